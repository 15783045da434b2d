"""The benchmark's plots. Needs matplotlib (`pocketllm[plot]`); draws without a display and
without switching the process's matplotlib backend."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
from matplotlib.figure import Figure

from ..scheduler import SlotEvent, plot_timeline
from .runners import TIMELINE_BATCH
from .workloads import Run, Workload, find, need


def write_plots(out: Path, workloads: list[Workload], runs: list[Run], timeline: list[SlotEvent]) -> None:
    """throughput_vs_concurrency.png, ttft_distribution.png and slot_timeline.png. The first two are
    plain Figures (no pyplot state, so nothing to show or close)."""
    _plot_throughput(workloads, runs).savefig(out / "throughput_vs_concurrency.png", dpi=120)
    _plot_ttft(runs).savefig(out / "ttft_distribution.png", dpi=120)
    plt.close(plot_timeline(timeline, out / "slot_timeline.png",
                            title=f"slot timeline: random workload, max_batch_size {TIMELINE_BATCH}"))


def _plot_throughput(workloads: list[Workload], runs: list[Run]) -> Figure:
    fig = Figure(figsize=(5 * len(workloads), 4))
    axes = fig.subplots(1, len(workloads), squeeze=False)
    for ax, workload in zip(axes[0], workloads):
        mine = [r for r in runs if r.workload == workload.name]
        for engine, mode, style, label in (("pocketllm", "batched", "o-", "pocketllm continuous batching"),
                                           ("transformers", "static", "s--", "transformers static batches")):
            points = [r for r in mine if (r.engine, r.mode) == (engine, mode)]
            if points:
                ax.plot([r.batch_size for r in points], [r.tokens_per_s for r in points], style, label=label)
        serial = need(runs, workload.name, "pocketllm", "serial", 1)
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


def _plot_ttft(runs: list[Run]) -> Figure:
    fig = Figure(figsize=(7, 4.5))
    ax = fig.subplots()
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


def plot_real_shapes(models: list[dict[str, Any]]) -> Figure:
    """One row per model: batch-1 decode, batched and prefill tokens/s, one bar per engine; the
    decode panel marks the memory-bandwidth limit."""
    metrics = (("decode_1", "batch-1 decode"), ("batched_8", "continuous batching 8"), ("prefill", "prefill"))
    fig = Figure(figsize=(13, 3.8 * len(models)))
    axes = fig.subplots(len(models), len(metrics), squeeze=False)
    for row, model in zip(axes, models):
        verdicts = model["verdicts"]
        for ax, (key, title) in zip(row, metrics):
            rates = verdicts[key]["tokens_per_s"]
            ax.bar([name.replace("pocketllm (", "(").replace(" decode", "") for name in rates], list(rates.values()),
                   color=[f"C{i}" for i in range(len(rates))])
            if key == "decode_1":
                ax.axhline(verdicts["bandwidth_limit_tokens_per_s"], color="black", linestyle=":",
                           label="memory-bandwidth limit")
                ax.legend(fontsize=8)
            ax.set_title(f"{model['preset']}: {title}")
            ax.set_ylabel("tokens/s")
            ax.tick_params(axis="x", labelsize=7, labelrotation=30)
            for label in ax.get_xticklabels():
                label.set_horizontalalignment("right")
    fig.tight_layout()
    return fig
