"""Throughput and latency benchmark (`pocketllm bench`, `bench/throughput.py`).

Why it exists: to show, with measured numbers, what continuous batching buys over the serial
path and over `transformers` generate, and whether the seed's goals are met on this machine.

Three seeded workloads (fixed, uniform random and heavy-tailed lengths) run on a random-weight
checkpoint written into a temporary directory (nothing is downloaded): serially, then batched at
each max_batch_size with every request submitted at once; `transformers` generate on the same
checkpoint runs them one at a time and in static, left-padded batches. Every request is greedy
and generates exactly its planned number of tokens (ignore_eos; min_new_tokens in transformers).

All requests of a run arrive together, so TTFT counts from that moment (queueing included);
TPOT = (total time - TTFT) / (tokens - 1) per request, averaged. A static batch hands its results
back when its longest request is done, so that is every request's total time there, and only the
tokens each request asked for count towards tokens/s. Each run is measured once after a warm-up.

Writes throughput.json, throughput.md, throughput_vs_concurrency.png, ttft_distribution.png and
slot_timeline.png into --out.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.metadata
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from tqdm import tqdm

from .config import EngineArgs, ModelConfig
from .llm import LLM
from .models import PRESETS, write_checkpoint
from .outputs import GenerationResult
from .sampling import SamplingParams
from .scheduler import SlotEvent, plot_timeline
from .scheduler.stats import percentile

MAX_SEQ_LEN = 512  # longest prompt (256) + longest output (128) of any workload fits
PAD_ID = 0  # transformers static batches: left padding, masked out
LATENCY_GOAL = 1.05  # single request: batched / serial wall time
CONCURRENCY_GOALS = {2: 1.7, 4: 3.0, 8: 4.5}  # fixed workload: tokens/s at max_batch_size c / at 1
TRANSFORMERS_GOAL = 1.5  # random workload: continuous batching / transformers static batching
VS_TRANSFORMERS_BATCH = 8
TIMELINE_BATCH = 4
LATENCY_MODES = {"serial": {"enable_batching": False},
                 "batched_thread": {"enable_batching": True},
                 "batched_caller": {"enable_batching": True, "background_thread": False}}


@dataclass(frozen=True)
class Scale:
    """How big a benchmark run is: the default one or --quick."""

    preset: str
    concurrencies: tuple[int, ...]
    requests: int  # per workload
    latency_repeats: int


SCALES = {"full": Scale("small", (1, 2, 4, 8, 16), 32, 5), "quick": Scale("tiny", (1, 2, 4), 8, 3)}


@dataclass(frozen=True)
class Workload:
    """Prompts and how many tokens each request generates."""

    name: str
    prompts: list[list[int]]
    output_lens: list[int]

    def params(self) -> list[SamplingParams]:
        """Greedy, ignoring EOS, so each request generates exactly its planned tokens."""
        return [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in self.output_lens]

    def summary(self) -> dict[str, Any]:
        return {"requests": len(self.prompts), "prompt_lens": [len(p) for p in self.prompts],
                "output_lens": list(self.output_lens)}


@dataclass
class Run:
    """One measured run: which engine and mode, and what it achieved."""

    workload: str
    engine: str  # "pocketllm" or "transformers"
    mode: str  # "serial", "batched" (continuous batching) or "static" (transformers batches)
    batch_size: int  # max_batch_size, static batch size, or 1 for serial
    requests: int
    output_tokens: int
    wall_s: float
    tokens_per_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    tpot_mean_s: float
    ttft_s: list[float]


# (TTFT, total time, generated tokens) of one request, in seconds from the run's start.
Sample = tuple[float, float, int]


# -- workloads ---------------------------------------------------------------------------------

def make_workloads(count: int, vocab_size: int, seed: int) -> list[Workload]:
    """`fixed` (prompt 32, 32 new tokens), `random` (prompt 8..128, output 8..64, uniform, as in
    nano-vllm's bench) and `heavy_tail` (lognormal: mostly short, a few long), all seeded."""
    rng = np.random.default_rng(seed)
    lengths = {
        "fixed": (np.full(count, 32), np.full(count, 32)),
        "random": (rng.integers(8, 129, count), rng.integers(8, 65, count)),
        "heavy_tail": (_lognormal(rng, count, median=16, high=256), _lognormal(rng, count, median=12, high=128)),
    }
    return [Workload(name, [rng.integers(0, vocab_size, int(n)).tolist() for n in prompt_lens],
                     [int(n) for n in output_lens])
            for name, (prompt_lens, output_lens) in lengths.items()]


def _lognormal(rng: np.random.Generator, count: int, median: int, high: int) -> np.ndarray:
    """Lengths with a heavy right tail (sigma 1: about 8% are over 4x the median), in [4, high]."""
    return np.clip(np.rint(rng.lognormal(np.log(median), 1.0, count)), 4, high).astype(int)


# -- pocketllm runs ----------------------------------------------------------------------------

def _engine(path: Path, **options: Any) -> LLM:
    return LLM(EngineArgs(model=str(path), max_seq_len=MAX_SEQ_LEN, backend_options=options))


def _warm_up(llm: LLM, count: int) -> None:
    """A few short requests first, so one-off costs (allocation, first kernels) are not timed."""
    llm.generate([[1] * 16] * count, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))


def _check(results: list[GenerationResult], workload: Workload) -> None:
    """A run counts only if every request generated exactly its planned tokens."""
    for result, planned in zip(results, workload.output_lens):
        if result.finish_reason != "length" or len(result.token_ids) != planned:
            raise RuntimeError(f"{workload.name}: request {result.request_id} ended {result.finish_reason!r} with "
                               f"{len(result.token_ids)}/{planned} tokens ({result.error})")


def summarize(workload: Workload, engine: str, mode: str, batch_size: int, wall_s: float,
              samples: list[Sample]) -> Run:
    """Tokens/s over the wall time; TTFT percentiles and mean TPOT over the requests."""
    ttfts = [ttft for ttft, _, _ in samples]
    tokens = sum(n for _, _, n in samples)
    tpots = [(total - ttft) / (n - 1) for ttft, total, n in samples if n > 1]
    return Run(workload.name, engine, mode, batch_size, len(samples), tokens, wall_s, tokens / wall_s,
               percentile(ttfts, 50), percentile(ttfts, 99), statistics.fmean(tpots) if tpots else 0.0, ttfts)


def run_serial(path: Path, workload: Workload) -> Run:
    """The serial path, one request after another; each waited since the run started."""
    with _engine(path, enable_batching=False) as llm:
        _warm_up(llm, 1)
        results, samples = [], []
        start = time.perf_counter()
        for prompt, params in zip(workload.prompts, workload.params()):
            queued = time.perf_counter() - start
            result = llm.generate(prompt, params)
            results.append(result)
            samples.append((queued + result.ttft_s, queued + result.total_time_s, len(result.token_ids)))
        wall = time.perf_counter() - start
    _check(results, workload)
    return summarize(workload, "pocketllm", "serial", 1, wall, samples)


def run_batched(path: Path, workload: Workload, max_batch_size: int, timeline: list[SlotEvent] | None = None) -> Run:
    """Continuous batching, every request submitted at once. With a `timeline` list, the run
    records its slot timeline and appends the measured requests' events (time 0 = first event)."""
    with _engine(path, enable_batching=True, max_batch_size=max_batch_size,
                 record_timeline=timeline is not None) as llm:
        _warm_up(llm, max_batch_size)
        start = time.perf_counter()
        results = llm.generate(workload.prompts, workload.params())
        wall = time.perf_counter() - start
        events = llm.scheduler.timeline
    _check(results, workload)
    if timeline is not None:
        timeline += _measured_events(events, {r.request_id for r in results})
    samples = [(r.ttft_s, r.total_time_s, len(r.token_ids)) for r in results]
    return summarize(workload, "pocketllm", "batched", max_batch_size, wall, samples)


def _measured_events(events: list[SlotEvent], request_ids: set[int]) -> list[SlotEvent]:
    """The events of the measured requests (not the warm-up's), shifted to start at 0."""
    kept = [e for e in events if e.request_id in request_ids]
    origin = min((e.start_s for e in kept), default=0.0)
    return [dataclasses.replace(e, start_s=e.start_s - origin, end_s=e.end_s - origin) for e in kept]


def measure_latency(path: Path, workload: Workload, repeats: int, options: dict[str, Any]) -> float:
    """Median wall time of the workload's first request alone on an engine built with `options`."""
    prompt, params = workload.prompts[0], workload.params()[0]
    with _engine(path, **options) as llm:
        _warm_up(llm, 1)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            _check([llm.generate(prompt, params)], workload)
            times.append(time.perf_counter() - start)
    return statistics.median(times)


# -- transformers baselines --------------------------------------------------------------------

def load_transformers(path: Path) -> Any:
    """The same checkpoint as a transformers model (float32, eval), warmed up; None when
    transformers is not installed."""
    try:
        import transformers
    except ImportError:
        return None
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    _static_batch(model, [[1] * 16, [1] * 8], 4)
    return model


class _FirstTokenClock:
    """A generate() streamer noting when the first new tokens arrive (its first put() is the prompt)."""

    def __init__(self) -> None:
        self.puts = 0
        self.first_token_time = 0.0

    def put(self, value: torch.Tensor) -> None:
        self.puts += 1
        if self.puts == 2:
            self.first_token_time = time.perf_counter()

    def end(self) -> None:
        pass


def _static_batch(model: Any, prompts: list[list[int]], new_tokens: int) -> float:
    """One left-padded greedy batch, `new_tokens` for every row; returns when its first tokens came."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[PAD_ID] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    clock = _FirstTokenClock()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=PAD_ID, streamer=clock)
    if out.shape[1] != width + new_tokens:
        raise RuntimeError(f"transformers generated {out.shape[1] - width} tokens, planned {new_tokens}")
    return clock.first_token_time


def run_transformers(model: Any, workload: Workload, batch_size: int) -> Run:
    """Static batching in submission order (batch 1: one request at a time). A batch runs until its
    longest request is done; only the tokens each request asked for are counted."""
    samples: list[Sample] = []
    start = time.perf_counter()
    for i in range(0, len(workload.prompts), batch_size):
        lens = workload.output_lens[i:i + batch_size]
        first = _static_batch(model, workload.prompts[i:i + batch_size], max(lens)) - start
        done = time.perf_counter() - start
        samples += [(first, done, n) for n in lens]
    wall = time.perf_counter() - start
    return summarize(workload, "transformers", "static", batch_size, wall, samples)


def static_efficiency(workload: Workload, batch_size: int) -> float:
    """Useful tokens / tokens a static batching of the workload generates (it pads to the longest)."""
    lens = workload.output_lens
    computed = sum(max(lens[i:i + batch_size]) * len(lens[i:i + batch_size]) for i in range(0, len(lens), batch_size))
    return sum(lens) / computed


# -- the benchmark -----------------------------------------------------------------------------

def plan_runs(path: Path, workloads: list[Workload], concurrencies: tuple[int, ...], hf_model: Any,
              timeline: list[SlotEvent]) -> list[tuple[str, Callable[[], Run]]]:
    """Every run, labelled for the progress bar; the timeline is recorded on `random` at TIMELINE_BATCH."""
    plan = []
    for w in workloads:
        plan.append((f"{w.name} serial", functools.partial(run_serial, path, w)))
        for c in concurrencies:
            recorded = timeline if (w.name, c) == ("random", TIMELINE_BATCH) else None
            plan.append((f"{w.name} batched {c}", functools.partial(run_batched, path, w, c, recorded)))
        if hf_model is not None:
            plan += [(f"{w.name} transformers {b}", functools.partial(run_transformers, hf_model, w, b))
                     for b in concurrencies]
    return plan


def run_all(path: Path, scale: Scale, workloads: list[Workload], hf_model: Any,
            timeline: list[SlotEvent]) -> tuple[dict[str, float], list[Run]]:
    """Single-request latency in each mode, then every planned run, under one progress bar."""
    plan = plan_runs(path, workloads, scale.concurrencies, hf_model, timeline)
    fixed = workloads[0]
    latency, runs = {}, []
    with tqdm(total=len(LATENCY_MODES) + len(plan), desc="bench", unit="run") as bar:
        for mode, options in LATENCY_MODES.items():
            bar.set_postfix_str(f"latency {mode}")
            latency[f"{mode}_s"] = measure_latency(path, fixed, scale.latency_repeats, options)
            bar.update()
        for label, measure in plan:
            bar.set_postfix_str(label)
            runs.append(measure())
            bar.update()
    return latency, runs


def find(runs: list[Run], workload: str, engine: str, mode: str, batch_size: int) -> Run | None:
    return next((r for r in runs if (r.workload, r.engine, r.mode, r.batch_size) == (workload, engine, mode,
                                                                                     batch_size)), None)


def seed_table(latency: dict[str, float], runs: list[Run]) -> dict[str, Any]:
    """The seed's goals on the fixed workload: single-request latency ratios, throughput ratios."""
    base = find(runs, "fixed", "pocketllm", "batched", 1)
    throughput = {}
    for c, goal in CONCURRENCY_GOALS.items():
        run = find(runs, "fixed", "pocketllm", "batched", c)  # None: not run (--quick)
        throughput[c] = {"tokens_per_s": None if run is None else run.tokens_per_s, "goal": goal,
                         "ratio": None if run is None else run.tokens_per_s / base.tokens_per_s}
    return {"latency_goal": LATENCY_GOAL,
            "latency_ratio_thread": latency["batched_thread_s"] / latency["serial_s"],
            "latency_ratio_caller": latency["batched_caller_s"] / latency["serial_s"],
            "throughput_baseline_tokens_per_s": base.tokens_per_s, "throughput": throughput}


def vs_transformers(runs: list[Run], workloads: list[Workload],
                    concurrencies: tuple[int, ...]) -> dict[str, Any] | None:
    """Continuous vs static batching on `random`, at batch 8 (or the largest run below it)."""
    batch = max(c for c in concurrencies if c <= VS_TRANSFORMERS_BATCH)
    ours = find(runs, "random", "pocketllm", "batched", batch)
    theirs = find(runs, "random", "transformers", "static", batch)
    if theirs is None:
        return None
    random_workload = next(w for w in workloads if w.name == "random")
    return {"workload": "random", "batch_size": batch, "pocketllm_tokens_per_s": ours.tokens_per_s,
            "transformers_tokens_per_s": theirs.tokens_per_s, "ratio": ours.tokens_per_s / theirs.tokens_per_s,
            "goal": TRANSFORMERS_GOAL, "goal_batch_size": VS_TRANSFORMERS_BATCH,
            "static_useful_token_fraction": static_efficiency(random_workload, batch)}


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on."""
    try:
        hf_version = importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        hf_version = None
    return {"platform": platform.platform(), "processor": _cpu_name(), "cpu_count": os.cpu_count(),
            "python": platform.python_version(), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "transformers": hf_version, "load_average_1min_at_start": load_average()}


def _cpu_name() -> str:
    """The CPU model (platform.processor() is empty on most Linux systems)."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def load_average() -> float | None:
    """The 1-minute load average: other work on the machine slows a run down."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


# -- output ------------------------------------------------------------------------------------

def _ratio_row(label: str, tokens_per_s: float | None, ratio: float | None, goal: str, met: bool | None) -> str:
    if ratio is None:
        return f"| {label} | - | not run (--quick) | {goal} | - |"
    tps = "-" if tokens_per_s is None else f"{tokens_per_s:.1f}"
    return f"| {label} | {tps} | {ratio:.2f}x | {goal} | {'yes' if met else 'no'} |"


def seed_table_md(table: dict[str, Any]) -> list[str]:
    goal = table["latency_goal"]
    lines = ["## The seed's table (`fixed` workload: prompt 32, 32 new tokens)", "",
             "| | tokens/s | measured | goal | met |", "|---|---|---|---|---|"]
    for key, how in (("latency_ratio_thread", "background thread"), ("latency_ratio_caller", "caller-driven step()")):
        ratio = table[key]
        lines.append(_ratio_row(f"single-request latency, batched ({how}) / serial", None, ratio, f"<= {goal}x",
                                ratio <= goal))
    lines.append(f"| concurrency 1 (max_batch_size 1) | {table['throughput_baseline_tokens_per_s']:.1f} | 1.00x | "
                 f"baseline | - |")
    for c, row in table["throughput"].items():
        met = row["ratio"] is not None and row["ratio"] >= row["goal"]
        lines.append(_ratio_row(f"concurrency {c} / 1", row["tokens_per_s"], row["ratio"], f">= {row['goal']}x", met))
    return lines


def vs_transformers_md(vs: dict[str, Any] | None) -> list[str]:
    lines = ["## Continuous batching vs transformers static batching (`random` workload)", ""]
    if vs is None:
        return lines + ["Not measured: transformers is not installed, or --no-transformers."]
    note = "" if vs["batch_size"] == vs["goal_batch_size"] else f" (goal set for batch {vs['goal_batch_size']})"
    return lines + [
        "| batch | pocketllm tokens/s | transformers tokens/s | ratio | goal | met | "
        "static batching: useful / generated tokens |",
        "|---|---|---|---|---|---|---|",
        f"| {vs['batch_size']} | {vs['pocketllm_tokens_per_s']:.1f} | {vs['transformers_tokens_per_s']:.1f} | "
        f"{vs['ratio']:.2f}x | >= {vs['goal']}x{note} | {'yes' if vs['ratio'] >= vs['goal'] else 'no'} | "
        f"{vs['static_useful_token_fraction']:.2f} |"]


def _lengths(values: list[int]) -> str:
    return f"{min(values)}..{max(values)} (mean {statistics.fmean(values):.1f})"


def workload_md(workload: Workload, runs: list[Run]) -> list[str]:
    lens = workload.summary()
    lines = [f"## Workload `{workload.name}`: {lens['requests']} requests, prompt {_lengths(lens['prompt_lens'])}, "
             f"output {_lengths(lens['output_lens'])} tokens", "",
             "| engine | mode | batch | wall s | output tokens | tokens/s | TTFT p50 ms | TTFT p99 ms | TPOT mean ms |",
             "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r.engine} | {r.mode} | {r.batch_size} | {r.wall_s:.2f} | {r.output_tokens} | {r.tokens_per_s:.1f} | "
              f"{1000 * r.ttft_p50_s:.0f} | {1000 * r.ttft_p99_s:.0f} | {1000 * r.tpot_mean_s:.1f} |"
              for r in runs if r.workload == workload.name]
    return lines


def markdown(report: dict[str, Any], workloads: list[Workload], runs: list[Run]) -> str:
    m, cfg = report["machine"], report["config"]
    load = "/".join("n/a" if v is None else f"{v:.2f}"
                    for v in (m["load_average_1min_at_start"], m["load_average_1min_at_end"]))
    header = [
        "# pocketllm throughput benchmark", "",
        f"Measured on {m['processor']} ({m['cpu_count']} CPUs, {m['torch_threads']} torch threads), {m['platform']}, "
        f"torch {m['torch']}, transformers {m['transformers'] or 'not installed'}; 1-minute load average {load} at "
        f"start/end (other work on the machine slows runs down). Preset `{cfg['preset']}` (random weights), seed "
        f"{cfg['seed']}, float32, torch backend. Greedy, EOS ignored: every request generates its planned tokens. All "
        f"requests of a run arrive at once: TTFT counts from then (queueing included); TPOT = (total - TTFT) / "
        f"(tokens - 1), mean over requests; a transformers static batch returns when its longest request is done. "
        f"One measurement per run after a warm-up; single-request latency is the median of {cfg['latency_repeats']}.",
        ""]
    lines = header + seed_table_md(report["seed_table"]) + [""] + vs_transformers_md(report["vs_transformers"])
    for workload in workloads:
        lines += [""] + workload_md(workload, runs)
    return "\n".join(lines) + "\n"


def write_plots(out: Path, workloads: list[Workload], runs: list[Run], timeline: list[SlotEvent]) -> None:
    """throughput_vs_concurrency.png, ttft_distribution.png and slot_timeline.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for name, draw in (("throughput_vs_concurrency.png", functools.partial(_plot_throughput, workloads, runs)),
                       ("ttft_distribution.png", functools.partial(_plot_ttft, runs))):
        fig = draw(plt)
        fig.savefig(out / name, dpi=120)
        plt.close(fig)
    plt.close(plot_timeline(timeline, out / "slot_timeline.png",
                            title=f"slot timeline: random workload, max_batch_size {TIMELINE_BATCH}"))


def _plot_throughput(workloads: list[Workload], runs: list[Run], plt: Any) -> Any:
    fig, axes = plt.subplots(1, len(workloads), figsize=(5 * len(workloads), 4), squeeze=False)
    for ax, workload in zip(axes[0], workloads):
        mine = [r for r in runs if r.workload == workload.name]
        for engine, mode, style, label in (("pocketllm", "batched", "o-", "pocketllm continuous batching"),
                                           ("transformers", "static", "s--", "transformers static batches")):
            points = [r for r in mine if (r.engine, r.mode) == (engine, mode)]
            if points:
                ax.plot([r.batch_size for r in points], [r.tokens_per_s for r in points], style, label=label)
        serial = find(runs, workload.name, "pocketllm", "serial", 1)
        ax.axhline(serial.tokens_per_s, color="gray", linestyle=":", label="pocketllm serial")
        one = find(runs, workload.name, "transformers", "static", 1)
        if one is not None:
            ax.axhline(one.tokens_per_s, color="tab:orange", linestyle=":", label="transformers one at a time")
        sizes = sorted({r.batch_size for r in mine})
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(s) for s in sizes])
        ax.set_ylim(bottom=0)
        ax.set_title(f"{workload.name} workload")
        ax.set_xlabel("max_batch_size / static batch size")
        ax.set_ylabel("output tokens/s")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    return fig


def _plot_ttft(runs: list[Run], plt: Any) -> Any:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in runs:
        if r.workload == "random" and r.engine == "pocketllm":
            ttfts = sorted(r.ttft_s)
            label = "serial" if r.mode == "serial" else f"max_batch_size {r.batch_size}"
            ax.step(ttfts, [(i + 1) / len(ttfts) for i in range(len(ttfts))], where="post", label=label)
    ax.set_xlabel("TTFT, s (from arrival; all requests arrive at once)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("TTFT CDF, random workload, pocketllm")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pocketllm bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None,
                        help=f"checkpoint preset (default {SCALES['full'].preset}; "
                             f"{SCALES['quick'].preset} with --quick)")
    parser.add_argument("--out", type=Path, default=Path("bench/results"), help="output directory")
    parser.add_argument("--quick", action="store_true",
                        help="tiny preset, 8 requests per workload, max_batch_size 1, 2, 4: under a minute")
    parser.add_argument("--seed", type=int, default=0, help="seeds the checkpoint weights and the workloads")
    parser.add_argument("--no-transformers", action="store_true", help="skip the transformers baselines")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and write its report; 2 when matplotlib (the plots) is missing."""
    args = build_parser().parse_args(argv)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("pocketllm bench: error: the plots need matplotlib: pip install 'pocketllm[plot]'", file=sys.stderr)
        return 2
    scale = SCALES["quick" if args.quick else "full"]
    preset = args.preset or scale.preset
    machine = machine_info()
    timeline: list[SlotEvent] = []
    with tempfile.TemporaryDirectory() as tmp:
        path = write_checkpoint(Path(tmp) / preset, preset, seed=args.seed)
        workloads = make_workloads(scale.requests, ModelConfig.from_dir(path).vocab_size, args.seed)
        hf_model = None if args.no_transformers else load_transformers(path)
        latency, runs = run_all(path, scale, workloads, hf_model, timeline)
    machine["load_average_1min_at_end"] = load_average()
    config = {"preset": preset, "seed": args.seed, "quick": args.quick, "concurrencies": list(scale.concurrencies),
              "requests_per_workload": scale.requests, "latency_repeats": scale.latency_repeats,
              "max_seq_len": MAX_SEQ_LEN, "transformers_baselines": hf_model is not None,
              "timeline": {"workload": "random", "max_batch_size": TIMELINE_BATCH, "events": len(timeline)}}
    report = {"machine": machine, "config": config, "workloads": {w.name: w.summary() for w in workloads},
              "latency": latency, "seed_table": seed_table(latency, runs),
              "vs_transformers": vs_transformers(runs, workloads, scale.concurrencies),
              "runs": [dataclasses.asdict(r) for r in runs]}
    print(write_outputs(args.out, report, workloads, runs, timeline))
    return 0


def write_outputs(out: Path, report: dict[str, Any], workloads: list[Workload], runs: list[Run],
                  timeline: list[SlotEvent]) -> str:
    """throughput.json, throughput.md and the plots; returns the Markdown."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "throughput.json").write_text(json.dumps(report, indent=2) + "\n")
    text = markdown(report, workloads, runs)
    (out / "throughput.md").write_text(text)
    write_plots(out, workloads, runs, timeline)
    return text
