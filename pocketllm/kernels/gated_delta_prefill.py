"""Op `gated_delta_prefill`: the gated delta rule over varlen prompts, in chunked (UT-transform)
form.

Chunks are CHUNK_SIZE positions aligned to absolute positions and always computed at full size
(padded with inert tokens), so a sequence's outputs and final state do not depend on the batch,
and a prompt split at a chunk boundary gives bitwise the same result as in one piece.
`gated_delta_prefill_triton` walks the same chunks, one program per sequence, value head and block
of value columns, its UT transform solved by forward substitution in registers.
"""

from typing import Protocol

import torch

from ._gated_delta import CHUNK_SIZE, _check_gated_delta_args, _load_unit_rows, _prepare
from ._triton import kernel_device_ok, tl, triton
from .checks import check_shape


class GatedDeltaPrefill(Protocol):
    """q/k [T, Hk, Dk], v [T, Hv, Dv], g (log decay)/beta [T, Hv], states fp32 [slots, Hv, Dk, Dv]
    (updated in place), slot_ids/start_positions [B], cu_seqlens [B + 1] -> [T, Hv, Dv]."""

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 states: torch.Tensor, slot_ids: torch.Tensor, start_positions: torch.Tensor,
                 cu_seqlens: torch.Tensor) -> torch.Tensor: ...


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
                 beta: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence: q/k [H, n, Dk], v [H, n, Dv], g/beta [H, n] at positions start.. -> (out [H, n, Dv], state)."""
    n = q.shape[1]
    outs = []
    lo = 0
    while lo < n:
        hi = min(n, lo + CHUNK_SIZE - (start + lo) % CHUNK_SIZE)  # stop at the next absolute chunk boundary
        q_c, k_c, v_c, g_c, beta_c = (_full_chunk(x, lo, hi) for x in (q, k, v, g, beta))
        out, state = _chunk(state, q_c, k_c, v_c, g_c, beta_c)
        outs.append(out[:, :hi - lo])
        lo = hi
    return torch.cat(outs, dim=1), state


def gated_delta_prefill_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                            states: torch.Tensor, slot_ids: torch.Tensor, start_positions: torch.Tensor,
                            cu_seqlens: torch.Tensor) -> torch.Tensor:
    """q/k [T, Hk, Dk], v [T, Hv, Dv], g (log decay, <= 0)/beta [T, Hv] (fp32), states [slots, Hv, Dk, Dv]
    fp32 (updated in place) -> out [T, Hv, Dv] in v's dtype."""
    out = torch.empty_like(v)
    bounds = cu_seqlens.tolist()
    num_v_heads = v.shape[1]
    for i, (slot, start) in enumerate(zip(slot_ids.tolist(), start_positions.tolist())):
        lo, hi = bounds[i], bounds[i + 1]
        qh, kh = _prepare(q[lo:hi], k[lo:hi], num_v_heads)
        seq_out, states[slot] = _prefill_one(states[slot], qh, kh, v[lo:hi].float().transpose(0, 1),
                                             g[lo:hi].float().T, beta[lo:hi].float().T, start)
        out[lo:hi] = seq_out.transpose(0, 1).to(v.dtype)
    return out


PREFILL_BLOCK_DV = 32  # value columns per prefill program (capped by Dv)


PREFILL_NUM_WARPS = 8  # the prefill program holds several [64, Dk] fp32 tiles at once


@triton.jit
def _gated_delta_prefill_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, states_ptr, slots_ptr, starts_ptr, cu_ptr,
                                out_ptr, q_st, q_sh, q_sd, k_st, k_sh, k_sd, v_st, v_sh, v_sd, g_st, g_sh,
                                b_st, b_sh, s_ss, s_sh, s_sk, s_sv, o_st, o_sh, o_sd, scale,
                                GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, CHUNK: tl.constexpr,
                                BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr):
    """Program (i, h, j): sequence i, value head h, value columns [j * BLOCK_DV, (j + 1) * BLOCK_DV),
    walking the sequence's chunks (aligned to absolute positions) in order with the state in registers."""
    seq = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    kh = h // GROUP
    lo = tl.load(cu_ptr + seq).to(tl.int64)
    length = tl.load(cu_ptr + seq + 1).to(tl.int64) - lo
    start = tl.load(starts_ptr + seq).to(tl.int64)
    slot = tl.load(slots_ptr + seq).to(tl.int64)

    dk = tl.arange(0, BLOCK_DK)
    dv = tl.program_id(2) * BLOCK_DV + tl.arange(0, BLOCK_DV)
    dv_mask = dv < DV
    state_mask = (dk < DK)[:, None] & dv_mask[None, :]
    tile = (states_ptr + slot * s_ss + h * s_sh + dk[:, None].to(tl.int64) * s_sk
            + dv[None, :].to(tl.int64) * s_sv)
    state = tl.load(tile, mask=state_mask, other=0.0)

    r = tl.arange(0, CHUNK)
    causal = r[:, None] >= r[None, :]
    eye = (r[:, None] == r[None, :]).to(tl.float32)
    first_chunk = start // CHUNK
    num_chunks = tl.where(length > 0, (start + length - 1) // CHUNK - first_chunk + 1, 0)
    for c in range(num_chunks):
        # Row r of the tile is absolute position (first_chunk + c) * CHUNK + r; rows outside the
        # sequence are zero (inert: g = 0 keeps the decay, k = beta = 0 adds nothing).
        offset = (first_chunk + c) * CHUNK + r - start
        valid = (offset >= 0) & (offset < length)
        tok = lo + tl.where(valid, offset, 0)
        q = _load_unit_rows(q_ptr + kh * q_sh, tok, q_st, q_sd, valid, DK, BLOCK_DK) * scale
        k = _load_unit_rows(k_ptr + kh * k_sh, tok, k_st, k_sd, valid, DK, BLOCK_DK)
        v = tl.load(v_ptr + tok[:, None] * v_st + h * v_sh + dv[None, :].to(tl.int64) * v_sd,
                    mask=valid[:, None] & dv_mask[None, :], other=0.0).to(tl.float32)
        g = tl.load(g_ptr + tok * g_st + h * g_sh, mask=valid, other=0.0).to(tl.float32)
        beta = tl.load(beta_ptr + tok * b_st + h * b_sh, mask=valid, other=0.0).to(tl.float32)

        cum = tl.sum(tl.where(causal, g[None, :], 0.0), axis=1)  # inclusive prefix sums of g
        cum_last = tl.sum(tl.where(r == CHUNK - 1, cum, 0.0), axis=0)
        decay = tl.exp(tl.where(causal, cum[:, None] - cum[None, :], float("-inf")))
        k_beta = k * beta[:, None]
        # T = (I + L)^-1 with L the strictly lower part of (k_beta k^T) * decay, by forward
        # substitution: row i of T is e_i - sum_{j < i} L[i, j] T[j].
        lower = tl.where(r[:, None] > r[None, :],
                         tl.dot(k_beta, tl.trans(k), input_precision="ieee") * decay, 0.0)
        solve = eye
        for i in range(1, CHUNK):
            l_row = tl.sum(tl.where(r[:, None] == i, lower, 0.0), axis=0)
            new_row = tl.where(r == i, 1.0, 0.0) - tl.sum(l_row[:, None] * solve, axis=0)
            solve = tl.where(r[:, None] == i, new_row[None, :], solve)
        new_values = tl.dot(solve, v * beta[:, None], input_precision="ieee")
        k_decayed = tl.dot(solve, k_beta * tl.exp(cum)[:, None], input_precision="ieee")
        v_new = new_values - tl.dot(k_decayed, state, input_precision="ieee")
        attn = tl.dot(q, tl.trans(k), input_precision="ieee") * decay
        out = (tl.dot(q * tl.exp(cum)[:, None], state, input_precision="ieee")
               + tl.dot(attn, v_new, input_precision="ieee"))
        tl.store(out_ptr + tok[:, None] * o_st + h * o_sh + dv[None, :].to(tl.int64) * o_sd,
                 out.to(out_ptr.dtype.element_ty), mask=valid[:, None] & dv_mask[None, :])
        k_to_end = k * tl.exp(cum_last - cum)[:, None]
        state = state * tl.exp(cum_last) + tl.dot(tl.trans(k_to_end), v_new, input_precision="ieee")
    tl.store(tile, state, mask=state_mask)


def gated_delta_prefill_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                               beta: torch.Tensor, states: torch.Tensor, slot_ids: torch.Tensor,
                               start_positions: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """`gated_delta_prefill_ref` in one launch: grid (sequences, Hv, Dv blocks of PREFILL_BLOCK_DV).

    Invariant by construction: program (i, h, j) reads only sequence i's tokens and its slot's
    [Dk, BLOCK_DV] state tile, and walks the sequence's chunks in order. Every chunk is a full
    CHUNK_SIZE-row tile of absolute positions (rows outside the sequence masked to inert zeros)
    computed with the same fixed-shape arithmetic, and the state between chunks is held in fp32
    (registers, or the slot when a prompt is split). So a sequence's result does not depend on the
    batch, and a prompt split at a multiple of CHUNK_SIZE runs exactly the same chunk computations.
    """
    kernel_device_ok(q)
    group = _check_gated_delta_args(q, k, v, g, beta, states)
    dim_k, num_v_heads, dim_v = q.shape[2], v.shape[1], v.shape[2]
    check_shape("slot_ids", slot_ids, (None,))
    batch = slot_ids.shape[0]
    check_shape("start_positions", start_positions, (batch,))
    check_shape("cu_seqlens", cu_seqlens, (batch + 1,))
    out = torch.empty_like(v)
    if batch == 0 or v.shape[0] == 0:
        return out
    block_dv = min(max(triton.next_power_of_2(dim_v), 16), PREFILL_BLOCK_DV)
    grid = (batch, num_v_heads, triton.cdiv(dim_v, block_dv))
    _gated_delta_prefill_kernel[grid](
        q, k, v, g, beta, states, slot_ids, start_positions, cu_seqlens, out, *q.stride(), *k.stride(),
        *v.stride(), *g.stride(), *beta.stride(), *states.stride(), *out.stride(), dim_k ** -0.5,
        GROUP=group, DK=dim_k, DV=dim_v, CHUNK=CHUNK_SIZE,
        BLOCK_DK=max(triton.next_power_of_2(dim_k), 16), BLOCK_DV=block_dv, num_warps=PREFILL_NUM_WARPS)
    return out

