"""Op `prefill_attention`: causal grouped-query attention of varlen prompts over slotted K/V.

Queries of several sequences are concatenated (cu_seqlens); each sequence's rows sit at absolute
positions start .. start + n - 1 of its slot, whose cache holds K/V for [0, start + n) by now.
- `prefill_attention_ref`: the reference, one sequence at a time, fp32 scores.
- `prefill_attention_fused`: the same through torch's fused attention, one call per sequence
  (what the torch backend runs).
- `prefill_attention_triton`: the Triton kernel, batch invariant by construction.
"""

from typing import Protocol

import torch

from ._attention import (
    _attend_block,
    _attend_one,
    _block_d,
    _check_attention_args,
    _dot_precision,
    _prefill_per_sequence,
    _sdpa_one,
    _softmax_start,
    attention_rows_cpu,
    kv_bytes,
)
from ._cases import attention_layout
from ._triton import kernel_device_ok, tl, triton
from .checks import check_shape
from .spec import Call, Cost, OpSpec, Step, size


class PrefillAttention(Protocol):
    """q [T, Hq, D] (sequences concatenated), caches [slots, max_seq_len, Hkv, D], slot_ids and
    start_positions [B], cu_seqlens [B + 1] -> [T, Hq, D]."""

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_ids: torch.Tensor,
                 start_positions: torch.Tensor, cu_seqlens: torch.Tensor, scale: float) -> torch.Tensor: ...


def prefill_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          slot_ids: torch.Tensor, start_positions: torch.Tensor,
                          cu_seqlens: torch.Tensor, scale: float) -> torch.Tensor:
    """q [T, Hq, D] (sequences concatenated), caches [slots, max_seq_len, Hkv, D],
    slot_ids/start_positions [B], cu_seqlens [B + 1] -> [T, Hq, D]."""
    return _prefill_per_sequence(_attend_one, q, k_cache, v_cache, slot_ids, start_positions, cu_seqlens, scale)


def prefill_attention_fused(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            slot_ids: torch.Tensor, start_positions: torch.Tensor,
                            cu_seqlens: torch.Tensor, scale: float) -> torch.Tensor:
    """prefill_attention_ref through torch's fused attention, one call per sequence: the torch
    backend's op. One call per sequence keeps every shape the call sees (and so the fused kernel's
    blocking) a function of that sequence alone; it never builds the [heads, n, n] score matrix the
    reference does, which dominates a long prefill."""
    return _prefill_per_sequence(_sdpa_one, q, k_cache, v_cache, slot_ids, start_positions, cu_seqlens, scale)


def prefill_attention_per_row(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              slot_ids: torch.Tensor, start_positions: torch.Tensor,
                              cu_seqlens: torch.Tensor, scale: float) -> torch.Tensor:
    """Every row as the torch backend decodes it (`decode_attention_fused`: torch's fused attention
    on one query row over keys 0 .. its position), so a position's bits are the same decoded, in a
    prefill piece of any length or cut, or scored: the torch backend's op with `exact_positions`.
    One call per row instead of one per sequence (what that costs: the measured tables of
    docs/measurements.md)."""
    return _prefill_per_sequence(_sdpa_rows, q, k_cache, v_cache, slot_ids, start_positions, cu_seqlens, scale)


def prefill_attention_own_order(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                slot_ids: torch.Tensor, start_positions: torch.Tensor,
                                cu_seqlens: torch.Tensor, scale: float) -> torch.Tensor:
    """Every row through the C++ kernel `decode_attention_own_order` runs (`_attention.attention_rows_cpu`):
    exact positions on the torch backend at a fraction of `per_row`'s cost; `per_row` where it does not apply."""
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    seq = torch.repeat_interleave(torch.arange(lengths.shape[0], device=q.device), lengths, output_size=q.shape[0])
    positions = start_positions[seq] + torch.arange(q.shape[0], device=q.device) - cu_seqlens[:-1][seq]
    out = attention_rows_cpu(q, k_cache, v_cache, slot_ids[seq], positions, scale)
    if out is None:
        return prefill_attention_per_row(q, k_cache, v_cache, slot_ids, start_positions, cu_seqlens, scale)
    return out


def _sdpa_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """`_sdpa_one` on each row alone, row i over keys 0 .. start + i, as a decode step calls it."""
    return torch.cat([_sdpa_one(q[i:i + 1], k[:start + i + 1], v[:start + i + 1], start + i, scale)
                      for i in range(q.shape[0])])


PREFILL_BLOCK_M = 64  # query rows per prefill tile

# BLOCK_D -> (BLOCK_N keys per block, num_warps), num_stages 2 throughout: fixed per head dim, never
# chosen by the batch. Sized with `pocketllm lab compile` so that no launch spills registers on
# sm_80 or sm_90: the wider head dims take half the key block and twice the warps of d64.
PREFILL_TILES = {64: (64, 4), 128: (32, 8), 256: (32, 8)}


def _prefill_tile(block_d: int) -> tuple[int, int]:
    """(BLOCK_N, num_warps) for a BLOCK_D; head dims under 64 use the d64 entry, over 256 the d256 one."""
    return PREFILL_TILES[min(max(block_d, 64), 256)]


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
    block_d = _block_d(head_dim)
    block_n, num_warps = _prefill_tile(block_d)
    _prefill_kernel[(tile_seq.numel(), num_heads)](
        q, k_cache, v_cache, out, slot_ids, start_positions, cu_seqlens, tile_seq, tile_row,
        *q.stride(), *k_cache.stride(), *v_cache.stride(), *out.stride(), scale,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_M=PREFILL_BLOCK_M, BLOCK_N=block_n, BLOCK_D=block_d,
        DOT_PRECISION=_dot_precision(q.dtype), num_warps=num_warps, num_stages=2)
    return out


# -- declaration -------------------------------------------------------------------------------------


def _launches(step: Step) -> list[Call]:
    cfg, batch = step.cfg, step.batch
    if batch.is_decode:
        return []
    return [Call(step.name, lambda: (step.tensor(step.tokens, cfg.num_attention_heads, cfg.head_dim),
                                     step.kv_cache(), step.kv_cache(), batch.slot_ids, batch.start_positions,
                                     batch.cu_seqlens, cfg.head_dim ** -0.5))]


def _cost(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_ids: torch.Tensor,
          start_positions: torch.Tensor, cu_seqlens: torch.Tensor, scale: float) -> Cost:
    """Reads q and each sequence's K and V up to its last new token, writes q's shape. Causal: the
    row at position p sees p + 1 keys, so n rows after s cached see n·s + n(n+1)/2 keys in all;
    4·heads·D FLOPs a key seen."""
    starts, lengths = start_positions.tolist(), (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    positions = sum(s + n for s, n in zip(starts, lengths))
    seen = sum(n * s + n * (n + 1) // 2 for s, n in zip(starts, lengths))
    heads, d = q.shape[1], q.shape[2]
    indices = size(slot_ids, start_positions, cu_seqlens)
    return Cost(2 * size(q) + kv_bytes(k_cache, positions) + indices, 4 * heads * d * seen)


OP = OpSpec("prefill_attention", PrefillAttention,
            {"ref": prefill_attention_ref, "fused": prefill_attention_fused, "per_row": prefill_attention_per_row,
             "own_order": prefill_attention_own_order, "triton": prefill_attention_triton},
            order=30, cases=attention_layout(160, [[(1, 0)], [(5, 0), (70, 0), (1, 9)], [(3, 64), (66, 64), (130, 0)]],
                                             splittable=True),
            launches=_launches, cost=_cost)
