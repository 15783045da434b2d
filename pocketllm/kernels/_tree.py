"""The fixed binary tree a row-parallel product's shards are summed in: pairs (0+1), (2+3), ...,
then pairs of those, level by level. Shared by the linear op's sharded form (`linear.in_shards`)
and the tensor-parallel layers, whose ranks' sums go through the same tree's upper levels."""

from __future__ import annotations

import torch

REDUCTION_SHARDS = 8  # so tensor-parallel sizes 1, 2, 4 and 8 agree bit for bit


def tree_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    """Sum a power-of-two number of tensors pairwise, level by level, in list order."""
    if not parts or len(parts) & (len(parts) - 1):
        raise ValueError(f"tree_sum needs a power-of-two number of parts, got {len(parts)}")
    while len(parts) > 1:
        parts = [parts[i] + parts[i + 1] for i in range(0, len(parts), 2)]
    return parts[0]
