"""The scheduler's loop and who runs it: one iteration (`step`), the background thread, and which
thread steps when a caller waits (`_drive`); the facade (batch_scheduler.py) builds on it."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from ..machine import release_openmp_team
from ..runner import ModelRunner
from .delivery import Delivery
from .draft_model import Drafting
from .execute import Outcome, Work, execute
from .planner import Planner
from .request import Request
from .slots import SlotManager
from .stats import Counters
from .timeline import Span
from .waits import wait_until

logger = logging.getLogger("pocketllm.scheduler.batch_scheduler")


class SchedulerLoop:
    """The state the loop shares with the facade is set up by BatchScheduler.__init__."""

    runner: ModelRunner
    drafter: Drafting | None
    slots: SlotManager
    planner: Planner
    delivery: Delivery
    counters: Counters
    _lock: threading.Lock
    _work: threading.Condition
    _changed: threading.Condition
    _step_lock: threading.Lock
    _requests: dict[int, Request]
    _detached: set[int]
    _thread: threading.Thread | None
    _stepping: bool
    _stopped: bool

    def step(self) -> bool:
        """One loop iteration; returns whether it ran a forward pass. Callbacks fire after the
        step has released its lock, so a callback may submit, cancel, step or stop."""
        with self._step_lock:
            start = time.perf_counter()
            with self._lock:
                if self._stopped:  # stop() cancels what is left; a late step runs nothing
                    return False
                self._stepping = True
                self.counters.counts["steps"] += 1
                try:
                    work = self.planner.plan()
                except BaseException:
                    self._stepping = False
                    raise
                self._changed.notify_all()  # admissions made room in the queue
            try:
                self._run(work)
            finally:
                with self._lock:
                    self._stepping = False
                    if work:
                        self.counters.busy_time += time.perf_counter() - start
                    self._ended(self.planner.complete())
                    self._changed.notify_all()  # streams wait for tokens as pollers wait for results
        self.delivery.deliver()
        return bool(work)

    def _run(self, work: Work) -> None:
        """The forward over `work`, outside the lock, then its outcomes applied under it. An
        exception that is not an Exception (KeyboardInterrupt, SystemExit) ends the batch with
        "error" and propagates."""
        if not work:
            return
        spans: list[Span] = []
        outcomes: Sequence[Outcome] = []
        try:
            if self.drafter is not None:  # a draft model's forwards, outside the lock as the target's
                work = self.drafter.fill(work)
                with self._lock:
                    for request, seq in work:
                        request.in_flight = seq
            outcomes = execute(self.runner, self.slots, work, spans)
        except BaseException as exc:
            outcomes = [exc] * len(work)
            raise
        finally:
            with self._lock:
                self.counters.forward([seq for _, seq in work], spans)
                for request in self.planner.apply(work, outcomes):
                    self.delivery.sampled(request)

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._stopped and not self._busy():
                    self._work.wait()
                if self._stopped:
                    return
            try:
                self.step()
            except BaseException:  # whatever a step raises (SystemExit included), the loop keeps serving
                logger.exception("scheduler step failed")

    def _drive(self, done: Callable[[], bool], until: float | None = None) -> bool:
        """Return True once `done()` (called with the lock held) holds, False once `until` has
        passed. The background thread steps the loop and others wait for it; a wait without end
        (`until` None) on a thread that nobody else would step for steps the loop itself: any
        caller without a background thread, and the scheduler thread when a callback on it waits
        (stop(drain=True), generate(), a poll without a timeout), which would otherwise wait for
        itself. Once stopped, that thread ends what is left (stop() may be joining it). A bounded
        wait only waits, for another caller's step.

        Why one thread runs every forward: torch's CPU build runs on GNU OpenMP, whose worker
        threads spin between parallel regions only while no more OpenMP threads exist than CPUs.
        Every thread that runs torch ops keeps a team of its own, so a second such thread, even
        idle, makes the working team sleep on futexes between regions, measurably slower per
        token. So with a background thread the engine builds the model on a thread that then
        exits (`LLM`), and the background thread does all the math; a thread that waits for it lets
        its own idle team go (`release_openmp_team`)."""
        if not self._must_step():
            release_openmp_team()
        while True:
            with self._lock:
                if done():
                    return True
                if until is not None or not self._must_step():
                    if not wait_until(self._changed, until):
                        return False
                    continue
                stopped = self._stopped
            if stopped:
                self._end_rest()
            else:
                self.step()

    def _must_step(self) -> bool:
        """Whether this thread steps the loop when it waits for it (see `_drive`)."""
        return self._thread is None or self._thread is threading.current_thread()

    def _end_rest(self) -> None:
        """Cancel every request not yet ended (after stop()) and hand out their results."""
        with self._step_lock, self._lock:
            self._ended(self.planner.end_all())
            self._changed.notify_all()
        self.delivery.deliver()

    def _ended(self, ended: list[Request]) -> None:
        """Count the requests that ended, queue their results, drop those nobody collects."""
        for request in ended:
            self.counters.ended(request)
            if request.request_id in self._detached:
                self._detached.discard(request.request_id)
                del self._requests[request.request_id]
        self.delivery.ended(ended)
        if ended:
            self._changed.notify_all()

    def _busy(self) -> bool:
        return bool(self.planner.waiting or self.planner.running)

    def _collectable(self, request_id: int) -> bool:
        """The request has finished and left its slot (or is unknown)."""
        request = self._requests.get(request_id)
        return request is None or (request.finished and request.slot is None)

