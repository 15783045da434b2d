"""The routed experts of a mixture-of-experts layer on one rank, and how the ranks' shares keep the
bits of one process.

Three ways to hold them (`TensorParallel`):
- one process: every expert whole;
- tensor parallel (above one rank, the default): a block of every expert's intermediate features
  per rank (gate/up by output column, down by input feature);
- expert parallel (`enable_expert_parallel`): a block of whole experts per rank; every rank routes
  every token (the router is replicated), computes the (token, rank) pairs its experts got, and the
  pairs' outputs go back to every rank.

With the fixed reduction tree (`tp.tree`, see `parallel/tree.py`) each expert's down matrix is
multiplied as REDUCTION_SHARDS shards of its input features summed in the tree: in one process by
the op itself ([E, S, H, I/S], `kernels/moe.py`), under tensor parallelism as each rank's subtree
with the ranks' sums through the upper levels, under expert parallelism whole on the expert's
rank. So every pair's output has the same bits at every size and in both layouts. Above one rank
every rank then holds every pair's output and combines each token's in its top-k order
(`kernels.moe.combine`, the sum every implementation of the op computes), whichever rank computed
them; one process calls the op on its rows whole, so a defect planted in the op shows. The price:
K rows per token cross the ranks (the dense MLP's all-gather moves one), under expert parallelism
about K / size per rank.

Without the tree each rank combines its own contributions and a plain all-reduce adds the ranks':
the library's order, and under expert parallelism the contributions combined rank by rank, so the
bits follow the size and the layout (the negative control of the tests).
"""

from __future__ import annotations

import torch

from ..kernels import Ops
from ..kernels.moe import combine
from ..parallel.group import TensorParallel
from ..parallel.tree import REDUCTION_SHARDS, tree_sum


class Experts:
    """This rank's experts: w_gate_up [E_local, 2I_local, H] and w_down [E_local, H, I_local] as
    loaded, the down matrix kept in the tree's shards where the tree is on."""

    def __init__(self, w_gate_up: torch.Tensor, w_down: torch.Tensor, tp: TensorParallel) -> None:
        self.tp = tp
        self.w_gate_up = w_gate_up
        self.count, hidden, inter = w_down.shape
        self.first = tp.rank * self.count if tp.expert_parallel else 0  # the first expert this rank holds
        shards = (REDUCTION_SHARDS // (1 if tp.expert_parallel else tp.size)) if tp.tree else 1
        if inter % shards:  # one process only (check_parallel refuses such a model above one rank)
            shards = 1
        # The shards as column slices of each expert's down matrix (a view) where the kernel streams it
        # as a whole, else a copy shard by shard.
        sharded = w_down.view(self.count, hidden, shards, inter // shards).transpose(1, 2)
        self.w_down = w_down if shards == 1 else sharded if tp.shards_in_place else sharded.contiguous()

    def matrices(self) -> tuple[torch.Tensor, ...]:
        """Each expert's gate/up matrix and down matrix (or its shards), as the op multiplies them."""
        down = [shard for expert in self.w_down for shard in expert] if self.w_down.dim() == 4 else self.w_down
        return (*self.w_gate_up.unbind(0), *down)

    def forward(self, ops: Ops, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """[T, H]: the routed experts' output for rows x [T, H] routed to topk_ids [T, K]."""
        if self.tp.size == 1:
            return ops.moe(x, topk_ids, topk_weights, self.w_gate_up, self.w_down)
        if not self.tp.tree:
            return self._library_order(ops, x, topk_ids, topk_weights)
        tokens, top_k = topk_ids.shape
        pairs = self._pair_outputs(ops, x, topk_ids)
        return combine(pairs.view(tokens, top_k, x.shape[1]), topk_weights, x.dtype)

    def _local(self, ops: Ops, x: torch.Tensor, topk_ids: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
        """[P, H]: the outputs of the (token, rank) pairs `pairs` (indices t * K + k) on this rank's
        experts, each pair a row of its own with weight 1, so the op returns it uncombined (its row's
        bits, whatever else is in the call)."""
        top_k = topk_ids.shape[1]
        ids = topk_ids.reshape(-1).index_select(0, pairs) - self.first
        ones = torch.ones(pairs.numel(), 1, dtype=torch.float32, device=x.device)
        return ops.moe(x.index_select(0, pairs // top_k), ids[:, None], ones, self.w_gate_up, self.w_down)

    def _owners(self, topk_ids: torch.Tensor) -> torch.Tensor:
        """[T * K]: the rank that computes each pair (this one, unless experts are split whole)."""
        flat = topk_ids.reshape(-1)
        return flat // self.count if self.tp.expert_parallel else torch.full_like(flat, self.tp.rank)

    def _pair_outputs(self, ops: Ops, x: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """[T * K, H]: every pair's whole output (the tree's every level summed), on every rank."""
        owners = self._owners(topk_ids)
        mine = (owners == self.tp.rank).nonzero().squeeze(1)
        local = self._local(ops, x, topk_ids, mine)
        if not self.tp.expert_parallel:
            return tree_sum(self.tp.all_gather(local))
        rows = [(owners == rank).nonzero().squeeze(1) for rank in range(self.tp.size)]
        padded = local.new_zeros(max(r.numel() for r in rows), local.shape[1])  # every rank sends one shape
        padded[:local.shape[0]] = local
        out = local.new_empty(owners.numel(), local.shape[1])
        for rank_rows, part in zip(rows, self.tp.all_gather(padded)):
            out[rank_rows] = part[:rank_rows.numel()]
        return out

    def _library_order(self, ops: Ops, x: torch.Tensor, topk_ids: torch.Tensor,
                       topk_weights: torch.Tensor) -> torch.Tensor:
        """Each rank's own contributions combined, the ranks' sums all-reduced in the library's order."""
        if not self.tp.expert_parallel:
            return self.tp.all_reduce(ops.moe(x, topk_ids, topk_weights, self.w_gate_up, self.w_down))
        owners = self._owners(topk_ids)
        mine = (owners == self.tp.rank).nonzero().squeeze(1)
        pairs = x.new_zeros(owners.numel(), x.shape[1])
        pairs[mine] = self._local(ops, x, topk_ids, mine)
        weights = torch.where((owners == self.tp.rank).view(topk_ids.shape), topk_weights.float(), 0.0)
        return self.tp.all_reduce(combine(pairs.view(*topk_ids.shape, x.shape[1]), weights, x.dtype))
