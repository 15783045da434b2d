"""Rotary position embedding (the rotate-half layout of Qwen / Llama).

cos/sin come from a table indexed by absolute position, built once, so a position's rotation is
the same whichever batch it sits in.
"""

import torch


def rope_table(head_dim: int, max_positions: int, theta: float,
               device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos and sin tables of shape [max_positions, head_dim] (head_dim: the rotary width)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
    positions = torch.arange(max_positions, dtype=torch.float32, device=device)
    freqs = positions[:, None] * inv_freq[None, :]
    angles = torch.cat([freqs, freqs], dim=-1)
    return angles.cos(), angles.sin()


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
