"""rms_norm_gated_ref against the formula in float64: weight * x / sqrt(mean(x^2) + eps) * silu(gate),
over the last axis, rows independent; the result in x's dtype."""

from __future__ import annotations

import pytest
import torch

from pocketllm.kernels.rms_norm_gated import rms_norm_gated_ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_gated_matches_the_formula(dtype):
    gen = torch.Generator().manual_seed(0)
    x = (3.0 * torch.randn(4, 2, 24, generator=gen)).to(dtype)
    gate = (2.0 * torch.randn(4, 2, 24, generator=gen)).to(dtype)
    weight = (1.0 + 0.5 * torch.randn(24, generator=gen)).to(dtype)
    eps = 0.25  # large enough to matter
    out = rms_norm_gated_ref(x, gate, weight, eps)
    xd, gd = x.double(), gate.double()
    expected = weight.double() * xd / torch.sqrt(xd.pow(2).mean(-1, keepdim=True) + eps) * (gd * torch.sigmoid(gd))
    assert out.dtype == dtype and out.shape == x.shape
    tolerance = 1e-5 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(out.double(), expected, atol=tolerance, rtol=tolerance)
