"""BatchScheduler: continuous batching over a fixed set of cache slots; the threaded facade.

The Python counterpart of a C++ `QwenBatchScheduler`: submit/cancel/poll/stats/stop from any
thread, and one loop iteration, `step()`:

    plan (planner.py) -> one forward (execute.py) -> apply outcomes -> complete -> deliver (delivery.py)

This module and the loop it builds on (loop.py) own what the parts must not: the lock, the
conditions and the thread. With the background thread, it alone calls `step()` while there is
work, and sleeps on a condition otherwise: every forward runs on that one thread (see `_drive`).
Without it, the callers step the loop: `generate()`, `stream()` and a poll that waits without a
timeout do (deterministic tests step by hand), and so does the scheduler thread itself when a
callback on it waits. The forward runs outside the lock, so submit, cancel and a poll with a
timeout never wait for the model. Every submitted request reaches exactly one terminal state
("stop", "length", "cancelled" or "error"), and its slot is freed when it does.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import cast, overload

from ..cache import SlotCache
from ..grammar import Grammars
from ..options import PreemptionMode
from ..outputs import GenerationResult
from ..runner import ModelRunner
from ..sampling import SamplingParams
from ..speculative import SpeculativeConfig
from .delivery import Callback, Delivery, Subscriber, TokenCallback, token_delta
from .draft_model import Drafting
from .loop import SchedulerLoop
from .planner import Planner
from .policy import PrefillPolicy, check_policy, check_preemption_mode
from .request import Request, RequestStatus, check_submission
from .slots import SlotManager
from .speculation import check_speculative, speculation_for
from .stats import Counters, SchedulerStats
from .stream import TokenDelta
from .timeline import SlotEvent
from .waits import deadline


class QueueFullError(RuntimeError):
    """submit_request found `max_waiting` requests waiting (and waited as long as it was told to)."""


class SwapSpaceError(RuntimeError):
    """A preemption would hold more than `max_swap_bytes` of swapped-out slots in host memory."""


class BatchScheduler(SchedulerLoop):
    def __init__(self, runner: ModelRunner, cache: SlotCache, vocab_size: int, max_seq_len: int,
                 eos_token_ids: tuple[int, ...] = (), background_thread: bool = True, record_timeline: bool = False,
                 request_ids: Iterator[int] | None = None, policy: PrefillPolicy | None = None,
                 max_waiting: int = 0, max_swap_bytes: int = 0,
                 detokenize: Callable[[list[int]], str] | None = None, exact_positions: bool = False,
                 preemption_mode: PreemptionMode = "swap", grammars: Grammars | None = None,
                 speculative: SpeculativeConfig | None = None, drafter: Drafting | None = None) -> None:
        """`max_waiting`: submissions refused (or made to wait) beyond this many waiting requests;
        `max_swap_bytes`: host memory preempted requests may hold (0: no limit, for both).
        `detokenize`: token ids -> text; with it, results and token deltas carry text.
        `exact_positions`: the op table gives a position the same bits decoded or prefilled at any cut,
        so decoded positions are reusable and a prompt is cut where the step's budget runs out.
        `preemption_mode`: "swap" (a preempted slot copied to host memory and back) or "recompute"
        (the slot freed, the request's tokens prefilled again on readmission; needs exact_positions).
        `grammars`: compiles requests' structured outputs (SamplingParams.structured_outputs) at
        submission and gives each its matcher; without it such a request is refused.
        `speculative`: each request drafts tokens and a step verifies them (a verify piece in place of
        its decode row, within the token budget); needs exact positions, where a verified row has its
        decode step's bits; `drafter`: the draft model that proposes them (method "draft_model")."""
        policy = policy if policy is not None else PrefillPolicy()
        check_policy(policy, cache.num_slots, max_seq_len, cache.has_states, exact_positions)
        check_preemption_mode(preemption_mode, exact_positions)
        check_speculative(speculative, exact_positions)
        self.speculative, self.drafter = speculative, drafter
        self.runner, self.cache = runner, cache
        self.vocab_size, self.max_seq_len, self.eos_token_ids = vocab_size, max_seq_len, eos_token_ids
        self.max_waiting, self.grammars = max_waiting, grammars
        self._ids = request_ids if request_ids is not None else itertools.count()
        self._lock = threading.Lock()  # every request, queue, counter and the timeline change under it
        self._work = threading.Condition(self._lock)  # the loop waits here for requests
        self._changed = threading.Condition(self._lock)  # pollers, streams and submitters: results, tokens, room
        self._step_lock = threading.Lock()  # one step at a time, whoever calls it
        self.counters = Counters(record_timeline)
        self.slots = SlotManager(cache, policy, reuse_decoded=exact_positions)
        self.planner = Planner(self.slots, policy, self.counters, max_swap_bytes, cut_at_budget=exact_positions,
                               preemption_mode=preemption_mode)
        self.delivery = Delivery(self._lock, self.counters, detokenize)
        self._requests: dict[int, Request] = {}  # submitted, result not yet collected
        self._detached: set[int] = set()  # ids whose results nobody collects: dropped once they end
        self._stepping = self._stopped = self._draining = False  # _draining: stop(drain=True) is finishing
        self._thread: threading.Thread | None = None
        if background_thread:
            self._thread = threading.Thread(target=self._loop, name="pocketllm-scheduler", daemon=True)
            self._thread.start()

    @property
    def policy(self) -> PrefillPolicy:
        return self.planner.policy

    @property
    def timeline(self) -> list[SlotEvent] | None:
        """Per-forward slot events, when recording (read it once the work is done)."""
        return self.counters.timeline

    # -- public API (any thread) ---------------------------------------------------------------

    def submit_request(self, prompt_tokens: Sequence[int], sampling: SamplingParams | None = None,
                       callback: Callback | None = None, priority: int = 0, on_token: TokenCallback | None = None,
                       wait_ms: float | None = 0) -> int:
        """Queue a request; returns its id. Bad input raises TypeError/ValueError and queues nothing.

        `priority`: lower runs first, first come first served among equals; a waiting request
        preempts a running one of a higher value when no slot is free. `callback(result)` runs once
        the request has ended, `on_token(delta)` after each token, both on the thread that ran the
        step, outside the scheduler's lock (a delta whose token leaves the text inside a character
        comes with the next token, or when the request ends). With `max_waiting` requests
        waiting, a submission raises QueueFullError at once (`wait_ms=0`), after waiting up to
        `wait_ms` for room, or waits as long as it takes (None; stepping the loop itself where
        nobody else would, as `_drive` does)."""
        until = deadline(wait_ms, "wait_ms")
        prompt, sampling = check_submission(prompt_tokens, sampling, priority, self.vocab_size, self.max_seq_len,
                                            self.grammars, callback=callback, on_token=on_token)
        return self._enqueue(prompt, sampling, priority, self.delivery.subscribe(callback, on_token), until)

    def preempt(self, request_id: int) -> bool:
        """Preempt a running request at the start of the next step: its slot is freed and it waits
        again (in its priority order), then continues in a free slot later as if never interrupted.
        By swap, its slot's K/V and states go to host memory bit for bit and come back; by recompute,
        it prefills its prompt and the tokens it generated again (reusing what a slot still holds),
        and no token is delivered twice. False if it is not running (or already ending);
        SwapSpaceError when a swap would exceed `max_swap_bytes`. True sets the swap's bytes aside, so
        the preemption happens unless the request ends first; its size is that after the step in
        progress, the one the automatic path checks."""
        with self._lock:
            request = self._requests.get(request_id)
            if (request is None or request.status is not RequestStatus.RUNNING or request.finished
                    or request.cancel_requested or request.preempt_requested):
                return False
            if not self.planner.reserve(request):
                raise SwapSpaceError(f"swapping request {request_id} out would hold {self.slots.swap_bytes(request)} "
                                     f"bytes of host memory (with what is swapped out or set aside), over "
                                     f"max_swap_bytes={self.planner.max_swap_bytes}")
            request.preempt_requested = True
            return True

    def cancel_request(self, request_id: int) -> bool:
        """Cancel a waiting or running request; False if it is unknown or already finished.
        A waiting request ends at once; a running one at the end of the step in progress."""
        with self._lock:
            request = self._requests.get(request_id)
            if request is None or request.finished or request.cancel_requested:
                return False
            request.cancel_requested = True
            if request.status is RequestStatus.WAITING:
                self.planner.cancel_waiting(request)
                ended = [request]
            else:
                ended = [] if self._stepping else self.planner.complete()
            self._ended(ended)
        self.delivery.deliver()
        return True

    @overload
    def poll_result(self, request_id: int, timeout_ms: None) -> GenerationResult: ...
    @overload
    def poll_result(self, request_id: int, timeout_ms: float | None = 0) -> GenerationResult | None: ...
    def poll_result(self, request_id: int, timeout_ms: float | None = 0) -> GenerationResult | None:
        """The request's result once it has finished, else None after waiting up to `timeout_ms`
        (None or math.inf: wait as long as it takes). A result is handed over once; then the id is
        unknown. Raises KeyError for an id that was never submitted or was already collected,
        ValueError for a negative or NaN timeout."""
        # At once for an unknown id (KeyError below); a wait without end may have to step the loop.
        if not self._drive(lambda: self._collectable(request_id), deadline(timeout_ms, "timeout_ms")):
            return None
        with self._lock:
            request = self._requests.pop(request_id, None)  # collectable: ended and out of its slot
        if request is None:
            raise KeyError(f"request id {request_id} is unknown or its result was already collected")
        return self.delivery.result(request)

    def get_stats(self) -> SchedulerStats:
        with self._lock:
            waiting = self.planner.waiting
            return self.counters.snapshot(
                waiting=len(waiting), running=len(self.planner.running), cache_bytes=self.cache.nbytes,
                state_snapshot_bytes=self.cache.prefix_state_nbytes,
                swapped_out=sum(r.swapped is not None for r in waiting), swap_bytes_held=self.slots.swap_held,
                uncollected=sum(r.finished and r.slot is None for r in self._requests.values()))

    def stop(self, drain: bool = False) -> None:
        """Stop the loop, the thread joined. drain=False: every request not yet finished ends
        "cancelled"; drain=True: new submissions are refused at once, and the requests already
        submitted run to their end first (see `_drive`)."""
        if drain:
            with self._lock:
                self._draining = True
            self._drive(lambda: not self._busy())
        with self._lock:
            self._stopped = True
            self._work.notify_all()
            self._changed.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._end_rest()

    def generate(self, requests: Sequence[tuple[Sequence[int], SamplingParams]],
                 priority: int = 0) -> list[GenerationResult]:
        """Submit (prompt, params) pairs, every one checked before any is queued, and return their
        results once all are done (see `_drive`: the background thread steps the loop, or this
        thread does); other submitters' requests share the steps. With `max_waiting`, the
        submissions wait for room as they go, so any number of prompts gets through. If this
        raises part way (stop(), an interrupt), what it queued is cancelled and never left over."""
        checked = [check_submission(prompt, params, priority, self.vocab_size, self.max_seq_len, self.grammars)
                   for prompt, params in requests]
        ids: list[int] = []
        try:
            for prompt, params in checked:
                ids.append(self._enqueue(prompt, params, priority, None, None))
            self._drive(lambda: all(self._collectable(i) for i in ids))
        except BaseException:
            self._abandon(ids)
            raise
        # Every one has finished, so none of these polls comes back empty.
        return cast("list[GenerationResult]", [self.poll_result(i) for i in ids])

    def stream(self, request_id: int) -> Iterator[TokenDelta | GenerationResult]:
        """The request's tokens as they are sampled (TokenDelta each, in order, none skipped), then
        its GenerationResult (collected: the id is unknown afterwards). Waits for tokens as
        `_drive` does. Leaving the iteration early cancels the request. KeyError for an unknown or
        collected id."""
        with self._lock:
            if request_id not in self._requests:
                raise KeyError(f"request id {request_id} is unknown or its result was already collected")
        sent, texts = 0, self.delivery.deltas()
        try:
            while True:
                with self._lock:
                    request = self._requests[request_id]
                    deltas = [token_delta(request, i) for i in range(sent, len(request.token_ids))]
                    ended = self._collectable(request_id)
                sent += len(deltas)
                for delta in deltas:
                    yield from texts.push(delta)
                if ended:
                    yield from texts.end()
                    yield self.poll_result(request_id, timeout_ms=None)
                    return
                self._drive(self._progressed(request, sent))
        finally:
            with self._lock:
                left = request_id in self._requests
            if left:  # left early: end it and collect what it did (unless a callback just did)
                self.cancel_request(request_id)
                with contextlib.suppress(KeyError):
                    self.poll_result(request_id, timeout_ms=None)

    def configure(self, policy: PrefillPolicy) -> None:
        """Run on another prefill policy (budget, cuts, reuse) from now on; only while idle, with
        no request waiting or running (RuntimeError otherwise). What the slots hold stays
        reusable when the reuse grid and snapshot interval are unchanged, and is forgotten else."""
        if not isinstance(policy, PrefillPolicy):
            raise TypeError(f"configure() takes a PrefillPolicy, got {type(policy).__name__}")
        check_policy(policy, self.cache.num_slots, self.max_seq_len, self.cache.has_states, self.planner.cut_at_budget)
        with self._step_lock, self._lock:
            if self._busy():
                raise RuntimeError("configure() needs an idle scheduler: requests are waiting or running")
            self.planner.policy = policy
            self.slots.configure(policy)

    @property
    def has_work(self) -> bool:
        with self._lock:
            return self._busy()

    def _abandon(self, ids: list[int]) -> None:
        """Cancel these requests; their results are dropped when they end, nobody collects them."""
        for request_id in ids:
            self.cancel_request(request_id)
        with self._lock:
            for request_id in ids:
                if self._collectable(request_id):
                    self._requests.pop(request_id, None)
                else:
                    self._detached.add(request_id)

    # -- helpers (lock held unless said otherwise) ----------------------------------------------

    def _enqueue(self, prompt: list[int], sampling: SamplingParams, priority: int, subscriber: Subscriber | None,
                 until: float | None) -> int:
        """Queue a checked request once the queue has room (see submit_request). No lock."""
        while True:
            with self._lock:
                if self._stopped or self._draining:
                    raise RuntimeError("scheduler is stopped; no new requests are accepted")
                waiting = len(self.planner.waiting)
                if self._has_room():
                    return self._queue(prompt, sampling, priority, subscriber)
            if not self._drive(lambda: self._stopped or self._draining or self._has_room(), until):
                raise QueueFullError(f"{waiting} requests are waiting, the most max_waiting={self.max_waiting} "
                                     f"allows; retry later or pass wait_ms to wait for room")

    def _has_room(self) -> bool:
        return not self.max_waiting or len(self.planner.waiting) < self.max_waiting

    def _queue(self, prompt: list[int], sampling: SamplingParams, priority: int, subscriber: Subscriber | None) -> int:
        grammar = None if self.grammars is None else self.grammars.state(sampling)  # compiled at the check
        request = Request(next(self._ids), prompt, sampling, sampling.resolved_seed(), self.eos_token_ids,
                          priority=priority, subscriber=subscriber, grammar=grammar,
                          speculation=speculation_for(self.speculative, self.cache.has_states, self.vocab_size))
        self._requests[request.request_id] = request
        self.planner.enqueue(request)
        self.counters.counts["prompt_tokens"] += len(prompt)
        self._work.notify()
        return request.request_id

    def _progressed(self, request: Request, seen: int) -> Callable[[], bool]:
        """A `_drive` condition: the request has more than `seen` tokens, or has ended."""
        return lambda: self._collectable(request.request_id) or len(request.token_ids) > seen
