"""Op `rms_norm_gated`: the gated RMSNorm of Gated DeltaNet outputs, rms_norm(x) * silu(gate)."""

from typing import Any, Protocol

import torch

from ._cases import ROWS, randn
from ._triton import kernel_device_ok, tl, triton
from .cpu.extension import load_extension
from .pointwise import elementwise_invariant
from .rms_norm import rms_norm_ref
from .spec import Call, Cost, Layout, OpSpec, Step, size


class RmsNormGated(Protocol):
    """x and gate [..., H], weight [H] -> [..., H] in x's dtype."""

    def __call__(self, x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...


def rms_norm_gated_ref(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gated RMSNorm of Gated DeltaNet outputs: rms_norm_ref(x) * silu(gate), the product in fp32,
    then cast to x's dtype. x and gate [..., H]; rows are independent."""
    silu = elementwise_invariant(torch.nn.functional.silu, gate.float())
    return (rms_norm_ref(x, weight, eps).float() * silu).to(x.dtype)


def rms_norm_gated_own_order(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The torch backend's op where pocketllm's C++ kernels build: `rms_norm_own_order`'s row times
    torch's scalar SiLU of the gate, in one call of `kernels/cpu/rows.cpp`. fp32 CPU rows of 2 or 3
    dimensions, gate of x's shape; elsewhere the reference."""
    module = load_extension()
    if module is None or any(t.dtype != torch.float32 or t.device.type != "cpu" or t.stride(-1) != 1
                             for t in (x, gate, weight)) or x.dim() not in (2, 3) or gate.shape != x.shape \
            or any(t.dim() == 3 and t.stride(1) < t.shape[-1] for t in (x, gate)):
        return rms_norm_gated_ref(x, gate, weight, eps)
    return module.rms_norm_rows(x, weight, float(eps), gate)


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


def _launches(step: Step) -> list[Call]:
    """The gated norm of each Gated DeltaNet layer: the delta rule's output, gated by z."""
    if not step.linear_attention:
        return []

    def args() -> tuple[Any, ...]:
        _, z = step.gdn_in_proj()
        out = step.tensor(*z.shape)  # the gated delta rule's output
        return out, z, step.tensor(step.cfg.linear_value_head_dim), step.cfg.rms_norm_eps

    return [Call(step.name, args)]


def _cost(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> Cost:
    """Reads x, the gate and the weight, writes x's shape; ~9 FLOPs an element (norm 4, silu 4, product)."""
    return Cost(2 * size(x) + size(gate, weight), 9 * x.numel())


OP = OpSpec("rms_norm_gated", RmsNormGated, {"ref": rms_norm_gated_ref, "own_order": rms_norm_gated_own_order,
                                            "triton": rms_norm_gated_triton}, order=130,
            cases=Layout(
                lambda gen, n, dims, dtype: {"x": randn(gen, n, dims["hidden"], dtype=dtype),
                                             "gate": randn(gen, n, dims["hidden"], dtype=dtype)}, None,
                lambda gen, dims, dtype: {"weight": randn(gen, dims["hidden"], dtype=dtype), "eps": 1e-6},
                [({"hidden": h}, members) for h in (8, 24, 100) for members in ROWS]),
            launches=_launches, cost=_cost)
