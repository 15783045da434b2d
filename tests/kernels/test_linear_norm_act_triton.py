"""The Triton linear, RMSNorm and SiLU-and-mul kernels: each against its torch reference (fp32 and
fp16 under the interpreter, bf16 at model sizes on CUDA) and bitwise row invariance."""

import pytest
import torch
from helpers import budget
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_impls import DEVICE, implementation
from kernel_tolerances import assert_close

from pocketllm.kernels.linear import TILES, linear_ref
from pocketllm.kernels.rms_norm import rms_norm_ref
from pocketllm.kernels.silu_and_mul import silu_and_mul_ref

linear_impl = implementation("linear")
rms_norm_impl = implementation("rms_norm")
silu_and_mul_impl = implementation("silu_and_mul")

ROW_COUNTS = (1, 2, 17, 63, 64, 65, 130)
# (K, N, with bias): K not a multiple of BLOCK_K, N odd, and one shape of whole tiles.
LINEAR_SHAPES = ((48, 33, True), (100, 130, False), (64, 256, True))
INVARIANCE_ROWS = tuple(range(1, 21)) + (33, 64, 65)
DTYPES = (torch.float32, torch.float16)
# The fp32/fp16 tests run on DEVICE: CPU tensors under the interpreter, CUDA ones with a GPU.


def _randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32, device: str = DEVICE,
           scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=gen)).to(device=device, dtype=dtype)


def _linear_inputs(m: int, k: int, n: int, dtype: torch.dtype, device: str = DEVICE, seed: int = 0):
    """x ~ N(0, 1) and W ~ N(0, 1/K), so outputs are O(1) at every K; a bias of O(1)."""
    x = _randn(m, k, seed=seed, dtype=dtype, device=device)
    weight = _randn(n, k, seed=seed + 1, dtype=dtype, device=device, scale=k ** -0.5)
    bias = _randn(n, seed=seed + 2, dtype=dtype, device=device)
    return x, weight, bias


def _assert_rows_invariant(fn, x: torch.Tensor, row_counts) -> None:
    """fn on the first m rows gives bit for bit the first m rows of fn on all rows."""
    full = fn(x)
    for m in row_counts:
        assert torch.equal(fn(x[:m]), full[:m]), f"rows 0..{m} differ from the same rows of the full batch"


# -- linear ------------------------------------------------------------------------------------------


def test_linear_test_shapes_cover_partial_tiles():
    """The shapes below really exercise masking: a K tail, an odd N, and N beyond one tile."""
    ks, ns = [k for k, _, _ in LINEAR_SHAPES], [n for _, n, _ in LINEAR_SHAPES]
    _, BLOCK_N, BLOCK_K = TILES[DEVICE]  # noqa: N806
    assert any(k % BLOCK_K for k in ks) and any(n % 2 for n in ns) and any(n > BLOCK_N for n in ns)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("k,n,with_bias", LINEAR_SHAPES)
def test_linear_matches_reference(k: int, n: int, with_bias: bool, dtype: torch.dtype):
    """linear_triton equals F.linear within the dtype's tolerance for every row count, with and
    without a bias."""
    x, weight, bias = _linear_inputs(max(ROW_COUNTS), k, n, dtype)
    bias = bias if with_bias else None
    for m in ROW_COUNTS:
        out = linear_impl(x[:m], weight, bias)
        assert out.shape == (m, n) and out.dtype == dtype
        assert_close(out, linear_ref(x[:m], weight, bias))


def test_linear_strided_input():
    """A column slice of a wider tensor (row stride != K) gives the same bits as its contiguous
    copy, and matches the reference."""
    wide, weight, bias = _linear_inputs(19, 80, 33, torch.float32)
    x, weight = wide[:, 5:53], weight[:, :48].contiguous()
    assert not x.is_contiguous()
    out = linear_impl(x, weight, bias)
    assert torch.equal(out, linear_impl(x.contiguous(), weight, bias))
    assert_close(out, linear_ref(x, weight, bias))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_linear_row_invariant(dtype: torch.dtype):
    """Each row's bits do not depend on how many rows share the call."""
    x, weight, bias = _linear_inputs(max(INVARIANCE_ROWS), 100, 33, dtype)
    _assert_rows_invariant(lambda rows: linear_impl(rows, weight, bias), x, INVARIANCE_ROWS)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_linear_rows_keep_their_bits_at_every_tile_position(dtype: torch.dtype):
    """A row moved to another position of its row tile (as other requests come and go) keeps its
    bits: rolled inputs give rolled outputs, for shifts within and across tiles."""
    x, weight, bias = _linear_inputs(37, 100, 33, dtype)
    full = linear_impl(x, weight, bias)
    for shift in (1, 5, 15, 16, 21):
        assert torch.equal(linear_impl(x.roll(shift, 0), weight, bias), full.roll(shift, 0)), shift


@settings(deadline=None, max_examples=budget(0.3))
@given(m=st.integers(1, 40), extra=st.integers(1, 40), k=st.integers(1, 80), n=st.integers(1, 80),
       seed=st.integers(0, 2**16))
def test_linear_row_invariant_property(m: int, extra: int, k: int, n: int, seed: int):
    """For any shape, the first m rows of a batch of m + extra rows equal the same rows computed alone."""
    x, weight, bias = _linear_inputs(m + extra, k, n, torch.float32, seed=seed)
    _assert_rows_invariant(lambda rows: linear_impl(rows, weight, bias), x, (m,))


# -- rms_norm ----------------------------------------------------------------------------------------


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


# -- silu_and_mul ------------------------------------------------------------------------------------


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


# -- CUDA, bf16, model sizes -------------------------------------------------------------------------


GPU_LINEAR_SHAPES = ((4096, 4096), (4096, 12288))


@pytest.mark.gpu
@pytest.mark.parametrize("k,n", GPU_LINEAR_SHAPES)
@pytest.mark.parametrize("m", (1, 8, 256, 4096))
def test_gpu_linear_bf16_matches_reference(m: int, k: int, n: int):
    """bf16 linear at Qwen3 layer sizes agrees with cuBLAS within the bf16 tolerance, with and
    without a bias."""
    x, weight, bias = _linear_inputs(m, k, n, torch.bfloat16, device="cuda")
    assert_close(linear_impl(x, weight, bias), linear_ref(x, weight, bias))
    assert_close(linear_impl(x, weight), linear_ref(x, weight))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32), ids=str)
@pytest.mark.parametrize("k,n", GPU_LINEAR_SHAPES)
def test_gpu_linear_row_invariant(k: int, n: int, dtype: torch.dtype):
    """On CUDA (persistent grid, tensor cores for bf16, IEEE fp32 dot for fp32), a decode-sized
    call gives the same bits as the same rows inside a 256-row prefill."""
    x, weight, bias = _linear_inputs(256, k, n, dtype, device="cuda")
    _assert_rows_invariant(lambda rows: linear_impl(rows, weight, bias), x, (1, 2, 8, 63, 64, 65, 200))


@pytest.mark.gpu
def test_gpu_linear_fp32_is_not_tf32():
    """fp32 inputs are multiplied in IEEE fp32, not TF32: the result matches a float64 product to
    fp32 accuracy (TF32 keeps 10 mantissa bits and would miss by about 1e-3)."""
    x, weight, bias = _linear_inputs(64, 4096, 256, torch.float32, device="cuda")
    exact = linear_ref(x.double(), weight.double(), bias.double())
    torch.testing.assert_close(linear_impl(x, weight, bias).double(), exact, atol=1e-4, rtol=1e-4)


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


@pytest.mark.gpu
def test_gpu_silu_and_mul_bf16():
    """bf16 SiLU-and-mul at intermediate size 12288 matches the reference and is row invariant."""
    gate_up = _randn(256, 2 * 12288, seed=15, dtype=torch.bfloat16, device="cuda", scale=4.0)
    assert_close(silu_and_mul_impl(gate_up), silu_and_mul_ref(gate_up))
    _assert_rows_invariant(silu_and_mul_impl, gate_up, (1, 7, 64))
