"""PrefixCache: exact prefix reuse over the slot cache.

A new request takes the slot whose contents share the longest reusable prefix with its prompt
(free slots first at equal length, then the least recently used); when the best donor is busy,
the prefix is copied into a free slot instead. The reused length is rounded down to the policy's
reuse grid, and only prefilled positions are ever reused (see `PrefixIndex`), so the rest of the
prompt runs the pieces, and gets the bits, of a cold run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..cache import SlotCache
from .policy import PrefillPolicy
from .prefix_index import PrefixIndex


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


class PrefixCache:
    def __init__(self, cache: SlotCache, policy: PrefillPolicy) -> None:
        self.cache = cache
        self.policy = policy
        self.index = PrefixIndex(cache.num_slots, policy.reuse_grid or 1)  # grid 0: nothing is reused
        # Slots whose contents were swapped in: they hold no state copies, so they are not donors
        # until another request takes them.
        self._unindexed: set[int] = set()

    def place(self, prompt: Sequence[int]) -> Placement:
        """The best free slot for `prompt`, and the prefix it can reuse. A free slot must exist."""
        free = self.cache.free_slots  # least recently used first
        limit = self.policy.reusable(len(prompt), len(prompt))
        matches = self.index.match(prompt, limit) if limit else {}
        # Longest prefix; at equal length a free slot (no copy), then the least recently used.
        rank = {slot: i for i, slot in enumerate(free)}
        best = max(matches, key=lambda s: (matches[s], s in rank, -rank.get(s, 0)), default=None)
        reused = 0 if best is None else self.index.verified(best, prompt, matches[best])
        if not reused:
            return Placement(free[0], 0, None)
        return Placement(best if best in rank else free[0], reused, best)

    def take(self, placement: Placement, prompt: Sequence[int]) -> int:
        """Allocate the placement's slot with its reused prefix in place (copied if need be)."""
        slot, reused = placement.slot, placement.reused
        if placement.copied:
            assert placement.donor is not None
            self.cache.allocate(slot)
            self.cache.copy_prefix(placement.donor, slot, reused)
        else:
            self.cache.allocate(slot, keep=reused)
        self.index.truncate(slot, 0)
        self.index.extend(slot, prompt, reused)
        self._unindexed.discard(slot)
        return slot

    def take_for_swap_in(self) -> int:
        """The least recently used free slot, for a swapped-out request's contents."""
        slot = self.cache.allocate()
        self.index.truncate(slot, 0)
        self._unindexed.add(slot)
        return slot

    def prefilled(self, slot: int, prompt: Sequence[int], length: int) -> None:
        """The slot now holds prompt[:length], prefilled: keep its states there when `length` is on
        the snapshot grid, and index it."""
        if slot in self._unindexed:
            return
        interval = self.policy.snapshot_interval
        if interval and length % interval == 0:
            self.cache.save_prefix_state(slot, length)
        self.index.extend(slot, prompt, length)

    def forget(self, slot: int) -> None:
        """The slot's contents are not to be trusted (a failed forward): nothing of it is reused."""
        self.index.truncate(slot, 0)
        self.cache.forget(slot)
