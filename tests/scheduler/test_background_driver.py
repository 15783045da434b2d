"""The background thread does all the math: with it, every forward runs on that one thread, also
for generate(), stream() and a poll that waits, from any number of callers (a second thread
running torch ops slows the first on the CPU); the model is built off the caller's thread; a
step that raises is logged and does not kill the thread."""

from __future__ import annotations

import logging
import threading
import time

from pocketllm import SamplingParams

from .harness import THREAD_NAME


def _record_threads(llm, monkeypatch) -> list[str]:
    names: list[str] = []
    real = llm.runner.run

    def run(seqs):
        names.append(threading.current_thread().name)
        return real(seqs)

    monkeypatch.setattr(llm.runner, "run", run)
    return names


def test_every_forward_runs_on_the_scheduler_thread(make_llm, monkeypatch):
    llm = make_llm(background=True)
    names = _record_threads(llm, monkeypatch)
    params = SamplingParams(max_tokens=3, temperature=0)
    for _ in range(2):
        results = llm.generate(prompt_tokens=[[1, 2, 3], [4, 5]], sampling_params=params)
        assert [r.finish_reason for r in results] == ["length", "length"]
        rid = llm.scheduler.submit_request([6, 7], params)
        assert llm.scheduler.poll_result(rid, timeout_ms=None).finish_reason == "length"
        assert list(llm.stream([8, 9], params))[-1].finish_reason == "length"
    assert names and set(names) == {THREAD_NAME}


def test_the_model_is_built_off_the_callers_thread(tiny_checkpoint, monkeypatch):
    """With a scheduler thread, LLM builds model, cache and probe on a thread that then ends."""
    from pocketllm import LLM, EngineArgs
    from pocketllm import llm as llm_module

    built_on: list[str] = []
    real_build = llm_module.build_model

    def build_model(*args, **kwargs):
        built_on.append(threading.current_thread().name)
        return real_build(*args, **kwargs)

    monkeypatch.setattr(llm_module, "build_model", build_model)
    for background, expected in ((True, "pocketllm-build"), (False, threading.current_thread().name)):
        with LLM(EngineArgs(model=str(tiny_checkpoint), max_seq_len=64,
                            backend_options={"enable_batching": True, "background_thread": background})):
            assert built_on.pop() == expected
    assert not any(t.name == "pocketllm-build" for t in threading.enumerate())


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


def test_concurrent_callers_wait_while_the_thread_steps(make_llm, monkeypatch):
    """Callers in generate() on two threads, the first one's forward slowed: every forward still
    runs on the scheduler thread, and both callers get their results."""
    llm = make_llm(background=True, max_batch_size=4)
    names = _record_threads(llm, monkeypatch)
    recorded_run = llm.runner.run

    def run(seqs):
        time.sleep(0.02)  # slow forwards: a caller that wrongly stepped would show up in `names`
        return recorded_run(seqs)

    monkeypatch.setattr(llm.runner, "run", run)
    results: dict[str, object] = {}
    callers = [threading.Thread(name=name, target=lambda name=name, n=n: results.setdefault(name, llm.generate(
        prompt_tokens=[n, n + 1], sampling_params=SamplingParams(max_tokens=n, temperature=0))))
        for name, n in (("A", 1), ("B", 12))]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join(30)
    assert sorted(results) == ["A", "B"] and all(r.finish_reason == "length" for r in results.values())
    assert names and set(names) == {THREAD_NAME}
