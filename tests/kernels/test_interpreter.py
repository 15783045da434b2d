"""Interpreted, a launch patches Triton's language once per module of the functions its kernel
calls (pocketllm.kernels._triton), not at every call: the kernel's result is unchanged."""

from __future__ import annotations

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
