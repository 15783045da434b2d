"""Op `conv1d_prefill`: the causal conv1d (+ SiLU) over the tokens of varlen prompts, reading
each slot's conv state before the first token and leaving the last K - 1 inputs in it."""

from typing import Protocol

import torch

from ._cases import conv_shared, conv_slot, rows
from ._conv1d import BLOCK_C_STATE, _check_conv_args, _conv_window, conv1d_cost
from ._triton import kernel_device_ok, tl, triton
from .spec import Call, Layout, OpSpec, Step


class Conv1dPrefill(Protocol):
    """x [T, C] (sequences concatenated), weight [C, K], conv_states [slots, C, K - 1] (updated in
    place), slot_ids [B], cu_seqlens [B + 1] -> [T, C] in x's dtype."""

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, conv_states: torch.Tensor, slot_ids: torch.Tensor,
                 cu_seqlens: torch.Tensor) -> torch.Tensor: ...


def conv1d_prefill_ref(x: torch.Tensor, weight: torch.Tensor, conv_states: torch.Tensor,
                              slot_ids: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """x [T, C] (sequences concatenated), weight [C, K], conv_states [slots, C, K - 1] (updated in
    place to each sequence's last K - 1 inputs) -> [T, C] in x's dtype."""
    out = torch.empty_like(x)
    bounds = cu_seqlens.tolist()
    for i, slot in enumerate(slot_ids.tolist()):
        lo, hi = bounds[i], bounds[i + 1]
        window = torch.cat([conv_states[slot].T.float(), x[lo:hi].float()])
        out[lo:hi] = _conv_window(window, weight, hi - lo).to(x.dtype)
        conv_states[slot] = window[-(weight.shape[1] - 1):].T.to(conv_states.dtype)
    return out


BLOCK_T = 16  # prefill tokens per program


BLOCK_C = 128  # channels per program (prefill tile [BLOCK_T, BLOCK_C])


@triton.jit
def _prefill_tap(x_ptr, state_ptr, w_ptr, t, c, lo, slot, mask, c_ok, x_st, x_sc, w_sc, w_sk, s_ss, s_sc, s_sk,
                 j: tl.constexpr, K: tl.constexpr):
    """Tap j of tokens t: input t - K + 1 + j (from x, or from the slot's state before the
    sequence start lo) times w[:, j], in fp32."""
    src = t - (K - 1) + j
    in_x = (src >= lo)[:, None]
    xv = tl.load(x_ptr + src[:, None] * x_st + c[None, :] * x_sc, mask=mask & in_x, other=0.0)
    col = (t - lo + j)[:, None]  # the state column holding input src when src < lo
    sv = tl.load(state_ptr + slot[:, None] * s_ss + c[None, :] * s_sc + col * s_sk, mask=mask & ~in_x, other=0.0)
    w = tl.load(w_ptr + c * w_sc + j * w_sk, mask=c_ok, other=0.0).to(tl.float32)
    return tl.where(in_x, xv.to(tl.float32), sv.to(tl.float32)) * w[None, :]


@triton.jit
def _conv_prefill_kernel(x_ptr, w_ptr, state_ptr, slots_ptr, cu_ptr, seq_ptr, out_ptr, T, C,
                         x_st, x_sc, w_sc, w_sk, s_ss, s_sc, s_sk,
                         K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """Program (i, j): tokens [i * BLOCK_T, (i + 1) * BLOCK_T) x channels of block j; each token
    row looks up its own sequence, so a tile may straddle sequences."""
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.program_id(1).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
    t_ok = t < T
    c_ok = c < C
    mask = t_ok[:, None] & c_ok[None, :]
    seq = tl.load(seq_ptr + t, mask=t_ok, other=0)
    lo = tl.load(cu_ptr + seq, mask=t_ok, other=0).to(tl.int64)
    slot = tl.load(slots_ptr + seq, mask=t_ok, other=0).to(tl.int64)
    # The reference's order: acc = tap 0, then acc = acc + tap j (no FMA: launched without fusion).
    acc = _prefill_tap(x_ptr, state_ptr, w_ptr, t, c, lo, slot, mask, c_ok, x_st, x_sc, w_sc, w_sk,
                       s_ss, s_sc, s_sk, 0, K)
    for j in tl.static_range(1, K):
        acc = acc + _prefill_tap(x_ptr, state_ptr, w_ptr, t, c, lo, slot, mask, c_ok, x_st, x_sc, w_sc, w_sk,
                                 s_ss, s_sc, s_sk, j, K)
    out = acc / (1.0 + tl.exp(-acc))
    tl.store(out_ptr + t[:, None] * C + c[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _state_input(x_ptr, state_ptr, i, hi, lo, slot, c, c_ok, x_st, x_sc, s_ss, s_sc, s_sk, K: tl.constexpr):
    """Input hi - K + 1 + i of the sequence [lo, hi) (from x, or from the old state when the
    sequence is shorter than K - 1), as fp32 channels c."""
    pos = hi - (K - 1) + i + 0 * c  # a vector: the interpreter rejects tensor & scalar masks
    in_x = pos >= lo
    xv = tl.load(x_ptr + pos * x_st + c * x_sc, mask=c_ok & in_x, other=0.0)
    sv = tl.load(state_ptr + slot * s_ss + c * s_sc + (hi - lo + i) * s_sk, mask=c_ok & ~in_x, other=0.0)
    return tl.where(in_x, xv.to(tl.float32), sv.to(tl.float32))


@triton.jit
def _conv_state_kernel(x_ptr, state_ptr, slots_ptr, cu_ptr, C, x_st, x_sc, s_ss, s_sc, s_sk,
                       K: tl.constexpr, BLOCK_C: tl.constexpr):
    """Program (b, j): sequence b's slot state, channel block j <- its last K - 1 inputs. All the
    old values are read before the barrier, then the new ones are written."""
    b = tl.program_id(0)
    c = tl.program_id(1).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < C
    lo = tl.load(cu_ptr + b).to(tl.int64)
    hi = tl.load(cu_ptr + b + 1).to(tl.int64)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    dst = state_ptr + slot * s_ss + c * s_sc
    # K - 1 <= 3 columns, unrolled into separate vectors (K is at least 2).
    v0 = _state_input(x_ptr, state_ptr, 0, hi, lo, slot, c, c_ok, x_st, x_sc, s_ss, s_sc, s_sk, K)
    if K > 2:
        v1 = _state_input(x_ptr, state_ptr, 1, hi, lo, slot, c, c_ok, x_st, x_sc, s_ss, s_sc, s_sk, K)
    if K > 3:
        v2 = _state_input(x_ptr, state_ptr, 2, hi, lo, slot, c, c_ok, x_st, x_sc, s_ss, s_sc, s_sk, K)
    tl.debug_barrier()
    tl.store(dst, v0.to(state_ptr.dtype.element_ty), mask=c_ok)
    if K > 2:
        tl.store(dst + s_sk, v1.to(state_ptr.dtype.element_ty), mask=c_ok)
    if K > 3:
        tl.store(dst + 2 * s_sk, v2.to(state_ptr.dtype.element_ty), mask=c_ok)


def conv1d_prefill_triton(x: torch.Tensor, weight: torch.Tensor, conv_states: torch.Tensor,
                                 slot_ids: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """`conv1d_prefill_ref` in two launches: x [T, C] (any strides), weight [C, K] (K in
    2..4), conv_states [slots, C, K - 1] (updated in place), slot_ids [B] (distinct), cu_seqlens
    [B + 1] -> a new contiguous [T, C] in x's dtype.

    Invariant by construction: the grid is (fixed [BLOCK_T, BLOCK_C] tiles of tokens x channels);
    each output element reads exactly its own K inputs (from x, or from its slot's state before
    the sequence start) and sums the K fp32 products in the reference's order without FMA, so
    its bits do not depend on the batch, the tile it falls in or where the prompt was split. The
    first launch only reads the states; the second writes each slot's new state from its
    sequence's last K - 1 inputs (and old state entries when the sequence is shorter), so no
    output ever sees a state written by the same call.
    """
    kernel_device_ok(x)
    kernel = _check_conv_args(x, weight, conv_states)
    tokens, channels = x.shape
    out = torch.empty((tokens, channels), dtype=x.dtype, device=x.device)
    batch = slot_ids.shape[0]
    if batch == 0 or channels == 0:
        return out
    cu_seqlens = cu_seqlens.contiguous()
    strides = (*x.stride(), *weight.stride(), *conv_states.stride())
    if tokens > 0:
        # Token -> sequence map, on the device (no host sync): the number of sequence ends <= t.
        seq_of = torch.searchsorted(cu_seqlens[1:], torch.arange(tokens, dtype=cu_seqlens.dtype, device=x.device),
                                    right=True)
        _conv_prefill_kernel[(triton.cdiv(tokens, BLOCK_T), triton.cdiv(channels, BLOCK_C))](
            x, weight, conv_states, slot_ids, cu_seqlens, seq_of, out, tokens, channels, *strides,
            K=kernel, BLOCK_T=BLOCK_T, BLOCK_C=BLOCK_C, enable_fp_fusion=False)
    _conv_state_kernel[(batch, triton.cdiv(channels, BLOCK_C_STATE))](
        x, conv_states, slot_ids, cu_seqlens, channels, *x.stride(), *conv_states.stride(),
        K=kernel, BLOCK_C=BLOCK_C_STATE)
    return out


def _launches(step: Step) -> list[Call]:
    if not step.linear_attention or step.batch.is_decode:
        return []
    return [Call(step.name, lambda: (step.gdn_in_proj()[0], *step.conv_state(), step.batch.slot_ids,
                                     step.batch.cu_seqlens))]


OP = OpSpec("conv1d_prefill", Conv1dPrefill, {"ref": conv1d_prefill_ref, "triton": conv1d_prefill_triton},
            order=90, cases=Layout(
                rows("x", "channels"), conv_slot, conv_shared,
                [({"channels": c, "width": w}, seqs) for c, w in ((8, 4), (130, 3), (20, 2))
                 for seqs in ([(1, 0)], [(5, 0), (70, 3), (2, 0)])], splittable=True),
            launches=_launches, cost=conv1d_cost)
