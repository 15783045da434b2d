"""Planner: which requests run in the next step, and with what.

It holds the queues and decides, within the token budget (`PrefillPolicy.max_num_batched_tokens`):
a decode row for every running request that has sampled, then prefill pieces in scheduling order,
first of the requests still prefilling, then of waiting ones as free slots admit them (a new
request at its best prefix placement, a preempted one swapped back in). A prompt is cut only where
the policy's request-local grid says, never where the budget runs out, so a long prompt does not
stall the running requests for its whole prefill and its bits do not move. Before that, it swaps
out what must make room (preempt() asked for it, or a waiting request outranks a running one and
no slot is free). It has no lock and no thread: the facade calls it under its own lock.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from .execute import Outcome, Work
from .policy import PrefillPolicy
from .request import Request, RequestStatus
from .slots import SlotManager
from .stats import Counters


class Planner:
    def __init__(self, slots: SlotManager, policy: PrefillPolicy, counters: Counters, max_swap_bytes: int) -> None:
        self.slots = slots
        self.policy = policy
        self.counters = counters
        self.max_swap_bytes = max_swap_bytes  # 0: no limit
        self.waiting: list[Request] = []  # in scheduling order (Request.order)
        self.running: list[Request] = []

    def enqueue(self, request: Request) -> None:
        bisect.insort(self.waiting, request, key=lambda r: r.order)

    def swap_fits(self, request: Request, extra: int = 0) -> bool:
        """Whether swapping `request` out (with `extra` more tokens cached) stays within max_swap_bytes."""
        return not self.max_swap_bytes or self.slots.swap_bytes(request, extra) <= self.max_swap_bytes

    def plan(self) -> Work:
        """This step's work: swap out what must make room, then a decode row for every running
        request that has sampled, then prefill pieces in scheduling order (running requests before
        waiting ones); the first piece that does not fit ends the step's prefill."""
        self._preempt()
        live = sorted((r for r in self.running if not r.finished and not r.cancel_requested), key=lambda r: r.order)
        work = [(r, r.decode_input()) for r in live if r.token_ids]
        budget = self.policy.max_num_batched_tokens - len(work)
        for request in live:
            if request.prefilling:
                piece = request.prefill_input(self.policy)
                if len(piece.token_ids) > budget:
                    return work
                budget -= len(piece.token_ids)
                work.append((request, piece))
        while self.waiting and self.slots.num_free > 0:
            admitted = self._admit_first(budget)
            if admitted is None:
                break
            item = admitted.next_input(self.policy)
            budget -= len(item.token_ids)
            work.append((admitted, item))
        return work

    def _admit_first(self, budget: int) -> Request | None:
        """Move the first waiting request into a free slot if its next input fits in `budget`."""
        request = self.waiting[0]
        if request.swapped is not None:
            if request.swapped_step == self.counters.steps:  # swapped out this very step: not back yet
                return None
            cost = 1 if request.token_ids else self.policy.piece_len(request.num_prefilled, len(request.prompt_tokens))
            if cost > budget:
                return None
            self.slots.swap_in(request)
        else:
            placement = self.slots.place(request.prompt_tokens)
            if self.policy.piece_len(placement.reused, len(request.prompt_tokens)) > budget:
                return None
            self.slots.admit(request, placement)
            if placement.reused:
                counts = self.counters.counts
                counts["prefix_hits"] += 1
                counts["prefix_tokens_reused"] += placement.reused
                counts["prefix_copies"] += placement.copied
        self.waiting.pop(0)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        return request

    def _preempt(self) -> None:
        """Swap out the running requests preempt() asked for, then, while the first waiting request
        outranks a running one and no slot is free, the lowest-ranked running request (the latest
        among equal priorities), as far as max_swap_bytes allows."""
        for request in [r for r in self.running if r.preempt_requested]:
            if not request.finished and not request.cancel_requested and self.swap_fits(request):
                self._swap_out(request)
            else:
                request.preempt_requested = False
        while self.waiting and self.slots.num_free == 0:
            live = [r for r in self.running if not r.finished and not r.cancel_requested]
            victim = max(live, key=lambda r: r.order, default=None)
            if victim is None or victim.priority <= self.waiting[0].priority or not self.swap_fits(victim):
                return
            self._swap_out(victim)

    def _swap_out(self, request: Request) -> None:
        self.slots.swap_out(request)
        assert request.swapped is not None
        request.status = RequestStatus.WAITING
        request.preempt_requested, request.swapped_step = False, self.counters.steps
        self.running.remove(request)
        self.enqueue(request)
        self.counters.counts["preemptions"] += 1
        self.counters.counts["swapped_bytes"] += request.swapped.nbytes

    def apply(self, work: Work, outcomes: Sequence[Outcome]) -> list[Request]:
        """Record each request's outcome of the forward; returns the requests that sampled."""
        sampled = []
        for (request, seq), outcome in zip(work, outcomes):
            if isinstance(outcome, BaseException):
                request.finish("error", f"{type(outcome).__name__}: {outcome}")
                continue
            request.advance(seq, outcome)
            if outcome is not None:
                sampled.append(request)
            if not seq.decode:
                self.slots.prefilled(request)
        return sampled

    def complete(self) -> list[Request]:
        """End the cancelled running requests, free the slots of every ended one; returns those."""
        ended = []
        for request in list(self.running):
            if request.cancel_requested:
                request.finish("cancelled")
            if request.finished:
                self.running.remove(request)
                self.slots.release(request)
                ended.append(request)
        return ended

    def end_all(self) -> list[Request]:
        """Cancel every request, running or waiting, and free their slots; returns them."""
        for request in self.running:
            request.cancel_requested = True
        ended = self.complete()
        for request in list(self.waiting):
            self.cancel_waiting(request)
            ended.append(request)
        return ended

    def cancel_waiting(self, request: Request) -> None:
        """End a request that has no slot (never admitted, or swapped out), and unqueue it."""
        self.waiting.remove(request)
        self.slots.drop_swap(request)
        request.finish("cancelled")
