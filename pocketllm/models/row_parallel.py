"""A row-parallel matrix: input features split over ranks, products summed in the fixed tree.

o_proj, down_proj and the Gated DeltaNet out_proj read features that tensor parallelism splits
(heads, intermediate columns), so each rank holds a K slice of the matrix and the ranks' products
must be summed. With the tree (the default when sharded; an option at size 1) the slice is cut into its fixed
shards and summed as `parallel/tree.py` describes; without it, one product per rank and a
plain all-reduce. The bias, held by every rank, is added once after the sum. A matrix whose
K does not split into the shards is one product (it cannot run on several ranks either).
"""

from __future__ import annotations

import torch

from ..kernels import Ops
from ..kernels.linear import in_shards
from ..parallel.group import TensorParallel
from ..parallel.tree import REDUCTION_SHARDS, tree_sum


class RowParallel:
    """y = x W^T (+ b) for this rank's K slice W [N, K_local] of a row-parallel matrix."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, tp: TensorParallel, name: str) -> None:
        self.tp, self.bias = tp, bias
        if not tp.tree:
            self.shards = [weight]
            return
        count = REDUCTION_SHARDS // tp.size
        if weight.shape[1] % count and tp.size == 1:  # such a model cannot be split either: one product
            self.shards = [weight]
            return
        if weight.shape[1] % count:
            raise ValueError(f"{name}: its {weight.shape[1] * tp.size} input features do not split into "
                             f"{REDUCTION_SHARDS} equal shards for the fixed reduction tree")
        # Column slices of the matrix (views) where the kernel streams it as a whole, else copies.
        shards = weight.contiguous().split(weight.shape[1] // count, dim=1)
        self.shards = list(shards) if tp.shards_in_place else [shard.contiguous() for shard in shards]

    def weights(self) -> tuple[torch.Tensor, ...]:
        """The matrices multiplied through `ops.linear`: its shards."""
        return tuple(self.shards)

    def forward(self, ops: Ops, x: torch.Tensor) -> torch.Tensor:
        local = in_shards(ops.linear, x, self.shards)
        if self.tp.size > 1:
            local = tree_sum(self.tp.all_gather(local)) if self.tp.tree else self.tp.all_reduce(local)
        return local if self.bias is None else local + self.bias
