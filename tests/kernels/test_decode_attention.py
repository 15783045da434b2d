"""decode_attention (pocketllm/kernels/decode_attention.py): one query per sequence, at position
seq_len - 1, over the K/V of its slot.

- the reference against per-head softmax attention written out in float64 (GQA), and equal to the
  last row of prefilling the whole sequence;
- the torch backend's fused attention against the reference, and its batch and slot invariance:
  a sequence alone, among others and copied into another slot gives its bits in the batch; the
  cache past a sequence never read;
- the kernel under test (by default the Triton one, which runs the prefill kernel on one row) and
  the split-KV kernel against the reference, lengths over one and several splits, never reading
  past a sequence's end (NaN there), and their batch and slot invariance, bitwise;
- the kernel under test gives a position the bits the prefill kernel gives it (exact positions),
  which the split-KV kernel does not promise.
CPU runs use the Triton interpreter (fp32, fp16; tiny head counts); the `gpu` test repeats the
comparison in bf16 at realistic sizes.
"""

from __future__ import annotations

import pytest
import torch
from kernel_cases import ATTENTION_LENGTHS as LENGTHS
from kernel_cases import DTYPES, FUSED_HEAD_CONFIGS, GPU_HEADS, KERNEL_HEAD_CONFIGS, kv_cache, poison_past
from kernel_cases import FORMULA_HEAD_CONFIGS as HEAD_CONFIGS
from kernel_cases import FORMULA_TOL as TOL
from kernel_cases import FUSED_SLOTS as SLOTS
from kernel_cases import attention_reference as _attention_reference
from kernel_cases import fused_cache as _cache
from kernel_cases import randn as _randn
from kernel_cases import random_cache as _random_cache
from kernel_impls import DEVICE, implementation
from kernel_tolerances import assert_close

from pocketllm.kernels.decode_attention import (
    DECODE_BLOCK_N,
    decode_attention_fused,
    decode_attention_ref,
    decode_attention_split_kv,
)
from pocketllm.kernels.prefill_attention import prefill_attention_ref

decode_attention_impl = implementation("decode_attention")
prefill_attention_impl = implementation("prefill_attention")
KERNELS = ["under_test", "split_kv"]

SEQ_LENGTHS = (1, 2, 17, 63, 65)


# -- the reference against the formula ---------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", HEAD_CONFIGS)
def test_decode_attention_matches_reference(dtype, num_heads, num_kv_heads, head_dim):
    """One query per sequence at position seq_len - 1 (lengths 1, 2, 17, 63, 65) equals the reference."""
    scale = head_dim ** -0.5
    k_cache, v_cache = _random_cache(6, 70, num_kv_heads, head_dim, dtype, seed=head_dim + 3)
    slots = [3, 0, 5, 1, 2]
    q = _randn(len(slots), num_heads, head_dim, seed=head_dim + 4, dtype=dtype)
    out = decode_attention_ref(q, k_cache, v_cache, torch.tensor(slots), torch.tensor(SEQ_LENGTHS), scale)
    assert out.shape == q.shape and out.dtype == dtype
    for i, (slot, length) in enumerate(zip(slots, SEQ_LENGTHS)):
        expected = _attention_reference(q[i:i + 1], k_cache[slot, :length], v_cache[slot, :length], length - 1, scale)
        torch.testing.assert_close(out[i:i + 1].double(), expected, **TOL["attention"][dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", HEAD_CONFIGS)
@pytest.mark.parametrize("length", SEQ_LENGTHS)
def test_decode_attention_equals_last_prefill_row(dtype, num_heads, num_kv_heads, head_dim, length):
    """Decoding the last token of a sequence gives the last row of prefilling the whole sequence."""
    scale = head_dim ** -0.5
    k_cache, v_cache = _random_cache(2, 70, num_kv_heads, head_dim, dtype, seed=length)
    q = _randn(length, num_heads, head_dim, seed=length + 1, dtype=dtype)
    prefill = prefill_attention_ref(q, k_cache, v_cache, torch.tensor([1]), torch.tensor([0]),
                                    torch.tensor([0, length]), scale)
    decode = decode_attention_ref(q[-1:].clone(), k_cache, v_cache, torch.tensor([1]), torch.tensor([length]), scale)
    torch.testing.assert_close(decode, prefill[-1:], **TOL["decode_vs_prefill"][dtype])


# -- the torch backend's fused attention -------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", FUSED_HEAD_CONFIGS)
def test_decode_matches_reference_and_is_invariant(dtype, heads, kv_heads, head_dim):
    """Odd lengths (1, one block, block + 1, the cache's end); each sequence alone, among others,
    and copied into another slot gives the same bits as in the batch."""
    k, v = _cache(kv_heads, head_dim, dtype)
    lens = torch.tensor([1, 64, 65, 149, 150])
    slots = torch.tensor([3, 0, 4, 1, 2])
    q = _randn(5, heads, head_dim, seed=3, dtype=dtype)
    out = decode_attention_fused(q, k, v, slots, lens, head_dim ** -0.5)
    assert_close(out, decode_attention_ref(q, k, v, slots, lens, head_dim ** -0.5))
    for i in range(5):
        alone = decode_attention_fused(q[i:i + 1], k, v, slots[i:i + 1], lens[i:i + 1], head_dim ** -0.5)
        assert torch.equal(alone, out[i:i + 1]), i
        others = [i, (i + 2) % 5, (i + 4) % 5]
        mixed = decode_attention_fused(q[others], k, v, slots[others], lens[others], head_dim ** -0.5)
        assert torch.equal(mixed[:1], out[i:i + 1]), i
        spare = (int(slots[i]) + 1) % SLOTS
        k_moved, v_moved = k.clone(), v.clone()
        k_moved[spare], v_moved[spare] = k[slots[i]], v[slots[i]]
        moved = decode_attention_fused(q[i:i + 1], k_moved, v_moved, torch.tensor([spare]), lens[i:i + 1],
                                       head_dim ** -0.5)
        assert torch.equal(moved, out[i:i + 1]), i


def test_decode_never_reads_past_the_sequence():
    """Cache positions past a sequence's end hold NaN (a stale, failed request's K/V): the output
    stays finite and equal to the clean cache's."""
    k, v = _cache(2, 16, torch.float32)
    q = _randn(2, 4, 16, seed=5, dtype=torch.float32)
    slots, lens = torch.tensor([0, 3]), torch.tensor([10, 64])
    clean = decode_attention_fused(q, k, v, slots, lens, 0.25)
    k[0, 10:], v[0, 10:], k[3, 64:], v[3, 64:] = (float("nan"),) * 4
    assert torch.equal(decode_attention_fused(q, k, v, slots, lens, 0.25), clean)


# -- the kernel against the reference, batch and slot invariance -------------------------------


def _decode_case(lengths, num_heads, num_kv_heads, head_dim, dtype, seed=0, device=DEVICE):
    """q [B, Hq, D] and caches where sequence i (length lengths[i]) sits in slot B - i (slots in
    reverse batch order, slot 0 unused); cache positions past each sequence's end are NaN."""
    batch = len(lengths)
    slots = [batch - i for i in range(batch)]
    k_cache, v_cache = kv_cache(batch + 1, max(lengths) + 3, num_kv_heads, head_dim, dtype, seed, device)
    poison_past(k_cache, v_cache, slots, list(lengths))
    gen = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(batch, num_heads, head_dim, generator=gen).to(device=device, dtype=dtype)
    as_long = dict(dtype=torch.int64, device=device)
    return q, k_cache, v_cache, torch.tensor(slots, **as_long), torch.tensor(lengths, **as_long)


def _decode(kernel, q, k_cache, v_cache, slot_ids, seq_lens, scale, split_size):
    """The kernel under test, or the split-KV kernel with `split_size` (small splits make short
    sequences span several)."""
    if kernel == "split_kv":
        return decode_attention_split_kv(q, k_cache, v_cache, slot_ids, seq_lens, scale, split_size=split_size)
    return decode_attention_impl(q, k_cache, v_cache, slot_ids, seq_lens, scale)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", KERNEL_HEAD_CONFIGS)
def test_decode_matches_reference(kernel, dtype, num_heads, num_kv_heads, head_dim):
    """Lengths 1..130 in one call, split_size 64 (up to 3 splits merged), never reading past a
    sequence's end (NaN there), agree with decode_attention_ref."""
    q, k, v, slots, lens = _decode_case(LENGTHS, num_heads, num_kv_heads, head_dim, dtype)
    scale = head_dim ** -0.5
    out = _decode(kernel, q, k, v, slots, lens, scale, split_size=64)
    assert out.dtype == dtype and out.shape == q.shape
    assert_close(out, decode_attention_ref(q, k, v, slots, lens, scale))


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_default_split_size_matches_reference(kernel, dtype):
    """The default split size (256), with sequences of one split, exactly one and several splits."""
    q, k, v, slots, lens = _decode_case((1, 255, 256, 257, 600), 2, 1, 32, dtype, seed=3)
    assert_close(_decode(kernel, q, k, v, slots, lens, 0.2, split_size=256),
                 decode_attention_ref(q, k, v, slots, lens, 0.2))


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_is_batch_and_slot_invariant(kernel, dtype):
    """A sequence decoded alone, in any slot, gives bitwise its output inside a batch of sequences
    with very different lengths (so different split counts and grid sizes)."""
    lengths = LENGTHS + (300,)
    q, k, v, slots, lens = _decode_case(lengths, 4, 2, 24, dtype, seed=5)
    batched = _decode(kernel, q, k, v, slots, lens, 0.3, split_size=64)
    spare = len(lengths) + 1  # a slot no sequence of the batch uses
    k_moved, v_moved = torch.cat([k, torch.zeros_like(k[:1])]), torch.cat([v, torch.zeros_like(v[:1])])
    for i in range(len(lengths)):
        alone = _decode(kernel, q[i:i + 1], k, v, slots[i:i + 1], lens[i:i + 1], 0.3, split_size=64)
        assert torch.equal(alone, batched[i:i + 1])
        k_moved[spare], v_moved[spare] = k[slots[i]], v[slots[i]]
        moved = _decode(kernel, q[i:i + 1], k_moved, v_moved, torch.tensor([spare], device=DEVICE), lens[i:i + 1],
                        0.3, split_size=64)
        assert torch.equal(moved, alone)


def test_decode_rejects_split_size_not_multiple_of_block():
    """A split must be whole key blocks, so that block starts are multiples of BLOCK_N."""
    q, k, v, slots, lens = _decode_case((5,), 2, 1, 16, torch.float32)
    with pytest.raises(ValueError, match="multiple"):
        decode_attention_split_kv(q, k, v, slots, lens, 0.3, split_size=DECODE_BLOCK_N + 1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_decoded_position_has_the_bits_of_the_same_position_prefilled(dtype):
    """Decoding position p (lengths 1..130, several in one call) gives bitwise the row p of the prefill
    kernel run on the whole sequence and on a piece cut just before p: what makes a generated token's
    logprob equal the logprob of scoring the same sequence."""
    lengths = (1, 2, 17, 64, 65, 130)
    q, k, v, slots, lens = _decode_case(lengths, 4, 2, 24, dtype, seed=9)
    decoded = decode_attention_impl(q, k, v, slots, lens, 0.3)
    for i, length in enumerate(lengths):
        piece = torch.randn(length, 4, 24, generator=torch.Generator().manual_seed(i)).to(device=DEVICE, dtype=dtype)
        piece[-1] = q[i]
        one = torch.tensor([0, length], device=DEVICE)
        whole = prefill_attention_impl(piece, k, v, slots[i:i + 1], torch.tensor([0], device=DEVICE), one, 0.3)
        assert torch.equal(whole[-1], decoded[i]), f"length {length}: the whole-prompt row differs"
        cut = max(length - 3, 0)
        tail = prefill_attention_impl(piece[cut:], k, v, slots[i:i + 1], torch.tensor([cut], device=DEVICE),
                                      torch.tensor([0, length - cut], device=DEVICE), 0.3)
        assert torch.equal(tail[-1], decoded[i]), f"length {length}: the row of a piece from {cut} differs"


# -- GPU, bf16, realistic sizes ----------------------------------------------------------------


GPU_DECODE_LENGTHS = (4096, 1, 17, 300, 1000, 2049, 3333, 4095)


@pytest.mark.parametrize("kernel,split_size", [("under_test", 256), ("split_kv", 64), ("split_kv", 256)])
@pytest.mark.gpu
def test_gpu_decode_matches_reference_and_is_batch_invariant(kernel, split_size):
    """bf16, B=8, context up to 4096, Hq=32, Hkv=8, D=128: matches the reference, and each
    sequence alone equals its output in the batch bitwise."""
    q, k, v, slots, lens = _decode_case(GPU_DECODE_LENGTHS, dtype=torch.bfloat16, device="cuda", **GPU_HEADS)
    scale = 128 ** -0.5
    out = _decode(kernel, q, k, v, slots, lens, scale, split_size=split_size)
    assert_close(out, decode_attention_ref(q, k, v, slots, lens, scale))
    for i in range(len(GPU_DECODE_LENGTHS)):
        alone = _decode(kernel, q[i:i + 1], k, v, slots[i:i + 1], lens[i:i + 1], scale, split_size=split_size)
        assert torch.equal(alone, out[i:i + 1])
