"""The linear op's Triton kernel and its launchers: `linear_triton` (one product) and
`linear_triton_shards` (a row-parallel matrix's K shards summed in the fixed tree, in one launch).
Kept apart from `linear.py`, which registers them beside the references and the CPU kernels."""

from collections.abc import Sequence

import torch

from ._triton import kernel_device_ok, launch_device_type, tl, triton

# Tile sizes are constants per device kind, never derived from M: a row's output tile always has
# the same shape, the same K blocks in the same order, so its bits cannot depend on the batch.
# CPU tensors run under the interpreter, one program at a time in numpy, where every program and
# every reduction call costs far more than the arithmetic: they get wide tiles (K in few blocks).
# There `tl.dot` is numpy's matmul, i.e. the host BLAS, whose micro-kernels give a row different
# bits at different positions of the tile; rows move between positions with the batch, so the
# interpreter computes the tile product as an explicit fp32 product and sum, the same per-element
# order for every row.
TILES = {"cpu": (16, 128, 256), "cuda": (64, 64, 64)}  # device type -> (BLOCK_M, BLOCK_N, BLOCK_K)
GROUP_M = 8
TRITON_MAX_SHARDS = 8  # tree_push's three levels: the fixed tree's 8 shards
NUM_WARPS, NUM_STAGES = 8, 3  # 8 warps: the 8-shard tree's three levels fit the registers


@triton.jit
def tree_push(s, product, level0, level1, level2, dtype: tl.constexpr):
    """Shard s's fp32 `product` into the fixed tree `_tree.tree_sum` adds in (at most 8 shards),
    as a tensor of `dtype` per shard would be: rounded to `dtype`, it closes the subtrees its index
    ends, each sum in fp32 rounded to `dtype` (as adding two such tensors rounds it). `level0..2`
    hold the finished subtrees of 1, 2 and 4 shards (fp32 values of `dtype`); returns (the sum so
    far of the subtree s closes, level0, level1, level2): after the last shard, the tree's sum."""
    part = product.to(dtype).to(tl.float32)
    if s % 2 == 1:
        part = (level0 + part).to(dtype).to(tl.float32)
    if s % 4 == 3:
        part = (level1 + part).to(dtype).to(tl.float32)
    if s % 8 == 7:
        part = (level2 + part).to(dtype).to(tl.float32)
    if s % 2 == 0:
        level0 = part
    elif s % 4 == 1:
        level1 = part
    elif s % 8 == 3:
        level2 = part
    return part, level0, level1, level2


# M is not specialised (Triton would compile a separate kernel for M == 1): one binary for every batch.
@triton.jit(do_not_specialize=["M"])
def _linear_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K,
                   stride_xm, stride_xk, stride_wn, stride_wk, stride_ws, stride_om,
                   HAS_BIAS: tl.constexpr, SHARDS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, HOST_DOT: tl.constexpr):
    """Persistent tile loop: program p computes tiles p, p + P, p + 2P, ... (P = programs).

    K is a shard's width: shard s reads x's columns [s * K, (s + 1) * K) and W at s * stride_ws, in
    its own K loop (the loop of a one-shard call on that slice), and the shards' products, each
    rounded to the output's dtype, are summed in the fixed tree in registers (`tree_push`)."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    tiles_per_group = GROUP_M * num_pid_n
    dtype = out_ptr.dtype.element_ty
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
        x_base = x_ptr + rows[:, None] * stride_xm + ks[None, :] * stride_xk
        w_base = w_ptr + cols[None, :] * stride_wn + ks[:, None] * stride_wk
        # A loop over the shards, not one unrolled per shard: the registers hold one shard's
        # pointers and the tree's three levels at a time.
        level0 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        level1 = level0
        level2 = level0
        part = level0
        for s in range(SHARDS):
            x_ptrs = x_base + s * K * stride_xk
            w_ptrs = w_base + s * stride_ws
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                k_ok = (k0 + ks) < K
                a = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                b = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
                if HOST_DOT:
                    acc += tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
                else:
                    acc = tl.dot(a, b, acc, input_precision="ieee")
                x_ptrs += BLOCK_K * stride_xk
                w_ptrs += BLOCK_K * stride_wk
            # One shard: its fp32 sum, rounded once after the bias; more: each rounded, in the tree.
            if SHARDS == 1:
                part = acc
            else:
                part, level0, level1, level2 = tree_push(s, acc, level0, level1, level2, dtype)
        if HAS_BIAS:  # one shard only (the launcher's rule)
            part += tl.load(b_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        out_ptrs = out_ptr + rows[:, None] * stride_om + cols[None, :]
        tl.store(out_ptrs, part.to(dtype), mask=row_ok[:, None] & col_ok[None, :])


def k_block(device_type: str, k: int) -> int:
    """BLOCK_K for a K loop over `k` features: the device's, but under the interpreter (numpy computes
    a whole block, masked or not) no wider than `k` needs, so a narrow K, a shard's, costs little.
    A function of K alone: a row's bits still depend on nothing the batch changes."""
    block_k = TILES[device_type][2]
    return block_k if device_type != "cpu" else min(block_k, max(16, triton.next_power_of_2(k)))


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
    if x.shape[1] != weight.shape[1]:
        raise ValueError(f"x has K={x.shape[1]} but weight has K={weight.shape[1]}")
    return _launch_linear(x, weight, bias, 1, 0)


def linear_triton_shards(x: torch.Tensor, shards: Sequence[torch.Tensor]) -> torch.Tensor:
    """x [M, S * K] times W given as its K slices `shards` (S = 2, 4 or 8 of [N, K]) -> [M, N]: in one
    launch, bitwise what `in_shards` gives with one `linear_triton` call per shard (each shard's K
    loop is that call's, the shards summed in the fixed tree in registers). Column slices of one
    matrix (a row-parallel matrix kept in place) are read where they lie; other shards are stacked."""
    kernel_device_ok(x)
    first = shards[0]
    if len(shards) not in (2, 4, TRITON_MAX_SHARDS):
        raise ValueError(f"linear_triton_shards takes 2, 4 or 8 shards, got {len(shards)}")
    if any(s.shape != first.shape or s.dtype != first.dtype or s.device != first.device or s.stride() != first.stride()
           for s in shards) or first.dim() != 2:
        raise ValueError("linear_triton_shards: the shards differ in shape, dtype, device or strides")
    if x.dim() != 2 or x.shape[1] != len(shards) * first.shape[1]:
        raise ValueError(f"x must be [M, {len(shards) * first.shape[1]}] for {len(shards)} shards of "
                         f"{tuple(first.shape)}, got {tuple(x.shape)}")
    step = shards[1].data_ptr() - first.data_ptr()
    if step % first.element_size() or any(s.data_ptr() - first.data_ptr() != i * step for i, s in enumerate(shards)):
        stacked = torch.stack(list(shards))
        return _launch_linear(x, stacked[0], None, len(shards), stacked.stride(0))
    return _launch_linear(x, first, None, len(shards), step // first.element_size())


def _launch_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, shards: int,
                   stride_ws: int) -> torch.Tensor:
    """One `_linear_kernel` launch over `shards` K slices of `weight`'s width, `stride_ws` apart."""
    m, n, k = x.shape[0], weight.shape[0], weight.shape[1]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    device_type = launch_device_type(x)
    block_m, block_n = TILES[device_type][:2]
    block_k = k_block(device_type, k)
    num_tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    _linear_kernel[(_num_programs(x.device, num_tiles),)](
        x, weight, bias if bias is not None else weight, out, m, n, k,
        x.stride(0), x.stride(1), weight.stride(0), weight.stride(1), stride_ws, out.stride(0),
        HAS_BIAS=bias is not None, SHARDS=shards, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        GROUP_M=GROUP_M, HOST_DOT=device_type == "cpu", num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return out


