"""Rotary position embedding (the rotate-half layout of Qwen / Llama).

cos/sin come from a table indexed by absolute position, built once, so a position's rotation is
the same whichever batch it sits in.
"""

import math
from collections.abc import Callable

import torch

from .pointwise import elementwise_invariant


def rope_table(head_dim: int, max_positions: int, theta: float,
               device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos and sin tables of shape [max_positions, head_dim] (head_dim: the rotary width).

    The angles are transformers' (fp32 inverse frequencies, fp32 position * frequency); their cos and
    sin are libm's double results rounded to fp32, each entry computed on its own. torch's CPU cos and
    sin run a tensor through a vector library in chunks split by the thread count (strided ones too,
    through a buffer), and an entry's last bit depends on its chunk: a tensor-parallel worker that
    built its table on another number of threads than rank 0 rotated keys past position ~100
    differently and shifted logprobs by a few ulps."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / elementwise_invariant(lambda e: theta ** e, exponents)  # libm's powf per entry
    positions = torch.arange(max_positions, dtype=torch.float32)
    angles = (positions[:, None] * inv_freq[None, :]).flatten().tolist()
    half = (max_positions, head_dim // 2)

    def table(fn: Callable[[float], float]) -> torch.Tensor:
        values = torch.tensor([fn(a) for a in angles], dtype=torch.float64).float().reshape(half)
        return torch.cat([values, values], dim=-1).to(device)

    return table(math.cos), table(math.sin)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rope_ref(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D], positions [T] -> x rotated by the angle of each token's position.

    The tables' width R may be smaller than D (partial rotary, as in Qwen3.5): then only the
    first R dims rotate and the rest pass through unchanged."""
    rotary = cos.shape[-1]
    c = cos.index_select(0, positions)[:, None, :].to(x.dtype)
    s = sin.index_select(0, positions)[:, None, :].to(x.dtype)
    if rotary == x.shape[-1]:
        return x * c + _rotate_half(x) * s
    rot, rest = x[..., :rotary], x[..., rotary:]
    return torch.cat([rot * c + _rotate_half(rot) * s, rest], dim=-1)
