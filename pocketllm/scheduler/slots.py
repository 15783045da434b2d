"""SlotManager: the one owner of what the slots hold, between the slot cache (tensors) and the
requests. The serial path and the scheduler both go through it, so a request's slot lifecycle
(allocation, prefix reuse, state snapshots, swap, the rule that a failed slot keeps no contents)
is written once.

The manager owns the slot bookkeeping; the cache holds tensors only. Free slots are handed out
least recently used first (a freed slot goes to the end of the free list), so what a freed slot
holds lasts as long as it can for prefix reuse, and a freed slot records the token ids whose K/V
it still holds (`held_tokens`).

Prefix reuse: a new request takes the slot whose contents share the longest reusable prefix
with its prompt (free slots first at equal length, then the least recently used); when the best
donor is busy, the prefix is copied into a free slot instead. With exact positions
(`reuse_decoded`) every cut is exact and the positions decode steps wrote hold a prefill's bits, so
they are reused too, and a prefix of any length is found (the index finds slots by 16-token
blocks, the match is extended to the token). A model without recurrent states reuses it
whole; a hybrid one up to the furthest position where the slot's states were kept: its snapshot
grid, and where the slot's last tenant ended (a chat's next turn reuses the whole last turn).
Without exact positions
the reused length is rounded down to the policy's reuse grid and only prefilled positions are reused,
so the rest of the prompt runs the pieces, and gets the bits, of a cold run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..cache import SlotCache, SlotCacheError, StateSnapshot
from ..runner import SequenceInput
from .policy import PrefillPolicy
from .prefix_index import INDEX_BLOCK, PrefixIndex
from .request import Request


@dataclass(frozen=True)
class Placement:
    """Where a request goes: `slot` (free) with its first `reused` tokens taken from `donor`
    (the slot itself when it was retained, another slot when copied; None: nothing reused)."""

    slot: int
    reused: int
    donor: int | None

    @property
    def copied(self) -> bool:
        return self.donor is not None and self.donor != self.slot


class SlotManager:
    """Which slots are free, what each holds, and every step of a request's slot lifecycle."""

    def __init__(self, cache: SlotCache, policy: PrefillPolicy, reuse_decoded: bool = False) -> None:
        self.cache = cache
        self.policy = policy
        # Whether decoded positions are reusable, and a prefix to any length: with exact positions
        # every cut is exact and a decoded position holds a prefill's bits (a hybrid model's prefix
        # up to a position where its states were kept: `SlotCache.resume_point`).
        self.reuse_decoded = reuse_decoded
        self._free = list(range(cache.num_slots))  # least recently used first
        self._held: list[list[int]] = [[] for _ in range(cache.num_slots)]  # per freed slot: its tokens
        self.index = PrefixIndex(cache.num_slots, self._index_grid(policy))
        # Slots whose contents were swapped in: they hold no state copies, so they are not donors
        # until another request takes them.
        self._unindexed: set[int] = set()
        self.swap_held = 0  # bytes of swapped-out slots in host memory
        self.swap_reserved = 0  # bytes preempt() set aside for swaps the next step makes

    @property
    def keeps_fine_states(self) -> bool:
        """Whether prefill pieces keep the slot's states at the policy's fine positions on the way: a
        hybrid model, with exact positions (a cut anywhere is exact) and prefix reuse."""
        return self.reuse_decoded and self.cache.has_states and self.policy.prefix_reuse

    def _keeps_at(self, length: int) -> bool:
        """Whether a slot's states are kept where it holds `length` positions."""
        return self.policy.keeps_states_at(length, self.keeps_fine_states)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def free_slots(self) -> list[int]:
        """Free slots, least recently used first."""
        return list(self._free)

    def held_tokens(self, slot: int) -> list[int]:
        """The token ids whose K/V free slot `slot` holds (positions 0..len-1); empty while taken."""
        return list(self._held[slot])

    def configure(self, policy: PrefillPolicy) -> None:
        """Run on `policy` from now on; what the slots hold stays reusable only when the reuse grid
        and the snapshot interval are unchanged."""
        old, self.policy = self.policy, policy
        if self.reuse_decoded:
            return  # every position of every slot stays reusable, whatever the cuts
        if (policy.reuse_grid, policy.snapshot_interval) != (old.reuse_grid, old.snapshot_interval):
            self.index = PrefixIndex(self.cache.num_slots, self._index_grid(policy))
            self._unindexed.clear()
            for slot in range(self.cache.num_slots):
                self.cache.forget(slot)

    def _index_grid(self, policy: PrefillPolicy) -> int:
        """The index's blocks: INDEX_BLOCK tokens with reuse at any position (a found slot's match is
        then extended to the token), else the policy's reuse grid (0: nothing is reused)."""
        return INDEX_BLOCK if self.reuse_decoded else policy.reuse_grid or 1

    # -- taking and releasing slots ----------------------------------------------------------

    def allocate(self, slot: int | None = None, keep: int = 0) -> int:
        """Take a free slot: `slot`, or the least recently used one, reset for its new tenant with
        its first `keep` positions kept (`SlotCache.reset`). SlotCacheError when no slot is free or
        `slot` is not free."""
        if not self._free:
            raise SlotCacheError(f"all {self.cache.num_slots} cache slots are in use")
        if slot is None:
            slot = self._free[0]
        elif slot not in self._free:
            raise SlotCacheError(f"slot {slot} is not free (free: {sorted(self._free)})")
        self.cache.reset(slot, keep)
        self._free.remove(slot)
        self._held[slot] = []
        return slot

    def free(self, slot: int, tokens: list[int]) -> None:
        """Return a slot; `tokens` are the ids whose K/V it now holds (positions 0..len-1)."""
        if not 0 <= slot < self.cache.num_slots or slot in self._free:
            raise SlotCacheError(f"slot {slot} is not allocated (slots 0..{self.cache.num_slots - 1})")
        self._held[slot] = list(tokens)
        self._free.append(slot)

    def place(self, prompt: Sequence[int], reuse: bool = True) -> Placement:
        """The best free slot for `prompt`, and the prefix it can reuse (none without `reuse`). A
        free slot must exist."""
        free = self.free_slots  # least recently used first
        limit = self.policy.reusable(len(prompt), len(prompt), self.reuse_decoded) if reuse else 0
        matches = self.index.match(prompt, limit) if limit else {}
        if self.reuse_decoded:  # whole blocks found; each match extended to the token, then to a kept state
            matches = {slot: self.cache.resume_point(slot, self.index.common_prefix(slot, prompt, limit))
                       for slot in matches}
            matches = {slot: length for slot, length in matches.items() if length}
        # Longest prefix; at equal length a free slot (no copy), then the least recently used.
        rank = {slot: i for i, slot in enumerate(free)}
        best = max(matches, key=lambda s: (matches[s], s in rank, -rank.get(s, 0)), default=None)
        reused = 0 if best is None else matches[best] if self.reuse_decoded else \
            self.index.verified(best, prompt, matches[best])
        if not reused:
            return Placement(free[0], 0, None)
        return Placement(best if best in rank else free[0], reused, best)

    def admit(self, request: Request, placement: Placement) -> None:
        """Give `request` the placement's slot with its reused prefix in place (copied if need be).
        If that raises, the slot is free again and claims no contents."""
        slot, reused = placement.slot, placement.reused
        self.allocate(slot, keep=0 if placement.copied else reused)
        try:
            if placement.copied:
                assert placement.donor is not None
                self.cache.copy_prefix(placement.donor, slot, reused)
            self.index.truncate(slot, 0)
            self.index.extend(slot, request.prefill_tokens, reused)
        except BaseException:
            self._discard(slot)
            raise
        self._unindexed.discard(slot)
        request.slot, request.num_prefilled = slot, reused

    def admit_cold(self, request: Request) -> None:
        """Give `request` the least recently used free slot, reusing nothing."""
        slot = self.allocate()
        self.index.truncate(slot, 0)
        self._unindexed.discard(slot)
        request.slot, request.num_prefilled = slot, 0

    def prefilled(self, request: Request, keeps: Sequence[int] = ()) -> None:
        """The request's slot now holds its prefill tokens up to `num_prefilled`: keep the states its
        piece kept on the way (`keeps`) and its states there when that is a kept position, and index it."""
        slot, length = request.assigned_slot, request.num_prefilled
        if slot in self._unindexed:
            return
        self.cache.commit_kept(slot, keeps)
        if self._keeps_at(length):
            self.cache.save_prefix_state(slot, length)
        self.index.extend(slot, request.prefill_tokens, length)

    def decoded(self, request: Request) -> None:
        """A decode step wrote the request's position num_cached - 1: with `reuse_decoded`, keep its
        states where that is a kept position, so a later turn can resume there."""
        slot, length = request.assigned_slot, request.num_cached
        if self.reuse_decoded and self._keeps_at(length) and slot not in self._unindexed:
            self.cache.save_prefix_state(slot, length)

    def verified(self, request: Request, seq: SequenceInput) -> None:
        """A verify piece wrote positions seq.start.. of which the request kept num_cached: a model
        with recurrent states takes them back to the copy kept there (its K/V past it are never read,
        and are written again by whatever comes next), then as after a decode step."""
        if self.cache.has_states and request.num_cached < seq.start + len(seq.token_ids):
            self.cache.restore_kept(request.assigned_slot, request.num_cached)
        self.decoded(request)

    def release(self, request: Request) -> None:
        """Free the slot of a request that ended or is preempted by recompute. A failed request's
        slot claims no contents: a failed forward may have written them."""
        slot = request.assigned_slot
        if request.finish_reason == "error":
            self._discard(slot)
        else:
            self._index_decoded(request)
            self.free(slot, request.held_tokens())
        request.slot = None

    def _index_decoded(self, request: Request) -> None:
        """With `reuse_decoded`, index what decode steps wrote after the prompt (the next turn of a
        conversation reuses the previous answer too), and keep the states where the request ends."""
        if self.reuse_decoded and request.assigned_slot not in self._unindexed and not request.prefilling:
            self.index.extend(request.assigned_slot, request.held_tokens(), request.num_cached)
            self.cache.save_prefix_state(request.assigned_slot, request.num_cached, end=True)

    def _discard(self, slot: int) -> None:
        """Free a slot whose contents may be wrong: nothing in it is reused."""
        self.index.truncate(slot, 0)
        self.cache.forget(slot)
        self.free(slot, [])

    # -- a forward's recurrent states ------------------------------------------------------

    def guard(self, seqs: Sequence[SequenceInput]) -> StateSnapshot | None:
        """What `restore` needs to undo a forward over `seqs` (recurrent states only: a rerun
        rewrites the same K/V positions)."""
        return self.cache.snapshot_states([s.slot for s in seqs], [s.start for s in seqs])

    def restore(self, saved: StateSnapshot | None) -> None:
        self.cache.restore_states(saved)

    # -- swap -----------------------------------------------------------------------------

    def swap_bytes(self, request: Request) -> int:
        """Host memory held and set aside once `request` is swapped out too, at its size after the
        step in progress (`Request.cached_after_step`)."""
        return self.swap_held + self.swap_reserved + self.cache.swap_bytes(request.cached_after_step)

    def reserve(self, request: Request) -> None:
        """Set aside the bytes of `request`'s swap at the start of the next step (preempt())."""
        request.swap_reserved = self.cache.swap_bytes(request.cached_after_step)
        self.swap_reserved += request.swap_reserved

    def unreserve(self, request: Request) -> None:
        self.swap_reserved -= request.swap_reserved
        request.swap_reserved = 0

    def swap_out(self, request: Request) -> None:
        """Copy a running request's slot to host memory, bit for bit, and free the slot (its
        contents stay reusable)."""
        slot = request.assigned_slot
        request.swapped = self.cache.swap_out(slot, request.num_cached)
        self._index_decoded(request)
        self.free(slot, request.held_tokens())
        request.slot = None
        self.swap_held += request.swapped.nbytes

    def swap_in(self, request: Request) -> None:
        """Bring a swapped-out request back into the least recently used free slot, bit for bit.
        If that raises, the slot is free again and claims no contents."""
        assert request.swapped is not None
        slot = self.allocate()
        try:
            self.index.truncate(slot, 0)
            self.cache.swap_in(slot, request.swapped)
        except BaseException:
            self._discard(slot)
            raise
        self._unindexed.add(slot)
        request.slot = slot
        self.drop_swap(request)

    def drop_swap(self, request: Request) -> None:
        """Let go of a request's host copy (swapped back in, or ended while swapped out)."""
        if request.swapped is not None:
            self.swap_held -= request.swapped.nbytes
            self.cache.drop_swap(request.swapped)
            request.swapped = None
