"""Callbacks that raise anything (BaseException included) are logged and counted while the
scheduler thread keeps serving; a callback must be callable; poll timeouts accept None and
math.inf as "wait forever" and refuse negative or NaN values."""

from __future__ import annotations

import logging
import math
import threading

import pytest

from pocketllm import SamplingParams

LOGGER = "pocketllm.scheduler.batch_scheduler"
GREEDY = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("exception", [SystemExit(3), KeyboardInterrupt(), GeneratorExit(), ValueError("bad")],
                         ids=lambda e: type(e).__name__)
def test_callback_raising_base_exception_is_counted_and_thread_keeps_serving(make_llm, caplog, exception):
    """With the background thread: a callback raising `exception` is logged with its traceback and
    counted; the thread stays alive and serves the next requests, whose callbacks run."""
    llm = make_llm(max_batch_size=2, background=True)
    s = llm.scheduler
    caplog.set_level(logging.ERROR, logger=LOGGER)
    called = threading.Event()

    def raising(result):
        called.set()
        raise exception

    bad = s.submit_request([1, 2], GREEDY, callback=raising)
    assert s.poll_result(bad, timeout_ms=math.inf).finish_reason == "length"
    assert called.wait(10)
    good_called = threading.Event()
    good = s.submit_request([3, 4], GREEDY, callback=lambda result: good_called.set())
    assert s.poll_result(good, timeout_ms=None).finish_reason == "length"
    assert good_called.wait(10)
    assert s._thread.is_alive()
    assert s.get_stats().callback_errors == 1
    logged = [r for r in caplog.records if r.name == LOGGER and f"request {bad}" in r.getMessage()]
    assert len(logged) == 1 and isinstance(logged[0].exc_info[1], type(exception))


@pytest.mark.parametrize("callback", [42, "print", [print]], ids=repr)
def test_callback_must_be_callable(make_llm, callback):
    """A callback that cannot be called is refused at submit, before anything is queued."""
    s = make_llm().scheduler
    with pytest.raises(TypeError, match="callback must be callable"):
        s.submit_request([1], GREEDY, callback=callback)
    assert not s.has_work and s.get_stats().prompt_tokens == 0


@pytest.mark.parametrize("timeout", [-1, -0.001, float("nan"), -math.inf])
def test_poll_refuses_negative_or_nan_timeouts(make_llm, timeout):
    s = make_llm().scheduler
    rid = s.submit_request([1], GREEDY)
    with pytest.raises(ValueError, match="timeout_ms must be >= 0, None or math.inf"):
        s.poll_result(rid, timeout_ms=timeout)


@pytest.mark.parametrize("timeout", ["10", True, [1]], ids=repr)
def test_poll_refuses_timeouts_that_are_not_numbers(make_llm, timeout):
    s = make_llm().scheduler
    rid = s.submit_request([1], GREEDY)
    with pytest.raises(TypeError, match="timeout_ms must be a number"):
        s.poll_result(rid, timeout_ms=timeout)


@pytest.mark.parametrize("forever", [None, math.inf, 10**400, 1e300], ids=repr)
def test_poll_waits_forever_or_for_huge_timeouts(make_llm, forever):
    """None, math.inf and timeouts beyond what threading can wait for block until the result is
    there (the background thread produces it) instead of raising OverflowError."""
    llm = make_llm(background=True)
    rid = llm.scheduler.submit_request([1, 2, 3], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    result = llm.scheduler.poll_result(rid, timeout_ms=forever)
    assert result is not None and result.finish_reason == "length"
