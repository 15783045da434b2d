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

from ..kernels._tree import REDUCTION_SHARDS, tree_sum

__all__ = ["REDUCTION_SHARDS", "SIZES", "tree_enabled", "tree_sum"]

SIZES = tuple(n for n in range(1, REDUCTION_SHARDS + 1) if REDUCTION_SHARDS % n == 0 and n & (n - 1) == 0)


def tree_enabled(option: bool | None, size: int, native: bool = False) -> bool:
    """The `tree_reduction` option at `size` ranks: None means on whenever the model is sharded, and
    in one process where the linear kernel sums its shards itself (`native`: it costs nothing)."""
    return (size > 1 or native) if option is None else option
