"""The fixed reduction tree that makes every tensor-parallel size give the same bits.

A row-parallel product y = x W^T (o_proj, down_proj, the Gated DeltaNet out_proj) is split over
its input features K into `REDUCTION_SHARDS` fixed shards of K / REDUCTION_SHARDS features. Each
shard's product is one call of the linear op (whose bits depend on its K only), and the shard
products are summed in one binary tree: pairs (0+1), (2+3), ..., then pairs of those, and so on.
At tensor-parallel size n (a power of two dividing the shard count) rank r holds shards
[r * S/n, (r+1) * S/n): its local tree is exactly one subtree, and the ranks' sums, gathered in
rank order, go through the tree's upper levels on every rank alike. Every size, 1 included,
therefore adds the same numbers in the same order. (After the published "tree-based invariant
kernels" idea; written from the algorithm.)
"""

from __future__ import annotations

import torch

REDUCTION_SHARDS = 8  # so tensor-parallel sizes 1, 2, 4 and 8 agree bit for bit
SIZES = tuple(n for n in range(1, REDUCTION_SHARDS + 1) if REDUCTION_SHARDS % n == 0 and n & (n - 1) == 0)


def tree_enabled(option: bool | None, size: int) -> bool:
    """The `tree_reduction` option at `size` ranks: None means on whenever the model is sharded."""
    return size > 1 if option is None else option


def tree_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """Sum a power-of-two number of tensors pairwise, level by level, in list order."""
    if not parts or len(parts) & (len(parts) - 1):
        raise ValueError(f"tree_sum needs a power-of-two number of parts, got {len(parts)}")
    while len(parts) > 1:
        parts = [parts[i] + parts[i + 1] for i in range(0, len(parts), 2)]
    return parts[0]
