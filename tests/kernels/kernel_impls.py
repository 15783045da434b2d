"""What the kernel tests run on: the device (CUDA when present, else the CPU under the Triton
interpreter) and, per op, the implementation under test: the one given with
`pytest --impl OP=SPEC` (registered as "under_test" by tests/conftest.py), else the op's Triton
kernel. A variant therefore runs the whole kernel suite with no edit to it."""

from collections.abc import Callable
from typing import Any

import torch

from pocketllm.kernels.registry import IMPLEMENTATIONS

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
UNDER_TEST = "under_test"


def implementation(op: str) -> Callable[..., Any]:
    """The implementation of `op` the kernel tests exercise."""
    impls = IMPLEMENTATIONS[op]
    return impls.get(UNDER_TEST, impls["triton"])
