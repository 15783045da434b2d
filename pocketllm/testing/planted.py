"""Defects planted by construction, for negative controls: a property test that cannot fail proves
nothing, so run it once on one of these and see it fail.

A negative control must fail its check on every machine, so its defect cannot be something a BLAS
or a torch kernel happens to do on one CPU (a kernel switch at some row count, a blocking that
moves with the shape). Most defects here are an explicit rescale by 1 + 2^-20 applied where the
defect's condition holds: that moves every nonzero normal fp32 value by 8 to 16 units in the last
place whatever the hardware computed before it, so bits differ by arithmetic, while staying far
inside the reference tolerance (1e-4), so only the invariance checks can see it. A real kernel
would get there by choosing a tile, a split or an algorithm by the row count or the piece. Two are
plain bugs that the reference check sees: attention one key short, and a sampler drawing its noise at
the wrong position. One is a scheduling policy: cuts that follow the step's token budget.
"""

from __future__ import annotations

import torch

from ..kernels.decode_attention import decode_attention_fused, decode_attention_ref, decode_attention_triton
from ..kernels.gated_delta_prefill import gated_delta_prefill_recurrent
from ..kernels.linear import linear_per_row
from ..kernels.moe import experts_by_group
from ..kernels.prefill_attention import prefill_attention_ref
from ..kernels.sample import sample_ref
from ..scheduler import PrefillPolicy

NUDGE = 1.0 + 2.0**-20  # exact in fp32; x * NUDGE != x for every nonzero normal fp32 x
ROW_TILE = 4  # the row count from which the planted linear "switches kernels"


def linear_row_count_dependent(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Each row alone below ROW_TILE rows, then another path that rounds differently: a row's
    bits depend on how many rows share the call."""
    out = linear_per_row(x, weight, bias)
    return out * NUDGE if x.shape[0] >= ROW_TILE else out


def decode_attention_one_key_short(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                   slot_ids: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Decode attention that leaves out each sequence's last key (its own token; a bound off by one):
    batch invariant, and wrong (except where a sequence has one key, which it then keeps)."""
    return decode_attention_ref(q, k_cache, v_cache, slot_ids, (seq_lens - 1).clamp(min=1), scale)


def sample_position_off_by_one(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor,
                               top_p: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference sampler drawing each row's noise at the next position: batch invariant and
    replayable, but not the draw the contract names, (seed, position)."""
    return sample_ref(logits, temperature, top_k, top_p, seeds, positions + 1)


class BudgetCuts(PrefillPolicy):
    """A scheduling policy that cuts a prompt after a share of the step's token budget: boundaries
    that move with the budget, off the 64-token grid. Without exact positions the contract forbids
    it (a piece's bits may depend on where it starts); with them any cut is exact."""

    def piece_end(self, done: int, prompt_len: int) -> int:
        return min(prompt_len, done + self.max_piece(prompt_len))

    def max_piece(self, max_seq_len: int) -> int:
        return self.max_num_batched_tokens // 3


def prefill_attention_first_row_nudged(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                       slot_ids: torch.Tensor, start_positions: torch.Tensor,
                                       cu_seqlens: torch.Tensor, scale: float) -> torch.Tensor:
    """The reference, with the first query row of every piece taking another path: a position's
    bits depend on whether a piece starts there, so a prompt cut anywhere changes them. Batch
    invariant (each piece alone), within tolerance of the reference."""
    out = prefill_attention_ref(q, k_cache, v_cache, slot_ids, start_positions, cu_seqlens, scale)
    first_rows = cu_seqlens[:-1][cu_seqlens[:-1] < cu_seqlens[1:]].long()
    out[first_rows] = out[first_rows] * NUDGE
    return out


def decode_attention_nudged(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_ids: torch.Tensor,
                            seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """The torch backend's decode attention with every decoded row taking another path (as decoding
    through a split-KV merge instead of the prefill's arithmetic would): a position's bits depend on
    whether it was decoded or prefilled. Batch invariant (each row alone), within tolerance."""
    return decode_attention_fused(q, k_cache, v_cache, slot_ids, seq_lens, scale) * NUDGE


def decode_attention_triton_nudged(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                   slot_ids: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """`decode_attention_nudged` on the triton backend: its exact decode (the prefill kernel on one
    row), every decoded row nudged."""
    return decode_attention_triton(q, k_cache, v_cache, slot_ids, seq_lens, scale) * NUDGE


def gated_delta_prefill_first_row_nudged(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                         beta: torch.Tensor, states: torch.Tensor, slot_ids: torch.Tensor,
                                         start_positions: torch.Tensor, cu_seqlens: torch.Tensor,
                                         replay: torch.Tensor | None = None) -> torch.Tensor:
    """The torch backend's Gated DeltaNet prefill with the first row of every piece taking another
    path: a cut changes a position's bits, and, unlike attention in a model's last layer, the row
    feeds every later layer. Batch invariant, within tolerance."""
    out = gated_delta_prefill_recurrent(q, k, v, g, beta, states, slot_ids, start_positions, cu_seqlens, replay)
    first_rows = cu_seqlens[:-1][cu_seqlens[:-1] < cu_seqlens[1:]].long()
    out[first_rows] = out[first_rows] * NUDGE
    return out


def moe_grouping_order(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w_gate_up: torch.Tensor,
                       w_down: torch.Tensor) -> torch.Tensor:
    """Each token's contributions summed in the order the batch's expert groups are visited (largest
    group first, as a load-balancing grouped GEMM schedules them), not in the token's rank order;
    the products themselves row invariant. Where that order is not the rank order the token's sum
    rounds differently (for three terms or more, or in half precision, it does), which is planted
    as the nudge, so it shows for any K and on every machine. The order, and so the bits, depend
    on which other tokens share the batch. Within tolerance of the reference."""
    tokens, top_k = topk_ids.shape
    y = experts_by_group(x, topk_ids, w_gate_up, w_down, linear_per_row).float()
    counts = torch.bincount(topk_ids.reshape(-1), minlength=w_gate_up.shape[0])
    visit = sorted(range(w_gate_up.shape[0]), key=lambda e: (-int(counts[e]), e))
    when = torch.empty_like(counts)
    when[torch.tensor(visit, dtype=torch.long)] = torch.arange(len(visit))
    order = torch.argsort(when[topk_ids], dim=1, stable=True)  # each token's ranks in visiting order
    contributions = y * topk_weights.float()[..., None]
    ordered = contributions.gather(1, order[..., None].expand_as(contributions))
    out = ordered[:, 0]
    for k in range(1, top_k):
        out = out + ordered[:, k]
    moved = (order != torch.arange(top_k)).any(dim=1)
    out[moved] = out[moved] * NUDGE
    return out.to(x.dtype)
