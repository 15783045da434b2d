"""ForwardBatch: one model step's worth of sequences, flattened into tensors."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    """New tokens of B sequences, concatenated.

    `is_decode`: every sequence has exactly one new token and runs the decode attention path;
    otherwise the varlen prefill path. Sequence i owns tokens cu_seqlens[i]:cu_seqlens[i+1],
    lives in cache slot slot_ids[i] and has start_positions[i] tokens cached before this step.
    """

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, absolute position of each token
    token_slots: torch.Tensor  # [T] int64, slot of each token
    slot_ids: torch.Tensor  # [B] int64
    start_positions: torch.Tensor  # [B] int64
    cu_seqlens: torch.Tensor  # [B + 1] int64
    last_token_indices: torch.Tensor  # [B] int64, the token whose logits are returned
    is_decode: bool

    @classmethod
    def build(cls, slots: list[int], starts: list[int], new_tokens: list[list[int]], is_decode: bool,
              device: torch.device | str) -> ForwardBatch:
        lengths = [len(t) for t in new_tokens]
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        positions = [start + j for start, n in zip(starts, lengths) for j in range(n)]
        token_slots = [slot for slot, n in zip(slots, lengths) for _ in range(n)]

        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        return cls(
            input_ids=tensor([t for tokens in new_tokens for t in tokens]),
            positions=tensor(positions),
            token_slots=tensor(token_slots),
            slot_ids=tensor(slots),
            start_positions=tensor(starts),
            cu_seqlens=tensor(cu),
            last_token_indices=tensor([c - 1 for c in cu[1:]]),
            is_decode=is_decode,
        )
