"""Write new K/V rows into their slots of the cache, at their absolute positions (after RoPE).

Attention reads K/V from the slot only after this write, so a token attends to exactly the
bytes every later step will read too.

`rope_write_kv_triton` is the Triton kernel: one program per token rotates its q and k heads and
writes k and v into the cache, in one launch.
"""

from typing import Any, Protocol

import torch

from ._cases import HEADS, randn
from ._triton import kernel_device_ok, tl, triton
from .cpu.extension import load_extension
from .rope import apply_rope_ref, rope_table
from .spec import Call, Cost, Layout, OpSpec, Step, size


class RopeWriteKv(Protocol):
    """q [T, Hq, D], k/v [T, Hkv, D], positions/token_slots [T], cos/sin [max_positions, rotary
    dim], caches [slots, max_seq_len, Hkv, D] (written in place) -> rotated q [T, Hq, D]."""

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                 cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 token_slots: torch.Tensor) -> torch.Tensor: ...


def write_kv_ref(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 token_slots: torch.Tensor, positions: torch.Tensor) -> None:
    """k_cache/v_cache [slots, max_seq_len, kv_heads, D]; k/v [T, kv_heads, D]; token_slots/positions [T]."""
    k_cache[token_slots, positions] = k.to(k_cache.dtype)
    v_cache[token_slots, positions] = v.to(v_cache.dtype)


def rope_write_kv_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                      cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      token_slots: torch.Tensor) -> torch.Tensor:
    """Rotate q and k by their positions, write rotated k and v into the slots; returns rotated q.

    The op the model calls: one launch in the Triton backend, this composition in the reference.
    """
    write_kv_ref(k_cache, v_cache, apply_rope_ref(k, positions, cos, sin), v, token_slots, positions)
    return apply_rope_ref(q, positions, cos, sin)


def rope_write_kv_own_order(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                            cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            token_slots: torch.Tensor) -> torch.Tensor:
    """The torch backend's op where pocketllm's C++ kernels build: the reference's arithmetic (each
    product and sum rounded on its own: the same bits) in one call of `kernels/cpu/rows.cpp` instead of
    a dozen torch ops. fp32 CPU tensors with each token's heads contiguous; elsewhere the reference."""
    module = load_extension()
    tensors = (q, k, v, cos, sin, k_cache, v_cache)
    if module is None or any(t.dtype != torch.float32 or t.device.type != "cpu" for t in tensors) \
            or any(t.stride(-1) != 1 or t.stride(1) != t.shape[2] for t in (q, k, v)) \
            or not all(t.is_contiguous() for t in (cos, sin, k_cache, v_cache)):
        return rope_write_kv_ref(q, k, v, positions, cos, sin, k_cache, v_cache, token_slots)
    return module.rope_write_kv_rows(q, k, v, positions, cos, sin, k_cache, v_cache, token_slots)


# -- Triton ------------------------------------------------------------------------------------------


@triton.jit
def _rotate_tile(ptr, row_offset, head_stride, dim_stride, heads, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                 BLOCK_HALF: tl.constexpr, c1, s1, c2, s2):
    """Load one token's [heads, D] tile as its two halves and rotate it in the tile's dtype.

    Each product and each sum is computed in fp32 and rounded to the dtype, as torch computes
    `x * c + rotate_half(x) * s` for 16-bit floats; for fp32 the conversions are no-ops.
    Returns (first half, second half, head indices, mask)."""
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_HALF)
    mask = (h < heads)[:, None] & (d < HALF)[None, :]
    base = ptr + row_offset + h[:, None].to(tl.int64) * head_stride + d[None, :].to(tl.int64) * dim_stride
    x1 = tl.load(base, mask=mask, other=0.0)
    x2 = tl.load(base + HALF * dim_stride, mask=mask, other=0.0)
    dtype = x1.dtype
    # cos/sin cast to x's dtype first, as the reference does.
    c1 = c1.to(dtype).to(tl.float32)[None, :]
    s1 = s1.to(dtype).to(tl.float32)[None, :]
    c2 = c2.to(dtype).to(tl.float32)[None, :]
    s2 = s2.to(dtype).to(tl.float32)[None, :]
    x1f = x1.to(tl.float32)
    x2f = x2.to(tl.float32)
    out1 = ((x1f * c1).to(dtype).to(tl.float32) - (x2f * s1).to(dtype).to(tl.float32)).to(dtype)
    out2 = ((x2f * c2).to(dtype).to(tl.float32) + (x1f * s2).to(dtype).to(tl.float32)).to(dtype)
    return out1, out2, h, mask


@triton.jit
def _copy_dims(src_ptr, src_row, src_sh, src_sd, dst_ptr, dst_row, dst_sh, dst_sd, heads,
               START: tl.constexpr, COUNT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr):
    """Copy dims [START, START + COUNT) of one token's [heads, D] rows, cast to dst's dtype."""
    h = tl.arange(0, BLOCK_H)[:, None].to(tl.int64)
    n = START + tl.arange(0, BLOCK_N)[None, :].to(tl.int64)
    mask = (h < heads) & (n < START + COUNT)
    vals = tl.load(src_ptr + src_row + h * src_sh + n * src_sd, mask=mask)
    tl.store(dst_ptr + dst_row + h * dst_sh + n * dst_sd, vals.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_write_kv_kernel(q_ptr, k_ptr, v_ptr, positions_ptr, slots_ptr, cos_ptr, sin_ptr,
                          q_out_ptr, k_cache_ptr, v_cache_ptr,
                          q_st, q_sh, q_sd, k_st, k_sh, k_sd, v_st, v_sh, v_sd,
                          cos_sp, cos_sd, sin_sp, sin_sd,
                          kc_ss, kc_sp, kc_sh, kc_sd, vc_ss, vc_sp, vc_sh, vc_sd,
                          HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
                          BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_HALF: tl.constexpr,
                          BLOCK_PASS: tl.constexpr, BLOCK_D: tl.constexpr):
    """Program t handles token t: all its q heads, k heads and v heads. Dims [0, 2 * HALF) rotate,
    dims [2 * HALF, D) (partial rotary) are copied unchanged."""
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + t).to(tl.int64)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)
    dmask = d < HALF
    d64 = d.to(tl.int64)
    c1 = tl.load(cos_ptr + pos * cos_sp + d64 * cos_sd, mask=dmask, other=0.0)
    c2 = tl.load(cos_ptr + pos * cos_sp + (d64 + HALF) * cos_sd, mask=dmask, other=0.0)
    s1 = tl.load(sin_ptr + pos * sin_sp + d64 * sin_sd, mask=dmask, other=0.0)
    s2 = tl.load(sin_ptr + pos * sin_sp + (d64 + HALF) * sin_sd, mask=dmask, other=0.0)

    # q -> a contiguous [T, HQ, D] output.
    q1, q2, hq, qmask = _rotate_tile(q_ptr, t * q_st, q_sh, q_sd, HQ, HALF, BLOCK_HQ, BLOCK_HALF, c1, s1, c2, s2)
    q_out = q_out_ptr + t * (HQ * D) + hq[:, None] * D + d[None, :]
    tl.store(q_out, q1, mask=qmask)
    tl.store(q_out + HALF, q2, mask=qmask)

    # k -> k_cache[slot, pos] (int64 offsets: slot * slot_stride can pass 2^31).
    k1, k2, hk, kmask = _rotate_tile(k_ptr, t * k_st, k_sh, k_sd, HKV, HALF, BLOCK_HKV, BLOCK_HALF, c1, s1, c2, s2)
    k_row = slot * kc_ss + pos * kc_sp
    k_dst = k_cache_ptr + k_row + hk[:, None].to(tl.int64) * kc_sh + d64[None, :] * kc_sd
    tl.store(k_dst, k1.to(k_cache_ptr.dtype.element_ty), mask=kmask)
    tl.store(k_dst + HALF * kc_sd, k2.to(k_cache_ptr.dtype.element_ty), mask=kmask)

    if 2 * HALF < D:  # partial rotary: the rest of q and k passes through
        _copy_dims(q_ptr, t * q_st, q_sh, q_sd, q_out_ptr, t * (HQ * D), D, 1, HQ, 2 * HALF, D - 2 * HALF,
                   BLOCK_HQ, BLOCK_PASS)
        _copy_dims(k_ptr, t * k_st, k_sh, k_sd, k_cache_ptr, k_row, kc_sh, kc_sd, HKV, 2 * HALF, D - 2 * HALF,
                   BLOCK_HKV, BLOCK_PASS)

    # v -> v_cache[slot, pos], unrotated.
    _copy_dims(v_ptr, t * v_st, v_sh, v_sd, v_cache_ptr, slot * vc_ss + pos * vc_sp, vc_sh, vc_sd, HKV, 0, D,
               BLOCK_HKV, BLOCK_D)


def rope_write_kv_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                         cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         token_slots: torch.Tensor) -> torch.Tensor:
    """`rope_write_kv_ref` in one launch: q/k/v [T, heads, D] (any strides), positions/token_slots
    int64 [T], cos/sin fp32 [P, R] (R even, R <= D: the first R dims of each head rotate, the rest
    pass through, as partial rotary), caches [slots, max_seq_len, kv_heads, D]; returns rotated q
    as a new contiguous [T, q_heads, D] tensor.

    Invariant by construction: the op is elementwise per (token, head, dim). Program t reads only
    token t's rows, its position's cos/sin row and writes only cache entry (slot[t], pos[t]); the
    tile shape comes from the head count, head dim and rotary width (model constants), never from
    T. Each product and sum is rounded to x's dtype in the reference's order and FMA contraction
    is off, so fp32 results are bitwise the reference's and 16-bit results round each step as
    torch does; pass-through dims are copied.
    """
    kernel_device_ok(q)
    tokens, q_heads, dim = q.shape
    kv_heads = k.shape[1]
    rotary = cos.shape[-1]
    if k.shape != (tokens, kv_heads, dim) or v.shape != (tokens, kv_heads, dim):
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: need [T, heads, D]")
    if rotary % 2 or rotary > dim or sin.shape[-1] != rotary:
        raise ValueError(f"cos/sin widths {rotary}, {sin.shape[-1]}: need one even rotary width <= D = {dim}")
    out = torch.empty((tokens, q_heads, dim), dtype=q.dtype, device=q.device)
    if tokens == 0:
        return out
    half = rotary // 2
    _rope_write_kv_kernel[(tokens,)](
        q, k, v, positions, token_slots, cos, sin, out, k_cache, v_cache,
        *q.stride(), *k.stride(), *v.stride(), *cos.stride(), *sin.stride(), *k_cache.stride(), *v_cache.stride(),
        HQ=q_heads, HKV=kv_heads, D=dim, HALF=half, BLOCK_HQ=triton.next_power_of_2(q_heads),
        BLOCK_HKV=triton.next_power_of_2(kv_heads), BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_PASS=triton.next_power_of_2(max(dim - rotary, 1)), BLOCK_D=triton.next_power_of_2(dim),
        enable_fp_fusion=False)
    return out


# -- declaration -------------------------------------------------------------------------------------


def _case_tokens(gen: torch.Generator, n: int, dims: dict, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {"q": randn(gen, n, dims["heads"], dims["head_dim"], dtype=dtype),
            "k": randn(gen, n, dims["kv_heads"], dims["head_dim"], dtype=dtype),
            "v": randn(gen, n, dims["kv_heads"], dims["head_dim"], dtype=dtype)}


def _case_slots(gen: torch.Generator, start: int, n: int, dims: dict, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    shape = (dims["max_len"], dims["kv_heads"], dims["head_dim"])
    return {"k_cache": torch.zeros(shape, dtype=dtype), "v_cache": torch.zeros(shape, dtype=dtype)}


def _launches(step: Step) -> list[Call]:
    def args() -> tuple[Any, ...]:
        q, k, v = step.attention_views()  # q and k are normed into new tensors first
        table = step.tensor(step.max_seq_len, step.cfg.rotary_dim, dtype=torch.float32)
        return (step.tensor(*q.shape), step.tensor(*k.shape), v, step.batch.positions, table, table, step.kv_cache(),
                step.kv_cache(), step.batch.token_slots)

    return [Call(step.name, args)]


def _cost(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
          sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, token_slots: torch.Tensor) -> Cost:
    """Reads q, k, v, each token's cos/sin row and its position and slot; writes the rotated q and
    the tokens' cache rows. 3 FLOPs a rotated element (x·cos + rotate(x)·sin)."""
    tokens, rotary_dim = q.shape[0], cos.shape[1]
    cache_rows = (k.numel() + v.numel()) * k_cache.element_size()
    rows = 2 * tokens * rotary_dim * cos.element_size()
    rotated = tokens * (q.shape[1] + k.shape[1]) * rotary_dim
    return Cost(2 * size(q) + size(k, v, positions, token_slots) + rows + cache_rows, 3 * rotated)


OP = OpSpec("rope_write_kv", RopeWriteKv, {"ref": rope_write_kv_ref, "own_order": rope_write_kv_own_order,
                                          "triton": rope_write_kv_triton}, order=20,
            cases=Layout(_case_tokens, _case_slots,
                         lambda gen, dims, dtype: dict(zip(("cos", "sin"), rope_table(dims["head_dim"],
                                                                                      dims["max_len"], 1e6))),
                         [({**heads, "max_len": 80}, seqs) for heads in HEADS
                          for seqs in ([(1, 0)], [(5, 0), (8, 60), (3, 70)])], splittable=True),
            launches=_launches, cost=_cost)
