"""silu_and_mul (pocketllm/kernels/silu_and_mul.py): [T, 2I] -> silu(gate) * up, gate the first I
columns.

- the reference against the formula in float64;
- the kernel under test (by default the Triton one) against the reference, widths up to more than
  one column block (fp32 and fp16 on DEVICE; bf16 at model sizes in the `gpu` test);
- its row invariance, bitwise: every prefix of rows equals the same rows of the full batch.
"""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DTYPES
from kernel_cases import FORMULA_TOL as TOL
from kernel_cases import assert_rows_invariant as _assert_rows_invariant
from kernel_cases import randn as _cpu_randn
from kernel_cases import randn_on as _randn
from kernel_impls import implementation
from kernel_tolerances import assert_close

from pocketllm.kernels.silu_and_mul import silu_and_mul_ref

silu_and_mul_impl = implementation("silu_and_mul")


# -- the reference against the formula ---------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_tokens,inter", [(1, 16), (17, 96), (65, 24)])
def test_silu_and_mul_matches_formula(dtype, num_tokens, inter):
    """[T, 2I] -> gate * sigmoid(gate) * up with gate the first I columns."""
    gate_up = (2.0 * _cpu_randn(num_tokens, 2 * inter, seed=inter)).to(dtype)
    gate, up = gate_up[:, :inter].double(), gate_up[:, inter:].double()
    expected = gate / (1.0 + torch.exp(-gate)) * up
    out = silu_and_mul_ref(gate_up)
    assert out.shape == (num_tokens, inter) and out.dtype == dtype
    torch.testing.assert_close(out.double(), expected, **TOL["silu_and_mul"][dtype])


# -- the kernel against the reference, row invariance ------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("inter", (1, 33, 1500))
def test_silu_and_mul_matches_reference(inter: int, dtype: torch.dtype):
    """silu_and_mul_triton equals the reference (gate first, up second), including widths over one
    column block."""
    gate_up = _randn(7, 2 * inter, seed=inter, dtype=dtype, scale=4.0)
    out = silu_and_mul_impl(gate_up)
    assert out.shape == (7, inter) and out.dtype == dtype
    assert_close(out, silu_and_mul_ref(gate_up))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_and_mul_row_invariant(dtype: torch.dtype):
    """Every prefix of rows gives the same bits as inside the full batch."""
    gate_up = _randn(17, 2 * 40, seed=10, dtype=dtype, scale=4.0)
    _assert_rows_invariant(silu_and_mul_impl, gate_up, (1, 2, 5, 16))


# -- CUDA, bf16, model sizes -------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_silu_and_mul_bf16():
    """bf16 SiLU-and-mul at intermediate size 12288 matches the reference and is row invariant."""
    gate_up = _randn(256, 2 * 12288, seed=15, dtype=torch.bfloat16, device="cuda", scale=4.0)
    assert_close(silu_and_mul_impl(gate_up), silu_and_mul_ref(gate_up))
    _assert_rows_invariant(silu_and_mul_impl, gate_up, (1, 7, 64))
