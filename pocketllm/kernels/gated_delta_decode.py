"""Op `gated_delta_decode`: one step of the gated delta rule per sequence, exactly the recurrence
(see `_gated_delta`); `gated_delta_decode_triton` runs one program per sequence, value head and
block of value columns."""

from typing import Protocol

import torch

from ._cases import GDN, decode_grid, gdn_slot, gdn_tokens, no_shared
from ._gated_delta import _check_gated_delta_args, _l2norm, gated_delta_cost, gated_delta_recurrent
from ._triton import kernel_device_ok, tl, triton
from .checks import check_shape
from .pointwise import elementwise_invariant
from .spec import Call, Layout, OpSpec, Step


class GatedDeltaDecode(Protocol):
    """q/k [B, Hk, Dk], v [B, Hv, Dv], g/beta [B, Hv], states fp32 [slots, Hv, Dk, Dv] (advanced in
    place), slot_ids [B] -> [B, Hv, Dv]."""

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                 states: torch.Tensor, slot_ids: torch.Tensor) -> torch.Tensor: ...


def gated_delta_decode_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                           states: torch.Tensor, slot_ids: torch.Tensor) -> torch.Tensor:
    """One token per sequence: q/k [B, Hk, Dk], v [B, Hv, Dv], g/beta [B, Hv] -> [B, Hv, Dv]; the
    slots' states advance by one token."""
    num_v_heads = v.shape[1]
    group = num_v_heads // q.shape[1]
    qh = (_l2norm(q.float()) * q.shape[-1] ** -0.5).repeat_interleave(group, dim=1)  # [B, Hv, Dk]
    kh = _l2norm(k.float()).repeat_interleave(group, dim=1)
    state = states[slot_ids] * elementwise_invariant(torch.exp, g.float())[..., None, None]  # [B, Hv, Dk, Dv]
    remembered = (state * kh[..., None]).sum(dim=-2)  # [B, Hv, Dv]
    delta = (v.float() - remembered) * beta.float()[..., None]
    state = state + kh[..., None] * delta[..., None, :]
    states[slot_ids] = state
    return (state * qh[..., None]).sum(dim=-2).to(v.dtype)


def gated_delta_decode_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                                 beta: torch.Tensor, states: torch.Tensor, slot_ids: torch.Tensor) -> torch.Tensor:
    """One token per sequence through `_gated_delta.gated_delta_recurrent` (C++, CPU), the function
    `gated_delta_prefill_recurrent` runs on prompts: a decoded position gets a prefilled one's bits."""
    cu_seqlens = torch.arange(q.shape[0] + 1, dtype=torch.int64, device=q.device)
    return gated_delta_recurrent(q, k, v, g, beta, states, slot_ids, cu_seqlens)


DECODE_BLOCK_DV = 64  # value columns per decode program (capped by Dv)


@triton.jit
def _gated_delta_decode_kernel(q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, states_ptr, slots_ptr, out_ptr,
                               q_sb, q_sh, q_sd, k_sb, k_sh, k_sd, v_sb, v_sh, v_sd, g_sb, g_sh, b_sb, b_sh,
                               s_ss, s_sh, s_sk, s_sv, o_sb, o_sh, o_sd, scale,
                               GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                               BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr):
    """Program (b, h, j): sequence b, value head h, value columns [j * BLOCK_DV, (j + 1) * BLOCK_DV)."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    kh = h // GROUP
    dk = tl.arange(0, BLOCK_DK)
    dv = tl.program_id(2) * BLOCK_DV + tl.arange(0, BLOCK_DV)
    dk_mask = dk < DK
    dv_mask = dv < DV
    q = tl.load(q_ptr + b * q_sb + kh * q_sh + dk.to(tl.int64) * q_sd, mask=dk_mask, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + b * k_sb + kh * k_sh + dk.to(tl.int64) * k_sd, mask=dk_mask, other=0.0).to(tl.float32)
    q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * scale
    k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
    v = tl.load(v_ptr + b * v_sb + h * v_sh + dv.to(tl.int64) * v_sd, mask=dv_mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + b * g_sb + h * g_sh).to(tl.float32)
    beta = tl.load(beta_ptr + b * b_sb + h * b_sh).to(tl.float32)
    slot = tl.load(slots_ptr + b).to(tl.int64)
    tile = (states_ptr + slot * s_ss + h * s_sh + dk[:, None].to(tl.int64) * s_sk
            + dv[None, :].to(tl.int64) * s_sv)
    mask = dk_mask[:, None] & dv_mask[None, :]
    state = tl.load(tile, mask=mask, other=0.0) * tl.exp(g)
    remembered = tl.sum(state * k[:, None], axis=0)
    delta = (v - remembered) * beta
    state = state + k[:, None] * delta[None, :]
    tl.store(tile, state, mask=mask)
    out = tl.sum(state * q[:, None], axis=0)
    tl.store(out_ptr + b * o_sb + h * o_sh + dv.to(tl.int64) * o_sd, out.to(out_ptr.dtype.element_ty), mask=dv_mask)


def gated_delta_decode_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                              beta: torch.Tensor, states: torch.Tensor, slot_ids: torch.Tensor) -> torch.Tensor:
    """`gated_delta_decode_ref` in one launch: grid (B, Hv, Dv blocks of DECODE_BLOCK_DV).

    Invariant by construction: program (b, h, j) reads only sequence b's token and its slot's
    [Dk, BLOCK_DV] state tile, and writes only that tile and its outputs; reductions run over Dk
    within the program, and the tile shape comes from Dk / Dv (model constants), never from B.
    """
    kernel_device_ok(q)
    group = _check_gated_delta_args(q, k, v, g, beta, states)
    batch, dim_k = q.shape[0], q.shape[2]
    num_v_heads, dim_v = v.shape[1], v.shape[2]
    check_shape("slot_ids", slot_ids, (batch,))
    out = torch.empty((batch, num_v_heads, dim_v), dtype=v.dtype, device=v.device)
    if batch == 0:
        return out
    block_dv = min(triton.next_power_of_2(dim_v), DECODE_BLOCK_DV)
    grid = (batch, num_v_heads, triton.cdiv(dim_v, block_dv))
    _gated_delta_decode_kernel[grid](
        q, k, v, g, beta, states, slot_ids, out, *q.stride(), *k.stride(), *v.stride(), *g.stride(),
        *beta.stride(), *states.stride(), *out.stride(), dim_k ** -0.5,
        GROUP=group, DK=dim_k, DV=dim_v, BLOCK_DK=triton.next_power_of_2(dim_k),
        BLOCK_DV=block_dv)
    return out


def _launches(step: Step) -> list[Call]:
    if not step.linear_attention or not step.batch.is_decode:
        return []
    return [Call(step.name, lambda: (*step.gated_delta_args(), step.batch.slot_ids))]


OP = OpSpec("gated_delta_decode", GatedDeltaDecode,
            {"ref": gated_delta_decode_ref, "triton": gated_delta_decode_triton,
             "recurrent": gated_delta_decode_recurrent}, order=120,
            cases=Layout(gdn_tokens, gdn_slot, no_shared,
                         [(dims, decode_grid(lengths)) for dims in GDN for lengths in ([1], [3, 1, 70, 2])]),
            launches=_launches, cost=gated_delta_cost)
