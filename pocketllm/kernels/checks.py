"""Argument checks shared by the kernel launchers.

A Triton kernel trusts its pointers and strides: a wrong shape or dtype reads the wrong memory
instead of failing. So every launcher checks what it is given, on the host, from shapes and
dtypes only (never a tensor's values, which would wait for the device), and raises ValueError
naming the argument and what was expected.
"""

from __future__ import annotations

import torch


def check_shape(name: str, tensor: torch.Tensor, shape: tuple[int | None, ...]) -> None:
    """`tensor` has len(shape) dims, each equal to `shape`'s entry where that is not None."""
    if tensor.dim() != len(shape) or any(want is not None and got != want for got, want in zip(tensor.shape, shape)):
        expected = ", ".join("*" if want is None else str(want) for want in shape)
        raise ValueError(f"{name} must have shape [{expected}], got {list(tensor.shape)}")


def check_dtype(dtype: torch.dtype, **tensors: torch.Tensor) -> None:
    """Every tensor has `dtype`."""
    for name, tensor in tensors.items():
        if tensor.dtype != dtype:
            raise ValueError(f"{name} must be {dtype}, got {tensor.dtype}")


def check_groups(num_heads: int, num_shared: int, heads: str = "query heads", shared: str = "key/value heads") -> int:
    """Heads per shared head (grouped-query attention: query heads per K/V head); `num_heads` must
    be a multiple of `num_shared`."""
    if num_shared <= 0 or num_heads % num_shared:
        raise ValueError(f"{num_heads} {heads} are not a multiple of {num_shared} {shared}")
    return num_heads // num_shared
