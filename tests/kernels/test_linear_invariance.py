"""The torch backend's linear layers are row invariant by construction: every BLAS call has the
shape [tile, K] x [K, N] (4-row tiles for decode rows, 64-row tiles for prefill rows), so a row's
bits cannot depend on the batch size. What remains for the
BLAS is that a row's result does not depend on its position inside a tile. These tests measure
both on the machine that runs them, at 1 and 2 threads (BLAS thresholds move with the thread
count), at the widths of real models and prefill-sized row counts; a negative control shows that
the same checks catch a linear whose rows depend on the row count (planted by construction, so on
every machine; whether one plain GEMM call per batch is such a linear depends on the CPU's BLAS,
which the engine's start-up probe measures where it runs)."""

from __future__ import annotations

import pytest
import torch

from planted import linear_row_count_dependent

from pocketllm.kernels.linear import (
    DECODE_ROW_TILE,
    PREFILL_ROW_TILE,
    linear_per_row,
    linear_row_invariant,
)
from pocketllm.kernels.prefill_linear import prefill_linear_row_invariant

LINEARS = {DECODE_ROW_TILE: linear_row_invariant, PREFILL_ROW_TILE: prefill_linear_row_invariant}


@pytest.fixture(params=[1, 2], ids=lambda n: f"{n}thread")
def threads(request):
    """Run the test body at the given torch (and BLAS) thread count, then restore it."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def _randn(*shape, seed: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


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


# (K, N) of the Qwen3-0.6B-like and Intel-failing shapes named in the design notes.
PREFILL_SHAPES = [(512, 1408), (1408, 512), (1024, 3072), (3072, 1024)]


@pytest.mark.parametrize("k,n", PREFILL_SHAPES)
def test_rows_keep_their_bits_at_prefill_sizes(threads, k, n):
    """The first rows are the same alone (one tile) and inside prefills of up to 1500 rows, where
    a single GEMM call changes its blocking on some CPUs; a row moved to the end of a long prefill
    keeps its bits too."""
    linear_row_invariant = prefill_linear_row_invariant
    ROW_TILE = PREFILL_ROW_TILE  # noqa: N806
    largest = 1500 if k * n < 2_000_000 else 520
    x = _randn(largest, k, seed=k + 7)
    w = _randn(n, k, seed=n + 7)
    head = linear_row_invariant(x[:ROW_TILE], w)
    sizes = [m for m in (17, 100, 257, 513, 1024, 1500) if m <= largest]
    bad = [m for m in sizes if not torch.equal(linear_row_invariant(x[:m], w)[:ROW_TILE], head[:m])]
    assert not bad, f"row results change at M in {bad}"
    moved = torch.cat([x[ROW_TILE:largest], x[:ROW_TILE]])
    assert torch.equal(linear_row_invariant(moved, w)[-ROW_TILE:], head)


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
