"""Kernel-vs-reference tolerances, per dtype, in one place (atol, rtol)."""

import torch

TOLERANCES = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None) -> None:
    torch.testing.assert_close(actual.float(), expected.float(), **TOLERANCES[dtype or expected.dtype])
