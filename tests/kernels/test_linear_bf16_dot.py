"""The bf16 dot-product linear (`linear.linear_bf16_dot`, `kernels/cpu/linear.cpp`'s `linear_bf16_dot`):
fp32 rows rounded to bf16, bf16 weights, VDPBF16PS's pair steps in the fixed-order kernel's lanes and tree.

- bitwise its documented order emulated in torch (pairs high element first, products exact, each sum
  rounded once, denormals flushed), for every residue of K mod 32, rows through the direct and the
  packed tiles, on the instruction and on its software form, 1 and 2 threads;
- the software form gives the instruction's bits on denormals, sums that cancel into the denormal
  range, infinities and NaN (where the CPU has the instruction);
- a planted defect, the low element's product first, is told apart by the same check;
- within bf16's rounding of the float64 product; a row alone equals it in any batch; bad operands named;
- in K shards (`linear_bf16_dot_shards`, the tensor-parallel tree in one call): bitwise each shard's
  product summed in the fixed tree, for the direct and the packed tiles.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from kernel_cases import lane_pairing as lane_pairing  # the fixture

from pocketllm.kernels._tree import tree_sum
from pocketllm.kernels.cpu.extension import load_extension
from pocketllm.kernels.linear import in_shards, linear_bf16_dot, linear_bf16_dot_avx2

EXT = load_extension()
if EXT is None:
    pytest.skip("the C++ CPU kernels cannot be built here (no compiler or ninja)", allow_module_level=True)
HAS_INSTRUCTION = Path("/proc/cpuinfo").exists() and "avx512_bf16" in Path("/proc/cpuinfo").read_text()
VARIANTS = ["avx2"] + (["avx512"] if HAS_INSTRUCTION else [])
TINY = torch.finfo(torch.float32).tiny


def _flush(t: torch.Tensor) -> torch.Tensor:
    """Denormals to zero of their sign (DAZ on inputs, FTZ on results)."""
    return torch.where(t.abs() < TINY, t * 0, t)


def _documented_order(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None,
                      low_first: bool = False) -> torch.Tensor:
    """The kernel's order, emulated: x rounded to bf16; per 32-element step, lane i adds the product of
    elements 2i + 1, then of 2i (`low_first`: the planted defect), each sum of an exact float64 product
    rounded once to fp32 (as the test of the fp32 kernel emulates its FMAs); the 16-lane tree, then the
    bias; denormals flushed throughout."""
    m, k = x.shape
    padded = -(-k // 32) * 32
    xb = F.pad(_flush(x.to(torch.bfloat16).float()), (0, padded - k)).double()
    wb = F.pad(_flush(w.float()), (0, padded - k)).double()
    lanes = torch.zeros(m, w.shape[0], 16)
    for k0 in range(0, padded, 32):
        xs, ws = xb[:, None, k0:k0 + 32], wb[None, :, k0:k0 + 32]
        for part in ((0, 1) if low_first else (1, 0)):
            lanes = _flush((xs[..., part::2] * ws[..., part::2] + lanes.double()).float())
    for half in (8, 4, 2, 1):
        lanes = _flush(lanes[..., :half] + lanes[..., half:2 * half])
    out = lanes[..., 0]
    return out if b is None else _flush(out + b)


def _data(m: int, n: int, k: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen)
    w = (torch.randn(n, k, generator=gen) * k ** -0.5).bfloat16()
    return x, w, torch.randn(n, generator=gen)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal, NaN where NaN (the instruction's NaN payloads are not part of the order)."""
    return bool(((a == b) & (torch.signbit(a) == torch.signbit(b)) | (a.isnan() & b.isnan())).all())


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_residue_of_k_is_the_documented_order(variant):
    for k in range(1, 68):  # every residue mod 32 (an odd K: one zero element more), one and two steps and more
        x, w, b = _data(3, 19, k, seed=k)
        assert torch.equal(EXT.linear_bf16_dot(x, w, b, variant), _documented_order(x, w, b)), k


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("m", [1, 2, 6, 9, 16, 40])  # the direct tiles (6: AVX2 interleaves two row groups over
# chunks of K, 515 pairs here), then the packed ones from 16 rows
def test_every_row_count_is_the_documented_order_and_each_row_alone(variant, threads, m, lane_pairing):
    x, w, b = _data(m, 70, 1030, seed=m)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = EXT.linear_bf16_dot(x, w, b, variant)
        rows = [EXT.linear_bf16_dot(x[row:row + 1], w, b, variant) for row in (0, m - 1)]
    finally:
        torch.set_num_threads(before)
    assert torch.equal(got, _documented_order(x, w, b))
    assert torch.equal(rows[0], got[:1]) and torch.equal(rows[1], got[m - 1:])


@pytest.mark.skipif(not HAS_INSTRUCTION, reason="this CPU has no AVX512-BF16: only the software form runs")
def test_the_software_form_gives_the_instruction_bits_on_edge_values():
    gen = torch.Generator().manual_seed(3)
    values = torch.tensor([0.0, -0.0, 1e-39, -1e-39, 1.1e-38, -1.1754944e-38, 2.0 ** -126, 1e-20, 3e19, -3e19, 1.0,
                           -1.0, 0.5, -0.25])
    for specials in ([], [float("inf")], [float("nan")]):
        pool = torch.cat([values, torch.tensor(specials)])
        x = pool[torch.randint(0, len(pool), (7, 96), generator=gen)] * (1 + 0.01 * torch.rand(7, 96, generator=gen))
        w = (values[torch.randint(0, len(values), (40, 96), generator=gen)]
             * (1 + 0.01 * torch.rand(40, 96, generator=gen))).bfloat16()
        instruction = EXT.linear_bf16_dot(x, w, None, "avx512")
        assert _same(EXT.linear_bf16_dot(x, w, None, "avx2"), instruction), specials
        assert _same(_documented_order(x, w), instruction), specials
    # sums that cancel into the denormal range: flushed to zero by both forms
    x = torch.tensor([[1.5e-38, 1.0, -1.4e-38, 0.0] * 8])
    w = torch.ones(3, 32).bfloat16()
    assert _same(EXT.linear_bf16_dot(x, w, None, "avx2"), EXT.linear_bf16_dot(x, w, None, "avx512"))


def test_negative_control_the_other_pair_order_is_told_apart():
    """Adding the low element's product first must fail the bitwise check the kernel passes."""
    x, w, b = _data(20, 50, 1030, seed=11)
    got = EXT.linear_bf16_dot(x, w, b)
    assert torch.equal(got, _documented_order(x, w, b))
    swapped = _documented_order(x, w, b, low_first=True)
    torch.testing.assert_close(swapped, got)  # the same product...
    assert not torch.equal(swapped, got)  # ...in another order


def test_within_bf16_rounding_of_the_float64_product():
    x, w, b = _data(33, 64, 2048, seed=5)
    want = x.to(torch.bfloat16).double() @ w.double().T + b.double()
    torch.testing.assert_close(linear_bf16_dot(x, w, b).double(), want, atol=2e-5, rtol=1e-5)
    assert torch.equal(linear_bf16_dot_avx2(x, w, b), linear_bf16_dot(x, w, b))


def test_bad_operands_are_named():
    x, w, _ = _data(2, 4, 6)
    with pytest.raises(ValueError, match="takes fp32 x and bias and a bf16 weight"):
        linear_bf16_dot(x, w.float())
    with pytest.raises(ValueError, match="bf16 dot products take bf16 shards"):
        EXT.linear_bf16_dot_shards(x, [w[:, :3].float(), w[:, 3:].float()])
    with pytest.raises(ValueError, match="variant must be"):
        EXT.linear_bf16_dot(x, w, None, "amx")
    assert linear_bf16_dot(x[:0], w).shape == (0, 4)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("shards", [2, 8])
def test_shards_are_each_shard_product_summed_in_the_tree(variant, shards, lane_pairing):
    for width in (17, 18, 64):  # an odd width: each slice one zero element more
        for m in (1, 5, 16, 20):
            x, w, _ = _data(m, 37, shards * width, seed=m * width + shards)
            parts = [w[:, i * width:(i + 1) * width].contiguous() for i in range(shards)]
            native = EXT.linear_bf16_dot_shards(x, parts, variant)
            one_call_each = tree_sum([EXT.linear_bf16_dot(x[:, i * width:(i + 1) * width].contiguous(), part, None,
                                                          variant) for i, part in enumerate(parts)])
            assert torch.equal(native, one_call_each), (width, m)
            # the shards as column slices of one matrix: read in place (an even width) or padded (odd)
            assert torch.equal(EXT.linear_bf16_dot_shards(x, list(w.split(width, dim=1)), variant), native), (width, m)
            assert torch.equal(in_shards(linear_bf16_dot, x, parts), native)  # the default variant: the same bits
