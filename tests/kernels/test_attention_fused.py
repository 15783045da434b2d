"""The torch backend's attention (`prefill_attention_fused`, `decode_attention_fused`: torch's fused
attention, one call per sequence) against the references, and its batch and slot invariance: a
sequence's output is the same bits alone, in any batch, and in any slot."""

from __future__ import annotations

import pytest
import torch
from kernel_tolerances import assert_close

from pocketllm.kernels.decode_attention import decode_attention_fused, decode_attention_ref
from pocketllm.kernels.prefill_attention import prefill_attention_fused, prefill_attention_ref

# (num_heads, num_kv_heads, head_dim): GQA ratios 1, 2, 4, 8; odd head dims; the Qwen3-0.6B and
# Qwen3.5-0.8B attention shapes last.
HEAD_CONFIGS = [(4, 4, 16), (4, 2, 24), (8, 2, 40), (8, 1, 8), (16, 8, 128), (8, 2, 256)]
SLOTS, MAX_LEN = 5, 150
DTYPES = [torch.float32, torch.float16]


def _randn(*shape, seed: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _cache(num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return (_randn(SLOTS, MAX_LEN, num_kv_heads, head_dim, seed=1, dtype=dtype),
            _randn(SLOTS, MAX_LEN, num_kv_heads, head_dim, seed=2, dtype=dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", HEAD_CONFIGS)
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


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", HEAD_CONFIGS)
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


def test_decode_never_reads_past_the_sequence():
    """Cache positions past a sequence's end hold NaN (a stale, failed request's K/V): the output
    stays finite and equal to the clean cache's."""
    k, v = _cache(2, 16, torch.float32)
    q = _randn(2, 4, 16, seed=5, dtype=torch.float32)
    slots, lens = torch.tensor([0, 3]), torch.tensor([10, 64])
    clean = decode_attention_fused(q, k, v, slots, lens, 0.25)
    k[0, 10:], v[0, 10:], k[3, 64:], v[3, 64:] = (float("nan"),) * 4
    assert torch.equal(decode_attention_fused(q, k, v, slots, lens, 0.25), clean)
