"""The engine factory the assertions drive: one serial engine and batched engines on one checkpoint,
and what a batched run gives against the cold serial run of each of its requests.

`Engines` builds every engine a property needs from one checkpoint and one set of arguments (the
serial reference, a batched engine per number of slots, a serial engine per way of cutting prompts)
and keeps them across a property's examples; `run_batched` drives a workload through the scheduler
step by step (arrivals, cancellations, preemptions at their steps); `mismatches` compares each request
with its cold serial run and says where the first difference is.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from ..config import EngineArgs
from ..llm import LLM
from ..outputs import GenerationResult
from ..scheduler import BatchScheduler, PrefillPolicy
from . import _checks as check
from .strategies import Job, Schedule, Workload

MAX_SEQ_LEN = 96
# The EngineArgs fields Engines sets from its own arguments (path, max_seq_len, backend options as
# keywords), and those engine_args and batched_args may set.
OWN_FIELDS = ("model", "max_seq_len", "backend_options")
ENGINE_FIELDS = tuple(f.name for f in fields(EngineArgs) if f.init and f.name not in OWN_FIELDS)


class Engines:
    """The engine factory of a property: one serial engine and one batched engine per max_batch_size,
    on the same checkpoint and options (`options`: backend options; `engine_args`: backend,
    op_overrides, dtype, ...); one more serial engine per other way of cutting prompts (chunk size,
    snapshot interval) a workload runs on. `batched_args`: EngineArgs of the batched engines only
    (tensor_parallel_size=2: the batched runs are sharded, their references single-process).
    Engines are built on first use and kept until `close()` (also on leaving a `with` block)."""

    def __init__(self, path: str | Path, max_seq_len: int = MAX_SEQ_LEN, engine_args: Mapping[str, Any] | None = None,
                 batched_args: Mapping[str, Any] | None = None, **options: Any) -> None:
        _check_arguments(path, max_seq_len, engine_args, batched_args)
        self.path = str(path)
        self.options = options
        self.engine_args = dict(engine_args or {})
        self.batched_args = dict(batched_args or {})
        self.max_seq_len = max_seq_len
        self.serial = self._engine(self.options)
        self.batched: dict[int, LLM] = {}
        self._cut_serial: dict[tuple[int, int], LLM] = {}
        self.serial_cache: dict[tuple, GenerationResult] = {}
        # Every workload the batched engines ran, in order: what their slots hold (retained prefixes)
        # depends on it, so a counterexample that needs it replays from here (`replay`).
        self.history: list[Workload] = []

    def __repr__(self) -> str:
        args = [repr(self.path), f"max_seq_len={self.max_seq_len}"]
        args += [f"{name}={python_source(value)}" for name, value in (("engine_args", self.engine_args),
                                                                 ("batched_args", self.batched_args)) if value]
        args += [f"{name}={python_source(value)}" for name, value in self.options.items()]
        return f"Engines({', '.join(args)})"

    def __enter__(self) -> Engines:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def vocab_size(self) -> int:
        return self.serial.model_config.vocab_size

    def _engine(self, options: dict[str, Any], batched: bool = False) -> LLM:
        args = {**self.engine_args, **self.batched_args} if batched else self.engine_args
        return LLM(EngineArgs(model=self.path, max_seq_len=self.max_seq_len, backend_options=options, **args))

    def scheduler(self, max_batch_size: int) -> BatchScheduler:
        """The caller-stepped scheduler of the batched engine with `max_batch_size` slots."""
        check.positive("Engines.scheduler", max_batch_size=max_batch_size)
        if max_batch_size not in self.batched:
            self.batched[max_batch_size] = self._engine({**self.options, "enable_batching": True,
                                                         "max_batch_size": max_batch_size,
                                                         "background_thread": False}, batched=True)
        scheduler = self.batched[max_batch_size].scheduler
        assert scheduler is not None
        return scheduler

    def _serial_for(self, policy: PrefillPolicy | None) -> LLM:
        """The serial engine that cuts prompts as `policy` does (the engine's own cuts for None)."""
        if policy is None:
            return self.serial
        cuts = (policy.chunk_size, policy.snapshot_interval)
        if cuts not in self._cut_serial:
            self._cut_serial[cuts] = self._engine({**self.options, "prefill_chunk_size": cuts[0],
                                                   "state_snapshot_interval": cuts[1],
                                                   "max_num_batched_tokens": 2 * self.max_seq_len + 1024})
        return self._cut_serial[cuts]

    def serial_result(self, job: Job, policy: PrefillPolicy | None = None) -> GenerationResult:
        """The job run alone, cold, in serial mode, its prompt cut as `policy` cuts it (cached)."""
        _check_job("Engines.serial_result", job, policy)
        llm = self._serial_for(policy)
        key = (job.prompt, job.params, llm.policy.chunk_size, llm.policy.snapshot_interval)
        if key not in self.serial_cache:
            result = llm.generate(prompt_tokens=list(job.prompt), sampling_params=job.params)
            if result.finish_reason not in ("stop", "length"):
                raise AssertionError(f"serial run ended {result.finish_reason}: {result.error}")
            self.serial_cache[key] = result
        return self.serial_cache[key]

    def serial_output(self, job: Job, policy: PrefillPolicy | None = None) -> tuple[list[int], list[float]]:
        """(tokens, logprobs) of `serial_result`."""
        _check_job("Engines.serial_output", job, policy)
        result = self.serial_result(job, policy)
        return result.token_ids, result.logprobs

    def close(self) -> None:
        for llm in [self.serial, *self.batched.values(), *self._cut_serial.values()]:
            llm.close()


def _check_arguments(path: Any, max_seq_len: Any, engine_args: Any, batched_args: Any) -> None:
    """Engines' own arguments, checked before an engine is built: EngineArgs would name none of them
    (a path without a checkpoint fails as a missing config.json, engine_args={"max_seq_len": ...}
    as a duplicate keyword)."""
    check.instance("Engines", "path", path, (str, os.PathLike), "a checkpoint directory (a str or Path)")
    check.integer("Engines", "max_seq_len", max_seq_len, 2)
    for name, args in (("engine_args", engine_args), ("batched_args", batched_args)):
        check.instance("Engines", name, args, (Mapping, type(None)), "None or a dict of EngineArgs fields")
        for key in args or {}:
            if key in OWN_FIELDS:
                raise ValueError(f"Engines: {name} must not set {key!r}: Engines sets it from its own arguments "
                                 "(path, max_seq_len, backend options as keywords)")
            check.one_of("Engines", f"{name} keys", key, ENGINE_FIELDS)
    if not (Path(path) / "config.json").is_file():
        raise check.refuse(ValueError, "Engines", "path", "a checkpoint directory (one with a config.json)", str(path))


def _check_job(where: str, job: Any, policy: Any) -> None:
    check.instance(where, "job", job, Job, "a Job")
    check.instance(where, "policy", policy, (PrefillPolicy, type(None)),
                   "None or a PrefillPolicy (a Schedule's is schedule.policy(max_batch_size, max_seq_len))")


def check_run(where: str, engines: Any, workload: Any) -> None:
    """What a run takes: an Engines and a Workload (the argument order of every run and assertion)."""
    check.instance(where, "engines", engines, Engines, "an Engines")
    check.instance(where, "workload", workload, Workload, "a Workload")


def python_source(value: Any) -> str:
    """`value` as Python source where it can be: callables by their import path ("module:name", which
    op_overrides and every implementation argument take), containers element by element."""
    if callable(value) and hasattr(value, "__module__") and hasattr(value, "__qualname__"):
        return repr(f"{value.__module__}:{value.__qualname__}")
    if isinstance(value, dict):
        return "{" + ", ".join(f"{python_source(k)}: {python_source(v)}" for k, v in value.items()) + "}"
    return repr(value)


def as_policy(schedule: Schedule | PrefillPolicy | None, max_batch_size: int, max_seq_len: int
              ) -> PrefillPolicy | None:
    """The PrefillPolicy a workload's schedule stands for on these slots (None: the engine's own)."""
    check.instance("as_policy", "schedule", schedule, (Schedule, PrefillPolicy, type(None)),
                   "a Schedule, a PrefillPolicy or None")
    return schedule.policy(max_batch_size, max_seq_len) if isinstance(schedule, Schedule) else schedule


def run_batched(engines: Engines, workload: Workload) -> dict[int, GenerationResult]:
    """Drive the scheduler step by step: submit each job at its arrival step, cancel and preempt it
    when due; job index -> its result. The workload's schedule (the engine's own policy when None) is
    configured first. What slots hold from earlier workloads stays reusable while the reuse grid is
    unchanged: retained donors too."""
    check_run("run_batched", engines, workload)
    engines.history.append(workload)
    scheduler = engines.scheduler(workload.max_batch_size)
    policy = as_policy(workload.schedule, workload.max_batch_size, engines.max_seq_len)
    if policy is not None:
        scheduler.configure(policy)
    ids: dict[int, int] = {}
    step = 0
    while len(ids) < len(workload.jobs) or scheduler.has_work:
        for index, job in enumerate(workload.jobs):
            if job.arrival_step == step:
                ids[index] = scheduler.submit_request(list(job.prompt), job.params, priority=job.priority)
            if index in ids and job.cancel_step is not None and job.arrival_step + job.cancel_step == step:
                scheduler.cancel_request(ids[index])
            if index in ids and step - job.arrival_step in job.preempt_steps:
                scheduler.preempt(ids[index])
        scheduler.step()
        step += 1
    results = {index: scheduler.poll_result(request_id) for index, request_id in ids.items()}
    if any(r is None for r in results.values()):
        raise AssertionError("a request has no terminal state after the scheduler ran out of work")
    if engines.batched[workload.max_batch_size].slots.num_free != workload.max_batch_size:
        raise AssertionError("slots still held after every request ended")
    return {index: result for index, result in results.items() if result is not None}


@dataclass(frozen=True)
class Mismatch:
    """Where one request's batched output first differs from its cold serial run: the generated
    position, and what each run has there (token, logprob; None past the end of its output)."""

    job: int
    position: int
    batched: tuple[int, float] | None
    serial: tuple[int, float] | None
    batched_result: GenerationResult
    serial_result: GenerationResult


def first_difference(batched: GenerationResult, serial: GenerationResult, prefix_only: bool) -> int | None:
    """The first generated position where the two differ in token or logprob bits (a position only
    one of them has counts); None when none does. `prefix_only`: `batched` may stop early (it was
    cancelled) and must be a prefix of `serial`."""
    for name, result in (("batched", batched), ("serial", serial)):
        check.instance("first_difference", name, result, GenerationResult, "a GenerationResult")
    check.flag("first_difference", "prefix_only", prefix_only)
    a = list(zip(batched.token_ids, batched.logprobs))
    b = list(zip(serial.token_ids, serial.logprobs))
    n = len(a) if prefix_only else max(len(a), len(b))
    for position in range(n):
        if position >= len(a) or position >= len(b) or a[position] != b[position]:
            return position
    return None


def find_mismatches(engines: Engines, workload: Workload) -> list[Mismatch]:
    """Each request of the workload run batched against its cold serial run (its prompt cut at the
    same request-local positions); a cancelled request's output must be a prefix of its serial one."""
    check_run("find_mismatches", engines, workload)
    found = []
    policy = as_policy(workload.schedule, workload.max_batch_size, engines.max_seq_len)
    for index, result in run_batched(engines, workload).items():
        serial = engines.serial_result(workload.jobs[index], policy)
        position = first_difference(result, serial, prefix_only=result.finish_reason == "cancelled")
        if position is not None:
            found.append(Mismatch(index, position, _at(result, position), _at(serial, position), result, serial))
    return found


def _at(result: GenerationResult, position: int) -> tuple[int, float] | None:
    if position >= len(result.token_ids):
        return None
    return result.token_ids[position], result.logprobs[position]


def replay(engines: Engines, history: list[Workload]) -> list[Mismatch]:
    """Run `history` in order on `engines` (fresh ones, to reproduce what a property's engines went
    through), and return the mismatches of every workload: a counterexample that shows only after
    earlier workloads (a retained prefix, the slots' order) then shows without Hypothesis."""
    check.instance("replay", "engines", engines, Engines, "an Engines")
    check.items("replay", "history", history, "a list of Workloads", min_len=0)
    check.each("replay", "history", history, Workload, "a Workload")
    return [m for workload in history for m in find_mismatches(engines, workload)]
