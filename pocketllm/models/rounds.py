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

import torch

from ..kernels import Ops
from .batch import ForwardBatch

Keep = Callable[[int, int], None]  # (slot, position): copy the slot's state as it is now


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
    for r in batch.rounds:
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
    for r in batch.rounds:
        rows = r.rows
        args = (q[rows], k[rows], v[rows], g[rows], beta[rows], state, r.slot_ids, r.start_positions, r.cu_seqlens)
        parts.append((rows, ops.gated_delta_prefill(*args) if replay is None else
                      ops.gated_delta_prefill(*args, replay)))
        for slot, position in r.kept:
            keep(slot, position)
    return _assemble(q.shape[0], parts)
