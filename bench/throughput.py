"""Throughput and latency of the batch scheduler vs the serial path (the seed's table).

Runs on the `small` preset (about 40M parameters) with the torch backend:
- latency: one request alone, serial path vs through the scheduler (goal: ratio <= 1.05);
- throughput: concurrency 1, 2, 4, 8 (max_batch_size = concurrency, 4 x concurrency requests
  submitted at once), tokens/s and the ratio to concurrency 1 (goals 1.7x, 3.0x, 4.5x);
- the cost of batch invariance: tokens/s with and without the row padding, batch 1 and 8.
Writes bench/results/throughput.json and throughput.md (or into --out).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from pocketllm import LLM, EngineArgs, SamplingParams, write_checkpoint

GOALS = {1: 1.05, 2: 1.7, 4: 3.0, 8: 4.5}


def engine(path: Path, max_batch_size: int, invariant: bool = True) -> LLM:
    options = {"enable_batching": True, "max_batch_size": max_batch_size, "batch_invariant": invariant}
    return LLM(EngineArgs(model=str(path), max_seq_len=512, backend_options=options))


def prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (count, length), generator=generator).tolist()


def timed_generate(llm: LLM, batch: list[list[int]], params: SamplingParams) -> tuple[float, int]:
    start = time.perf_counter()
    results = llm.generate(prompt_tokens=batch, sampling_params=params)
    elapsed = time.perf_counter() - start
    assert all(r.finish_reason == "length" for r in results), [r.error for r in results]
    return elapsed, sum(len(r.token_ids) for r in results)


def measure_latency(path: Path, args: argparse.Namespace, params: SamplingParams, vocab: int) -> dict:
    """Median wall time of one request alone: the serial path vs the scheduler, stepped by its
    background thread and stepped by the calling thread (background_thread=False)."""
    batch = prompts(1, args.prompt_len, vocab, seed=1)
    modes = {"serial": {"enable_batching": False},
             "batched_thread": {"enable_batching": True},
             "batched_caller": {"enable_batching": True, "background_thread": False}}
    times = {}
    for name, options in modes.items():
        with LLM(EngineArgs(model=str(path), max_seq_len=512, backend_options=options)) as llm:
            timed_generate(llm, batch, params)  # warm-up
            times[name] = statistics.median(timed_generate(llm, batch, params)[0] for _ in range(args.repeats))
    return {**{f"{k}_s": v for k, v in times.items()},
            "ratio_thread": times["batched_thread"] / times["serial"],
            "ratio_caller": times["batched_caller"] / times["serial"]}


def measure_throughput(path: Path, concurrency: int, args: argparse.Namespace, params: SamplingParams,
                       vocab: int, invariant: bool = True) -> float:
    """Generated tokens/s with `concurrency` slots and 4 x concurrency requests submitted at once."""
    batch = prompts(4 * concurrency, args.prompt_len, vocab, seed=concurrency)
    with engine(path, concurrency, invariant) as llm:
        timed_generate(llm, batch[:concurrency], params)  # warm-up
        runs = [timed_generate(llm, batch, params) for _ in range(args.repeats)]
    elapsed, tokens = min(runs)
    return tokens / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="small")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()

    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = write_checkpoint(Path(tmp) / args.preset, args.preset, seed=0)
        vocab = json.loads((path / "config.json").read_text())["vocab_size"]
        latency = measure_latency(path, args, params, vocab)
        throughput = {c: measure_throughput(path, c, args, params, vocab) for c in (1, 2, 4, 8)}
        no_padding = {c: measure_throughput(path, c, args, params, vocab, invariant=False) for c in (1, 8)}

    report = {
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "torch": torch.__version__, "threads": torch.get_num_threads()},
        "workload": {"preset": args.preset, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
                     "requests_per_run": "4 x concurrency", "repeats": args.repeats},
        "latency": latency,
        "throughput_tokens_per_s": throughput,
        "throughput_ratio": {c: throughput[c] / throughput[1] for c in throughput},
        "invariance_cost": {c: {"invariant": throughput[c], "not_invariant": no_padding[c],
                                "ratio": throughput[c] / no_padding[c]} for c in no_padding},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "throughput.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [
        f"Measured on {report['machine']['processor']}, {report['machine']['threads']} threads, "
        f"torch {report['machine']['torch']}, preset {args.preset}, prompt {args.prompt_len}, "
        f"{args.max_tokens} new tokens, greedy.",
        "",
        "| concurrency | tokens/s | measured | goal |",
        "|---|---|---|---|",
        f"| 1 (latency, batched via background thread / serial) | - | {latency['ratio_thread']:.2f}x | <= {GOALS[1]}x |",
        f"| 1 (latency, batched via caller-driven step() / serial) | - | {latency['ratio_caller']:.2f}x | <= {GOALS[1]}x |",
    ]
    lines += [f"| {c} | {throughput[c]:.1f} | {report['throughput_ratio'][c]:.2f}x | "
              f"{'>= ' + str(GOALS[c]) + 'x' if c > 1 else 'baseline'} |" for c in throughput]
    lines += ["", "| batch | tokens/s invariant | tokens/s without padding | cost |", "|---|---|---|---|"]
    lines += [f"| {c} | {v['invariant']:.1f} | {v['not_invariant']:.1f} | {v['ratio']:.2f}x |"
              for c, v in report["invariance_cost"].items()]
    (args.out / "throughput.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
