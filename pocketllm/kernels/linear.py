"""Linear layers: y = x @ W^T (+ b).

`linear_ref` is the plain reference. `linear_row_invariant` is what the torch backend runs: CPU
BLAS (MKL here) switches its GEMM kernel on the number of rows, so one row's result changes with
how many other rows share the call. Measured on MKL 2024.2 / AVX-512, fp32, for K, N from 32 to
4096: row counts 1-3, 5-7 and 9-11 each round differently, while every multiple of 4 and every
count >= 12 agree bit for bit. Padding the row count up to a multiple of `ROW_MULTIPLE` therefore
makes each row's result independent of the batch. tests/kernels/test_linear.py re-measures this
on the machine that runs it, so a BLAS with other thresholds fails loudly instead of silently.
"""

import torch
import torch.nn.functional as F

ROW_MULTIPLE = 4


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """[M, K] x [N, K] -> [M, N]."""
    return F.linear(x, weight, bias)


def linear_row_invariant(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`linear_ref` with the row count padded so each row's bits do not depend on M."""
    rows = x.shape[0]
    pad = -rows % ROW_MULTIPLE
    if pad:
        x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
    return F.linear(x, weight, bias)[:rows]
