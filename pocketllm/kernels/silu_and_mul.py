"""SiLU-and-mul, the SwiGLU gate: silu(gate) * up, with gate and up fused in one projection.

`silu_and_mul_triton` is the Triton kernel: elementwise, each program one block of one row.
"""

from typing import Protocol

import torch
import torch.nn.functional as F

from ._cases import ROWS, no_shared, rows
from ._triton import kernel_device_ok, tl, triton
from .cpu.extension import load_extension
from .pointwise import elementwise_invariant
from .spec import Call, Cost, Layout, OpSpec, Step, size


class SiluAndMul(Protocol):
    """gate_up [T, 2I] (gate first, then up) -> [T, I]."""

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor: ...


BLOCK = 1024


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate first, then up) -> [T, I]; silu per element, whatever T (see pointwise.py)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return elementwise_invariant(F.silu, gate) * up


def silu_and_mul_own_order(gate_up: torch.Tensor) -> torch.Tensor:
    """The torch backend's op where pocketllm's C++ kernels build: one call of `kernels/cpu/rows.cpp`
    with torch's scalar SiLU, g / (1 + exp(-g)), on every element (the reference's bits, without its
    staging copy and three dispatches). fp32 CPU rows; elsewhere the reference."""
    module = load_extension()
    if module is None or gate_up.dtype != torch.float32 or gate_up.device.type != "cpu" or gate_up.dim() != 2 \
            or gate_up.stride(-1) != 1:
        return silu_and_mul_ref(gate_up)
    return module.silu_and_mul_rows(gate_up)


# -- Triton ------------------------------------------------------------------------------------------


@triton.jit
def _silu_and_mul_kernel(in_ptr, out_ptr, inter, stride_in, BLOCK: tl.constexpr):
    """Program (row, j) computes columns [j * BLOCK, (j + 1) * BLOCK) of one output row."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inter
    gate = tl.load(in_ptr + row * stride_in + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(in_ptr + row * stride_in + inter + cols, mask=ok, other=0.0).to(tl.float32)
    # As the reference: silu in fp32 rounded to the input dtype, then the product (exact in fp32
    # for 16-bit inputs) rounded once to the input dtype.
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * inter + cols, (silu * up).to(out_ptr.dtype.element_ty), mask=ok)


def silu_and_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate first, then up) -> [T, I] in the input dtype; row invariant by construction.

    Purely elementwise: every output element reads only its own gate and up values and the grid is
    (row, fixed-size column block), so no value depends on how many rows share the call.
    """
    kernel_device_ok(gate_up)
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up must be [T, 2I], got {tuple(gate_up.shape)}")
    if gate_up.stride(1) != 1:
        gate_up = gate_up.contiguous()
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((rows, inter), dtype=gate_up.dtype, device=gate_up.device)
    if rows == 0 or inter == 0:
        return out
    _silu_and_mul_kernel[(rows, triton.cdiv(inter, BLOCK))](gate_up, out, inter, gate_up.stride(0), BLOCK=BLOCK)
    return out


def _launches(step: Step) -> list[Call]:
    return [Call(step.name, lambda: (step.tensor(step.tokens, 2 * step.cfg.intermediate_size),))]


def _cost(gate_up: torch.Tensor) -> Cost:
    """Reads [T, 2I], writes [T, I]; ~5 FLOPs an output (silu's exp, add and divide, two multiplies)."""
    outputs = gate_up.numel() // 2
    return Cost(size(gate_up) + outputs * gate_up.element_size(), 5 * outputs)


OP = OpSpec("silu_and_mul", SiluAndMul, {"ref": silu_and_mul_ref, "own_order": silu_and_mul_own_order,
                                         "triton": silu_and_mul_triton}, order=50,
            cases=Layout(rows("gate_up", "width2"), None, no_shared,
                         [({"width2": w}, members) for w in (2, 48, 2 * 1100) for members in ROWS]),
            launches=_launches, cost=_cost)
