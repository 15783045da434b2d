"""The moe op's Triton kernels: the pairs' alignment into one expert's row blocks, gate/up with the
SiLU-and-multiply, the down product (a sharded down matrix's shards summed in the fixed tree in one
launch), and each token's combine in rank order. `moe.moe_triton` launches them."""

import torch

from ._linear_triton import tree_push
from ._triton import tl, triton


def align_pairs(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(pair_ids [B * block_m], block_expert [B]): the (token, rank) pairs t * K + k sorted by expert
    (stable: pair order within an expert), each expert's run padded to whole blocks with the
    sentinel T * K; block b computes expert block_expert[b], -1 for the blocks past the last. B is a
    bound known without reading the ids (no device sync): ceil(T * K / block_m) + min(E, T * K)."""
    flat = topk_ids.reshape(-1)
    pairs = flat.numel()
    device = flat.device
    max_blocks = triton.cdiv(pairs, block_m) + min(num_experts, pairs)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    blocks = (counts + block_m - 1) // block_m
    block_end = torch.cumsum(blocks, 0)
    count_start = torch.cumsum(counts, 0) - counts
    sorted_experts = flat[order]
    position = (block_end - blocks)[sorted_experts] * block_m + torch.arange(pairs, device=device) \
        - count_start[sorted_experts]
    pair_ids = torch.full((max_blocks * block_m,), pairs, dtype=torch.int64, device=device)
    pair_ids[position] = order
    block_expert = torch.searchsorted(block_end, torch.arange(max_blocks, device=device), right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1)
    return pair_ids, block_expert


@triton.jit
def _block_tile(pair_ids_ptr, num_pairs, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """A program's tile: its block's padded rows, their pairs (the sentinel num_pairs past an
    expert's last), which rows are real, its output columns and the K offsets of one step."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pair_ids_ptr + offs)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    return offs, pair, pair < num_pairs, cols, tl.arange(0, BLOCK_K)


@triton.jit
def _tile_dot(acc, a, b, HOST_DOT: tl.constexpr):
    """acc + a @ b in fp32: IEEE tl.dot compiled; under the interpreter an explicit product and sum,
    the same per-element order for every row (see linear.py: numpy's matmul is the host BLAS)."""
    if HOST_DOT:
        return acc + tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
    else:
        return tl.dot(a, b, acc, input_precision="ieee")


@triton.jit(do_not_specialize=["num_pairs"])
def moe_gate_up_kernel(x_ptr, w_ptr, h_ptr, pair_ids_ptr, block_expert_ptr, num_pairs, top_k, hidden, inter,
                        stride_xm, stride_we, stride_wn, stride_hm,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        HOST_DOT: tl.constexpr):
    """Program (b, j): rows of block b (one expert's pairs), columns [j * BLOCK_N, ...) of I:
    gate and up over H in BLOCK_K steps, then silu(gate) * up, rounded as the reference rounds."""
    expert = tl.load(block_expert_ptr + tl.program_id(0))
    if expert >= 0:
        offs, pair, row_ok, cols, ks = _block_tile(pair_ids_ptr, num_pairs, BLOCK_M, BLOCK_N, BLOCK_K)
        col_ok = cols < inter
        token = tl.where(row_ok, pair // top_k, 0)
        x_ptrs = x_ptr + token[:, None] * stride_xm + ks[None, :]
        g_ptrs = w_ptr + expert.to(tl.int64) * stride_we + cols[None, :] * stride_wn + ks[:, None]
        u_ptrs = g_ptrs + inter * stride_wn
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            k_ok = (k0 + ks) < hidden
            a = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w_mask = k_ok[:, None] & col_ok[None, :]
            acc_g = _tile_dot(acc_g, a, tl.load(g_ptrs, mask=w_mask, other=0.0), HOST_DOT)
            acc_u = _tile_dot(acc_u, a, tl.load(u_ptrs, mask=w_mask, other=0.0), HOST_DOT)
            x_ptrs += BLOCK_K
            g_ptrs += BLOCK_K
            u_ptrs += BLOCK_K
        dtype = h_ptr.dtype.element_ty
        gate = acc_g.to(dtype).to(tl.float32)
        up = acc_u.to(dtype).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        tl.store(h_ptr + offs[:, None] * stride_hm + cols[None, :], (silu * up).to(dtype),
                 mask=row_ok[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=["num_pairs"])
def moe_down_kernel(h_ptr, w_ptr, y_ptr, pair_ids_ptr, block_expert_ptr, num_pairs, hidden, inter,
                     stride_hm, stride_we, stride_ws, stride_wn, stride_ym, SHARDS: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, HOST_DOT: tl.constexpr):
    """Program (b, j): the down product of block b's rows, columns [j * BLOCK_N, ...) of H, over I
    in BLOCK_K steps, stored in each pair's own row of y. `inter` is a shard's width: shard s reads
    h's columns [s * inter, (s + 1) * inter) and W at s * stride_ws in a K loop of its own, and the
    shards' products are summed in the fixed tree in registers (`tree_push`)."""
    expert = tl.load(block_expert_ptr + tl.program_id(0))
    if expert >= 0:
        offs, pair, row_ok, cols, ks = _block_tile(pair_ids_ptr, num_pairs, BLOCK_M, BLOCK_N, BLOCK_K)
        col_ok = cols < hidden
        dtype = y_ptr.dtype.element_ty
        a_base = h_ptr + offs[:, None] * stride_hm + ks[None, :]
        b_base = w_ptr + expert.to(tl.int64) * stride_we + cols[None, :] * stride_wn + ks[:, None]
        level0 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        level1 = level0
        level2 = level0
        part = level0
        for s in range(SHARDS):
            a_ptrs = a_base + s * inter
            b_ptrs = b_base + s * stride_ws
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for k0 in range(0, inter, BLOCK_K):
                k_ok = (k0 + ks) < inter
                acc = _tile_dot(acc, tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0),
                                tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0), HOST_DOT)
                a_ptrs += BLOCK_K
                b_ptrs += BLOCK_K
            part, level0, level1, level2 = tree_push(s, acc, level0, level1, level2, dtype)
        rows = tl.where(row_ok, pair, 0)
        tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], part.to(dtype),
                 mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def moe_combine_kernel(y_ptr, w_ptr, out_ptr, hidden, TOP_K: tl.constexpr, BLOCK: tl.constexpr):
    """Program (t, j): out[t, cols] = sum over k = 0..TOP_K-1, in rank order, of y[t * K + k] * w[t, k]."""
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < hidden
    weight = tl.load(w_ptr + token * TOP_K)
    acc = tl.load(y_ptr + token * TOP_K * hidden + cols, mask=ok, other=0.0).to(tl.float32) * weight
    for k in tl.static_range(1, TOP_K):
        weight = tl.load(w_ptr + token * TOP_K + k)
        acc += tl.load(y_ptr + (token * TOP_K + k) * hidden + cols, mask=ok, other=0.0).to(tl.float32) * weight
    tl.store(out_ptr + token * hidden + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


COMBINE_BLOCK = 1024
DOWN_WARPS = 8
