"""Callbacks, failing callbacks, failing forwards and rejected submissions: each is contained to
its own request(s) and the scheduler keeps serving."""

from __future__ import annotations

import collections
import logging
import threading

import pytest

from pocketllm import SamplingParams

LOGGER = "pocketllm.scheduler.batch_scheduler"


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


class Callbacks:
    """Thread-safe callback sink: counts calls per request id and keeps the last result."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.count: collections.Counter[int] = collections.Counter()
        self.results = {}

    def __call__(self, result) -> None:
        with self.lock:
            self.count[result.request_id] += 1
            self.results[result.request_id] = result


def test_callbacks_fire_once_with_the_result(make_llm, drain):
    """Every request's callback fires exactly once, with a result equal to the one poll_result
    returns, whatever the terminal state (length, stop, cancelled waiting, cancelled running)."""
    llm = make_llm(max_batch_size=3)
    s = llm.scheduler
    cb = Callbacks()
    probe = s.submit_request([9, 8], SamplingParams(max_tokens=8, temperature=1.0, seed=3, ignore_eos=True))
    drain(s)
    stop_token = s.poll_result(probe).token_ids[2]

    ids = {
        "length": s.submit_request([1, 2], greedy(3), callback=cb),
        "stop": s.submit_request([9, 8], SamplingParams(max_tokens=8, temperature=1.0, seed=3, ignore_eos=True,
                                                         stop_token_ids=(stop_token,)), callback=cb),
        "running_cancel": s.submit_request([3], greedy(9), callback=cb),
        "waiting_cancel": s.submit_request([4], greedy(9), callback=cb),
    }
    s.step()
    assert s.cancel_request(ids["waiting_cancel"])
    s.step()
    assert s.cancel_request(ids["running_cancel"])
    drain(s)
    assert dict(cb.count) == {rid: 1 for rid in ids.values()}
    expected = {"length": "length", "stop": "stop", "running_cancel": "cancelled", "waiting_cancel": "cancelled"}
    for name, rid in ids.items():
        polled = s.poll_result(rid)
        assert cb.results[rid] == polled
        assert polled.finish_reason == expected[name]
    assert cb.results[ids["waiting_cancel"]].token_ids == []
    assert len(cb.results[ids["running_cancel"]].token_ids) == 2
    drain(s)
    assert dict(cb.count) == {rid: 1 for rid in ids.values()}


@pytest.mark.parametrize("background", [False, True])
def test_raising_callback_is_logged_counted_and_contained(make_llm, drain, wait_until, caplog, background):
    """A callback that raises is logged with its traceback and counted in callback_errors; its
    request's result is intact and later requests (and their callbacks) still complete."""
    llm = make_llm(max_batch_size=2, background=background)
    s = llm.scheduler
    cb = Callbacks()

    def bad(result):
        cb(result)
        raise ValueError("callback exploded")

    caplog.set_level(logging.ERROR, logger=LOGGER)
    failing = s.submit_request([1, 2], greedy(1), callback=bad)
    if not background:
        drain(s)
    first = s.poll_result(failing, timeout_ms=10_000)
    assert first is not None and first.finish_reason == "length"
    later = [s.submit_request([3 + i], greedy(3), callback=cb) for i in range(3)]
    if not background:
        drain(s)
    for rid in later:
        result = s.poll_result(rid, timeout_ms=10_000)
        assert result is not None and result.finish_reason == "length"
    # Callbacks run just after the result is published: wait for the last ones to have run.
    wait_until(lambda: len(cb.count) == 4, what="all callbacks")
    assert dict(cb.count) == {rid: 1 for rid in [failing, *later]}
    assert s.get_stats().callback_errors == 1
    records = [r for r in caplog.records if r.name == LOGGER and f"request {failing}" in r.getMessage()]
    assert len(records) == 1
    assert records[0].levelno == logging.ERROR and records[0].exc_info is not None
    assert isinstance(records[0].exc_info[1], ValueError)
    assert llm.slots.num_free == 2


def has_prefill(seqs) -> bool:
    return any(not s.decode for s in seqs)


def has_decode(seqs) -> bool:
    return any(s.decode for s in seqs)


def failing_run(llm, monkeypatch, fail_on, once: bool = True):
    """Patch llm.runner.run to raise RuntimeError("boom") on the calls for which
    fail_on(call_index, seqs) is true (with `once`, only the first such call); returns the call log."""
    real = llm.runner.run
    log = {"calls": 0, "failed": 0}

    def run(seqs):
        index = log["calls"]
        log["calls"] += 1
        if not (once and log["failed"]) and fail_on(index, seqs):
            log["failed"] += 1
            raise RuntimeError("boom")
        return real(seqs)

    monkeypatch.setattr(llm.runner, "run", run)
    return log


def test_prefill_failure_errors_its_batch_and_keeps_serving(make_llm, drain, monkeypatch, caplog):
    """When every prefill forward raises, each request of the batch is tried alone, ends with
    "error" (and the exception in result.error), frees its slot and is logged; the scheduler keeps
    serving."""
    llm = make_llm(max_batch_size=3)
    s = llm.scheduler
    reference_id = s.submit_request([5, 6, 7], greedy(3))
    drain(s)
    reference = s.poll_result(reference_id)

    log = failing_run(llm, monkeypatch, lambda i, seqs: has_prefill(seqs), once=False)
    caplog.set_level(logging.ERROR, logger=LOGGER)
    cb = Callbacks()
    ids = [s.submit_request(p, greedy(3), callback=cb) for p in ([1], [2, 3], [4, 5, 6])]
    s.step()
    assert log["failed"] == 1 + len(ids)  # the batch, then each request alone
    assert llm.slots.num_free == 3 and not s.has_work
    for rid in ids:
        result = s.poll_result(rid)
        assert result.finish_reason == "error" and result.token_ids == []
        assert result.error is not None and "RuntimeError" in result.error and "boom" in result.error
    assert dict(cb.count) == {rid: 1 for rid in ids}
    failed = {r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno == logging.ERROR}
    assert failed == {f"forward pass failed for request {rid}" for rid in ids}
    stats = s.get_stats()
    assert (stats.errored, stats.finished, stats.waiting, stats.running) == (3, 1, 0, 0)

    monkeypatch.undo()
    again = s.submit_request([5, 6, 7], greedy(3))
    drain(s)
    result = s.poll_result(again)
    assert result.finish_reason == "length" and result.token_ids == reference.token_ids
    assert llm.slots.num_free == 3


def test_transient_batch_failure_is_retried_per_request(make_llm, drain, monkeypatch):
    """A prefill batch, and later a decode batch, whose forward raises once is rerun request by
    request: every request finishes normally, with the tokens and logprobs of its undisturbed run."""
    llm = make_llm(max_batch_size=3)
    s = llm.scheduler
    prompts = ([1, 2], [3], [4, 5, 6])
    ids = [s.submit_request(p, greedy(4)) for p in prompts]
    drain(s)
    reference = [s.poll_result(rid) for rid in ids]

    for is_decode_failing in (False, True):
        failing = has_decode if is_decode_failing else has_prefill
        log = failing_run(llm, monkeypatch, lambda i, seqs, f=failing: f(seqs))
        ids = [s.submit_request(p, greedy(4)) for p in prompts]
        drain(s)
        assert log["failed"] == 1
        for rid, ref in zip(ids, reference):
            result = s.poll_result(rid)
            assert result.finish_reason == "length"
            assert (result.token_ids, result.logprobs) == (ref.token_ids, ref.logprobs)
        monkeypatch.undo()
    assert llm.slots.num_free == 3 and s.get_stats().errored == 0


def test_decode_failure_errors_only_the_decode_batch(make_llm, drain, monkeypatch):
    """Decode forwards that keep raising end the running requests "error" (keeping the tokens they
    had) and free their slots; a request prefilled in the same step is unaffected."""
    llm = make_llm(max_batch_size=3)
    s = llm.scheduler
    reference_id = s.submit_request([8, 9], greedy(3))
    drain(s)
    reference = s.poll_result(reference_id)

    a = s.submit_request([1, 2], greedy(4))
    b = s.submit_request([3], greedy(4))
    s.step()  # both prefilled
    log = failing_run(llm, monkeypatch, lambda i, seqs: has_decode(seqs) and i <= 3, once=False)
    fresh = s.submit_request([8, 9], greedy(3))
    s.step()  # prefill of `fresh` succeeds; decode of a and b raises, batched and alone
    assert log["failed"] == 3
    for rid in (a, b):
        result = s.poll_result(rid)
        assert result.finish_reason == "error" and "boom" in result.error and len(result.token_ids) == 1
    assert llm.slots.num_free == 2 and s.get_stats().running == 1
    drain(s)
    result = s.poll_result(fresh)
    assert result.finish_reason == "length" and result.token_ids == reference.token_ids
    assert llm.slots.num_free == 3 and s.get_stats().errored == 2


def test_prefill_failure_leaves_running_requests_alone(make_llm, drain, monkeypatch):
    """When the prefill of newly admitted requests fails, requests already running continue and
    produce exactly the tokens they produce undisturbed."""
    llm = make_llm(max_batch_size=2)
    s = llm.scheduler
    reference_id = s.submit_request([4, 4, 2], greedy(5))
    drain(s)
    reference = s.poll_result(reference_id)

    survivor = s.submit_request([4, 4, 2], greedy(5))
    s.step()
    failing_run(llm, monkeypatch, lambda i, seqs: has_prefill(seqs), once=False)  # fails alone again
    doomed = s.submit_request([7], greedy(5))
    s.step()
    assert s.poll_result(doomed).finish_reason == "error"
    drain(s)
    result = s.poll_result(survivor)
    assert result.finish_reason == "length" and result.token_ids == reference.token_ids


def test_forward_failure_does_not_stop_background_thread(make_llm, monkeypatch):
    """With the background thread, a failing forward errors its requests and later requests are
    still served by the same thread."""
    llm = make_llm(max_batch_size=2, background=True)
    s = llm.scheduler
    failing_run(llm, monkeypatch, lambda i, seqs: i == 0)
    doomed = s.submit_request([1, 2], greedy(3))
    result = s.poll_result(doomed, timeout_ms=10_000)
    assert result is not None and result.finish_reason == "error" and "boom" in result.error
    later = [s.submit_request([3, i], greedy(3)) for i in range(4)]
    for rid in later:
        result = s.poll_result(rid, timeout_ms=10_000)
        assert result is not None and result.finish_reason == "length"
    assert s._thread.is_alive()
    assert llm.slots.num_free == 2


BAD_INPUTS = [
    pytest.param([], greedy(1), ValueError, id="empty-prompt"),
    pytest.param([256], greedy(1), ValueError, id="token-over-vocab"),
    pytest.param([3, -1], greedy(1), ValueError, id="negative-token"),
    pytest.param([1] * 100, greedy(29), ValueError, id="prompt+max_tokens>max_seq_len"),
    pytest.param([1] * 128, greedy(1), ValueError, id="prompt-fills-max_seq_len"),
    pytest.param([1], greedy(1, stop_token_ids=(256,)), ValueError, id="stop-token-over-vocab"),
    pytest.param("abc", greedy(1), TypeError, id="string-prompt"),
    pytest.param([1.0], greedy(1), TypeError, id="float-token"),
    pytest.param([1], {"max_tokens": 1}, TypeError, id="params-not-SamplingParams"),
]


@pytest.mark.parametrize("prompt, params, error", BAD_INPUTS)
def test_bad_submission_raises_and_queues_nothing(make_llm, drain, prompt, params, error):
    """Bad input to submit_request raises (ValueError for bad values), changes no statistic, queues
    nothing, and the scheduler then serves a good request normally."""
    llm = make_llm(max_batch_size=2, max_seq_len=128)
    s = llm.scheduler
    ok = s.submit_request([1, 2], greedy(2))
    s.step()
    before = s.get_stats()
    with pytest.raises(error):
        s.submit_request(prompt, params)
    assert s.get_stats() == before
    assert llm.slots.num_free == 1
    good = s.submit_request([1, 2], greedy(2))
    assert good > ok
    drain(s)
    assert s.poll_result(ok).finish_reason == "length"
    assert s.poll_result(good).finish_reason == "length"
    stats = s.get_stats()
    assert stats.finished == 2 and stats.prompt_tokens == 4 and stats.errored == 0


def test_callbacks_may_submit_and_cancel(make_llm, wait_until):
    """Callbacks run outside the scheduler lock: with the background thread, a callback can submit
    a follow-up request (a chain of 5) and cancel another request, and everything completes."""
    llm = make_llm(max_batch_size=2, background=True)
    s = llm.scheduler
    chain: list[int] = []
    cb = Callbacks()
    blocker = s.submit_request([9], greedy(60))

    def next_link(result):
        cb(result)
        if len(chain) < 5:
            chain.append(s.submit_request(result.token_ids[-1:], greedy(2), callback=next_link))
        else:
            assert s.cancel_request(blocker)

    chain.append(s.submit_request([1, 2], greedy(2), callback=next_link))
    wait_until(lambda: len(cb.count) == 5, what="the chain of callbacks")
    result = s.poll_result(blocker, timeout_ms=10_000)
    assert result is not None and result.finish_reason == "cancelled"
    assert [s.poll_result(rid, timeout_ms=10_000).finish_reason for rid in chain] == ["length"] * 5
    assert dict(cb.count) == {rid: 1 for rid in chain[:5]}
    assert llm.slots.num_free == 2
