"""The report: the seed's goals, continuous vs static batching, the machine, JSON and Markdown."""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import statistics
from pathlib import Path
from typing import Any

import torch

from ..machine import cpu_name
from .baseline import static_efficiency
from .workloads import Run, Workload, find, need

LATENCY_GOAL = 1.05  # single request: batched / serial wall time
CONCURRENCY_GOALS = {2: 1.7, 4: 3.0, 8: 4.5}  # fixed workload: tokens/s at max_batch_size c / at 1
TRANSFORMERS_GOAL = 1.5  # random workload: continuous batching / transformers static batching
VS_TRANSFORMERS_BATCH = 8


def seed_table(latency: dict[str, float], runs: list[Run]) -> dict[str, Any]:
    """The seed's goals on the fixed workload: single-request latency ratios, throughput ratios."""
    base = need(runs, "fixed", "pocketllm", "batched", 1)
    throughput: dict[int, dict[str, Any]] = {}
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
    ours = need(runs, "random", "pocketllm", "batched", batch)
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
    return {"platform": platform.platform(), "processor": cpu_name(), "cpu_count": os.cpu_count(),
            "python": platform.python_version(), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
            "transformers": hf_version, "load_average_1min_at_start": load_average()}


def save_report(out: Path, stem: str, report: dict[str, Any], text: str) -> None:
    """`stem`.json (the whole report) and `stem`.md (its table) in `out`, created if need be."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(report, indent=2) + "\n")
    (out / f"{stem}.md").write_text(text)


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
    skipped = [f"Skipped {part.replace('_', ' ')}: {why}." for part, why in report.get("skipped", {}).items()]
    lines = header + (skipped + [""] if skipped else []) + seed_table_md(report["seed_table"]) + [""]
    lines += vs_transformers_md(report["vs_transformers"])
    for workload in workloads:
        lines += [""] + workload_md(workload, runs)
    return "\n".join(lines) + "\n"


def write_report(out: Path, report: dict[str, Any], workloads: list[Workload], runs: list[Run]) -> str:
    """throughput.json and throughput.md; returns the Markdown."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "throughput.json").write_text(json.dumps(report, indent=2) + "\n")
    text = markdown(report, workloads, runs)
    (out / "throughput.md").write_text(text)
    return text
