"""Transcendental pointwise ops whose bits depend only on each element's value.

On the CPU, PyTorch evaluates sigmoid, silu, softplus, log... with SIMD polynomials over the
vectorized part of a contiguous tensor and with scalar libm over the remainder, and the two
disagree in the last bit for some inputs (measured: sigmoid, silu and softplus differ for 0.1-0.3%
of random inputs). Which elements fall in the remainder depends on the tensor's size and on how it
is split across threads, i.e. on the batch. Evaluating through a strided view sends every element
through the scalar path, so a token's result no longer depends on its neighbours. CUDA kernels
evaluate every element with the same code, so there the op runs as is.
"""

from collections.abc import Callable

import torch


def elementwise_invariant(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """fn(x) with every element computed by the same (scalar) code path."""
    if x.device.type != "cpu":
        return fn(x)
    staged = x.new_empty(*x.shape, 2)
    staged[..., 0] = x
    return fn(staged[..., 0])
