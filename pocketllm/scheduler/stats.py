"""SchedulerStats: a snapshot of what the scheduler has done, from `get_stats()`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))  # ceil(n * q / 100), at least 1
    return ordered[int(rank) - 1]


@dataclass(frozen=True)
class SchedulerStats:
    """Counts since the scheduler started; latency figures (ttft_*, total_time_*) over the most
    recent requests (batch_scheduler.LATENCY_WINDOW of them)."""

    waiting: int
    running: int
    finished: int  # ended with "stop" or "length"
    cancelled: int
    errored: int
    prompt_tokens: int
    generated_tokens: int
    steps: int
    prefill_batches: int  # forwards that ran a prefill piece
    decode_batches: int  # forwards that ran a decode row
    callback_errors: int
    busy_time_s: float  # time spent inside steps that ran a forward
    cache_bytes: int  # size of the slot cache the scheduler runs on
    prefill_chunks: int  # prefill pieces run (a prompt cut into n pieces counts n)
    mixed_steps: int  # forwards that ran decode rows and prefill pieces together
    prefix_hits: int  # requests that reused a prefix held by a slot
    prefix_copies: int  # ... of which copied it from a busy slot
    prefix_tokens_reused: int  # prompt tokens not prefilled thanks to reuse
    state_snapshot_bytes: int  # Gated DeltaNet state copies held now, for prefix reuse
    preemptions: int  # requests swapped out (a request swapped out twice counts twice)
    swapped_out: int  # requests swapped out now, waiting to come back
    swap_bytes_held: int  # host memory their slots take now
    swapped_bytes: int  # bytes copied out by every preemption so far
    uncollected: int  # ended requests whose result nobody has polled yet
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    total_time_mean_s: float
    total_time_p50_s: float
    total_time_p99_s: float

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second of busy time."""
        return self.generated_tokens / self.busy_time_s if self.busy_time_s > 0 else 0.0

    @property
    def chunks_per_step(self) -> float:
        """Prefill pieces per forward that prefilled."""
        return self.prefill_chunks / self.prefill_batches if self.prefill_batches else 0.0

    @classmethod
    def build(cls, ttfts: list[float], totals: list[float], **counts: Any) -> SchedulerStats:
        mean = lambda xs: sum(xs) / len(xs) if xs else 0.0  # noqa: E731
        return cls(ttft_mean_s=mean(ttfts), ttft_p50_s=percentile(ttfts, 50), ttft_p99_s=percentile(ttfts, 99),
                   total_time_mean_s=mean(totals), total_time_p50_s=percentile(totals, 50),
                   total_time_p99_s=percentile(totals, 99), **counts)
