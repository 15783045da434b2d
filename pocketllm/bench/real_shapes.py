"""Real-shape benchmark (`pocketllm bench --real-shapes`): pocketllm against `transformers` at the
size of published checkpoints, where a small preset flatters.

Random weights in the exact shapes of Qwen3-0.6B and Qwen3.5-0.8B (written once into the
checkpoint cache, reused afterwards), float32, torch backend. Both engines run in one process on
the same checkpoint and the same prompts. Per model:

- batch-1 decode: one request (prompt 32) alone; TTFT, TPOT and decode tokens/s = 1 / TPOT, beside
  the memory-bandwidth limit: bytes of every matrix a token multiplies / the machine's streaming
  read bandwidth (a sum over a buffer far larger than the caches, measured in this run);
- batched: the seeded `random` workload (prompt 8..128, output 8..64), pocketllm's continuous
  batching at max_batch_size 8 against transformers' static batches of 8 (left-padded);
- prefill: TTFT of one 512-token prompt, as prompt tokens/s.

pocketllm runs in each of CONFIGS: the default, per-row decode (the latency configuration), exact
positions on (decoded and prefilled positions bitwise equal) and batch invariance off, so the cost
of each promise is stated at each point. `--quick` runs the tiny
presets with small counts (a smoke test of the whole pipeline); the numbers that matter come from
the full run.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..config import EngineArgs
from ..llm import LLM
from ..models import cached_checkpoint
from ..sampling import SamplingParams
from .baseline import load_transformers, run_transformers, timed_generate
from .report import load_average, machine_info, save_report
from .runners import run_batched
from .workloads import make_workloads

GOALS = {"decode_1": 1.2, "batched_8": 1.5, "prefill": 1.0}  # pocketllm / transformers
BANDWIDTH_GOAL = 0.8  # batch-1 decode / memory-bandwidth limit


@dataclass(frozen=True)
class Size:
    """How much one run measures."""

    presets: tuple[str, ...]
    decode_tokens: int
    prefill_tokens: int
    batched_requests: int


SIZES = {"full": Size(("qwen3-0.6b", "qwen3.5-0.8b"), 32, 512, 16),
         "quick": Size(("tiny", "qwen3.5-tiny"), 8, 64, 8)}
BATCH = 8
PROMPT = 32  # batch-1 decode prompt
MAX_SEQ_LEN = 640


@dataclass(frozen=True)
class Point:
    """One engine's numbers on one model: decode alone, batched, prefill."""

    engine: str  # "transformers" or a key of CONFIGS
    decode_ttft_s: float
    decode_tpot_s: float
    batched_tokens_per_s: float
    prefill_s: float


def read_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """Bytes/s of a streaming read (a sum) over `gib` GiB, best of `repeats`: the ceiling any
    kernel that reads every weight once per token works under."""
    buffer = torch.ones(int(gib * 2**30) // 4)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - start)
    return buffer.numel() * 4 / best


def token_bytes(llm: LLM) -> int:
    """Bytes of the matrices every generated token multiplies (lm_head included)."""
    return sum(w.numel() * w.element_size() for w in llm.model.linear_weights())


def _prompt(rng: np.random.Generator, vocab: int, length: int) -> list[int]:
    return rng.integers(0, vocab, length).tolist()


# pocketllm's configurations, each measured at every point: the default, the decode strategy for
# lone requests (see linear_per_row), exact positions (see backends._torch), and the contract
# switched off (one plain GEMM per batch).
CONFIGS: dict[str, dict[str, Any]] = {"pocketllm": {},
                                      "pocketllm (per-row decode)": {"decode_per_row": True, "exact_positions": False},
                                      "pocketllm (exact positions)": {"exact_positions": True},
                                      "pocketllm (invariance off)": {"batch_invariant": False}}


def _pocketllm_alone(path: Path, decode_prompt: list[int], prefill_prompt: list[int], size: Size,
                     options: dict[str, Any]) -> tuple[float, float, float]:
    """(decode TTFT, decode TPOT, prefill TTFT) of one request at a time on the serial path."""
    args = EngineArgs(model=str(path), max_seq_len=MAX_SEQ_LEN, backend_options={"enable_batching": False, **options})
    with LLM(args) as llm:
        llm.generate([decode_prompt[:8]], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
        decoded = llm.generate([decode_prompt], SamplingParams(max_tokens=size.decode_tokens, temperature=0.0,
                                                               ignore_eos=True))[0]
        prefilled = llm.generate([prefill_prompt], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))[0]
    assert decoded.ttft_s is not None and decoded.total_time_s is not None and prefilled.ttft_s is not None
    tpot = (decoded.total_time_s - decoded.ttft_s) / (size.decode_tokens - 1)
    return decoded.ttft_s, tpot, prefilled.ttft_s


def measure_model(preset: str, size: Size, seed: int, with_transformers: bool,
                  configs: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """Every point of one model, for transformers and each of pocketllm's `configs` (CONFIGS)."""
    path = cached_checkpoint(preset, seed)
    rng = np.random.default_rng(seed)
    with LLM(EngineArgs(model=str(path), max_seq_len=MAX_SEQ_LEN, backend_options={"enable_batching": False,
                                                                                    "invariance_probe": False})) as llm:
        vocab, weights = llm.model_config.vocab_size, token_bytes(llm)
        params = sum(t.numel() for t in llm.model.linear_weights())
    decode_prompt, prefill_prompt = _prompt(rng, vocab, PROMPT), _prompt(rng, vocab, size.prefill_tokens)
    workload = next(w for w in make_workloads(size.batched_requests, vocab, seed) if w.name == "random")
    points = []
    if with_transformers:
        model = load_transformers(path)
        ttft, total = timed_generate(model, decode_prompt, size.decode_tokens)
        prefill, _ = timed_generate(model, prefill_prompt, 1)
        static = run_transformers(model, workload, BATCH)
        points.append(Point("transformers", ttft, (total - ttft) / (size.decode_tokens - 1), static.tokens_per_s,
                            prefill))
        del model
    for name, options in (CONFIGS if configs is None else configs).items():
        print(f"{preset}: {name}", flush=True)
        ttft, tpot, prefill = _pocketllm_alone(path, decode_prompt, prefill_prompt, size, options)
        batched = run_batched(path, workload, BATCH, **options)
        points.append(Point(name, ttft, tpot, batched.tokens_per_s, prefill))
    return {"preset": preset, "matrix_parameters": params, "bytes_per_token": weights,
            "prefill_tokens": size.prefill_tokens, "points": [asdict(p) for p in points]}


def verdicts(model: dict[str, Any], bandwidth: float) -> dict[str, Any]:
    """Per point: each engine's tokens/s, pocketllm's ratios to transformers against the goals;
    the batch-1 decode of each configuration as a fraction of the memory-bandwidth limit."""
    by_engine = {p["engine"]: p for p in model["points"]}
    ours = [name for name in by_engine if name != "transformers"]
    limit = bandwidth / model["bytes_per_token"]
    rates = {"decode_1": lambda p: 1 / p["decode_tpot_s"], "batched_8": lambda p: p["batched_tokens_per_s"],
             "prefill": lambda p: model["prefill_tokens"] / p["prefill_s"]}
    out: dict[str, Any] = {"bandwidth_limit_tokens_per_s": limit,
                           "decode_1_of_limit": {name: rates["decode_1"](by_engine[name]) / limit for name in ours}}
    theirs = by_engine.get("transformers")
    for point, rate in rates.items():
        row: dict[str, Any] = {"goal": GOALS[point], "tokens_per_s": {e: rate(p) for e, p in by_engine.items()}}
        if theirs is not None:
            row["ratio"] = {name: rate(by_engine[name]) / rate(theirs) for name in ours}
            row["met_by"] = [name for name, ratio in row["ratio"].items() if ratio >= GOALS[point]]
        out[point] = row
    return out


def markdown(report: dict[str, Any]) -> str:
    m = report["machine"]
    lines = ["# pocketllm at real model shapes", "",
             f"Measured on {m['processor']} ({m['cpu_count']} CPUs, {m['torch_threads']} torch threads), torch "
             f"{m['torch']}, transformers {m['transformers'] or 'not installed'}; float32, torch backend, random "
             f"weights in the checkpoints' exact shapes; load average {m['load_average_1min_at_start']:.2f} at start. "
             f"Streaming read bandwidth: {report['read_bandwidth_gb_s']:.1f} GB/s. Tokens/s, and in brackets "
             f"the ratio to transformers.", ""]
    names = {"decode_1": "batch-1 decode", "batched_8": f"continuous batching {BATCH} (`random`)",
             "prefill": f"prefill ({report['size']['prefill_tokens']}-token prompt)"}
    engines = [p["engine"] for p in report["models"][0]["points"]]  # transformers first, when measured
    for model in report["models"]:
        v = model["verdicts"]
        lines += [f"## `{model['preset']}` ({model['matrix_parameters'] / 1e6:.1f}M matrix parameters, "
                  f"{model['bytes_per_token'] / 2**20:.1f} MiB read per token)", "",
                  "| | " + " | ".join(engines) + " | goal | met by |", "|---" * (len(engines) + 3) + "|"]
        for key, label in names.items():
            row = v[key]
            cells = [f"{row['tokens_per_s'][e]:.2f}" + (f" ({row['ratio'][e]:.2f}x)" if e in row.get("ratio", {})
                                                         else "") for e in engines]
            met = ", ".join(row["met_by"]) or "none" if "met_by" in row else "-"
            lines.append(f"| {label} | " + " | ".join(cells) + f" | >= {row['goal']}x | {met} |")
        limit = v["bandwidth_limit_tokens_per_s"]
        shares = ", ".join(f"{name} {100 * share:.0f}%" for name, share in v["decode_1_of_limit"].items())
        lines += ["", f"Memory-bandwidth limit for batch-1 decode: {limit:.2f} tokens/s. Reached: {shares} "
                      f"(goal {100 * BANDWIDTH_GOAL:.0f}%).", ""]
    return "\n".join(lines)


def run(out: Path, quick: bool, seed: int, with_transformers: bool, plots: bool) -> str:
    """Measure every model of the size, write real_shapes.json/.md (and .png); return the Markdown."""
    size = SIZES["quick" if quick else "full"]
    machine = machine_info()
    bandwidth = read_bandwidth(0.25 if quick else 1.0)
    models = []
    for preset in size.presets:
        model = measure_model(preset, size, seed, with_transformers)
        model["verdicts"] = verdicts(model, bandwidth)
        models.append(model)
    machine["load_average_1min_at_end"] = load_average()
    report = {"machine": machine, "read_bandwidth_gb_s": bandwidth / 1e9, "size": asdict(size), "seed": seed,
              "models": models}
    text = markdown(report)
    save_report(out, "real_shapes", report, text)
    if plots:
        from .plots import plot_real_shapes

        plot_real_shapes(models).savefig(out / "real_shapes.png", dpi=120)
    return text
