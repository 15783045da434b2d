"""A batch's recurrent ops (the causal conv and the gated delta rule) split where slots keep their
states inside a prefill piece (`ForwardBatch.keeps`), so a hybrid model keeps its Gated DeltaNet
states every 64 positions without cutting its prompts: the ops run the prefill pieces in rounds, one
sub-piece of each per round, and after a round whose sub-piece ends at a kept position the slot's
state is copied (`SlotCache.keep_state`). The scheduler asks for it only with exact positions, where
a cut anywhere gives the same bits, so the split changes no output; the rest of the layer (the
projections, attention, the MLP) runs each piece whole.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..kernels import Ops
from .batch import ForwardBatch

Keep = Callable[[int, int], None]  # (slot, position): copy the slot's state as it is now


@dataclass(frozen=True)
class Round:
    """One sub-piece of each prefill piece that still has one: its rows in the batch, the varlen
    description the prefill ops take, and the (slot, position) states complete after it."""

    rows: torch.Tensor
    slot_ids: torch.Tensor
    start_positions: torch.Tensor
    cu_seqlens: torch.Tensor
    kept: tuple[tuple[int, int], ...]


def rounds(batch: ForwardBatch) -> list[Round]:
    """The prefill pieces cut at their kept positions, as rounds of sub-pieces."""
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


def _assemble(total: int, parts: list[tuple[torch.Tensor | slice, torch.Tensor]]) -> torch.Tensor:
    """One tensor of `total` rows from (rows, values) parts."""
    out = parts[0][1].new_empty((total, *parts[0][1].shape[1:]))
    for rows, values in parts:
        out[rows] = values
    return out


def conv1d_keeping(ops: Ops, x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, batch: ForwardBatch,
                   keep: Keep) -> torch.Tensor:
    """`layers.conv1d`, the prefill pieces run in rounds, each slot's conv state kept on the way."""
    parts: list[tuple[torch.Tensor | slice, torch.Tensor]] = []
    if batch.decode is not None:
        parts.append((slice(0, batch.num_decode), ops.conv1d_decode(x[:batch.num_decode], weight, state,
                                                                     batch.decode.slot_ids)))
    for r in rounds(batch):
        parts.append((r.rows, ops.conv1d_prefill(x[r.rows], weight, state, r.slot_ids, r.cu_seqlens)))
        for slot, position in r.kept:
            keep(slot, position)
    return _assemble(x.shape[0], parts)


def gated_delta_keeping(ops: Ops, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                        beta: torch.Tensor, state: torch.Tensor, batch: ForwardBatch, replay: torch.Tensor | None,
                        keep: Keep) -> torch.Tensor:
    """`layers.gated_delta`, the prefill pieces run in rounds, each slot's recurrent state kept on
    the way (a round ends on the chunk grid, where the replay path's state holds no replayed rows)."""
    nd = batch.num_decode
    parts: list[tuple[torch.Tensor | slice, torch.Tensor]] = []
    if batch.decode is not None:
        head = slice(0, nd)
        if replay is None:
            decoded = ops.gated_delta_decode(q[head], k[head], v[head], g[head], beta[head], state,
                                             batch.decode.slot_ids)
        else:  # the replay path runs decode rows through the prefill op, one-token pieces
            decoded = ops.gated_delta_prefill(q[head], k[head], v[head], g[head], beta[head], state,
                                              batch.slot_ids[head], batch.start_positions[head],
                                              batch.cu_seqlens[:nd + 1], replay)
        parts.append((head, decoded))
    for r in rounds(batch):
        rows = r.rows
        args = (q[rows], k[rows], v[rows], g[rows], beta[rows], state, r.slot_ids, r.start_positions, r.cu_seqlens)
        parts.append((rows, ops.gated_delta_prefill(*args) if replay is None else
                      ops.gated_delta_prefill(*args, replay)))
        for slot, position in r.kept:
            keep(slot, position)
    return _assemble(q.shape[0], parts)
