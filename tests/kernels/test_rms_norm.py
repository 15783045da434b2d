"""rms_norm (pocketllm/kernels/rms_norm.py): x / sqrt(mean(x^2) + eps) * weight over the last axis.

- the reference against the formula in float64, and the torch backend's op against the model
  definition (Qwen3RMSNorm; Qwen3.5's (1 + weight), folded in at load by `offset_norm`);
- the kernel under test (by default the Triton one) against the reference on odd widths, strided
  per-head views of a fused projection and any leading shape (fp32 and fp16 on DEVICE; bf16 at
  model sizes in the `gpu` test);
- its row invariance, bitwise: a row's result does not depend on the rows around it.
"""

from __future__ import annotations

import math

import pytest
import torch
from kernel_cases import DTYPES
from kernel_cases import FORMULA_TOL as TOL
from kernel_cases import assert_rows_invariant as _assert_rows_invariant
from kernel_cases import gen as _gen
from kernel_cases import randn as _cpu_randn
from kernel_cases import randn_on as _randn
from kernel_cases import rms_normalised as _rms_normalised
from kernel_impls import implementation
from kernel_tolerances import assert_close

from pocketllm.kernels import torch_ops
from pocketllm.kernels.rms_norm import rms_norm_ref
from pocketllm.models.qwen3_5 import offset_norm

OPS = torch_ops()
rms_norm_impl = implementation("rms_norm")


# -- the reference against the formula ---------------------------------------------------------


def _rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x64 = x.double()
    rms = torch.sqrt((x64 * x64).sum(-1, keepdim=True) / x.shape[-1] + eps)
    return (x64 / rms) * weight.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 64), (17, 48), (63, 4, 16), (2, 3, 24)])
def test_rms_norm_matches_formula(dtype, shape):
    """x / sqrt(mean(x^2) + eps) * w over the last dim only (rows and heads are independent)."""
    x = (3.0 * _cpu_randn(*shape, seed=2)).to(dtype)
    weight = (1.0 + 0.1 * _cpu_randn(shape[-1], seed=3)).to(dtype)
    eps = 1e-6
    out = rms_norm_ref(x, weight, eps)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out.double(), _rms_norm_reference(x, weight, eps), **TOL["rms_norm"][dtype])


def test_rms_norm_eps_matters_for_tiny_rows():
    """eps enters under the square root: a row of zeros maps to zeros, a tiny row is damped by eps."""
    x = torch.tensor([[0.0, 0.0, 0.0, 0.0], [1e-4, -1e-4, 1e-4, -1e-4]])
    w = torch.ones(4)
    out = rms_norm_ref(x, w, 1e-6)
    assert torch.equal(out[0], torch.zeros(4))
    expected = 1e-4 / math.sqrt(1e-8 + 1e-6)
    torch.testing.assert_close(out[1], torch.tensor([expected, -expected, expected, -expected]),
                               atol=1e-6, rtol=1e-5)


# -- the torch backend's op against the model definition ---------------------------------------


@pytest.mark.usefixtures("single_torch_thread")  # many tiny ops: threads only add spin-waiting
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_rms_norm_matches_definition(dtype: torch.dtype):
    """Qwen3RMSNorm: weight * x / sqrt(mean(x^2) + eps), the weight used as given (no offset)."""
    gen = _gen(30)
    x = (3.0 * torch.randn(5, 3, 40, generator=gen)).to(dtype)
    weight = (1.0 + 0.5 * torch.randn(40, generator=gen)).to(dtype)
    eps = 0.5  # large enough to show where it enters
    out = OPS.rms_norm(x, weight, eps)
    assert out.dtype == dtype and out.shape == x.shape
    assert_close(out, _rms_normalised(x, eps) * weight.double(), dtype)


@pytest.mark.usefixtures("single_torch_thread")  # many tiny ops: threads only add spin-waiting
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_qwen3_5_norm_is_the_offset_weight(dtype: torch.dtype):
    """Qwen3_5RMSNorm scales by (1 + weight) with weight zero-centred; the engine folds the 1 in
    at load (`offset_norm`) and then runs the plain rms_norm: together they give the definition."""
    gen = _gen(31)
    x = (3.0 * torch.randn(6, 64, generator=gen)).to(dtype)
    weight = (0.1 * torch.randn(64, generator=gen)).to(dtype)
    out = OPS.rms_norm(x, offset_norm(weight), 1e-6)
    assert_close(out, _rms_normalised(x, 1e-6) * (1.0 + weight.double()), dtype)


# -- the kernel against the reference, row invariance ------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", (1, 24, 100, 128))
def test_rms_norm_matches_reference(hidden: int, dtype: torch.dtype):
    """rms_norm_triton equals rms_norm_ref within tolerance, in x's dtype, for rows of any width."""
    x = _randn(17, hidden, seed=hidden, dtype=dtype, scale=3.0)
    weight = _randn(hidden, seed=hidden + 1, dtype=dtype)
    out = rms_norm_impl(x, weight, 1e-6)
    assert out.shape == x.shape and out.dtype == dtype
    assert_close(out, rms_norm_ref(x, weight, 1e-6))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_per_head_on_a_fused_projection_slice(dtype: torch.dtype):
    """The q/k norm case: a [T, heads, D] view of a column slice of a fused qkv output (rows
    contiguous, row stride not D) normalises each head like the reference."""
    tokens, heads, kv_heads, d = 5, 4, 2, 24
    qkv = _randn(tokens, (heads + 2 * kv_heads) * d, seed=3, dtype=dtype, scale=2.0)
    q = qkv[:, :heads * d].reshape(tokens, heads, d)
    k = qkv[:, heads * d:(heads + kv_heads) * d].reshape(tokens, kv_heads, d)
    assert not q.is_contiguous() and not k.is_contiguous()
    weight = _randn(d, seed=4, dtype=dtype)
    for part in (q, k):
        out = rms_norm_impl(part, weight, 1e-6)
        assert out.shape == part.shape
        assert_close(out, rms_norm_ref(part, weight, 1e-6))


def test_rms_norm_any_leading_shape():
    """1-d input and a 4-d input with permuted leading dims (not mergeable into a view) keep their
    shape and match the reference."""
    weight = _randn(16, seed=5)
    for x in (_randn(16, seed=6), _randn(2, 3, 5, 16, seed=7).transpose(1, 2)):
        out = rms_norm_impl(x, weight, 1e-5)
        assert out.shape == x.shape
        assert_close(out, rms_norm_ref(x, weight, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_row_invariant(dtype: torch.dtype):
    """A row normalised alone, and any prefix of rows, gives the same bits as inside the full batch."""
    x = _randn(33, 100, seed=8, dtype=dtype, scale=3.0)
    weight = _randn(100, seed=9, dtype=dtype)
    _assert_rows_invariant(lambda rows: rms_norm_impl(rows, weight, 1e-6), x, (1, 2, 7, 16, 17, 32))
    assert torch.equal(rms_norm_impl(x[20:21], weight, 1e-6), rms_norm_impl(x, weight, 1e-6)[20:21])


# -- CUDA, bf16, model sizes -------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_rms_norm_bf16():
    """bf16 RMSNorm at hidden size 4096 and per head on the q slice of a fused qkv output matches the
    reference, and a single row gives the same bits as inside the batch."""
    x = _randn(256, 4096, seed=11, dtype=torch.bfloat16, device="cuda", scale=3.0)
    weight = _randn(4096, seed=12, dtype=torch.bfloat16, device="cuda")
    out = rms_norm_impl(x, weight, 1e-6)
    assert_close(out, rms_norm_ref(x, weight, 1e-6))
    _assert_rows_invariant(lambda rows: rms_norm_impl(rows, weight, 1e-6), x, (1, 7, 64))
    qkv = _randn(256, (32 + 2 * 8) * 128, seed=13, dtype=torch.bfloat16, device="cuda", scale=2.0)
    q = qkv[:, :32 * 128].reshape(256, 32, 128)
    head_weight = _randn(128, seed=14, dtype=torch.bfloat16, device="cuda")
    assert_close(rms_norm_impl(q, head_weight, 1e-6), rms_norm_ref(q, head_weight, 1e-6))
