"""AsyncLLM: many concurrent streams, early exits and task cancellation; every request reaches one
terminal state and its slot is freed; the event loop keeps running while the engine thread works
(a heartbeat task ticks while streams are mid-way); outputs equal the serial engine's. Misuse: a
stream left while its object is kept, an event loop closed under a running request, a bad `wait_s`.

Where a test needs the engine to be at a given point (mid-step, between steps) when it acts, a
`_Hold` keeps the scheduler thread there, so the outcome never depends on timing."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import math
import random
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from pocketllm import LLM, AsyncLLM, EngineArgs, GenerationResult, SamplingParams, TokenDelta

LONG = SamplingParams(max_tokens=8, ignore_eos=True, seed=0)  # 8 tokens: the tests hold the engine before them


class _Hold:
    """Holds a scheduler thread at one point until `release()` (30 s at most), `reached` set
    meanwhile: what a test does then cannot race the engine."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.monkeypatch = monkeypatch
        self.reached, self._released = threading.Event(), threading.Event()

    def at_forward(self, engine: AsyncLLM, n: int) -> None:
        """In the engine's n-th forward from now: mid-step, so a cancel takes effect at its end."""
        runner, count = engine.llm.runner, itertools.count(1)
        run = runner.run

        def held_run(seqs):
            if next(count) == n:
                self._wait()
            return run(seqs)

        self.monkeypatch.setattr(runner, "run", held_run)

    def after_first_token(self, engine: AsyncLLM) -> None:
        """Once the engine has handed a stream its first token: between steps, so a cancel ends
        the request at once."""
        scheduler = engine.scheduler
        submit = scheduler.submit_request

        def held_submit(*args, on_token, **kwargs):
            def held_on_token(delta: TokenDelta) -> None:
                on_token(delta)
                if delta.index == 0:
                    self._wait()

            return submit(*args, on_token=held_on_token, **kwargs)

        self.monkeypatch.setattr(scheduler, "submit_request", held_submit)

    def release(self) -> None:
        self._released.set()

    def __enter__(self) -> _Hold:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()

    def _wait(self) -> None:
        self.reached.set()
        self._released.wait(30)


@pytest.fixture
def engine(tiny_checkpoint) -> Iterator[AsyncLLM]:
    """An AsyncLLM made outside any event loop, so that it outlives the loops a test runs; closed after."""
    made = AsyncLLM(EngineArgs(model=str(tiny_checkpoint), max_seq_len=64))
    yield made
    made.close()


@pytest.fixture
def hold(engine, monkeypatch) -> Iterator[_Hold]:
    """A `_Hold`, released at teardown, before the engine closes."""
    with _Hold(monkeypatch) as held:
        yield held


async def _eventually(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Poll `predicate` while the event loop runs on; fail, never hang, after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout_s}s"
        await asyncio.sleep(0.001)


def _cancelled_early(engine: AsyncLLM) -> None:
    """The engine's one request ended "cancelled" before `LONG.max_tokens`, and no callback raised
    (waits, bounded, until it has ended and its result callback has collected it)."""
    scheduler = engine.scheduler
    asyncio.run(_eventually(lambda: not scheduler.has_work and scheduler.get_stats().uncollected == 0))
    stats = scheduler.get_stats()
    assert (stats.cancelled, stats.finished, stats.callback_errors) == (1, 0, 0)
    assert 0 < stats.generated_tokens < LONG.max_tokens


def _logged(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.name.startswith("pocketllm")]


def _params(rng: random.Random) -> SamplingParams:
    return SamplingParams(max_tokens=rng.randint(1, 12), temperature=rng.choice([0.0, 0.9]),
                          seed=rng.randrange(2**32), ignore_eos=True)


@pytest.mark.slow
def test_hundreds_of_concurrent_requests_early_exits_and_cancellation(tiny_checkpoint):
    rng = random.Random(0)
    jobs = [([rng.randrange(256) for _ in range(rng.randint(1, 24))], _params(rng)) for _ in range(200)]
    serial = LLM(EngineArgs(model=str(tiny_checkpoint), max_seq_len=64))
    expected = [serial.generate(prompt_tokens=p, sampling_params=sp) for p, sp in jobs]
    ticks_mid_stream = 0
    streaming: set[int] = set()

    async def main() -> tuple[list, AsyncLLM]:
        nonlocal ticks_mid_stream
        engine = AsyncLLM(EngineArgs(model=str(tiny_checkpoint), max_seq_len=64,
                                     backend_options={"max_batch_size": 8}))
        stop = asyncio.Event()

        async def heartbeat() -> None:
            nonlocal ticks_mid_stream
            while not stop.is_set():
                await asyncio.sleep(0.001)
                ticks_mid_stream += bool(streaming)

        async def consume(index: int) -> object:
            prompt, params = jobs[index]
            if index % 5 == 0:
                return await engine.generate(prompt, params)
            seen = []
            async for item in engine.stream(prompt, params):
                if isinstance(item, GenerationResult):
                    streaming.discard(index)
                    return seen, item
                streaming.add(index)
                seen.append(item.token_id)
                if index % 7 == 1 and len(seen) == 2:
                    streaming.discard(index)
                    return seen, None  # left early: the request is cancelled
            raise AssertionError("no result")

        beat = asyncio.create_task(heartbeat())
        tasks = [asyncio.create_task(consume(i)) for i in range(len(jobs))]
        await asyncio.sleep(0)
        for index in range(3, len(jobs), 11):  # cancelled tasks
            tasks[index].cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        stop.set()
        await beat
        return results, engine

    results, engine = asyncio.run(main())
    try:
        for index, outcome in enumerate(results):
            want = expected[index].token_ids
            if isinstance(outcome, asyncio.CancelledError):
                assert index % 11 == 3
            elif isinstance(outcome, GenerationResult):
                assert (outcome.token_ids, outcome.logprobs) == (want, expected[index].logprobs)
            else:
                seen, result = outcome
                assert seen == (want if result is not None else want[:len(seen)])
        scheduler = engine.scheduler

        def settled() -> bool:
            stats = scheduler.get_stats()
            return stats.running == stats.waiting == 0 and stats.finished + stats.cancelled == len(jobs)

        for _ in range(2000):  # a cancellation takes effect at the end of the step in progress
            if settled():
                break
            time.sleep(0.005)
        stats = scheduler.get_stats()
        assert settled() and engine.llm.slots.num_free == 8 and stats.errored == 0
        assert stats.uncollected == 0  # every result was collected: nothing leaks
        assert ticks_mid_stream >= 3  # the loop ran while streams were mid-way
    finally:
        engine.close()


def test_async_text_and_errors(tiny_checkpoint):
    async def main() -> None:
        async with AsyncLLM(EngineArgs(model=str(tiny_checkpoint), max_seq_len=64)) as engine:
            items = [item async for item in engine.stream(prompt="hello", sampling_params=SamplingParams(
                max_tokens=6, temperature=1.0, seed=1))]
            *deltas, result = items
            assert all(isinstance(d, TokenDelta) for d in deltas)
            assert "".join(d.text for d in deltas) == result.text
            with pytest.raises(ValueError, match="outside the vocabulary"):
                await engine.generate([10**6], SamplingParams(max_tokens=1))
            with pytest.raises(TypeError, match="one prompt"):
                await engine.generate()
            assert not engine.scheduler.has_work

    asyncio.run(main())


def test_submit_returns_once_queued_and_token_0_brings_the_prompts_scores(engine, hold):
    """`submit` returns while the engine is held in its first forward (no token yet), with the id
    its deltas carry; token 0's delta has the prompt's logprobs and top logprobs, the result's;
    closing a submission's items cancels its request; bad input raises from `submit` itself."""
    hold.at_forward(engine, 1)
    scoring = SamplingParams(max_tokens=3, ignore_eos=True, seed=4, logprobs=1, prompt_logprobs=2)

    async def main() -> None:
        first = await engine.submit([5, 6, 7, 8], scoring)
        await _eventually(lambda: hold.reached.is_set())
        second = await engine.submit([1, 2], LONG)
        assert engine.scheduler.get_stats().generated_tokens == 0  # both queued, no token computed
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await engine.submit([10**6], LONG)
        await second.items.aclose()
        hold.release()
        *deltas, result = [item async for item in first.items]
        assert [d.request_id for d in deltas] == [first.request_id] * 3 and result.request_id == first.request_id
        assert deltas[0].prompt_logprobs == result.prompt_logprobs and result.prompt_logprobs[0] is None
        assert deltas[0].prompt_top_logprobs == result.prompt_top_logprobs and len(result.prompt_logprobs) == 4
        assert all(d.prompt_logprobs is None and d.prompt_top_logprobs is None for d in deltas[1:])

    asyncio.run(main())
    stats = engine.scheduler.get_stats()
    assert (stats.finished, stats.cancelled) == (1, 1) and engine.llm.slots.num_free == engine.llm.args.max_batch_size


def test_async_backpressure_raises_or_waits_without_blocking_the_loop(tiny_checkpoint, monkeypatch):
    """Seeded and ignoring EOS, so every request runs to its max_tokens; `running` is held in its
    second forward until the checks that need a full queue are done."""
    from pocketllm import QueueFullError

    async def main() -> None:
        args = EngineArgs(model=str(tiny_checkpoint), max_seq_len=64,
                          backend_options={"max_batch_size": 1, "max_waiting": 1})
        async with AsyncLLM(args) as engine:
            long = SamplingParams(max_tokens=40, ignore_eos=True, seed=1)
            short = SamplingParams(max_tokens=1, ignore_eos=True, seed=2)
            with _Hold(monkeypatch) as hold:
                hold.at_forward(engine, 2)
                running = asyncio.create_task(engine.generate([1, 2], long))
                await _eventually(lambda: engine.scheduler.get_stats().running == 1)
                queued = asyncio.create_task(engine.generate([3, 4], long))  # fills the queue
                await _eventually(lambda: engine.scheduler.get_stats().waiting == 1)
                with pytest.raises(QueueFullError, match="max_waiting=1"):
                    await engine.generate([5], short)
                room = asyncio.create_task(engine.generate([5], short, wait_s=None))
                await asyncio.sleep(0.01)
                assert not room.done()  # it waits for room while the loop runs on
            waited = await room
            assert waited.finish_reason == "length"
            assert [r.finish_reason for r in await asyncio.gather(running, queued)] == ["length", "length"]

    asyncio.run(main())


def test_wait_s_is_checked_before_anything_is_queued(engine):
    """NaN, negative, bool or non-number `wait_s` raise naming it, with nothing queued; a number
    >= 0, None and math.inf are taken."""
    one = SamplingParams(max_tokens=1, ignore_eos=True, seed=0)

    async def main() -> None:
        for wait_s, error in [(math.nan, ValueError), (-1, ValueError), (-math.inf, ValueError),
                              (True, TypeError), ("1", TypeError)]:
            with pytest.raises(error, match="wait_s"):
                await engine.generate([1], one, wait_s=wait_s)
            with pytest.raises(error, match="wait_s"):
                async for _ in engine.stream([1], one, wait_s=wait_s):
                    pass
        assert engine.scheduler.get_stats().prompt_tokens == 0
        for wait_s in (0, 0.5, None, math.inf, 10**400):
            assert (await engine.generate([1], one, wait_s=wait_s)).finish_reason == "length"

    asyncio.run(main())


@pytest.mark.parametrize("kept", [False, True], ids=["dropped", "kept"])
def test_leaving_a_stream_early_cancels_its_request(engine, hold, kept):
    """Breaking out of `async for` cancels the request, also while the caller keeps the stream
    object; the engine is held after the first token, so the request cannot finish meanwhile."""
    hold.after_first_token(engine)

    async def main() -> None:
        stream = engine.stream([1, 2], LONG)
        async for _ in stream:
            break
        if not kept:
            del stream
        await _eventually(lambda: engine.scheduler.get_stats().cancelled == 1)

    asyncio.run(main())
    hold.release()
    _cancelled_early(engine)


def test_a_stream_is_iterated_once_and_closes_like_a_generator(engine, hold):
    """`async for` and `aiter()` work, a second iteration or `anext()` on the stream itself raise
    TypeError; `aclose()` (so `contextlib.aclosing`) ends an iteration still running."""
    hold.after_first_token(engine)

    async def main() -> None:
        stream = engine.stream([1, 2], LONG)
        with pytest.raises(TypeError, match="not an async iterator"):
            await anext(stream)
        async with contextlib.aclosing(stream):
            deltas = aiter(stream)
            assert (await anext(deltas)).index == 0
            with pytest.raises(TypeError, match="iterated once"):
                aiter(stream)
        assert engine.scheduler.get_stats().cancelled == 1  # closed: the request ended at once

    asyncio.run(main())
    hold.release()
    _cancelled_early(engine)


def test_a_closed_event_loop_cancels_its_running_request_silently(engine, hold, caplog):
    """A loop closed by hand under a stream it left mid-way (and kept): the request's next token
    finds the loop closed, so the request is cancelled there; nothing is logged."""
    caplog.set_level(logging.DEBUG, logger="pocketllm")
    hold.at_forward(engine, 3)  # a first token whose text is incomplete comes with the second

    async def first_token():
        deltas = aiter(engine.stream([1, 2], LONG))
        await anext(deltas)
        return deltas

    loop = asyncio.new_event_loop()
    deltas = loop.run_until_complete(first_token())  # kept: no finalizer closes it
    assert hold.reached.wait(10)
    loop.close()
    hold.release()
    _cancelled_early(engine)
    assert _logged(caplog) == []
    del deltas  # only now may the stream go


def test_leaving_a_stream_at_the_end_of_asyncio_run_logs_nothing(engine, hold, caplog):
    """The stream is left while the engine is mid-step, so its request ends with that step, after
    asyncio.run has closed the loop: the step's token and the result find the loop closed."""
    caplog.set_level(logging.DEBUG, logger="pocketllm")
    hold.at_forward(engine, 3)  # a first token whose text is incomplete comes with the second

    async def main() -> None:
        async for _ in engine.stream([1, 2], LONG):
            await _eventually(hold.reached.is_set)
            break

    asyncio.run(main())
    hold.release()
    _cancelled_early(engine)
    assert _logged(caplog) == []
