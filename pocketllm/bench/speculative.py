"""Speculative decoding benchmark (`pocketllm bench --speculative`): decode tokens/s with each method
against the same engine without speculation, at real model shapes (random weights), with the drafts
accepted and whether the output is bitwise the output without speculation, row by row.

Two workloads, at batch 1 and in continuous batches of 8 (8 requests at once on 8 slots):
- lookup: greedy decoding after a prompt that repeats a 48-token passage (random-weight greedy
  continuations fall into cycles too, which a prompt lookup catches): the case speculation is for;
- random: random prompts, temperature 1: nothing repeats, a draft model of other random weights
  misses, the adaptive width's worst case.
Methods: ngram k=4 (vLLM's lookup defaults), ngram k=8 (lookup 2..4), a draft model (the preset's
widths, attention-only for a hybrid, 2 layers, other random weights) k=4, and the oracle (drafts
taken from the run without speculation, k=8): the ceiling, how many verified positions a step can
afford. One engine at a time (memory), each run once; writes speculative.json and speculative.md.
`--quick` runs the tiny presets with few tokens: a smoke test, its timings mean little.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..config import EngineArgs
from ..llm import LLM
from ..models import cached_checkpoint, write_checkpoint
from ..models.registry import read_config
from ..sampling import SamplingParams
from ..testing.drafters import OracleDrafter
from .report import load_average, machine_info, save_report


@dataclass(frozen=True)
class Size:
    presets: tuple[str, ...]
    tokens: int
    batches: tuple[int, ...]


SIZES = {"full": Size(("qwen3-0.6b", "qwen3.5-0.8b"), 48, (1, 8)), "quick": Size(("tiny", "qwen3.5-tiny"), 8, (1, 2))}
PASSAGE = 48
# A hybrid model's draft: the attention-only preset of its size (draft models hold no recurrent states).
DRAFT_PRESETS = {"qwen3.5-0.8b": "qwen3-0.6b", "qwen3.5-tiny": "tiny", "qwen3.5-moe-small": "qwen3-moe-small"}


def methods(draft: Path, oracle: OracleDrafter) -> dict[str, dict[str, Any] | None]:
    return {"none": None,
            "ngram k=4": {"method": "ngram", "num_speculative_tokens": 4},
            "ngram k=8, lookup 2-4": {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 2,
                                      "prompt_lookup_max": 4},
            "draft model (2 layers) k=4": {"model": str(draft), "num_speculative_tokens": 4},
            "oracle k=8": {"method": "custom", "drafter": oracle, "num_speculative_tokens": 8}}


def workloads(vocab: int, batch: int, tokens: int, seed: int) -> dict[str, tuple[list[list[int]], SamplingParams]]:
    generator = torch.Generator().manual_seed(seed)
    passages = [torch.randint(0, vocab, (PASSAGE,), generator=generator).tolist() for _ in range(batch)]
    lookup = [p * 2 + p[:8] for p in passages]
    random_prompts = [torch.randint(0, vocab, (2 * PASSAGE,), generator=generator).tolist() for _ in range(batch)]
    return {"lookup": (lookup, SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)),
            "random": (random_prompts, SamplingParams(max_tokens=tokens, temperature=1.0, seed=seed, ignore_eos=True))}


def _run(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> dict[str, Any]:
    scheduler = llm.scheduler
    assert scheduler is not None
    before = scheduler.get_stats()
    start = time.perf_counter()
    results = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    after = scheduler.get_stats()
    counts = {name: getattr(after, name) - getattr(before, name)
              for name in ("spec_verifies", "spec_draft_tokens", "spec_accepted_tokens", "steps")}
    tokens = sum(len(r.token_ids) for r in results)
    return {"tokens_per_s": tokens / elapsed, **counts, "outputs": [(r.token_ids, r.logprobs) for r in results]}


def measure_model(preset: str, size: Size, seed: int) -> dict[str, Any]:
    """Every method on every workload and batch of `preset`, the runs without speculation first."""
    path = cached_checkpoint(preset, seed)
    oracle = OracleDrafter()
    rows: list[dict[str, Any]] = []
    plain: dict[tuple[str, int], dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        draft = write_checkpoint(Path(tmp) / "draft", DRAFT_PRESETS.get(preset, preset), seed=seed + 1,
                                 num_hidden_layers=2, vocab_size=read_config(path).vocab_size)
        for method, spec in methods(draft, oracle).items():
            with LLM(EngineArgs(model=str(path), max_seq_len=4 * PASSAGE + size.tokens + 8, speculative=spec,
                                backend_options={"enable_batching": True, "background_thread": False,
                                                 "max_batch_size": max(size.batches)})) as llm:
                vocab = llm.model_config.vocab_size
                for batch in size.batches:
                    for name, (prompts, params) in workloads(vocab, batch, size.tokens, seed).items():
                        run = _run(llm, prompts, params)
                        outputs = run.pop("outputs")
                        if spec is None:
                            plain[(name, batch)] = {**run, "outputs": outputs}
                            for prompt, (tokens, _) in zip(prompts, outputs):
                                oracle.learn(prompt, tokens)
                        base = plain[(name, batch)]
                        row = {"method": method, "workload": name, "batch": batch, **run,
                               "vs_none": run["tokens_per_s"] / base["tokens_per_s"],
                               "bits_equal": outputs == base["outputs"]}
                        rows.append(row)
                        print(f"  {preset} {name} x{batch} {method}: {run['tokens_per_s']:.2f} tokens/s, "
                              f"{row['vs_none']:.2f}x, accepted {run['spec_accepted_tokens']}/"
                              f"{run['spec_draft_tokens']}, bits equal: {row['bits_equal']}", flush=True)
    return {"preset": preset, "rows": rows}


def markdown(report: dict[str, Any]) -> str:
    machine = report["machine"]
    lines = [f"# Speculative decoding ({machine['processor']}, {machine['cpu_count']} CPUs, torch {machine['torch']})",
             "", f"{report['size']['tokens']} tokens per request; batch 8: 8 requests at once on 8 slots.", "",
             "| model | workload | batch | method | tokens/s | vs none | drafted | accepted | mean accepted length "
             "| steps | bits equal |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for model in report["models"]:
        for r in model["rows"]:
            length = 1 + r["spec_accepted_tokens"] / r["spec_verifies"] if r["spec_verifies"] else 0.0
            lines.append(f"| {model['preset']} | {r['workload']} | {r['batch']} | {r['method']} | "
                         f"{r['tokens_per_s']:.2f} | {r['vs_none']:.2f}x | {r['spec_draft_tokens']} | "
                         f"{r['spec_accepted_tokens']} | {length:.2f} | {r['steps']} | "
                         f"{'yes' if r['bits_equal'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def run(out: Path, quick: bool, seed: int, presets: tuple[str, ...] | None = None) -> str:
    """Measure each preset (the size's, or `presets`) and write the report; returns its table."""
    size = SIZES["quick" if quick else "full"]
    models = [measure_model(preset, size, seed) for preset in (presets or size.presets)]
    machine = machine_info()
    machine["load_average_1min_at_end"] = load_average()
    report = {"machine": machine, "size": {"presets": list(presets or size.presets), "tokens": size.tokens,
                                           "batches": list(size.batches)}, "seed": seed, "models": models}
    text = markdown(report)
    save_report(out, "speculative", report, text)
    return text
