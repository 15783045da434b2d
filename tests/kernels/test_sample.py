"""sample (pocketllm/kernels/sample.py), its torch reference: counter-based noise, greedy /
temperature / top-k / top-p selection, logprobs and row invariance, checked against references
written here (the hash with Python's wrap-around arithmetic, the allowed set in float64 plain
Python, softmax frequencies), and the noise against the documented formula bit for bit
(tests/sampling_oracle.py computes the documented hash in Python integers: a change of the offset
or scale of the uniform, of the mixer or of the key schedule changes some entries even where the
statistics of the noise would not notice).

The filters at their exact boundaries (reference and kernel): test_sample_boundaries.py; the kernel
against this reference: test_sample_kernel.py.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from helpers import budget
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from kernel_cases import MIXED_ROWS
from kernel_cases import as_int64 as _as_int64
from kernel_impls import DEVICE, implementation
from sampling_oracle import MASK32, MAX_UNIFORM, POSITION_SALT, draw, mix, uniforms

from pocketllm.kernels.sample import allowed_mask, mix32, sample_ref, uniform_noise

sample_impl = implementation("sample")


def _column(values, dtype):
    return torch.tensor(values, dtype=dtype)


def sample(logits, temperature, top_k, top_p, seeds, positions):
    """sample_ref with per-row python lists."""
    return sample_ref(logits, _column(temperature, torch.float32), _column(top_k, torch.int64),
                      _column(top_p, torch.float32), _column([_as_int64(s) for s in seeds], torch.int64),
                      _column(positions, torch.int64))


def _logits(rows: int, vocab: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    return scale * torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed))


# -- the hash and the noise --------------------------------------------------------------------


def _lowbias32(x: int) -> int:
    """Chris Wellons' lowbias32 mixer with plain Python wrap-around arithmetic."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & MASK32
    x ^= x >> 15
    x = (x * 0x846CA68B) & MASK32
    x ^= x >> 16
    return x


def test_mix32_equals_wraparound_lowbias32():
    """mix32's overflow-free int64 arithmetic computes the 32-bit wrap-around mixer exactly."""
    rng = random.Random(0)
    values = [0, 1, 2, 0xFFFF, 0x10000, 2**31 - 1, 2**31, MASK32 - 1, MASK32]
    values += [rng.getrandbits(32) for _ in range(2000)]
    out = mix32(torch.tensor(values, dtype=torch.int64)).tolist()
    assert out == [_lowbias32(v) for v in values]


def test_mix32_is_a_bijection_on_a_range():
    """Distinct 32-bit inputs give distinct outputs, all within [0, 2^32)."""
    x = torch.cat([torch.arange(0, 1 << 17), torch.arange(MASK32 - (1 << 17) + 1, MASK32 + 1)])
    out = mix32(x)
    assert int(out.min()) >= 0 and int(out.max()) <= MASK32
    assert torch.unique(out).numel() == x.numel()


def test_uniform_noise_is_open_interval_and_roughly_uniform():
    """1e5 uniforms lie strictly in (0, 1), have mean 0.5 +- 0.01, even deciles and no
    correlation between neighbouring vocabulary entries."""
    seeds = torch.tensor([_as_int64(s) for s in (0, 1, 7, 2**32, 2**63, 2**64 - 1, 12345, 99, 3, 2**40 + 5)])
    positions = torch.tensor([0, 0, 5, 1, 2**31, 77, 3, 4096, 1, 0])
    u = uniform_noise(seeds, positions, 10_000)
    assert u.shape == (10, 10_000) and u.dtype == torch.float32
    assert float(u.min()) > 0.0 and float(u.max()) < 1.0
    assert abs(float(u.double().mean()) - 0.5) < 0.01
    counts = torch.histc(u.double(), bins=10, min=0.0, max=1.0)
    assert bool(((counts - 10_000).abs() < 500).all()), counts.tolist()
    a, b = u[:, :-1].flatten().double(), u[:, 1:].flatten().double()
    corr = float(((a - a.mean()) * (b - b.mean())).mean() / (a.std() * b.std()))
    assert abs(corr) < 0.02


def test_uniform_noise_is_a_pure_function_of_seed_position_and_index():
    """Same (seed, position) -> bitwise the same noise; changing the seed (low or high 32 bits) or
    the position changes essentially every entry; a row's noise does not depend on its batch."""
    def noise(seed: int, position: int, vocab: int = 4096) -> torch.Tensor:
        return uniform_noise(torch.tensor([_as_int64(seed)]), torch.tensor([position]), vocab)[0]

    base = noise(42, 10)
    assert torch.equal(base, noise(42, 10))
    for other in (noise(43, 10), noise(42 + 2**32, 10), noise(42 + 2**63, 10), noise(42, 11)):
        assert float((other == base).float().mean()) < 0.01
    assert torch.equal(noise(42, 10, 100), base[:100])  # entry v depends on v, not on the vocab size
    batch = uniform_noise(torch.tensor([5, 42, _as_int64(2**64 - 1)]), torch.tensor([0, 10, 3]), 4096)
    assert torch.equal(batch[1], base)


# -- the noise is the documented formula, bit for bit ------------------------------------------


# Seeds with either 32-bit half zero or all ones, positions at 0 and at the int32 edge.
CASES = [(0, 0), (1, 7), (2**32, 3), (2**63 + 5, 2**31 - 1), (2**64 - 1, 123456), (0xDEADBEEF12345678, 2**31)]


def test_uniform_noise_is_the_documented_formula():
    vocab = 4099
    seeds = torch.tensor([_as_int64(s) for s, _ in CASES])
    positions = torch.tensor([p for _, p in CASES])
    noise = uniform_noise(seeds, positions, vocab)
    for row, (seed, position) in zip(noise, CASES):
        assert row.tolist() == [float(torch.tensor(u, dtype=torch.float32)) for u in uniforms(seed, position, vocab)]


def _unmix(y: int) -> int:
    """The inverse of the documented mixer (xorshifts and odd multipliers are invertible mod 2^32)."""
    y ^= y >> 16
    y = (y * pow(0x846CA68B, -1, 2**32)) & MASK32
    y ^= (y >> 15) ^ (y >> 30)
    y = (y * pow(0x7FEB352D, -1, 2**32)) & MASK32
    return y ^ (y >> 16)


def _seed_whose_entry_0_draws(bits: int) -> int:
    """A seed (high half 0) whose noise at position 0, entry 0 has hash `bits`: mix(0) = 0, so the
    entry's hash is mix(key) and key = mix(seed_lo ^ mix(mix(0 ^ SALT)))."""
    return _unmix(_unmix(bits)) ^ mix(mix(POSITION_SALT))


def test_noise_at_the_largest_draw_stays_below_one():
    """The hash whose top 24 bits are all ones gives the largest uniform, 1 - 2^-24 after fp32
    rounding (never 1.0, whose Gumbel noise is infinite): a token filtered out is then still never
    drawn, and an allowed one wins only by its finite score, on the reference and the kernel."""
    seed = _seed_whose_entry_0_draws(MASK32)
    assert uniforms(seed, 0, 1)[0] == MAX_UNIFORM
    noise = uniform_noise(torch.tensor([seed]), torch.tensor([0]), 2)
    assert float(noise[0, 0]) == MAX_UNIFORM < 1.0
    logits = torch.tensor([[0.0, 5.0]], device=DEVICE)
    for sampler in (sample_ref, sample_impl):
        for top_k in (1, 0):
            params = (torch.tensor([1.0], device=DEVICE), torch.tensor([top_k], device=DEVICE),
                      torch.tensor([1.0], device=DEVICE), torch.tensor([seed], device=DEVICE),
                      torch.tensor([0], device=DEVICE))
            token = int(sampler(logits, *params)[0][0])
            expected = 1 if top_k == 1 else draw([0.0, 5.0], 1.0, 0, 1.0, seed, 0).token
            assert token == expected, (sampler.__name__, top_k)
    assert draw([0.0, 5.0], 1.0, 0, 1.0, seed, 0).token == 0  # the extreme draw does win when allowed


def test_reference_runs_on_the_inputs_device():
    """No tensor is made on a fixed device: on the meta device (standing in for a GPU) the noise and
    the allowed mask come out there, shaped [B, V]."""
    seeds, positions = torch.tensor([1, 2], device="meta"), torch.tensor([3, 4], device="meta")
    noise = uniform_noise(seeds, positions, 50)
    assert noise.device.type == "meta" and noise.shape == (2, 50) and noise.dtype == torch.float32
    mask = allowed_mask(torch.empty(2, 50, device="meta"), torch.tensor([0, 5], device="meta"),
                        torch.tensor([1.0, 0.5], device="meta"))
    assert mask.device.type == "meta" and mask.shape == (2, 50) and mask.dtype == torch.bool


# -- greedy, logprobs, determinism -------------------------------------------------------------


def test_greedy_rows_are_argmax_with_first_index_on_ties():
    """temperature 0 returns the argmax (the first on ties), whatever the seed or filters."""
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [-1.0, -1.0, -2.0, -5.0], [0.0, 0.0, 0.0, 7.5]])
    tokens, _ = sample(logits, [0.0] * 3, [0, 1, 2], [1.0, 0.1, 0.5], [1, 2, 3], [0, 9, 99])
    assert tokens.tolist() == [1, 0, 3]
    big = _logits(16, 300, seed=1)
    tokens, _ = sample(big, [0.0] * 16, [0] * 16, [1.0] * 16, list(range(16)), list(range(16)))
    assert tokens.tolist() == [max(range(300), key=lambda v: (float(row[v]), -v)) for row in big]


@pytest.mark.parametrize("temperature,top_k,top_p", [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.3, 5, 1.0), (2.0, 0, 0.7)])
def test_logprob_is_log_softmax_of_raw_logits(temperature, top_k, top_p):
    """The reported logprob is log_softmax of the unscaled, unfiltered logits at the chosen token."""
    logits = _logits(8, 150, seed=2)
    tokens, logprobs = sample(logits, [temperature] * 8, [top_k] * 8, [top_p] * 8, list(range(8)), [3] * 8)
    assert logprobs.dtype == torch.float32
    for row, token, logprob in zip(logits.double(), tokens.tolist(), logprobs.tolist()):
        expected = float(row[token] - torch.logsumexp(row, dim=0))
        assert logprob == pytest.approx(expected, abs=1e-5)


def test_same_seed_and_position_is_bitwise_deterministic():
    """Sampling the same logits with the same (seed, position) twice gives the same tokens and
    bitwise the same logprobs; another position or seed gives another token sequence."""
    logits = _logits(64, 200, seed=3, scale=1.0)
    args = ([1.0] * 64, [0] * 64, [1.0] * 64)
    t1, l1 = sample(logits, *args, [2**64 - 1] * 64, list(range(64)))
    t2, l2 = sample(logits, *args, [2**64 - 1] * 64, list(range(64)))
    assert torch.equal(t1, t2) and torch.equal(l1, l2)
    t3, _ = sample(logits, *args, [5] * 64, list(range(64)))
    t4, _ = sample(logits, *args, [2**64 - 1] * 64, list(range(1, 65)))
    assert (t1 != t3).sum() > 32 and (t1 != t4).sum() > 32


def test_row_invariance_alone_vs_mixed_batch():
    """Each row sampled alone gives bitwise the same token and logprob as inside a batch of mixed
    greedy / sampled / top-k / top-p rows, in any batch order."""
    logits = _logits(len(MIXED_ROWS), 300, seed=4, scale=2.0)

    def run(indices):
        rows = [MIXED_ROWS[i] for i in indices]
        return sample(logits[indices], *[list(c) for c in zip(*rows)])

    batch_tokens, batch_logprobs = run(list(range(len(MIXED_ROWS))))
    reversed_tokens, reversed_logprobs = run(list(reversed(range(len(MIXED_ROWS)))))
    for i in range(len(MIXED_ROWS)):
        tokens, logprobs = run([i])
        assert torch.equal(tokens[0], batch_tokens[i]) and torch.equal(logprobs[0], batch_logprobs[i]), i
        j = len(MIXED_ROWS) - 1 - i
        assert torch.equal(reversed_tokens[j], batch_tokens[i]) and torch.equal(reversed_logprobs[j], batch_logprobs[i])


# -- filters -----------------------------------------------------------------------------------


def test_allowed_mask_hand_computed_cases():
    """top-p keeps the smallest prefix reaching top_p; top-k renormalises before top-p."""
    logits = torch.tensor([0.05, 0.5, 0.15, 0.3]).log()[None, :].repeat(7, 1)  # order: 1, 3, 2, 0
    top_k = torch.tensor([0, 0, 0, 0, 2, 2, 1])
    top_p = torch.tensor([0.45, 0.6, 0.85, 0.99, 0.7, 0.6, 1.0])
    mask = allowed_mask(logits, top_k, top_p)
    expected = [{1}, {1, 3}, {1, 3, 2}, {0, 1, 2, 3}, {1, 3}, {1}, {1}]
    assert [set(torch.nonzero(row).flatten().tolist()) for row in mask] == expected


def test_top_k_one_is_greedy_for_sampled_rows():
    """With top_k = 1 every sampled row returns the argmax, whatever its noise."""
    logits = _logits(200, 50, seed=5)
    tokens, _ = sample(logits, [1.5] * 200, [1] * 200, [1.0] * 200, [7] * 200, list(range(200)))
    assert torch.equal(tokens, logits.argmax(dim=-1))


def _reference_allowed(logits: list[float], temperature: float, top_k: int, top_p: float, margin: float):
    """Allowed token set in float64 plain Python, or None when a boundary is too close to call."""
    z = [x / temperature for x in logits]
    order = sorted(range(len(z)), key=lambda i: (-z[i], i))

    def ambiguous_cut(kept: list[int], dropped: list[int]) -> bool:
        """Some kept and some dropped token differ by less than the margin without being equal:
        fp32 rounding could merge them into a tie that the stable sort breaks by index instead."""
        if not dropped:
            return False
        low, high = min(z[a] for a in kept), max(z[b] for b in dropped)
        tol = margin * max(1.0, abs(low), abs(high))
        near_kept = [z[a] for a in kept if z[a] <= high + tol]
        near_dropped = [z[b] for b in dropped if z[b] >= low - tol]
        return any(0 < za - zb <= tol for za in near_kept for zb in near_dropped)

    if 0 < top_k < len(z):
        if ambiguous_cut(order[:top_k], order[top_k:]):
            return None
        order = order[:top_k]
    top = z[order[0]]
    weights = [math.exp(z[i] - top) for i in order]
    total = sum(weights)
    probs = [w / total for w in weights]
    if top_p >= 1.0:
        return set(order)
    kept, mass_before = 1, probs[0]
    for r in range(1, len(order)):
        if abs(mass_before - top_p) < 1e-4:
            return None
        if mass_before < top_p:
            kept += 1
        mass_before += probs[r]
    if ambiguous_cut(order[:kept], order[kept:]):
        return None
    return set(order[:kept])


@st.composite
def sampling_cases(draw):
    vocab = draw(st.integers(5, 200))
    kind = draw(st.sampled_from(["hypothesis", "gaussian", "quantized"]))
    if kind == "hypothesis":  # Hypothesis' own floats: ties, zeros, subnormals, extremes
        logits = draw(st.lists(st.floats(-12, 12, width=32), min_size=vocab, max_size=vocab))
    else:  # realistic spread-out logits; "quantized" rounds them to create many exact ties
        scale = draw(st.floats(0.1, 8.0))
        gen = torch.Generator().manual_seed(draw(st.integers(0, 2**32)))
        values = scale * torch.randn(vocab, generator=gen)
        logits = (values.round() if kind == "quantized" else values).tolist()
    temperature = draw(st.floats(0.05, 3.0, exclude_min=True))
    top_k = draw(st.integers(0, vocab))
    top_p = draw(st.one_of(st.just(1.0), st.floats(0.05, 1.0, exclude_min=True)))
    seed = draw(st.integers(0, 2**64 - 1))
    position = draw(st.integers(0, 2**31))
    return logits, temperature, top_k, top_p, seed, position


@settings(deadline=None, max_examples=budget(1.25))
@given(sampling_cases())
def test_sampled_token_is_in_independently_computed_allowed_set(case):
    """For random logits / temperature / top-k / top-p / seed / position: allowed_mask equals the
    float64 plain-Python allowed set, and the sampled token lies in it (with the right logprob)."""
    logits, temperature, top_k, top_p, seed, position = case
    t32 = float(torch.tensor(temperature, dtype=torch.float32))  # the values the kernel really sees
    p32 = float(torch.tensor(top_p, dtype=torch.float32))
    reference = _reference_allowed(logits, t32, top_k, p32, margin=1e-5)
    assume(reference is not None)
    row = torch.tensor([logits], dtype=torch.float32)
    mask = allowed_mask(row / torch.tensor([t32])[:, None], torch.tensor([top_k]), torch.tensor([p32]))
    assert set(torch.nonzero(mask[0]).flatten().tolist()) == reference
    tokens, logprobs = sample(row, [t32], [top_k], [p32], [seed], [position])
    token = int(tokens[0])
    assert token in reference
    raw = torch.tensor(logits, dtype=torch.float64)
    assert float(logprobs[0]) == pytest.approx(float(raw[token] - torch.logsumexp(raw, 0)), abs=1e-4)


# -- the sampled distribution ------------------------------------------------------------------


@pytest.mark.parametrize("temperature,top_k,expected_support", [(1.0, 0, 4), (0.6, 3, 3)])
def test_empirical_frequencies_match_softmax(temperature, top_k, expected_support):
    """Over 20000 positions, token frequencies match softmax(logits / T) (renormalised over the top
    k) within a loose chi-square bound (3 or 2 degrees of freedom, bound 30 ~ p < 1e-5)."""
    logits = [0.0, 1.0, -0.5, 0.3]
    n = 20_000
    tokens, _ = sample(torch.tensor([logits]).repeat(n, 1), [temperature] * n, [top_k] * n, [1.0] * n,
                       [2024] * n, list(range(n)))
    counts = torch.bincount(tokens, minlength=4).tolist()
    z = [x / temperature for x in logits]
    support = sorted(range(4), key=lambda i: -z[i])[: top_k or 4]
    weights = {i: math.exp(z[i]) for i in support}
    total = sum(weights.values())
    assert {i for i in range(4) if counts[i]} == set(support) and len(support) == expected_support
    chi2 = sum((counts[i] - n * weights[i] / total) ** 2 / (n * weights[i] / total) for i in support)
    assert chi2 < 30, (counts, chi2)
