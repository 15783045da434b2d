"""AsyncLLM: many concurrent streams, early exits and task cancellation; every request reaches one
terminal state and its slot is freed; the event loop keeps running while the engine thread works
(a heartbeat task ticks while streams are mid-way); outputs equal the serial engine's."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from pocketllm import LLM, AsyncLLM, EngineArgs, GenerationResult, SamplingParams, TokenDelta


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
        assert settled() and engine.llm.cache.num_free == 8 and stats.errored == 0
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


def test_async_backpressure_raises_or_waits_without_blocking_the_loop(tiny_checkpoint):
    from pocketllm import QueueFullError

    async def main() -> None:
        args = EngineArgs(model=str(tiny_checkpoint), max_seq_len=64,
                          backend_options={"max_batch_size": 1, "max_waiting": 1})
        async with AsyncLLM(args) as engine:
            long = SamplingParams(max_tokens=40, ignore_eos=True)
            running = asyncio.create_task(engine.generate([1, 2], long))
            while engine.scheduler.get_stats().running == 0:
                await asyncio.sleep(0.001)
            queued = asyncio.create_task(engine.generate([3, 4], long))  # fills the queue
            while engine.scheduler.get_stats().waiting == 0:
                await asyncio.sleep(0.001)
            with pytest.raises(QueueFullError, match="max_waiting=1"):
                await engine.generate([5], SamplingParams(max_tokens=1))
            waited = await engine.generate([5], SamplingParams(max_tokens=1), wait_s=None)
            assert waited.finish_reason == "length"
            assert [r.finish_reason for r in await asyncio.gather(running, queued)] == ["length", "length"]

    asyncio.run(main())
