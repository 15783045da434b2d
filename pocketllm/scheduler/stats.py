"""What the scheduler has done: `Counters` is where the planner, the delivery and the facade
count, under the facade's lock, so that every figure is counted in one place; `SchedulerStats`
is its snapshot, from `get_stats()`."""

from __future__ import annotations

import collections
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..runner import SequenceInput
    from .request import Request
    from .timeline import SlotEvent, Span

LATENCY_WINDOW = 100_000  # requests whose TTFT and total time the latency statistics cover


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
    recent requests (LATENCY_WINDOW of them)."""

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
    prefix_hits: int  # admissions that reused a prefix held by a slot (a recompute's readmission too)
    prefix_copies: int  # ... of which copied it from a busy slot
    prefix_tokens_reused: int  # tokens not prefilled thanks to reuse
    state_snapshot_bytes: int  # Gated DeltaNet state copies held now, for prefix reuse
    preemptions: int  # requests preempted, by swap or recompute (a request preempted twice counts twice)
    recomputes: int  # ... of which by recompute (preemption_mode="recompute")
    recomputed_tokens: int  # positions those freed slots held, prefilled again on readmission unless reused
    swapped_out: int  # requests swapped out now, waiting to come back
    swap_bytes_held: int  # host memory their slots take now
    swapped_bytes: int  # bytes copied out by every preemption so far
    uncollected: int  # ended requests whose result nobody has polled yet
    spec_verifies: int  # verify pieces run (speculative decoding): one per drafting request and step
    spec_draft_tokens: int  # tokens they drafted
    spec_accepted_tokens: int  # ... of which accepted (each saved a decode step)
    ttft_mean_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    total_time_mean_s: float
    total_time_p50_s: float
    total_time_p99_s: float

    @property
    def spec_mean_accepted_length(self) -> float:
        """Tokens a verify piece emitted on average: 1 + its accepted drafts (0.0 before any ran)."""
        return 1 + self.spec_accepted_tokens / self.spec_verifies if self.spec_verifies else 0.0

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second of busy time."""
        return self.generated_tokens / self.busy_time_s if self.busy_time_s > 0 else 0.0


class Counters:
    """Running counts, busy time, the latencies of the most recent requests only (so that a
    long-running engine's memory stays bounded) and, when recording, the timeline. Changed under
    the scheduler's lock."""

    def __init__(self, record_timeline: bool = False) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self.ttfts: collections.deque[float] = collections.deque(maxlen=LATENCY_WINDOW)
        self.totals: collections.deque[float] = collections.deque(maxlen=LATENCY_WINDOW)
        self.busy_time = 0.0
        self.started = time.perf_counter()
        self.timeline: list[SlotEvent] | None = [] if record_timeline else None

    @property
    def steps(self) -> int:
        return self.counts["steps"]

    def forward(self, seqs: Sequence[SequenceInput], spans: Sequence[Span]) -> None:
        """One step's forward: its prefill pieces, whether it decoded, prefilled or both, and the
        timeline's events of the forwards it took (more than one when a failed batch was rerun)."""
        if self.timeline is not None:
            self.timeline.extend(span.event(self.steps, self.started) for span in spans)
        pieces = sum(not s.decode and not s.drafts for s in seqs)
        decoded = pieces < len(seqs)
        self.counts["prefill_chunks"] += pieces
        self.counts["prefill_batches"] += pieces > 0
        self.counts["decode_batches"] += decoded
        self.counts["mixed_steps"] += decoded and pieces > 0

    def verified(self, drafted: int, accepted: int) -> None:
        """A verify piece of `drafted` drafts accepted `accepted` of them."""
        self.counts["spec_verifies"] += 1
        self.counts["spec_draft_tokens"] += drafted
        self.counts["spec_accepted_tokens"] += accepted

    def ended(self, request: Request) -> None:
        """A request that has reached its terminal state."""
        reason = request.finish_reason
        assert reason is not None  # a request is counted once it has finished
        self.counts["finished" if reason in ("stop", "length") else reason] += 1
        self.counts["generated_tokens"] += len(request.token_ids)
        result = request.result()
        if result.ttft_s is not None:
            self.ttfts.append(result.ttft_s)
        assert result.total_time_s is not None  # a finished request has its finish time
        self.totals.append(result.total_time_s)

    def snapshot(self, **now: Any) -> SchedulerStats:
        """The stats, with `now` (what the queues and the cache hold at this moment)."""
        c, ttfts, totals = self.counts, list(self.ttfts), list(self.totals)
        mean = lambda xs: sum(xs) / len(xs) if xs else 0.0  # noqa: E731
        return SchedulerStats(
            finished=c["finished"], cancelled=c["cancelled"], errored=c["error"], prompt_tokens=c["prompt_tokens"],
            generated_tokens=c["generated_tokens"], steps=c["steps"], prefill_batches=c["prefill_batches"],
            decode_batches=c["decode_batches"], callback_errors=c["callback_errors"], busy_time_s=self.busy_time,
            prefill_chunks=c["prefill_chunks"], mixed_steps=c["mixed_steps"], prefix_hits=c["prefix_hits"],
            prefix_copies=c["prefix_copies"], prefix_tokens_reused=c["prefix_tokens_reused"],
            preemptions=c["preemptions"], recomputes=c["recomputes"], recomputed_tokens=c["recomputed_tokens"],
            swapped_bytes=c["swapped_bytes"], spec_verifies=c["spec_verifies"],
            spec_draft_tokens=c["spec_draft_tokens"], spec_accepted_tokens=c["spec_accepted_tokens"],
            ttft_mean_s=mean(ttfts), ttft_p50_s=percentile(ttfts, 50), ttft_p99_s=percentile(ttfts, 99),
            total_time_mean_s=mean(totals), total_time_p50_s=percentile(totals, 50),
            total_time_p99_s=percentile(totals, 99), **now)
