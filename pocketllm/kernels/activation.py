"""SiLU-and-mul, the SwiGLU gate: silu(gate) * up, with gate and up fused in one projection."""

import torch
import torch.nn.functional as F


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate first, then up) -> [T, I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
