"""The Triton rope + KV-write kernel (pocketllm/kernels/rope_write_kv.py) and sampling kernel
(pocketllm/kernels/sample.py) against their torch references, and their invariance contract,
checked bitwise: a token's or a row's result does not depend on the batch around it.

CPU runs use the Triton interpreter (fp32, fp16; small grids to stay fast); the `gpu` tests repeat
the comparisons in bf16 / at a real vocabulary size on CUDA.

Sampling: the kernel's noise is the reference's bit for bit and logits / T is IEEE-rounded like
torch's, so its top-k set is exactly the reference's on tie-free logits. Its top-p mass is summed
in another order (and exp may be approximated on GPU), so a token whose cumulative mass lies
within BAND of top_p may go either way: `_analyse` marks those tokens, the allowed sets are
compared exactly everywhere else, and tokens are compared exactly on rows where the winner cannot
depend on that band or on the rounding of the noisy scores (top-2 scores more than GAP apart).
"""

from __future__ import annotations

import pytest
import torch
from helpers import budget
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from kernel_impls import DEVICE, implementation
from kernel_tolerances import assert_close

from pocketllm.kernels.rope import apply_rope_ref, rope_table
from pocketllm.kernels.rope_write_kv import rope_write_kv_ref
from pocketllm.kernels.sample import _launch_sample, allowed_mask, sample_ref, sample_triton, uniform_noise

rope_write_kv_impl = implementation("rope_write_kv")
sample_impl = implementation("sample")

BAND = 1e-4  # top-p: cumulative masses this close to top_p are rounding-dependent
GAP = 1e-5  # noisy scores this close are rounding-dependent


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _as_int64(seed: int) -> int:
    """A seed in [0, 2^64) as the int64 with the same bits (how the engine passes seeds)."""
    return seed - 2**64 if seed >= 2**63 else seed


# -- rope + KV write ---------------------------------------------------------------------------------


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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens,heads,kv_heads,head_dim", ROPE_CASES)
def test_rope_write_kv_matches_reference(tokens, heads, kv_heads, head_dim, dtype):
    """Rotated q and the written K/V equal the reference (fp32 bitwise, fp16 within tolerance)
    for strided q/k/v views and tokens spread over slots; every other cache entry is untouched."""
    case = _rope_case(tokens, heads, kv_heads, head_dim, dtype, seed=tokens * 100 + head_dim)
    (out, kc, vc), (ref, kr, vr) = _run_both(case)
    assert out.shape == ref.shape and out.dtype == dtype and out.is_contiguous()
    _assert_same_outputs((out, kc, vc), (ref, kr, vr), dtype)
    positions, k_cache, v_cache, token_slots = case[3], case[6], case[7], case[8]
    untouched = torch.ones(k_cache.shape[:2], dtype=torch.bool, device=DEVICE)
    untouched[token_slots, positions] = False
    assert torch.equal(kc[untouched], k_cache[untouched]) and torch.equal(vc[untouched], v_cache[untouched])
    assert not torch.equal(kc[~untouched], k_cache[~untouched])  # the written entries did change


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


# -- sampling: helpers -------------------------------------------------------------------------------


def _columns(rows: list[tuple], device: str = DEVICE):
    """(temperature, top_k, top_p, seed, position) per row -> the five [B] parameter tensors."""
    temperature, top_k, top_p, seeds, positions = zip(*rows)
    return (torch.tensor(temperature, dtype=torch.float32, device=device),
            torch.tensor(top_k, dtype=torch.int64, device=device),
            torch.tensor(top_p, dtype=torch.float32, device=device),
            torch.tensor([_as_int64(s) for s in seeds], dtype=torch.int64, device=device),
            torch.tensor(positions, dtype=torch.int64, device=device))


def _analyse(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, noise: torch.Tensor):
    """Float64 view of one sampled row: (allowed, band, clear, tie).

    allowed: the reference's allowed set (stable sort, fp32 scaled logits, float64 masses);
    band: tokens whose top-p decision is within BAND of top_p; clear: the Gumbel-max winner is
    the same for any resolution of the band and any rounding up to GAP of the noisy scores;
    tie: a tie in logits / T straddles the top-k or top-p cut (where the kernel keeps the whole
    tie class and the reference only its lower indices)."""
    z = logits.float() / torch.tensor(temperature, dtype=torch.float32)  # the reference's rounding
    values, order = z.double().sort(descending=True, stable=True)
    vocab = z.numel()
    keep = torch.ones(vocab, dtype=torch.bool)
    band = torch.zeros(vocab, dtype=torch.bool)
    tie = False
    if 0 < top_k < vocab:
        keep[top_k:] = False
        tie |= bool(values[top_k - 1] == values[top_k])
    if top_p < 1.0:
        kept = int(keep.sum())
        probs = torch.softmax(values[:kept], dim=0)
        mass_before = torch.cumsum(probs, dim=0) - probs
        keep_p = mass_before < top_p
        keep_p[0] = True
        band[1:kept] = (mass_before[1:] - top_p).abs() <= BAND
        cut = int(keep_p.sum())
        tie |= cut < kept and bool(values[cut - 1] == values[cut])
        keep[:kept] &= keep_p
    allowed = torch.zeros(vocab, dtype=torch.bool).scatter(0, order, keep)
    band = torch.zeros(vocab, dtype=torch.bool).scatter(0, order, band)
    scores = z.double() - torch.log(-torch.log(noise.double()))
    sure = scores[allowed & ~band].sort(descending=True).values
    best_band = float(scores[band].max()) if bool(band.any()) else float("-inf")
    clear = bool(sure.numel() > 0) and float(sure[0]) - best_band > GAP and (
        sure.numel() == 1 or float(sure[0] - sure[1]) > GAP)
    return allowed, band, clear, tie


def _check_against_reference(logits: torch.Tensor, rows: list[tuple], min_clear: float = 1.0) -> None:
    """Kernel vs reference on a batch (`sample_triton`, and the debug launch that also returns the
    noise and allowed masks): greedy tokens exact; sampled rows: the noise bitwise, the
    allowed set exactly outside the top-p band, and the token exactly on clear rows (at least
    `min_clear` of the sampled rows must be clear); logprobs within the fp32 tolerance.
    Always the Triton launcher, whatever --impl names: only it has the debug launch."""
    params = _columns(rows, device=str(logits.device))
    tokens, logprobs, noise, allowed = _launch_sample(logits, *params, debug=True)
    plain_tokens, plain_logprobs = sample_triton(logits, *params)  # the same results without the debug writes
    assert torch.equal(plain_tokens, tokens) and torch.equal(plain_logprobs, logprobs)
    ref_tokens, ref_logprobs = sample_ref(logits, *params)
    temperature, top_k, top_p, seeds, positions = params
    sampled = temperature > 0
    scaled = logits.float() / torch.where(sampled, temperature, 1.0)[:, None]
    ref_allowed = allowed_mask(scaled, top_k, top_p)
    ref_noise = uniform_noise(seeds, positions, logits.shape[1])
    assert torch.equal(tokens[~sampled], ref_tokens[~sampled])
    clear_rows = 0
    for i in torch.nonzero(sampled).flatten().tolist():
        assert torch.equal(noise[i], ref_noise[i]), i
        expected, band, clear, tie = _analyse(logits[i].cpu(), float(temperature[i]), int(top_k[i]),
                                              float(top_p[i]), ref_noise[i].cpu())
        assert not tie, i
        outside = ~band.to(logits.device)
        assert torch.equal(expected.to(logits.device)[outside], ref_allowed[i][outside]), i  # the analysis is right
        assert torch.equal(allowed[i][outside], ref_allowed[i][outside]), i
        if clear:
            clear_rows += 1
            assert int(tokens[i]) == int(ref_tokens[i]), i
    assert clear_rows >= min_clear * int(sampled.sum())
    assert_close(logprobs, ref_logprobs)


def _logits(rows: int, vocab: int, seed: int, scale: float = 3.0, device: str = DEVICE) -> torch.Tensor:
    """Gaussian logits: tie-free with probability ~1."""
    return (scale * torch.randn(rows, vocab, generator=_gen(seed))).to(device)


# -- sampling: CPU (interpreter) ---------------------------------------------------------------------


@pytest.mark.parametrize("vocab", [7, 1000])
def test_kernel_noise_is_uniform_noise_bitwise(vocab):
    """The uniforms the kernel draws equal `uniform_noise` bit for bit, for extreme seeds (low and
    high 32 bits, negative int64 views) and positions up to 2^31 + 5."""
    seeds = [0, 1, 2**32 - 1, 2**32, 2**63, 2**64 - 1, 12345678901234567]
    rows = [(1.0, 0, 1.0, s, p) for s, p in zip(seeds, [0, 1, 7, 2**31 - 1, 2**31, 2**31 + 5, 4096])]
    params = _columns(rows)
    _, _, noise, _ = _launch_sample(_logits(len(rows), vocab, seed=1), *params, debug=True)
    assert torch.equal(noise, uniform_noise(params[3], params[4], vocab))


@pytest.mark.parametrize("vocab", [7, 256, 1000, 32003])
def test_greedy_rows_match_reference(vocab):
    """temperature 0: the argmax with the first index on ties (logits rounded to multiples of 0.5,
    so ties are common, plus a row whose maximum repeats at the end), whatever top-k/top-p/seed."""
    logits = (_logits(3, vocab, seed=vocab) * 2).round() / 2
    logits[2] = logits[2].clamp(max=4.0)
    logits[2, -1] = 4.0
    rows = [(0.0, 0, 1.0, 1, 0), (0.0, 5, 0.5, 2, 9), (0.0, 1, 0.1, 2**64 - 1, 3)]
    tokens, logprobs = sample_impl(logits, *_columns(rows))
    ref_tokens, ref_logprobs = sample_ref(logits, *_columns(rows))
    assert torch.equal(tokens, ref_tokens) and tokens.dtype == torch.int64
    assert tokens.tolist() == [int(torch.nonzero(row == row.max())[0]) for row in logits]
    assert_close(logprobs, ref_logprobs)


SAMPLED_ROWS = [  # (temperature, top_k, top_p, seed, position)
    (1.0, 0, 1.0, 11, 0),
    (0.7, 5, 1.0, 12, 17),
    (1.3, 0, 0.8, 13, 2),
    (0.5, 3, 0.5, 2**64 - 1, 1000),
    (2.5, 50, 0.9, 0, 63),
    (1.0, 1, 1.0, 14, 4),
    (0.9, 10**6, 0.95, 15, 2**31),
    (0.0, 2, 0.3, 16, 8),
]


@pytest.mark.parametrize("vocab", [7, 256, 1000])
def test_sampled_rows_match_reference(vocab):
    """Mixed plain / top-k / top-p / top-k + top-p / top_k 1 / top_k >= V / greedy rows on
    Gaussian logits: noise, allowed sets, tokens and logprobs agree with the reference."""
    _check_against_reference(_logits(len(SAMPLED_ROWS), vocab, seed=vocab + 1), SAMPLED_ROWS)


def test_sampled_rows_match_reference_large_vocab():
    """V = 32003 (not a multiple of the block): plain, and top-k 40 then top-p 0.9."""
    rows = [(1.0, 0, 1.0, 21, 5), (0.8, 40, 0.9, 22, 6)]
    _check_against_reference(_logits(len(rows), 32003, seed=2), rows)


@st.composite
def _sampling_rows(draw):
    vocab = draw(st.integers(2, 300))
    logits = draw(st.lists(st.floats(-12, 12, width=32), min_size=vocab, max_size=vocab))
    temperature = draw(st.floats(0.0625, 3.0, width=32))  # greedy rows have their own test
    top_k = draw(st.integers(0, vocab + 2))
    top_p = draw(st.floats(0.0625, 1.0, width=32)) if draw(st.booleans()) else 1.0
    seed = draw(st.integers(0, 2**64 - 1))
    position = draw(st.integers(0, 2**31))
    return torch.tensor([logits], dtype=torch.float32), (temperature, top_k, top_p, seed, position)


@settings(deadline=None, max_examples=budget(0.375))
@given(_sampling_rows())
def test_sampling_matches_reference_property(case):
    """Random logits (repeats allowed) and parameters: where no tie straddles a cut and the
    winner is clear, the kernel's allowed set, token and logprob are the reference's."""
    logits, row = case
    temperature, top_k, top_p, seed, position = row
    noise = uniform_noise(torch.tensor([_as_int64(seed)]), torch.tensor([position]), logits.shape[1])[0]
    _, _, clear, tie = _analyse(logits[0], temperature, top_k, top_p, noise)
    assume(clear and not tie)
    _check_against_reference(logits.to(DEVICE), [row])


MIXED_ROWS = [  # (temperature, top_k, top_p, seed, position)
    (0.0, 0, 1.0, 1, 0),
    (1.0, 0, 1.0, 2, 5),
    (0.7, 5, 1.0, 3, 17),
    (1.3, 0, 0.8, 4, 2),
    (0.5, 3, 0.5, 2**64 - 1, 1000),
    (2.5, 0, 1.0, 0, 63),
    (0.0, 7, 0.3, 9, 9),
    (1.0, 1, 1.0, 10, 4),
]


def _assert_rows_invariant(logits: torch.Tensor, rows: list[tuple]) -> None:
    """Each row alone, and the batch reversed, give bitwise the batch's tokens and logprobs."""
    device = str(logits.device)
    tokens, logprobs = sample_impl(logits, *_columns(rows, device))
    order = list(reversed(range(len(rows))))
    rev_tokens, rev_logprobs = sample_impl(logits[order], *_columns([rows[i] for i in order], device))
    assert torch.equal(rev_tokens.flip(0), tokens) and torch.equal(rev_logprobs.flip(0), logprobs)
    for i, row in enumerate(rows):
        alone_tokens, alone_logprobs = sample_impl(logits[i:i + 1], *_columns([row], device))
        assert torch.equal(alone_tokens[0], tokens[i]) and torch.equal(alone_logprobs[0], logprobs[i]), i


def test_row_alone_equals_row_in_mixed_batch():
    """Each row sampled alone gives bitwise the same token and logprob as inside a batch of mixed
    greedy / plain / top-k / top-p rows, in either batch order."""
    _assert_rows_invariant(_logits(len(MIXED_ROWS), 300, seed=4, scale=2.0), MIXED_ROWS)


# -- GPU, bf16 / real sizes ---------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 64, 4096])
def test_gpu_rope_write_kv_matches_reference(tokens):
    """bf16, Hq=32, Hkv=8, D=128, up to 4096 tokens over 16 slots of 4096 positions: q and the
    caches match the reference (bitwise in fp32), and other cache entries are untouched."""
    for dtype in (torch.bfloat16, torch.float32):
        case = _rope_case(tokens, 32, 8, 128, dtype, seed=tokens, device="cuda", slots=16, max_len=4096)
        (out, kc, vc), (ref, kr, vr) = _run_both(case)
        if dtype == torch.float32:
            assert torch.equal(out, ref) and torch.equal(kc, kr) and torch.equal(vc, vr)
        else:
            assert_close(out, ref)
            assert_close(kc, kr)
            assert_close(vc, vr)
            untouched = torch.ones(case[6].shape[:2], dtype=torch.bool, device="cuda")
            untouched[case[8], case[3]] = False
            assert torch.equal(kc[untouched], case[6][untouched]) and torch.equal(vc[untouched], case[7][untouched])


@pytest.mark.gpu
def test_gpu_rope_write_kv_partial_rotary_matches_reference():
    """Qwen3.5 attention shapes (Hq=16, Hkv=2, D=256, R=64), 4096 tokens: q and the caches match
    the reference, bitwise in fp32 and within tolerance in bf16."""
    for dtype in (torch.bfloat16, torch.float32):
        case = list(_rope_case(4096, 16, 2, 256, dtype, seed=3, device="cuda", slots=16, max_len=4096))
        case[4], case[5] = rope_table(64, 4096, 10_000_000.0, device="cuda")
        (out, kc, vc), (ref, kr, vr) = _run_both(case)
        if dtype == torch.float32:
            assert torch.equal(out, ref) and torch.equal(kc, kr) and torch.equal(vc, vr)
        else:
            assert_close(out, ref)
            assert_close(kc, kr)
            assert_close(vc, vr)


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


def _gpu_rows(count: int) -> list[tuple]:
    """A fixed mix of greedy / plain / top-k / top-p / top-k + top-p rows."""
    kinds = [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.8, 50, 1.0), (1.2, 0, 0.9), (0.6, 1000, 0.95), (1.0, 1, 1.0),
             (0.7, 0, 0.5), (1.5, 20, 0.8)]
    return [(*kinds[i % len(kinds)], 1000 + i, 7 * i + 3) for i in range(count)]


@pytest.mark.gpu
def test_gpu_sampling_matches_reference():
    """V = 151936, B = 64, Gaussian logits: noise, allowed sets outside the top-p band, tokens
    on clear rows (at least 90% of the sampled rows) and logprobs agree with the reference."""
    _check_against_reference(_logits(64, 151936, seed=6, device="cuda"), _gpu_rows(64), min_clear=0.9)


@pytest.mark.gpu
def test_gpu_sampling_rows_are_batch_invariant():
    """V = 151936, B = 64, logits rounded through bf16 (ties included): each row alone and the
    reversed batch give bitwise the batch's tokens and logprobs."""
    logits = _logits(64, 151936, seed=8, device="cuda").bfloat16().float()
    _assert_rows_invariant(logits, _gpu_rows(64))
