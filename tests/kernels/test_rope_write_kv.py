"""rope_write_kv (pocketllm/kernels/rope_write_kv.py): rotate q and k, write k and v to the cache.

- the reference against the formula: rotated q returned, rotated k and unrotated v written at
  [slot, position] of each token, every other cache cell as it was (`write_kv_ref` alone too);
- the kernel under test (by default the Triton one) against the reference, bitwise in fp32 and
  within tolerance in fp16, on strided q/k/v views of one fused projection, tokens spread over
  slots, and partial rotary tables (R < D, as in Qwen3.5); the `gpu` tests repeat it in bf16 at
  real sizes and address caches past 2^31 elements;
- its batch invariance, bitwise: a token rotated and written alone equals the token in a batch.
"""

from __future__ import annotations

import pytest
import torch
from kernel_cases import FORMULA_HEAD_CONFIGS as HEAD_CONFIGS
from kernel_cases import FORMULA_TOL as TOL
from kernel_cases import gen as _gen
from kernel_cases import randn as _randn
from kernel_cases import random_cache as _random_cache
from kernel_cases import rope_reference as _rope_reference
from kernel_impls import DEVICE, implementation
from kernel_tolerances import assert_close

from pocketllm.kernels.rope import apply_rope_ref, rope_table
from pocketllm.kernels.rope_write_kv import rope_write_kv_ref, write_kv_ref

rope_write_kv_impl = implementation("rope_write_kv")


# -- the reference against the formula ---------------------------------------------------------


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16])
def test_write_kv_writes_exactly_the_given_cells(cache_dtype):
    """Each token's K/V lands at [slot, position], converted to the cache dtype; nothing else changes."""
    slots, max_len, kv_heads, d = 4, 40, 2, 16
    k_cache = _randn(slots, max_len, kv_heads, d, seed=7, dtype=cache_dtype)
    v_cache = _randn(slots, max_len, kv_heads, d, seed=8, dtype=cache_dtype)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    token_slots = torch.tensor([2, 2, 2, 0, 3, 1, 1])
    positions = torch.tensor([5, 6, 7, 0, 39, 17, 18])
    k = _randn(7, kv_heads, d, seed=9)
    v = _randn(7, kv_heads, d, seed=10)
    write_kv_ref(k_cache, v_cache, k, v, token_slots, positions)
    expected_k, expected_v = before_k.clone(), before_v.clone()
    for t in range(7):
        s, p = int(token_slots[t]), int(positions[t])
        for h in range(kv_heads):
            for j in range(d):
                expected_k[s, p, h, j] = k[t, h, j].item()
                expected_v[s, p, h, j] = v[t, h, j].item()
    assert k_cache.dtype == cache_dtype
    assert torch.equal(k_cache, expected_k)
    assert torch.equal(v_cache, expected_v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", HEAD_CONFIGS)
def test_rope_write_kv_rotates_q_and_k_and_writes_k_v(dtype, num_heads, num_kv_heads, head_dim):
    """The fused op returns rotated q, stores rotated k and unrotated v at [slot, position] of each
    token, and leaves every other cache cell as it was."""
    theta, tokens = 10000.0, 9
    cos, sin = rope_table(head_dim, 64, theta)
    k_cache, v_cache = _random_cache(3, 64, num_kv_heads, head_dim, dtype, seed=head_dim + 50)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    q = _randn(tokens, num_heads, head_dim, seed=1, dtype=dtype)
    k = _randn(tokens, num_kv_heads, head_dim, seed=2, dtype=dtype)
    v = _randn(tokens, num_kv_heads, head_dim, seed=3, dtype=dtype)
    token_slots = torch.tensor([1, 1, 1, 1, 0, 2, 2, 2, 2])
    positions = torch.tensor([10, 11, 12, 13, 0, 60, 61, 62, 63])
    q_rot = rope_write_kv_ref(q, k, v, positions, cos, sin, k_cache, v_cache, token_slots)
    assert q_rot.shape == q.shape and q_rot.dtype == dtype
    torch.testing.assert_close(q_rot.double(), _rope_reference(q, positions, theta), **TOL["rope"][dtype])
    written = torch.zeros(k_cache.shape[:2], dtype=torch.bool)
    written[token_slots, positions] = True
    torch.testing.assert_close(k_cache[token_slots, positions].double(), _rope_reference(k, positions, theta),
                               **TOL["rope"][dtype])
    assert torch.equal(v_cache[token_slots, positions], v)
    assert torch.equal(k_cache[~written], before_k[~written]) and torch.equal(v_cache[~written], before_v[~written])


# -- the kernel against the reference, batch invariance ----------------------------------------


def _rope_case(tokens: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, seed: int,
               device: str = DEVICE, slots: int = 4, max_len: int = 256):
    """q/k/v as strided views of one fused projection [T, (Hq + 2 Hkv) * D] (as the model makes
    them), distinct (slot, position) pairs spread over `slots` slots, random caches, rope tables."""
    gen = _gen(seed)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(device=device, dtype=dtype)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k, v = (t.reshape(tokens, -1, head_dim) for t in (q, k, v))
    cells = torch.randperm(slots * max_len, generator=gen)[:tokens]
    token_slots, positions = (cells // max_len).to(device), (cells % max_len).to(device)
    shape = (slots, max_len, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    v_cache = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    cos, sin = rope_table(head_dim, max_len, 1_000_000.0, device=device)
    return q, k, v, positions, cos, sin, k_cache, v_cache, token_slots


def _run_both(case):
    """(q_out, k_cache, v_cache) of the kernel and of the reference, each on its own cache copy."""
    q, k, v, positions, cos, sin, k_cache, v_cache, token_slots = case
    kc, vc, kr, vr = k_cache.clone(), v_cache.clone(), k_cache.clone(), v_cache.clone()
    out = rope_write_kv_impl(q, k, v, positions, cos, sin, kc, vc, token_slots)
    ref = rope_write_kv_ref(q, k, v, positions, cos, sin, kr, vr, token_slots)
    return (out, kc, vc), (ref, kr, vr)


# (tokens, q heads, kv heads, head dim): T 1/2/17/65, GQA 1/2/4, D 16/32/64/128 and the odd 24.
ROPE_CASES = [(1, 4, 4, 16), (2, 4, 2, 32), (17, 8, 2, 64), (65, 4, 1, 128), (17, 2, 2, 128), (5, 3, 3, 24)]


def _assert_same_outputs(got: tuple, want: tuple, dtype: torch.dtype) -> None:
    """Rotated q and both caches: bitwise in fp32, within the dtype's tolerance otherwise."""
    for actual, expected in zip(got, want):
        if dtype == torch.float32:
            assert torch.equal(actual, expected)
        else:
            assert_close(actual, expected)


def _assert_rest_untouched(case, kc, vc):
    """The mask of the cache entries no token of `case` writes; asserts kc/vc still hold the
    inputs' caches there."""
    positions, k_cache, v_cache, token_slots = case[3], case[6], case[7], case[8]
    untouched = torch.ones(k_cache.shape[:2], dtype=torch.bool, device=k_cache.device)
    untouched[token_slots, positions] = False
    assert torch.equal(kc[untouched], k_cache[untouched]) and torch.equal(vc[untouched], v_cache[untouched])
    return untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens,heads,kv_heads,head_dim", ROPE_CASES)
def test_rope_write_kv_matches_reference(tokens, heads, kv_heads, head_dim, dtype):
    """Rotated q and the written K/V equal the reference (fp32 bitwise, fp16 within tolerance)
    for strided q/k/v views and tokens spread over slots; every other cache entry is untouched."""
    case = _rope_case(tokens, heads, kv_heads, head_dim, dtype, seed=tokens * 100 + head_dim)
    (out, kc, vc), (ref, kr, vr) = _run_both(case)
    assert out.shape == ref.shape and out.dtype == dtype and out.is_contiguous()
    _assert_same_outputs((out, kc, vc), (ref, kr, vr), dtype)
    untouched = _assert_rest_untouched(case, kc, vc)
    assert not torch.equal(kc[~untouched], case[6][~untouched])  # the written entries did change


# (tokens, q heads, kv heads, head dim, rotary width): partial rotary, as in Qwen3.5.
PARTIAL_ROPE_CASES = [(5, 4, 2, 64, 16), (17, 2, 1, 256, 64), (3, 3, 3, 32, 8), (2, 2, 2, 24, 22)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens,heads,kv_heads,head_dim,rotary", PARTIAL_ROPE_CASES)
def test_rope_write_kv_partial_rotary_matches_reference(tokens, heads, kv_heads, head_dim, rotary, dtype):
    """Tables of width R < D: only the first R dims of each q/k head rotate, the rest (and v)
    pass through; q and the written K/V equal the reference (fp32 bitwise, fp16 within
    tolerance) and the pass-through dims are the inputs' bits."""
    case = list(_rope_case(tokens, heads, kv_heads, head_dim, dtype, seed=tokens * 100 + rotary))
    case[4], case[5] = rope_table(rotary, case[6].shape[1], 1_000_000.0, device=DEVICE)
    (out, kc, vc), (ref, kr, vr) = _run_both(case)
    assert out.shape == ref.shape and out.dtype == dtype
    _assert_same_outputs((out, kc, vc), (ref, kr, vr), dtype)
    q, k, positions, token_slots = case[0], case[1], case[3], case[8]
    assert torch.equal(out[..., rotary:], q[..., rotary:])
    assert torch.equal(kc[token_slots, positions][..., rotary:], k[..., rotary:])
    assert not torch.equal(out[..., :rotary], q[..., :rotary])  # the rotary dims did rotate


def test_rope_write_kv_token_alone_equals_token_in_batch():
    """Each token rotated and written alone gives bitwise the same q row and cache entries as
    inside a batch of 6 (fp16)."""
    q, k, v, positions, cos, sin, k_cache, v_cache, token_slots = _rope_case(6, 4, 2, 32, torch.float16, seed=7)
    kb, vb = k_cache.clone(), v_cache.clone()
    batch = rope_write_kv_impl(q, k, v, positions, cos, sin, kb, vb, token_slots)
    ka, va = k_cache.clone(), v_cache.clone()
    for t in range(6):
        alone = rope_write_kv_impl(q[t:t + 1], k[t:t + 1], v[t:t + 1], positions[t:t + 1], cos, sin, ka, va,
                                   token_slots[t:t + 1])
        assert torch.equal(alone[0], batch[t])
    assert torch.equal(ka, kb) and torch.equal(va, vb)


# -- GPU, bf16, real sizes ---------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 64, 4096])
def test_gpu_rope_write_kv_matches_reference(tokens):
    """bf16, Hq=32, Hkv=8, D=128, up to 4096 tokens over 16 slots of 4096 positions: q and the
    caches match the reference (bitwise in fp32), and other cache entries are untouched."""
    for dtype in (torch.bfloat16, torch.float32):
        case = _rope_case(tokens, 32, 8, 128, dtype, seed=tokens, device="cuda", slots=16, max_len=4096)
        (out, kc, vc), (ref, kr, vr) = _run_both(case)
        _assert_same_outputs((out, kc, vc), (ref, kr, vr), dtype)
        _assert_rest_untouched(case, kc, vc)


@pytest.mark.gpu
def test_gpu_rope_write_kv_partial_rotary_matches_reference():
    """Qwen3.5 attention shapes (Hq=16, Hkv=2, D=256, R=64), 4096 tokens: q and the caches match
    the reference, bitwise in fp32 and within tolerance in bf16."""
    for dtype in (torch.bfloat16, torch.float32):
        case = list(_rope_case(4096, 16, 2, 256, dtype, seed=3, device="cuda", slots=16, max_len=4096))
        case[4], case[5] = rope_table(64, 4096, 10_000_000.0, device="cuda")
        _assert_same_outputs(*_run_both(case), dtype)


@pytest.mark.gpu
def test_gpu_rope_write_kv_addresses_past_2_31_elements():
    """bf16 caches of 2^31 + 2^20 elements: the entry of a token in the last slot (offset > 2^31)
    holds its rotated K and V."""
    slots, max_len, kv_heads, head_dim = 2049, 1024, 8, 128  # slot stride 2^20 elements
    k_cache = torch.zeros(slots, max_len, kv_heads, head_dim, dtype=torch.bfloat16, device="cuda")
    v_cache = torch.zeros_like(k_cache)
    q, k, v, _, cos, sin, _, _, _ = _rope_case(2, 32, kv_heads, head_dim, torch.bfloat16, seed=5, device="cuda",
                                               max_len=max_len)
    token_slots = torch.tensor([2048, 0], device="cuda")
    positions = torch.tensor([1023, 5], device="cuda")
    out = rope_write_kv_impl(q, k, v, positions, cos, sin, k_cache, v_cache, token_slots)
    assert_close(out, apply_rope_ref(q, positions, cos, sin))
    assert_close(k_cache[token_slots, positions], apply_rope_ref(k, positions, cos, sin))
    assert torch.equal(v_cache[token_slots, positions], v)
