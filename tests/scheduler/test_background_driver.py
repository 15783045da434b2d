"""The background thread and a caller that drives generate() itself: while the caller steps, the
thread sleeps (every forward of that call runs on the calling thread); once the caller is done,
the thread serves submissions again; a step that raises is logged and does not kill the thread."""

from __future__ import annotations

import logging
import threading

from pocketllm import SamplingParams

THREAD_NAME = "pocketllm-scheduler"


def _record_threads(llm, monkeypatch) -> list[str]:
    names: list[str] = []
    real = llm.runner.run

    def run(seqs, is_decode):
        names.append(threading.current_thread().name)
        return real(seqs, is_decode)

    monkeypatch.setattr(llm.runner, "run", run)
    return names


def test_generate_steps_on_the_caller_then_the_thread_serves_again(make_llm, monkeypatch):
    llm = make_llm(background=True)
    names = _record_threads(llm, monkeypatch)
    params = SamplingParams(max_tokens=3, temperature=0)
    results = llm.generate(prompt_tokens=[[1, 2, 3], [4, 5]], sampling_params=params)
    assert [r.finish_reason for r in results] == ["length", "length"]
    assert names and set(names) == {threading.current_thread().name}
    names.clear()
    for _ in range(2):  # twice: the driver count must be back to zero after each call
        rid = llm.scheduler.submit_request([6, 7], params)
        assert llm.scheduler.poll_result(rid, timeout_ms=10_000).finish_reason == "length"
        assert set(names) == {THREAD_NAME}
        names.clear()
        llm.generate(prompt_tokens=[8], sampling_params=params)
        assert set(names) == {threading.current_thread().name}
        names.clear()


def test_a_failing_step_is_logged_and_the_thread_goes_on(make_llm, caplog):
    llm = make_llm(background=True)
    scheduler = llm.scheduler
    real_step = scheduler.step
    failures = []

    def step_failing_once():
        if not failures:
            failures.append(1)
            raise RuntimeError("planted")
        return real_step()

    scheduler.step = step_failing_once  # the loop looks step() up on the instance
    with caplog.at_level(logging.ERROR, logger="pocketllm.scheduler.batch_scheduler"):
        rid = scheduler.submit_request([1, 2], SamplingParams(max_tokens=2, temperature=0))
        assert scheduler.poll_result(rid, timeout_ms=10_000).finish_reason == "length"
    assert failures == [1]
    logged = [r for r in caplog.records if r.getMessage() == "scheduler step failed"]
    assert len(logged) == 1 and "planted" in str(logged[0].exc_info[1])
