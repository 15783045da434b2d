"""BatchScheduler: continuous batching over a fixed set of cache slots.

The Python counterpart of a C++ `QwenBatchScheduler`: submit/cancel/poll/stats/stop from any
thread, and one loop iteration, `step()`:

    admit_requests -> schedule decode rows + prefill pieces -> one forward -> handle_completions

With the background thread, it alone calls `step()` while there is work, and sleeps on a
condition variable otherwise: every forward runs on that one thread (see `_drive` for why that
matters on the CPU). Without it, the callers step the loop: `generate()`, `stream()` and a poll
that waits without a timeout do (deterministic tests step by hand). The forward passes run outside
the lock, so submit, cancel and a poll with a timeout never wait for the model.

A step runs one forward within a token budget (`PrefillPolicy.max_num_batched_tokens`): a decode
row for every running request that has sampled, then prefill pieces, first come first served, of
the requests still prefilling and of newly admitted ones while the budget lasts. A prompt is cut
only where the policy's request-local grid says, never where the budget runs out, so a long
prompt no longer stalls the running requests for its whole prefill and its bits do not move.
Admission reuses prefixes held by slots (`PrefixCache`). Every submitted request reaches exactly
one terminal state ("stop", "length", "cancelled" or "error"), and its slot is freed when it does.

A failure is its own request's: when a batched forward raises (an op's exception, out of memory,
non-finite output), each of its requests is rerun alone. Ops are batch invariant, so the requests
that succeed get bitwise the tokens of the batched (and serial) run; the ones that fail again end
with "error". Every counter and the timeline change under `_lock`.
"""

from __future__ import annotations

import bisect
import collections
import dataclasses
import itertools
import logging
import math
import numbers
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast, overload

from ..cache import SlotCache
from ..outputs import GenerationResult
from ..runner import ModelRunner, SequenceInput
from ..sampling import SamplingParams
from .policy import PrefillPolicy, check_budget
from .prefix_cache import Placement, PrefixCache
from .request import Request, RequestStatus, validate_prompt
from .stats import SchedulerStats
from .stream import TextDeltas, TokenDelta
from .timeline import SlotEvent

logger = logging.getLogger(__name__)

Callback = Callable[[GenerationResult], None]
TokenCallback = Callable[[TokenDelta], None]
LATENCY_WINDOW = 100_000  # requests whose TTFT and total time the latency statistics cover
# (token, logprob) sampled for a request whose forward succeeded (None: a piece inside its prompt),
# else the exception that ended it.
Outcome = tuple[int, float] | None | BaseException
# (request, what it fed, start, end) of each forward a request took part in, for the timeline.
Span = tuple[Request, SequenceInput, float, float]


class QueueFullError(RuntimeError):
    """submit_request found `max_waiting` requests waiting (and waited as long as it was told to)."""


class SwapSpaceError(RuntimeError):
    """A preemption would hold more than `max_swap_bytes` of swapped-out slots in host memory."""


class BatchScheduler:
    def __init__(self, runner: ModelRunner, cache: SlotCache, vocab_size: int, max_seq_len: int,
                 eos_token_ids: tuple[int, ...] = (), background_thread: bool = True, record_timeline: bool = False,
                 request_ids: Iterator[int] | None = None, policy: PrefillPolicy | None = None,
                 max_waiting: int = 0, max_swap_bytes: int = 0,
                 detokenize: Callable[[list[int]], str] | None = None) -> None:
        """`max_waiting`: submissions refused (or made to wait) beyond this many waiting requests;
        `max_swap_bytes`: host memory preempted requests may hold (0: no limit, for both).
        `detokenize`: token ids -> text; with it, results and token deltas carry text."""
        self.runner = runner
        self.cache = cache
        self.policy = policy if policy is not None else PrefillPolicy()
        check_budget(self.policy, cache.num_slots, max_seq_len)
        self.prefixes = PrefixCache(cache, self.policy)
        self.vocab_size = vocab_size
        self.max_seq_len = max_seq_len
        self.eos_token_ids = eos_token_ids
        self._ids = request_ids if request_ids is not None else itertools.count()
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)  # the loop waits here for requests
        self._done = threading.Condition(self._lock)  # pollers wait here for results
        self._room = threading.Condition(self._lock)  # submitters wait here for room in the queue
        self._step_lock = threading.Lock()  # one step at a time, whoever calls it
        self.max_waiting = max_waiting
        self.max_swap_bytes = max_swap_bytes
        self._waiting: list[Request] = []  # in scheduling order (Request.order)
        self._running: list[Request] = []
        self._requests: dict[int, Request] = {}  # submitted, result not yet collected
        self._callbacks: dict[int, Callback] = {}
        self._token_callbacks: dict[int, TokenCallback] = {}
        self.detokenize = detokenize
        self._texts: dict[int, TextDeltas] = {}  # per request with on_token, its detokenizer
        self._deltas: collections.deque[TokenDelta] = collections.deque()  # for on_token, in order
        self._delivering = threading.RLock()  # one thread hands out token deltas at a time, in order
        self._swap_held = 0  # bytes of swapped-out slots in host memory
        self._stepping = False
        self._stopped = False
        self._draining = False  # stop(drain=True) is letting the last requests finish
        self._counts: collections.Counter[str] = collections.Counter()
        # Latencies of the most recent requests only, so that a long-running engine's memory stays bounded.
        self._ttfts: collections.deque[float] = collections.deque(maxlen=LATENCY_WINDOW)
        self._totals: collections.deque[float] = collections.deque(maxlen=LATENCY_WINDOW)
        self._busy_time = 0.0
        self._started = time.perf_counter()
        # Per-forward slot events, when recording (read it once the work is done).
        self.timeline: list[SlotEvent] | None = [] if record_timeline else None
        self._thread: threading.Thread | None = None
        if background_thread:
            self._thread = threading.Thread(target=self._loop, name="pocketllm-scheduler", daemon=True)
            self._thread.start()

    # -- public API (any thread) ---------------------------------------------------------------

    def submit_request(self, prompt_tokens: Sequence[int], sampling: SamplingParams | None = None,
                       callback: Callback | None = None, priority: int = 0, on_token: TokenCallback | None = None,
                       wait_ms: float | None = 0) -> int:
        """Queue a request; returns its id. Bad input raises TypeError/ValueError and queues nothing.

        `priority`: lower runs first, first come first served among equals; a waiting request
        preempts a running one of a higher value when no slot is free. `callback(result)` runs once
        the request has ended, `on_token(delta)` after each token, both on the thread that ran the
        step, outside the scheduler's lock. With `max_waiting` requests waiting, a submission
        raises QueueFullError at once (`wait_ms=0`), after waiting up to `wait_ms` for room, or
        waits as long as it takes (None)."""
        sampling = sampling if sampling is not None else SamplingParams()
        prompt = validate_prompt(prompt_tokens, sampling, self.vocab_size, self.max_seq_len)
        for name, fn in (("callback", callback), ("on_token", on_token)):
            if fn is not None and not callable(fn):
                raise TypeError(f"{name} must be callable or None, got {type(fn).__name__}")
        if isinstance(priority, bool) or not isinstance(priority, int) or not -2**31 <= priority < 2**31:
            raise ValueError(f"priority must be an int in [-2**31, 2**31), got {priority!r}")
        deadline = _deadline(wait_ms)
        with self._lock:
            while True:
                if self._stopped or self._draining:
                    raise RuntimeError("scheduler is stopped; no new requests are accepted")
                if not self.max_waiting or len(self._waiting) < self.max_waiting:
                    break
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise QueueFullError(f"{len(self._waiting)} requests are waiting, the most max_waiting="
                                         f"{self.max_waiting} allows; retry later or pass wait_ms to wait for room")
                self._room.wait(None if remaining is None else min(remaining, threading.TIMEOUT_MAX))
            request = Request(next(self._ids), prompt, sampling, sampling.resolved_seed(), self.eos_token_ids,
                              priority=priority)
            self._requests[request.request_id] = request
            if callback is not None:
                self._callbacks[request.request_id] = callback
            if on_token is not None:
                self._token_callbacks[request.request_id] = on_token
                if self.detokenize is not None:
                    self._texts[request.request_id] = TextDeltas(self.detokenize)
            bisect.insort(self._waiting, request, key=lambda r: r.order)
            self._counts["prompt_tokens"] += len(prompt)
            self._work.notify()
        return request.request_id

    def preempt(self, request_id: int) -> bool:
        """Swap a running request out at the start of the next step: its slot's K/V and states go
        to host memory bit for bit and the slot is freed; it waits again (in its priority order)
        and is swapped back into a free slot later, then continues as if never interrupted. False
        if it is not running (or already ending); SwapSpaceError when `max_swap_bytes` would be
        exceeded."""
        with self._lock:
            request = self._requests.get(request_id)
            if (request is None or request.status is not RequestStatus.RUNNING or request.finished
                    or request.cancel_requested or request.preempt_requested):
                return False
            needed = self._swap_held + self.cache.swap_bytes(request.num_cached + 1)
            if self.max_swap_bytes and needed > self.max_swap_bytes:
                raise SwapSpaceError(f"swapping request {request_id} out would hold {needed} bytes of host memory, "
                                     f"over max_swap_bytes={self.max_swap_bytes}")
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
                self._waiting.remove(request)
                finished = [self._cancel_waiting(request)]
                self._done.notify_all()
                self._room.notify_all()
            else:
                finished = [] if self._stepping else self._handle_completions()
        self._fire_callbacks(finished)
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
        deadline = _deadline(timeout_ms)
        if deadline is None:  # without a thread, a caller that waits as long as it takes steps the loop
            self._drive(lambda: self._ended(request_id))  # returns at once for an unknown id: KeyError below
        with self._lock:
            while True:
                request = self._requests.get(request_id)
                if request is None:
                    raise KeyError(f"request id {request_id} is unknown or its result was already collected")
                if request.finished and request.slot is None:
                    del self._requests[request_id]
                    return self._result(request)
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                self._done.wait(None if remaining is None else min(remaining, threading.TIMEOUT_MAX))

    def get_stats(self) -> SchedulerStats:
        with self._lock:
            c = self._counts
            return SchedulerStats.build(
                list(self._ttfts), list(self._totals), waiting=len(self._waiting), running=len(self._running),
                finished=c["finished"], cancelled=c["cancelled"], errored=c["error"],
                prompt_tokens=c["prompt_tokens"], generated_tokens=c["generated_tokens"], steps=c["steps"],
                prefill_batches=c["prefill_batches"], decode_batches=c["decode_batches"],
                callback_errors=c["callback_errors"], busy_time_s=self._busy_time, cache_bytes=self.cache.nbytes,
                prefill_chunks=c["prefill_chunks"], mixed_steps=c["mixed_steps"], prefix_hits=c["prefix_hits"],
                prefix_copies=c["prefix_copies"], prefix_tokens_reused=c["prefix_tokens_reused"],
                state_snapshot_bytes=self.cache.prefix_state_nbytes, preemptions=c["preemptions"],
                swapped_out=sum(r.swapped is not None for r in self._waiting), swap_bytes_held=self._swap_held,
                swapped_bytes=c["swapped_bytes"],
                uncollected=sum(r.finished and r.slot is None for r in self._requests.values()))

    def stop(self, drain: bool = False) -> None:
        """Stop the loop, the thread joined. drain=False: every request not yet finished ends
        "cancelled"; drain=True: new submissions are refused at once, and the requests already
        submitted run to their end first (see `_drive`)."""
        if drain:
            with self._lock:
                self._draining = True
            self._drive(lambda: not (self._waiting or self._running))
        with self._lock:
            self._stopped = True
            self._work.notify_all()
            self._room.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        with self._step_lock, self._lock:
            for request in self._running:
                request.cancel_requested = True
            finished = self._handle_completions()
            finished += [self._cancel_waiting(r) for r in self._waiting]
            self._waiting.clear()
            self._done.notify_all()
        self._fire_callbacks(finished)

    def generate(self, requests: Sequence[tuple[Sequence[int], SamplingParams]],
                 priority: int = 0) -> list[GenerationResult]:
        """Submit (prompt, params) pairs and return their results once all are done (see `_drive`:
        the background thread steps the loop, or this thread does); other submitters' requests
        share the steps."""
        ids = [self.submit_request(prompt, params, priority=priority) for prompt, params in requests]
        self._drive(lambda: all(self._ended(i) for i in ids))
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
        sent = 0
        texts = None if self.detokenize is None else TextDeltas(self.detokenize)
        try:
            while True:
                with self._lock:
                    request = self._requests[request_id]
                    tokens, logprobs = request.token_ids[sent:], request.logprobs[sent:]
                    finished, ended = request.finished, self._ended(request_id)
                for i, (token, logprob) in enumerate(zip(tokens, logprobs)):
                    delta = TokenDelta(request_id, sent, token, logprob, last=finished and i == len(tokens) - 1)
                    yield delta if texts is None else _with_text(delta, texts)
                    sent += 1
                if ended:
                    yield self.poll_result(request_id, timeout_ms=None)
                    return
                self._drive(self._progressed(request, sent))
        finally:
            with self._lock:
                left = request_id in self._requests
            if left:  # left early: end it and collect what it did
                self.cancel_request(request_id)
                self.poll_result(request_id, timeout_ms=None)

    def _progressed(self, request: Request, seen: int) -> Callable[[], bool]:
        """A `_drive` condition: the request has more than `seen` tokens, or has ended."""
        return lambda: self._ended(request.request_id) or len(request.token_ids) > seen

    def _ended(self, request_id: int) -> bool:
        """The request has finished and left its slot (or is unknown). Lock held."""
        request = self._requests.get(request_id)
        return request is None or (request.finished and request.slot is None)

    def _drive(self, done: Callable[[], bool]) -> None:
        """Return once `done()` (called with the lock held) holds: with the background thread,
        wait for it; without, step the loop on the calling thread.

        Why one thread runs every forward: torch's CPU build runs on GNU OpenMP, whose worker
        threads spin between parallel regions only while no more OpenMP threads exist than CPUs.
        Every thread that runs torch ops keeps a team of its own, so a second such thread, even
        idle, makes the working team sleep on futexes between regions: measured 1.5x slower per
        token on 2 cores. So with a background thread the engine builds the model on a thread
        that then exits (`LLM`), and the background thread does all the math."""
        while True:
            with self._lock:
                if done():
                    return
                if self._stopped or self._thread is not None:  # stop() ends every request, or the thread steps
                    self._done.wait()
                    continue
            self.step()

    def configure(self, policy: PrefillPolicy) -> None:
        """Run on another prefill policy (budget, cuts, reuse) from now on; only while idle, with
        no request waiting or running (RuntimeError otherwise). What the slots hold stays
        reusable when the reuse grid and snapshot interval are unchanged, and is forgotten else."""
        with self._step_lock, self._lock:
            if self._waiting or self._running:
                raise RuntimeError("configure() needs an idle scheduler: requests are waiting or running")
            check_budget(policy, self.cache.num_slots, self.max_seq_len)
            old, self.policy = self.policy, policy
            if (policy.reuse_grid, policy.snapshot_interval) == (old.reuse_grid, old.snapshot_interval):
                self.prefixes.policy = policy
            else:
                self.prefixes = PrefixCache(self.cache, policy)
                for slot in range(self.cache.num_slots):
                    self.cache.forget(slot)

    @property
    def has_work(self) -> bool:
        with self._lock:
            return bool(self._waiting or self._running)

    # -- the loop ---------------------------------------------------------------------------

    def step(self) -> bool:
        """One loop iteration; returns whether it ran a forward pass. Callbacks fire after the
        step has released its lock, so a callback may submit, cancel, step or stop."""
        with self._step_lock:
            start = time.perf_counter()
            with self._lock:
                if self._stopped:  # stop() cancels what is left; a late step runs nothing
                    return False
                self._stepping = True
                self._counts["steps"] += 1
                work = self._schedule()
            try:
                self._run_batch(work)
            finally:
                with self._lock:
                    self._stepping = False
                    if work:
                        self._busy_time += time.perf_counter() - start
                    finished = self._handle_completions()
                    self._done.notify_all()  # streams wait for tokens as pollers wait for results
        self._fire_token_callbacks()
        self._fire_callbacks(finished)
        return bool(work)

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._stopped and not (self._waiting or self._running):
                    self._work.wait()
                if self._stopped:
                    return
            try:
                self.step()
            except BaseException:  # whatever a step raises (SystemExit included), the loop keeps serving
                logger.exception("scheduler step failed")

    def _schedule(self) -> list[tuple[Request, SequenceInput]]:
        """This step's work within the token budget: swap out what must make room, then a decode
        row for every running request that has sampled, then prefill pieces in scheduling order
        (running requests before waiting ones); the first piece that does not fit ends the step's
        prefill. Lock held."""
        self._preempt()
        live = sorted((r for r in self._running if not r.finished and not r.cancel_requested), key=lambda r: r.order)
        work = [(r, r.decode_input()) for r in live if r.token_ids]
        budget = self.policy.max_num_batched_tokens - len(work)
        for request in live:
            if request.prefilling:
                piece = request.prefill_input(self.policy)
                if len(piece.token_ids) > budget:
                    return work
                budget -= len(piece.token_ids)
                work.append((request, piece))
        while self._waiting and self.cache.num_free > 0:
            request = self._waiting[0]
            if request.swapped is not None:
                if request.swapped_step == self._counts["steps"]:  # swapped out this very step: not back yet
                    break
                prompt_len = len(request.prompt_tokens)
                cost = 1 if request.token_ids else self.policy.piece_len(request.num_prefilled, prompt_len)
                if cost > budget:
                    break
                self._swap_in(self._waiting.pop(0))
            else:
                placement = self.prefixes.place(request.prompt_tokens)
                if self.policy.piece_len(placement.reused, len(request.prompt_tokens)) > budget:
                    break
                self._admit(self._waiting.pop(0), placement)
            item = request.decode_input() if request.token_ids else request.prefill_input(self.policy)
            budget -= len(item.token_ids)
            work.append((request, item))
            self._room.notify_all()
        return work

    def _preempt(self) -> None:
        """Swap out the running requests preempt() asked for, then, while the first waiting request
        outranks a running one and no slot is free, the lowest-ranked running request (the latest
        among equal priorities), as far as max_swap_bytes allows. Lock held."""
        for request in [r for r in self._running if r.preempt_requested]:
            if not request.finished and not request.cancel_requested and self._swap_fits(request):
                self._swap_out(request)
            else:
                request.preempt_requested = False
        while self._waiting and self.cache.num_free == 0:
            live = [r for r in self._running if not r.finished and not r.cancel_requested]
            victim = max(live, key=lambda r: r.order, default=None)
            if victim is None or victim.priority <= self._waiting[0].priority or not self._swap_fits(victim):
                return
            self._swap_out(victim)

    def _swap_fits(self, request: Request) -> bool:
        needed = self._swap_held + self.cache.swap_bytes(request.num_cached)
        return not self.max_swap_bytes or needed <= self.max_swap_bytes

    def _swap_out(self, request: Request) -> None:
        """Copy a running request's slot to host memory, free the slot (its contents stay reusable)
        and queue the request again. Lock held."""
        slot = request.assigned_slot
        request.swapped = self.cache.swap_out(slot, request.num_cached)
        self.cache.free(slot, request.held_tokens())
        request.slot, request.status = None, RequestStatus.WAITING
        request.preempt_requested, request.swapped_step = False, self._counts["steps"]
        self._running.remove(request)
        bisect.insort(self._waiting, request, key=lambda r: r.order)
        self._swap_held += request.swapped.nbytes
        self._counts["preemptions"] += 1
        self._counts["swapped_bytes"] += request.swapped.nbytes

    def _swap_in(self, request: Request) -> None:
        """Bring a swapped-out request back into a free slot, bit for bit. Lock held."""
        assert request.swapped is not None
        request.slot = self.prefixes.take_for_swap_in()
        self.cache.swap_in(request.slot, request.swapped)
        self._release_swap(request)
        request.status = RequestStatus.RUNNING
        self._running.append(request)

    def _release_swap(self, request: Request) -> None:
        if request.swapped is not None:
            self._swap_held -= request.swapped.nbytes
            request.swapped = None

    def _admit(self, request: Request, placement: Placement) -> None:
        """Give a waiting request its slot, with the prefix it reuses in place. Lock held."""
        request.slot = self.prefixes.take(placement, request.prompt_tokens)
        request.num_prefilled = placement.reused
        request.status = RequestStatus.RUNNING
        self._running.append(request)
        if placement.reused:
            self._counts["prefix_hits"] += 1
            self._counts["prefix_tokens_reused"] += placement.reused
            self._counts["prefix_copies"] += placement.copied

    def _run_batch(self, work: list[tuple[Request, SequenceInput]]) -> None:
        """Run one forward over `work` and apply its outcomes under the lock. An exception that is
        not an Exception (KeyboardInterrupt, SystemExit) ends the batch with "error" and propagates."""
        if not work:
            return
        spans: list[Span] = []
        outcomes: Sequence[Outcome] = []
        try:
            outcomes = self._forward(work, spans)
        except BaseException as exc:
            outcomes = [exc] * len(work)
            raise
        finally:
            with self._lock:
                self._count_forward([seq for _, seq in work])
                if self.timeline is not None:
                    step = self._counts["steps"]
                    self.timeline.extend(
                        SlotEvent(step, "decode" if seq.decode else "prefill", r.assigned_slot, r.request_id,
                                  len(seq.token_ids), begin - self._started, end - self._started)
                        for r, seq, begin, end in spans)
                for (request, seq), outcome in zip(work, outcomes):
                    if isinstance(outcome, BaseException):
                        request.finish("error", f"{type(outcome).__name__}: {outcome}")
                        continue
                    request.advance(seq, outcome)
                    if outcome is not None and request.request_id in self._token_callbacks:
                        self._deltas.append(TokenDelta(request.request_id, len(request.token_ids) - 1, *outcome,
                                                       last=request.finished))
                    if not seq.decode:
                        self.prefixes.prefilled(request.assigned_slot, request.prompt_tokens, request.num_prefilled)

    def _count_forward(self, seqs: list[SequenceInput]) -> None:
        """Count one forward: its prefill pieces, and whether it decoded, prefilled or both. Lock held."""
        pieces = sum(not s.decode for s in seqs)
        decoded = pieces < len(seqs)
        self._counts["prefill_chunks"] += pieces
        self._counts["prefill_batches"] += pieces > 0
        self._counts["decode_batches"] += decoded
        self._counts["mixed_steps"] += decoded and pieces > 0

    def _forward(self, work: list[tuple[Request, SequenceInput]], spans: list[Span]) -> Sequence[Outcome]:
        """One forward for the batch; if it raises, one forward per request, so that only the
        requests that fail alone end with their exception."""
        try:
            return self._timed_run(work, spans)
        except Exception as exc:
            if len(work) == 1:
                logger.error("forward pass failed for request %d", work[0][0].request_id, exc_info=exc)
                return [exc]
            logger.warning("forward pass of %d requests failed (%s: %s); rerunning each alone",
                           len(work), type(exc).__name__, exc)
        outcomes: list[Outcome] = []
        for item in work:
            try:
                outcomes += self._timed_run([item], spans)
            except Exception as exc:
                logger.error("forward pass failed for request %d", item[0].request_id, exc_info=exc)
                outcomes.append(exc)
        return outcomes

    def _timed_run(self, work: list[tuple[Request, SequenceInput]], spans: list[Span]) -> list[Outcome]:
        start = time.perf_counter()
        outputs = self.runner.run([seq for _, seq in work])
        end = time.perf_counter()
        spans.extend((r, seq, start, end) for r, seq in work)
        return list(outputs)

    def _handle_completions(self) -> list[Request]:
        """Free the slots of finished or cancelled requests and publish their results. Lock held."""
        finished = []
        for request in list(self._running):
            if request.cancel_requested:
                request.finish("cancelled")
            if request.finished:
                self._running.remove(request)
                # A failed request's slot claims no contents: a failed forward may have written them.
                failed = request.finish_reason == "error"
                if failed:
                    self.prefixes.forget(request.assigned_slot)
                self.cache.free(request.assigned_slot, [] if failed else request.held_tokens())
                request.slot = None
                finished.append(request)
        for request in finished:
            self._record(request)
        if finished:
            self._done.notify_all()
        return finished

    def _cancel_waiting(self, request: Request) -> Request:
        """End a request that has no slot (never admitted, or swapped out). Lock held; the caller
        unqueues it."""
        self._release_swap(request)
        request.finish("cancelled")
        self._record(request)
        return request

    def _record(self, request: Request) -> None:
        """Count a request that has reached its terminal state. Lock held."""
        reason = request.finish_reason
        assert reason is not None  # a request is recorded once it has finished
        self._counts["finished" if reason in ("stop", "length") else reason] += 1
        self._counts["generated_tokens"] += len(request.token_ids)
        result = request.result()
        if result.ttft_s is not None:
            self._ttfts.append(result.ttft_s)
        assert result.total_time_s is not None  # a finished request has its finish time
        self._totals.append(result.total_time_s)

    def _result(self, request: Request) -> GenerationResult:
        """The request's result, with its text when the scheduler can detokenize."""
        result = request.result()
        if self.detokenize is not None:
            result.text = self.detokenize(result.token_ids)
        return result

    def _fire_token_callbacks(self) -> None:
        """Run the on_token callbacks of every token sampled so far, outside the lock, in the order
        the tokens were sampled, one thread at a time (so before the result callbacks of the step
        that follows); one that raises is logged and counted, as a result callback is."""
        with self._delivering:
            while True:
                with self._lock:
                    if not self._deltas:
                        return
                    delta = self._deltas.popleft()
                    callback = self._token_callbacks.get(delta.request_id)
                    texts = self._texts.get(delta.request_id)
                if callback is not None:
                    self._call_back(callback, delta if texts is None else _with_text(delta, texts), "on_token callback",
                                    delta.request_id)

    def _fire_callbacks(self, finished: list[Request]) -> None:
        """Run callbacks outside the lock; one that raises anything (SystemExit and KeyboardInterrupt
        included: a callback must not end the scheduler) is logged and counted, nothing more."""
        for request in finished:
            with self._lock:
                callback = self._callbacks.pop(request.request_id, None)
                self._token_callbacks.pop(request.request_id, None)
                self._texts.pop(request.request_id, None)
            if callback is not None:
                self._call_back(callback, self._result(request), "callback", request.request_id)

    def _call_back(self, callback: Callable[[Any], None], value: Any, what: str, request_id: int) -> None:
        """callback(value) outside the lock; whatever it raises (SystemExit and KeyboardInterrupt
        included: a callback must not end the scheduler) is logged and counted, nothing more."""
        try:
            callback(value)
        except BaseException:
            logger.exception("%s for request %d raised", what, request_id)
            with self._lock:
                self._counts["callback_errors"] += 1


def _with_text(delta: TokenDelta, texts: TextDeltas) -> TokenDelta:
    """The delta with the text its token adds (the last token also flushes what was held back)."""
    return dataclasses.replace(delta, text=texts.add(delta.token_id) + (texts.flush() if delta.last else ""))


def _deadline(timeout_ms: float | None) -> float | None:
    """The monotonic time at which a poll gives up; None to wait forever (None or math.inf)."""
    if timeout_ms is None:
        return None
    if isinstance(timeout_ms, bool) or not isinstance(timeout_ms, numbers.Real):
        raise TypeError(f"timeout_ms must be a number of milliseconds >= 0, None or math.inf, "
                        f"got {type(timeout_ms).__name__}")
    try:
        timeout_s = float(timeout_ms) / 1000.0
    except OverflowError:  # an int too large for a float: longer than anyone waits
        return None
    if math.isnan(timeout_s) or timeout_s < 0:
        raise ValueError(f"timeout_ms must be >= 0, None or math.inf (wait forever), got {timeout_ms!r}")
    return None if math.isinf(timeout_s) else time.monotonic() + timeout_s
