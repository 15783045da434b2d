"""Planner: which requests run in the next step, and with what.

It holds the queues and decides, within the token budget (`PrefillPolicy.max_num_batched_tokens`):
a decode row for every running request that has sampled, then prefill pieces in scheduling order,
first of the requests still prefilling, then of waiting ones as free slots admit them (a new
request at its best prefix placement, a preempted one swapped back in). A prompt is cut only where
the policy's request-local grid says, never where the budget runs out, so a long prompt does not
stall the running requests for its whole prefill and its bits do not move; with exact positions
(`cut_at_budget`), where a position's bits do not depend on the cut, a piece that does not fit is
cut where the budget runs out instead of waiting for the next step; a new request's first piece
only when no other prompt prefills in the step (else it waits for a step where it fits whole, so a
burst of prompts sharing a system prompt finds it prefilled and reuses it). Before that, it preempts
what must make room (preempt() asked for it, or a waiting request outranks a running one and
no slot is free): by swap, its slot copied to host memory and back, or by recompute, its slot
freed and its prompt and generated tokens prefilled again once readmitted (exact only with exact
positions, where a re-prefilled position has the bits its decode step gave). It has no lock and no
thread: the facade calls it under its own lock.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from ..options import PreemptionMode
from ..runner import SequenceInput
from .execute import Outcome, Work
from .policy import PrefillPolicy
from .request import Request, RequestStatus
from .slots import SlotManager
from .stats import Counters


class Planner:
    def __init__(self, slots: SlotManager, policy: PrefillPolicy, counters: Counters, max_swap_bytes: int,
                 cut_at_budget: bool = False, preemption_mode: PreemptionMode = "swap") -> None:
        self.slots = slots
        self.cut_at_budget = cut_at_budget
        self.policy = policy
        self.counters = counters
        self.max_swap_bytes = max_swap_bytes  # 0: no limit; swap only
        self.recompute = preemption_mode == "recompute"
        self.waiting: list[Request] = []  # in scheduling order (Request.order)
        self.running: list[Request] = []
        self._ended: list[Request] = []  # ended without a slot since the last complete()

    def enqueue(self, request: Request) -> None:
        bisect.insort(self.waiting, request, key=lambda r: r.order)

    def swap_fits(self, request: Request) -> bool:
        """Whether preempting `request` once the step in progress is over (see
        `Request.cached_after_step`) stays within max_swap_bytes, beside what is held or reserved;
        always by recompute, which holds no host memory."""
        return self.recompute or not self.max_swap_bytes or self.slots.swap_bytes(request) <= self.max_swap_bytes

    def reserve(self, request: Request) -> bool:
        """Set aside what preempting `request` at the next step takes (preempt()): its swap's bytes,
        False if they do not fit; nothing by recompute."""
        if not self.swap_fits(request):
            return False
        if not self.recompute:
            self.slots.reserve(request)
        return True

    def plan(self) -> Work:
        """This step's work: swap out what must make room, then a decode row for every running
        request that has sampled, then prefill pieces in scheduling order (running requests before
        waiting ones); the first piece that does not fit ends the step's prefill. Drafts (speculative
        decoding) turn decode rows into verify pieces with the budget the running requests' pieces
        leave, before waiting requests are admitted, so drafting never starves a prompt in progress."""
        self._preempt()
        live = sorted((r for r in self.running if not r.finished and not r.cancel_requested), key=lambda r: r.order)
        decoding = [r for r in live if r.decoding]
        budget = self.policy.max_num_batched_tokens - len(decoding)
        pieces: Work = []
        stalled = False
        for request in (r for r in live if r.prefilling):
            piece = self._piece(request, budget)
            if piece is None:
                stalled = True
                break
            budget -= len(piece.token_ids)
            pieces.append((request, piece))
        work: Work = []
        for request in decoding:
            item = request.decode_input(most_drafts=budget)
            budget -= len(item.token_ids) - 1
            work.append((request, item))
        work += pieces
        while not stalled and self.waiting and self.slots.num_free > 0:
            request = self.waiting[0]
            prefilling = any(not item.decode and not item.drafts for _, item in work)
            try:
                if not self._admit(request, budget, may_cut=not prefilling):
                    break
            except Exception as exc:  # it ends "error" (a slot it took is freed); the rest still run
                self._fail_admission(request, exc)
                continue
            admitted = request.decode_input(budget - 1) if not request.prefilling else self._piece(request, budget)
            assert admitted is not None  # _admit checked that it fits
            budget -= len(admitted.token_ids)
            work.append((request, admitted))
        for request, item in work:
            request.in_flight = item
        return work

    def _piece(self, request: Request, budget: int) -> SequenceInput | None:
        """The request's next prefill piece within `budget` tokens: its policy piece, cut at the
        budget with `cut_at_budget`; None when it does not fit."""
        keep = self.slots.keeps_fine_states
        piece = request.prefill_input(self.policy, keep=keep)
        if len(piece.token_ids) <= budget:
            return piece
        return request.prefill_input(self.policy, budget, keep) if self.cut_at_budget and budget > 0 else None

    def _fits(self, piece_len: int, budget: int, may_cut: bool = True) -> bool:
        return piece_len <= budget or (self.cut_at_budget and may_cut and budget > 0)

    def _admit(self, request: Request, budget: int, may_cut: bool) -> bool:
        """Move the first waiting request into a free slot if its next input fits in `budget` (a
        new prompt's first piece cut at the budget only when `may_cut`)."""
        if request.preempted_step == self.counters.steps:  # preempted this very step: not back yet
            return False
        if request.swapped is not None:
            cost = 1 if request.token_ids else self.policy.piece_len(request.num_prefilled, len(request.prompt_tokens))
            if not self._fits(cost, budget):
                return False
            self.slots.swap_in(request)
        else:
            tokens = request.prefill_tokens  # a request preempted by recompute reuses what it can of them too
            placement = self.slots.place(tokens, reuse=not request.scores_prompt)
            if not self._fits(self.policy.piece_len(placement.reused, len(tokens)), budget, may_cut):
                return False
            self.slots.admit(request, placement)
            if placement.reused:
                counts = self.counters.counts
                counts["prefix_hits"] += 1
                counts["prefix_tokens_reused"] += placement.reused
                counts["prefix_copies"] += placement.copied
        self.waiting.pop(0)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        return True

    def _fail_admission(self, request: Request, exc: Exception) -> None:
        """A request whose admission raised leaves the queue ended "error", never lost in between."""
        self.waiting.remove(request)
        self.slots.drop_swap(request)
        request.finish("error", f"admission failed: {type(exc).__name__}: {exc}")
        self._ended.append(request)

    def _preempt(self) -> None:
        """Preempt the running requests preempt() asked for, then, while the first waiting request
        outranks a running one and no slot is free, the lowest-ranked running request (the latest
        among equal priorities), as far as max_swap_bytes allows."""
        for request in [r for r in self.running if r.preempt_requested]:
            self.slots.unreserve(request)  # preempt() held its bytes: the swap fits
            if not request.finished and not request.cancel_requested:
                self._evict(request)
            else:
                request.preempt_requested = False
        while self.waiting and self.slots.num_free == 0:
            live = [r for r in self.running if not r.finished and not r.cancel_requested]
            victim = max(live, key=lambda r: r.order, default=None)
            if victim is None or victim.priority <= self.waiting[0].priority or not self.swap_fits(victim):
                return
            self._evict(victim)

    def _evict(self, request: Request) -> None:
        """Take a running request's slot away (by swap or by recompute) and queue it again, in its
        scheduling order."""
        if self.recompute:
            self._drop(request)
        else:
            self._swap_out(request)
        request.status = RequestStatus.WAITING
        request.preempt_requested, request.preempted_step = False, self.counters.steps
        self.running.remove(request)
        self.enqueue(request)
        self.counters.counts["preemptions"] += 1

    def _swap_out(self, request: Request) -> None:
        self.slots.swap_out(request)
        assert request.swapped is not None
        self.counters.counts["swapped_bytes"] += request.swapped.nbytes

    def _drop(self, request: Request) -> None:
        """Free the slot (what it holds stays a prefix donor, for this request's re-prefill too) and
        make the request prefill everything again."""
        counts = self.counters.counts
        counts["recomputes"] += 1
        counts["recomputed_tokens"] += request.num_cached
        self.slots.release(request)
        request.restart()

    def apply(self, work: Work, outcomes: Sequence[Outcome]) -> list[Request]:
        """Record each request's outcome of the forward; returns the requests that sampled."""
        sampled = []
        for (request, seq), outcome in zip(work, outcomes):
            request.in_flight = None
            if isinstance(outcome, BaseException):
                request.finish("error", f"{type(outcome).__name__}: {outcome}")
                continue
            request.advance(seq, outcome)
            if outcome.sampled is not None:
                sampled.append(request)
            if seq.drafts:
                self.counters.verified(len(seq.drafts), len(outcome.accepted))
                self.slots.verified(request, seq)
            elif seq.decode:
                self.slots.decoded(request)
            else:
                self.slots.prefilled(request, seq.keeps)
        return sampled

    def complete(self) -> list[Request]:
        """End the cancelled running requests, free the slots of every ended one; returns those,
        with the requests whose admission failed since the last call."""
        ended, self._ended = self._ended, []
        for request in list(self.running):
            if request.cancel_requested:
                request.finish("cancelled")
            if request.finished:
                self.running.remove(request)
                self.slots.unreserve(request)
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
