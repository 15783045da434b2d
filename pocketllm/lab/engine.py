"""Engine-level checks: the invariance property, and greedy parity against `transformers`.

The property is the contract itself: random workloads (arrival steps, batch sizes, sampling
parameters, cancellations; with `prefix_workloads` also shared system prompts and random token
budgets, chunk sizes, snapshot intervals and prefix reuse) through the batch scheduler, every
request's tokens and logprobs `==` its cold serial run (its prompt cut at the same request-local
positions). The engine tests and `pocketllm lab check` run this same code, the lab with a variant
installed through `op_overrides`. Needs `hypothesis` (and `transformers` for parity):
the `dev` extra.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ..config import Backend, EngineArgs
from ..kernels.backends import DEFAULT_BACKEND
from ..kernels.registry import ImplSpec
from ..llm import LLM
from ..models import cached_checkpoint
from ..outputs import GenerationResult
from ..sampling import SamplingParams
from ..scheduler import PrefillPolicy

MAX_SEQ_LEN = 96


@dataclass(frozen=True)
class Job:
    prompt: tuple[int, ...]
    params: SamplingParams
    arrival_step: int
    cancel_step: int | None  # steps after arrival; None: never cancelled
    priority: int = 0
    preempt_steps: tuple[int, ...] = ()  # steps after arrival at which it is preempted if running


def sampling_params(max_tokens: int = 24) -> st.SearchStrategy:
    """Greedy and seeded sampling with temperature, top-k and top-p, 1..max_tokens new tokens."""
    return st.builds(SamplingParams, max_tokens=st.integers(1, max_tokens),
                     temperature=st.sampled_from([0.0, 0.0, 0.5, 1.0, 1.7]), top_k=st.sampled_from([0, 0, 1, 5, 40]),
                     top_p=st.sampled_from([1.0, 1.0, 0.9, 0.5]), seed=st.integers(0, 2**64 - 1),
                     ignore_eos=st.booleans())


def workloads(vocab: int, max_prompt: int = 64, max_jobs: int = 12, max_tokens: int = 24) -> st.SearchStrategy:
    """(jobs, max_batch_size): prompts of 1..max_prompt tokens arriving at steps 0..12."""
    jobs = st.builds(Job, prompt=st.lists(st.integers(0, vocab - 1), min_size=1, max_size=max_prompt).map(tuple),
                     params=sampling_params(max_tokens), arrival_step=st.integers(0, 12),
                     cancel_step=st.none() | st.integers(0, 10))
    return st.tuples(st.lists(jobs, min_size=1, max_size=max_jobs), st.integers(1, 8))


@dataclass(frozen=True)
class Schedule:
    """A scheduler policy drawn for one example; the token budget is the least the configuration
    allows plus `budget_slack`."""

    chunk_size: int
    snapshot_interval: int
    budget_slack: int
    prefix_reuse: bool

    def policy(self, max_batch_size: int, max_seq_len: int) -> PrefillPolicy:
        piece = PrefillPolicy(1, self.chunk_size, self.snapshot_interval).max_piece(max_seq_len)
        return PrefillPolicy(piece + max_batch_size - 1 + self.budget_slack, self.chunk_size, self.snapshot_interval,
                             self.prefix_reuse)


def schedules() -> st.SearchStrategy:
    """Chunk sizes (0: uncut), snapshot intervals, budgets from the tightest allowed up, reuse on or off."""
    return st.builds(Schedule, chunk_size=st.sampled_from([0, 64, 128]), snapshot_interval=st.sampled_from([64, 128]),
                     budget_slack=st.sampled_from([0, 1, 7, 300]), prefix_reuse=st.sampled_from([True, True, False]))


def preemption_workloads(vocab: int, max_prompt: int = 150, max_jobs: int = 8,
                         max_tokens: int = 16, min_preempts: int = 0) -> st.SearchStrategy:
    """(jobs, max_batch_size, schedule): priorities 0..2 (so later, more urgent requests preempt
    running ones when the slots are full) and forced preemptions at random steps, `min_preempts`
    to 3 per request; prompts long enough to be preempted between prefill pieces too. Whether a
    preemption swaps or recomputes is the engines' option (`Engines(..., preemption_mode=...)`)."""
    token = st.integers(0, vocab - 1)
    # Half the prompts span several pieces, so swap-outs land between pieces of a prefill too.
    prompt = st.lists(token, min_size=1, max_size=max_prompt) | st.lists(token, min_size=65, max_size=max_prompt)
    job = st.builds(Job, prompt=prompt.map(tuple),
                    params=sampling_params(max_tokens), arrival_step=st.integers(0, 10),
                    cancel_step=st.none() | st.integers(0, 12), priority=st.integers(0, 2),
                    preempt_steps=st.lists(st.integers(1, 14), min_size=min_preempts, max_size=3).map(tuple))
    return st.tuples(st.lists(job, min_size=1, max_size=max_jobs), st.integers(1, 4), schedules())


def prefix_workloads(vocab: int, max_prompt: int = 200, max_jobs: int = 8, max_tokens: int = 12) -> st.SearchStrategy:
    """(jobs, max_batch_size, schedule): prompts that start with one of a few "system prompts" (40 to
    160 tokens) or with nothing, then 1..40 tokens of their own; arrivals at steps 0..12, cancellations."""
    token = st.integers(0, vocab - 1)

    def jobs_on(systems: list[list[int]]) -> st.SearchStrategy:
        prompt = st.tuples(st.sampled_from(systems + [[]]), st.lists(token, min_size=1, max_size=40)).map(
            lambda parts: tuple((parts[0] + parts[1])[-max_prompt:]))
        job = st.builds(Job, prompt=prompt, params=sampling_params(max_tokens), arrival_step=st.integers(0, 12),
                        cancel_step=st.none() | st.integers(0, 10))
        return st.lists(job, min_size=1, max_size=max_jobs)

    systems = st.lists(st.lists(token, min_size=40, max_size=160), min_size=1, max_size=3)
    return st.tuples(systems.flatmap(jobs_on), st.integers(1, 6), schedules())


class Engines:
    """One serial engine and one batched engine per max_batch_size, on the same checkpoint and
    options (`options`: backend options; `engine_args`: backend, op_overrides, ...); one more serial
    engine per other way of cutting prompts (chunk size, snapshot interval) a workload runs on.
    `batched_args`: EngineArgs of the batched engines only (tensor_parallel_size=2: the batched runs
    are sharded, their references single-process)."""

    def __init__(self, path: str | Path, max_seq_len: int = MAX_SEQ_LEN, engine_args: Mapping[str, Any] | None = None,
                 batched_args: Mapping[str, Any] | None = None, **options: Any) -> None:
        self.path = str(path)
        self.options = options
        self.engine_args = dict(engine_args or {})
        self.batched_args = dict(batched_args or {})
        self.max_seq_len = max_seq_len
        self.serial = self._engine(self.options)
        self.batched: dict[int, LLM] = {}
        self._cut_serial: dict[tuple[int, int], LLM] = {}
        self.serial_cache: dict[tuple, tuple[list[int], list[float]]] = {}

    def _engine(self, options: dict[str, Any], batched: bool = False) -> LLM:
        args = {**self.engine_args, **self.batched_args} if batched else self.engine_args
        return LLM(EngineArgs(model=self.path, max_seq_len=self.max_seq_len, backend_options=options, **args))

    def scheduler(self, max_batch_size: int) -> Any:
        if max_batch_size not in self.batched:
            self.batched[max_batch_size] = self._engine({**self.options, "enable_batching": True,
                                                         "max_batch_size": max_batch_size,
                                                         "background_thread": False}, batched=True)
        return self.batched[max_batch_size].scheduler

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

    def serial_output(self, job: Job, policy: PrefillPolicy | None = None) -> tuple[list[int], list[float]]:
        """The job run alone, cold, in serial mode, its prompt cut as `policy` cuts it."""
        llm = self._serial_for(policy)
        key = (job.prompt, job.params, llm.policy.chunk_size, llm.policy.snapshot_interval)
        if key not in self.serial_cache:
            result = llm.generate(prompt_tokens=list(job.prompt), sampling_params=job.params)
            if result.finish_reason not in ("stop", "length"):
                raise AssertionError(f"serial run ended {result.finish_reason}: {result.error}")
            self.serial_cache[key] = (result.token_ids, result.logprobs)
        return self.serial_cache[key]

    def close(self) -> None:
        for llm in [self.serial, *self.batched.values(), *self._cut_serial.values()]:
            llm.close()


def as_policy(schedule: Schedule | PrefillPolicy, max_batch_size: int, max_seq_len: int) -> PrefillPolicy:
    return schedule.policy(max_batch_size, max_seq_len) if isinstance(schedule, Schedule) else schedule


def run_batched(engines: Engines, workload: list[Job], max_batch_size: int,
                schedule: Schedule | PrefillPolicy | None = None) -> dict[int, GenerationResult]:
    """Drive the scheduler step by step: submit each job at its arrival step, cancel it when due.
    `schedule`: the policy to run on (the engine's own when None). What slots hold from earlier
    workloads stays reusable while the reuse grid is unchanged: retained donors too."""
    scheduler = engines.scheduler(max_batch_size)
    if schedule is not None:
        scheduler.configure(as_policy(schedule, max_batch_size, engines.max_seq_len))
    ids: dict[int, int] = {}
    step = 0
    while len(ids) < len(workload) or scheduler.has_work:
        for index, job in enumerate(workload):
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
    if engines.batched[max_batch_size].slots.num_free != max_batch_size:
        raise AssertionError("slots still held after every request ended")
    return results


def mismatches(engines: Engines, workload: list[Job], max_batch_size: int,
               schedule: Schedule | PrefillPolicy | None = None) -> list[str]:
    """Differences between batched and serial outputs; a cancelled request's partial output must
    be a prefix of its serial output."""
    found = []
    policy = None if schedule is None else as_policy(schedule, max_batch_size, engines.max_seq_len)
    for index, result in run_batched(engines, workload, max_batch_size, policy).items():
        tokens, logprobs = engines.serial_output(workload[index], policy)
        n = len(result.token_ids) if result.finish_reason == "cancelled" else len(tokens)  # a prefix if cancelled
        if result.token_ids != tokens[:n] or result.logprobs != logprobs[:n]:
            found.append(f"job {index}: batched {result.token_ids} {result.logprobs} != serial {tokens} {logprobs}")
    return found


@contextmanager
def quiet_engine() -> Iterator[None]:
    """The engine's logs and warnings held back while the lab drives it: a variant that breaks
    every step would have each failed forward logged with its traceback, and each engine's
    start-up probe warn, hundreds of lines, where the verdict says what failed first."""
    package_logger = logging.getLogger("pocketllm")
    level = package_logger.level
    package_logger.setLevel(logging.CRITICAL + 1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            yield
    finally:
        package_logger.setLevel(level)


def engine_property(overrides: Mapping[str, ImplSpec], preset: str, examples: int,
                    backend: Backend = DEFAULT_BACKEND) -> str | None:
    """Run the invariance property on `preset` with `overrides` installed; None when it holds,
    else the shrunk counterexample."""
    path = cached_checkpoint(preset)
    engines = Engines(path, engine_args={"backend": backend, "op_overrides": dict(overrides)})
    vocab = engines.serial.model_config.vocab_size
    failure: list[str] = []

    @settings(max_examples=examples, deadline=None, database=None, derandomize=True, report_multiple_bugs=False,
              suppress_health_check=list(HealthCheck))
    @given(workload=workloads(min(vocab, 256), max_prompt=40, max_jobs=8))
    def holds(workload: tuple[list[Job], int]) -> None:
        try:
            found = mismatches(engines, *workload)
        except AssertionError as exc:  # a serial run that failed, a request left without a result
            found = [str(exc)]
        if found:
            failure[:] = [f"max_batch_size {workload[1]}, {len(workload[0])} jobs: {found[0]}"]
            raise AssertionError(found[0])

    try:
        holds()
    except AssertionError:
        return failure[-1] if failure else "the property failed"
    finally:
        engines.close()
    return None


@torch.inference_mode()
def greedy_parity(overrides: Mapping[str, ImplSpec], preset: str, prompts: int = 3, new_tokens: int = 16,
                  backend: Backend = DEFAULT_BACKEND) -> str | None:
    """Greedy tokens of pocketllm (fp32, `overrides` installed) == transformers' (eager, fp32)
    on `prompts` random prompts; None when all agree, else the first divergence."""
    import transformers

    path = cached_checkpoint(preset)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    hf.eval()
    llm = LLM(EngineArgs(model=str(path), max_seq_len=128, backend=backend, op_overrides=dict(overrides)))
    gen = torch.Generator().manual_seed(0)
    config = transformers.GenerationConfig(do_sample=False, max_new_tokens=new_tokens, eos_token_id=None,
                                           pad_token_id=0)
    hf.generation_config.eos_token_id = None
    for length in (1, 9, 70)[:prompts]:
        prompt = torch.randint(0, llm.model_config.vocab_size, (length,), generator=gen).tolist()
        want = hf.generate(torch.tensor([prompt]), generation_config=config)[0, length:].tolist()
        result = llm.generate(prompt_tokens=prompt, sampling_params=SamplingParams(
            max_tokens=new_tokens, temperature=0.0, ignore_eos=True))
        if result.finish_reason != "length":
            return f"prompt of {length} tokens: the run ended {result.finish_reason}: {result.error}"
        got = result.token_ids
        if got != want:
            at = next(i for i, (a, b) in enumerate(zip(got, want)) if a != b)
            return f"prompt of {length} tokens: token {at} is {got[at]}, transformers gives {want[at]}"
    return None
