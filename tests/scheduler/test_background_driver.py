"""The background thread and a caller that drives generate() itself: while the caller steps, the
thread sleeps (every forward of that call runs on the calling thread); once the caller is done,
the thread serves submissions again; a step that raises is logged and does not kill the thread."""

from __future__ import annotations

import logging
import threading
import time

from pocketllm import SamplingParams

THREAD_NAME = "pocketllm-scheduler"


def _record_threads(llm, monkeypatch) -> list[str]:
    names: list[str] = []
    real = llm.runner.run

    def run(seqs):
        names.append(threading.current_thread().name)
        return real(seqs)

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


def test_two_concurrent_drivers_keep_the_thread_asleep(make_llm, monkeypatch):
    """Caller A drives while caller B enters generate(); after A returns, B still drives, so the
    thread must keep sleeping: every forward runs on A's or B's thread."""
    llm = make_llm(background=True, max_batch_size=4)
    names = _record_threads(llm, monkeypatch)
    recorded_run = llm.runner.run
    a_inside, b_inside = threading.Event(), threading.Event()

    def run(seqs):
        a_inside.set()
        b_inside.wait(10)  # A's first forward waits until B is inside generate()
        time.sleep(0.02)  # slow forwards: a thread that wrongly woke up would get steps
        return recorded_run(seqs)

    monkeypatch.setattr(llm.runner, "run", run)
    real_submit = llm.scheduler.submit_request

    def submit(*args, **kwargs):
        request_id = real_submit(*args, **kwargs)
        if threading.current_thread().name == "B":
            b_inside.set()
        return request_id

    monkeypatch.setattr(llm.scheduler, "submit_request", submit)
    b_results = []
    b = threading.Thread(name="B", target=lambda: b_results.append(
        llm.generate(prompt_tokens=[5, 6], sampling_params=SamplingParams(max_tokens=12, temperature=0))))
    a_result = []
    a = threading.Thread(name="A", target=lambda: a_result.append(
        llm.generate(prompt_tokens=[1, 2], sampling_params=SamplingParams(max_tokens=1, temperature=0))))
    a.start()
    assert a_inside.wait(10)
    b.start()
    a.join(30)
    b.join(30)
    assert a_result[0].finish_reason == "length" and b_results[0].finish_reason == "length"
    assert set(names) <= {"A", "B"} and "B" in names


def test_a_poll_that_waits_steps_on_its_own_thread(make_llm, gate, wait_until):
    """poll_result(timeout_ms=None) drives the loop itself once the step in progress is done: the
    forwards that finish its request run on the polling thread, none on the background thread."""
    llm = make_llm(background=True)
    g = gate(llm)
    names: list[str] = []
    gated_run = llm.runner.run

    def run(seqs):
        names.append(threading.current_thread().name)
        return gated_run(seqs)

    llm.runner.run = run
    params = SamplingParams(max_tokens=3, temperature=0)
    llm.scheduler.submit_request([1, 2], params)
    assert g.entered.wait(10)  # the thread is inside the prefill of the first request
    second = llm.scheduler.submit_request([3, 4], params)
    polled = []
    poller = threading.Thread(target=lambda: polled.append(llm.scheduler.poll_result(second, timeout_ms=None)),
                              name="poller", daemon=True)
    poller.start()
    wait_until(lambda: llm.scheduler._drivers == 1, what="the poll to become the driver")
    names.clear()
    g.opened.set()
    poller.join(10)
    assert polled and polled[0].finish_reason == "length"
    assert names and set(names) == {"poller"}
