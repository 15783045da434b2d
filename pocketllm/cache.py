"""SlotCache: a fixed set of slots, each owning one request's cached state.

A slotted cache is a block table with one block per request: a request owns one slot from
admission to completion and kernels need no per-token index loads.
- Full-attention layers: K and V [num_slots, max_seq_len, num_kv_heads, head_dim]; a token's K/V
  live at [slot, position].
- Gated DeltaNet layers: a conv state [num_slots, conv_dim, conv_width - 1] (the last inputs of the
  causal conv) and an fp32 recurrent state [num_slots, heads, key_dim, value_dim]. Both are zeroed
  when a request takes the slot, so a slot's previous tenant never leaks into the next.
A freed slot remembers the token ids whose K/V it still holds, so a later request with a shared
prefix can find them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionCacheSpec:
    num_kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class RecurrentCacheSpec:
    conv_dim: int
    conv_width: int
    num_heads: int
    key_dim: int
    value_dim: int


LayerCacheSpec = AttentionCacheSpec | RecurrentCacheSpec


class SlotCacheError(RuntimeError):
    """The one error the slot cache raises: no free slot, or a slot that is not allocated."""


class SlotCache:
    """Per-layer slot tensors (None where a layer has no such state) plus slot bookkeeping."""

    def __init__(self, num_slots: int, max_seq_len: int, layers: list[LayerCacheSpec], dtype: torch.dtype,
                 device: torch.device | str = "cpu") -> None:
        self.num_slots = num_slots
        self.max_seq_len = max_seq_len
        self.k: list[torch.Tensor | None] = []
        self.v: list[torch.Tensor | None] = []
        self.conv: list[torch.Tensor | None] = []
        self.recurrent: list[torch.Tensor | None] = []
        for spec in layers:
            attention = isinstance(spec, AttentionCacheSpec)
            kv_shape = (num_slots, max_seq_len, spec.num_kv_heads, spec.head_dim) if attention else None
            self.k.append(torch.zeros(kv_shape, dtype=dtype, device=device) if attention else None)
            self.v.append(torch.zeros(kv_shape, dtype=dtype, device=device) if attention else None)
            self.conv.append(None if attention else torch.zeros(
                num_slots, spec.conv_dim, spec.conv_width - 1, dtype=dtype, device=device))
            self.recurrent.append(None if attention else torch.zeros(
                num_slots, spec.num_heads, spec.key_dim, spec.value_dim, dtype=torch.float32, device=device))
        self.slot_tokens: list[list[int]] = [[] for _ in range(num_slots)]
        self._free = list(range(num_slots))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        """Take the lowest free slot, its recurrent state zeroed; SlotCacheError when all are in use."""
        if not self._free:
            raise SlotCacheError(f"all {self.num_slots} cache slots are in use")
        self._free.sort()
        slot = self._free.pop(0)
        self.slot_tokens[slot] = []
        for state in self.conv + self.recurrent:
            if state is not None:
                state[slot].zero_()
        return slot

    def free(self, slot: int, tokens: list[int]) -> None:
        """Return a slot; `tokens` are the ids whose K/V it now holds (positions 0..len-1)."""
        if not 0 <= slot < self.num_slots or slot in self._free:
            raise SlotCacheError(f"slot {slot} is not allocated (slots 0..{self.num_slots - 1})")
        self.slot_tokens[slot] = list(tokens)
        self._free.append(slot)
