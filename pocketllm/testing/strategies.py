"""Hypothesis strategies for property tests of the engine's contract.

Each draws what one example of a property needs: sampling parameters (greedy, seeded, top-k and
top-p at their boundaries), prompts over a vocabulary, request streams (`Workload`: jobs with arrival
steps, shared system prompts, cancellations, priorities and forced preemptions, and the number of
slots), scheduler budgets and cuts (`Schedule`), model presets (random checkpoints, written once and
cached) and per-op case grids (the kernel lab's odd lengths, GQA ratios, head dims, NaN beyond each
sequence). Everything a strategy draws has a repr that is Python: a shrunk counterexample pastes
into a reproduction as it is printed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hypothesis import strategies as st

from ..models import PRESETS, cached_checkpoint
from ..sampling import MAX_SEED, SamplingParams
from ..scheduler import PrefillPolicy
from . import _checks as check


@dataclass(frozen=True)
class Job:
    """One request of a workload: its prompt and sampling parameters, the scheduler step it arrives
    at, and when (steps after arrival) it is cancelled (None: never), its priority (lower runs first)
    and the steps after arrival at which it is preempted if it runs then."""

    prompt: tuple[int, ...]
    params: SamplingParams
    arrival_step: int = 0
    cancel_step: int | None = None
    priority: int = 0
    preempt_steps: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        """A prompt must be a tuple: the serial runs are cached by it, and the repr is a reproduction."""
        check.int_items("Job", "prompt", self.prompt, 0, "a non-empty tuple of token ids", (tuple,), 1)
        check.instance("Job", "params", self.params, SamplingParams, "a SamplingParams")
        check.integer("Job", "arrival_step", self.arrival_step, 0)
        check.optional_int("Job", "cancel_step", self.cancel_step, 0)
        check.integer("Job", "priority", self.priority)
        check.int_items("Job", "preempt_steps", self.preempt_steps, 0, "a tuple of steps after arrival (ints >= 0)")


@dataclass(frozen=True)
class Schedule:
    """A scheduler policy drawn for one example; the token budget is the least the configuration
    allows plus `budget_slack`."""

    chunk_size: int
    snapshot_interval: int
    budget_slack: int
    prefix_reuse: bool

    def __post_init__(self) -> None:
        """Cuts a PrefillPolicy refuses are refused here, when drawn or written, not when first run."""
        check.integer("Schedule", "budget_slack", self.budget_slack, 0)
        try:
            PrefillPolicy(1, self.chunk_size, self.snapshot_interval, self.prefix_reuse)
        except (TypeError, ValueError) as exc:
            raise type(exc)(f"Schedule: {exc}") from None

    def policy(self, max_batch_size: int, max_seq_len: int) -> PrefillPolicy:
        check.positive("Schedule.policy", max_batch_size=max_batch_size, max_seq_len=max_seq_len)
        piece = PrefillPolicy(1, self.chunk_size, self.snapshot_interval).max_piece(max_seq_len)
        return PrefillPolicy(piece + max_batch_size - 1 + self.budget_slack, self.chunk_size, self.snapshot_interval,
                             self.prefix_reuse)


@dataclass(frozen=True)
class Workload:
    """Jobs run together through the batch scheduler with `max_batch_size` slots, on `schedule`
    (a drawn Schedule, a PrefillPolicy, or None: the engine's own policy)."""

    jobs: tuple[Job, ...]
    max_batch_size: int
    schedule: Schedule | PrefillPolicy | None = None

    def __post_init__(self) -> None:
        """An empty workload would pass every assertion without running anything."""
        check.items("Workload", "jobs", self.jobs, "a non-empty tuple of Job")
        check.each("Workload", "jobs", self.jobs, Job, "a Job")
        check.positive("Workload", max_batch_size=self.max_batch_size)
        check.instance("Workload", "schedule", self.schedule, (Schedule, PrefillPolicy, type(None)),
                       "a Schedule, a PrefillPolicy or None")


# Boundary values of each sampling field beside ordinary ones: greedy and the smallest temperature
# that samples, top-k 1 (greedy by another road) and past any vocabulary, top-p just below 1 and tiny.
TEMPERATURES = (0.0, 0.0, 1e-5, 0.5, 1.0, 1.7)
TOP_KS = (0, 0, 1, 5, 40, 2**31)
TOP_PS = (1.0, 1.0, 0.9, 0.5, 1e-6, 0.99999994)


def sampling_params(max_tokens: int = 24, logprobs: bool = False) -> st.SearchStrategy[SamplingParams]:
    """Greedy and seeded sampling with temperature, top-k and top-p (ordinary and boundary values),
    1..max_tokens new tokens, EOS honoured or not; with `logprobs`, 0..5 alternatives per token too."""
    check.positive("sampling_params", max_tokens=max_tokens)
    check.flag("sampling_params", "logprobs", logprobs)
    return st.builds(SamplingParams, max_tokens=st.integers(1, max_tokens), temperature=st.sampled_from(TEMPERATURES),
                     top_k=st.sampled_from(TOP_KS), top_p=st.sampled_from(TOP_PS), seed=st.integers(0, MAX_SEED),
                     ignore_eos=st.booleans(), logprobs=st.none() | st.integers(0, 5) if logprobs else st.none())


def prompts(vocab: int, max_len: int = 64, min_len: int = 1) -> st.SearchStrategy[tuple[int, ...]]:
    """Token ids below `vocab`, min_len..max_len of them."""
    check.positive("prompts", vocab=vocab)
    check.integer("prompts", "min_len", min_len, 0)
    check.integer("prompts", "max_len", max_len, max(1, min_len), rule=f"an int >= 1 and >= min_len ({min_len})")
    return st.lists(st.integers(0, vocab - 1), min_size=min_len, max_size=max_len).map(tuple)


def request_streams(vocab: int, max_prompt: int = 64, max_jobs: int = 12, max_tokens: int = 24,
                    max_batch_size: int = 8, system_prompts: bool = False, priorities: bool = False,
                    preemptions: int | None = None, schedule: bool = False,
                    params: st.SearchStrategy[SamplingParams] | None = None,
                    repetitive: bool = False) -> st.SearchStrategy[Workload]:
    """Workloads: 1..max_jobs jobs arriving at steps 0..12, some cancelled, on 1..max_batch_size slots.
    `system_prompts`: prompts start with one of a few shared prefixes (40 to 160 tokens) or none, then
    1..40 tokens of their own (prefix reuse gets work). `priorities`: priorities 0..2, so later, more
    urgent requests preempt running ones when the slots are full. `preemptions`: besides, each job is
    preempted at `preemptions`..3 random steps, and half the prompts span several prefill pieces.
    `schedule`: a drawn Schedule (budgets, chunk sizes, snapshot intervals, reuse) to run on.
    `repetitive`: half the prompts repeat a short pattern (n-gram drafts find matches)."""
    where = "request_streams"
    check.positive(where, vocab=vocab, max_prompt=max_prompt, max_jobs=max_jobs, max_tokens=max_tokens,
                   max_batch_size=max_batch_size)
    for name, value in (("system_prompts", system_prompts), ("priorities", priorities), ("schedule", schedule),
                        ("repetitive", repetitive)):
        check.flag(where, name, value)
    check.optional_int(where, "preemptions", preemptions, 0)
    if params is not None:
        check.instance(where, "params", params, st.SearchStrategy,
                       "None or a Hypothesis strategy of SamplingParams (a fixed one: hypothesis.strategies.just(...))")
    token = st.integers(0, vocab - 1)
    job_params = params if params is not None else sampling_params(max_tokens)
    preempt = (st.lists(st.integers(1, 14), min_size=preemptions, max_size=max(preemptions, 3)).map(tuple)
               if preemptions is not None else st.just(()))

    def jobs_on(systems: list[tuple[int, ...]]) -> st.SearchStrategy[tuple[Job, ...]]:
        if system_prompts:
            prompt = st.tuples(st.sampled_from([*systems, ()]), st.lists(token, min_size=1, max_size=40)).map(
                lambda parts: (parts[0] + tuple(parts[1]))[-max_prompt:])
        elif preemptions is not None:  # half the prompts span several pieces: swaps between pieces too
            prompt = prompts(vocab, max_prompt) | prompts(vocab, max_prompt, min_len=min(65, max_prompt))
        else:
            prompt = prompts(vocab, max_prompt)
        if repetitive:
            prompt = prompt | repetitive_prompts(vocab, max_prompt)
        job = st.builds(Job, prompt=prompt, params=job_params, arrival_step=st.integers(0, 12),
                        cancel_step=st.none() | st.integers(0, 10),
                        priority=st.integers(0, 2) if priorities else st.just(0), preempt_steps=preempt)
        return st.lists(job, min_size=1, max_size=max_jobs).map(tuple)

    systems = st.lists(prompts(vocab, 160, min_len=40), min_size=1, max_size=3) if system_prompts else st.just([])
    return st.builds(Workload, systems.flatmap(jobs_on), st.integers(1, max_batch_size),
                     schedules() if schedule else st.none())


def repetitive_prompts(vocab: int, max_len: int = 64) -> st.SearchStrategy[tuple[int, ...]]:
    """A pattern of 1..6 token ids below `vocab` repeated up to max_len tokens, then 0..3 of its own:
    prompts on which a prompt lookup (n-gram drafts) finds matches, right or wrong."""
    check.positive("repetitive_prompts", vocab=vocab, max_len=max_len)
    token = st.integers(0, vocab - 1)
    return st.tuples(st.lists(token, min_size=1, max_size=6), st.integers(1, max_len),
                     st.lists(token, max_size=3)).map(
        lambda parts: tuple((parts[0] * max_len)[:parts[1]] + parts[2])[:max_len])


def speculation_workloads(vocab: int, max_prompt: int = 64, max_jobs: int = 6, max_tokens: int = 24
                          ) -> st.SearchStrategy[Workload]:
    """Repetitive and random prompts, priorities, forced preemptions and logprobs on 1..4 slots, on a
    drawn Schedule: the runs a speculating engine must give the bits of one that does not."""
    check.positive("speculation_workloads", vocab=vocab, max_prompt=max_prompt, max_jobs=max_jobs,
                   max_tokens=max_tokens)
    return request_streams(vocab, max_prompt, max_jobs, max_tokens, max_batch_size=4, priorities=True,
                           preemptions=0, schedule=True, params=sampling_params(max_tokens, logprobs=True),
                           repetitive=True)


def workloads(vocab: int, max_prompt: int = 64, max_jobs: int = 12, max_tokens: int = 24
              ) -> st.SearchStrategy[Workload]:
    """Jobs with arrivals and cancellations on 1..8 slots, on the engine's own policy."""
    check.positive("workloads", vocab=vocab, max_prompt=max_prompt, max_jobs=max_jobs, max_tokens=max_tokens)
    return request_streams(vocab, max_prompt, max_jobs, max_tokens)


def prefix_workloads(vocab: int, max_prompt: int = 200, max_jobs: int = 8, max_tokens: int = 12
                     ) -> st.SearchStrategy[Workload]:
    """Shared system prompts, arrivals and cancellations on 1..6 slots, on a drawn Schedule."""
    check.positive("prefix_workloads", vocab=vocab, max_prompt=max_prompt, max_jobs=max_jobs, max_tokens=max_tokens)
    return request_streams(vocab, max_prompt, max_jobs, max_tokens, max_batch_size=6, system_prompts=True,
                           schedule=True)


def preemption_workloads(vocab: int, max_prompt: int = 150, max_jobs: int = 8, max_tokens: int = 16,
                         min_preempts: int = 0) -> st.SearchStrategy[Workload]:
    """Priorities and forced preemptions (`min_preempts`..3 per job) on 1..4 slots, on a drawn
    Schedule; whether a preemption swaps or recomputes is the engine's option."""
    check.positive("preemption_workloads", vocab=vocab, max_prompt=max_prompt, max_jobs=max_jobs,
                   max_tokens=max_tokens)
    check.integer("preemption_workloads", "min_preempts", min_preempts, 0)
    return request_streams(vocab, max_prompt, max_jobs, max_tokens, max_batch_size=4, priorities=True,
                           preemptions=min_preempts, schedule=True)


def schedules() -> st.SearchStrategy[Schedule]:
    """Chunk sizes (0: uncut), snapshot intervals, budgets from the tightest allowed up, reuse on or off."""
    return st.builds(Schedule, chunk_size=st.sampled_from([0, 64, 128]), snapshot_interval=st.sampled_from([64, 128]),
                     budget_slack=st.sampled_from([0, 1, 7, 300]), prefix_reuse=st.sampled_from([True, True, False]))


def checkpoints(presets: tuple[str, ...] = ("tiny", "qwen3.5-tiny"), seed: int = 0) -> st.SearchStrategy[Path]:
    """Paths of random-weight checkpoints of `presets` (see `pocketllm.PRESETS`), each written once
    into the checkpoint cache (`$POCKETLLM_CACHE`) and reused by every later example and run."""
    check.items("checkpoints", "presets", presets, "a non-empty tuple of preset names")
    for index, preset in enumerate(presets):
        check.one_of("checkpoints", f"presets[{index}]", preset, sorted(PRESETS))
    check.integer("checkpoints", "seed", seed, 0)
    return st.sampled_from(presets).map(lambda preset: cached_checkpoint(preset, seed))


def op_cases(op: str, dtypes: tuple[str, ...] = ("float32",)) -> st.SearchStrategy:
    """The points of `op`'s case grid (the kernel lab's: odd lengths, GQA ratios, head dims, empty and
    one-row batches, NaN beyond each sequence) in `dtypes`, as `pocketllm.testing.cases.Case`s."""
    check.op_name("op_cases", op)
    check.dtype_names("op_cases", "dtypes", dtypes)
    import torch

    from .cases import op_cases as grid

    cases = grid(op, tuple(getattr(torch, name) for name in dtypes))
    return st.sampled_from(cases)
