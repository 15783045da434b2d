"""Delivery: what the scheduler hands out, and to whom.

A request submitted with callbacks carries one `Subscriber` record. Token deltas come from one
producer, `token_delta` (made under the lock) and `DeltaText` (their text, outside it): `stream()`
pulls them, `on_token` (and so `AsyncLLM`) gets them pushed. What is pushed goes through one
queue of events, a token or a request's end, in the order they happened (under the scheduler's
lock), handed out by one thread at a time: so every token's delta comes, in order, before its
request's result, whichever thread ended the request (a step, a cancel from elsewhere, stop()).
A thread that finds another one handing out leaves its events to it, and a callback that steps
or cancels leaves its own to the loop it runs in: nobody waits for somebody else's callback.
Callbacks run outside the scheduler's lock; whatever one raises is logged and counted, never
allowed to end the scheduler.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Callable
from typing import Any

from ..outputs import GenerationResult
from .request import Request
from .stats import Counters
from .stream import Callback, DeltaText, Subscriber, TextDeltas, TokenCallback, TokenDelta

# The scheduler's parts log under the facade's name: one logger to configure for the scheduler.
logger = logging.getLogger("pocketllm.scheduler.batch_scheduler")

def token_delta(request: Request, index: int) -> TokenDelta:
    """Token `index` of `request`, as sampled (without text), with its top-k alternatives when
    asked for, in the result's type; token 0 with the prompt's logprobs when it scores its prompt.
    Lock held."""
    last = index == len(request.token_ids) - 1 and request.finish_reason in ("stop", "length")
    top = None if request.params.logprobs is None else list(request.top_logprobs[index])
    first = index == 0
    return TokenDelta(request.request_id, index, request.token_ids[index], request.logprobs[index], last=last,
                      top_logprobs=top, prompt_logprobs=request.prompt_logprobs() if first else None,
                      prompt_top_logprobs=request.prompt_top_logprobs() if first else None)


class Delivery:
    def __init__(self, lock: threading.Lock, counters: Counters,
                 detokenize: Callable[[list[int]], str] | None) -> None:
        self._lock = lock  # the scheduler's
        self._counters = counters
        self.detokenize = detokenize
        # (request, token index) for a token, (request, None) for its end; in the order they happened.
        self._events: collections.deque[tuple[Request, int | None]] = collections.deque()
        self._handing_out = False  # a thread is running callbacks (under the lock)

    def subscribe(self, callback: Callback | None, on_token: TokenCallback | None) -> Subscriber | None:
        """The record for a request with these callbacks (None without any)."""
        if callback is None and on_token is None:
            return None
        return Subscriber(callback, on_token, self.deltas())

    def deltas(self) -> DeltaText:
        """Fresh text state for one consumer of one request's deltas."""
        return DeltaText(None if self.detokenize is None else TextDeltas(self.detokenize))

    def sampled(self, request: Request) -> None:
        """`request` has just sampled its token (or tokens: a verify piece's): queue their deltas for
        on_token. Lock held."""
        subscriber = request.subscriber
        if subscriber is not None and subscriber.on_token is not None:
            self._events.extend((request, index) for index in range(subscriber.queued, len(request.token_ids)))
            subscriber.queued = len(request.token_ids)

    def ended(self, requests: list[Request]) -> None:
        """These requests have ended: queue their results for their subscribers. Lock held."""
        self._events.extend((request, None) for request in requests if request.subscriber is not None)

    def result(self, request: Request) -> GenerationResult:
        """An ended request's result, with its text when the engine detokenizes (decoded once)."""
        if self.detokenize is not None and request.text is None:
            request.text = self.detokenize(request.token_ids)
        return request.result()

    def deliver(self) -> None:
        """Run the callbacks of every event queued so far, in order, outside the lock; at once
        if another thread (or a callback further up this one) is doing it: it hands these out too."""
        with self._lock:
            if self._handing_out:
                return
            self._handing_out = True
        while True:
            with self._lock:  # the emptiness check and the flag change together: no event is stranded
                if not self._events:
                    self._handing_out = False
                    return
                request, index = self._events.popleft()
                subscriber = request.subscriber
                delta = None if index is None else token_delta(request, index)
                if index is None:
                    request.subscriber = None
            if subscriber is not None:
                self._guarded("delivery", request, self._hand_out, subscriber, request, delta)

    def _hand_out(self, subscriber: Subscriber, request: Request, delta: TokenDelta | None) -> None:
        """One event's callbacks: the deltas it makes ready, or (delta None) the deltas still held
        and then the result."""
        ready = subscriber.deltas.end() if delta is None else subscriber.deltas.push(delta)
        if subscriber.on_token is not None:
            for item in ready:
                self._guarded("on_token callback", request, subscriber.on_token, item)
        if delta is None and subscriber.callback is not None:
            self._guarded("callback", request, subscriber.callback, self.result(request))

    def _guarded(self, what: str, request: Request, fn: Callable[..., None], *args: Any) -> None:
        """fn(*args); whatever it raises (SystemExit and KeyboardInterrupt included: a callback must
        not end the scheduler) is logged and counted, nothing more."""
        try:
            fn(*args)
        except BaseException:
            logger.exception("%s for request %d raised", what, request.request_id)
            with self._lock:
                self._counters.counts["callback_errors"] += 1
