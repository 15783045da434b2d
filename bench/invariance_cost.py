"""What the invariance contract costs on this machine: the torch backend with
`batch_invariant` on (fixed 16-row GEMM tiles) against off (one GEMM call per batch).

Three points, each run with invariance on and off, alternately, best of `--repeats`:
- batch 1: one request decoding alone (serial mode), tokens/s;
- batch 8: a random-length workload (prompts 8-125, outputs 8-64 tokens) through the scheduler at
  max_batch_size 8, stepped on the calling thread, tokens/s;
- prefill: one prompt of 512 tokens and one new token, prompt tokens/s.
Random-weight checkpoints (nothing downloaded); greedy; every request generates all its tokens.

    python bench/invariance_cost.py [--preset small qwen3.5-small] [--out bench/results]
Writes invariance_cost.json and invariance_cost.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import tempfile
import time
from pathlib import Path

import torch

from pocketllm import LLM, EngineArgs, SamplingParams, write_checkpoint
from pocketllm.config import ModelConfig


def _engine(path: Path, invariant: bool, batching: bool) -> LLM:
    options = {"batch_invariant": invariant, "enable_batching": batching, "max_batch_size": 8,
               "background_thread": False}
    return LLM(EngineArgs(model=str(path), max_seq_len=640, backend_options=options))


def _timed(llm: LLM, prompts: list[list[int]], new_tokens: list[int]) -> tuple[float, int]:
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in new_tokens]
    started = time.perf_counter()
    results = llm.generate(prompt_tokens=prompts, sampling_params=params)
    elapsed = time.perf_counter() - started
    assert all(len(r.token_ids) == n for r, n in zip(results, new_tokens))
    return elapsed, sum(new_tokens)


def measure(path: Path, vocab: int, repeats: int, seed: int) -> dict[str, dict[str, float]]:
    rng = random.Random(seed)
    batch8 = ([[rng.randrange(vocab) for _ in range(rng.randint(8, 125))] for _ in range(32)],
              [rng.randint(8, 64) for _ in range(32)])
    points = {
        "batch 1 decode (tokens/s)": (False, [[rng.randrange(vocab) for _ in range(32)]], [64], "new"),
        "batch 8 random workload (tokens/s)": (True, *batch8, "new"),
        "prefill 512 tokens (prompt tokens/s)": (False, [[rng.randrange(vocab) for _ in range(512)]], [1], "prompt"),
    }
    out: dict[str, dict[str, float]] = {}
    for name, (batching, prompts, new_tokens, counted) in points.items():
        engines = {on: _engine(path, on, batching) for on in (True, False)}
        best = {True: 0.0, False: 0.0}
        for _ in range(repeats):
            for on, llm in engines.items():
                elapsed, generated = _timed(llm, prompts, new_tokens)
                tokens = generated if counted == "new" else sum(len(p) for p in prompts)
                best[on] = max(best[on], tokens / elapsed)
        for llm in engines.values():
            llm.close()
        out[name] = {"invariant": best[True], "plain": best[False], "ratio": best[True] / best[False]}
        print(f"  {name}: on {best[True]:.1f}, off {best[False]:.1f}, on/off {best[True] / best[False]:.3f}",
              flush=True)
    return out


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", nargs="+", default=["small", "qwen3.5-small"])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    report = {"cpu": _cpu(), "threads": torch.get_num_threads(), "torch": torch.__version__, "presets": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for preset in args.preset:
            print(f"{preset}:", flush=True)
            path = write_checkpoint(Path(tmp) / preset, preset, seed=args.seed)
            vocab = ModelConfig.from_dir(path).vocab_size
            report["presets"][preset] = measure(path, vocab, args.repeats, args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "invariance_cost.json").write_text(json.dumps(report, indent=2))
    lines = [f"Invariance on vs off, torch backend, fp32, {report['cpu']}, {report['threads']} threads, "
             f"torch {report['torch']}", "", "| preset | point | on | off | on/off |", "|---|---|---|---|---|"]
    for preset, points in report["presets"].items():
        lines += [f"| {preset} | {name} | {v['invariant']:.1f} | {v['plain']:.1f} | {v['ratio']:.2f}x |"
                  for name, v in points.items()]
    (args.out / "invariance_cost.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
