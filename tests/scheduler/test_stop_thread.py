"""stop()/close() and the background thread: pending requests end "cancelled", the thread is
joined, nothing is accepted afterwards; the thread sleeps when idle and wakes on submit."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from pocketllm import LLM, EngineArgs, SamplingParams


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def test_stop_cancels_waiting_and_running_manual(make_llm):
    """stop() on a manually driven scheduler ends running and waiting requests "cancelled" (each
    callback once), frees every slot, is idempotent, and submit afterwards raises RuntimeError."""
    llm = make_llm(max_batch_size=2)
    s = llm.scheduler
    seen = []
    ids = [s.submit_request([1 + i, 2], greedy(5), callback=seen.append) for i in range(3)]
    s.step()
    assert (s.get_stats().waiting, s.get_stats().running) == (1, 2)
    s.stop()
    results = [s.poll_result(i) for i in ids]
    assert [r.finish_reason for r in results] == ["cancelled"] * 3
    assert [len(r.token_ids) for r in results] == [1, 1, 0]
    assert sorted(r.request_id for r in seen) == ids
    assert llm.slots.num_free == 2
    stats = s.get_stats()
    assert (stats.waiting, stats.running, stats.cancelled, stats.finished) == (0, 0, 3, 0)
    s.stop()
    llm.close()
    assert len(seen) == 3
    with pytest.raises(RuntimeError):
        s.submit_request([1], greedy(1))
    assert s.get_stats() == stats
    assert not s.has_work


def test_stop_with_background_thread_in_flight(make_llm, gate, wait_until, scheduler_threads):
    """stop() while the thread is inside a forward: the step completes, then every pending request
    (the one in the forward and the waiting ones) ends "cancelled", a poller blocked on one is
    woken with that result, the thread is joined and submit raises RuntimeError."""
    threads_before = scheduler_threads()
    llm = make_llm(max_batch_size=2, background=True)
    s = llm.scheduler
    assert s._thread in scheduler_threads()
    g = gate(llm)
    seen = []
    first = s.submit_request([1, 2], greedy(5), callback=seen.append)
    assert g.entered.wait(10)  # the thread is now held inside the prefill of `first`
    queued = [s.submit_request([3 + i], greedy(5), callback=seen.append) for i in range(2)]
    assert (s.get_stats().waiting, s.get_stats().running) == (2, 1)

    polled = []
    poller = threading.Thread(target=lambda: polled.append(s.poll_result(queued[1], timeout_ms=None)), daemon=True)
    poller.start()
    stopper = threading.Thread(target=llm.close, daemon=True)
    stopper.start()
    wait_until(lambda: s._stopped, what="stop() to begin")
    g.opened.set()
    stopper.join(10)
    assert not stopper.is_alive(), "stop() did not return"
    poller.join(10)
    assert not poller.is_alive()
    assert polled[0].finish_reason == "cancelled" and polled[0].token_ids == []

    assert not s._thread.is_alive()
    assert scheduler_threads() <= threads_before
    first_result, queued0 = s.poll_result(first), s.poll_result(queued[0])
    assert first_result.finish_reason == "cancelled" and len(first_result.token_ids) == 1
    assert queued0.finish_reason == "cancelled" and queued0.token_ids == []
    assert sorted(r.request_id for r in seen) == [first, *queued]
    assert llm.slots.num_free == 2
    stats = s.get_stats()
    assert (stats.waiting, stats.running, stats.cancelled) == (0, 0, 3)
    with pytest.raises(RuntimeError):
        s.submit_request([1], greedy(1))


def test_context_manager_joins_thread(tiny_checkpoint, scheduler_threads):
    """Leaving `with LLM(...)` stops the scheduler: its thread is gone, finished results remain
    collectable, and no new requests are accepted."""
    before = scheduler_threads()
    args = EngineArgs(model=str(tiny_checkpoint), max_seq_len=64,
                      backend_options={"enable_batching": True, "max_batch_size": 2, "background_thread": True})
    with LLM(args) as llm:
        s = llm.scheduler
        assert s._thread.is_alive() and s._thread.name == "pocketllm-scheduler"
        rid = s.submit_request([1, 2], greedy(2))
        assert s.poll_result(rid, timeout_ms=None).finish_reason == "length"
        pending = s.submit_request([3], greedy(60))
    assert not s._thread.is_alive()
    assert scheduler_threads() <= before
    assert s.poll_result(pending).finish_reason in ("cancelled", "length")
    with pytest.raises(RuntimeError):
        s.submit_request([1], greedy(1))


def test_idle_thread_does_not_spin_and_wakes_on_submit(make_llm):
    """With no requests the thread calls step() zero times over 0.3 s (no busy loop); a submit
    wakes it; once the work is done it goes back to sleep (no further step() calls)."""
    llm = make_llm(background=True)
    s = llm.scheduler
    calls = []
    real_step = s.step

    def counting_step():
        calls.append(time.monotonic())
        return real_step()

    s.step = counting_step  # the loop looks step() up on the instance at each iteration
    time.sleep(0.3)  # observation window
    assert calls == [] and s.get_stats().steps == 0

    rid = s.submit_request([1, 2, 3], greedy(3))
    result = s.poll_result(rid, timeout_ms=10_000)
    assert result is not None and result.finish_reason == "length"
    assert len(calls) == 3  # prefill + 2 decodes, no idle iterations
    settled = len(calls)
    time.sleep(0.3)  # observation window
    assert len(calls) == settled
    assert s.get_stats().steps == settled

    rid = s.submit_request([4], greedy(1))
    assert s.poll_result(rid, timeout_ms=10_000).finish_reason == "length"
    assert len(calls) > settled


STOP_FROM_CALLBACK = r"""
import sys, threading
from pocketllm import LLM, EngineArgs, SamplingParams
background = sys.argv[2] == "1"
llm = LLM(EngineArgs(model=sys.argv[1], max_seq_len=64, backend_options={
    "enable_batching": True, "max_batch_size": 2, "background_thread": background}))
s = llm.scheduler
# ignore_eos: an unseeded sample is EOS one time in 256 here, which would end it "stop"
rid = s.submit_request([1, 2, 3], SamplingParams(max_tokens=1, ignore_eos=True), callback=lambda result: llm.close())
if background:
    result = s.poll_result(rid, timeout_ms=None)
else:
    s.step()
    result = s.poll_result(rid)
llm.close()
try:
    s.submit_request([1], SamplingParams(max_tokens=1))
except RuntimeError:
    print("REJECTED", flush=True)
alive = [t for t in threading.enumerate() if t.name == "pocketllm-scheduler"]
print("DONE", result.finish_reason, len(alive), flush=True)
"""


def test_close_from_a_callback_does_not_deadlock(tiny_checkpoint):
    """stop()/close() called from a request's callback (which runs on the stepping thread, in both
    the manual and the background-thread mode) stops the scheduler instead of deadlocking. Each
    mode runs in its own subprocess (both at once), so a deadlock fails the test instead of hanging it."""
    procs = {mode: subprocess.Popen([sys.executable, "-c", STOP_FROM_CALLBACK, str(tiny_checkpoint), flag],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                    env={**os.environ, "OMP_NUM_THREADS": "1"})
             for mode, flag in (("manual", "0"), ("background", "1"))}
    deadline = time.monotonic() + 25
    problems = []
    for mode, proc in procs.items():
        try:
            out, err = proc.communicate(timeout=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            problems.append(f"{mode}: deadlock, close() from inside a callback never returned")
            continue
        if proc.returncode != 0 or "REJECTED" not in out or "DONE length 0" not in out:
            problems.append(f"{mode}: rc={proc.returncode} stdout={out!r} stderr={err[-2000:]!r}")
    assert not problems, "\n".join(problems)


def test_dropping_the_engine_stops_its_thread(tiny_checkpoint, scheduler_threads):
    """An LLM dropped without close() is finalized: its scheduler thread is stopped and joined,
    and its pending request ends "cancelled"."""
    import gc

    before = scheduler_threads()
    llm = LLM(EngineArgs(model=str(tiny_checkpoint), max_seq_len=64,
                         backend_options={"enable_batching": True, "max_batch_size": 2, "background_thread": True}))
    s = llm.scheduler
    thread = s._thread
    rid = s.submit_request([1, 2], SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True))
    del llm
    gc.collect()
    assert not thread.is_alive()
    assert scheduler_threads() <= before
    assert s.poll_result(rid).finish_reason in ("cancelled", "length")
    with pytest.raises(RuntimeError):
        s.submit_request([1], greedy(1))
