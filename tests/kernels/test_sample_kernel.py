"""sample (pocketllm/kernels/sample.py), the kernel under test (by default the Triton one) against
the torch reference, and its invariance contract, checked bitwise: a row's result does not depend
on the batch around it.

CPU runs use the Triton interpreter (small grids); the `gpu` tests repeat the comparisons at a real
vocabulary size on CUDA.

The kernel's noise is the reference's bit for bit and logits / T is IEEE-rounded like torch's, so
its top-k set is exactly the reference's on tie-free logits. Its top-p mass is summed in another
order (and exp may be approximated on GPU), so a token whose cumulative mass lies within BAND of
top_p may go either way: `_analyse` marks those tokens, the allowed sets are compared exactly
everywhere else, and tokens are compared exactly on rows where the winner cannot depend on that
band or on the rounding of the noisy scores (top-2 scores more than GAP apart).

The reference against independent oracles: test_sample.py; both at exact filter boundaries:
test_sample_boundaries.py.
"""

from __future__ import annotations

import pytest
import torch
from helpers import budget
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from kernel_cases import MIXED_ROWS
from kernel_cases import as_int64 as _as_int64
from kernel_cases import gen as _gen
from kernel_impls import DEVICE, implementation
from kernel_tolerances import assert_close

from pocketllm.kernels.sample import _launch_sample, allowed_mask, sample_ref, sample_triton, uniform_noise

sample_impl = implementation("sample")

BAND = 1e-4  # top-p: cumulative masses this close to top_p are rounding-dependent
GAP = 1e-5  # noisy scores this close are rounding-dependent


# -- helpers -----------------------------------------------------------------------------------


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


# -- CPU (interpreter) -------------------------------------------------------------------------


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


@pytest.mark.parametrize("vocab", [7, 256, 1000])
def test_sampled_rows_match_reference(vocab):
    """Mixed plain / top-k / top-p / top-k + top-p / top_k 1 / top_k >= V / greedy rows on
    Gaussian logits: noise, allowed sets, tokens and logprobs agree with the reference."""
    _check_against_reference(_logits(len(MIXED_ROWS), vocab, seed=vocab + 1), MIXED_ROWS)


@pytest.mark.slow
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


# -- GPU, real sizes ---------------------------------------------------------------------------


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
