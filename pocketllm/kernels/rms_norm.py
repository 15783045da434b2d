"""Op `rms_norm`: RMSNorm over the last dimension (also used per head for the q/k norm).

The Hugging Face Qwen convention: normalise in fp32, cast back to the input dtype, then scale.
`rms_norm_triton` is the Triton kernel: one program per row, the whole row in one block.
"""

from typing import Any, Protocol

import torch

from ._cases import ROWS, randn, rows
from ._triton import kernel_device_ok, tl, triton
from .cpu.extension import load_extension
from .spec import Call, Cost, Layout, OpSpec, Step, size


class RmsNorm(Protocol):
    """x [..., H], weight [H] -> [..., H]."""

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """[..., H] -> [..., H]; each row is reduced on its own, so rows never influence each other."""
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def rms_norm_own_order(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The torch backend's op where pocketllm's C++ kernels build: each row in one call of
    `kernels/cpu/rows.cpp` (its sum of squares in the fixed order of the linear kernel), instead of the
    reference's five torch ops per call, which dominate a decode step's small rows. fp32 CPU rows of
    2 or 3 dimensions; elsewhere the reference (also row invariant, rounding differently)."""
    module = load_extension()
    if module is None or x.dtype != torch.float32 or weight.dtype != torch.float32 or x.device.type != "cpu" \
            or x.dim() not in (2, 3) or x.stride(-1) != 1 or (x.dim() == 3 and x.stride(1) < x.shape[-1]):
        return rms_norm_ref(x, weight, eps)
    return module.rms_norm_rows(x, weight, float(eps))


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
    out = torch.empty(shape, dtype=torch.result_type(weight, x), device=x.device)
    if out.numel() == 0:
        return out
    if x.dim() < 2 or x.stride(-1) != 1:
        x = x.reshape(-1, h).contiguous()
    view = x.reshape(-1, x.shape[-2], h)  # a view whenever the leading dims can merge; else a copy
    rows = view.shape[0] * view.shape[1]
    _rms_norm_kernel[(rows,)](view, weight, out, view.shape[1], view.stride(0), view.stride(1), h, eps,
                              BLOCK=triton.next_power_of_2(h))
    return out


def _launches(step: Step) -> list[Call]:
    cfg, eps = step.cfg, step.cfg.rms_norm_eps

    def hidden_rows(n: int) -> tuple[Any, ...]:
        return step.tensor(n, cfg.hidden_size), step.tensor(cfg.hidden_size), eps

    return [Call(f"{step.name}: hidden", lambda: hidden_rows(step.tokens)),
            Call(f"{step.name}: q norm", lambda: (step.attention_views()[0], step.tensor(cfg.head_dim), eps)),
            Call(f"{step.name}: k norm", lambda: (step.attention_views()[1], step.tensor(cfg.head_dim), eps)),
            Call(f"{step.name}: final norm", lambda: hidden_rows(step.sequences))]


def _cost(x: torch.Tensor, weight: torch.Tensor, eps: float) -> Cost:
    """Reads x and the weight, writes x's shape; ~4 FLOPs an element (square, sum, two scalings)."""
    return Cost(2 * size(x) + size(weight), 4 * x.numel())


OP = OpSpec("rms_norm", RmsNorm, {"ref": rms_norm_ref, "own_order": rms_norm_own_order, "triton": rms_norm_triton},
            order=10, cases=Layout(
    rows("x", "hidden"), None,
    lambda gen, dims, dtype: {"weight": randn(gen, dims["hidden"], dtype=dtype), "eps": 1e-6},
    [({"hidden": h}, members) for h in (1, 24, 100) for members in ROWS]), launches=_launches, cost=_cost)
