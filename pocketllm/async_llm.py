"""AsyncLLM: the engine for asyncio programs.

The model runs on the batch scheduler's thread; the event loop only submits, cancels and receives
(each a short critical section, never a forward pass), so it never blocks on the model. Tokens
and results cross threads through `loop.call_soon_threadsafe`. Leaving an `async for` over
`stream` early, or cancelling the task that awaits `generate`, cancels the request.

    async with AsyncLLM(EngineArgs(model=path)) as engine:
        async for delta in engine.stream([1, 2, 3], SamplingParams(max_tokens=8)):
            ...                                     # TokenDelta per token, then the GenerationResult
        result = await engine.generate(prompt="Hello", sampling_params=SamplingParams(max_tokens=8))
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Sequence

from .config import EngineArgs
from .llm import LLM
from .outputs import GenerationResult
from .sampling import SamplingParams
from .scheduler import BatchScheduler
from .scheduler.batch_scheduler import QueueFullError
from .scheduler.stream import TokenDelta

ROOM_POLL_S = 0.005  # how often a submission that waits for room in the queue tries again


class AsyncLLM:
    """An LLM in batched mode with its scheduler thread, driven from an event loop."""

    def __init__(self, args: EngineArgs) -> None:
        options = {**(args.backend_options or {}), "enable_batching": True, "background_thread": True}
        self.llm = LLM(dataclasses.replace(args, backend_options=options))

    @property
    def scheduler(self) -> BatchScheduler:
        assert self.llm.scheduler is not None  # always batched
        return self.llm.scheduler

    async def generate(self, prompt_tokens: Sequence[int] | None = None,
                       sampling_params: SamplingParams | None = None, *, prompt: str | None = None,
                       priority: int = 0, wait_s: float | None = 0.0) -> GenerationResult:
        """The request's result once it has ended; cancelling the awaiting task cancels it."""
        async for item in self.stream(prompt_tokens, sampling_params, prompt=prompt, priority=priority,
                                      wait_s=wait_s):
            if isinstance(item, GenerationResult):
                return item
        raise AssertionError("a stream always ends with its result")

    async def stream(self, prompt_tokens: Sequence[int] | None = None,
                     sampling_params: SamplingParams | None = None, *, prompt: str | None = None,
                     priority: int = 0, wait_s: float | None = 0.0) -> AsyncIterator[TokenDelta | GenerationResult]:
        """TokenDelta per sampled token (with the text it adds when the model has a tokenizer), then
        the GenerationResult. Bad input raises before anything is queued. With `max_waiting`
        requests waiting, QueueFullError at once (`wait_s=0`), or once `wait_s` seconds passed
        without room (None: wait as long as it takes); the loop runs on meanwhile."""
        llm = self.llm
        tokens, params = llm.prepare(prompt_tokens, sampling_params, prompt)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[TokenDelta | GenerationResult] = asyncio.Queue()
        scheduler = self.scheduler

        def on_result(result: GenerationResult) -> None:  # on the engine thread, the request has ended
            scheduler.poll_result(result.request_id)  # collected here, so an abandoned stream leaks nothing
            loop.call_soon_threadsafe(queue.put_nowait, result)

        def on_token(delta: TokenDelta) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, delta)

        deadline = None if wait_s is None else loop.time() + wait_s
        while True:
            try:
                request_id = scheduler.submit_request(tokens, params, callback=on_result, on_token=on_token,
                                                      priority=priority)
                break
            except QueueFullError:
                if deadline is not None and loop.time() >= deadline:
                    raise
                await asyncio.sleep(ROOM_POLL_S)  # never block the loop on the queue's condition
        ended = False
        try:
            while not ended:
                item = await queue.get()
                ended = isinstance(item, GenerationResult)
                yield item
        finally:
            if not ended:  # left early or cancelled: the result callback collects what it did
                scheduler.cancel_request(request_id)

    def close(self) -> None:
        """Stop the scheduler thread; unfinished requests end "cancelled"."""
        self.llm.close()

    async def __aenter__(self) -> AsyncLLM:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await asyncio.to_thread(self.close)  # joining the engine thread may wait for a step
