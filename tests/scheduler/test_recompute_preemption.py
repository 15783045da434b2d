"""Preemption by recompute (`preemption_mode="recompute"`): a preempted request gives its slot up and,
once readmitted, prefills its prompt and the tokens it had generated again (reusing what a slot still
holds), then decodes on. With exact positions a re-prefilled position has the bits its decode step
gave, so every request's tokens and logprobs `==` its uninterrupted cold serial run; nothing
delivered is delivered twice, and every request still ends exactly once. Without exact positions the
mode is refused. Negative controls: a recompute that drops the last generated token, or re-prefills
the generated tokens one position late, fails the property."""

from __future__ import annotations

import random

import pytest
from helpers import budget
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import rule

from pocketllm import LLM, EngineArgs, SamplingParams
from pocketllm.sampling import MAX_LOGPROBS
from pocketllm.scheduler import BatchScheduler, Request
from pocketllm.scheduler.stream import TokenDelta
from pocketllm.testing import Engines, Job, Schedule, Workload, assert_batch_invariant, mismatches
from pocketllm.testing.strategies import preemption_workloads

from .test_state_machines import CallerDrivenMachine, _run

VOCAB = 256
MAX_SEQ_LEN = 192
EXACT = {"exact_positions": True, "prefill_chunk_size": 64, "state_snapshot_interval": 64}
SCORE = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=MAX_LOGPROBS)


@pytest.fixture(scope="module")
def engines(checkpoint_dir):
    """Serial and batched engines on the Qwen3 tiny checkpoint, torch backend, exact positions."""
    engines = Engines(checkpoint_dir("tiny"), max_seq_len=MAX_SEQ_LEN, exact_positions=True,
                      preemption_mode="recompute")
    yield engines
    engines.close()


@pytest.fixture(scope="module")
def serial(checkpoint_dir):
    return _engine(checkpoint_dir("tiny"), batched=False)


def _engine(path, batched: bool = True, **options) -> LLM:
    return LLM(EngineArgs(model=str(path), max_seq_len=MAX_SEQ_LEN, backend_options={
        **EXACT, "enable_batching": batched, "background_thread": False, "record_timeline": batched,
        **({"preemption_mode": "recompute"} if batched else {}), **options}))


def _params(tokens: int, seed: int, **extra) -> SamplingParams:
    return SamplingParams(max_tokens=tokens, temperature=0.8, seed=seed, ignore_eos=True, **extra)


def _prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB) for _ in range(length)]


def _step_until(s, done, limit: int = 200) -> None:
    for _ in range(limit):
        if done():
            return
        s.step()
    raise AssertionError("the scheduler did not get there")


# -- the property -------------------------------------------------------------------------------

@settings(max_examples=budget())
@given(workload=preemption_workloads(VOCAB, max_prompt=130, max_jobs=6, max_tokens=12, min_preempts=1))
def test_recompute_preempted_and_prioritised_equals_uninterrupted_serial_bitwise(engines, workload):
    assert_batch_invariant(engines, workload)


# A request preempted at step 4 (max_batch_size 1: two prefill pieces, then 3 tokens sampled), then
# by a more urgent one mid-decode; its re-prefills reuse the 64 positions its old slot still holds.
FIXED = [Job(tuple(_prompt(70, 1)), _params(10, 1), 0, None, priority=1, preempt_steps=(4,)),
         Job(tuple(_prompt(9, 2)), _params(4, 2), 9, None, priority=0)]


def test_the_lab_workload_preempts_by_recompute(engines):
    """What the property relies on: Job.preempt_steps and priorities preempt by recompute here."""
    before = engines.scheduler(1).get_stats()
    assert_batch_invariant(engines, Workload(tuple(FIXED), 1, Schedule(64, 64, 0, True)))
    after = engines.scheduler(1).get_stats()
    assert after.preemptions - before.preemptions == after.recomputes - before.recomputes == 2
    assert after.swapped_bytes == after.swap_bytes_held == 0
    assert after.prefix_tokens_reused - before.prefix_tokens_reused >= 64


def _drop_last_token(self: Request) -> None:
    self.replayed, self.num_prefilled = len(self.token_ids) - 1, 0


def _one_position_late(self: Request) -> list[int]:
    return self.prompt_tokens + self.token_ids[:min(self.replayed, 1)] + self.token_ids[:self.replayed]


@pytest.mark.parametrize("attr,mutant", [("restart", _drop_last_token),
                                         ("prefill_tokens", property(_one_position_late))],
                         ids=["drops_the_last_token", "one_position_late"])
def test_negative_control_a_wrong_recompute_fails_the_property(engines, monkeypatch, attr, mutant):
    """A recompute that re-prefills one generated token too few (the last one sampled again, a
    repeat) or every generated token one position late (other positions, another sampler seed)."""
    monkeypatch.setattr(Request, attr, mutant)
    assert mismatches(engines, Workload(tuple(FIXED), 1, Schedule(64, 64, 0, True))) != []


@pytest.mark.slow
def test_the_triton_backend_preempts_by_recompute_exactly(tiny_checkpoint):
    """Triton (interpreted here; exact positions by default): a request preempted after 2 tokens
    re-prefills from every position its old slot holds (70: its prompt and the first generated
    token; any position, on an attention-only model) and ends with the tokens, logprobs and top
    logprobs of its serial run."""
    def engine(**options) -> LLM:
        return LLM(EngineArgs(model=str(tiny_checkpoint), max_seq_len=96, backend="triton", backend_options={
            "background_thread": False, "prefill_chunk_size": 64, "state_snapshot_interval": 64, **options}))

    prompt, params = _prompt(69, 8), _params(5, 8, logprobs=2)
    expected = engine().generate(prompt, params)
    llm = engine(enable_batching=True, max_batch_size=1, preemption_mode="recompute")
    s = llm.scheduler
    rid = s.submit_request(prompt, params)
    for _ in range(3):
        s.step()
    assert s.preempt(rid)
    result = s.poll_result(rid, None)
    assert (s.get_stats().recomputes, s.get_stats().prefix_tokens_reused) == (1, 70)
    assert (result.token_ids, result.logprobs, result.top_logprobs) == (expected.token_ids, expected.logprobs,
                                                                        expected.top_logprobs)


# -- scoring --------------------------------------------------------------------------------------

def _workload():
    prompts = [_prompt(n, n) for n in (70, 5, 130)]
    prompts.append(prompts[0][:64] + [1, 2, 3])  # reuses the first one's 64 positions
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3),
              _params(9, 3, logprobs=3), _params(6, 4, top_k=20, logprobs=3),
              SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=3)]
    return prompts, params


def test_recomputed_requests_score_as_they_generated(tiny_checkpoint):
    """Generation with every request preempted by recompute twice (mid-prefill and mid-decode) and
    an urgent request in the mix; then prompt + output scored (prompt_logprobs): each generated
    token's logprob and top 3 equal the scores of its position."""
    prompts, params = _workload()
    llm = _engine(tiny_checkpoint, max_batch_size=2, max_num_batched_tokens=64)
    s = llm.scheduler
    ids = [s.submit_request(p, sp, priority=1) for p, sp in zip(prompts, params)]
    forced = 0
    for step in range(300):
        if step in (1, 6, 12):
            forced += sum(s.preempt(i) for i in ids)
        if step == 3:
            s.submit_request([5, 6, 7], _params(3, 9), priority=0)
        if not s.step() and not s.has_work:
            break
    assert s.get_stats().recomputes > forced >= 4
    results = [s.poll_result(i, None) for i in ids]
    scored = llm.generate([p + r.token_ids for p, r in zip(prompts, results)], [SCORE] * len(prompts))
    for prompt, r, sc in zip(prompts, results, scored):
        n = len(prompt)  # generated token i sits at position n + i of the scored sequence
        assert (r.logprobs, r.top_logprobs) == (sc.prompt_logprobs[n:], [t[:3] for t in sc.prompt_top_logprobs[n:]])


def test_a_scoring_request_recomputed_mid_prompt_scores_each_position_once(tiny_checkpoint, serial):
    """prompt_logprobs of a request preempted between its prompt's pieces, and again while it
    decodes: one score per prompt token, those of its uninterrupted serial run, on its first
    token's delta as on its result."""
    prompt, params = _prompt(150, 7), _params(5, 5, prompt_logprobs=3)
    expected = serial.generate(prompt, params)
    llm = _engine(tiny_checkpoint, max_batch_size=1, max_num_batched_tokens=64)
    s = llm.scheduler
    sampled: list[TokenDelta] = []
    rid = s.submit_request(prompt, params, on_token=sampled.append)
    s.step()  # the first 64 prompt tokens scored
    assert s.preempt(rid)
    _step_until(s, lambda: len(sampled) == 2)
    assert s.preempt(rid)
    result = s.poll_result(rid, None)
    assert s.get_stats().recomputes == 2
    assert len(result.prompt_logprobs) == len(prompt) == len(result.prompt_top_logprobs)
    assert (result.prompt_logprobs, result.prompt_top_logprobs) == (expected.prompt_logprobs,
                                                                    expected.prompt_top_logprobs)
    assert (result.token_ids, result.logprobs) == (expected.token_ids, expected.logprobs)
    assert (sampled[0].prompt_logprobs, sampled[0].prompt_top_logprobs) == (expected.prompt_logprobs,
                                                                            expected.prompt_top_logprobs)
    assert all(d.prompt_logprobs is None for d in sampled[1:])


# -- lifecycle, delivery and stats -------------------------------------------------------------

def test_stats_count_recomputes_and_hold_no_host_memory(tiny_checkpoint, serial):
    """One preemption by recompute after 8 tokens of a 60-token prompt: its 67 cached positions are
    dropped, it waits without a host copy (max_swap_bytes does not apply), and its re-prefill of 68
    tokens reuses all 67 its old slot still holds (any position, on an attention-only model), 7
    decoded positions among them."""
    prompt, params = _prompt(60, 3), _params(12, 3)
    expected = serial.generate(prompt, params)
    llm = _engine(tiny_checkpoint, max_batch_size=1, max_swap_bytes=1)
    s = llm.scheduler
    rid = s.submit_request(prompt, params)
    for _ in range(8):  # the prompt, then 7 decode steps
        s.step()
    assert s.preempt(rid) and not s.preempt(rid)  # already on its way out
    s.step()
    stats = s.get_stats()
    assert (stats.preemptions, stats.recomputes, stats.recomputed_tokens) == (1, 1, 67)
    assert (stats.waiting, stats.running, stats.swapped_out, stats.swap_bytes_held, stats.swapped_bytes) == (
        1, 0, 0, 0, 0)
    s.step()
    assert (s.get_stats().prefix_hits, s.get_stats().prefix_tokens_reused) == (1, 67)
    result = s.poll_result(rid, None)
    assert (result.token_ids, result.logprobs) == (expected.token_ids, expected.logprobs)
    assert s.get_stats().recomputes == 1 and not s.preempt(rid)


def test_a_more_urgent_request_preempts_by_recompute(tiny_checkpoint, serial):
    """Two slots busy with priority-1 requests, then a priority-0 one: it runs at once, the later
    victim gives its slot up and re-prefills later; every output equals its serial run."""
    prompts = [_prompt(n, n) for n in (70, 20, 9)]
    expected = [serial.generate(p, _params(12, i)) for i, p in enumerate(prompts)]
    llm = _engine(tiny_checkpoint, max_batch_size=2)
    s = llm.scheduler
    early, late = (s.submit_request(p, _params(12, i), priority=1) for i, p in enumerate(prompts[:2]))
    for _ in range(3):
        s.step()
    urgent = s.submit_request(prompts[2], _params(12, 2), priority=0)
    s.step()
    stats = s.get_stats()
    assert (stats.recomputes, stats.swapped_out, stats.running, stats.waiting) == (1, 0, 2, 1)
    assert {e.request_id for e in s.timeline if e.step == stats.steps} == {early, urgent}
    results = [s.poll_result(i, None) for i in (early, late, urgent)]
    assert [(r.token_ids, r.logprobs) for r in results] == [(e.token_ids, e.logprobs) for e in expected]


def test_stream_deltas_stay_in_order_without_repeats(tiny_checkpoint, serial):
    """A stream whose request is preempted at every token, and an on_token subscriber beside it:
    each token comes once, in order, and they make the result."""
    prompt, params = _prompt(80, 4), _params(10, 4)
    expected = serial.generate(prompt, params)
    llm = _engine(tiny_checkpoint, max_batch_size=2)
    s = llm.scheduler
    pushed: list[TokenDelta] = []
    other = s.submit_request(prompt, params, on_token=pushed.append)
    pulled, result = [], None
    for item in s.stream(s.submit_request(prompt, params)):
        if isinstance(item, TokenDelta):
            pulled.append(item)
            s.preempt(item.request_id)
            s.preempt(other)
        else:
            result = item
    assert s.get_stats().recomputes >= params.max_tokens
    assert [d.index for d in pulled] == list(range(params.max_tokens)) == [d.index for d in pushed]
    assert [d.token_id for d in pulled] == result.token_ids == expected.token_ids == [d.token_id for d in pushed]
    assert [d.logprob for d in pulled] == result.logprobs == expected.logprobs
    assert s.poll_result(other, None).token_ids == expected.token_ids


class RecomputeMachine(CallerDrivenMachine):
    """The caller-driven state machine (submit with callbacks that call back, cancel, preempt, poll,
    stream, generate, configure, step, stop/drain) on exact positions, preempting by recompute: every
    request ends once, its deltas are its tokens in order, its bits those of its cold serial run."""

    options = {"exact_positions": True, "preemption_mode": "recompute"}

    @rule(n=st.integers(1, 4), preempt=st.booleans())
    def step(self, n, preempt):
        """The machine's steps, or steps that each preempt whatever is running first."""
        for _ in range(n):
            for rid in self._open() if preempt else ():
                self.s.preempt(rid)
            self.s.step()


def test_the_scheduler_preempting_by_recompute_keeps_every_promise(tiny_checkpoint):
    _run(RecomputeMachine, tiny_checkpoint, 0.2)


def test_cancel_and_stop_while_preempted_end_each_request_once(tiny_checkpoint):
    llm = _engine(tiny_checkpoint, max_batch_size=1)
    s = llm.scheduler
    ended: dict[int, list[str]] = {}
    ids = [s.submit_request(_prompt(30, i), _params(8, i), callback=lambda r: ended.setdefault(
        r.request_id, []).append(r.finish_reason)) for i in range(2)]
    s.step()
    s.step()
    assert s.preempt(ids[0])
    s.step()  # preempted: both wait now, the first not readmitted in the step that preempted it
    assert (s.get_stats().waiting, s.get_stats().running, llm.slots.num_free) == (2, 0, 1)
    assert s.cancel_request(ids[0]) and not s.cancel_request(ids[0])
    cancelled = s.poll_result(ids[0])
    assert cancelled.finish_reason == "cancelled" and len(cancelled.token_ids) == 2
    s.step()
    assert s.preempt(ids[1])
    s.step()
    s.stop()
    assert s.poll_result(ids[1]).finish_reason == "cancelled"
    assert ended == {ids[0]: ["cancelled"], ids[1]: ["cancelled"]}
    assert llm.slots.num_free == 1


def test_an_error_in_the_recompute_prefill_ends_that_request_once(tiny_checkpoint, serial, monkeypatch):
    """The forward that re-prefills a preempted request's generated tokens raises for it alone: it
    ends "error" with the tokens it had, once; the request beside it is untouched."""
    prompts, params = [_prompt(40, 5), _prompt(12, 6)], [_params(8, 5), _params(8, 6)]
    llm = _engine(tiny_checkpoint, max_batch_size=2)
    real = llm.runner.run

    def run(seqs):
        if any(not q.decode and q.start + len(q.token_ids) > len(prompts[0]) for q in seqs):
            raise RuntimeError("injected: the recompute prefill failed")
        return real(seqs)

    monkeypatch.setattr(llm.runner, "run", run)
    s = llm.scheduler
    ended: list[str] = []
    victim = s.submit_request(prompts[0], params[0], callback=lambda r: ended.append(r.finish_reason))
    bystander = s.submit_request(prompts[1], params[1])
    for _ in range(3):
        s.step()
    assert s.preempt(victim)
    failed, other = s.poll_result(victim, None), s.poll_result(bystander, None)
    assert (failed.finish_reason, len(failed.token_ids), ended) == ("error", 3, ["error"])
    assert "injected: the recompute prefill failed" in failed.error
    assert failed.token_ids == serial.generate(prompts[0], params[0]).token_ids[:3]
    assert other.token_ids == serial.generate(prompts[1], params[1]).token_ids
    assert s.get_stats().errored == 1 and llm.slots.num_free == 2


# -- refusal ------------------------------------------------------------------------------------

@pytest.mark.parametrize("batched", [True, False], ids=["batched", "serial"])
def test_recompute_without_exact_positions_is_refused(tiny_checkpoint, batched):
    with pytest.raises(ValueError, match=r"preemption_mode='recompute' needs exact positions "
                                         r"\(backend_options\['exact_positions'\]=True"):
        LLM(EngineArgs(model=str(tiny_checkpoint), max_seq_len=MAX_SEQ_LEN, backend_options={
            "exact_positions": False, "enable_batching": batched, "background_thread": False,
            "preemption_mode": "recompute"}))


def test_the_scheduler_checks_its_preemption_mode(tiny_checkpoint, serial):
    args = (serial.runner, serial.cache, serial.model_config.vocab_size, 64)
    with pytest.raises(ValueError, match=r"preemption_mode='recompute' needs exact positions"):
        BatchScheduler(*args, background_thread=False, preemption_mode="recompute")
    with pytest.raises(ValueError, match=r"preemption_mode must be one of 'swap', 'recompute', got 'lru'"):
        BatchScheduler(*args, background_thread=False, exact_positions=True, preemption_mode="lru")
    BatchScheduler(*args, background_thread=False, exact_positions=True, preemption_mode="recompute").stop()
