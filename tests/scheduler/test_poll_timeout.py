"""poll_result's timeout is in milliseconds and its unknown-id error names the id."""

from __future__ import annotations

import time

import pytest

from pocketllm import SamplingParams


def test_timeout_is_in_milliseconds(make_llm):
    llm = make_llm()  # manual stepping: nothing runs the request while we wait
    rid = llm.scheduler.submit_request([1, 2], SamplingParams(max_tokens=2))
    start = time.monotonic()
    assert llm.scheduler.poll_result(rid, timeout_ms=50) is None
    waited = time.monotonic() - start
    assert 0.045 <= waited < 2.0


def test_unknown_id_error_names_it(make_llm):
    llm = make_llm()
    with pytest.raises(KeyError, match="request id 12345 is unknown or its result was already collected"):
        llm.scheduler.poll_result(12345)
