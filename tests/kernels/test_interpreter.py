"""Interpreted, a launch patches Triton's language once per module of the functions its kernel
calls (pocketllm.kernels._triton), not at every call, and each element type's numpy dtype is looked up
once: the kernels' results are unchanged."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pocketllm.kernels._triton import HAS_TRITON, INTERPRETED, tl, triton

pytestmark = pytest.mark.skipif(not (HAS_TRITON and INTERPRETED), reason="the Triton interpreter's patching only")


@triton.jit
def _halve(x):
    return x * 0.5


@triton.jit
def _sums_kernel(x_ptr, out_ptr, ROWS: tl.constexpr, COLS: tl.constexpr):
    """out[r] = sum(x[r]) / 2, one `tl.sum` (a jit function of triton.language.standard) and one
    `_halve` (this module's) per row."""
    cols = tl.arange(0, COLS)
    for r in range(ROWS):
        tl.store(out_ptr + r, _halve(tl.sum(tl.load(x_ptr + r * COLS + cols), axis=0)))


def test_a_launch_patches_the_language_once_per_module(monkeypatch):
    from triton.runtime import interpreter

    patched = []
    original = interpreter._patch_lang
    monkeypatch.setattr(interpreter, "_patch_lang", lambda fn: patched.append(fn.__module__) or original(fn))
    x = torch.arange(6 * 8, dtype=torch.float32).reshape(6, 8)
    out = torch.empty(6)
    for _ in range(2):  # each launch patches afresh
        _sums_kernel[(1,)](x, out, ROWS=6, COLS=8)
    assert torch.equal(out, x.sum(dim=1) / 2)
    # Per launch: the kernel's module, then once each the modules of tl.sum and _halve (this one:
    # patched by the launch already, its globals are the kernel's), not 6 + 6 more times.
    assert patched == [__name__, "triton.language.standard", __name__] * 2


# How the interpreter stores each element type in numpy: bf16 as its 16 bits, fp8 as its 8, pointers as
# 64-bit addresses (Triton's documented table, written out here independently of the cache).
STORED_AS = {"int1": np.bool_, "int8": np.int8, "uint8": np.uint8, "int16": np.int16, "uint16": np.uint16,
             "int32": np.int32, "uint32": np.uint32, "int64": np.int64, "uint64": np.uint64,
             "float16": np.float16, "float32": np.float32, "float64": np.float64, "bfloat16": np.uint16,
             "float8e5": np.uint8, "float8e4nv": np.uint8, "float8e4b15": np.uint8}


def test_the_cached_numpy_dtypes_are_the_interpreters():
    from triton.runtime import interpreter

    assert interpreter._get_np_dtype.__module__ == "pocketllm.kernels._triton"  # the cache is installed
    for _ in range(2):  # the first answer is Triton's; the second comes from the cache
        for name, stored in STORED_AS.items():
            element = getattr(tl, name)
            assert interpreter._get_np_dtype(element) == np.dtype(stored), name
            assert interpreter._get_np_dtype(tl.block_type(element, [2, 4])) == np.dtype(stored), name
            for pointer in (tl.pointer_type(element), tl.block_type(tl.pointer_type(element), [8])):
                assert interpreter._get_np_dtype(pointer) == np.dtype(np.uint64), name


@triton.jit
def _widen_kernel(x_ptr, out_ptr, N: tl.constexpr):
    offsets = tl.arange(0, N)
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets).to(tl.float32) * 2.0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.int16, torch.int64])
def test_kernels_still_load_every_element_type(dtype):
    """Each element type through the cached table: loaded, widened to fp32, doubled, stored."""
    x = torch.arange(-8, 8).to(dtype)
    out = torch.empty(16)
    _widen_kernel[(1,)](x, out, N=16)
    assert torch.equal(out, x.float() * 2)
