"""SlotCache: a fixed set of slots, each a contiguous KV region of max_seq_len positions.

A slotted cache is a block table with one block per request: a request owns one slot from
admission to completion, its K/V live at [slot, position], and kernels need no per-token index
loads. A freed slot remembers the token ids whose K/V it still holds, so a later request with a
shared prefix can find them.
"""

from __future__ import annotations

import torch


class SlotCache:
    """K/V tensors [num_slots, max_seq_len, num_kv_heads, head_dim] per layer, plus slot bookkeeping."""

    def __init__(self, num_slots: int, max_seq_len: int, num_layers: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        shape = (num_slots, max_seq_len, num_kv_heads, head_dim)
        self.num_slots = num_slots
        self.max_seq_len = max_seq_len
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.slot_tokens: list[list[int]] = [[] for _ in range(num_slots)]
        self._free = list(range(num_slots))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        """Take the lowest free slot; raises RuntimeError when every slot is in use."""
        if not self._free:
            raise RuntimeError(f"all {self.num_slots} cache slots are in use")
        self._free.sort()
        slot = self._free.pop(0)
        self.slot_tokens[slot] = []
        return slot

    def free(self, slot: int, tokens: list[int]) -> None:
        """Return a slot; `tokens` are the ids whose K/V it now holds (positions 0..len-1)."""
        if not 0 <= slot < self.num_slots or slot in self._free:
            raise ValueError(f"slot {slot} is not allocated (slots 0..{self.num_slots - 1})")
        self.slot_tokens[slot] = list(tokens)
        self._free.append(slot)
