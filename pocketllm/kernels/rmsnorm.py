"""RMSNorm over the last dimension (also used per head for the q/k norm).

The Hugging Face Qwen convention: normalise in fp32, cast back to the input dtype, then scale.
`rms_norm_triton` is the Triton kernel: one program per row, the whole row in one block.
"""

import torch

from ._triton import kernel_device_ok, tl, triton
from .pointwise import elementwise_invariant


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """[..., H] -> [..., H]; each row is reduced on its own, so rows never influence each other."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def rms_norm_gated_ref(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gated RMSNorm of Gated DeltaNet outputs: rms_norm_ref(x) * silu(gate), the product in fp32,
    then cast to x's dtype. x and gate [..., H]; rows are independent."""
    silu = elementwise_invariant(torch.nn.functional.silu, gate.float())
    return (rms_norm_ref(x, weight, eps).float() * silu).to(x.dtype)


# -- Triton ------------------------------------------------------------------------------------------


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, inner, stride_outer, stride_inner, H, eps, BLOCK: tl.constexpr):
    """Row r of the [outer, inner, H] view lives at (r // inner) * stride_outer + (r % inner) * stride_inner."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + (row // inner) * stride_outer + (row % inner) * stride_inner
    cols = tl.arange(0, BLOCK)
    ok = cols < H
    x = tl.load(x_row + cols, mask=ok, other=0.0).to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=0) / H + eps)
    # As the reference: round the normalised row to x's dtype, then scale; the fp32 product of two
    # 16-bit floats is exact, so casting it to the output dtype rounds once, like torch does.
    normed = (x * inv_rms).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * H + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=ok)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """[..., H] -> [..., H] (contiguous), as `rms_norm_ref`; row invariant by construction.

    Each program reduces exactly one row, loaded whole into a block of next_power_of_2(H) lanes
    (padding lanes are zero), so the sum of squares has the same shape and order for a row whether
    it is normalised alone or among many rows. Rows need only be contiguous along H: the q/k
    slices of a fused projection, viewed as [T, heads, D], are read in place.
    """
    kernel_device_ok(x)
    shape, h = x.shape, x.shape[-1]
    if weight.shape != (h,):
        raise ValueError(f"weight has shape {tuple(weight.shape)}, expected ({h},)")
    if x.dim() < 2 or x.stride(-1) != 1:
        x = x.reshape(-1, h).contiguous()
    view = x.reshape(-1, x.shape[-2], h)  # a view whenever the leading dims can merge; else a copy
    out = torch.empty(shape, dtype=torch.result_type(weight, x), device=x.device)
    rows = view.shape[0] * view.shape[1]
    if rows == 0:
        return out
    _rms_norm_kernel[(rows,)](view, weight, out, view.shape[1], view.stride(0), view.stride(1), h, eps,
                              BLOCK=triton.next_power_of_2(h))
    return out


def _row_view(t: torch.Tensor) -> torch.Tensor:
    """[..., H] -> an [outer, inner, H] view with unit stride along H (a copy only where needed);
    tensors of the same shape get views of the same shape."""
    h = t.shape[-1]
    if t.dim() < 2:
        t = t.reshape(1, h)
    if t.stride(-1) != 1:
        t = t.contiguous()
    return t.reshape(-1, t.shape[-2], h)


@triton.jit
def _rms_norm_gated_kernel(x_ptr, g_ptr, w_ptr, out_ptr, inner, x_so, x_si, g_so, g_si, H, eps,
                           ROUND_MID: tl.constexpr, BLOCK: tl.constexpr):
    """Row r of x and gate, each viewed as [outer, inner, H], as in `_rms_norm_kernel`."""
    row = tl.program_id(0).to(tl.int64)
    outer_idx, inner_idx = row // inner, row % inner
    cols = tl.arange(0, BLOCK)
    ok = cols < H
    x = tl.load(x_ptr + outer_idx * x_so + inner_idx * x_si + cols, mask=ok, other=0.0).to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=0) / H + eps)
    normed = (x * inv_rms).to(x_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    y = w * normed
    if ROUND_MID:  # rms_norm_ref's result is in x's dtype (else fp32: nothing to round)
        y = y.to(x_ptr.dtype.element_ty).to(tl.float32)
    g = tl.load(g_ptr + outer_idx * g_so + inner_idx * g_si + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * H + cols, (y * (g / (1.0 + tl.exp(-g)))).to(out_ptr.dtype.element_ty), mask=ok)


def rms_norm_gated_triton(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`rms_norm_gated_ref`: x and gate [..., H] (rows contiguous along H, any other strides),
    weight [H] -> a new contiguous tensor of x's shape and dtype; row invariant by construction.

    As `rms_norm_triton`: each program handles exactly one row, loaded whole into a block of
    next_power_of_2(H) lanes, so its sum of squares has the same shape and order whichever rows
    share the call; the gate is elementwise. The normalised row is rounded as the reference rounds
    it (to x's dtype, then to the dtype of weight * normed), then multiplied by silu(gate) in fp32.
    """
    kernel_device_ok(x)
    shape, h = x.shape, x.shape[-1]
    if weight.shape != (h,) or gate.shape != shape:
        raise ValueError(f"x {tuple(shape)}, gate {tuple(gate.shape)}, weight {tuple(weight.shape)}: "
                         "need gate shaped as x and weight [H]")
    mid = torch.result_type(weight, x)
    if mid not in (x.dtype, torch.float32):
        raise ValueError(f"weight {weight.dtype} with x {x.dtype}: the norm's result would be {mid}")
    out = torch.empty(shape, dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    xv, gv = _row_view(x), _row_view(gate)
    _rms_norm_gated_kernel[(xv.shape[0] * xv.shape[1],)](
        xv, gv, weight, out, xv.shape[1], xv.stride(0), xv.stride(1), gv.stride(0), gv.stride(1), h, eps,
        ROUND_MID=mid == x.dtype, BLOCK=triton.next_power_of_2(h))
    return out
