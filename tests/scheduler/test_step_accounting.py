"""What a step records besides tokens: logprobs next to every token, busy time that adds up over
steps and stays within the wall clock, timeline times measured from the scheduler's start, and a
failed batch logged with the number of requests it held, then each request that fails alone."""

from __future__ import annotations

import logging
import math
import time

from pocketllm import LLM, EngineArgs, SamplingParams


def _engine(checkpoint) -> LLM:
    return LLM(EngineArgs(model=str(checkpoint), max_seq_len=64, backend_options={
        "enable_batching": True, "background_thread": False, "max_batch_size": 2, "record_timeline": True}))


def test_logprobs_busy_time_and_timeline_clock(tiny_checkpoint):
    created = time.perf_counter()
    llm = _engine(tiny_checkpoint)
    try:
        results = llm.generate(prompt_tokens=[[1, 2, 3], [4]],
                               sampling_params=SamplingParams(max_tokens=5, temperature=0.8, seed=1))
        elapsed = time.perf_counter() - created
        stats = llm.scheduler.get_stats()
        events = llm.scheduler.timeline
    finally:
        llm.close()
    for result in results:
        assert len(result.logprobs) == len(result.token_ids) == 5
        assert all(isinstance(lp, float) and math.isfinite(lp) and lp <= 0.0 for lp in result.logprobs)
    forwards = {(e.step, e.phase): e.end_s - e.start_s for e in events}
    assert len(forwards) == 5  # one prefill (both prompts) and four decodes
    assert sum(forwards.values()) <= stats.busy_time_s <= elapsed
    assert all(0.0 <= e.start_s <= e.end_s <= elapsed for e in events)


def test_failed_forward_is_logged_with_its_request_count(tiny_checkpoint, monkeypatch, caplog):
    llm = _engine(tiny_checkpoint)
    try:
        def broken(seqs):
            raise RuntimeError("planted")

        monkeypatch.setattr(llm.runner, "run", broken)
        with caplog.at_level(logging.WARNING, logger="pocketllm.scheduler.batch_scheduler"):
            ids = [llm.scheduler.submit_request(p, SamplingParams(max_tokens=2)) for p in ([1], [2])]
            llm.scheduler.step()
            results = [llm.scheduler.poll_result(i) for i in ids]
    finally:
        llm.close()
    assert [r.finish_reason for r in results] == ["error", "error"]
    assert [r.getMessage() for r in caplog.records] == [
        "forward pass of 2 requests failed (RuntimeError: planted); rerunning each alone",
        *(f"forward pass failed for request {i}" for i in ids)]
