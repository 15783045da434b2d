"""Speculative decoding at real model shapes (random weights): decode tokens/s with and without
speculation, drafts accepted, and whether the output is bitwise the output without speculation.

Two workloads, each `--requests` requests at once through the batch scheduler, `--tokens` tokens each:
- "greedy": greedy decoding after a prompt that repeats a passage (random weights loop, so a prompt
  lookup finds what comes next: the case speculation is for);
- "sampled": temperature 1, where nothing repeats: the prompt lookup proposes nothing, and a draft
  model of other random weights (the preset's widths, 2 layers) proposes drafts that miss, the
  adaptive width's worst case.
Configurations run interleaved, `--repeats` times each; the median is reported.

    python bench/speculative.py [--preset qwen3-0.6b] [--requests 1 4] [--tokens 64] [--repeats 2]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from pocketllm import LLM, EngineArgs, SamplingParams, write_checkpoint
from pocketllm.machine import cpu_name
from pocketllm.models import cached_checkpoint

CONFIGS = {
    "plain": None,
    "ngram k=4": {"method": "ngram", "num_speculative_tokens": 4},
    "ngram k=8, lookup 2-4": {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 2,
                              "prompt_lookup_max": 4},
}


def prompts(vocab: int, requests: int, seed: int) -> list[list[int]]:
    """A 48-token passage, twice, then its first 8 tokens again: per request."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(requests):
        passage = torch.randint(0, vocab, (48,), generator=generator).tolist()
        out.append(passage * 2 + passage[:8])
    return out


def run(llm: LLM, batch: list[list[int]], params: SamplingParams) -> tuple[float, list, dict]:
    """(tokens/s of the run, outputs, the run's speculation counts)."""
    scheduler = llm.scheduler
    assert scheduler is not None
    before = scheduler.get_stats()
    start = time.perf_counter()
    results = llm.generate(batch, params)
    elapsed = time.perf_counter() - start
    after = scheduler.get_stats()
    counts = {name: getattr(after, name) - getattr(before, name)
              for name in ("spec_verifies", "spec_draft_tokens", "spec_accepted_tokens", "steps")}
    tokens = sum(len(r.token_ids) for r in results)
    return tokens / elapsed, [(r.token_ids, r.logprobs) for r in results], counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen3-0.6b")
    parser.add_argument("--requests", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    path = cached_checkpoint(args.preset, args.seed)
    draft = Path(tempfile.mkdtemp()) / "draft"
    write_checkpoint(draft, args.preset, seed=args.seed + 1, num_hidden_layers=2)
    configs = {**CONFIGS, "draft model (2 layers) k=4": {"model": str(draft), "num_speculative_tokens": 4}}
    engines = {name: LLM(EngineArgs(model=str(path), max_seq_len=512, speculative=spec,
                                    backend_options={"enable_batching": True, "background_thread": False}))
               for name, spec in configs.items()}
    vocab = engines["plain"].model_config.vocab_size
    workloads = {"greedy": SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True),
                 "sampled": SamplingParams(max_tokens=args.tokens, temperature=1.0, seed=1, ignore_eos=True)}
    print(f"{args.preset}, {cpu_name()}, torch threads {torch.get_num_threads()}")
    lines = ["| workload | requests | configuration | tokens/s | vs plain | drafted | accepted | steps | bits equal |",
             "|---|---|---|---|---|---|---|---|---|"]
    for workload, params in workloads.items():
        for requests in args.requests:
            batch = prompts(vocab, requests, args.seed)
            speeds: dict[str, list[float]] = {name: [] for name in engines}
            outputs, counts = {}, {}
            for _ in range(args.repeats):
                for name, llm in engines.items():
                    speed, outputs[name], counts[name] = run(llm, batch, params)
                    speeds[name].append(speed)
                    print(f"  {workload} x{requests} {name}: {speed:.2f} tokens/s {counts[name]}", flush=True)
            plain = statistics.median(speeds["plain"])
            for name in engines:
                median, c = statistics.median(speeds[name]), counts[name]
                lines.append(f"| {workload} | {requests} | {name} | {median:.2f} | {median / plain:.2f}x | "
                             f"{c['spec_draft_tokens']} | {c['spec_accepted_tokens']} | {c['steps']} | "
                             f"{'yes' if outputs[name] == outputs['plain'] else 'NO'} |")
    for llm in engines.values():
        llm.close()
    shutil.rmtree(draft.parent)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
