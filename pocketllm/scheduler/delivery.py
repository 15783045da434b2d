"""Delivery: what the scheduler hands out, and to whom.

A request submitted with callbacks carries one `Subscriber` record. Token deltas come from one
producer, `token_delta` (made under the lock) and `with_text` (outside it): `stream()` pulls them,
`on_token` (and so `AsyncLLM`) gets them pushed, in the order the tokens were sampled. Callbacks
run outside the scheduler's lock, on the thread that ran the step, one delivering thread at a
time; whatever a callback raises is logged and counted, never allowed to end the scheduler.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..outputs import GenerationResult
from .request import Request
from .stats import Counters
from .stream import TextDeltas, TokenDelta

# The scheduler's parts log under the facade's name: one logger to configure for the scheduler.
logger = logging.getLogger("pocketllm.scheduler.batch_scheduler")

Callback = Callable[[GenerationResult], None]
TokenCallback = Callable[[TokenDelta], None]


@dataclass
class Subscriber:
    """Who hears of one request: `callback(result)` once it has ended, `on_token(delta)` after
    each token, with `texts` turning its tokens into text when the engine detokenizes."""

    callback: Callback | None
    on_token: TokenCallback | None
    texts: TextDeltas | None


def token_delta(request: Request, index: int) -> TokenDelta:
    """Token `index` of `request`, as sampled (without text). Lock held."""
    last = index == len(request.token_ids) - 1 and request.finish_reason in ("stop", "length")
    return TokenDelta(request.request_id, index, request.token_ids[index], request.logprobs[index], last=last)


def with_text(delta: TokenDelta, texts: TextDeltas | None) -> TokenDelta:
    """The delta with the text its token adds (the last token also flushes what was held back)."""
    if texts is None:
        return delta
    return dataclasses.replace(delta, text=texts.add(delta.token_id) + (texts.flush() if delta.last else ""))


class Delivery:
    def __init__(self, lock: threading.Lock, counters: Counters,
                 detokenize: Callable[[list[int]], str] | None) -> None:
        self._lock = lock  # the scheduler's
        self._counters = counters
        self.detokenize = detokenize
        self._pending: collections.deque[tuple[Request, TokenDelta]] = collections.deque()  # in sampling order
        self._delivering = threading.RLock()  # one thread hands out token deltas at a time, in order

    def subscribe(self, callback: Callback | None, on_token: TokenCallback | None) -> Subscriber | None:
        """The record for a request with these callbacks (None without any)."""
        if callback is None and on_token is None:
            return None
        return Subscriber(callback, on_token, self.texts() if on_token is not None else None)

    def texts(self) -> TextDeltas | None:
        """A fresh detokenizer for one consumer of one request's tokens (None without one)."""
        return None if self.detokenize is None else TextDeltas(self.detokenize)

    def sampled(self, request: Request) -> None:
        """`request` has just sampled a token: queue its delta for on_token. Lock held."""
        subscriber = request.subscriber
        if subscriber is not None and subscriber.on_token is not None:
            self._pending.append((request, token_delta(request, len(request.token_ids) - 1)))

    def result(self, request: Request) -> GenerationResult:
        """An ended request's result, with its text when the engine detokenizes (decoded once)."""
        if self.detokenize is not None and request.text is None:
            request.text = self.detokenize(request.token_ids)
        return request.result()

    def deliver_tokens(self) -> None:
        """Run the on_token callbacks of every token sampled so far, outside the lock, in the order
        the tokens were sampled, one thread at a time (so before the result callbacks of the step
        that follows)."""
        with self._delivering:
            while True:
                with self._lock:
                    if not self._pending:
                        return
                    request, delta = self._pending.popleft()
                    subscriber = request.subscriber  # None once its result was delivered
                if subscriber is not None and subscriber.on_token is not None:
                    self._call(subscriber.on_token, with_text(delta, subscriber.texts), "on_token callback",
                               delta.request_id)

    def deliver_results(self, ended: list[Request]) -> None:
        """Run the result callbacks of ended requests, outside the lock."""
        for request in ended:
            with self._lock:
                subscriber, request.subscriber = request.subscriber, None
            if subscriber is not None and subscriber.callback is not None:
                self._call(subscriber.callback, self.result(request), "callback", request.request_id)

    def _call(self, callback: Callable[[Any], None], value: Any, what: str, request_id: int) -> None:
        """callback(value); whatever it raises (SystemExit and KeyboardInterrupt included: a
        callback must not end the scheduler) is logged and counted, nothing more."""
        try:
            callback(value)
        except BaseException:
            logger.exception("%s for request %d raised", what, request_id)
            with self._lock:
                self._counters.counts["callback_errors"] += 1
