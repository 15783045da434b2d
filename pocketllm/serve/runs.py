"""Running one HTTP request's choices on the AsyncLLM: submission, stop strings, merging, disconnects.

Every choice is submitted before the response starts, so a full queue is a 429 and never a
broken stream; a stream starts right after (its status and headers go out before any token is
computed), a response that is not streamed once each choice has its first token. Stop strings
are the server's (the engine stops on token ids): text is held back while it could still become
a stop string, and a choice that hits one is cancelled in the engine, then read to its result,
so every request reaches its one terminal state in the engine. InFlight keeps what runs, so
that a shutdown ends it in a terminal state too.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from fastapi import Request

from ..async_llm import AsyncLLM, StreamItem, Submission
from ..outputs import GenerationResult, TopLogprobs
from ..sampling import SamplingParams
from ..scheduler.stream import TokenDelta
from .errors import APIError, EngineFailure

logger = logging.getLogger(__name__)
T = TypeVar("T")
FINISH_REASONS = {"stop": "stop", "length": "length", "cancelled": "abort"}  # vLLM says "abort"


class ClientDisconnected(Exception):
    """The client went away before its response was complete."""


@dataclass(frozen=True)
class ChoiceSpec:
    """One choice to generate: its place in the response, its prompt and parameters."""

    index: int
    prompt_index: int
    prompt: list[int]
    params: SamplingParams
    stops: tuple[str, ...] = ()


@dataclass
class Piece:
    """What one step of a choice adds: its tokens and the text released with them; `finish` once it ended."""

    index: int
    deltas: list[TokenDelta]
    text: str
    finish: str | None = None


class StopText:
    """Releases text as it grows, holding back a tail that could still start a stop string."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops, self.text, self.sent = tuple(stops), "", 0
        self._hold = max((len(s) for s in stops), default=1) - 1
        self._unchecked = 0  # the text fed with check=False: a stop string must end after it

    def feed(self, piece: str, check: bool = True) -> tuple[str, bool]:
        """The text now safe to hand out, and whether a stop string ended the choice. `check`: False
        while min_tokens is not reached (as vLLM, a stop string then counts only if it ends later)."""
        start = max(0, self.sent - self._hold)
        self.text += piece
        if not check:
            self._unchecked = len(self.text)
            return self._release(max(self.sent, len(self.text) - self._hold)), False
        hits = [i for i in (self.text.find(s, max(start, self._unchecked - len(s) + 1)) for s in self.stops)
                if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            return self._release(len(self.text)), True
        return self._release(max(self.sent, len(self.text) - self._hold)), False

    def flush(self) -> str:
        return self._release(len(self.text))

    def _release(self, upto: int) -> str:
        out, self.sent = self.text[self.sent:upto], upto
        return out


@dataclass(eq=False)  # compared and hashed as itself: InFlight keeps it in a WeakSet
class ChoiceRun:
    """A submitted choice: its request and items, and its first item once read (`read_first`).
    `prompt_scores`: the prompt's logprobs and top logprobs once they came (with its first token,
    or its result), for a choice that scores its prompt."""

    spec: ChoiceSpec
    submission: Submission
    engine: AsyncLLM
    first: StreamItem | None = None
    deltas: list[TokenDelta] = field(default_factory=list)
    result: GenerationResult | None = None
    finish: str | None = None
    prompt_scores: tuple[list[float | None], list[TopLogprobs | None] | None] | None = None

    @property
    def rest(self) -> AsyncGenerator[StreamItem, None]:
        return self.submission.items

    async def read_first(self) -> None:
        self.first = await anext(self.rest)

    async def pieces(self) -> AsyncIterator[Piece]:
        """The choice's pieces, the last one with its finish reason; its result kept in `result`."""
        checker = StopText(self.spec.stops)
        item: StreamItem = self.first if self.first is not None else await anext(self.rest)
        while self.finish is None:
            if self.prompt_scores is None and item.prompt_logprobs is not None:
                self.prompt_scores = (item.prompt_logprobs, item.prompt_top_logprobs)
            if isinstance(item, GenerationResult):
                self.result, self.finish = item, self._reason(item)
                yield Piece(self.spec.index, [], checker.flush(), self.finish)
                return
            self.deltas.append(item)
            text, stopped = checker.feed(item.text or "", len(self.deltas) >= self.spec.params.min_tokens)
            if stopped:
                self.finish = "stop"
                yield Piece(self.spec.index, [item], text, "stop")
                self.result = await self._cancelled()
                return
            yield Piece(self.spec.index, [item], text)
            item = await anext(self.rest)

    def cancel(self) -> None:
        """Cancel the engine's request: its stream goes on to its result, which says "cancelled"."""
        self.engine.scheduler.cancel_request(self.submission.request_id)

    async def _cancelled(self) -> GenerationResult:
        """Cancel the engine's request (a stop string ended it) and read on to its result."""
        self.cancel()
        async for item in self.rest:
            if isinstance(item, GenerationResult):
                return item
        raise AssertionError("a stream always ends with its result")

    @staticmethod
    def _reason(result: GenerationResult) -> str:
        if result.finish_reason == "error":
            raise EngineFailure(f"the engine failed on this request: {result.error}")
        return FINISH_REASONS[result.finish_reason or "cancelled"]


async def start(engine: AsyncLLM, specs: Sequence[ChoiceSpec], read_first: bool) -> list[ChoiceRun]:
    """Submit every choice (with `read_first`, and wait for each one's first item); if one cannot
    be submitted (QueueFullError, bad input), or this is cancelled, the others are cancelled and
    the error raised."""
    tasks = [asyncio.ensure_future(engine.submit(spec.prompt, spec.params)) for spec in specs]
    try:
        await asyncio.wait(tasks)
        failed = next((t.exception() for t in tasks if t.exception() is not None), None)
        if failed is not None:
            raise failed
        runs = [ChoiceRun(spec, task.result(), engine) for spec, task in zip(specs, tasks)]
        if read_first:
            await asyncio.gather(*(run.read_first() for run in runs))
        return runs
    except BaseException:  # the client left, the server is shutting down, or one failed: none may run on
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        submitted = [t.result() for t in tasks if not t.cancelled() and t.exception() is None]
        await asyncio.gather(*(aclose(s.items) for s in submitted), return_exceptions=True)
        raise


async def aclose(items: AsyncIterator[StreamItem]) -> None:
    """Close a stream's iteration; the engine cancels its unfinished request."""
    close = getattr(items, "aclose", None)
    if close is not None:
        await close()


async def merged(runs: Sequence[ChoiceRun]) -> AsyncIterator[Piece]:
    """The pieces of every run as they come; leaving early cancels the runs still going."""
    queue: asyncio.Queue[Piece | BaseException | None] = asyncio.Queue()

    async def pump(run: ChoiceRun) -> None:
        try:
            async for piece in run.pieces():
                queue.put_nowait(piece)
            queue.put_nowait(None)
        except Exception as exc:  # handed to the consumer, which raises it
            queue.put_nowait(exc)

    tasks = [asyncio.ensure_future(pump(run)) for run in runs]
    try:
        for _ in runs:
            while (item := await queue.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(aclose(run.rest) for run in runs), return_exceptions=True)


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """`work`'s value; ClientDisconnected (with `work` cancelled) if the client goes away first."""
    task = asyncio.ensure_future(work)

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(watch())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():  # the client left, or this handler was cancelled (shutdown)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        raise ClientDisconnected
    return task.result()


class InFlight:
    """The server's submissions and runs still going, so that its shutdown can end each in a
    terminal state instead of cutting it: a run is cancelled in the engine, so it ends "abort" (a
    stream with its final chunk and [DONE], queued or not); a request still being submitted, or
    not streamed and still waiting for its first item, is withdrawn and answered 503; a request
    that comes after is answered 503 at once."""

    def __init__(self, engine: AsyncLLM) -> None:
        self.engine, self.closing = engine, False
        self._starting: set[asyncio.Task[list[ChoiceRun]]] = set()
        self._runs: weakref.WeakSet[ChoiceRun] = weakref.WeakSet()  # a finished response lets go of its runs

    async def start(self, request: Request, specs: Sequence[ChoiceSpec], read_first: bool) -> list[ChoiceRun]:
        """`start`'s runs; ClientDisconnected if the client leaves first, a 503 once shutting down."""
        if self.closing:
            raise APIError(503, "the server is shutting down")
        task = asyncio.ensure_future(self._start(specs, read_first))
        self._starting.add(task)
        try:
            return await until_disconnect(request, task)
        except ClientDisconnected:
            if self.closing:
                raise APIError(503, "the server is shutting down: the request was withdrawn before it "
                                    "started") from None
            raise
        finally:
            self._starting.discard(task)

    async def _start(self, specs: Sequence[ChoiceSpec], read_first: bool) -> list[ChoiceRun]:
        runs = await start(self.engine, specs, read_first)
        self._runs.update(runs)  # in the same step as the task ends: abort() sees them either way
        return runs

    def abort(self) -> None:
        """End everything in flight (see the class); what comes after is refused."""
        self.closing = True
        runs = list(self._runs)
        if runs or self._starting:
            logger.info("pocketllm: aborting %d choices in flight and %d requests not started", len(runs),
                        len(self._starting))
        for task in self._starting:
            task.cancel()
        for run in runs:
            run.cancel()
