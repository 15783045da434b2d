"""Each torch reference op in pocketllm/kernels against an independent plain-torch formula.

The formulas here are written from the op's mathematical definition (explicit per-head loops,
complex rotation, float64), not from the op's code, so a shared mistake is unlikely.
"""

from __future__ import annotations

import math

import pytest
import torch

from pocketllm.kernels.decode_attention import decode_attention_ref
from pocketllm.kernels.embedding import embedding_ref
from pocketllm.kernels.linear import linear_ref, linear_row_invariant
from pocketllm.kernels.prefill_attention import prefill_attention_ref
from pocketllm.kernels.rms_norm import rms_norm_ref
from pocketllm.kernels.rope import apply_rope_ref, rope_table
from pocketllm.kernels.rope_write_kv import rope_write_kv_ref, write_kv_ref
from pocketllm.kernels.silu_and_mul import silu_and_mul_ref

# Tolerances of each op against its float64 reference, per input dtype.
TOL = {
    "rms_norm": {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
                 torch.bfloat16: dict(atol=2e-2, rtol=2e-2)},
    "rope_table": {torch.float32: dict(atol=1e-4, rtol=0)},
    "rope": {torch.float32: dict(atol=1e-4, rtol=1e-5), torch.float16: dict(atol=1e-2, rtol=5e-3)},
    "attention": {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=4e-3, rtol=4e-3)},
    "decode_vs_prefill": {torch.float32: dict(atol=1e-6, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)},
    "silu_and_mul": {torch.float32: dict(atol=1e-6, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)},
    "linear": {torch.float32: dict(atol=1e-4, rtol=1e-5), torch.float16: dict(atol=3e-2, rtol=1e-2),
               torch.bfloat16: dict(atol=2e-1, rtol=2e-2)},
}

SEQ_LENGTHS = (1, 2, 17, 63, 65)
# (num_heads, num_kv_heads, head_dim): GQA ratios 1, 2, 4 and head dims 16, 32, 24.
HEAD_CONFIGS = [(4, 4, 16), (4, 2, 32), (8, 2, 24), (3, 3, 24), (8, 2, 16)]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape, seed: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=_gen(seed)).to(dtype)


# -- embedding ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 2, 17, 65])
def test_embedding_is_exact_row_gather(dtype, num_tokens):
    """embedding_ref returns table row `id` for each id, bit for bit, repeats and extremes included."""
    table = _randn(300, 24, seed=1, dtype=dtype)
    ids = torch.randint(0, 300, (num_tokens,), generator=_gen(num_tokens))
    ids[0] = 299
    if num_tokens > 1:
        ids[-1] = 0
    out = embedding_ref(ids, table)
    expected = torch.stack([table[int(i)] for i in ids])
    assert out.dtype == dtype and out.shape == (num_tokens, 24)
    assert torch.equal(out, expected)


# -- RMSNorm ----------------------------------------------------------------------------------


def _rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x64 = x.double()
    rms = torch.sqrt((x64 * x64).sum(-1, keepdim=True) / x.shape[-1] + eps)
    return (x64 / rms) * weight.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 64), (17, 48), (63, 4, 16), (2, 3, 24)])
def test_rms_norm_matches_formula(dtype, shape):
    """x / sqrt(mean(x^2) + eps) * w over the last dim only (rows and heads are independent)."""
    x = (3.0 * _randn(*shape, seed=2)).to(dtype)
    weight = (1.0 + 0.1 * _randn(shape[-1], seed=3)).to(dtype)
    eps = 1e-6
    out = rms_norm_ref(x, weight, eps)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out.double(), _rms_norm_reference(x, weight, eps), **TOL["rms_norm"][dtype])


def test_rms_norm_eps_matters_for_tiny_rows():
    """eps enters under the square root: a row of zeros maps to zeros, a tiny row is damped by eps."""
    x = torch.tensor([[0.0, 0.0, 0.0, 0.0], [1e-4, -1e-4, 1e-4, -1e-4]])
    w = torch.ones(4)
    out = rms_norm_ref(x, w, 1e-6)
    assert torch.equal(out[0], torch.zeros(4))
    expected = 1e-4 / math.sqrt(1e-8 + 1e-6)
    torch.testing.assert_close(out[1], torch.tensor([expected, -expected, expected, -expected]),
                               atol=1e-6, rtol=1e-5)


# -- RoPE ------------------------------------------------------------------------------------------


def _angles(head_dim: int, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """[T, D/2] float64 angles pos * theta^(-2i/D)."""
    i = torch.arange(head_dim // 2, dtype=torch.float64)
    inv_freq = theta ** (-2.0 * i / head_dim)
    return positions.double()[:, None] * inv_freq[None, :]


def _rope_reference(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate each pair (x[i], x[i + D/2]) as the complex number x[i] + j x[i + D/2] by its angle."""
    half = x.shape[-1] // 2
    z = torch.complex(x[..., :half].double(), x[..., half:].double())
    rot = torch.polar(torch.ones(1, dtype=torch.float64), _angles(x.shape[-1], positions, theta))
    z = z * rot[:, None, :]
    return torch.cat([z.real, z.imag], dim=-1)


@pytest.mark.parametrize("head_dim", [16, 24, 32])
@pytest.mark.parametrize("theta", [10000.0, 1000000.0])
def test_rope_table_matches_formula(head_dim, theta):
    """cos/sin tables are cos/sin(pos * theta^(-2i/D)), the D/2 frequencies repeated for both halves."""
    cos, sin = rope_table(head_dim, 600, theta)
    assert cos.shape == sin.shape == (600, head_dim) and cos.dtype == sin.dtype == torch.float32
    angles = _angles(head_dim, torch.arange(600), theta)
    full = torch.cat([angles, angles], dim=-1)
    torch.testing.assert_close(cos.double(), full.cos(), **TOL["rope_table"][torch.float32])
    torch.testing.assert_close(sin.double(), full.sin(), **TOL["rope_table"][torch.float32])
    assert torch.equal(cos[0], torch.ones(head_dim)) and torch.equal(sin[0], torch.zeros(head_dim))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("head_dim", [16, 24, 32])
@pytest.mark.parametrize("num_tokens", [1, 2, 17, 65])
def test_apply_rope_matches_complex_rotation(dtype, head_dim, num_tokens):
    """apply_rope_ref rotates pairs (i, i + D/2) by each token's own position, positions in any order."""
    theta = 10000.0
    cos, sin = rope_table(head_dim, 512, theta)
    x = _randn(num_tokens, 3, head_dim, seed=head_dim + num_tokens, dtype=dtype)
    positions = torch.randint(0, 512, (num_tokens,), generator=_gen(num_tokens))
    out = apply_rope_ref(x, positions, cos, sin)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out.double(), _rope_reference(x, positions, theta), **TOL["rope"][dtype])


def test_rope_scores_depend_only_on_relative_position():
    """<rope(q, m), rope(k, n)> depends only on m - n: the defining property of rotary embeddings."""
    cos, sin = rope_table(32, 400, 10000.0)
    q, k = _randn(1, 1, 32, seed=5), _randn(1, 1, 32, seed=6)

    def score(m: int, n: int) -> float:
        qm = apply_rope_ref(q, torch.tensor([m]), cos, sin)
        kn = apply_rope_ref(k, torch.tensor([n]), cos, sin)
        return float((qm.double() * kn.double()).sum())

    base = score(7, 3)
    for shift in (1, 50, 300):
        assert score(7 + shift, 3 + shift) == pytest.approx(base, abs=2e-4)
    assert abs(score(7, 3) - score(3, 7)) > 1e-3  # and it does depend on the sign of the offset


# -- KV write ------------------------------------------------------------------------------------


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


# -- attention -------------------------------------------------------------------------------------


def _attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int,
                         scale: float) -> torch.Tensor:
    """q [n, Hq, D] at positions start.., k/v [start + n, Hkv, D]: per-head softmax attention in
    float64, KV heads repeated so query head h reads KV head h // (Hq / Hkv), causal mask."""
    n, num_heads, _ = q.shape
    length = k.shape[0]
    group = num_heads // k.shape[1]
    k_rep = k.double().repeat_interleave(group, dim=1)
    v_rep = v.double().repeat_interleave(group, dim=1)
    out = torch.zeros(q.shape, dtype=torch.float64)
    causal = torch.arange(length)[None, :] <= (start + torch.arange(n))[:, None]  # key j visible to query i
    for h in range(num_heads):
        scores = (q[:, h].double() @ k_rep[:, h].T) * scale  # [n, length]
        scores = scores.masked_fill(~causal, -math.inf)
        out[:, h] = torch.softmax(scores, dim=-1) @ v_rep[:, h]
    return out


def _random_cache(slots: int, max_len: int, kv_heads: int, d: int, dtype, seed: int):
    """A cache filled with random values everywhere, so reading past a sequence's end shows."""
    return (_randn(slots, max_len, kv_heads, d, seed=seed, dtype=dtype),
            _randn(slots, max_len, kv_heads, d, seed=seed + 1, dtype=dtype))


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


# -- SiLU and mul -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_tokens,inter", [(1, 16), (17, 96), (65, 24)])
def test_silu_and_mul_matches_formula(dtype, num_tokens, inter):
    """[T, 2I] -> gate * sigmoid(gate) * up with gate the first I columns."""
    gate_up = (2.0 * _randn(num_tokens, 2 * inter, seed=inter)).to(dtype)
    gate, up = gate_up[:, :inter].double(), gate_up[:, inter:].double()
    expected = gate / (1.0 + torch.exp(-gate)) * up
    out = silu_and_mul_ref(gate_up)
    assert out.shape == (num_tokens, inter) and out.dtype == dtype
    torch.testing.assert_close(out.double(), expected, **TOL["silu_and_mul"][dtype])


# -- linear ----------------------------------------------------------------------------------------------

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

# Bitwise row invariance of linear_row_invariant, at 1 and 2 threads: test_linear_invariance.py.
