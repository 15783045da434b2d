"""rms_norm_gated (pocketllm/kernels/rms_norm_gated.py), the gated RMSNorm of Gated DeltaNet:
weight * x / sqrt(mean(x^2) + eps) * silu(gate) over the last axis, normalised before the gate.

- the reference against the formula in float64, and the torch backend's op against the model
  definition (Qwen3_5RMSNormGated);
- the kernel under test (by default the Triton one) against the reference with a strided gate,
  weights in x's dtype and in fp32, and any leading shape (fp32 and fp16 on DEVICE; bf16 at model
  sizes in the `gpu` test);
- its row invariance, bitwise: prefixes of the rows and a single row equal the full batch's.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_cases import DTYPES
from kernel_cases import gen as _gen
from kernel_cases import randn_on as _randn
from kernel_cases import rms_normalised as _rms_normalised
from kernel_impls import DEVICE, implementation
from kernel_tolerances import assert_close

from pocketllm.kernels import torch_ops
from pocketllm.kernels.rms_norm_gated import rms_norm_gated_ref

OPS = torch_ops()
rms_norm_gated_impl = implementation("rms_norm_gated")


# -- the reference against the formula and the model definition --------------------------------


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


@pytest.mark.usefixtures("single_torch_thread")  # many tiny ops: threads only add spin-waiting
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_rms_norm_gated_matches_definition(dtype: torch.dtype):
    """Qwen3_5RMSNormGated: weight * x / sqrt(mean(x^2) + eps) * silu(gate), normalised before the
    gate (the gate does not enter the mean), weight used as given, over each head's last axis."""
    gen = _gen(32)
    x = (3.0 * torch.randn(7, 2, 24, generator=gen)).to(dtype)
    gate = (2.0 * torch.randn(7, 2, 24, generator=gen)).to(dtype)
    weight = (1.0 + 0.5 * torch.randn(24, generator=gen)).to(dtype)
    eps = 0.25
    out = OPS.rms_norm_gated(x, gate, weight, eps)
    assert out.dtype == dtype and out.shape == x.shape
    expected = _rms_normalised(x, eps) * weight.double() * F.silu(gate.double())
    assert_close(out, expected, dtype)


# -- the kernel against the reference, row invariance ------------------------------------------


def _gated_inputs(rows: int, heads: int, hidden: int, dtype: torch.dtype, seed: int, device: str = DEVICE):
    """x [rows, heads, H] contiguous and gate as a [rows, heads, H] view of a column slice of a
    wider projection (as the model's fused z projection gives it)."""
    x = _randn(rows, heads, hidden, seed=seed, dtype=dtype, device=device, scale=3.0)
    wide = _randn(rows, 2 * heads * hidden, seed=seed + 1, dtype=dtype, device=device, scale=2.0)
    gate = wide[:, heads * hidden:].reshape(rows, heads, hidden)
    return x, gate


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", (1, 37, 128))
def test_rms_norm_gated_matches_reference(hidden: int, dtype: torch.dtype):
    """x [17, 3, H] with a strided gate: the kernel matches the reference in x's dtype, with a
    weight of x's dtype and with an fp32 weight (the norm then stays in fp32 before the gate)."""
    x, gate = _gated_inputs(17, 3, hidden, dtype, seed=hidden)
    assert not gate.is_contiguous()
    for weight_dtype in (dtype, torch.float32):
        weight = _randn(hidden, seed=hidden + 2, dtype=weight_dtype)
        out = rms_norm_gated_impl(x, gate, weight, 1e-6)
        assert out.shape == x.shape and out.dtype == dtype
        assert_close(out, rms_norm_gated_ref(x, gate, weight, 1e-6))


def test_rms_norm_gated_any_leading_shape():
    """1-d rows and 4-d inputs with permuted leading dims keep their shape and match the reference."""
    weight = _randn(16, seed=5)
    for shape, perm in (((16,), (0,)), ((2, 3, 5, 16), (0, 2, 1, 3))):
        x = _randn(*shape, seed=6).permute(perm)
        gate = _randn(*shape, seed=7).permute(perm)
        out = rms_norm_gated_impl(x, gate, weight, 1e-5)
        assert out.shape == x.shape
        assert_close(out, rms_norm_gated_ref(x, gate, weight, 1e-5))


def _check_gated_rows_invariant(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                                prefixes: tuple[int, ...]) -> None:
    """Any prefix of rows, and a single row, gives bitwise the same rows as the full batch."""
    full = rms_norm_gated_impl(x, gate, weight, 1e-6)
    for m in prefixes:
        assert torch.equal(rms_norm_gated_impl(x[:m], gate[:m], weight, 1e-6), full[:m]), m
    last = x.shape[0] - 1
    assert torch.equal(rms_norm_gated_impl(x[last:], gate[last:], weight, 1e-6), full[last:])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_gated_row_invariant(dtype: torch.dtype):
    """Prefixes of 1, 2, 7, 16 of 33 rows, and the last row alone, are bitwise the full batch's."""
    x, gate = _gated_inputs(33, 2, 100, dtype, seed=8)
    _check_gated_rows_invariant(x, gate, _randn(100, seed=9, dtype=dtype), (1, 2, 7, 16))


# -- CUDA, bf16, model sizes -------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_rms_norm_gated():
    """bf16 [4096, 32, 128] with a strided gate: matches the reference (bf16 and fp32 weights) and
    prefixes of the rows are bitwise the full batch's."""
    x, gate = _gated_inputs(4096, 32, 128, torch.bfloat16, seed=51, device="cuda")
    for weight_dtype in (torch.bfloat16, torch.float32):
        weight = _randn(128, seed=52, dtype=weight_dtype, device="cuda")
        assert_close(rms_norm_gated_impl(x, gate, weight, 1e-6), rms_norm_gated_ref(x, gate, weight, 1e-6))
    _check_gated_rows_invariant(x, gate, weight, (1, 7, 64, 4000))
