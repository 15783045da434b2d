"""PrefixIndex: which slots hold which prompt prefixes, so a lookup costs O(prompt length).

A slot's prefilled tokens are registered in blocks of `grid` tokens; block i is keyed by a hash
chained over blocks 0..i, so one key names a whole prefix. A lookup walks the prompt's chain once
and collects, per slot, how many leading blocks it shares; `common_prefix` then compares a found
slot's tokens with the prompt's, past its whole blocks too (reuse at any position, where exact
positions allow it). The slot manager registers prefilled
positions, and decoded ones only with exact positions: otherwise K/V written by decode steps went
through other arithmetic (and recurrent states are kept only at prefill cuts), so reusing them would
not reproduce a cold run's bits. Hash collisions cannot cause
a wrong reuse: the chosen slot's tokens are compared before it is used.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

# The blocks of a model that reuses prefixes at any position: a lookup finds the slots that share
# whole blocks, then compares tokens past them.
INDEX_BLOCK = 16


def _chain(tokens: Sequence[int], grid: int, blocks: range, key: int) -> Iterator[int]:
    """Keys of `blocks` of `tokens`, continuing from `key` (the key of the block before)."""
    for b in blocks:
        key = hash((key, tuple(tokens[b * grid:(b + 1) * grid])))
        yield key


class PrefixIndex:
    def __init__(self, num_slots: int, grid: int) -> None:
        self.grid = grid
        self._slots: dict[int, set[int]] = {}  # block key -> slots holding that prefix
        self._keys: list[list[int]] = [[] for _ in range(num_slots)]  # per slot, its chain of block keys
        self._tokens: list[list[int]] = [[] for _ in range(num_slots)]  # every token registered, per slot

    def extend(self, slot: int, tokens: Sequence[int], length: int) -> None:
        """Register tokens[:length], which `slot` now holds (its whole blocks as keys)."""
        keys = self._keys[slot]
        blocks = range(len(keys), length // self.grid)
        for key in _chain(tokens, self.grid, blocks, keys[-1] if keys else 0):
            keys.append(key)
            self._slots.setdefault(key, set()).add(slot)
        if length > len(self._tokens[slot]):
            self._tokens[slot] = list(tokens[:length])

    def truncate(self, slot: int, length: int) -> None:
        """Forget what `slot` holds from position `length` on (about to be overwritten)."""
        keys = self._keys[slot]
        keep = length // self.grid
        for key in keys[keep:]:
            holders = self._slots[key]
            holders.discard(slot)
            if not holders:
                del self._slots[key]
        del keys[keep:]
        del self._tokens[slot][length:]

    def match(self, prompt: Sequence[int], limit: int) -> dict[int, int]:
        """slot -> length of the prefix of `prompt` it holds by its keys, in whole blocks, up to
        `limit` tokens. Confirm the one chosen with `verified`."""
        found: dict[int, int] = {}
        for b, key in enumerate(_chain(prompt, self.grid, range(limit // self.grid), 0)):
            holders = self._slots.get(key)
            if not holders:
                break
            for slot in holders:
                found[slot] = (b + 1) * self.grid
        return found

    def common_prefix(self, slot: int, prompt: Sequence[int], limit: int) -> int:
        """How many leading tokens of `prompt`, up to `limit`, `slot` holds, token for token."""
        held = self._tokens[slot]
        end = min(len(held), len(prompt), limit)
        return next((i for i in range(end) if held[i] != prompt[i]), end)

    def verified(self, slot: int, prompt: Sequence[int], length: int) -> int:
        """`length` if `slot` holds prompt[:length] token for token, else the whole blocks it does
        hold (a hash collision only shortens a match)."""
        same = self.common_prefix(slot, prompt, length)
        return length if same == length else same // self.grid * self.grid
