"""Op `decode_attention`: one new query per sequence, at position seq_len - 1 of its slot,
attending to the slot's keys [0, seq_len).

- `decode_attention_ref`: the reference, one sequence at a time, fp32 scores.
- `decode_attention_fused`: the same through torch's fused attention, one call per sequence
  (what the torch backend runs).
- `decode_attention_triton`: the new row through the prefill kernel, so a position's bits are
  the same decoded or prefilled (the triton backend's op with `exact_positions`, the default).
- `decode_attention_split_kv`: split-KV Triton kernels with fixed-size splits, batch invariant by
  construction but rounding differently from a prefill (the triton backend's op without
  `exact_positions`: more parallel on long contexts).
"""

from typing import Protocol

import torch

from ._attention import (
    _attend_block,
    _attend_one,
    _block_d,
    _check_attention_args,
    _decode_per_sequence,
    _dot_precision,
    _sdpa_one,
    _softmax_start,
    attention_rows_cpu,
    kv_bytes,
)
from ._cases import attention_layout, decode_grid
from ._triton import kernel_device_ok, tl, triton
from .checks import check_shape
from .prefill_attention import prefill_attention_triton
from .spec import Call, Cost, OpSpec, Step, size


class DecodeAttention(Protocol):
    """q [B, Hq, D], caches [slots, max_seq_len, Hkv, D], slot_ids and seq_lens [B] -> [B, Hq, D]."""

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_ids: torch.Tensor,
                 seq_lens: torch.Tensor, scale: float) -> torch.Tensor: ...


def decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         slot_ids: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, Hq, D], one token per sequence at position seq_len - 1 -> [B, Hq, D]."""
    return _decode_per_sequence(_attend_one, q, k_cache, v_cache, slot_ids, seq_lens, scale)


def decode_attention_fused(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           slot_ids: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """decode_attention_ref through torch's fused attention, one call per sequence (one op where
    the reference runs about ten): the torch backend's op."""
    return _decode_per_sequence(_sdpa_one, q, k_cache, v_cache, slot_ids, seq_lens, scale)


def decode_attention_own_order(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               slot_ids: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Each row through the C++ kernel `prefill_attention_own_order` runs on every prefill row
    (`_attention.attention_rows_cpu`): a decoded position gets a prefilled one's bits; `fused`
    (which `prefill_attention_per_row` matches) where the kernel does not apply."""
    out = attention_rows_cpu(q, k_cache, v_cache, slot_ids, seq_lens - 1, scale)
    return decode_attention_fused(q, k_cache, v_cache, slot_ids, seq_lens, scale) if out is None else out


# Fixed tile sizes. They never depend on the batch, so a sequence's arithmetic never does either.
DECODE_BLOCK_N = 64  # keys per block in decode; a split is a whole number of these blocks


DECODE_SPLIT_SIZE = 256  # keys per split in decode (fixed size, not a fixed count)


@triton.jit
def _decode_split_kernel(q_ptr, k_ptr, v_ptr, slot_ptr, len_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
                         stride_qb, stride_qh, stride_qd,
                         stride_ks, stride_kl, stride_kh, stride_kd,
                         stride_vs, stride_vl, stride_vh, stride_vd,
                         num_heads, max_splits, scale,
                         GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, SPLIT_SIZE: tl.constexpr,
                         BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                         DOT_PRECISION: tl.constexpr):
    """One (sequence, KV head, split): all query heads of the group against keys
    [split * SPLIT_SIZE, min((split + 1) * SPLIT_SIZE, seq_len)), online softmax in fp32; writes the
    split's unnormalised (max, sum, acc) per head. Splits past the sequence's end do nothing."""
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)
    seq_len = tl.load(len_ptr + seq).to(tl.int32)
    split_start = split * SPLIT_SIZE
    if split_start < seq_len:
        split_end = tl.minimum(split_start + SPLIT_SIZE, seq_len)
        slot = tl.load(slot_ptr + seq).to(tl.int64)
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        offs_n = tl.arange(0, BLOCK_N)
        g_mask = g < GROUP
        d_mask = d < HEAD_DIM
        heads = kv_head * GROUP + g
        q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + d[None, :] * stride_qd,
                    mask=g_mask[:, None] & d_mask[None, :], other=0.0)
        k_base = k_ptr + slot * stride_ks + kv_head * stride_kh
        v_base = v_ptr + slot * stride_vs + kv_head * stride_vh
        m, l, acc = _softmax_start(BLOCK_G, BLOCK_D)
        for block_start in range(split_start, split_end, BLOCK_N):
            pos = block_start + offs_n
            kv_mask = pos < split_end
            # Every block of a split holds at least one key, so m is finite after it.
            m, l, acc = _attend_block(q, k_base, v_base, pos, kv_mask, kv_mask[None, :], d, d_mask, stride_kl,
                                      stride_kd, stride_vl, stride_vd, scale, m, l, acc, DOT_PRECISION)
        part = (seq * num_heads + heads) * max_splits + split  # [BLOCK_G]
        tl.store(part_m_ptr + part, m, mask=g_mask)
        tl.store(part_l_ptr + part, l, mask=g_mask)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=g_mask[:, None] & d_mask[None, :])


@triton.jit
def _decode_merge_kernel(part_m_ptr, part_l_ptr, part_acc_ptr, len_ptr, out_ptr,
                         stride_ob, stride_oh, stride_od, num_heads, max_splits,
                         HEAD_DIM: tl.constexpr, SPLIT_SIZE: tl.constexpr, BLOCK_D: tl.constexpr):
    """One (sequence, query head): merges its ceil(seq_len / SPLIT_SIZE) splits in split order
    with log-sum-exp and writes the normalised output in the output's dtype."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    num_splits = tl.cdiv(tl.load(len_ptr + seq).to(tl.int32), SPLIT_SIZE)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    first = (seq * num_heads + head) * max_splits
    m = tl.load(part_m_ptr + first)
    l = tl.load(part_l_ptr + first)
    acc = tl.load(part_acc_ptr + first * HEAD_DIM + d, mask=d_mask, other=0.0)
    for split in range(1, num_splits):
        m_split = tl.load(part_m_ptr + first + split)
        l_split = tl.load(part_l_ptr + first + split)
        acc_split = tl.load(part_acc_ptr + (first + split) * HEAD_DIM + d, mask=d_mask, other=0.0)
        m_new = tl.maximum(m, m_split)
        alpha = tl.exp(m - m_new)
        beta = tl.exp(m_split - m_new)
        l = l * alpha + l_split * beta
        acc = acc * alpha + acc_split * beta
        m = m_new
    out = acc / l
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + d * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=d_mask)


def decode_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            slot_ids: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Each sequence's new row as a one-row prefill piece at position seq_len - 1
    (`prefill_attention_triton`): the row sits at its absolute place in its query tile and walks the
    same key blocks with the same online softmax as inside any prefill piece, so it gets the bits a
    prefill (or a scoring pass) gives that position. One program per (sequence, head) walks all of
    its keys: no split-KV parallelism (see `decode_attention_split_kv`)."""
    check_shape("slot_ids", slot_ids, (q.shape[0],))
    check_shape("seq_lens", seq_lens, (q.shape[0],))
    rows = torch.arange(q.shape[0] + 1, dtype=torch.int64, device=q.device)
    return prefill_attention_triton(q, k_cache, v_cache, slot_ids, seq_lens - 1, rows, scale)


def decode_attention_split_kv(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              slot_ids: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                              split_size: int = DECODE_SPLIT_SIZE) -> torch.Tensor:
    """Split-KV decode attention, same semantics as `decode_attention_ref`.

    Batch invariant by construction: a split is a fixed number of keys (`split_size`) at fixed
    absolute positions, walked in fixed BLOCK_N blocks, so the splits of a sequence and every
    split's arithmetic depend only on its own length and K/V; the merge folds exactly that
    sequence's splits in split order. Batch size, other sequences' lengths and the slot index
    change only how many programs are launched, never what any program computes.
    """
    kernel_device_ok(q)
    if split_size <= 0 or split_size % DECODE_BLOCK_N:
        raise ValueError(f"split_size must be a positive multiple of {DECODE_BLOCK_N}, got {split_size}")
    group = _check_attention_args(q, k_cache, v_cache)
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    check_shape("slot_ids", slot_ids, (batch,))
    check_shape("seq_lens", seq_lens, (batch,))
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    max_splits = triton.cdiv(int(seq_lens.max()), split_size)
    part_m = torch.empty((batch, num_heads, max_splits), dtype=torch.float32, device=q.device)
    part_l = torch.empty_like(part_m)
    part_acc = torch.empty((batch, num_heads, max_splits, head_dim), dtype=torch.float32, device=q.device)
    block_d = _block_d(head_dim)
    _decode_split_kernel[(batch, num_kv_heads, max_splits)](
        q, k_cache, v_cache, slot_ids, seq_lens, part_m, part_l, part_acc,
        *q.stride(), *k_cache.stride(), *v_cache.stride(),
        num_heads, max_splits, scale,
        GROUP=group, HEAD_DIM=head_dim, SPLIT_SIZE=split_size,
        BLOCK_G=max(16, triton.next_power_of_2(group)), BLOCK_N=DECODE_BLOCK_N, BLOCK_D=block_d,
        DOT_PRECISION=_dot_precision(q.dtype), num_stages=2)
    _decode_merge_kernel[(batch, num_heads)](
        part_m, part_l, part_acc, seq_lens, out, *out.stride(), num_heads, max_splits,
        HEAD_DIM=head_dim, SPLIT_SIZE=split_size, BLOCK_D=block_d)
    return out


# -- declaration -------------------------------------------------------------------------------------


def _launches(step: Step) -> list[Call]:
    cfg, batch = step.cfg, step.batch
    if not batch.is_decode:
        return []
    return [Call(step.name, lambda: (step.tensor(step.tokens, cfg.num_attention_heads, cfg.head_dim),
                                     step.kv_cache(), step.kv_cache(), batch.slot_ids, batch.start_positions + 1,
                                     cfg.head_dim ** -0.5))]


def _cost(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_ids: torch.Tensor,
          seq_lens: torch.Tensor, scale: float) -> Cost:
    """Reads q and the first seq_len positions of each sequence's K and V (not the whole cache),
    writes q's shape; 4·heads·D FLOPs a key per query row (q·k and p·v)."""
    keys = int(seq_lens.sum())
    heads, d = q.shape[1], q.shape[2]
    return Cost(2 * size(q) + kv_bytes(k_cache, keys) + size(slot_ids, seq_lens), 4 * heads * d * keys)


OP = OpSpec("decode_attention", DecodeAttention,
            {"ref": decode_attention_ref, "fused": decode_attention_fused, "triton": decode_attention_triton,
             "split_kv": decode_attention_split_kv, "own_order": decode_attention_own_order},
            order=40, cases=attention_layout(300, [decode_grid(lengths) for lengths in ([1], [1, 64, 65, 257],
                                                                                          [300, 2, 129])]),
            launches=_launches, cost=_cost)
