"""State the scheduler leaves behind: the tokens a freed slot remembers, and the slot timeline.

Prefix reuse will trust a freed slot's remembered token ids to describe the K/V it holds, so they
are checked twice: against the documented rule (the prompt and every generated token but the
last, whose K/V was never computed) and against the cache itself (the layer-0 keys of a fresh
prefill of those tokens, which depend only on token and position). The timeline is checked event
by event against what the scheduler was asked to do.
"""

from __future__ import annotations

import torch

from pocketllm import LLM, EngineArgs, SamplingParams
from pocketllm.models import ForwardBatch

PROMPTS = [[1, 2, 3, 4, 5], [9] * 11, [200, 7]]
MAX_TOKENS = [4, 1, 6]


def _engine(checkpoint, batching: bool, record_timeline: bool = False, max_batch_size: int = 3) -> LLM:
    return LLM(EngineArgs(model=str(checkpoint), max_seq_len=64, backend_options={
        "enable_batching": batching, "background_thread": False, "max_batch_size": max_batch_size,
        "record_timeline": record_timeline}))


def _params(max_tokens: int, seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.9, seed=seed, ignore_eos=True)


@torch.inference_mode()
def _fresh_layer0_keys(llm: LLM, tokens: list[int]) -> torch.Tensor:
    """Layer-0 keys of `tokens` prefilled from position 0 in a spare slot (which is freed again)."""
    slot = llm.slots.allocate()
    try:
        llm.model.forward(ForwardBatch.build([slot], [0], [tokens], False, "cpu"), llm.cache)
        return llm.cache.k[0][slot, :len(tokens)].clone()
    finally:
        llm.slots.free(slot, [])


def _slot_of(llm: LLM, remembered: list[int]) -> int:
    held = [llm.slots.held_tokens(slot) for slot in range(llm.cache.num_slots)]
    matches = [s for s, tokens in enumerate(held) if tokens == remembered]
    assert len(matches) == 1, (remembered, held)
    return matches[0]


def _check_remembered(llm: LLM, prompt: list[int], generated: list[int]) -> None:
    remembered = prompt + generated[:-1]
    slot = _slot_of(llm, remembered)
    torch.testing.assert_close(llm.cache.k[0][slot, :len(remembered)], _fresh_layer0_keys(llm, remembered),
                               atol=1e-5, rtol=0)


def test_freed_slot_remembers_the_tokens_whose_kv_it_holds_serial(tiny_checkpoint):
    """Serial path: after each request, its slot (the lowest, reused every time) remembers
    prompt + generated[:-1], and its layer-0 keys at those positions are those tokens' keys."""
    llm = _engine(tiny_checkpoint, batching=False)
    try:
        for seed, (prompt, n) in enumerate(zip(PROMPTS, MAX_TOKENS)):
            result = llm.generate(prompt_tokens=prompt, sampling_params=_params(n, seed))
            assert len(result.token_ids) == n
            assert llm.slots.num_free == llm.cache.num_slots
            _check_remembered(llm, prompt, result.token_ids)
    finally:
        llm.close()


def test_freed_slot_remembers_the_tokens_whose_kv_it_holds_batched(tiny_checkpoint):
    """Batched path, requests of different lengths finishing at different steps: each one's slot
    remembers its prompt + generated[:-1], with the matching keys."""
    llm = _engine(tiny_checkpoint, batching=True, max_batch_size=len(PROMPTS) + 1)
    try:
        params = [_params(n, seed) for seed, n in enumerate(MAX_TOKENS)]
        results = llm.generate(prompt_tokens=PROMPTS, sampling_params=params)
        assert llm.slots.num_free == len(PROMPTS) + 1
        for prompt, result, n in zip(PROMPTS, results, MAX_TOKENS):
            assert len(result.token_ids) == n
            _check_remembered(llm, prompt, result.token_ids)
    finally:
        llm.close()


def test_reused_slot_forgets_the_previous_tenant(tiny_checkpoint):
    """A slot taken by a new request remembers nothing until that request completes, then only
    the new request's tokens."""
    llm = _engine(tiny_checkpoint, batching=True, max_batch_size=1)
    try:
        first = llm.generate(prompt_tokens=[3, 4, 5, 6], sampling_params=_params(3, 1))
        assert llm.slots.held_tokens(0) == [3, 4, 5, 6] + first.token_ids[:-1]
        scheduler = llm.scheduler
        request_id = scheduler.submit_request([8, 9], _params(2, 2))
        scheduler.step()  # admitted and prefilled: one token drawn, one more to go
        assert llm.slots.held_tokens(0) == []
        scheduler.step()
        second = scheduler.poll_result(request_id)
        assert second is not None and len(second.token_ids) == 2
        assert llm.slots.held_tokens(0) == [8, 9] + second.token_ids[:1]
    finally:
        llm.close()


def test_cancelled_request_slot_remembers_what_was_computed(tiny_checkpoint):
    """A request cancelled after its prefill leaves the prompt (its only computed K/V) plus the
    generated tokens already fed back, none more."""
    llm = _engine(tiny_checkpoint, batching=True, max_batch_size=1)
    try:
        scheduler = llm.scheduler
        request_id = scheduler.submit_request([10, 11, 12], _params(20, 3))
        scheduler.step()
        scheduler.step()  # prefill, then one decode: two tokens drawn, the first fed back
        assert scheduler.cancel_request(request_id)
        result = scheduler.poll_result(request_id)
        assert result.finish_reason == "cancelled" and len(result.token_ids) == 2
        assert llm.slots.held_tokens(0) == [10, 11, 12, result.token_ids[0]]
    finally:
        llm.close()


# -- the timeline ------------------------------------------------------------------------------------------


def test_timeline_records_every_forward_of_every_request(tiny_checkpoint):
    """Two slots, three requests: one prefill event per request with its prompt length, then one
    single-token decode event per later step until it finishes, all in the slot it was given; the
    third request waits for the first freed slot; steps and times never go backwards."""
    llm = _engine(tiny_checkpoint, batching=True, record_timeline=True, max_batch_size=2)
    try:
        scheduler = llm.scheduler
        ids = [scheduler.submit_request(p, _params(n, i)) for i, (p, n) in enumerate(zip(PROMPTS, MAX_TOKENS))]
        steps = 0
        while scheduler.has_work:
            scheduler.step()
            steps += 1
        results = {i: scheduler.poll_result(i) for i in ids}
        events = scheduler.timeline
    finally:
        llm.close()

    assert all(r.finish_reason == "length" for r in results.values())
    assert {e.phase for e in events} <= {"prefill", "decode"}
    assert [e.step for e in events] == sorted(e.step for e in events) and events[-1].step == steps
    for before, after in zip(events, events[1:]):
        assert before.start_s <= before.end_s <= after.end_s
    assert all(0 <= e.start_s <= e.end_s for e in events)

    by_request = {i: [e for e in events if e.request_id == i] for i in ids}
    for request_id, prompt, n in zip(ids, PROMPTS, MAX_TOKENS):
        mine = by_request[request_id]
        assert [e.phase for e in mine] == ["prefill"] + ["decode"] * (n - 1)
        assert [e.num_tokens for e in mine] == [len(prompt)] + [1] * (n - 1)
        first_step = mine[0].step
        assert [e.step for e in mine] == list(range(first_step, first_step + n))  # one forward per step
        assert len({e.slot for e in mine}) == 1
    for step in {e.step for e in events}:
        slots = [(e.phase, e.slot) for e in events if e.step == step]
        assert len(slots) == len(set(slots))  # no slot fed twice in one forward

    # FCFS with two slots: requests 0 and 1 start together in slots 0 and 1; request 1 (one token)
    # finishes at its prefill step, so request 2 takes slot 1 in the next step.
    first, second, third = (by_request[i] for i in ids)
    assert (first[0].step, first[0].slot, second[0].step, second[0].slot) == (1, 0, 1, 1)
    assert (third[0].step, third[0].slot) == (2, 1)


def test_timeline_is_off_unless_asked(tiny_checkpoint):
    llm = _engine(tiny_checkpoint, batching=True)
    try:
        llm.generate(prompt_tokens=[1, 2], sampling_params=_params(2, 0))
        assert llm.scheduler.timeline is None
    finally:
        llm.close()
