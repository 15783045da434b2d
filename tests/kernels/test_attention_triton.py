"""The attention kernels under test (by default the Triton ones in pocketllm/kernels/prefill_attention.py
and decode_attention.py) against their torch references, and their invariance contract, checked
bitwise: a sequence's output does not depend on the batch
around it, on its slot, or (prefill) on how its prompt was cut into pieces.

CPU runs use the Triton interpreter (fp32, fp16; tiny head counts to stay fast); the `gpu` tests
repeat the comparisons in bf16 at realistic sizes.
"""

from __future__ import annotations

import pytest
import torch
from helpers import budget
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_impls import DEVICE, implementation
from kernel_tolerances import assert_close

from pocketllm.kernels.decode_attention import DECODE_BLOCK_N, decode_attention_ref, decode_attention_triton
from pocketllm.kernels.prefill_attention import prefill_attention_ref

decode_attention_impl = implementation("decode_attention")
prefill_attention_impl = implementation("prefill_attention")

DTYPES = [torch.float32, torch.float16]
LENGTHS = (1, 2, 17, 63, 64, 65, 130)
# (num_heads, num_kv_heads, head_dim): GQA ratios 1, 2, 4, head dims 32, 64, 128, the odd 24 and 16.
HEAD_CONFIGS = [(2, 2, 32), (4, 2, 64), (4, 1, 128), (4, 2, 24), (8, 2, 16)]


def _cache(num_slots: int, max_len: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
           seed: int, device: str = DEVICE) -> tuple[torch.Tensor, torch.Tensor]:
    """Random K and V caches [slots, max_len, Hkv, D]."""
    gen = torch.Generator().manual_seed(seed)
    shape = (num_slots, max_len, num_kv_heads, head_dim)
    return (torch.randn(shape, generator=gen).to(device=device, dtype=dtype),
            torch.randn(shape, generator=gen).to(device=device, dtype=dtype))


def _poison_past(k_cache: torch.Tensor, v_cache: torch.Tensor, slots: list[int], ends: list[int]) -> None:
    """NaN in every cache position at or past a sequence's end: any read of one shows in the output."""
    for slot, end in zip(slots, ends):
        k_cache[slot, end:] = float("nan")
        v_cache[slot, end:] = float("nan")


def _decode_case(lengths, num_heads, num_kv_heads, head_dim, dtype, seed=0, device=DEVICE):
    """q [B, Hq, D] and caches where sequence i (length lengths[i]) sits in slot B - i (slots in
    reverse batch order, slot 0 unused); cache positions past each sequence's end are NaN."""
    batch = len(lengths)
    slots = [batch - i for i in range(batch)]
    k_cache, v_cache = _cache(batch + 1, max(lengths) + 3, num_kv_heads, head_dim, dtype, seed, device)
    _poison_past(k_cache, v_cache, slots, list(lengths))
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(batch, num_heads, head_dim, generator=gen).to(device=device, dtype=dtype)
    as_long = dict(dtype=torch.int64, device=device)
    return q, k_cache, v_cache, torch.tensor(slots, **as_long), torch.tensor(lengths, **as_long)


def _prefill_case(lengths, starts, num_heads, num_kv_heads, head_dim, dtype, seed=0, device=DEVICE):
    """Concatenated q [T, Hq, D] for sequences of lengths[i] new tokens after starts[i] cached ones,
    caches (sequence i in slot B - i) with NaN past each sequence's end, and cu_seqlens."""
    batch = len(lengths)
    slots = [batch - i for i in range(batch)]
    ends = [s + n for s, n in zip(starts, lengths)]
    k_cache, v_cache = _cache(batch + 1, max(ends) + 3, num_kv_heads, head_dim, dtype, seed, device)
    _poison_past(k_cache, v_cache, slots, ends)
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(sum(lengths), num_heads, head_dim, generator=gen).to(device=device, dtype=dtype)
    as_long = dict(dtype=torch.int64, device=device)
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return (q, k_cache, v_cache, torch.tensor(slots, **as_long), torch.tensor(starts, **as_long),
            torch.tensor(cu, **as_long))


def _one_sequence(slot: int, start: int, length: int, device=DEVICE):
    """slot_ids, start_positions, cu_seqlens of a single prefill sequence."""
    as_long = dict(dtype=torch.int64, device=device)
    return torch.tensor([slot], **as_long), torch.tensor([start], **as_long), torch.tensor([0, length], **as_long)


# -- decode -----------------------------------------------------------------------------------------


def _decode(q, k_cache, v_cache, slot_ids, seq_lens, scale, split_size):
    """The decode implementation under test. `split_size` is an option of the Triton launcher (small
    splits make short sequences span several): it is passed only when that launcher is under test."""
    if decode_attention_impl is decode_attention_triton:
        return decode_attention_triton(q, k_cache, v_cache, slot_ids, seq_lens, scale, split_size=split_size)
    return decode_attention_impl(q, k_cache, v_cache, slot_ids, seq_lens, scale)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", HEAD_CONFIGS)
def test_decode_matches_reference(dtype, num_heads, num_kv_heads, head_dim):
    """Lengths 1..130 in one call, split_size 64 (up to 3 splits merged), never reading past a
    sequence's end (NaN there), agree with decode_attention_ref."""
    q, k, v, slots, lens = _decode_case(LENGTHS, num_heads, num_kv_heads, head_dim, dtype)
    scale = head_dim ** -0.5
    out = _decode(q, k, v, slots, lens, scale, split_size=64)
    assert out.dtype == dtype and out.shape == q.shape
    assert_close(out, decode_attention_ref(q, k, v, slots, lens, scale))


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_default_split_size_matches_reference(dtype):
    """The default split size (256), with sequences of one split, exactly one and several splits."""
    q, k, v, slots, lens = _decode_case((1, 255, 256, 257, 600), 2, 1, 32, dtype, seed=3)
    assert_close(decode_attention_impl(q, k, v, slots, lens, 0.2), decode_attention_ref(q, k, v, slots, lens, 0.2))


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_is_batch_and_slot_invariant(dtype):
    """A sequence decoded alone, in any slot, gives bitwise its output inside a batch of sequences
    with very different lengths (so different split counts and grid sizes)."""
    lengths = LENGTHS + (300,)
    q, k, v, slots, lens = _decode_case(lengths, 4, 2, 24, dtype, seed=5)
    batched = _decode(q, k, v, slots, lens, 0.3, split_size=64)
    spare = len(lengths) + 1  # a slot no sequence of the batch uses
    k_moved, v_moved = torch.cat([k, torch.zeros_like(k[:1])]), torch.cat([v, torch.zeros_like(v[:1])])
    for i in range(len(lengths)):
        alone = _decode(q[i:i + 1], k, v, slots[i:i + 1], lens[i:i + 1], 0.3, split_size=64)
        assert torch.equal(alone, batched[i:i + 1])
        k_moved[spare], v_moved[spare] = k[slots[i]], v[slots[i]]
        moved = _decode(q[i:i + 1], k_moved, v_moved, torch.tensor([spare], device=DEVICE), lens[i:i + 1], 0.3,
                        split_size=64)
        assert torch.equal(moved, alone)


def test_decode_rejects_split_size_not_multiple_of_block():
    """A split must be whole key blocks, so that block starts are multiples of BLOCK_N."""
    q, k, v, slots, lens = _decode_case((5,), 2, 1, 16, torch.float32)
    with pytest.raises(ValueError, match="multiple"):
        decode_attention_triton(q, k, v, slots, lens, 0.3, split_size=DECODE_BLOCK_N + 1)


# -- prefill ----------------------------------------------------------------------------------------

PREFILL_STARTS = (0, 3, 0, 40, 0, 1, 70)  # nonzero cached prefixes for some sequences


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", HEAD_CONFIGS)
def test_prefill_matches_reference(dtype, num_heads, num_kv_heads, head_dim):
    """Varlen prefill of lengths 1..130, some after a cached prefix, in one call, never reading past a
    sequence's end (NaN there), agrees with prefill_attention_ref."""
    q, k, v, slots, starts, cu = _prefill_case(LENGTHS, PREFILL_STARTS, num_heads, num_kv_heads, head_dim, dtype)
    scale = head_dim ** -0.5
    out = prefill_attention_impl(q, k, v, slots, starts, cu, scale)
    assert out.dtype == dtype and out.shape == q.shape
    assert_close(out, prefill_attention_ref(q, k, v, slots, starts, cu, scale))


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_is_batch_invariant(dtype):
    """A sequence prefilled alone gives bitwise its rows inside a varlen batch of others."""
    q, k, v, slots, starts, cu = _prefill_case(LENGTHS, PREFILL_STARTS, 2, 1, 24, dtype, seed=7)
    batched = prefill_attention_impl(q, k, v, slots, starts, cu, 0.3)
    for i in range(len(LENGTHS)):
        lo, hi = int(cu[i]), int(cu[i + 1])
        alone = prefill_attention_impl(q[lo:hi], k, v, *_one_sequence(int(slots[i]), int(starts[i]), hi - lo), 0.3)
        assert torch.equal(alone, batched[lo:hi])


def _one_vs_two_pieces(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot: int, split: int, scale: float):
    """Prefill of prompt q (in `slot`) in one piece, and in two: q[:split], then q[split:] at
    start_position split over the cache holding the first piece."""
    n, device = q.shape[0], q.device
    whole = prefill_attention_impl(q, k, v, *_one_sequence(slot, 0, n, device), scale)
    first = prefill_attention_impl(q[:split], k, v, *_one_sequence(slot, 0, split, device), scale)
    second = prefill_attention_impl(q[split:], k, v, *_one_sequence(slot, split, n - split, device), scale)
    return whole, torch.cat([first, second])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split", [1, 17, 64, 65, 129])
@pytest.mark.parametrize("head_dim", [24, 128])  # 64-key blocks, 32-key blocks (PREFILL_TILES)
def test_prefill_in_two_pieces_equals_one_piece(dtype, split, head_dim):
    """Chunked prefill over a cached first piece gives bitwise the rows of one-piece prefill."""
    q, k, v, slots, _, _ = _prefill_case((130,), (0,), 4, 2, head_dim, dtype, seed=11)
    whole, pieces = _one_vs_two_pieces(q, k, v, int(slots[0]), split, 0.3)
    assert torch.equal(whole, pieces)


@settings(max_examples=budget(0.3), deadline=None)
@given(length=st.integers(2, 200), split_fraction=st.floats(0.0, 1.0), seed=st.integers(0, 2**16),
       dtype=st.sampled_from(DTYPES))
def test_prefill_piece_invariance_property(length, split_fraction, seed, dtype):
    """For any prompt length and split point, two-piece prefill equals one-piece prefill bitwise."""
    split = min(length - 1, 1 + int(split_fraction * (length - 1)))
    q, k, v, slots, _, _ = _prefill_case((length,), (0,), 2, 1, 16, dtype, seed=seed)
    whole, pieces = _one_vs_two_pieces(q, k, v, int(slots[0]), split, 0.25)
    assert torch.equal(whole, pieces)


# -- GPU, bf16, realistic sizes -------------------------------------------------------------------

GPU_HEADS = dict(num_heads=32, num_kv_heads=8, head_dim=128)
GPU_DECODE_LENGTHS = (4096, 1, 17, 300, 1000, 2049, 3333, 4095)


@pytest.mark.parametrize("split_size", [64, 256])
@pytest.mark.gpu
def test_gpu_decode_matches_reference_and_is_batch_invariant(split_size):
    """bf16, B=8, context up to 4096, Hq=32, Hkv=8, D=128: matches the reference, and each
    sequence alone equals its output in the batch bitwise."""
    q, k, v, slots, lens = _decode_case(GPU_DECODE_LENGTHS, dtype=torch.bfloat16, device="cuda", **GPU_HEADS)
    scale = 128 ** -0.5
    out = _decode(q, k, v, slots, lens, scale, split_size=split_size)
    assert_close(out, decode_attention_ref(q, k, v, slots, lens, scale))
    for i in range(len(GPU_DECODE_LENGTHS)):
        alone = _decode(q[i:i + 1], k, v, slots[i:i + 1], lens[i:i + 1], scale, split_size=split_size)
        assert torch.equal(alone, out[i:i + 1])


@pytest.mark.gpu
def test_gpu_prefill_matches_reference_and_is_batch_invariant():
    """bf16 varlen prefill of 8 sequences (up to 4096 positions, some after a cached prefix),
    Hq=32, Hkv=8, D=128: matches the reference, and each sequence alone equals its batch rows."""
    lengths, starts = (4096, 1, 17, 1000, 2500, 64, 65, 300), (0, 0, 100, 3000, 1, 0, 4000, 63)
    q, k, v, slots, starts_t, cu = _prefill_case(lengths, starts, dtype=torch.bfloat16, device="cuda", **GPU_HEADS)
    scale = 128 ** -0.5
    out = prefill_attention_impl(q, k, v, slots, starts_t, cu, scale)
    assert_close(out, prefill_attention_ref(q, k, v, slots, starts_t, cu, scale))
    for i in range(len(lengths)):
        lo, hi = int(cu[i]), int(cu[i + 1])
        alone = prefill_attention_impl(q[lo:hi], k, v, *_one_sequence(int(slots[i]), starts[i], hi - lo, "cuda"),
                                       scale)
        assert torch.equal(alone, out[lo:hi])


@pytest.mark.gpu
@pytest.mark.parametrize("split", [1, 1000, 2048, 2049, 4095])
def test_gpu_prefill_in_two_pieces_equals_one_piece(split):
    """bf16, a 4096-token prompt, Hq=32, Hkv=8, D=128: two-piece prefill equals one piece bitwise."""
    q, k, v, slots, _, _ = _prefill_case((4096,), (0,), dtype=torch.bfloat16, device="cuda", **GPU_HEADS)
    whole, pieces = _one_vs_two_pieces(q, k, v, int(slots[0]), split, 128 ** -0.5)
    assert torch.equal(whole, pieces)
