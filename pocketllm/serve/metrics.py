"""GET /metrics: the scheduler's statistics in Prometheus' text format, written by prometheus-client
(HELP and TYPE lines; counters named `_total`, as the format's convention wants), or as JSON with
`?format=json`. Read at each scrape from `get_stats()`: nothing is counted twice."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from .errors import APIError
from .state import ServerState

PREFIX = "pocketllm_"
# Counts that only grow, since the engine started; everything else is a gauge (a value now, or a
# latency over the most recent requests).
COUNTERS = {
    "finished": "requests that ended with 'stop' or 'length'",
    "cancelled": "requests cancelled",
    "errored": "requests that ended with 'error'",
    "prompt_tokens": "prompt tokens of the requests admitted",
    "generated_tokens": "tokens generated",
    "steps": "scheduler steps",
    "prefill_batches": "forwards that ran a prefill piece",
    "decode_batches": "forwards that ran a decode row",
    "callback_errors": "callbacks that raised",
    "busy_time_s": "seconds spent in steps that ran a forward",
    "prefill_chunks": "prefill pieces run",
    "mixed_steps": "forwards that ran decode rows and prefill pieces together",
    "prefix_hits": "admissions that reused a prefix a slot held",
    "prefix_copies": "prefix reuses copied from a busy slot",
    "prefix_tokens_reused": "prompt positions not prefilled thanks to prefix reuse",
    "preemptions": "requests preempted (swap or recompute)",
    "recomputes": "preemptions by recompute",
    "recomputed_tokens": "positions freed by recompute preemptions",
    "swapped_bytes": "bytes copied to host memory by swap preemptions",
    "spec_verifies": "verify pieces run (speculative decoding: a request's drafts checked in one step)",
    "spec_draft_tokens": "tokens drafted",
    "spec_accepted_tokens": "drafted tokens accepted",
}
GAUGES = {
    "waiting": "requests waiting for a slot",
    "running": "requests holding a slot",
    "free_slots": "cache slots free",
    "cache_bytes": "bytes of the slot cache",
    "state_snapshot_bytes": "bytes of the Gated DeltaNet state copies held for prefix reuse",
    "swapped_out": "requests swapped out now",
    "swap_bytes_held": "host memory the swapped-out slots take",
    "uncollected": "ended requests whose result nobody has collected",
    "tokens_per_s": "generated tokens per second of busy time",
    "spec_mean_accepted_length": "tokens a verify piece emitted on average (1 + accepted drafts; 0: none ran)",
}


def stats_values(state: ServerState) -> dict[str, Any]:
    """Every statistic by name: get_stats() with tokens/s and the free slots."""
    engine = state.engine
    stats = engine.scheduler.get_stats()
    return {**dataclasses.asdict(stats), "tokens_per_s": stats.tokens_per_s, "free_slots": engine.llm.slots.num_free,
            "spec_mean_accepted_length": stats.spec_mean_accepted_length}


class StatsCollector:
    """prometheus-client's view of the scheduler: one metric family per statistic, read at each scrape."""

    def __init__(self, state: ServerState) -> None:
        self.state = state

    def collect(self) -> Iterator[Metric]:
        for name, value in stats_values(self.state).items():
            if name in COUNTERS:
                yield CounterMetricFamily(PREFIX + name, COUNTERS[name], value=float(value))
            else:
                latency = name.removesuffix("_s").replace("_", " ", 1)
                help_text = GAUGES.get(name, f"{latency} in seconds over the most recent requests")
                yield GaugeMetricFamily(PREFIX + name, help_text, value=float(value))


def metrics_registry(state: ServerState) -> CollectorRegistry:
    """A registry of the app's own (not the process-global one: two apps in a process stay apart)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StatsCollector(state))
    return registry


def metrics_response(state: ServerState, registry: CollectorRegistry, format: str) -> Response:
    if format not in ("prometheus", "json"):
        raise APIError(400, f"format must be 'prometheus' or 'json', got {format!r}", "format")
    if format == "json":
        return JSONResponse(stats_values(state))
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
