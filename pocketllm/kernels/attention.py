"""Causal attention over slotted K/V caches, grouped-query.

Each sequence attends only to the keys of its own slot, and is computed on its own: its result
depends on its queries and its slot's K/V, never on which other sequences share the call. The
cache holds K/V for positions [0, start + n) of a sequence by the time attention runs.

- `prefill_attention_ref`: varlen queries (cu_seqlens) of several sequences, each at absolute
  positions start .. start + n - 1 of its slot.
- `decode_attention_ref`: one query per sequence, at position seq_len - 1 of its slot.
- `prefill_attention_fused`, `decode_attention_fused`: the same through torch's fused attention,
  still one call per sequence; what the torch backend runs.
- `prefill_attention_triton`, `decode_attention_triton`: Triton kernels with the same semantics,
  batch invariant by construction (see their docstrings).
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ._triton import kernel_device_ok, tl, triton
from .checks import check_dtype, check_groups, check_shape


def _attend_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """q [n, Hq, D] at positions start.., k/v [start + n, Hkv, D] -> [n, Hq, D]."""
    n, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    # Query heads of one KV group become rows of one matmul: [Hkv, group * n, D].
    qg = q.reshape(n, num_kv_heads, group, head_dim).permute(1, 2, 0, 3).reshape(num_kv_heads, group * n, head_dim)
    scores = torch.matmul(qg.float(), k.permute(1, 2, 0).float()) * scale  # [Hkv, group * n, L]
    query_pos = start + torch.arange(n, device=q.device).repeat(group)
    key_pos = torch.arange(k.shape[0], device=q.device)
    scores.masked_fill_(key_pos[None, :] > query_pos[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    out = torch.matmul(probs, v.permute(1, 0, 2))  # [Hkv, group * n, D]
    return out.reshape(num_kv_heads, group, n, head_dim).permute(2, 0, 1, 3).reshape(n, num_heads, head_dim)


def _prefill_per_sequence(attend_one: Callable[..., torch.Tensor], q: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, slot_ids: torch.Tensor, start_positions: torch.Tensor,
                          cu_seqlens: torch.Tensor, scale: float) -> torch.Tensor:
    """`attend_one` on each sequence of a varlen batch, over its own slot's keys."""
    out = torch.empty_like(q)
    bounds = cu_seqlens.tolist()
    for i, (slot, start) in enumerate(zip(slot_ids.tolist(), start_positions.tolist())):
        lo, hi = bounds[i], bounds[i + 1]
        end = start + hi - lo
        out[lo:hi] = attend_one(q[lo:hi], k_cache[slot, :end], v_cache[slot, :end], start, scale)
    return out


def _decode_per_sequence(attend_one: Callable[..., torch.Tensor], q: torch.Tensor, k_cache: torch.Tensor,
                         v_cache: torch.Tensor, slot_ids: torch.Tensor, seq_lens: torch.Tensor,
                         scale: float) -> torch.Tensor:
    """`attend_one` on each sequence's one new token, at position seq_len - 1 of its slot."""
    out = torch.empty_like(q)
    for i, (slot, length) in enumerate(zip(slot_ids.tolist(), seq_lens.tolist())):
        out[i:i + 1] = attend_one(q[i:i + 1], k_cache[slot, :length], v_cache[slot, :length], length - 1, scale)
    return out


def prefill_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          slot_ids: torch.Tensor, start_positions: torch.Tensor,
                          cu_seqlens: torch.Tensor, scale: float) -> torch.Tensor:
    """q [T, Hq, D] (sequences concatenated), caches [slots, max_seq_len, Hkv, D],
    slot_ids/start_positions [B], cu_seqlens [B + 1] -> [T, Hq, D]."""
    return _prefill_per_sequence(_attend_one, q, k_cache, v_cache, slot_ids, start_positions, cu_seqlens, scale)


def decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         slot_ids: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, Hq, D], one token per sequence at position seq_len - 1 -> [B, Hq, D]."""
    return _decode_per_sequence(_attend_one, q, k_cache, v_cache, slot_ids, seq_lens, scale)


def _sdpa_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """As _attend_one, through torch's fused attention: q [n, Hq, D] at positions start..,
    k/v [start + n, Hkv, D] -> [n, Hq, D]. Query row i sees keys 0 .. start + i: every key for a
    single row, the built-in causal mask when start == 0, an explicit mask otherwise."""
    n = q.shape[0]
    mask = None
    if n > 1 and start > 0:
        mask = torch.arange(k.shape[0], device=q.device)[None, :] <= start + torch.arange(n, device=q.device)[:, None]
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         attn_mask=mask, is_causal=n > 1 and start == 0, scale=scale,
                                         enable_gqa=True)
    return out[0].transpose(0, 1)


def prefill_attention_fused(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            slot_ids: torch.Tensor, start_positions: torch.Tensor,
                            cu_seqlens: torch.Tensor, scale: float) -> torch.Tensor:
    """prefill_attention_ref through torch's fused attention, one call per sequence: the torch
    backend's op. One call per sequence keeps every shape the call sees (and so the fused kernel's
    blocking) a function of that sequence alone; it never builds the [heads, n, n] score matrix the
    reference does, which made attention a quarter of a 512-token prefill."""
    return _prefill_per_sequence(_sdpa_one, q, k_cache, v_cache, slot_ids, start_positions, cu_seqlens, scale)


def decode_attention_fused(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           slot_ids: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """decode_attention_ref through torch's fused attention, one call per sequence (one op where
    the reference runs about ten): the torch backend's op."""
    return _decode_per_sequence(_sdpa_one, q, k_cache, v_cache, slot_ids, seq_lens, scale)


# -- Triton kernels ---------------------------------------------------------------------------

# Fixed tile sizes. They never depend on the batch, so a sequence's arithmetic never does either.
DECODE_BLOCK_N = 64  # keys per block in decode; a split is a whole number of these blocks
DECODE_SPLIT_SIZE = 256  # keys per split in decode (fixed size, not a fixed count)
PREFILL_BLOCK_M = 64  # query rows per prefill tile
PREFILL_BLOCK_N = 64  # keys per prefill block


def _dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs must not be rounded to TF32 on GPU; fp16/bf16 inputs use the default."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


@triton.jit
def _softmax_start(ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """Online-softmax state (m, l, acc) of ROWS query rows before their first key block."""
    m = tl.full([ROWS], float("-inf"), tl.float32)
    return m, tl.zeros([ROWS], tl.float32), tl.zeros([ROWS, BLOCK_D], tl.float32)


@triton.jit
def _attend_block(q, k_base, v_base, pos, kv_mask, visible, d, d_mask, stride_kl, stride_kd, stride_vl, stride_vd,
                  scale, m, l, acc, DOT_PRECISION: tl.constexpr):
    """One key block of online softmax for a tile of query rows: returns the updated (m, l, acc).
    `visible` masks (row, key) pairs; a row that sees no key of the block keeps (m, l, acc) bit
    for bit, provided its m is already finite (alpha = exp(0) = 1, p = exp(-inf) = 0)."""
    k = tl.load(k_base + pos[:, None].to(tl.int64) * stride_kl + d[None, :] * stride_kd,
                mask=kv_mask[:, None] & d_mask[None, :], other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.exp(m - m_new)
    p = tl.exp(s - m_new[:, None])
    l = l * alpha + tl.sum(p, 1)
    v = tl.load(v_base + pos[:, None].to(tl.int64) * stride_vl + d[None, :] * stride_vd,
                mask=kv_mask[:, None] & d_mask[None, :], other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l, acc


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


def _check_attention_args(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> int:
    """q [tokens, heads, head_dim] and K/V caches [slots, max_seq_len, kv_heads, head_dim] that agree;
    returns the query heads per key/value head."""
    check_shape("q", q, (None, None, None))
    check_shape("k_cache", k_cache, (None, None, None, q.shape[2]))
    check_shape("v_cache", v_cache, (k_cache.shape[0], k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]))
    check_dtype(q.dtype, k_cache=k_cache, v_cache=v_cache)
    return check_groups(q.shape[1], k_cache.shape[2])


def decode_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
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


@triton.jit
def _prefill_kernel(q_ptr, k_ptr, v_ptr, out_ptr, slot_ptr, start_ptr, cu_ptr, tile_seq_ptr, tile_row_ptr,
                    stride_qt, stride_qh, stride_qd,
                    stride_ks, stride_kl, stride_kh, stride_kd,
                    stride_vs, stride_vl, stride_vh, stride_vd,
                    stride_ot, stride_oh, stride_od, scale,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                    DOT_PRECISION: tl.constexpr):
    """One (query tile of one sequence, query head): rows tile_row .. tile_row + BLOCK_M - 1 of the
    sequence against key blocks [0, BLOCK_N), [BLOCK_N, 2 BLOCK_N), .. up to the tile's last
    position, causal by absolute position, online softmax in fp32."""
    tile = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    seq = tl.load(tile_seq_ptr + tile).to(tl.int64)
    tile_row = tl.load(tile_row_ptr + tile).to(tl.int32)
    first_token = tl.load(cu_ptr + seq).to(tl.int64)
    num_rows = (tl.load(cu_ptr + seq + 1) - first_token).to(tl.int32)
    start = tl.load(start_ptr + seq).to(tl.int32)
    slot = tl.load(slot_ptr + seq).to(tl.int64)
    kv_head = head // GROUP
    rows = tile_row + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    row_mask = (rows >= 0) & (rows < num_rows)
    d_mask = d < HEAD_DIM
    q_pos = start + rows
    last_pos = start + tl.minimum(tile_row + BLOCK_M, num_rows) - 1
    tokens = first_token + rows
    q = tl.load(q_ptr + tokens[:, None] * stride_qt + head * stride_qh + d[None, :] * stride_qd,
                mask=row_mask[:, None] & d_mask[None, :], other=0.0)
    k_base = k_ptr + slot * stride_ks + kv_head * stride_kh
    v_base = v_ptr + slot * stride_vs + kv_head * stride_vh
    m, l, acc = _softmax_start(BLOCK_M, BLOCK_D)
    for block_start in range(0, last_pos + 1, BLOCK_N):
        pos = block_start + offs_n
        kv_mask = pos <= last_pos
        # Key 0 (block 0) is visible to every row, so m is finite after block 0, and a later block
        # that is fully masked for a row leaves that row's (m, l, acc) bit for bit unchanged.
        m, l, acc = _attend_block(q, k_base, v_base, pos, kv_mask, pos[None, :] <= q_pos[:, None], d, d_mask,
                                  stride_kl, stride_kd, stride_vl, stride_vd, scale, m, l, acc, DOT_PRECISION)
    out = acc / l[:, None]
    tl.store(out_ptr + tokens[:, None] * stride_ot + head * stride_oh + d[None, :] * stride_od,
             out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & d_mask[None, :])


def _prefill_tiles(cu_seqlens: torch.Tensor, start_positions: torch.Tensor,
                   block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Query tiles that never straddle two sequences and sit at absolute positions (multiples of
    block_m): (sequence index, first row) per tile, the first row relative to the sequence's first
    new token (negative for a first tile that starts before it)."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    first_abs = start_positions // block_m
    tiles = torch.where(lengths > 0, (start_positions + lengths - 1) // block_m - first_abs + 1, 0)
    num_tiles = int(tiles.sum())
    device = cu_seqlens.device
    tile_seq = torch.repeat_interleave(torch.arange(len(tiles), device=device), tiles, output_size=num_tiles)
    first_tile = torch.cumsum(tiles, 0) - tiles
    tile_abs = torch.arange(num_tiles, device=device) - first_tile[tile_seq] + first_abs[tile_seq]
    tile_row = tile_abs * block_m - start_positions[tile_seq]
    return tile_seq, tile_row


def prefill_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             slot_ids: torch.Tensor, start_positions: torch.Tensor,
                             cu_seqlens: torch.Tensor, scale: float) -> torch.Tensor:
    """Varlen causal prefill attention over slotted caches, same semantics as `prefill_attention_ref`.

    Row invariant by construction: tiles hold rows of one sequence only, query tiles and key blocks
    sit at fixed absolute positions (multiples of BLOCK_M and BLOCK_N from 0), so a row always has
    the same place in its tile (a dot product on the CPU interpreter computes rows differently by
    their place in the tile), and every operation on a row (its row of q.K^T, max, exp, sum, its
    row of p.V) reads only that row. The blocks a tile walks past a row's
    own position are fully masked for it and merge as exact no-ops, so a row's result is the same
    whichever rows share its tile: a sequence alone or in a batch, a prompt in one piece or in two
    over a cached prefix, all give bit-identical rows.
    """
    kernel_device_ok(q)
    group = _check_attention_args(q, k_cache, v_cache)
    num_tokens, num_heads, head_dim = q.shape
    check_shape("slot_ids", slot_ids, (None,))
    check_shape("start_positions", start_positions, (slot_ids.shape[0],))
    check_shape("cu_seqlens", cu_seqlens, (slot_ids.shape[0] + 1,))
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return out
    tile_seq, tile_row = _prefill_tiles(cu_seqlens, start_positions, PREFILL_BLOCK_M)
    _prefill_kernel[(tile_seq.numel(), num_heads)](
        q, k_cache, v_cache, out, slot_ids, start_positions, cu_seqlens, tile_seq, tile_row,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *out.stride(), scale,
        GROUP=group, HEAD_DIM=head_dim,
        BLOCK_M=PREFILL_BLOCK_M, BLOCK_N=PREFILL_BLOCK_N, BLOCK_D=_block_d(head_dim),
        DOT_PRECISION=_dot_precision(q.dtype), num_stages=2)
    return out
