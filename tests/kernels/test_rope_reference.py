"""rope_table and apply_rope_ref against the rotary embedding written out per dimension pair in
float64 (the rotate-half layout: dims i and i + R/2 of the first R rotate together by
position * theta^(-2i/R)), full and partial (R < D: the other dims pass through unchanged)."""

from __future__ import annotations

import math

import pytest
import torch

from pocketllm.kernels.rope import apply_rope_ref, rope_table


def _expected(x: torch.Tensor, positions: list[int], rotary: int, theta: float) -> torch.Tensor:
    out = x.double().clone()
    half = rotary // 2
    for t, position in enumerate(positions):
        for i in range(half):
            angle = position * theta ** (-2.0 * i / rotary)
            a, b = x[t, :, i].double(), x[t, :, i + half].double()
            out[t, :, i] = a * math.cos(angle) - b * math.sin(angle)
            out[t, :, i + half] = b * math.cos(angle) + a * math.sin(angle)
    return out


def test_rope_table_values():
    """cos/sin [P, R] fp32: entry (p, j) is the cos/sin of p * theta^(-2 (j mod R/2) / R)."""
    cos, sin = rope_table(8, 50, 10_000.0)
    assert cos.shape == sin.shape == (50, 8) and cos.dtype == sin.dtype == torch.float32
    angles = torch.tensor([[p * 10_000.0 ** (-2.0 * (j % 4) / 8) for j in range(8)] for p in range(50)],
                          dtype=torch.float64)
    torch.testing.assert_close(cos.double(), angles.cos(), atol=2e-5, rtol=0)
    torch.testing.assert_close(sin.double(), angles.sin(), atol=2e-5, rtol=0)


def test_rope_table_on_the_requested_device():
    cos, sin = rope_table(8, 50, 10_000.0, device="meta")
    assert cos.device.type == sin.device.type == "meta" and cos.shape == (50, 8)


@pytest.mark.parametrize("rotary", [16, 6])
def test_apply_rope_full_and_partial(rotary):
    """D = 16 with R = 16 (full) or R = 6 (partial, the table narrower than the head and much
    shorter than it is long); positions out of order and repeated."""
    gen = torch.Generator().manual_seed(rotary)
    x = torch.randn(5, 3, 16, generator=gen)
    positions = [7, 0, 31, 7, 2]
    cos, sin = rope_table(rotary, 40, 1_000_000.0)
    out = apply_rope_ref(x, torch.tensor(positions), cos, sin)
    assert out.shape == x.shape and out.dtype == x.dtype
    torch.testing.assert_close(out.double(), _expected(x, positions, rotary, 1_000_000.0), atol=1e-5, rtol=0)
    assert torch.equal(out[..., rotary:], x[..., rotary:])
