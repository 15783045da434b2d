"""cancel_request and poll_result: return values, terminal states, slot release, waiting semantics."""

from __future__ import annotations

import threading
import time

import pytest

from pocketllm import SamplingParams


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


# -- cancel ----------------------------------------------------------------------------------


def test_cancel_waiting_request(make_llm, recorder, drain):
    """Cancelling a waiting request returns True, ends it "cancelled" at once with no tokens (it
    never ran: its prompt reaches no forward), fires its callback once, and leaves the rest alone."""
    llm = make_llm(max_batch_size=1)
    s = llm.scheduler
    rec = recorder(llm)
    seen = []
    running = s.submit_request([1, 2], greedy(3))
    waiting = s.submit_request([200, 201, 202], greedy(3), callback=seen.append)
    s.step()
    assert (s.get_stats().waiting, s.get_stats().running) == (1, 1)

    assert s.cancel_request(waiting) is True
    assert (s.get_stats().waiting, s.get_stats().running) == (0, 1)
    assert len(seen) == 1 and seen[0].request_id == waiting and seen[0].finish_reason == "cancelled"
    result = s.poll_result(waiting)
    assert result.finish_reason == "cancelled" and result.token_ids == [] and result.ttft_s is None
    drain(s)
    assert all(tokens != [200, 201, 202] for _, seqs in rec.calls for _, _, tokens in seqs)
    assert s.poll_result(running).finish_reason == "length"
    assert len(seen) == 1
    assert s.get_stats().cancelled == 1 and llm.slots.num_free == 1


def test_cancel_running_request_frees_its_slot(make_llm, recorder, drain):
    """Cancelling a running request between steps returns True, frees its slot immediately, ends
    it "cancelled" with the tokens it had, and it is never decoded again; the waiting request
    takes the slot at the next step."""
    llm = make_llm(max_batch_size=1)
    s = llm.scheduler
    rec = recorder(llm)
    victim = s.submit_request([1, 2, 3], greedy(10))
    queued = s.submit_request([4, 5], greedy(2))
    s.step()
    assert llm.slots.num_free == 0

    assert s.cancel_request(victim) is True
    assert llm.slots.num_free == 1
    assert (s.get_stats().waiting, s.get_stats().running) == (1, 0)
    result = s.poll_result(victim)
    assert result.finish_reason == "cancelled" and len(result.token_ids) == 1
    calls_before = len(rec.calls)
    drain(s)
    assert [(d, [t for _, _, t in seqs]) for d, seqs in rec.calls[calls_before:]][0] == (False, [[4, 5]])
    assert all(len(seqs) == 1 for _, seqs in rec.calls[calls_before:])
    assert s.poll_result(queued).finish_reason == "length"
    assert llm.slots.num_free == 1


def test_cancel_running_request_during_forward(make_llm, gate):
    """With the background thread, cancelling a request whose forward is in progress returns True;
    it ends "cancelled" when that step ends, and its slot is free by the time its result is out."""
    llm = make_llm(max_batch_size=2, background=True)
    s = llm.scheduler
    g = gate(llm)
    rid = s.submit_request([1, 2, 3], greedy(1))  # would finish "length" in this very forward
    assert g.entered.wait(10)
    assert s.cancel_request(rid) is True
    assert s.cancel_request(rid) is False
    assert s.poll_result(rid, timeout_ms=0) is None
    g.opened.set()
    result = s.poll_result(rid, timeout_ms=10_000)
    assert result is not None and result.finish_reason == "cancelled"
    assert llm.slots.num_free == 2


def test_cancel_unknown_finished_or_collected_returns_false(make_llm, drain):
    """cancel_request is False for an id never submitted, a finished request (whose result is then
    unchanged) and a collected one."""
    s = make_llm().scheduler
    assert s.cancel_request(12345) is False
    assert s.cancel_request(-1) is False
    rid = s.submit_request([1], greedy(2))
    drain(s)
    assert s.cancel_request(rid) is False
    result = s.poll_result(rid)
    assert result.finish_reason == "length" and len(result.token_ids) == 2
    assert s.cancel_request(rid) is False
    assert s.get_stats().cancelled == 0


@pytest.mark.parametrize("state", ["waiting", "running"])
def test_cancel_twice_second_returns_false(make_llm, state):
    """A second cancel of the same request is False, and the request is cancelled exactly once."""
    llm = make_llm(max_batch_size=1)
    s = llm.scheduler
    calls = []
    first = s.submit_request([1], greedy(5), callback=calls.append)
    second = s.submit_request([2], greedy(5), callback=calls.append)
    s.step()
    target = second if state == "waiting" else first
    assert s.cancel_request(target) is True
    assert s.cancel_request(target) is False
    assert [r.request_id for r in calls] == [target]
    assert s.get_stats().cancelled == 1
    assert s.poll_result(target).finish_reason == "cancelled"


# -- poll ------------------------------------------------------------------------------------


def test_poll_unknown_id_raises_keyerror(make_llm):
    """poll_result on an id that was never submitted raises KeyError."""
    s = make_llm().scheduler
    with pytest.raises(KeyError):
        s.poll_result(999)
    with pytest.raises(KeyError):
        s.poll_result(999, timeout_ms=10)


def test_poll_before_completion_returns_none(make_llm):
    """Before completion poll_result returns None at once with timeout_ms=0, and after waiting
    about timeout_ms with a small timeout; the result stays collectable."""
    s = make_llm().scheduler
    rid = s.submit_request([1, 2], greedy(1))
    start = time.monotonic()
    assert s.poll_result(rid, timeout_ms=0) is None
    assert s.poll_result(rid) is None
    assert time.monotonic() - start < 0.5
    start = time.monotonic()
    assert s.poll_result(rid, timeout_ms=50) is None
    assert time.monotonic() - start >= 0.045
    s.step()
    assert s.poll_result(rid, timeout_ms=50).finish_reason == "length"


def test_poll_hands_result_over_once(make_llm, drain):
    """After completion poll_result returns the result once; a second poll raises KeyError."""
    s = make_llm().scheduler
    rid = s.submit_request([1, 2, 3], greedy(3))
    drain(s)
    result = s.poll_result(rid)
    assert result.request_id == rid and result.prompt_tokens == [1, 2, 3] and len(result.token_ids) == 3
    with pytest.raises(KeyError):
        s.poll_result(rid)
    with pytest.raises(KeyError):
        s.poll_result(rid, timeout_ms=None)


def test_poll_without_timeout_waits_until_done(make_llm, gate):
    """With the background thread, poll_result(timeout_ms=None) blocks while the request is in
    flight and returns its finished result once it is done."""
    llm = make_llm(background=True)
    s = llm.scheduler
    g = gate(llm)
    rid = s.submit_request([1, 2, 3], greedy(4))
    assert g.entered.wait(10)
    got = []
    poller = threading.Thread(target=lambda: got.append(s.poll_result(rid, timeout_ms=None)), daemon=True)
    poller.start()
    poller.join(0.2)  # the forward is held: the poller must still be waiting
    assert poller.is_alive() and got == []
    g.opened.set()
    poller.join(10)
    assert not poller.is_alive()
    assert got[0].finish_reason == "length" and len(got[0].token_ids) == 4


def test_poll_wakes_on_completion_not_at_timeout(make_llm):
    """A poll with a long timeout returns as soon as the request is done, not at the timeout."""
    s = make_llm(background=True).scheduler
    rid = s.submit_request([1, 2, 3], greedy(3))
    start = time.monotonic()
    result = s.poll_result(rid, timeout_ms=60_000)
    assert result is not None and result.finish_reason == "length"
    assert time.monotonic() - start < 10


def test_concurrent_pollers_exactly_one_gets_the_result(make_llm, gate):
    """Two threads waiting on the same id: exactly one gets the result, the other gets KeyError."""
    llm = make_llm(background=True)
    s = llm.scheduler
    g = gate(llm)
    rid = s.submit_request([5, 6], greedy(2))
    assert g.entered.wait(10)
    outcomes = []
    lock = threading.Lock()

    def poll():
        try:
            out = s.poll_result(rid, timeout_ms=20_000)
        except KeyError:
            out = "KeyError"
        with lock:
            outcomes.append(out)

    threads = [threading.Thread(target=poll, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    g.opened.set()
    for t in threads:
        t.join(30)
    assert len(outcomes) == 2
    assert outcomes.count("KeyError") == 1
    (result,) = [o for o in outcomes if o != "KeyError"]
    assert result.request_id == rid and result.finish_reason == "length"
