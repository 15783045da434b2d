"""Stress: 4 client threads submit 500 requests to a background-thread scheduler and cancel some
of their own (at once or after a short random delay). Every request reaches exactly one terminal
state, seen once by its callback and once by poll_result; nothing leaks (slots, queue, thread)."""

from __future__ import annotations

import collections
import random
import threading
import time
from dataclasses import dataclass, field

from pocketllm import LLM, EngineArgs, SamplingParams

N_THREADS = 4
PER_THREAD = 125
MAX_BATCH = 4
MAX_SEQ_LEN = 64
TERMINAL = {"stop", "length", "cancelled"}


@dataclass
class Submitted:
    request_id: int
    prompt: list[int]
    params: SamplingParams
    cancel_results: list[bool] = field(default_factory=list)  # cancel_request return values, in order


def make_work(thread_index: int) -> list[tuple[list[int], SamplingParams, str, float, float]]:
    """Deterministic per-thread workload: (prompt, params, cancel mode, cancel delay, pause after)."""
    rng = random.Random(1000 + thread_index)
    work = []
    for _ in range(PER_THREAD):
        prompt = [rng.randrange(256) for _ in range(rng.randint(1, 8))]
        params = SamplingParams(
            max_tokens=rng.randint(1, 6),
            temperature=rng.choice([0.0, 0.7, 1.0]),
            top_k=rng.choice([0, 0, 10]),
            seed=rng.randrange(2**64),
            ignore_eos=rng.random() < 0.3,
        )
        mode = rng.choices(["none", "now", "later", "twice"], weights=[60, 15, 20, 5])[0]
        work.append((prompt, params, mode, rng.uniform(0.0, 0.015), rng.uniform(0.0, 0.02)))
    return work


def test_concurrent_submit_cancel_poll(tiny_checkpoint, scheduler_threads):
    """500 requests from 4 threads with random cancels: each id reaches exactly one terminal state
    in {stop, length, cancelled}; callbacks fire once per id with the polled result; a cancel that
    returned True ends "cancelled" and one that returned False (or none) does not; results of
    requests that were not cancelled equal a serial run of the same request (and cancelled ones
    are a prefix of it); at the end all slots are free, the queue is empty, the counts add up and
    close() leaves no scheduler thread alive."""
    threads_before = scheduler_threads()
    args = EngineArgs(model=str(tiny_checkpoint), max_seq_len=MAX_SEQ_LEN,
                      backend_options={"enable_batching": True, "max_batch_size": MAX_BATCH,
                                       "background_thread": True})
    llm = LLM(args)
    s = llm.scheduler
    callback_lock = threading.Condition()
    callback_count: collections.Counter[int] = collections.Counter()
    callback_results = {}

    def on_done(result):
        with callback_lock:
            callback_count[result.request_id] += 1
            callback_results[result.request_id] = result
            callback_lock.notify_all()

    submitted: list[list[Submitted]] = [[] for _ in range(N_THREADS)]
    polled: list[dict] = [{} for _ in range(N_THREADS)]
    failures: list[BaseException] = []
    start_barrier = threading.Barrier(N_THREADS)

    def client(t: int) -> None:
        try:
            start_barrier.wait(10)
            for prompt, params, mode, delay, pause in make_work(t):
                rid = s.submit_request(prompt, params, callback=on_done)
                entry = Submitted(rid, prompt, params)
                submitted[t].append(entry)
                if mode in ("later", "twice"):
                    time.sleep(delay)  # let the request get admitted / decoded for a while
                if mode != "none":
                    entry.cancel_results.append(s.cancel_request(rid))
                if mode == "twice":
                    entry.cancel_results.append(s.cancel_request(rid))
                time.sleep(pause)  # pace submissions so the queue stays short and cancels hit running requests
            for entry in submitted[t]:
                polled[t][entry.request_id] = s.poll_result(entry.request_id, timeout_ms=None)
        except BaseException as exc:  # reported by the main thread
            failures.append(exc)

    started = time.monotonic()
    clients = [threading.Thread(target=client, args=(t,), daemon=True, name=f"client-{t}") for t in range(N_THREADS)]
    try:
        for c in clients:
            c.start()
        for c in clients:
            c.join(max(1.0, 60 - (time.monotonic() - started)))
        assert not any(c.is_alive() for c in clients), "a client thread never got all its results"
        assert not failures, failures

        entries = [e for per_thread in submitted for e in per_thread]
        results = {rid: r for per_thread in polled for rid, r in per_thread.items()}
        ids = [e.request_id for e in entries]
        assert len(ids) == len(set(ids)) == N_THREADS * PER_THREAD
        assert set(results) == set(ids)

        with callback_lock:  # callbacks run just after the result is published
            assert callback_lock.wait_for(lambda: len(callback_results) == len(ids), timeout=10)
        stats = s.get_stats()
        assert llm.slots.num_free == MAX_BATCH
        assert (stats.waiting, stats.running) == (0, 0)
        assert not s.has_work
    finally:
        llm.close()
    assert not s._thread.is_alive()
    assert scheduler_threads() <= threads_before

    assert set(callback_count) == set(ids) and set(callback_count.values()) == {1}
    eos = llm.model_config.eos_token_ids
    n_cancelled = 0
    for e in entries:
        result = results[e.request_id]
        assert result.request_id == e.request_id and result.prompt_tokens == e.prompt
        assert result.finish_reason in TERMINAL, result
        assert result.error is None
        cb = callback_results[e.request_id]
        outputs = (result.finish_reason, result.token_ids, result.logprobs)
        assert (cb.finish_reason, cb.token_ids, cb.logprobs) == outputs
        assert len(result.token_ids) == len(result.logprobs) <= e.params.max_tokens
        if e.cancel_results:
            assert e.cancel_results[1:] in ([], [False]), "a second cancel must return False"
            assert (result.finish_reason == "cancelled") == e.cancel_results[0], (e, result)
        else:
            assert result.finish_reason != "cancelled"
        if result.finish_reason == "length":
            assert len(result.token_ids) == e.params.max_tokens
        elif result.finish_reason == "stop":
            stops = set(e.params.stop_token_ids) | (set() if e.params.ignore_eos else set(eos))
            assert result.token_ids[-1] in stops
            assert not stops & set(result.token_ids[:-1])
        else:
            n_cancelled += 1

    assert stats.finished + stats.cancelled == len(ids)
    assert stats.cancelled == n_cancelled > 0
    assert stats.finished > 0
    assert stats.errored == 0 and stats.callback_errors == 0
    assert stats.prompt_tokens == sum(len(e.prompt) for e in entries)
    assert stats.generated_tokens == sum(len(r.token_ids) for r in results.values())

    # Concurrency did not disturb any request: compare with each request run alone, serially.
    serial = LLM(EngineArgs(model=str(tiny_checkpoint), max_seq_len=MAX_SEQ_LEN))
    expected = serial.generate([e.prompt for e in entries], [e.params for e in entries])
    for e, ref in zip(entries, expected):
        result = results[e.request_id]
        if result.finish_reason == "cancelled":
            n = len(result.token_ids)
            assert (result.token_ids, result.logprobs) == (ref.token_ids[:n], ref.logprobs[:n])
        else:
            assert (result.finish_reason, result.token_ids, result.logprobs) == \
                (ref.finish_reason, ref.token_ids, ref.logprobs)
