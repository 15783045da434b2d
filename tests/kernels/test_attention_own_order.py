"""The C++ attention (`own_order` of prefill_attention and decode_attention, `kernels/cpu/attention.cpp`):
the torch backend's attention with exact positions.

- against the reference (`prefill_attention_ref`) within tolerance, GQA 1/2/4, head dims off the
  16-lane grid;
- bitwise: every prefill row equals the same row decoded, a piece cut anywhere equals one piece,
  sequences alone equal them batched (rows of other slots and pieces next to them), 1 and 2 threads;
- bitwise the documented order of `attention.cpp` emulated in torch (its own exp included), on both
  instruction sets, every head-dim residue class the tests' layouts reach; the emulated exp within 2
  ulps of e^x; a planted defect (the C library's exp in place of the kernel's) is told apart;
- the fallback (fp16 here, or no compiler) keeps the same pairing: prefill rows one at a time as the
  fused decode computes them.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_cases import lane_pairing as lane_pairing  # the fixture
from kernel_tolerances import assert_close

from pocketllm.kernels.cpu.extension import load_extension
from pocketllm.kernels.decode_attention import decode_attention_own_order
from pocketllm.kernels.prefill_attention import prefill_attention_own_order, prefill_attention_ref

pytestmark = pytest.mark.skipif(load_extension() is None, reason="pocketllm's C++ CPU kernels cannot be built here")
LAYOUTS = [(4, 4, 16), (4, 2, 24), (8, 2, 40)]  # query heads, K/V heads, head dim
VARIANTS = ["avx2"] + (["avx512"] if load_extension() is not None and load_extension().best_variant() == "avx512"
                       else [])


def _long(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def _cache(layout, slots: int = 3, length: int = 96, dtype=torch.float32, seed: int = 0):
    heads, kv_heads, dim = layout
    gen = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(slots, length, kv_heads, dim, generator=gen).to(dtype) for _ in range(2))
    return k, v, (dim ** -0.5)


def _prefill(q, k, v, scale, slots, starts, lengths, fn=prefill_attention_own_order):
    cu = torch.cumsum(_long([0] + lengths), 0)
    return fn(q, k, v, _long(slots), _long(starts), cu, scale)


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_own_order_matches_the_reference(layout):
    k, v, scale = _cache(layout)
    q = torch.randn(30, layout[0], layout[2])
    args = (q, k, v, scale, [2, 0], [5, 60], [19, 11])
    assert_close(_prefill(*args), _prefill(*args, fn=prefill_attention_ref))


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_prefill_rows_are_decode_rows_and_cuts_do_not_matter(layout):
    k, v, scale = _cache(layout, seed=1)
    q = torch.randn(70, layout[0], layout[2])
    whole = _prefill(q, k, v, scale, [1], [3], [70])
    decoded = torch.cat([decode_attention_own_order(q[i:i + 1], k, v, _long([1]), _long([3 + i + 1]), scale)
                         for i in range(70)])
    assert torch.equal(decoded, whole)
    cuts = [0, 1, 8, 9, 17, 40, 70]  # across the kernel's 8-row blocks
    pieces = torch.cat([_prefill(q[lo:hi], k, v, scale, [1], [3 + lo], [hi - lo]) for lo, hi in zip(cuts, cuts[1:])])
    assert torch.equal(pieces, whole)


def test_own_order_is_batch_and_thread_invariant(single_torch_thread):
    layout = LAYOUTS[2]
    k, v, scale = _cache(layout, seed=2)
    lengths, slots, starts = [9, 1, 30], [2, 0, 2], [0, 50, 40]
    q = torch.randn(sum(lengths), layout[0], layout[2])
    batched = {}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        batched[threads] = _prefill(q, k, v, scale, slots, starts, lengths)
    assert torch.equal(batched[1], batched[2])
    lo = 0
    for slot, start, n in zip(slots, starts, lengths):
        assert torch.equal(_prefill(q[lo:lo + n], k, v, scale, [slot], [start], [n]), batched[2][lo:lo + n])
        lo += n


def test_rows_of_other_slots_at_the_next_positions_keep_their_own_keys(single_torch_thread):
    """The kernel groups consecutive rows of one slot into blocks that read each key once; rows of
    different slots whose positions follow each other (decode rows, a piece followed by another
    slot's piece) must not join a block: each row's bits are the row computed alone."""
    attention_rows = load_extension().attention_rows
    layout = LAYOUTS[1]
    k, v, scale = _cache(layout, slots=4, seed=4)
    slots = [0, 1, 2, 1, 3, 3, 3, 0, 2]
    positions = [5, 6, 7, 8, 9, 10, 11, 12, 13]  # each row at its predecessor's position + 1
    q = torch.randn(len(slots), layout[0], layout[2])
    together = attention_rows(q, k, v, _long(slots), _long(positions), scale)
    for i, (slot, position) in enumerate(zip(slots, positions)):
        alone = attention_rows(q[i:i + 1].contiguous(), k, v, _long([slot]), _long([position]), scale)
        assert torch.equal(together[i:i + 1], alone), (i, slot, position)


def test_the_fallback_pairs_prefill_rows_with_decode_rows():
    """fp16 is not the kernel's: both ops fall back, prefill row by row as the fused decode."""
    layout = LAYOUTS[1]
    k, v, scale = _cache(layout, dtype=torch.float16, seed=3)
    q = torch.randn(12, layout[0], layout[2]).half()
    whole = _prefill(q, k, v, scale, [0], [4], [12])
    decoded = torch.cat([decode_attention_own_order(q[i:i + 1], k, v, _long([0]), _long([4 + i + 1]), scale)
                         for i in range(12)])
    assert torch.equal(decoded, whole)


def _fma(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fp32 a * b + c rounded once: the float64 product is exact, the sum rounded to float64 and then
    to fp32 (the same as one rounding for these magnitudes but in the rarest double-rounding cases)."""
    return (a.double() * b.double() + c.double()).float()


def _exp_fixed(x: torch.Tensor) -> torch.Tensor:
    """attention.cpp's `exp_fixed`, step by step in fp32."""
    xc = torch.clamp(x, min=-87.0)
    t = xc * torch.tensor(1.44269504088896341, dtype=torch.float32)
    n = (t + 12582912.0) - 12582912.0
    r = _fma(n, torch.full_like(n, -0.693359375), xc)
    r = _fma(n, torch.full_like(n, 2.12194440e-4), r)
    p = torch.full_like(r, 1.9875691500e-4)
    for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
        p = _fma(p, r, torch.full_like(r, c))
    p = _fma(p, r * r, r) + 1.0
    scale = ((n.to(torch.int32) + 127) << 23).view(torch.float32)
    return torch.where(x < -87.0, torch.zeros_like(x), p * scale)


def _documented_order(q, k, v, slot, position, scale, exp=_exp_fixed):
    """One row [H, D] at `position` of `slot`, as attention.cpp documents it."""
    heads, dim = q.shape
    group = heads // k.shape[2]
    keys, values = k[slot, :position + 1], v[slot, :position + 1]  # [L, KV, D]
    padded = -(-dim // 16) * 16
    out = torch.empty(heads, dim)
    for h in range(heads):
        qh = F.pad(q[h], (0, padded - dim))
        kh, vh = F.pad(keys[:, h // group], (0, padded - dim)), values[:, h // group]
        lanes = torch.zeros(kh.shape[0], 16)
        for d0 in range(0, padded, 16):
            lanes = _fma(kh[:, d0:d0 + 16], qh[None, d0:d0 + 16].expand(kh.shape[0], 16), lanes)
        for half in (8, 4, 2, 1):
            lanes = lanes[:, :half] + lanes[:, half:2 * half]
        scores = lanes[:, 0] * torch.tensor(scale, dtype=torch.float32)
        e = exp(scores - scores.max())
        total, acc = torch.zeros(()), torch.zeros(dim)
        for j in range(e.shape[0]):
            total = total + e[j]
            acc = _fma(e[j].expand(dim), vh[j], acc)
        out[h] = acc / total
    return out


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_every_row_is_the_documented_order(variant, layout):
    """Rows of two pieces (one crossing the 16-row blocks) and a decode row, every one bitwise the order
    emulated in torch, on each instruction set."""
    k, v, scale = _cache(layout, length=48, seed=5)
    attention_rows = load_extension().attention_rows
    slots, positions = [1] * 21 + [0] * 3 + [2], list(range(3, 24)) + [0, 1, 2] + [47]
    q = torch.randn(len(slots), layout[0], layout[2])
    got = attention_rows(q, k, v, _long(slots), _long(positions), scale, variant)
    for i, (slot, position) in enumerate(zip(slots, positions)):
        assert torch.equal(got[i], _documented_order(q[i], k, v, slot, position, scale)), (i, slot, position)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("layout", [(4, 4, 16), (16, 2, 24)], ids=str)
def test_scores_by_packed_and_direct_tiles_are_the_documented_order(variant, layout, lane_pairing):
    """A block's scores run the packed tiles over its pack's whole groups of keys when it has more than
    8 query vectors, else the direct tiles: blocks of 8 and 9 vectors (the choice), of 128 (more than
    one block of packed columns), ending inside a group of keys with the pack longer or not."""
    k, v, scale = _cache(layout, length=48, seed=8)
    attention_rows = load_extension().attention_rows
    rows = {0: range(0, 25), 1: range(5, 13), 2: range(30, 47)}  # blocks: 16 + 9, 8, 16 + 1 rows
    slots = [slot for slot, positions in rows.items() for _ in positions]
    positions = [p for ps in rows.values() for p in ps]
    q = torch.randn(len(slots), layout[0], layout[2])
    got = attention_rows(q, k, v, _long(slots), _long(positions), scale, variant)
    for i, (slot, position) in enumerate(zip(slots, positions)):
        assert torch.equal(got[i], _documented_order(q[i], k, v, slot, position, scale)), (i, slot, position)


def test_the_documented_exp_is_within_two_ulps_of_e_to_the_x():
    x = torch.cat([torch.linspace(-87.0, 0.0, 200_001), -torch.rand(100_000) * 5]).float()
    want = torch.exp(x.double())
    ulp = (torch.nextafter(want.float(), torch.tensor(float("inf"))) - want.float()).double()
    assert ((_exp_fixed(x).double() - want).abs() / ulp).max() <= 2.0
    assert torch.equal(_exp_fixed(torch.tensor([0.0, -88.0, float("-inf")])), torch.tensor([1.0, 0.0, 0.0]))


def test_negative_control_the_c_library_exp_is_told_apart():
    """The same order with torch's exp in place of the kernel's must fail the bitwise check the kernel
    passes: the check sees a change of the exp, not only of the sums."""
    layout = LAYOUTS[2]
    k, v, scale = _cache(layout, length=48, seed=6)
    q = torch.randn(1, layout[0], layout[2])
    got = load_extension().attention_rows(q, k, v, _long([0]), _long([40]), scale)[0]
    assert torch.equal(got, _documented_order(q[0], k, v, 0, 40, scale))
    libm = _documented_order(q[0], k, v, 0, 40, scale, exp=torch.exp)
    torch.testing.assert_close(libm, got)  # the same attention...
    assert not torch.equal(libm, got)  # ...with other bits


@pytest.mark.skipif(len(VARIANTS) < 2, reason="this CPU has no AVX-512F")
def test_the_avx2_variant_gives_the_avx512_bits():
    layout = (16, 8, 128)  # Qwen3-0.6B's attention
    k, v, scale = _cache(layout, slots=2, length=70, seed=7)
    slots, positions = [0] * 40 + [1], list(range(30, 70)) + [69]
    q = torch.randn(len(slots), layout[0], layout[2])
    args = (q, k, v, _long(slots), _long(positions), scale)
    attention_rows = load_extension().attention_rows
    assert torch.equal(attention_rows(*args, "avx2"), attention_rows(*args, "avx512"))
