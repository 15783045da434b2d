"""Workloads (what is run), run records (what a run yields) and their summaries."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from ..sampling import SamplingParams
from ..scheduler.stats import percentile

Engine = Literal["pocketllm", "transformers"]
Mode = Literal["serial", "batched", "static"]


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
    engine: Engine
    mode: Mode  # "batched": continuous batching; "static": transformers batches
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

def summarize(workload: Workload, engine: Engine, mode: Mode, batch_size: int, wall_s: float,
              samples: list[Sample]) -> Run:
    """Tokens/s over the wall time; TTFT percentiles and mean TPOT over the requests."""
    ttfts = [ttft for ttft, _, _ in samples]
    tokens = sum(n for _, _, n in samples)
    tpots = [(total - ttft) / (n - 1) for ttft, total, n in samples if n > 1]
    return Run(workload.name, engine, mode, batch_size, len(samples), tokens, wall_s, tokens / wall_s,
               percentile(ttfts, 50), percentile(ttfts, 99), statistics.fmean(tpots) if tpots else 0.0, ttfts)

def find(runs: list[Run], workload: str, engine: Engine, mode: Mode, batch_size: int) -> Run | None:
    """The run of that kind, or None where it was not planned (--quick, no transformers)."""
    key = (workload, engine, mode, batch_size)
    return next((r for r in runs if (r.workload, r.engine, r.mode, r.batch_size) == key), None)


def need(runs: list[Run], workload: str, engine: Engine, mode: Mode, batch_size: int) -> Run:
    """The run of that kind, which every plan has."""
    run = find(runs, workload, engine, mode, batch_size)
    if run is None:
        raise LookupError(f"no {engine} {mode} run at batch size {batch_size} on the {workload} workload")
    return run
