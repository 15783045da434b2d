"""pocketllm runs: serial, batched at a max_batch_size, single-request latency; the run plan."""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tqdm import tqdm

from ..config import EngineArgs
from ..llm import LLM
from ..outputs import GenerationResult
from ..sampling import SamplingParams
from ..scheduler import SlotEvent
from .baseline import run_transformers
from .workloads import Run, Sample, Scale, Workload, summarize

MAX_SEQ_LEN = 512  # longest prompt (256) + longest output (128) of any workload fits

TIMELINE_BATCH = 4
LATENCY_MODES = {"serial": {"enable_batching": False},
                 "batched_thread": {"enable_batching": True},
                 "batched_caller": {"enable_batching": True, "background_thread": False}}


def _engine(path: Path, engine_args: dict[str, Any] | None = None, **options: Any) -> LLM:
    """An engine on `path` with these backend `options` and further EngineArgs fields (`engine_args`)."""
    return LLM(EngineArgs(model=str(path), max_seq_len=MAX_SEQ_LEN, backend_options=options, **(engine_args or {})))


def _warm_up(llm: LLM, count: int) -> None:
    """A few short requests first, so one-off costs (allocation, first kernels) are not timed."""
    llm.generate([[1] * 16] * count, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))


def _check(results: list[GenerationResult], workload: Workload) -> None:
    """A run counts only if every request generated exactly its planned tokens."""
    for result, planned in zip(results, workload.output_lens):
        if result.finish_reason != "length" or len(result.token_ids) != planned:
            raise RuntimeError(f"{workload.name}: request {result.request_id} ended {result.finish_reason!r} with "
                               f"{len(result.token_ids)}/{planned} tokens ({result.error})")


def _generate(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[GenerationResult]:
    """`llm.generate` on a list of prompts, which returns a list."""
    results = llm.generate(prompts, params)
    assert isinstance(results, list)
    return results


def _sample(result: GenerationResult, queued: float = 0.0) -> Sample:
    """(TTFT, total time, tokens) of a finished request that waited `queued` seconds before it ran."""
    if result.ttft_s is None or result.total_time_s is None:
        raise RuntimeError(f"request {result.request_id} ended {result.finish_reason!r} before its first token")
    return queued + result.ttft_s, queued + result.total_time_s, len(result.token_ids)


def run_serial(path: Path, workload: Workload) -> Run:
    """The serial path, one request after another; each waited since the run started."""
    with _engine(path, enable_batching=False) as llm:
        _warm_up(llm, 1)
        results: list[GenerationResult] = []
        samples: list[Sample] = []
        start = time.perf_counter()
        for prompt, params in zip(workload.prompts, workload.params()):
            queued = time.perf_counter() - start
            (result,) = _generate(llm, [prompt], [params])
            results.append(result)
            samples.append(_sample(result, queued))
        wall = time.perf_counter() - start
    _check(results, workload)
    return summarize(workload, "pocketllm", "serial", 1, wall, samples)


def run_batched(path: Path, workload: Workload, max_batch_size: int, timeline: list[SlotEvent] | None = None,
                engine_args: dict[str, Any] | None = None, **options: Any) -> Run:
    """Continuous batching, every request submitted at once, on an engine with these backend
    `options` and EngineArgs fields (`engine_args`) besides. With a `timeline` list, the run records
    its slot timeline and appends the measured requests' events (time 0 = first event)."""
    with _engine(path, engine_args, enable_batching=True, max_batch_size=max_batch_size,
                 record_timeline=timeline is not None, **options) as llm:
        _warm_up(llm, max_batch_size)
        start = time.perf_counter()
        results = _generate(llm, workload.prompts, workload.params())
        wall = time.perf_counter() - start
        events = llm.scheduler.timeline if llm.scheduler is not None else None
    _check(results, workload)
    if timeline is not None and events is not None:
        timeline += _measured_events(events, {r.request_id for r in results})
    samples = [_sample(r) for r in results]
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
            _check(_generate(llm, [prompt], [params]), workload)
            times.append(time.perf_counter() - start)
    return statistics.median(times)

def plan_runs(path: Path, workloads: list[Workload], concurrencies: tuple[int, ...], hf_model: Any,
              timeline: list[SlotEvent]) -> list[tuple[str, Callable[[], Run]]]:
    """Every run, labelled for the progress bar; the timeline is recorded on `random` at TIMELINE_BATCH."""
    plan: list[tuple[str, Callable[[], Run]]] = []
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
