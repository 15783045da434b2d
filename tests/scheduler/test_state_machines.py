"""The scheduler's public API driven by Hypothesis state machines, caller-driven and with the
background thread: rules submit (with callbacks that call back into the scheduler), cancel,
preempt, poll, stream, generate, configure, step and stop/drain; after every rule, each request is
in exactly one state and (caller-driven) the slots and swap space are accounted; at the end every
request has ended once, is collectable, its deltas are its tokens, in order, before its result, its
streamed text is its text, and its tokens and logprobs are the bits of its cold serial run (a
prefix of them if it was cancelled)."""

from __future__ import annotations

import contextlib
import threading
import time

import pytest
from helpers import budget
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pocketllm import LLM, EngineArgs, GenerationResult, QueueFullError, SamplingParams, SwapSpaceError
from pocketllm.scheduler import PrefillPolicy

from .harness import swap_size

# A generator's finally that raises is only an "unraisable" warning: here it fails the test.
pytestmark = pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")

OPTIONS = {"max_batch_size": 2, "prefill_chunk_size": 64, "state_snapshot_interval": 64,
           "max_num_batched_tokens": 80, "max_waiting": 4}
MAX_SEQ_LEN = 160
BASES = [[(7 * i + 3) % 256 for i in range(100)], [(11 * i + 5) % 256 for i in range(90)]]  # shared prefixes

prompts = st.one_of(
    st.lists(st.integers(0, 255), min_size=1, max_size=12),
    st.tuples(st.sampled_from(range(len(BASES))), st.integers(65, 90), st.lists(st.integers(0, 255), max_size=20))
    .map(lambda t: BASES[t[0]][:t[1]] + t[2]),
)
params = st.builds(SamplingParams, max_tokens=st.integers(1, 12), temperature=st.sampled_from([0.0, 1.0]),
                   top_k=st.sampled_from([0, 20]), top_p=st.sampled_from([1.0, 0.8]), seed=st.integers(0, 2**32),
                   ignore_eos=st.booleans())
CALLBACK_ACTIONS = ["record", "cancel_other", "submit_more", "generate", "poll_self"]


class _Reference:
    """Cold serial runs, one engine per exact_positions option (None: the backend's default) for the
    whole test session, cached by (prompt, params)."""

    def __init__(self) -> None:
        self.llms: dict[bool | None, LLM] = {}
        self.runs: dict = {}

    def __call__(self, path, prompt: list[int], p: SamplingParams, exact: bool | None = None) -> GenerationResult:
        if exact not in self.llms:
            self.llms[exact] = LLM(EngineArgs(model=str(path), max_seq_len=MAX_SEQ_LEN, backend_options={
                "prefill_chunk_size": OPTIONS["prefill_chunk_size"],
                "state_snapshot_interval": OPTIONS["state_snapshot_interval"], "exact_positions": exact}))
        key = (tuple(prompt), p, exact)
        if key not in self.runs:
            self.runs[key] = self.llms[exact].generate(prompt, p)
        return self.runs[key]


REFERENCE = _Reference()
# The rules that act on an open request: caller-driven, only while one is open; with the thread,
# always (which are open depends on timing, see SchedulerMachine._pick).
_something_to_pick = precondition(lambda self: self.background or self._open())


class SchedulerMachine(RuleBasedStateMachine):
    background = False
    checkpoint = None  # set by the test
    options: dict = {}  # more backend options (and its reference's exact_positions)

    def __init__(self) -> None:
        super().__init__()
        self.llm = LLM(EngineArgs(model=str(self.checkpoint), max_seq_len=MAX_SEQ_LEN, backend_options={
            "enable_batching": True, "background_thread": self.background, **OPTIONS, **self.options,
            # A long request's and a short one's worth of swap space, so preempt() is refused sometimes.
            "max_swap_bytes": swap_size(self.checkpoint, 120) + swap_size(self.checkpoint, 30)}))
        self.s = self.llm.scheduler
        self.mutex = threading.RLock()  # what the callbacks record, against the invariants' reads
        self.specs: dict[int, tuple[list[int], SamplingParams]] = {}
        self.collected: dict[int, GenerationResult | None] = {}  # None: collected where we cannot see it
        # on_token deltas, then the result, in delivery order (from the first delivery: with the thread,
        # a blocking submission's request can be delivered to before submit_request returns)
        self.pushed: dict[int, list] = {}
        self.stopped = False
        self.rules_run = 0

    # -- helpers --------------------------------------------------------------------------------

    def _callbacks(self, action: str):
        """on_token and a result callback that records, then does `action` on the scheduler."""
        box: dict = {}

        def on_token(delta):
            with self.mutex:
                self.pushed.setdefault(delta.request_id, []).append(delta)

        def callback(result: GenerationResult) -> None:
            with self.mutex:
                self.pushed.setdefault(result.request_id, []).append(result)
                others = [i for i in self.specs if i != result.request_id and i not in self.collected]
            try:
                if action == "cancel_other" and others:
                    self.s.cancel_request(others[-1])
                elif action == "submit_more":
                    self._submit([5, 6, 7], SamplingParams(max_tokens=2, temperature=0.0, seed=1), "record", 0)
                elif action in ("generate", "poll_self"):
                    with self.mutex:  # the invariants see the request submitted and collected at once
                        if action == "generate":
                            spec = ([9, 8], SamplingParams(max_tokens=2, temperature=0.0, seed=2))
                            self._collect_seen(self.s.generate([spec])[0], spec)
                        else:
                            with contextlib.suppress(KeyError):  # a rule's poll on the main thread took it first
                                self._collect(result.request_id, self.s.poll_result(result.request_id))
            except RuntimeError as exc:  # stopped meanwhile: refused, nothing queued
                assert "stopped" in str(exc)

        box.update(on_token=on_token, callback=callback)
        return box

    def _submit(self, prompt, p, action, wait_ms) -> None:
        """Submit and record. A submission that may wait does so without the mutex (the callbacks
        that make room need it); no invariant runs meanwhile, as only a rule waits."""
        callbacks = self._callbacks(action)
        if wait_ms is None:
            rid = self.s.submit_request(prompt, p, wait_ms=None, **callbacks)
            with self.mutex:  # the thread may have delivered its first tokens already
                self.specs[rid] = (prompt, p)
                self.pushed.setdefault(rid, [])
            return
        with self.mutex:
            try:
                rid = self.s.submit_request(prompt, p, wait_ms=0, **callbacks)
            except QueueFullError:
                return
            self.specs[rid], self.pushed[rid] = (prompt, p), []

    def _collect(self, rid: int, result: GenerationResult | None) -> None:
        with self.mutex:
            assert rid not in self.collected, f"request {rid} collected twice"
            self.collected[rid] = result

    def _collect_seen(self, result: GenerationResult, spec) -> None:
        with self.mutex:
            self.specs.setdefault(result.request_id, spec)
            self.pushed.setdefault(result.request_id, [])
            self._collect(result.request_id, result)

    def _open(self) -> list[int]:
        with self.mutex:
            return [i for i in self.specs if i not in self.collected]

    def _pick(self, data, among: list[int]) -> int | None:
        """One of `among` (None if empty), drawn the same way whatever `among` holds: with the thread,
        which requests are still open depends on timing, and Hypothesis needs every run's draws to
        follow from its earlier draws alone (else: FlakyStrategyDefinition)."""
        index = data.draw(st.integers(0, 63))
        return among[index % len(among)] if among else None

    # -- rules ----------------------------------------------------------------------------------

    @rule(prompt=prompts, p=params, action=st.sampled_from(CALLBACK_ACTIONS), priority=st.integers(-1, 1),
          wait=st.sampled_from([0, None]))
    def submit(self, prompt, p, action, priority, wait):
        if self.stopped:
            with pytest.raises(RuntimeError, match="stopped"):
                self.s.submit_request(prompt, p)
            return
        if wait is None and not self.background:
            wait = 0  # caller-driven, a wait without end steps on this thread: covered by `generate`
        self._submit(prompt, p, action, wait)

    @_something_to_pick
    @rule(data=st.data())
    def cancel(self, data):
        rid = self._pick(data, self._open())
        if rid is not None:
            self.s.cancel_request(rid)

    @_something_to_pick
    @rule(data=st.data())
    def preempt(self, data):
        """Caller-driven, one step first, so that a request may be running; with the thread, a
        request that has tokens and no result yet is likely running."""
        if not self.background and not self.stopped:
            self.s.step()
        open_ids = self._open()
        with self.mutex:
            running = [i for i in open_ids if self.pushed[i] and not isinstance(self.pushed[i][-1], GenerationResult)]
        rid = self._pick(data, running or open_ids)
        if rid is not None:
            with contextlib.suppress(SwapSpaceError):
                self.s.preempt(rid)

    @_something_to_pick
    @rule(data=st.data(), wait=st.sampled_from([0, None]))
    def poll(self, data, wait):
        rid = self._pick(data, self._open())
        if rid is None:
            return
        try:
            result = self.s.poll_result(rid, timeout_ms=wait)
        except KeyError:  # a callback collected it meanwhile
            with self.mutex:
                assert rid in self.collected
            return
        if result is not None:
            self._collect(rid, result)

    @_something_to_pick
    @rule(data=st.data(), take=st.one_of(st.none(), st.integers(0, 3)))
    def stream(self, data, take):
        """Pull a request's deltas: all of them and its result, or `take` and leave (which cancels it)."""
        rid = self._pick(data, self._open())
        if rid is None:
            return
        deltas = []
        try:
            for item in self.s.stream(rid):
                if isinstance(item, GenerationResult):
                    self._collect(rid, item)
                    self._check_deltas(deltas, item)
                    return
                deltas.append(item)
                if take is not None and len(deltas) >= take:
                    break
        except KeyError:  # a callback collected it meanwhile
            with self.mutex:
                assert rid in self.collected
            return
        if rid not in self.collected:
            self._collect(rid, None)  # left early: the stream cancelled and collected it

    @rule(batch=st.lists(st.tuples(prompts, params), min_size=1, max_size=4))
    def generate(self, batch):
        """More prompts than max_waiting get through too; each result is collected here."""
        if self.stopped:
            with pytest.raises(RuntimeError, match="stopped"):
                self.s.generate(batch)
            return
        try:
            results = self.s.generate(batch)
        except RuntimeError:  # a callback stopped the scheduler meanwhile: nothing is left over
            return
        for result, spec in zip(results, batch):
            self._collect_seen(result, spec)

    @rule(budget_tokens=st.integers(60, 120), reuse=st.booleans(), bad=st.sampled_from([None, "float", "small"]))
    def configure(self, budget_tokens, reuse, bad):
        """A policy is checked whoever builds it; a refused one leaves the scheduler as it was."""
        before = self.s.policy
        if bad == "float":
            with pytest.raises(TypeError):
                self.s.configure(PrefillPolicy(float(budget_tokens), 64, 64, reuse))
        elif bad == "small":
            with pytest.raises(ValueError):
                self.s.configure(PrefillPolicy(1, 64, 64, reuse))  # under 2 decode rows: refused, exact or not
        else:
            policy = PrefillPolicy(max(budget_tokens, 65), 64, 64, reuse)
            try:
                self.s.configure(policy)
                before = policy
            except RuntimeError as exc:  # not idle
                assert "idle" in str(exc)
        assert self.s.policy == before

    @precondition(lambda self: self.rules_run >= 12)  # late in a run: most runs see the scheduler live
    @rule(drain=st.booleans())
    def stop(self, drain):
        self.s.stop(drain=drain)
        self.stopped = True

    # -- what always holds ------------------------------------------------------------------------

    @invariant()
    def each_request_in_exactly_one_state(self):
        self.rules_run += 1
        with self.mutex:
            stats = self.s.get_stats()
            assert stats.waiting + stats.running + stats.uncollected == len(self.specs) - len(self.collected)
            assert stats.errored == stats.callback_errors == 0

    def _check_deltas(self, deltas, result: GenerationResult) -> None:
        assert [d.index for d in deltas] == list(range(len(result.token_ids)))
        assert [(d.token_id, d.logprob) for d in deltas] == list(zip(result.token_ids, result.logprobs))
        if result.text is not None:
            assert "".join(d.text for d in deltas) == result.text

    def _check_bits(self, rid: int, result: GenerationResult) -> None:
        prompt, p = self.specs[rid]
        cold = REFERENCE(self.checkpoint, prompt, p, self.options.get("exact_positions"))
        n = len(result.token_ids)
        if result.finish_reason == "cancelled":
            assert (result.token_ids, result.logprobs) == (cold.token_ids[:n], cold.logprobs[:n])
        else:
            assert result.finish_reason == cold.finish_reason
            assert (result.token_ids, result.logprobs) == (cold.token_ids, cold.logprobs)

    def teardown(self):
        try:
            if not self.stopped:
                self.s.stop(drain=True)
            for rid in self._open():
                self._collect(rid, self.s.poll_result(rid))
            stats = self.s.get_stats()
            assert (stats.waiting, stats.running, stats.uncollected, stats.swap_bytes_held) == (0, 0, 0, 0)
            assert self.llm.slots.num_free == self.llm.cache.num_slots and self.s.slots.swap_reserved == 0
            with self.mutex:
                for rid, items in self.pushed.items():
                    if not items:  # no callbacks (generate() from a rule)
                        continue
                    *deltas, result = items
                    assert isinstance(result, GenerationResult), f"request {rid}: a delta after its result"
                    self._check_deltas(deltas, result)
                    self._check_bits(rid, result)
                for rid, result in self.collected.items():
                    if result is not None:
                        self._check_bits(rid, result)
        finally:
            self.llm.close()


class CallerDrivenMachine(SchedulerMachine):
    background = False

    @rule(n=st.integers(1, 4))
    def step(self, n):
        for _ in range(n):
            self.s.step()

    @invariant()
    def slots_and_swap_accounted(self):
        stats = self.s.get_stats()
        assert self.llm.slots.num_free == self.llm.cache.num_slots - stats.running
        if stats.swapped_out == 0:
            assert stats.swap_bytes_held == 0
        assert stats.swap_bytes_held + self.s.slots.swap_reserved <= self.s.planner.max_swap_bytes


class BackgroundMachine(SchedulerMachine):
    background = True

    def __init__(self) -> None:
        super().__init__()
        real = self.llm.runner.run

        def run(seqs):  # a forward of a millisecond at least: rules land while requests run
            time.sleep(0.001)
            return real(seqs)

        self.llm.runner.run = run

    @rule()
    def settle(self):
        """Wait (bounded) for the thread to run out of work, then account for slots and swap space."""
        deadline = time.monotonic() + 30
        while self.s.has_work:
            assert time.monotonic() < deadline, "the scheduler thread did not run out of work"
            time.sleep(0.002)
        stats = self.s.get_stats()
        assert stats.running == stats.swapped_out == stats.swap_bytes_held == 0
        assert self.llm.slots.num_free == self.llm.cache.num_slots


def _run(machine: type[SchedulerMachine], checkpoint, fraction: float = 0.5) -> None:
    machine.checkpoint = checkpoint
    machine.TestCase.settings = settings(settings(), max_examples=budget(fraction), stateful_step_count=25)
    machine.TestCase().runTest()


def test_caller_driven_scheduler_keeps_every_promise(tiny_checkpoint):
    _run(CallerDrivenMachine, tiny_checkpoint)


def test_scheduler_with_its_thread_keeps_every_promise(tiny_checkpoint):
    _run(BackgroundMachine, tiny_checkpoint)


def test_the_machines_checks_catch_what_they_are_for(tiny_checkpoint):
    """The end-of-run checks fail on a logprob one ulp off, a token missing from the cancelled
    prefix, a delta out of order and text that does not add up."""
    import math

    machine = SchedulerMachine.__new__(SchedulerMachine)
    machine.checkpoint = tiny_checkpoint
    prompt, p = BASES[0][:80], SamplingParams(max_tokens=4, temperature=0.0, seed=0, ignore_eos=True)
    machine.specs = {0: (prompt, p)}
    cold = REFERENCE(tiny_checkpoint, prompt, p)
    machine._check_bits(0, cold)
    nudged = list(cold.logprobs)
    nudged[-1] = math.nextafter(nudged[-1], 0.0)
    bad = [(cold.finish_reason, cold.token_ids, nudged), ("cancelled", cold.token_ids[1:], cold.logprobs[1:])]
    for reason, tokens, logprobs in bad:
        with pytest.raises(AssertionError):
            machine._check_bits(0, GenerationResult(0, prompt, tokens, logprobs, reason))
    from pocketllm import TokenDelta

    deltas = [TokenDelta(0, i, t, lp, text="x") for i, (t, lp) in enumerate(zip(cold.token_ids, cold.logprobs))]
    result = GenerationResult(0, prompt, cold.token_ids, cold.logprobs, "length", text="x" * len(deltas))
    machine._check_deltas(deltas, result)
    for broken in (deltas[::-1], deltas[:-1], deltas[:-1] + [TokenDelta(0, len(deltas) - 1, 0, 0.0, text="y")]):
        with pytest.raises(AssertionError):
            machine._check_deltas(broken, result)
