"""AsyncLLM: the engine for asyncio programs.

The model runs on the batch scheduler's thread; the event loop only submits, cancels and receives
(each a short critical section, never a forward pass), so it never blocks on the model. Tokens
and results cross threads through `loop.call_soon_threadsafe`. Leaving an `async for` over
`stream` early, or cancelling the task that awaits `generate`, cancels the request; so does the
event loop closing under it.

    async with AsyncLLM(EngineArgs(model=path)) as engine:
        async for delta in engine.stream([1, 2, 3], SamplingParams(max_tokens=8)):
            ...                                     # TokenDelta per token, then the GenerationResult
        result = await engine.generate(prompt="Hello", sampling_params=SamplingParams(max_tokens=8))
        queued = await engine.submit([1, 2, 3], SamplingParams(max_tokens=8))  # queued, no token yet
        async for item in queued.items:
            ...
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import weakref
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import cast

from .config import EngineArgs
from .llm import LLM
from .outputs import GenerationResult
from .sampling import SamplingParams
from .scheduler import BatchScheduler
from .scheduler.batch_scheduler import QueueFullError
from .scheduler.stream import TokenDelta
from .scheduler.waits import deadline

StreamItem = TokenDelta | GenerationResult


@dataclasses.dataclass(frozen=True)
class Submission:
    """A request `AsyncLLM.submit` queued: its id and the iteration of its items (see `stream`)."""

    request_id: int
    items: AsyncGenerator[StreamItem, None]


class AsyncStream:
    """What `AsyncLLM.stream` returns: an async iterable, iterated once (`async for`, or `aiter()`
    for `anext()`). Its iterator is a generator that only the iteration holds, so leaving the loop
    early drops it and the event loop's finalizer closes it, cancelling the request, even while the
    caller keeps this object (a generator the caller held would stay open as long as it is held).
    `aclose()` closes a running iteration, as on an async generator (`contextlib.aclosing`)."""

    def __init__(self, items: Callable[[], AsyncGenerator[StreamItem, None]]) -> None:
        self._items: Callable[[], AsyncGenerator[StreamItem, None]] | None = items
        self._iteration: weakref.ref[AsyncGenerator[StreamItem, None]] | None = None  # never keeps it alive

    def __aiter__(self) -> AsyncGenerator[StreamItem, None]:
        if self._items is None:
            raise TypeError("an AsyncLLM stream is iterated once (or was closed); call stream() again "
                            "for another request")
        iteration = self._items()
        self._items, self._iteration = None, weakref.ref(iteration)
        return iteration

    async def aclose(self) -> None:
        """End the iteration if one runs (its unfinished request is cancelled); none may start after."""
        self._items = None
        iteration = self._iteration() if self._iteration is not None else None
        if iteration is not None:
            await iteration.aclose()


def _wait_ms(wait_s: float | None) -> float | None:
    """`wait_s` in the scheduler's milliseconds, once checked by the scheduler's rule for a wait
    (a number >= 0, None or math.inf: as long as it takes)."""
    deadline(wait_s, "wait_s", per_second=1)
    return None if wait_s is None else wait_s * 1000


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

    def stream(self, prompt_tokens: Sequence[int] | None = None, sampling_params: SamplingParams | None = None, *,
               prompt: str | None = None, priority: int = 0, wait_s: float | None = 0.0) -> AsyncStream:
        """TokenDelta per sampled token (with the text it adds when the model has a tokenizer), then
        the GenerationResult, for one `async for` (see AsyncStream). Bad input raises before
        anything is queued: the prompt and `wait_s` here, the rest once iterated. With
        `max_waiting` requests waiting, QueueFullError at once (`wait_s=0`), or once `wait_s`
        seconds passed without room (None or math.inf: wait as long as it takes); the loop runs on
        meanwhile."""
        wait_ms = _wait_ms(wait_s)
        tokens = self.llm.prepare(prompt_tokens, prompt)
        items = functools.partial(self._items, tokens, sampling_params, priority, wait_ms, False)
        return AsyncStream(cast("Callable[[], AsyncGenerator[StreamItem, None]]", items))

    async def submit(self, prompt_tokens: Sequence[int] | None = None, sampling_params: SamplingParams | None = None,
                     *, prompt: str | None = None, priority: int = 0, wait_s: float | None = 0.0) -> Submission:
        """`stream`'s request, submitted before this returns, without waiting for its first token: bad
        input and QueueFullError raise here. Iterating the submission's `items` gives the deltas and
        the result; closing them (`aclose()`, or letting go of them) cancels an unfinished request."""
        wait_ms = _wait_ms(wait_s)
        tokens = self.llm.prepare(prompt_tokens, prompt)
        items = self._items(tokens, sampling_params, priority, wait_ms, True)
        request_id = await anext(items)  # the generator now waits for the first token
        assert isinstance(request_id, int)
        return Submission(request_id, cast("AsyncGenerator[StreamItem, None]", items))

    async def _items(self, tokens: Sequence[int], sampling_params: SamplingParams | None, priority: int,
                     wait_ms: float | None, announce: bool) -> AsyncGenerator[StreamItem | int, None]:
        """The request's deltas and result, submitted on the first `anext()` (which, with
        `announce`, returns the request's id once it is submitted); closing the generator before
        the result cancels the request."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[StreamItem] = asyncio.Queue()
        scheduler = self.scheduler

        def post(item: StreamItem) -> bool:
            """Hand `item` to the loop; False once the loop is closed (nobody can read it)."""
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:
                if not loop.is_closed():
                    raise
                return False
            return True

        def on_result(result: GenerationResult) -> None:  # on the engine thread, the request has ended
            scheduler.poll_result(result.request_id)  # collected here, so an abandoned stream leaks nothing
            post(result)

        def on_token(delta: TokenDelta) -> None:
            if not post(delta):  # the loop closed under the request: end it (its result callback follows)
                scheduler.cancel_request(delta.request_id)

        submit = functools.partial(scheduler.submit_request, tokens, sampling_params, callback=on_result,
                                   on_token=on_token, priority=priority)
        request_id = await self._submit(submit, wait_ms)
        ended = False
        try:
            if announce:
                yield request_id
            while not ended:
                item = await queue.get()
                ended = isinstance(item, GenerationResult)
                yield item
        finally:
            if not ended:  # left early or cancelled: the result callback collects what it did
                scheduler.cancel_request(request_id)

    async def _submit(self, submit: functools.partial[int], wait_ms: float | None) -> int:
        """submit() at once; when the queue is full and the caller waits, the scheduler's own wait
        for room runs on a worker thread, so the event loop runs on meanwhile. A request that gets
        in after its awaiting task was cancelled is cancelled too."""
        try:
            return submit()
        except QueueFullError:
            if wait_ms == 0:
                raise
        waiting = asyncio.ensure_future(asyncio.to_thread(submit, wait_ms=wait_ms))
        try:
            return await asyncio.shield(waiting)
        except asyncio.CancelledError:
            waiting.add_done_callback(self._cancel_late)
            raise

    def _cancel_late(self, done: asyncio.Future[int]) -> None:
        """Cancel the request a submission queued after nobody was waiting for it any more."""
        if not done.cancelled() and done.exception() is None:
            self.scheduler.cancel_request(done.result())

    def close(self) -> None:
        """Stop the scheduler thread; unfinished requests end "cancelled"."""
        self.llm.close()

    async def __aenter__(self) -> AsyncLLM:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await asyncio.to_thread(self.close)  # joining the engine thread may wait for a step

