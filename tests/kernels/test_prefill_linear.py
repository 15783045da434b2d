"""prefill_linear (pocketllm/kernels/prefill_linear.py): the linear layers on a prefill's token
rows. Its reference and Triton kernel are linear's (test_linear.py checks them, and the torch
backend's 64-row tiles among its row-invariance cases); here the torch backend's
`prefill_linear_row_invariant` keeps a row's bits at prefill sizes, at 1 and 2 threads, where a
single GEMM call changes its blocking on some CPUs."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import randn as _randn
from kernel_cases import threads as threads  # the fixture

from pocketllm.kernels.linear import PREFILL_ROW_TILE
from pocketllm.kernels.prefill_linear import prefill_linear_row_invariant

# (K, N) of the Qwen3-0.6B-like and Intel-failing shapes named in the design notes.
PREFILL_SHAPES = [(512, 1408), (1408, 512), (1024, 3072), (3072, 1024)]


@pytest.mark.parametrize("k,n", PREFILL_SHAPES)
def test_rows_keep_their_bits_at_prefill_sizes(threads, k, n):
    """The first rows are the same alone (one tile) and inside prefills of up to 1500 rows, where
    a single GEMM call changes its blocking on some CPUs; a row moved to the end of a long prefill
    keeps its bits too."""
    linear_row_invariant = prefill_linear_row_invariant
    ROW_TILE = PREFILL_ROW_TILE  # noqa: N806
    largest = 1500 if k * n < 2_000_000 else 520
    x = _randn(largest, k, seed=k + 7)
    w = _randn(n, k, seed=n + 7)
    head = linear_row_invariant(x[:ROW_TILE], w)
    sizes = [m for m in (17, 100, 257, 513, 1024, 1500) if m <= largest]
    bad = [m for m in sizes if not torch.equal(linear_row_invariant(x[:m], w)[:ROW_TILE], head[:m])]
    assert not bad, f"row results change at M in {bad}"
    moved = torch.cat([x[ROW_TILE:largest], x[:ROW_TILE]])
    assert torch.equal(linear_row_invariant(moved, w)[-ROW_TILE:], head)
