"""prefill_attention (pocketllm/kernels/prefill_attention.py): varlen causal attention of each
sequence's new queries over the K/V of its own slot, positions start.. after a cached prefix.

- the reference against per-head softmax attention written out in float64 (GQA, causal mask),
  several sequences in one call each equal to the sequence alone, the cache past a sequence never
  read;
- the torch backend's fused attention (one call per sequence) against the reference, and its batch
  invariance: each sequence alone gives its rows' bits;
- the kernel under test (by default the Triton one) against the reference, never reading past a
  sequence's end (NaN there), and its invariance, bitwise: a sequence alone equals its batch rows,
  and a prompt prefilled in pieces (two pieces at any split; pieces cut at absolute positions after a
  slot that already holds tokens, each sharing its call with another sequence) equals one piece.
  The reference and the fused attention claim only batch invariance (their matmuls are shaped by
  the piece), not split invariance, so they are not split here.
CPU runs use the Triton interpreter (fp32, fp16; tiny head counts); the `gpu` tests repeat the
comparisons in bf16 at realistic sizes.
"""

from __future__ import annotations

import pytest
import torch
from helpers import budget
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_cases import ATTENTION_LENGTHS as LENGTHS
from kernel_cases import DTYPES, FUSED_HEAD_CONFIGS, GPU_HEADS, KERNEL_HEAD_CONFIGS, OTHER_LEN, kv_cache, poison_past
from kernel_cases import FORMULA_HEAD_CONFIGS as HEAD_CONFIGS
from kernel_cases import FORMULA_TOL as TOL
from kernel_cases import attention_reference as _attention_reference
from kernel_cases import device_long as _long
from kernel_cases import fused_cache as _cache
from kernel_cases import randn as _randn
from kernel_cases import random_cache as _random_cache
from kernel_cases import split_run as _split_run
from kernel_impls import DEVICE, implementation
from kernel_tolerances import assert_close

from pocketllm.kernels.prefill_attention import prefill_attention_fused, prefill_attention_ref

prefill_attention_impl = implementation("prefill_attention")


# -- the reference against the formula ---------------------------------------------------------


# (slot, start, new tokens): the lengths 1, 2, 17, 63, 65, some behind a cached prefix.
PREFILL_SEQS = [(2, 0, 17), (0, 5, 1), (3, 40, 2), (1, 0, 63), (4, 3, 65)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", HEAD_CONFIGS)
def test_prefill_attention_varlen_matches_reference_and_single_sequence(dtype, num_heads, num_kv_heads, head_dim):
    """Several sequences of different lengths and cached prefixes in one call: each equals the
    float64 per-head reference, and is bitwise what the op returns for that sequence alone."""
    scale = head_dim ** -0.5
    k_cache, v_cache = _random_cache(5, 80, num_kv_heads, head_dim, dtype, seed=head_dim)
    lengths = [n for _, _, n in PREFILL_SEQS]
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    q = _randn(cu[-1], num_heads, head_dim, seed=num_heads * 100 + head_dim, dtype=dtype)
    out = prefill_attention_ref(q, k_cache, v_cache, torch.tensor([s for s, _, _ in PREFILL_SEQS]),
                                torch.tensor([st for _, st, _ in PREFILL_SEQS]), torch.tensor(cu), scale)
    assert out.shape == q.shape and out.dtype == dtype
    for i, (slot, start, n) in enumerate(PREFILL_SEQS):
        lo, hi = cu[i], cu[i + 1]
        expected = _attention_reference(q[lo:hi], k_cache[slot, :start + n], v_cache[slot, :start + n], start, scale)
        torch.testing.assert_close(out[lo:hi].double(), expected, **TOL["attention"][dtype])
        alone = prefill_attention_ref(q[lo:hi].clone(), k_cache, v_cache, torch.tensor([slot]), torch.tensor([start]),
                                      torch.tensor([0, n]), scale)
        assert torch.equal(alone, out[lo:hi]), f"sequence {i} changed when batched with others"


def test_prefill_attention_ignores_cache_beyond_the_sequence():
    """Keys past start + n (stale or garbage cache contents) never influence the output."""
    k_cache, v_cache = _random_cache(2, 50, 2, 16, torch.float32, seed=11)
    q = _randn(9, 4, 16, seed=12)
    args = (torch.tensor([1]), torch.tensor([4]), torch.tensor([0, 9]), 0.25)
    out = prefill_attention_ref(q, k_cache, v_cache, *args)
    k_cache[1, 13:] = 1e4
    v_cache[1, 13:] = float("nan")
    k_cache[0] = 1e4
    assert torch.equal(prefill_attention_ref(q, k_cache, v_cache, *args), out)


# -- the torch backend's fused attention -------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", FUSED_HEAD_CONFIGS)
def test_prefill_matches_reference_and_is_invariant(dtype, heads, kv_heads, head_dim):
    """Sequences of 1, 7, 64 and 70 new tokens, two of them after a cached prefix (start > 0, the
    explicit-mask path): close to the reference; each sequence alone gives its rows' bits."""
    k, v = _cache(kv_heads, head_dim, dtype)
    slots, starts, lengths = torch.tensor([2, 0, 4, 1]), torch.tensor([0, 5, 0, 79]), [1, 7, 64, 70]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    q = _randn(int(cu[-1]), heads, head_dim, seed=4, dtype=dtype)
    out = prefill_attention_fused(q, k, v, slots, starts, cu, 0.3)
    assert_close(out, prefill_attention_ref(q, k, v, slots, starts, cu, 0.3))
    for i, (lo, hi) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        alone = prefill_attention_fused(q[lo:hi], k, v, slots[i:i + 1], starts[i:i + 1], torch.tensor([0, hi - lo]),
                                        0.3)
        assert torch.equal(alone, out[lo:hi]), i


# -- the kernel against the reference, batch and split invariance ------------------------------


def _prefill_case(lengths, starts, num_heads, num_kv_heads, head_dim, dtype, seed=0, device=DEVICE):
    """Concatenated q [T, Hq, D] for sequences of lengths[i] new tokens after starts[i] cached ones,
    caches (sequence i in slot B - i) with NaN past each sequence's end, and cu_seqlens."""
    batch = len(lengths)
    slots = [batch - i for i in range(batch)]
    ends = [s + n for s, n in zip(starts, lengths)]
    k_cache, v_cache = kv_cache(batch + 1, max(ends) + 3, num_kv_heads, head_dim, dtype, seed, device)
    poison_past(k_cache, v_cache, slots, ends)
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


PREFILL_STARTS = (0, 3, 0, 40, 0, 1, 70)  # nonzero cached prefixes for some sequences


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", KERNEL_HEAD_CONFIGS)
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


@pytest.mark.slow
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


ATTENTION_SPLITS = [  # (start, new tokens, absolute cuts)
    (64, 150, [192]),
    (128, 100, [192]),
    (37, 90, [64, 65]),
]


@pytest.mark.parametrize("start,length,cuts", ATTENTION_SPLITS)
def test_prefill_attention_kernel_split_invariance(start, length, cuts):
    """K/V of every position are in the slot (written before attention reads them); the queries of
    positions start.. in one call equal, bitwise, the same queries in pieces."""
    gen = torch.Generator().manual_seed(start + length)
    max_len = start + length + 8
    k_cache, v_cache = torch.randn(3, max_len, 1, 16, generator=gen), torch.randn(3, max_len, 1, 16, generator=gen)
    k_cache, v_cache = k_cache.to(DEVICE), v_cache.to(DEVICE)
    q = torch.randn(length + OTHER_LEN, 2, 16, generator=gen).to(DEVICE)

    def call(inputs, _state, slots, starts, lengths):
        (queries,) = inputs
        return prefill_attention_impl(queries, k_cache, v_cache, _long(slots), _long(starts),
                                      torch.cumsum(_long([0] + lengths), 0), 0.25)

    whole, _, pieces, _ = _split_run(call, (q,), torch.zeros(3, 1), start, cuts)
    assert torch.equal(pieces, whole)


# -- GPU, bf16, realistic sizes ----------------------------------------------------------------


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
