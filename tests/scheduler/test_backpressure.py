"""Backpressure and shutdown: `max_waiting` refuses (or holds) submissions beyond it and loses
nothing below it; stop() cancels what is left, stop(drain=True) lets it finish first."""

from __future__ import annotations

import threading

import pytest

from pocketllm import QueueFullError, SamplingParams


def _params(n: int = 3) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0)


@pytest.fixture
def engine(tiny_checkpoint):
    from pocketllm import LLM, EngineArgs

    made = []

    def make(**options):
        llm = LLM(EngineArgs(model=str(tiny_checkpoint), max_seq_len=64,
                             backend_options={"enable_batching": True, "background_thread": False,
                                              "max_batch_size": 1, **options}))
        made.append(llm)
        return llm

    yield make
    for llm in made:
        llm.close()


def test_submissions_beyond_max_waiting_are_refused_and_nothing_below_is_lost(engine):
    s = engine(max_waiting=2).scheduler
    ids = [s.submit_request([i + 1], _params()) for i in range(2)]
    with pytest.raises(QueueFullError, match="2 requests are waiting, the most max_waiting=2 allows"):
        s.submit_request([9], _params())
    with pytest.raises(QueueFullError):
        s.submit_request([9], _params(), wait_ms=20)  # nobody steps: no room comes
    s.step()  # one is admitted: room for one more
    ids.append(s.submit_request([3], _params()))
    while s.has_work:
        s.step()
    assert [s.poll_result(i).finish_reason for i in ids] == ["length"] * 3
    stats = s.get_stats()
    assert stats.finished == 3 and stats.cancelled == stats.errored == 0


def test_a_submission_that_waits_gets_in_when_room_frees(engine):
    """A bounded wait waits for another caller's step (it does not step itself)."""
    s = engine(max_waiting=1).scheduler
    first = s.submit_request([1, 2], _params())
    admitted = []
    waiter = threading.Thread(target=lambda: admitted.append(s.submit_request([5], _params(), wait_ms=60_000)))
    waiter.start()
    waiter.join(0.05)
    assert waiter.is_alive()  # held: the queue is full
    s.step()  # admits `first`: the waiting submission gets in
    waiter.join(10)
    assert len(admitted) == 1
    while s.has_work:
        s.step()
    assert s.poll_result(first).finish_reason == s.poll_result(admitted[0]).finish_reason == "length"


def test_stop_cancels_and_drain_finishes(engine):
    s = engine().scheduler
    ids = [s.submit_request([i + 1], _params(4)) for i in range(3)]
    s.step()
    s.stop()
    assert [s.poll_result(i).finish_reason for i in ids] == ["cancelled"] * 3
    s = engine().scheduler
    ids = [s.submit_request([i + 1], _params(4)) for i in range(3)]
    s.step()
    s.stop(drain=True)
    assert [s.poll_result(i).finish_reason for i in ids] == ["length"] * 3
    with pytest.raises(RuntimeError, match="stopped"):
        s.submit_request([1], _params())
