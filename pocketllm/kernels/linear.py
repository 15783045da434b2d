"""Linear layers: y = x @ W^T (+ b).

`linear_ref` is the plain reference. `linear_row_invariant` is what the torch backend runs. CPU
BLAS (MKL here) switches its GEMM kernel on the number of rows, so one row's result can change
with how many other rows share the call. Measured on MKL 2024.2 / AVX-512 for K, N from 64 to
32000 and M up to 3000: computed as W @ x^T, row counts below 12 each round differently, while
every count from 12 on agrees bit for bit (F.linear also agrees at multiples of 4, but its
small-M GEMM is 2-3x slower than W @ x^T). So the torch backend computes W @ x^T with the rows
padded to at least `MIN_ROWS`. tests/kernels/test_ops_reference.py re-measures this on the machine
that runs it, so a BLAS with other thresholds fails loudly instead of silently.
`linear_triton` is the Triton kernel, row invariant by construction (fixed tiles, no split-K).
"""

import torch
import torch.nn.functional as F

from ._triton import INTERPRETED, kernel_device_ok, tl, triton

MIN_ROWS = 16


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """[M, K] x [N, K] -> [M, N]."""
    return F.linear(x, weight, bias)


def linear_row_invariant(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """W @ x^T with at least MIN_ROWS rows, so each row's bits do not depend on M."""
    rows = x.shape[0]
    if rows < MIN_ROWS:
        x = torch.cat([x, x.new_zeros(MIN_ROWS - rows, x.shape[1])])
    out = torch.matmul(weight, x.T).T[:rows]
    return (out if bias is None else out + bias).contiguous()


# -- Triton ------------------------------------------------------------------------------------------

# Tile sizes are constants of the module, never derived from M: a row's output tile always has the
# same shape, the same K blocks in the same order, so its bits cannot depend on the batch.
# The interpreter runs each program in numpy, so it gets the smallest tiles tl.dot accepts.
BLOCK_M, BLOCK_N, BLOCK_K = (16, 32, 32) if INTERPRETED else (64, 64, 64)
GROUP_M = 8
NUM_WARPS, NUM_STAGES = 4, 3


# M is not specialised (Triton would compile a separate kernel for M == 1): one binary for every batch.
@triton.jit(do_not_specialize=["M"])
def _linear_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K,
                   stride_xm, stride_xk, stride_wn, stride_wk, stride_om,
                   HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """Persistent tile loop: program p computes tiles p, p + P, p + 2P, ... (P = programs)."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    tiles_per_group = GROUP_M * num_pid_n
    for tile in range(tl.program_id(0), num_tiles, tl.num_programs(0)):
        # GROUP_M swizzle: only the order tiles are visited in, never a tile's arithmetic.
        first_m = (tile // tiles_per_group) * GROUP_M
        group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
        pid_m = first_m + (tile % tiles_per_group) % group_rows
        pid_n = (tile % tiles_per_group) // group_rows

        rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        ks = tl.arange(0, BLOCK_K)
        row_ok = rows < M
        col_ok = cols < N
        x_ptrs = x_ptr + rows[:, None] * stride_xm + ks[None, :] * stride_xk
        w_ptrs = w_ptr + cols[None, :] * stride_wn + ks[:, None] * stride_wk
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = (k0 + ks) < K
            a = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            acc = tl.dot(a, b, acc, input_precision="ieee")
            x_ptrs += BLOCK_K * stride_xk
            w_ptrs += BLOCK_K * stride_wk
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        out_ptrs = out_ptr + rows[:, None] * stride_om + cols[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


_SM_COUNT: dict[int, int] = {}


def _num_programs(device: torch.device, num_tiles: int) -> int:
    """One program per tile under the interpreter; on CUDA at most one per SM (persistent)."""
    if device.type != "cuda":
        return num_tiles
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return min(num_tiles, _SM_COUNT[index])


def linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """[M, K] x [N, K] (+ [N]) -> [M, N] in x's dtype, row invariant by construction.

    Every output tile is BLOCK_M x BLOCK_N with constant tile sizes, and its K loop runs the same
    BLOCK_K steps in the same order with an fp32 accumulator (IEEE fp32 products for fp32 inputs,
    no split-K), the bias added once after the loop. Rows beyond M are masked to zero and never
    mix into other rows, so a row's bits depend only on that row, W and b, never on M. The
    persistent grid and the GROUP_M swizzle change only which program computes a tile and when.
    """
    kernel_device_ok(x)
    m, k = x.shape
    n, k_w = weight.shape
    if k != k_w:
        raise ValueError(f"x has K={k} but weight has K={k_w}")
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    num_tiles = triton.cdiv(m, BLOCK_M) * triton.cdiv(n, BLOCK_N)
    _linear_kernel[(_num_programs(x.device, num_tiles),)](
        x, weight, bias if bias is not None else weight, out, m, n, k,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), out.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, GROUP_M=GROUP_M,
        num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return out
