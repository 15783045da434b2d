"""linear (pocketllm/kernels/linear.py): y = x @ W^T (+ b).

- the reference and the torch backend's row-invariant linear against the formula in float64;
- the kernel under test (by default the Triton one) against the reference on K tails, odd N and
  strided inputs (fp32 and fp16 on DEVICE; bf16 at Qwen3 layer sizes in the `gpu` tests), and its
  row invariance, bitwise, for every row count and tile position;
- the torch backend's row invariance by construction: every BLAS call has the shape [tile, K] x
  [K, N] (4-row tiles for decode rows, 64-row tiles for the prefill rows of `prefill_linear`), so a
  row's bits cannot depend on the batch size; what remains for the BLAS is that a row's result does
  not depend on its position inside a tile. Measured on the machine that runs the tests, at 1 and 2
  threads (BLAS thresholds move with the thread count); a negative control shows that the same
  checks catch a linear whose rows depend on the row count (planted by construction, so on every
  machine; whether one plain GEMM call per batch is such a linear depends on the CPU's BLAS, which
  the engine's start-up probe measures where it runs). `linear_per_row` (the `decode_per_row`
  option): one row per call.
"""

from __future__ import annotations

import pytest
import torch
from helpers import budget
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_cases import DTYPES, randn_on
from kernel_cases import FORMULA_TOL as TOL
from kernel_cases import assert_rows_invariant as _assert_rows_invariant
from kernel_cases import randn as _randn
from kernel_cases import threads as threads  # the fixture
from kernel_impls import DEVICE, implementation
from kernel_tolerances import assert_close

from pocketllm.kernels._linear_triton import TILES, linear_triton, linear_triton_shards
from pocketllm.kernels._tree import tree_sum
from pocketllm.kernels.linear import (
    DECODE_ROW_TILE,
    PREFILL_ROW_TILE,
    in_shards,
    linear_per_row,
    linear_ref,
    linear_row_invariant,
    native_shards,
)
from pocketllm.kernels.prefill_linear import prefill_linear_row_invariant
from pocketllm.testing.planted import linear_row_count_dependent

linear_impl = implementation("linear")


# -- the reference against the formula ---------------------------------------------------------


def _linear_reference(x, weight, bias):
    out = x.double() @ weight.double().T
    return out + bias.double() if bias is not None else out


@pytest.mark.parametrize("op", [linear_ref, linear_row_invariant])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 17, 63])
def test_linear_matches_formula(op, dtype, with_bias, rows):
    """y = x @ W^T (+ b), shape [M, N], in the input dtype."""
    k, n = 48, 300
    x = _randn(rows, k, seed=rows, dtype=dtype)
    w = _randn(n, k, seed=rows + 1, dtype=dtype)
    b = _randn(n, seed=rows + 2, dtype=dtype) if with_bias else None
    out = op(x, w, b)
    assert out.shape == (rows, n) and out.dtype == dtype
    torch.testing.assert_close(out.double(), _linear_reference(x, w, b), **TOL["linear"][dtype])


# -- the kernel against the reference, row invariance ------------------------------------------


ROW_COUNTS = (1, 2, 17, 63, 64, 65, 130)
# (K, N, with bias): K not a multiple of BLOCK_K, N odd, and one shape of whole tiles.
LINEAR_SHAPES = ((48, 33, True), (100, 130, False), (64, 256, True))
INVARIANCE_ROWS = tuple(range(1, 21)) + (33, 64, 65)


def _linear_inputs(m: int, k: int, n: int, dtype: torch.dtype, device: str = DEVICE, seed: int = 0):
    """x ~ N(0, 1) and W ~ N(0, 1/K), so outputs are O(1) at every K; a bias of O(1)."""
    x = randn_on(m, k, seed=seed, dtype=dtype, device=device)
    weight = randn_on(n, k, seed=seed + 1, dtype=dtype, device=device, scale=k ** -0.5)
    bias = randn_on(n, seed=seed + 2, dtype=dtype, device=device)
    return x, weight, bias


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


# -- the torch backend: row invariant by construction ------------------------------------------


LINEARS = {DECODE_ROW_TILE: linear_row_invariant, PREFILL_ROW_TILE: prefill_linear_row_invariant}


# Small and odd widths (K not a multiple of the alignment unit), and real model widths.
SMALL_SHAPES = [(64, 128), (17, 33), (48, 300), (256, 512), (1000, 77)]


@pytest.mark.parametrize("tile", sorted(LINEARS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("k,n", SMALL_SHAPES)
def test_rows_are_independent_of_row_count_and_position(threads, tile, dtype, with_bias, k, n):
    """For every M in 1..3 tiles + 1 the rows of linear(x[:M]) equal the M = max call bit for bit;
    each row alone and each row moved to another position equals its row in the batch."""
    rows = 3 * tile + 1
    x = _randn(rows, k, seed=k * n, dtype=dtype)
    w = _randn(n, k, seed=k + n, dtype=dtype)
    b = _randn(n, seed=k - n, dtype=dtype) if with_bias else None
    assert _row_defects(LINEARS[tile], x, w, b, tile) == []


def _row_defects(linear, x, w, b, tile) -> list[str]:
    """What breaks row invariance for `linear` on x: row counts M whose rows differ from the full
    call's, rows that differ when computed alone, and row shifts that change a row's bits."""
    rows = x.shape[0]
    full = linear(x, w, b)
    counts = range(1, rows) if tile < 16 else sorted({1, 2, 7, tile - 1, tile, tile + 1, 2 * tile + 5, rows - 1})
    defects = [f"row count {m}" for m in counts if not torch.equal(linear(x[:m], w, b), full[:m])]
    defects += [f"row {j} alone" for j in range(0, rows, max(1, tile // 8))
                if not torch.equal(linear(x[j:j + 1], w, b), full[j:j + 1])]
    defects += [f"shift {shift}" for shift in (1, 5, tile - 1)
                if not torch.equal(linear(x.roll(shift, 0), w, b), full.roll(shift, 0))]
    return defects


@pytest.mark.parametrize("k,n", [(64, 128), (17, 33), (512, 1408)])
def test_negative_control_a_row_count_dependent_linear_is_caught(k, n):
    """The checks above fail on a linear whose rows round differently from 4 rows up: they can see
    a row-count dependence wherever it comes from."""
    x = _randn(3 * DECODE_ROW_TILE + 1, k, seed=k * n + 1)
    w = _randn(n, k, seed=k + n + 1)
    defects = _row_defects(linear_row_count_dependent, x, w, None, DECODE_ROW_TILE)
    assert "row count 1" in defects and "row 0 alone" in defects, defects


def test_tile_bits_do_not_depend_on_input_alignment():
    """A row's result is the same whether the caller's tensor starts on an aligned address or at
    an odd offset: inputs are staged into aligned tiles before the BLAS sees them."""
    k, n = 300, 200
    w = _randn(n, k, seed=3)
    base = _randn(DECODE_ROW_TILE * k + 1, seed=4)
    aligned = base[:DECODE_ROW_TILE * k].view(DECODE_ROW_TILE, k)
    shifted_storage = torch.empty(DECODE_ROW_TILE * k + 1)
    shifted_storage[1:] = aligned.reshape(-1)
    shifted = shifted_storage[1:].view(DECODE_ROW_TILE, k)
    assert shifted.data_ptr() % 64 != aligned.data_ptr() % 64
    assert torch.equal(linear_row_invariant(aligned, w), linear_row_invariant(shifted, w))


# -- one row per call (the `decode_per_row` option) --------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("k,n", SMALL_SHAPES + [(1024, 3072)])
def test_per_row_rows_are_independent_of_the_batch(threads, dtype, with_bias, k, n):
    """linear_per_row: each row of a 9-row batch equals the row alone, and the row among other
    rows at another position, bit for bit; the values agree with F.linear."""
    x = _randn(9, k, seed=k * n + 2, dtype=dtype)
    w = _randn(n, k, seed=k + n + 2, dtype=dtype)
    b = _randn(n, seed=k - n + 2, dtype=dtype) if with_bias else None
    full = linear_per_row(x, w, b)
    tolerance = {torch.float32: 1e-4, torch.float16: 3e-2, torch.bfloat16: 2e-1}[dtype]
    torch.testing.assert_close(full.float(), torch.nn.functional.linear(x, w, b).float(), atol=tolerance, rtol=1e-2)
    for j in range(9):
        assert torch.equal(linear_per_row(x[j:j + 1], w, b), full[j:j + 1]), j
        assert torch.equal(linear_per_row(x[[(j + 3) % 9, j]], w, b)[1:], full[j:j + 1]), j


def test_per_row_blocks_a_large_weight_the_same_in_any_batch(monkeypatch):
    """A weight over MAX_UNBLOCKED_BYTES (an lm_head) is multiplied in BLOCK_ROWS-row blocks, the last
    one short: rows keep their bits alone and in a batch, and equal the unblocked values closely."""
    import pocketllm.kernels.linear as linear

    monkeypatch.setattr(linear, "MAX_UNBLOCKED_BYTES", 64 * 1024)
    monkeypatch.setattr(linear, "BLOCK_ROWS", 96)
    x = _randn(5, 128, seed=11, dtype=torch.float32)
    w = _randn(1000, 128, seed=12, dtype=torch.float32)  # 512 KB: 11 blocks, the last of 40 rows
    full = linear.linear_per_row(x, w)
    torch.testing.assert_close(full, x @ w.T, atol=1e-4, rtol=1e-5)
    assert all(torch.equal(linear.linear_per_row(x[j:j + 1], w), full[j:j + 1]) for j in range(5))


def test_per_row_empty_batch():
    """Zero rows in, zero rows out."""
    out = linear_per_row(torch.empty(0, 32), _randn(16, 32, seed=13, dtype=torch.float32))
    assert out.shape == (0, 16)


# -- the Triton kernel over a row-parallel matrix's shards ---------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("shards", [2, 4, 8])
def test_triton_shards_are_each_shard_product_summed_in_the_tree(dtype, shards):
    """`linear_triton_shards` (one launch): bitwise each K slice's `linear_triton` product, rounded
    to the dtype, summed in the fixed tree (`tree_sum`), for slices of one matrix read in place and
    for separate shards; widths below, at and past a K block, rows across two row tiles; a row's bits
    are the row's alone."""
    block_m, _, block_k = TILES[DEVICE]
    for width in (5, block_k, block_k + 3):
        m = block_m + 3
        x = randn_on(m, shards * width, seed=width + shards, dtype=dtype)
        w = randn_on(19, shards * width, seed=width * shards, dtype=dtype) * width ** -0.5
        views = list(w.split(width, dim=1))
        one_call_each = tree_sum([linear_triton(x[:, i * width:(i + 1) * width].contiguous(), part)
                                  for i, part in enumerate(views)])
        native = linear_triton_shards(x, views)
        assert torch.equal(native, one_call_each), width
        assert torch.equal(linear_triton_shards(x, [v.contiguous() for v in views]), native), width
        assert torch.equal(linear_triton_shards(x[m - 2:], views), native[m - 2:]), width
        assert torch.equal(in_shards(linear_triton, x, views), native), width


def test_triton_shards_negative_control_a_sequential_sum_is_told_apart():
    """The comparison above can fail: the same shard products added left to right, rather than in the
    tree, differ from the kernel at 8 shards (values picked so that the two orders round apart)."""
    x = torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]], device=DEVICE)
    w = torch.tensor([[1.0, 0.0, 2.0 ** -24, 2.0 ** -24, 0.0, 0.0, 0.0, 0.0]], device=DEVICE)
    views = list(w.split(1, dim=1))
    parts = [linear_triton(x[:, i:i + 1].contiguous(), v) for i, v in enumerate(views)]
    sequential = parts[0]
    for part in parts[1:]:
        sequential = sequential + part
    assert torch.equal(linear_triton_shards(x, views), tree_sum(parts))
    assert not torch.equal(linear_triton_shards(x, views), sequential)


def test_triton_shards_are_native_for_every_dtype_and_refuse_what_they_cannot_sum():
    assert native_shards(linear_triton, torch.float16) is linear_triton_shards
    assert native_shards(linear_ref, torch.float32) is None
    # More shards than the kernel's tree holds: one launch per shard, the same tree.
    assert native_shards(linear_triton, torch.float32, 16) is None
    x16, w16 = randn_on(2, 64, seed=3, dtype=torch.float32), randn_on(5, 64, seed=4, dtype=torch.float32)
    parts = list(w16.split(4, dim=1))
    each = [linear_triton(x16[:, i * 4:(i + 1) * 4].contiguous(), p) for i, p in enumerate(parts)]
    assert torch.equal(in_shards(linear_triton, x16, parts), tree_sum(each))
    w = randn_on(7, 24, seed=1, dtype=torch.float32)
    x = randn_on(3, 24, seed=2, dtype=torch.float32)
    with pytest.raises(ValueError, match="2, 4 or 8 shards"):
        linear_triton_shards(x, list(w.split(8, dim=1)))
    with pytest.raises(ValueError, match="differ in shape"):
        linear_triton_shards(x, [w[:, :12], w[:, 12:20]])
    with pytest.raises(ValueError, match=r"x must be \[M, 24\]"):
        linear_triton_shards(x[:, :20], list(w.split(12, dim=1)))


# -- CUDA, bf16, model sizes -------------------------------------------------------------------


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
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32), ids=str)
@pytest.mark.parametrize("m", (1, 8, 256))
def test_gpu_triton_shards_are_one_launch_per_shard_in_the_tree(m: int, dtype: torch.dtype):
    """Compiled (tensor cores for bf16, the IEEE fp32 dot for fp32), at Qwen3-0.6B's o_proj (2048 ->
    1024) and down_proj (3072 -> 1024) widths: the one launch over 8 shards gives the bits of one
    launch per shard summed by tree_sum, and of 2 launches of 4 shards (TP=2's ranks) summed."""
    for k in (2048, 3072):
        x, weight, _ = _linear_inputs(m, k, 1024, dtype, device="cuda")
        views = list(weight.split(k // 8, dim=1))
        width = k // 8
        each = [linear_triton(x[:, i * width:(i + 1) * width].contiguous(), v) for i, v in enumerate(views)]
        native = linear_triton_shards(x, views)
        assert torch.equal(native, tree_sum(each)), k
        halves = [linear_triton_shards(x[:, h * k // 2:(h + 1) * k // 2].contiguous(), views[4 * h:4 * h + 4])
                  for h in range(2)]
        assert torch.equal(native, tree_sum(halves)), k
