"""Op `conv1d_decode`: the causal conv1d (+ SiLU) of one new input per sequence; each slot's
conv state shifts by one."""

from typing import Protocol

import torch
import torch.nn.functional as F

from ._cases import conv_shared, conv_slot, decode_grid, rows
from ._conv1d import BLOCK_C_STATE, _check_conv_args, conv1d_cost
from ._triton import kernel_device_ok, tl, triton
from .cpu.extension import load_extension
from .pointwise import elementwise_invariant
from .spec import Call, Layout, OpSpec, Step


class Conv1dDecode(Protocol):
    """x [B, C], weight [C, K], conv_states [slots, C, K - 1] (shifted in place), slot_ids [B] -> [B, C]."""

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, conv_states: torch.Tensor,
                 slot_ids: torch.Tensor) -> torch.Tensor: ...


def conv1d_decode_ref(x: torch.Tensor, weight: torch.Tensor, conv_states: torch.Tensor,
                             slot_ids: torch.Tensor) -> torch.Tensor:
    """One new input per sequence: x [B, C] -> [B, C]; the slots' states shift by one."""
    windows = torch.cat([conv_states[slot_ids].float(), x.float()[:, :, None]], dim=-1)  # [B, C, K]
    w = weight.float()
    acc = windows[:, :, 0] * w[:, 0]
    for j in range(1, weight.shape[1]):
        acc = acc + windows[:, :, j] * w[:, j]
    conv_states[slot_ids] = windows[:, :, 1:].to(conv_states.dtype)
    return elementwise_invariant(F.silu, acc).to(x.dtype)


def conv1d_decode_own_order(x: torch.Tensor, weight: torch.Tensor, conv_states: torch.Tensor,
                            slot_ids: torch.Tensor) -> torch.Tensor:
    """The torch backend's op where pocketllm's C++ kernels build: the reference's arithmetic (the
    taps' products and sums each rounded on its own, torch's scalar SiLU: the same bits, so a decoded
    position keeps a prefilled one's) in one call of `kernels/cpu/rows.cpp`. fp32 CPU tensors;
    elsewhere the reference."""
    module = load_extension()
    _check_conv_args(x, weight, conv_states)
    if module is None or any(t.dtype != torch.float32 or t.device.type != "cpu" for t in (x, weight, conv_states)) \
            or x.stride(-1) != 1 or not (weight.is_contiguous() and conv_states.is_contiguous()):
        return conv1d_decode_ref(x, weight, conv_states, slot_ids)
    return module.conv1d_decode_rows(x, weight, conv_states, slot_ids.long())


@triton.jit
def _conv_decode_kernel(x_ptr, w_ptr, state_ptr, slots_ptr, out_ptr, C, x_sb, x_sc, w_sc, w_sk, s_ss, s_sc, s_sk,
                        K: tl.constexpr, BLOCK_C: tl.constexpr):
    """Program (b, j): row b, channel block j. Reads the slot's K - 1 state columns and the new
    input, writes the output, then (after a barrier) the state shifted by one."""
    b = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < C
    slot = tl.load(slots_ptr + b).to(tl.int64)
    src = state_ptr + slot * s_ss + c * s_sc
    x = tl.load(x_ptr + b * x_sb + c * x_sc, mask=c_ok, other=0.0).to(tl.float32)
    # Window [s0, (s1, (s2,)) x], summed as the reference: acc = v0 * w0, then acc = acc + vj * wj.
    s0 = tl.load(src, mask=c_ok, other=0.0).to(tl.float32)
    acc = s0 * tl.load(w_ptr + c * w_sc, mask=c_ok, other=0.0).to(tl.float32)
    if K > 2:
        s1 = tl.load(src + s_sk, mask=c_ok, other=0.0).to(tl.float32)
        acc = acc + s1 * tl.load(w_ptr + c * w_sc + w_sk, mask=c_ok, other=0.0).to(tl.float32)
    if K > 3:
        s2 = tl.load(src + 2 * s_sk, mask=c_ok, other=0.0).to(tl.float32)
        acc = acc + s2 * tl.load(w_ptr + c * w_sc + 2 * w_sk, mask=c_ok, other=0.0).to(tl.float32)
    acc = acc + x * tl.load(w_ptr + c * w_sc + (K - 1) * w_sk, mask=c_ok, other=0.0).to(tl.float32)
    out = acc / (1.0 + tl.exp(-acc))
    tl.store(out_ptr + b * C + c, out.to(out_ptr.dtype.element_ty), mask=c_ok)
    tl.debug_barrier()
    if K == 2:
        tl.store(src, x.to(state_ptr.dtype.element_ty), mask=c_ok)
    if K == 3:
        tl.store(src, s1.to(state_ptr.dtype.element_ty), mask=c_ok)
        tl.store(src + s_sk, x.to(state_ptr.dtype.element_ty), mask=c_ok)
    if K == 4:
        tl.store(src, s1.to(state_ptr.dtype.element_ty), mask=c_ok)
        tl.store(src + s_sk, s2.to(state_ptr.dtype.element_ty), mask=c_ok)
        tl.store(src + 2 * s_sk, x.to(state_ptr.dtype.element_ty), mask=c_ok)


def conv1d_decode_triton(x: torch.Tensor, weight: torch.Tensor, conv_states: torch.Tensor,
                                slot_ids: torch.Tensor) -> torch.Tensor:
    """`conv1d_decode_ref` in one launch: x [B, C] (any strides), one new input per
    sequence, slot_ids [B] (distinct); conv_states shift by one in place -> a new contiguous [B, C].

    Invariant by construction: grid (row, fixed BLOCK_C_STATE channel block); row b reads only its
    own input and its slot's state and sums the K taps in the same order and fp32 operations as
    the prefill kernel, so decoding a token gives the bits prefilling it would.
    """
    kernel_device_ok(x)
    kernel = _check_conv_args(x, weight, conv_states)
    batch, channels = x.shape
    out = torch.empty((batch, channels), dtype=x.dtype, device=x.device)
    if batch == 0 or channels == 0:
        return out
    _conv_decode_kernel[(batch, triton.cdiv(channels, BLOCK_C_STATE))](
        x, weight, conv_states, slot_ids, out, channels, *x.stride(), *weight.stride(), *conv_states.stride(),
        K=kernel, BLOCK_C=BLOCK_C_STATE, enable_fp_fusion=False)
    return out


def _launches(step: Step) -> list[Call]:
    if not step.linear_attention or not step.batch.is_decode:
        return []
    return [Call(step.name, lambda: (step.gdn_in_proj()[0], *step.conv_state(), step.batch.slot_ids))]


OP = OpSpec("conv1d_decode", Conv1dDecode, {"ref": conv1d_decode_ref, "own_order": conv1d_decode_own_order,
                                           "triton": conv1d_decode_triton}, order=100,
            cases=Layout(rows("x", "channels"), conv_slot, conv_shared,
                         [({"channels": c, "width": w}, decode_grid(lengths)) for c, w in ((8, 4), (300, 3))
                          for lengths in ([1], [5, 1, 9, 2])]),
            launches=_launches, cost=conv1d_cost)
