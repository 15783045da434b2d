"""ForwardBatch: one model step's worth of sequences, flattened into tensors.

A step may mix decode rows and prefill pieces (chunked prefill): decode sequences come first, so
each kind owns one contiguous range of token rows, and the paired ops (attention, conv1d, the
gated delta rule) and the linear layers run each kind's rows through that kind's op.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DecodeRows:
    """The leading decode sequences: one new token each, at row i for sequence i."""

    slot_ids: torch.Tensor  # [D] int64
    seq_lens: torch.Tensor  # [D] int64, tokens in the slot once the new one is written


@dataclass(frozen=True)
class PrefillRows:
    """The prefill pieces after the decode rows; cu_seqlens counts from their first row."""

    slot_ids: torch.Tensor  # [P] int64
    start_positions: torch.Tensor  # [P] int64
    cu_seqlens: torch.Tensor  # [P + 1] int64


@dataclass
class ForwardBatch:
    """New tokens of B sequences, concatenated: the first `num_decode` are decode sequences (one
    token each), the rest prefill pieces (the varlen path). Sequence i owns tokens
    cu_seqlens[i]:cu_seqlens[i+1], lives in cache slot slot_ids[i] and has start_positions[i]
    tokens cached before this step. Logits are returned for the rows in `logit_rows`, sequence by
    sequence: the first `scored` rows of a sequence that scores its tokens (prompt logprobs), then
    its last row if it samples (a prefill piece that ends inside its prompt does not).
    """

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, absolute position of each token
    token_slots: torch.Tensor  # [T] int64, slot of each token
    slot_ids: torch.Tensor  # [B] int64
    start_positions: torch.Tensor  # [B] int64
    cu_seqlens: torch.Tensor  # [B + 1] int64
    logit_rows: torch.Tensor  # [L] int64, the rows whose logits the model returns, in sequence order
    num_decode: int
    decode: DecodeRows | None  # None when the batch has no decode sequence
    prefill: PrefillRows | None  # None when the batch has no prefill piece
    keeps: tuple[tuple[int, ...], ...] = ()  # per sequence: positions inside it where recurrent states are kept

    @functools.cached_property
    def rounds(self) -> list[Round]:
        """The prefill pieces cut at their `keeps`, as rounds of sub-pieces: worked out once, for
        every layer's recurrent ops."""
        return _rounds(self)

    @property
    def is_decode(self) -> bool:
        """Every sequence decodes (so every linear row is a decode row)."""
        return self.prefill is None

    @classmethod
    def build(cls, slots: list[int], starts: list[int], new_tokens: list[list[int]], is_decode: bool | list[bool],
              device: torch.device | str, sampled: list[bool] | None = None,
              scored: list[int] | None = None, keeps: list[tuple[int, ...]] | None = None) -> ForwardBatch:
        """`is_decode`: one flag for the whole batch or one per sequence (decode sequences first,
        one token each). `sampled`: which sequences need their last row's logits (default: all);
        `scored`: how many of its first rows each sequence scores (default: none); `keeps`: per
        sequence, the positions inside it where its recurrent states are kept (models/rounds.py)."""
        kinds = [is_decode] * len(slots) if isinstance(is_decode, bool) else list(is_decode)
        num_decode = sum(kinds)
        if kinds != [True] * num_decode + [False] * (len(kinds) - num_decode):
            raise ValueError("decode sequences must come before prefill pieces in a ForwardBatch")
        if any(len(new_tokens[i]) != 1 for i in range(num_decode)):
            raise ValueError("a decode sequence feeds exactly one token")
        sampled = [True] * len(slots) if sampled is None else sampled
        lengths = [len(t) for t in new_tokens]
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)

        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        slot_ids, start_positions, cu_seqlens = tensor(slots), tensor(starts), tensor(cu)
        decode = prefill = None
        if num_decode:
            decode = DecodeRows(slot_ids[:num_decode], start_positions[:num_decode] + 1)
        if num_decode < len(slots) or not slots and not is_decode:
            prefill = PrefillRows(slot_ids[num_decode:], start_positions[num_decode:],
                                  cu_seqlens[num_decode:] - num_decode if num_decode else cu_seqlens)
        return cls(
            input_ids=tensor([t for tokens in new_tokens for t in tokens]),
            positions=tensor([start + j for start, n in zip(starts, lengths) for j in range(n)]),
            token_slots=tensor([slot for slot, n in zip(slots, lengths) for _ in range(n)]),
            slot_ids=slot_ids,
            start_positions=start_positions,
            cu_seqlens=cu_seqlens,
            logit_rows=tensor(logit_rows(cu, sampled, scored or [0] * len(slots))),
            num_decode=num_decode,
            decode=decode,
            prefill=prefill,
            keeps=tuple(tuple(k) for k in keeps) if keeps and any(keeps) else (),
        )


@dataclass(frozen=True)
class Round:
    """One sub-piece of each prefill piece that still has one: its rows in the batch, the varlen
    description the prefill ops take, and the (slot, position) states complete after it."""

    rows: torch.Tensor
    slot_ids: torch.Tensor
    start_positions: torch.Tensor
    cu_seqlens: torch.Tensor
    kept: tuple[tuple[int, int], ...]


def _rounds(batch: ForwardBatch) -> list[Round]:
    """The prefill pieces cut at their kept positions, as rounds of sub-pieces (models/rounds.py)."""
    assert batch.prefill is not None
    device = batch.slot_ids.device
    slots, starts = batch.prefill.slot_ids.tolist(), batch.prefill.start_positions.tolist()
    cu = batch.prefill.cu_seqlens.tolist()
    bounds = [[start, *keeps, start + cu[i + 1] - cu[i]]
              for i, (start, keeps) in enumerate(zip(starts, batch.keeps[batch.num_decode:]))]
    out = []
    for r in range(max(len(b) for b in bounds) - 1):
        members = [i for i, b in enumerate(bounds) if r + 1 < len(b)]
        rows: list[int] = []
        lengths: list[int] = []
        for i in members:
            first = batch.num_decode + cu[i] + bounds[i][r] - starts[i]
            rows += range(first, first + bounds[i][r + 1] - bounds[i][r])
            lengths.append(bounds[i][r + 1] - bounds[i][r])
        offsets = torch.tensor([0, *lengths], dtype=torch.int64, device=device).cumsum(0)
        index = lambda values: torch.tensor(values, dtype=torch.int64, device=device)  # noqa: E731
        out.append(Round(index(rows), index([slots[i] for i in members]), index([bounds[i][r] for i in members]),
                         offsets, tuple((slots[i], bounds[i][r + 1]) for i in members if r + 2 < len(bounds[i]))))
    return out


def logit_rows(cu_seqlens: list[int], sampled: list[bool], scored: list[int]) -> list[int]:
    """Per sequence, its first `scored` rows, then its last row when it samples and that row is
    not among them."""
    rows: list[int] = []
    for start, end, samples, count in zip(cu_seqlens, cu_seqlens[1:], sampled, scored):
        rows += range(start, start + count)
        if samples and count < end - start:
            rows.append(end - 1)
    return rows
