"""BatchScheduler: continuous batching over a fixed set of cache slots.

The Python counterpart of a C++ `QwenBatchScheduler`: submit/cancel/poll/stats/stop from any
thread, and one loop iteration, `step()`:

    admit_requests -> schedule decode rows + prefill pieces -> one forward -> handle_completions

A background thread calls `step()` while there is work and nobody else does, and sleeps on a
condition variable otherwise: `generate()` and a poll that waits without a timeout step the loop on
their own thread, which is faster on the CPU (see `_drive`). Without the thread, the caller drives
`step()` (deterministic tests). The forward passes run outside the lock, so submit, cancel and a
poll with a timeout never wait for the model.

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

import collections
import itertools
import logging
import math
import numbers
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import cast, overload

from ..cache import SlotCache
from ..outputs import GenerationResult
from ..runner import ModelRunner, SequenceInput
from ..sampling import SamplingParams
from .policy import PrefillPolicy, check_budget
from .prefix_cache import Placement, PrefixCache
from .request import Request, RequestStatus, validate_prompt
from .stats import SchedulerStats
from .timeline import SlotEvent

logger = logging.getLogger(__name__)

Callback = Callable[[GenerationResult], None]
LATENCY_WINDOW = 100_000  # requests whose TTFT and total time the latency statistics cover
# (token, logprob) sampled for a request whose forward succeeded (None: a piece inside its prompt),
# else the exception that ended it.
Outcome = tuple[int, float] | None | BaseException
# (request, what it fed, start, end) of each forward a request took part in, for the timeline.
Span = tuple[Request, SequenceInput, float, float]


class BatchScheduler:
    def __init__(self, runner: ModelRunner, cache: SlotCache, vocab_size: int, max_seq_len: int,
                 eos_token_ids: tuple[int, ...] = (), background_thread: bool = True, record_timeline: bool = False,
                 request_ids: Iterator[int] | None = None, policy: PrefillPolicy | None = None) -> None:
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
        self._step_lock = threading.Lock()  # one step at a time, whoever calls it
        self._waiting: collections.deque[Request] = collections.deque()
        self._running: list[Request] = []
        self._requests: dict[int, Request] = {}  # submitted, result not yet collected
        self._callbacks: dict[int, Callback] = {}
        self._stepping = False
        self._stopped = False
        self._drivers = 0  # callers stepping the loop themselves (see run_until_finished)
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
                       callback: Callback | None = None) -> int:
        """Queue a request; returns its id. Bad input raises TypeError/ValueError and queues nothing."""
        sampling = sampling if sampling is not None else SamplingParams()
        prompt = validate_prompt(prompt_tokens, sampling, self.vocab_size, self.max_seq_len)
        if callback is not None and not callable(callback):
            raise TypeError(f"callback must be callable or None, got {type(callback).__name__}")
        with self._lock:
            if self._stopped:
                raise RuntimeError("scheduler is stopped; no new requests are accepted")
            request = Request(next(self._ids), prompt, sampling, sampling.resolved_seed(), self.eos_token_ids)
            self._requests[request.request_id] = request
            if callback is not None:
                self._callbacks[request.request_id] = callback
            self._waiting.append(request)
            self._counts["prompt_tokens"] += len(prompt)
            self._work.notify()
        return request.request_id

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
        if deadline is None:  # a caller that waits as long as it takes does the work itself
            self._drive([request_id])  # returns at once for an unknown id: the KeyError comes below
        with self._lock:
            while True:
                request = self._requests.get(request_id)
                if request is None:
                    raise KeyError(f"request id {request_id} is unknown or its result was already collected")
                if request.finished and request.slot is None:
                    del self._requests[request_id]
                    return request.result()
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
                state_snapshot_bytes=self.cache.prefix_state_nbytes)

    def stop(self) -> None:
        """Stop the loop: every request not yet finished ends as "cancelled", the thread is joined."""
        with self._lock:
            self._stopped = True
            self._work.notify_all()
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

    def generate(self, requests: Sequence[tuple[Sequence[int], SamplingParams]]) -> list[GenerationResult]:
        """Submit (prompt, params) pairs and step the loop on the calling thread until they are
        done (see `_drive`); other submitters' requests share the steps."""
        ids = [self.submit_request(prompt, params) for prompt, params in requests]
        self._drive(ids)
        # Every one has finished, so none of these polls comes back empty.
        return cast("list[GenerationResult]", [self.poll_result(i) for i in ids])

    def _drive(self, ids: list[int]) -> None:
        """Step the loop on the calling thread until every request in `ids` has finished (or was
        collected by another poller); the background thread sleeps meanwhile.

        Why a caller that would only wait does the work: torch's CPU build runs on GNU OpenMP, whose
        worker threads spin between parallel regions only while no more OpenMP threads exist than
        CPUs. The caller's thread already has a team (it loaded the model), so a second thread
        running torch ops makes both teams wait on futexes between regions: measured 1.5x slower
        per token on 2 cores than the same steps on the caller's thread."""
        with self._lock:
            self._drivers += 1
        try:
            while True:
                with self._lock:
                    if all((r := self._requests.get(i)) is None or (r.finished and r.slot is None) for i in ids):
                        return
                    if self._stopped:  # stop() ends every request; wait for it rather than step
                        self._done.wait()
                        continue
                self.step()
        finally:
            with self._lock:
                self._drivers -= 1
                self._work.notify()

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
        self._fire_callbacks(finished)
        return bool(work)

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._stopped and (self._drivers or not (self._waiting or self._running)):
                    self._work.wait()
                if self._stopped:
                    return
            try:
                self.step()
            except BaseException:  # whatever a step raises (SystemExit included), the loop keeps serving
                logger.exception("scheduler step failed")

    def _schedule(self) -> list[tuple[Request, SequenceInput]]:
        """This step's work within the token budget: a decode row for every running request that
        has sampled, then prefill pieces first come first served (running requests before waiting
        ones); the first piece that does not fit ends the step's prefill. Lock held."""
        live = [r for r in self._running if not r.finished and not r.cancel_requested]
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
            placement = self.prefixes.place(request.prompt_tokens)
            if self.policy.piece_end(placement.reused, len(request.prompt_tokens)) - placement.reused > budget:
                break
            self._admit(self._waiting.popleft(), placement)
            piece = request.prefill_input(self.policy)
            budget -= len(piece.token_ids)
            work.append((request, piece))
        return work

    def _admit(self, request: Request, placement: Placement) -> None:
        """Give a waiting request its slot, with the prefix it reuses in place. Lock held."""
        request.slot = self.prefixes.take(placement, request.prompt_tokens)
        request.num_prefilled = request.reused = placement.reused
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
        """End a request that never got a slot. Lock held; the caller unqueues it."""
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

    def _fire_callbacks(self, finished: list[Request]) -> None:
        """Run callbacks outside the lock; one that raises anything (SystemExit and KeyboardInterrupt
        included: a callback must not end the scheduler) is logged and counted, nothing more."""
        for request in finished:
            with self._lock:
                callback = self._callbacks.pop(request.request_id, None)
            if callback is None:
                continue
            try:
                callback(request.result())
            except BaseException:
                logger.exception("callback for request %d raised", request.request_id)
                with self._lock:
                    self._counts["callback_errors"] += 1


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
