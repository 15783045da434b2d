"""BatchScheduler API edges: constructed directly with its defaults, default sampling params,
the stopped-scheduler error, callbacks of only some requests in a step, and failing callbacks
each counted and logged."""

from __future__ import annotations

import logging

import pytest

from pocketllm import SamplingParams
from pocketllm.scheduler.batch_scheduler import BatchScheduler

from .harness import drain, scheduler_threads


def test_direct_construction_defaults(make_llm):
    """Defaults: a background thread (daemon), no timeline, request ids counting from 0."""
    llm = make_llm()
    before = scheduler_threads()
    scheduler = BatchScheduler(llm.runner, llm.cache, llm.model_config.vocab_size, 64)
    try:
        started = scheduler_threads() - before
        assert len(started) == 1 and all(t.daemon for t in started)
        assert scheduler.timeline is None
        ids = [scheduler.submit_request([1], SamplingParams(max_tokens=1)) for _ in range(2)]
        assert ids == [0, 1]
        assert scheduler.poll_result(1, timeout_ms=10_000).finish_reason == "length"
    finally:
        scheduler.stop()


def test_default_sampling_params_and_stopped_error(make_llm):
    llm = make_llm()
    scheduler = llm.scheduler
    rid = scheduler.submit_request([1, 2])  # SamplingParams() defaults: up to 16 tokens, EOS honoured
    drain(scheduler)
    result = scheduler.poll_result(rid)
    # The default seed is drawn at random, so a sampled EOS (1 token in 256 here) may end it early.
    assert (result.finish_reason, len(result.token_ids)) == ("length", 16) or (
        result.finish_reason == "stop" and len(result.token_ids) <= 16
        and result.token_ids[-1] in llm.model_config.eos_token_ids)
    scheduler.stop()
    with pytest.raises(RuntimeError, match="^scheduler is stopped; no new requests are accepted$"):
        scheduler.submit_request([1])


def test_callbacks_of_some_requests_and_failing_ones(make_llm, caplog):
    """In one step: a request without a callback, then two whose callbacks raise, then one whose
    callback works: every callback runs, each failure is logged and counted."""
    llm = make_llm(max_batch_size=4)
    scheduler = llm.scheduler
    seen = []

    def fail(result):
        raise ValueError("planted")

    params = SamplingParams(max_tokens=1)
    ids = [scheduler.submit_request([1], params), scheduler.submit_request([2], params, callback=fail),
           scheduler.submit_request([3], params, callback=fail),
           scheduler.submit_request([4], params, callback=lambda r: seen.append(r.request_id))]
    with caplog.at_level(logging.ERROR, logger="pocketllm.scheduler.batch_scheduler"):
        drain(scheduler)
    assert seen == [ids[3]]
    assert scheduler.get_stats().callback_errors == 2
    assert [r.getMessage() for r in caplog.records] == [f"callback for request {i} raised" for i in ids[1:3]]
