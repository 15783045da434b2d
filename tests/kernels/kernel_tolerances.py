"""Kernel-vs-reference tolerances: the lab's one table (`pocketllm.testing.compare.TOLERANCES`)."""

import torch

from pocketllm.testing.compare import TOLERANCES


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype | None = None) -> None:
    torch.testing.assert_close(actual.float(), expected.float(), **TOLERANCES[dtype or expected.dtype])
