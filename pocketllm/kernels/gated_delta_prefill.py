"""Op `gated_delta_prefill`: the gated delta rule over varlen prompts, in chunked (UT-transform)
form.

Chunks are CHUNK_SIZE positions aligned to absolute positions and always computed at full size
(padded with inert tokens), so a sequence's outputs and final state do not depend on the batch,
and a prompt split at a chunk boundary gives bitwise the same result as in one piece.
`gated_delta_prefill_triton` walks the same chunks, one program per sequence, value head and block
of value columns, updating the state in its slot; each chunk's UT transform is inverted beforehand, every
chunk at once, in blocks of 16 rows.
"""

from typing import Protocol

import torch

from ._cases import GDN, gdn_slot, gdn_tokens, no_shared
from ._gated_delta import (
    CHUNK_SIZE,
    _check_gated_delta_args,
    _prepare,
    check_replay,
    gated_delta_cost,
    gated_delta_recurrent,
    save_replay,
    with_replayed,
)
from ._triton import kernel_device_ok, tl, triton
from ._unit_lower import rows_product, unit_lower_inverse
from .checks import check_shape
from .spec import Call, Layout, OpSpec, Step


class GatedDeltaPrefill(Protocol):
    """q/k [T, Hk, Dk], v [T, Hv, Dv], g (log decay)/beta [T, Hv], states fp32 [slots, Hv, Dk, Dv]
    (updated in place), slot_ids/start_positions [B], cu_seqlens [B + 1], and optionally the
    replay buffers fp32 [slots, CHUNK_SIZE, width] of exact replay (see `_gated_delta`) -> [T, Hv, Dv]."""

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 states: torch.Tensor, slot_ids: torch.Tensor, start_positions: torch.Tensor,
                 cu_seqlens: torch.Tensor, replay: torch.Tensor | None = None) -> torch.Tensor: ...


def _chunk(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
           beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One full chunk for all heads: q/k [H, C, Dk], v [H, C, Dv], g/beta [H, C], state [H, Dk, Dv]
    -> (out [H, C, Dv], new state)."""
    size = q.shape[1]
    upper = torch.ones(size, size, dtype=torch.bool, device=q.device).triu(1)
    cum = g.cumsum(dim=-1)
    decay = (cum[:, :, None] - cum[:, None, :]).masked_fill(upper, float("-inf")).exp()
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * decay  # unit lower triangular once the diagonal is ignored
    new_values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    k_decayed = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * decay
    v_new = new_values - k_decayed @ state
    out = (q * cum.exp()[..., None]) @ state + attn @ v_new
    k_to_end = k * (cum[:, -1:] - cum).exp()[..., None]
    state = state * cum[:, -1].exp()[:, None, None] + k_to_end.transpose(-1, -2) @ v_new
    return out, state


def _full_chunk(x: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Positions lo..hi of x [H, n, ...], zero-padded to CHUNK_SIZE positions."""
    return torch.cat([x[:, lo:hi], x.new_zeros(x.shape[0], CHUNK_SIZE - (hi - lo), *x.shape[2:])], dim=1)


def _prefill_one(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                 beta: torch.Tensor, start: int, partial_state: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence: q/k [H, n, Dk], v [H, n, Dv], g/beta [H, n] at positions start.. -> (out [H, n, Dv],
    state). The state moves past an unfinished last chunk only with `partial_state`."""
    n = q.shape[1]
    outs = []
    lo = 0
    while lo < n:
        hi = min(n, lo + CHUNK_SIZE - (start + lo) % CHUNK_SIZE)  # stop at the next absolute chunk boundary
        q_c, k_c, v_c, g_c, beta_c = (_full_chunk(x, lo, hi) for x in (q, k, v, g, beta))
        out, after = _chunk(state, q_c, k_c, v_c, g_c, beta_c)
        if partial_state or (start + hi) % CHUNK_SIZE == 0:
            state = after
        outs.append(out[:, :hi - lo])
        lo = hi
    return torch.cat(outs, dim=1), state


def gated_delta_prefill_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                            states: torch.Tensor, slot_ids: torch.Tensor, start_positions: torch.Tensor,
                            cu_seqlens: torch.Tensor, replay: torch.Tensor | None = None) -> torch.Tensor:
    """q/k [T, Hk, Dk], v [T, Hv, Dv], g (log decay, <= 0)/beta [T, Hv] (fp32), states [slots, Hv, Dk, Dv]
    fp32 (updated in place) -> out [T, Hv, Dv] in v's dtype. With `replay`, exact replay: each
    piece runs its chunk from the chunk's start, and the replay buffers are updated."""
    if replay is not None:
        check_replay(replay, k, v)
        (q_x, k_x, v_x, g_x, beta_x, starts, cu), piece_rows = with_replayed(
            replay, q, k, v, g, beta, slot_ids, start_positions, cu_seqlens)
        out = _prefill_sequences(q_x, k_x, v_x, g_x, beta_x, states, slot_ids, starts, cu, partial_state=False)
        save_replay(replay, k, v, g, beta, slot_ids, start_positions, cu_seqlens)
        return out[piece_rows]
    return _prefill_sequences(q, k, v, g, beta, states, slot_ids, start_positions, cu_seqlens, partial_state=True)


def _prefill_sequences(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                       states: torch.Tensor, slot_ids: torch.Tensor, start_positions: torch.Tensor,
                       cu_seqlens: torch.Tensor, partial_state: bool) -> torch.Tensor:
    out = torch.empty_like(v)
    bounds = cu_seqlens.tolist()
    num_v_heads = v.shape[1]
    for i, (slot, start) in enumerate(zip(slot_ids.tolist(), start_positions.tolist())):
        lo, hi = bounds[i], bounds[i + 1]
        qh, kh = _prepare(q[lo:hi], k[lo:hi], num_v_heads)
        seq_out, states[slot] = _prefill_one(states[slot], qh, kh, v[lo:hi].float().transpose(0, 1),
                                             g[lo:hi].float().T, beta[lo:hi].float().T, start, partial_state)
        out[lo:hi] = seq_out.transpose(0, 1).to(v.dtype)
    return out


# Value columns and key rows of the state per step, and warps, of a prefill program. The program's
# tiles are [CHUNK, CHUNK] or CHUNK by one of these (tl.dot needs 16 or more); wider steps spill.
PREFILL_BLOCK_DV = 16
PREFILL_BLOCK_DK = 16
PREFILL_NUM_WARPS = 8


@triton.jit
def _load_rows(ptr, rows, row_stride, col_stride, row_mask, cols, DK: tl.constexpr):
    """fp32 [len(rows), len(cols)] of q or k; masked rows and columns past DK are zero."""
    mask = row_mask[:, None] & (cols < DK)[None, :]
    return tl.load(ptr + rows[:, None] * row_stride + cols[None, :].to(tl.int64) * col_stride, mask=mask,
                   other=0.0).to(tl.float32)


@triton.jit
def _load_state_rows(state_head, rows, s_sk, dv_mask, DK: tl.constexpr):
    """fp32 [len(rows), BLOCK_DV] of the slot's state (key rows `rows`); rows past DK are zero."""
    return tl.load(state_head + rows[:, None].to(tl.int64) * s_sk, mask=(rows < DK)[:, None] & dv_mask[None, :],
                   other=0.0)


@triton.jit
def _sequence(cu_ptr, starts_ptr, seq, CHUNK: tl.constexpr):
    """(first token row, length, start position, chunks spanned) of sequence seq, its chunks aligned
    to absolute positions (the launcher counts them the same way for the inverses' buffer)."""
    lo = tl.load(cu_ptr + seq).to(tl.int64)
    length = tl.load(cu_ptr + seq + 1).to(tl.int64) - lo
    start = tl.load(starts_ptr + seq).to(tl.int64)
    return lo, length, start, tl.where(length > 0, (start + length - 1) // CHUNK - start // CHUNK + 1, 0)


@triton.jit
def _chunk_tokens(lo, length, start, c, CHUNK: tl.constexpr):
    """(token rows, valid) of the sequence's chunk c: row r is absolute position
    (start // CHUNK + c) * CHUNK + r; rows outside the sequence are masked (they load as inert zeros:
    g = 0 keeps the decay, k = beta = 0 adds nothing)."""
    offset = (start // CHUNK + c) * CHUNK + tl.arange(0, CHUNK) - start
    valid = (offset >= 0) & (offset < length)
    return lo + tl.where(valid, offset, 0), valid


@triton.jit
def _inverse_norms(head, tok, st, sd, valid, DK: tl.constexpr, BLOCK_DK: tl.constexpr):
    """1 / |row| (eps 1e-6) of q or k's rows, the squares summed BLOCK_DK columns at a time."""
    dk = tl.arange(0, BLOCK_DK)
    sq = tl.zeros([tok.shape[0]], dtype=tl.float32)
    for d0 in range(0, DK, BLOCK_DK):
        x = _load_rows(head, tok, st, sd, valid, d0 + dk, DK)
        sq += tl.sum(x * x, axis=1)
    return tl.rsqrt(sq + 1e-6)


@triton.jit
def _ut_inverse_kernel(k_ptr, g_ptr, beta_ptr, starts_ptr, cu_ptr, base_ptr, inv_ptr, k_st, k_sh, k_sd, g_st, g_sh,
                       b_st, b_sh, i_sc, i_sh, GROUP: tl.constexpr, DK: tl.constexpr, CHUNK: tl.constexpr,
                       BLOCK_DK: tl.constexpr):
    """Program (i, h, c): T = (I + L)^-1 of sequence i's chunk c and value head h into
    inv[base[i] + c, h], L the strictly lower part of (beta k k^T) * decay. T depends on no state,
    so every chunk's is formed at once, before the prefill kernel walks the chunks in order."""
    seq = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    c = tl.program_id(2)
    lo, length, start, num_chunks = _sequence(cu_ptr, starts_ptr, seq, CHUNK)
    if c < num_chunks:
        k_head = k_ptr + (h // GROUP) * k_sh
        tok, valid = _chunk_tokens(lo, length, start, c, CHUNK)
        r = tl.arange(0, CHUNK)
        g = tl.load(g_ptr + tok * g_st + h * g_sh, mask=valid, other=0.0).to(tl.float32)
        beta = tl.load(beta_ptr + tok * b_st + h * b_sh, mask=valid, other=0.0).to(tl.float32)
        cum = tl.sum(tl.where(r[:, None] >= r[None, :], g[None, :], 0.0), axis=1)  # inclusive prefix sums of g
        k_scale = _inverse_norms(k_head, tok, k_st, k_sd, valid, DK, BLOCK_DK)
        dk = tl.arange(0, BLOCK_DK)
        gram = tl.zeros([CHUNK, CHUNK], dtype=tl.float32)
        for d0 in range(0, DK, BLOCK_DK):
            k = _load_rows(k_head, tok, k_st, k_sd, valid, d0 + dk, DK) * k_scale[:, None]
            gram += tl.dot(k, tl.trans(k), input_precision="ieee")
        below = r[:, None] > r[None, :]
        lower = tl.where(below, gram * beta[:, None] * tl.exp(tl.where(below, cum[:, None] - cum[None, :], 0.0)),
                         0.0)
        base = tl.load(base_ptr + seq).to(tl.int64)
        tl.store(inv_ptr + (base + c) * i_sc + h * i_sh + r[:, None] * CHUNK + r[None, :],
                 unit_lower_inverse(lower, CHUNK))


@triton.jit
def _gated_delta_prefill_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, states_ptr, slots_ptr, starts_ptr, cu_ptr,
                                base_ptr, inv_ptr, out_ptr, q_st, q_sh, q_sd, k_st, k_sh, k_sd, v_st, v_sh, v_sd,
                                g_st, g_sh, b_st, b_sh, s_ss, s_sh, s_sk, s_sv, i_sc, i_sh, o_st, o_sh, o_sd, scale,
                                GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, CHUNK: tl.constexpr,
                                BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, COMPLETE_ONLY: tl.constexpr):
    """Program (i, h, j): sequence i, value head h, value columns [j * BLOCK_DV, (j + 1) * BLOCK_DV),
    walking the sequence's chunks (aligned to absolute positions) in order.

    The state tile [Dk, BLOCK_DV] stays in the slot (fp32, in place) and is read and written
    BLOCK_DK rows at a time, as are q and k (BLOCK_DK columns at a time), so no tile is Dk wide:
    an fp32 dot holds its operands' whole rows per thread, and [CHUNK, Dk] operands with the
    state in registers spilled kilobytes per thread at Dk = 128. The UT transform's inverse T of
    each chunk comes from `_ut_inverse_kernel` (formed once, not once per block of value columns,
    and its solve's registers are not this program's). All loop trip counts are fixed by Dk and
    CHUNK, so every chunk runs the same arithmetic. With COMPLETE_ONLY (exact replay) the state is
    written only after a complete chunk."""
    seq = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    q_head = q_ptr + (h // GROUP) * q_sh
    k_head = k_ptr + (h // GROUP) * k_sh
    lo, length, start, num_chunks = _sequence(cu_ptr, starts_ptr, seq, CHUNK)
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    inv_head = inv_ptr + tl.load(base_ptr + seq).to(tl.int64) * i_sc + h * i_sh

    dk = tl.arange(0, BLOCK_DK)
    dv = tl.program_id(2) * BLOCK_DV + tl.arange(0, BLOCK_DV)
    dv_mask = dv < DV
    state_head = states_ptr + slot * s_ss + h * s_sh + dv[None, :].to(tl.int64) * s_sv

    r = tl.arange(0, CHUNK)
    causal = r[:, None] >= r[None, :]
    first_chunk = start // CHUNK
    for c in range(num_chunks):
        tok, valid = _chunk_tokens(lo, length, start, c, CHUNK)
        v = tl.load(v_ptr + tok[:, None] * v_st + h * v_sh + dv[None, :].to(tl.int64) * v_sd,
                    mask=valid[:, None] & dv_mask[None, :], other=0.0).to(tl.float32)
        g = tl.load(g_ptr + tok * g_st + h * g_sh, mask=valid, other=0.0).to(tl.float32)
        beta = tl.load(beta_ptr + tok * b_st + h * b_sh, mask=valid, other=0.0).to(tl.float32)
        cum = tl.sum(tl.where(causal, g[None, :], 0.0), axis=1)  # inclusive prefix sums of g
        cum_last = tl.sum(tl.where(r == CHUNK - 1, cum, 0.0), axis=0)
        # q and k rows are L2-normalised (eps 1e-6), their squared norms summed first.
        q_scale = _inverse_norms(q_head, tok, q_st, q_sd, valid, DK, BLOCK_DK) * scale
        k_scale = _inverse_norms(k_head, tok, k_st, k_sd, valid, DK, BLOCK_DK)

        # v_new = T (beta v) - T (beta k exp(cum)) S = T (beta (v - exp(cum) k S)), k S over
        # BLOCK_DK-wide steps.
        k_state = tl.zeros([CHUNK, BLOCK_DV], dtype=tl.float32)
        for d0 in range(0, DK, BLOCK_DK):
            k = _load_rows(k_head, tok, k_st, k_sd, valid, d0 + dk, DK) * k_scale[:, None]
            k_state += tl.dot(k, _load_state_rows(state_head, d0 + dk, s_sk, dv_mask, DK), input_precision="ieee")
        ut_inverse = tl.load(inv_head + c * i_sc + r[:, None] * CHUNK + r[None, :])
        v_new = rows_product(ut_inverse, beta[:, None] * (v - tl.exp(cum)[:, None] * k_state), CHUNK, BLOCK_DV)

        # out = exp(cum) q S + (q k^T * decay) v_new, q k^T and q S over BLOCK_DK-wide steps.
        scores = tl.zeros([CHUNK, CHUNK], dtype=tl.float32)
        q_state = tl.zeros([CHUNK, BLOCK_DV], dtype=tl.float32)
        for d0 in range(0, DK, BLOCK_DK):
            q = _load_rows(q_head, tok, q_st, q_sd, valid, d0 + dk, DK) * q_scale[:, None]
            k = _load_rows(k_head, tok, k_st, k_sd, valid, d0 + dk, DK) * k_scale[:, None]
            scores += tl.dot(q, tl.trans(k), input_precision="ieee")
        for d0 in range(0, DK, BLOCK_DK):
            q = _load_rows(q_head, tok, q_st, q_sd, valid, d0 + dk, DK) * q_scale[:, None]
            q_state += tl.dot(q, _load_state_rows(state_head, d0 + dk, s_sk, dv_mask, DK), input_precision="ieee")
        decay = tl.exp(tl.where(causal, cum[:, None] - cum[None, :], float("-inf")))
        out = tl.exp(cum)[:, None] * q_state + rows_product(scores * decay, v_new, CHUNK, BLOCK_DV)
        tl.store(out_ptr + tok[:, None] * o_st + h * o_sh + dv[None, :].to(tl.int64) * o_sd,
                 out.to(out_ptr.dtype.element_ty), mask=valid[:, None] & dv_mask[None, :])

        # S <- exp(cum_last) S + (k exp(cum_last - cum))^T v_new. The barriers order this program's
        # threads' reads and writes of the slot (the state is spread over them differently).
        tl.debug_barrier()
        rows_written = DK
        if COMPLETE_ONLY:  # an unfinished chunk leaves the state at its start: no row written
            rows_written = tl.where((first_chunk + c + 1) * CHUNK - start <= length, DK, 0)
        v_groups = tl.reshape(v_new, [CHUNK // 16, 16, BLOCK_DV])
        for d0 in range(0, DK, BLOCK_DK):
            rows = d0 + dk
            mask = (rows < rows_written)[:, None] & dv_mask[None, :]
            tile = state_head + rows[:, None].to(tl.int64) * s_sk
            k = _load_rows(k_head, tok, k_st, k_sd, valid, rows, DK) * (k_scale * tl.exp(cum_last - cum))[:, None]
            state = tl.load(tile, mask=mask, other=0.0) * tl.exp(cum_last)
            k_groups = tl.permute(tl.reshape(tl.trans(k), [BLOCK_DK, CHUNK // 16, 16]), [1, 0, 2])
            tl.store(tile, state + tl.sum(tl.dot(k_groups, v_groups, input_precision="ieee"), axis=0), mask=mask)
        tl.debug_barrier()


def gated_delta_prefill_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, states: torch.Tensor, slot_ids: torch.Tensor,
                               start_positions: torch.Tensor, cu_seqlens: torch.Tensor,
                               replay: torch.Tensor | None = None) -> torch.Tensor:
    """`gated_delta_prefill_ref` in one launch: grid (sequences, Hv, Dv blocks of PREFILL_BLOCK_DV).

    Invariant by construction: program (i, h, j) reads only sequence i's tokens and its slot's
    [Dk, BLOCK_DV] state tile, and walks the sequence's chunks in order. Every chunk is a full
    CHUNK_SIZE-row tile of absolute positions (rows outside the sequence masked to inert zeros)
    computed with the same fixed-shape arithmetic, and the state between chunks is held in fp32
    in the slot (split prompt or not). So a sequence's result does not depend on the
    batch, and a prompt split at a multiple of CHUNK_SIZE runs exactly the same chunk computations.
    With `replay` (exact replay) a prompt cut anywhere, or decoded, does too: each sequence is
    preceded by its chunk's replayed rows, so the kernel computes that chunk in full from its start,
    and the state moves only at complete chunks.
    """
    kernel_device_ok(q)
    group = _check_gated_delta_args(q, k, v, g, beta, states)
    check_shape("slot_ids", slot_ids, (None,))
    batch = slot_ids.shape[0]
    check_shape("start_positions", start_positions, (batch,))
    check_shape("cu_seqlens", cu_seqlens, (batch + 1,))
    if replay is not None:
        check_replay(replay, k, v)
        (q_x, k_x, v_x, g_x, beta_x, starts, cu), piece_rows = with_replayed(
            replay, q, k, v, g, beta, slot_ids, start_positions, cu_seqlens)
        out = _launch(q_x, k_x, v_x, g_x, beta_x, states, slot_ids, starts, cu, group, complete_only=True)
        save_replay(replay, k, v, g, beta, slot_ids, start_positions, cu_seqlens)
        return out[piece_rows]
    return _launch(q, k, v, g, beta, states, slot_ids, start_positions, cu_seqlens, group, complete_only=False)


def _launch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
            states: torch.Tensor, slot_ids: torch.Tensor, start_positions: torch.Tensor, cu_seqlens: torch.Tensor,
            group: int, complete_only: bool) -> torch.Tensor:
    """The chunks' UT inverses, then the walk along each sequence, over the sequences as given."""
    dim_k, num_v_heads, dim_v = q.shape[2], v.shape[1], v.shape[2]
    batch, tokens = slot_ids.shape[0], v.shape[0]
    out = torch.empty_like(v)
    if batch == 0 or tokens == 0:
        return out
    # Sequence i's chunks sit at base[i].. of the inverses; a sequence of n tokens spans at most
    # n // CHUNK + 2 chunks, so the batch's chunks are bounded without reading the lengths back.
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    counts = torch.where(lengths > 0, (start_positions + lengths - 1) // CHUNK_SIZE
                         - start_positions // CHUNK_SIZE + 1, 0)
    base = torch.cumsum(counts, 0) - counts
    max_chunks = tokens // CHUNK_SIZE + 2
    inverses = torch.empty(tokens // CHUNK_SIZE + 2 * batch, num_v_heads, CHUNK_SIZE, CHUNK_SIZE,
                           dtype=torch.float32, device=v.device)
    block_dk = min(max(triton.next_power_of_2(dim_k), 16), PREFILL_BLOCK_DK)
    _ut_inverse_kernel[(batch, num_v_heads, max_chunks)](
        k, g, beta, start_positions, cu_seqlens, base, inverses, *k.stride(), *g.stride(), *beta.stride(),
        *inverses.stride()[:2], GROUP=group, DK=dim_k, CHUNK=CHUNK_SIZE, BLOCK_DK=block_dk,
        num_warps=PREFILL_NUM_WARPS)
    block_dv = min(max(triton.next_power_of_2(dim_v), 16), PREFILL_BLOCK_DV)
    grid = (batch, num_v_heads, triton.cdiv(dim_v, block_dv))
    _gated_delta_prefill_kernel[grid](
        q, k, v, g, beta, states, slot_ids, start_positions, cu_seqlens, base, inverses, out, *q.stride(),
        *k.stride(), *v.stride(), *g.stride(), *beta.stride(), *states.stride(), *inverses.stride()[:2],
        *out.stride(), dim_k ** -0.5, GROUP=group, DK=dim_k, DV=dim_v, CHUNK=CHUNK_SIZE, BLOCK_DK=block_dk,
        BLOCK_DV=block_dv, COMPLETE_ONLY=complete_only, num_warps=PREFILL_NUM_WARPS)
    return out


def gated_delta_prefill_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                  beta: torch.Tensor, states: torch.Tensor, slot_ids: torch.Tensor,
                                  start_positions: torch.Tensor, cu_seqlens: torch.Tensor,
                                  replay: torch.Tensor | None = None) -> torch.Tensor:
    """The token-by-token recurrence of `_gated_delta.gated_delta_recurrent` (C++, CPU): the same
    function as `gated_delta_decode_recurrent`, so exact along the sequence with no replay buffer."""
    if replay is not None:
        raise ValueError("the recurrent gated delta rule keeps no replay buffers: replay must be None")
    return gated_delta_recurrent(q, k, v, g, beta, states, slot_ids, cu_seqlens)


def needs_replay(implementation: object) -> bool:
    """Whether an implementation of this op gives a position the same bits in any piece only with
    replay buffers: the chunked ones (and any unknown one); not the recurrent one."""
    return implementation is not gated_delta_prefill_recurrent


def _launches(step: Step) -> list[Call]:
    """Prefill pieces, plain and with exact replay; decode steps too with exact replay (exact
    positions run them through this op)."""
    batch = step.batch
    if not step.linear_attention:
        return []
    replayed = Call(f"{step.name}, exact replay", lambda: (*step.gated_delta_args(), batch.slot_ids,
                                                           batch.start_positions, batch.cu_seqlens,
                                                           step.replay_buffers()))
    if batch.is_decode:
        return [replayed]
    return [Call(step.name, lambda: (*step.gated_delta_args(), batch.slot_ids, batch.start_positions,
                                     batch.cu_seqlens)), replayed]


OP = OpSpec("gated_delta_prefill", GatedDeltaPrefill,
            {"ref": gated_delta_prefill_ref, "triton": gated_delta_prefill_triton,
             "recurrent": gated_delta_prefill_recurrent}, order=110,
            cases=Layout(gdn_tokens, gdn_slot, no_shared,
                         [(dims, seqs) for dims in GDN
                          for seqs in ([(1, 0)], [(5, 0), (70, 3), (1, 64)], [(130, 0), (63, 1)])], splittable=True),
            launches=_launches, cost=gated_delta_cost)
