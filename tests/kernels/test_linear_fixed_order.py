"""linear 'fixed_order' (pocketllm/kernels/cpu/): the C++ CPU kernel that owns its reduction order.

- against the formula in float64, and against a float64-emulated run of the documented order
  (16 FMA lanes over K, the zero-padded tail, the fixed tree, then the bias), bit for bit;
- a row's bits: the same alone and in any row count 1..64, at any position, at 1 and 2 threads
  (torch.set_num_threads, which the kernel's at::parallel_for follows), for misaligned and
  non-contiguous inputs, and the same from the AVX2 variant as from the AVX-512 one;
- 5 to 8 rows (AVX2's two row groups, interleaved over K in chunks whose lanes are carried between
  them): every row alone and the documented order, K around the chunks' boundaries;
- many rows (from 16 on the kernel packs x and W and carries each lane over K in blocks): every
  row is the same as computed alone and as the documented order, for row counts around the row
  groups (8 rows on AVX-512, 6 on AVX2), K across several blocks with a tail, N across several blocks
  of columns and not a multiple of the tile, with and without a bias, at 1 and 2 threads, with the
  packed tiles taking two lanes at once and one (each CPU picks one for speed; both run here);
- bf16 weights (widened to fp32 as they are loaded): the bits of the same weights widened beforehand,
  for any row count (direct and packed tiles), K with and without a tail, both variants; the avx2
  implementation registered beside the default gives the default's bits;
- a row-parallel matrix in K shards (`linear_shards`, `in_shards`): bitwise each shard's product
  summed in the fixed tree, for 2, 4 and 8 shards, both variants, fp32 and bf16 weights; under bf16
  and fp16 rows, in one call, bitwise one call per shard (each rounded) summed by `tree_sum` in that
  dtype, where fp32 sums rounded once are told apart;
- a negative control: the same bitwise check tells a K-split reduction from the kernel's;
- without a compiler (or with a broken one) the loader warns once, naming why, and returns None,
  and the op raises instead of falling back.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from kernel_cases import lane_pairing as lane_pairing  # the fixtures
from kernel_cases import threads as threads

from pocketllm.kernels._tree import tree_sum
from pocketllm.kernels.cpu.extension import load_extension
from pocketllm.kernels.linear import in_shards, linear_fixed_order, linear_fixed_order_avx2, native_shards
from pocketllm.kernels.registry import IMPLEMENTATIONS

EXT = load_extension()
if EXT is None:
    pytest.skip("the C++ CPU kernels cannot be built here (no compiler or ninja)", allow_module_level=True)
VARIANTS = ["avx2"] + (["avx512"] if EXT.best_variant() == "avx512" else [])
REPO = Path(__file__).resolve().parents[2]


def _data(m, n, k, seed=0, bias=True):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen)
    w = torch.randn(n, k, generator=gen) * k ** -0.5
    return x, w, (torch.randn(n, generator=gen) if bias else None)


def _documented_order(x, w, b):
    """The kernel's order, emulated: fp32 lanes, each FMA as an exact float64 product and sum rounded
    once to fp32 (exact for these sizes but in the rarest double-rounding cases)."""
    m, k = x.shape
    padded = -(-k // 16) * 16
    xp, wp = F.pad(x, (0, padded - k)).double(), F.pad(w, (0, padded - k)).double()
    lanes = torch.zeros(m, w.shape[0], 16)
    for k0 in range(0, padded, 16):
        lanes = (xp[:, None, k0:k0 + 16] * wp[None, :, k0:k0 + 16] + lanes.double()).float()
    for half in (8, 4, 2, 1):
        lanes = lanes[..., :half] + lanes[..., half:2 * half]
    out = lanes[..., 0]
    return out if b is None else out + b


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("k", [1, 15, 16, 17, 40, 83, 1029])
def test_matches_the_formula_and_the_documented_order(variant, k):
    for m, n, bias in ((1, 1, False), (5, 7, True), (9, 70, True)):
        x, w, b = _data(m, n, k, seed=k, bias=bias)
        got = EXT.linear(x, w, b, variant)
        want = x.double() @ w.double().T + (0 if b is None else b.double())
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
        assert torch.equal(got, _documented_order(x, w, b)), (m, n, k)


def test_the_op_is_registered_and_handles_dtypes_and_empty_batches():
    assert IMPLEMENTATIONS["linear"]["fixed_order"] is linear_fixed_order
    assert IMPLEMENTATIONS["prefill_linear"]["fixed_order"] is linear_fixed_order
    x, w, b = _data(3, 10, 33)
    assert linear_fixed_order(x[:0], w, b).shape == (0, 10)
    assert linear_fixed_order(x, w[:0], b[:0]).shape == (3, 0)
    half = linear_fixed_order(x.half(), w.half(), b.half())
    assert half.dtype == torch.float16
    assert torch.equal(half, linear_fixed_order(x.half().float(), w.half().float(), b.half().float()).half())
    with pytest.raises(ValueError, match="fp32"):
        linear_fixed_order(x.double(), w.double())
    with pytest.raises(ValueError, match="fp32"):
        EXT.linear(x.half(), w.half())
    with pytest.raises(ValueError, match="bf16 under fp32 x"):
        linear_fixed_order(x.half(), w.bfloat16())
    with pytest.raises(ValueError, match="K=33"):
        linear_fixed_order(x[:, :5], w)


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_row_is_the_same_in_any_row_count_and_position(variant):
    x, w, b = _data(64, 37, 83, seed=1)
    alone = torch.cat([EXT.linear(x[i:i + 1], w, b, variant) for i in range(64)])
    for count in range(1, 65):
        assert torch.equal(EXT.linear(x[:count], w, b, variant), alone[:count]), count
    for shift in range(1, 64):
        assert torch.equal(EXT.linear(x.roll(shift, 0), w, b, variant), alone.roll(shift, 0)), shift


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("m, n, k", [(15, 50, 83), (16, 50, 83), (63, 97, 17), (64, 149, 600), (65, 7, 1029),
                                     (127, 49, 5), (129, 100, 512), (200, 53, 33), (512, 20, 100),
                                     (17, 35, 2071), (33, 40, 4100), (16, 64, 64), (20, 1024, 64)])
def test_many_rows_are_each_row_alone_and_the_documented_order(variant, m, n, k, threads, lane_pairing):
    """N = 64 and 1024 (Qwen3-0.6B's hidden size: blocks of 96 columns, the last one 64 wide) end on a
    block narrower than its tiles by a whole 16 columns and more: what the kernel writes past a block's
    own columns lands in the next row's."""
    x, w, b = _data(m, n, k, seed=m + k, bias=m % 2 == 1)
    got = EXT.linear(x, w, b, variant)  # at `threads` threads, the rows alone at 1
    torch.set_num_threads(1)
    alone = torch.cat([EXT.linear(x[i:i + 1], w, b, variant) for i in range(m)])
    assert torch.equal(got, alone), (m, n, k)
    assert torch.equal(got, _documented_order(x, w, b)), (m, n, k)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("weights", ["float32", "bfloat16"])
@pytest.mark.parametrize("k", [511, 512, 513, 1024, 1040, 1543])
def test_interleaved_row_groups_carry_their_lanes_over_k_exactly(variant, weights, k, threads):
    """5 to 8 rows on AVX2 (two row groups) run the groups interleaved over chunks of 512 elements of K,
    each output's lanes stored and loaded between chunks: K below, at and past one and two chunks, a
    last chunk of a tail only (1543 = 3 * 512 + 7): every row alone and the documented order."""
    for m in (5, 6, 8):
        x, w, b = _data(m, 13, k, seed=m * k, bias=m != 6)
        w = w.to(getattr(torch, weights))
        got = EXT.linear(x, w, b, variant)
        torch.set_num_threads(1)
        alone = torch.cat([EXT.linear(x[i:i + 1], w, b, variant) for i in range(m)])
        torch.set_num_threads(threads)
        assert torch.equal(got, alone), (m, k)
        assert torch.equal(got, _documented_order(x, w.float(), b)), (m, k)


def test_the_thread_count_changes_no_bit(threads):
    x, w, b = _data(7, 1000, 200, seed=2)
    torch.set_num_threads(1)
    one = linear_fixed_order(x, w, b)
    torch.set_num_threads(threads)
    assert torch.equal(linear_fixed_order(x, w, b), one)
    assert torch.equal(linear_fixed_order(x[3:4], w, b), one[3:4])


def test_misaligned_and_strided_inputs_change_no_bit():
    x, w, b = _data(6, 21, 77, seed=3)
    want = linear_fixed_order(x, w, b)
    x_buffer, w_buffer = torch.empty(x.numel() + 1), torch.empty(w.numel() + 1)
    x_off, w_off = x_buffer[1:].view_as(x), w_buffer[1:].view_as(w)
    x_off.copy_(x)
    w_off.copy_(w)
    assert x_off.data_ptr() % 8 == 4
    assert torch.equal(linear_fixed_order(x_off, w_off, b), want)
    assert torch.equal(linear_fixed_order(x.T.contiguous().T, w, b), want)  # non-contiguous x


@pytest.mark.skipif(len(VARIANTS) < 2, reason="this CPU has no AVX-512F")
@pytest.mark.parametrize("k", [7, 16, 100, 1024, 1031])
def test_the_avx2_variant_gives_the_avx512_bits(k):
    x, w, b = _data(11, 45, k, seed=k)  # 8-row and 3-row tiles (AVX-512) against 4-row ones (AVX2)
    assert torch.equal(EXT.linear(x, w, b, "avx2"), EXT.linear(x, w, b, "avx512"))
    assert torch.equal(EXT.linear(x, w, b), EXT.linear(x, w, b, "avx512"))
    x, w, b = _data(70, 101, k, seed=k)  # many rows: tiles of 8 rows x 48 columns against 6 x 16
    assert torch.equal(EXT.linear(x, w, b, "avx2"), EXT.linear(x, w, b, "avx512"))


def test_negative_control_a_k_split_reduction_is_told_apart():
    """Summing two halves of K separately (a split-K order) must fail the bitwise check that the
    kernel passes, so that check can see a change of order."""
    x, w, _ = _data(4, 64, 2048, seed=4, bias=False)
    whole = EXT.linear(x, w)
    half = x.shape[1] // 2
    split = EXT.linear(x[:, :half], w[:, :half]) + EXT.linear(x[:, half:], w[:, half:])
    torch.testing.assert_close(split, whole)  # the same product...
    assert not torch.equal(split, whole)  # ...in another order


def test_without_a_compiler_the_loader_warns_once_and_returns_none(tmp_path):
    script = textwrap.dedent("""
        import os, warnings
        from pocketllm.kernels.cpu import extension
        from pocketllm.kernels.linear import linear_fixed_order, linear_fixed_order_avx2
        for cxx in ("/nonexistent/c++", "/bin/false"):
            os.environ["CXX"] = cxx
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                first, second = extension.load_extension(), extension.load_extension()
            print(cxx, first is None and second is None, len(caught), caught[0].message)
        try:
            linear_fixed_order(*[__import__("torch").ones(1, 1)] * 2)
        except RuntimeError as exc:
            print("raised", exc)
    """)
    env = dict(os.environ, POCKETLLM_EXTENSIONS_DIR=str(tmp_path), PYTHONPATH=str(REPO))
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("/nonexistent/c++ True 1 ") and "no C++ compiler '/nonexistent/c++'" in lines[0]
    assert lines[1].startswith("/bin/false True 1 ") and "the build failed" in lines[1], lines[1]
    assert lines[2].startswith("raised linear 'fixed_order' needs pocketllm's C++ CPU kernels: the build failed"), \
        lines[2]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("m", [1, 2, 3, 8, 15, 16, 40])
@pytest.mark.parametrize("k", [5, 16, 83, 1024])
def test_bf16_weights_give_the_bits_of_the_same_weights_in_fp32(variant, m, k):
    """A bf16 W is widened exactly as it is loaded, so the order runs on the same fp32 values: bitwise
    the product with W.float(), by the direct tiles (below 16 rows) and the packed ones."""
    x, w, b = _data(m, 61, k, seed=m * k)
    narrow = w.bfloat16()
    got = EXT.linear(x, narrow, b, variant)
    assert torch.equal(got, EXT.linear(x, narrow.float(), b, variant))
    torch.testing.assert_close(got.double(), x.double() @ narrow.double().T + b.double(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("weights", ["float32", "bfloat16"])
@pytest.mark.parametrize("residue", range(16))
def test_every_k_residue_is_the_documented_order(variant, weights, residue, lane_pairing):
    """Each tail length K % 16 (0..15), below and above one 16-lane step, by the direct tiles (1 and 5
    rows) and the packed ones (20 rows), fp32 and bf16 weights: the documented order, bit for bit. A
    tail load that reads a wrong lane for some residues only is caught here."""
    for k in (residue or 16, 32 + residue):
        for m in (1, 5, 20):
            x, w, b = _data(m, 19, k, seed=1000 * m + k)
            w = w.to(getattr(torch, weights))
            assert torch.equal(EXT.linear(x, w, b, variant), _documented_order(x, w.float(), b)), (m, k)


def test_bf16_weights_under_narrow_rows_round_once():
    """Rows in bf16 (an engine in bf16) over bf16 weights: widened, multiplied in the fixed order,
    rounded once to bf16."""
    x, w, b = _data(5, 30, 40, seed=9)
    x16, w16, b16 = x.bfloat16(), w.bfloat16(), b.bfloat16()
    got = linear_fixed_order(x16, w16, b16)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, EXT.linear(x16.float(), w16.float(), b16.float()).bfloat16())


def test_the_avx2_implementation_is_registered_and_gives_the_default_bits():
    assert IMPLEMENTATIONS["linear"]["fixed_order_avx2"] is linear_fixed_order_avx2
    assert IMPLEMENTATIONS["prefill_linear"]["fixed_order_avx2"] is linear_fixed_order_avx2
    for m in (1, 4, 33):
        x, w, b = _data(m, 40, 100, seed=m)
        assert torch.equal(linear_fixed_order_avx2(x, w, b), linear_fixed_order(x, w, b))
        assert torch.equal(linear_fixed_order_avx2(x, w.bfloat16(), b), linear_fixed_order(x, w.bfloat16(), b))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("weights", ["float32", "bfloat16"])
@pytest.mark.parametrize("shards", [2, 4, 8])
def test_the_kernel_sums_its_shards_as_one_call_per_shard_and_the_tree_do(variant, weights, shards, threads,
                                                                          lane_pairing):
    """`linear_shards` (the row-parallel product's order in one call): bitwise each K slice's product
    by `linear`, summed in the fixed tree, for the direct and the packed tiles and slices with a tail
    (widths 17, 40, 64, and 2071: K blocks of the packed tiles); the shards as column slices of one
    matrix (read in place) give the same bits; and a row's bits are those of the row alone."""
    for width in (17, 40, 64, 2071):
        for m in (1, 2, 5, 15, 16, 20, 33):
            x, w, _ = _data(m, 37, shards * width, seed=m * width + shards, bias=False)
            w = w.to(getattr(torch, weights))
            parts = [w[:, i * width:(i + 1) * width].contiguous() for i in range(shards)]
            native = EXT.linear_shards(x, parts, variant)
            one_call_each = tree_sum([EXT.linear(x[:, i * width:(i + 1) * width].contiguous(), part, None, variant)
                                      for i, part in enumerate(parts)])
            assert torch.equal(native, one_call_each), (width, m)
            assert torch.equal(EXT.linear_shards(x, list(w.split(width, dim=1)), variant), native), (width, m)
            assert torch.equal(EXT.linear_shards(x[m - 1:], parts, variant), native[m - 1:]), (width, m)


def test_in_shards_runs_the_kernel_natively_and_any_other_linear_one_call_per_shard():
    x, w, _ = _data(6, 20, 64, seed=7, bias=False)
    parts = list(w.split(16, dim=1))
    calls = []

    def counting(x, weight, bias=None):
        calls.append(x.shape[1])
        return linear_fixed_order(x, weight, bias)

    want = tree_sum([linear_fixed_order(x[:, i * 16:(i + 1) * 16].contiguous(), p) for i, p in enumerate(parts)])
    assert torch.equal(in_shards(linear_fixed_order, x, parts), want)
    assert torch.equal(in_shards(counting, x, parts), want) and calls == [16] * 4
    assert torch.equal(in_shards(linear_fixed_order, x, [w]), linear_fixed_order(x, w))
    with pytest.raises(ValueError, match="power of two"):
        EXT.linear_shards(x[:, :48], parts[:3])
    # Every shard is checked, not only the first: a narrower, a wider, a bf16 and a 1-D last shard.
    for last in (parts[3][:, :8], torch.cat([parts[3], parts[3]], 1), parts[3].bfloat16(), parts[3][0]):
        with pytest.raises(ValueError, match="the shards differ in shape, dtype or device"):
            EXT.linear_shards(x, parts[:3] + [last])
    with pytest.raises(ValueError, match="x must be"):
        EXT.linear_shards(x[:, :40], parts)


@pytest.mark.parametrize("linear", [linear_fixed_order, linear_fixed_order_avx2], ids=["default", "avx2"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shards", [2, 8])
def test_narrow_rows_sum_their_shards_in_one_call_as_one_call_per_shard_does(linear, dtype, shards, threads,
                                                                             lane_pairing):
    """Rows in bf16 or fp16 (an engine in that dtype): `in_shards` runs the kernel's one call, whose tree
    rounds each shard's product and each level's sum to the rows' dtype, and gives bitwise what one call
    per shard (rounded once each) summed by `tree_sum` in that dtype gives: direct and packed tiles,
    slices with a tail, the shards as column slices of one matrix, a row alone. The same sums kept in
    fp32 and rounded once at the end (no rounding per shard and level) are told apart."""
    assert native_shards(linear, dtype, shards) is not None
    told_apart = 0
    for width in (17, 40, 2071):
        for m in (1, 5, 16, 20, 33):
            x, w, _ = _data(m, 37, shards * width, seed=m * width + shards, bias=False)
            x, w = x.to(dtype), w.to(dtype)
            parts = [w[:, i * width:(i + 1) * width].contiguous() for i in range(shards)]
            one_call_each = tree_sum([linear(x[:, i * width:(i + 1) * width].contiguous(), part)
                                      for i, part in enumerate(parts)])
            native = in_shards(linear, x, parts)
            assert native.dtype == dtype and torch.equal(native, one_call_each), (width, m)
            assert torch.equal(in_shards(linear, x, list(w.split(width, dim=1))), native), (width, m)
            assert torch.equal(in_shards(linear, x[m - 1:], parts), native[m - 1:]), (width, m)
            wide = [part if dtype == torch.bfloat16 else part.float() for part in parts]
            told_apart += not torch.equal(EXT.linear_shards(x.float(), wide).to(dtype), one_call_each)
    assert told_apart >= 10  # of 15: a tree in fp32 is another order


def test_the_shard_tree_names_the_dtypes_it_rounds_to():
    x, w, _ = _data(2, 8, 32, bias=False)
    with pytest.raises(ValueError, match="round must be '', 'bfloat16' or 'float16', got 'half'"):
        EXT.linear_shards(x, list(w.split(16, dim=1)), "", "half")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [7, 20])
def test_the_tree_rounds_ties_overflow_infinities_and_nan_as_torch_does(dtype, m):
    """Shards one feature wide (each shard's product x * w, exact in fp32), of values whose products and
    sums fall on the dtype's ties (1 + 2^-7 for bf16, 1 + 2^-10 for fp16, times 1.5), overflow it, or
    are infinite or NaN: the kernel's one call has the bits of one call per shard summed by `tree_sum` in
    that dtype (signed zeros and infinities included; a NaN where it has one: torch's own NaN bits differ
    between its vectorized and scalar conversions), on the direct tiles (7 rows) and the packed ones (20)."""
    info = torch.finfo(dtype)
    tie = 1 + 2 * info.eps / 2  # its product with 1.5 lies halfway between two of the dtype's values
    finite = [tie, -tie, 1.5, info.tiny, 0.0, -0.0, 3.0, -1.0]
    gen = torch.Generator().manual_seed(5)
    x = torch.tensor(finite, dtype=torch.float32)[torch.randint(len(finite), (m, 8), generator=gen)]
    x[0, 2], x[1, 6], x[2, 0] = float("inf"), float("nan"), float("-inf")
    x[3, 1], x[3, 4], x[4, 0], x[4, 7] = info.max, info.max / 2, -info.max, info.max  # sums past the dtype's max
    x = x.to(dtype)
    w = torch.tensor([1.5, tie, 1.0, -1.5, 2.0, 0.5, -1.0, 1.0], dtype=torch.float32)
    w = torch.stack([w.roll(i) for i in range(7)]).to(dtype)  # [7, 8]: eight shards of one feature
    parts = list(w.split(1, dim=1))
    one_call_each = tree_sum([linear_fixed_order(x[:, i:i + 1].contiguous(), part.contiguous())
                              for i, part in enumerate(parts)])
    native = in_shards(linear_fixed_order, x, parts)
    assert native_shards(linear_fixed_order, dtype, 8) is not None
    nan = one_call_each.isnan()
    assert torch.equal(native.isnan(), nan)
    assert torch.equal(native[~nan].view(torch.int16), one_call_each[~nan].view(torch.int16))
    assert nan.any() and one_call_each.isinf().any() and one_call_each.isfinite().any()  # the cases are there
