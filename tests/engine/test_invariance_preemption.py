"""The invariance contract under priorities and preemption by swap: requests of random priorities
(a waiting request swaps out a running one of lower priority when the slots are full) and forced
swap-outs at random steps, several per request, swapped back into whatever slot is free. Every
request's tokens and logprobs must equal its uninterrupted cold serial run with `==`: a swap copies
bits and recomputes nothing."""

from __future__ import annotations

import random

import pytest
from helpers import budget, variant_params
from hypothesis import given, settings

from pocketllm import LLM, EngineArgs, SamplingParams, SwapSpaceError
from pocketllm.testing import Engines, Job, Schedule, Workload, assert_batch_invariant
from pocketllm.testing.strategies import preemption_workloads

VOCAB = 256
MAX_SEQ_LEN = 192


# The mixtures of experts at the full budget under `slow` (test_invariance_moe.py runs them by default).
@pytest.fixture(scope="module", params=["tiny", "qwen3.5", *variant_params(["qwen3-moe", "qwen3.5-moe"],
                                                                          {"qwen3-moe", "qwen3.5-moe"})])
def engines(request, checkpoint_dir):
    engines = Engines(checkpoint_dir(request.param), max_seq_len=MAX_SEQ_LEN)
    yield engines
    engines.close()


# The profile's budget per family (a swap copies bits whatever the linear layers' decode strategy,
# which the other properties vary).
@settings(max_examples=budget())
@given(workload=preemption_workloads(VOCAB, max_prompt=130, max_jobs=6, max_tokens=12))
def test_preempted_and_prioritised_equals_uninterrupted_serial_bitwise(engines, workload):
    assert_batch_invariant(engines, workload)


def _engine(path, **options) -> LLM:
    return LLM(EngineArgs(model=str(path), max_seq_len=MAX_SEQ_LEN,
                          backend_options={"enable_batching": True, "background_thread": False,
                                           "record_timeline": True, **options}))


def _params(tokens: int, seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=tokens, temperature=0.8, seed=seed, ignore_eos=True)


@pytest.mark.parametrize("variant", ["tiny", "qwen3.5"])
def test_a_more_urgent_request_swaps_out_the_latest_of_the_lowest_priority(checkpoint_dir, variant):
    """Two slots busy with priority-1 requests (the later one the victim), then a priority-0
    request: it runs at once, the victim comes back into another slot when one frees, and every
    output equals its uninterrupted serial run."""
    path = checkpoint_dir(variant)
    rng = random.Random(2)
    prompts = [[rng.randrange(VOCAB) for _ in range(n)] for n in (70, 20, 9)]
    serial = _engine(path, enable_batching=False)
    expected = [serial.generate(prompt_tokens=p, sampling_params=_params(12, i)) for i, p in enumerate(prompts)]
    with _engine(path, max_batch_size=2, prefill_chunk_size=64, state_snapshot_interval=64,
                 max_num_batched_tokens=128) as llm:
        s = llm.scheduler
        early, late = (s.submit_request(p, _params(12, i), priority=1) for i, p in enumerate(prompts[:2]))
        for _ in range(3):
            s.step()
        urgent = s.submit_request(prompts[2], _params(12, 2), priority=0)
        submitted_at = s.get_stats().steps
        s.step()
        stats = s.get_stats()
        assert (stats.preemptions, stats.swapped_out, stats.running) == (1, 1, 2)
        assert stats.swap_bytes_held == stats.swapped_bytes > 0
        while s.has_work:
            s.step()
        results = [s.poll_result(i) for i in (early, late, urgent)]
        slots_of_late = {e.slot for e in s.timeline if e.request_id == late}
        assert min(e.step for e in s.timeline if e.request_id == urgent) == submitted_at + 1  # at once
        assert s.get_stats().swap_bytes_held == 0
    assert [(r.token_ids, r.logprobs) for r in results] == [(e.token_ids, e.logprobs) for e in expected]
    assert len(slots_of_late) == 2  # swapped back into the other slot


def test_equal_priorities_never_preempt_and_run_first_come_first_served(checkpoint_dir):
    with _engine(checkpoint_dir("tiny"), max_batch_size=1) as llm:
        s = llm.scheduler
        ids = [s.submit_request([i + 1] * 5, _params(3, i)) for i in range(3)]
        order = []
        while s.has_work:
            s.step()
            order += [e.request_id for e in s.timeline if e.phase == "prefill" and e.request_id not in order]
        assert order == ids and s.get_stats().preemptions == 0


def test_forced_preemption_several_times_and_cancel_while_swapped(checkpoint_dir):
    """preempt() swaps a request out at the next step, again and again; a request cancelled while
    swapped out ends "cancelled" and its host copy is released."""
    path = checkpoint_dir("qwen3.5")
    serial = _engine(path, enable_batching=False)
    prompt = list(range(1, 90))
    expected = serial.generate(prompt_tokens=prompt, sampling_params=_params(10, 7))
    with _engine(path, max_batch_size=2) as llm:
        s = llm.scheduler
        rid = s.submit_request(prompt, _params(10, 7))
        other = s.submit_request([5, 6, 7], _params(10, 8))
        swaps = 0
        while s.has_work:
            if s.preempt(rid):
                swaps += 1
            s.step()
            s.step()
        assert s.poll_result(rid).logprobs == expected.logprobs
        assert s.get_stats().preemptions == swaps >= 3
        s.poll_result(other)
        victim = s.submit_request(prompt, _params(10, 9))
        s.step()
        assert s.preempt(victim) and not s.preempt(victim)  # already on its way out
        s.submit_request([1], _params(1, 0), priority=-1)
        s.step()
        assert s.get_stats().swapped_out == 1
        assert s.cancel_request(victim) and s.poll_result(victim).finish_reason == "cancelled"
        assert s.get_stats().swap_bytes_held == 0
        assert not s.preempt(12345) and not s.preempt(victim)


@pytest.mark.parametrize("variant", ["tiny", "qwen3.5"])
def test_swap_out_between_the_pieces_of_a_prefill(checkpoint_dir, variant):
    """A prompt of four 64-token pieces, swapped out after each piece (and once while decoding),
    comes back and ends exactly as its uninterrupted run."""
    path = checkpoint_dir(variant)
    prompt = [random.Random(5).randrange(VOCAB) for _ in range(180)]
    options = {"prefill_chunk_size": 64, "state_snapshot_interval": 64, "max_num_batched_tokens": 128}
    expected = _engine(path, enable_batching=False, **options).generate(prompt_tokens=prompt,
                                                                        sampling_params=_params(6, 3))
    with _engine(path, max_batch_size=2, **options) as llm:
        s = llm.scheduler
        sampled: list[int] = []
        rid = s.submit_request(prompt, _params(6, 3), on_token=lambda delta: sampled.append(delta.token_id))
        swapped_mid_prefill = 0
        while s.has_work:
            s.step()
            if s.preempt(rid):
                swapped_mid_prefill += not sampled
            s.step()
        result = s.poll_result(rid)
    assert swapped_mid_prefill >= 2
    assert (result.token_ids, result.logprobs) == (expected.token_ids, expected.logprobs)


def test_swap_space_cap(checkpoint_dir):
    """max_swap_bytes: preempt() raises SwapSpaceError naming it; priority preemption waits instead."""
    with _engine(checkpoint_dir("tiny"), max_batch_size=1, max_swap_bytes=1024) as llm:
        s = llm.scheduler
        low = s.submit_request(list(range(1, 60)), _params(6, 1), priority=5)
        s.step()
        with pytest.raises(SwapSpaceError, match="over max_swap_bytes=1024"):
            s.preempt(low)
        high = s.submit_request([3, 4], _params(2, 2), priority=0)
        s.step()
        assert s.get_stats().preemptions == 0 and s.get_stats().waiting == 1
        while s.has_work:
            s.step()
        assert s.poll_result(low).finish_reason == s.poll_result(high).finish_reason == "length"


@pytest.mark.parametrize("bad", [1.5, True, "0", 2**31])
def test_bad_priority_names_the_field(checkpoint_dir, bad):
    with _engine(checkpoint_dir("tiny")) as llm:
        with pytest.raises(ValueError, match=r"priority must be an int in \[-2\*\*31, 2\*\*31\)"):
            llm.scheduler.submit_request([1, 2], SamplingParams(max_tokens=1), priority=bad)
        assert not llm.scheduler.has_work


def test_jobs_with_priorities_and_preemptions_through_the_lab(checkpoint_dir):
    """The lab's runner honours Job.priority and Job.preempt_steps (what the property relies on)."""
    engines = Engines(checkpoint_dir("tiny"), max_seq_len=MAX_SEQ_LEN)
    try:
        # Swapped out at steps 2 and 5 (back in the step after each), then by the urgent job.
        jobs = [Job(tuple(range(1, 40)), _params(16, 1), 0, None, priority=1, preempt_steps=(2, 5)),
                Job((7, 8, 9), _params(4, 2), 8, None, priority=0)]
        assert_batch_invariant(engines, Workload(tuple(jobs), 1, Schedule(64, 64, 0, True)))
        assert engines.scheduler(1).get_stats().preemptions == 3
    finally:
        engines.close()
