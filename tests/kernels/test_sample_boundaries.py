"""The sampler's filters and greedy switch exactly at their boundaries, on the reference and the
Triton kernel (under the interpreter: one row, a vocabulary of at most 16).

Random logits put a top-p boundary within fp32 rounding of the threshold so rarely that the other
sampling tests filter such cases away; then `<` against `<=` at the boundary goes unnoticed. Here
every row is built so that the boundary is exact in fp32: scaled logits are fp32(-e ln 2), whose
exp is exactly 2^-e (checked below), the weights sum to 2, so every probability and every
cumulative mass is an exact dyadic number, and top_p is set to such a mass. The expected allowed
sets are computed with Fractions from the documented rules:
- reference: top-k keeps the k first in descending order (ties: lower index first); top-p keeps a
  token iff the mass strictly before it in that order is < top_p (the first always stays);
- kernel: the same, but whole tie classes (a tied value at the boundary is kept entirely), as its
  docstring states.
The drawn token must lie in the expected set and equal the Gumbel-max draw of the oracle
(tests/sampling_oracle.py) over it wherever the winner is clear.
"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch
from helpers import budget
from hypothesis import example, given, settings
from hypothesis import strategies as st
from kernel_impls import DEVICE
from sampling_oracle import uniforms

from pocketllm.kernels.sample import _launch_sample, allowed_mask, sample_ref
from pocketllm.sampling import MIN_TEMPERATURE, SamplingParams

MAX_EXPONENT = 8
LOG_HALF = [float(torch.tensor(-e * math.log(2.0), dtype=torch.float32)) for e in range(MAX_EXPONENT + 1)]


def _exact_exp_or_skip() -> None:
    """The construction needs exp(fp32(-e ln 2)) == 2^-e in torch and in numpy (the interpreter)."""
    import numpy as np

    x = torch.tensor(LOG_HALF)
    exact = torch.tensor([2.0 ** -e for e in range(MAX_EXPONENT + 1)])
    if not (torch.equal(torch.exp(x), exact) and torch.equal(torch.softmax(x, 0), exact / exact.sum())
            and np.array_equal(np.exp(x.numpy()), exact.numpy())):
        pytest.skip("exp is not exact at fp32(-e ln 2) on this platform")


def _row(exponents: list[int], temperature: float) -> torch.Tensor:
    """Logits whose scaled values logits / T are exactly LOG_HALF[e] (T a power of two)."""
    return torch.tensor([[LOG_HALF[e] * temperature for e in exponents]], dtype=torch.float32)


def _expected_allowed(exponents: list[int], top_k: int, top_p: Fraction, tie_classes: bool) -> set[int]:
    weight = [Fraction(1, 2 ** e) for e in exponents]
    order = sorted(range(len(weight)), key=lambda v: (-weight[v], v))
    if 0 < top_k < len(weight):
        if tie_classes:
            kth = weight[order[top_k - 1]]
            order = [v for v in order if weight[v] >= kth]
        else:
            order = order[:top_k]
    if top_p >= 1:
        return set(order)
    total = sum(weight[v] for v in order)
    kept = set()
    for rank, v in enumerate(order):
        if tie_classes:
            before = sum(weight[w] for w in order if weight[w] > weight[v]) / total
        else:
            before = sum(weight[w] for w in order[:rank]) / total
        if rank == 0 or before < top_p or (tie_classes and weight[v] == weight[order[0]]):
            kept.add(v)
    return kept


def _clear_draw(exponents: list[int], allowed: set[int], seed: int, position: int) -> int | None:
    """The Gumbel-max winner over `allowed`, or None when the runner-up is within 1e-5."""
    u = uniforms(seed, position, len(exponents))
    scores = sorted(((LOG_HALF[exponents[v]] - math.log(-math.log(u[v])), v) for v in allowed), reverse=True)
    if len(scores) > 1 and scores[0][0] - scores[1][0] < 1e-5:
        return None
    return scores[0][1]


def _params(temperature: float, top_k: int, top_p: float, seed: int, position: int):
    return (torch.tensor([temperature], dtype=torch.float32), torch.tensor([top_k]),
            torch.tensor([top_p], dtype=torch.float32), torch.tensor([seed]), torch.tensor([position]))


def _on_device(t: torch.Tensor) -> torch.Tensor:
    """The Triton kernel's inputs live on the kernel tests' device (CUDA when present)."""
    return t.to(DEVICE)


def _run(sampler: str, exponents, temperature, top_k, top_p, seed, position) -> tuple[set[int], int]:
    """(allowed set, token) of one sampler on one row."""
    logits = _row(exponents, temperature)
    params = _params(temperature, top_k, top_p, seed, position)
    if sampler == "triton":
        tokens, _, _, allowed = (out.cpu() for out in _launch_sample(_on_device(logits), *map(_on_device, params),
                                                                      debug=True))
    else:
        tokens, _ = sample_ref(logits, *params)
        allowed = allowed_mask(logits / params[0][:, None], params[1], params[2])
    return set(torch.nonzero(allowed[0]).flatten().tolist()), int(tokens[0])


@st.composite
def boundary_cases(draw):
    """A row whose weights 2^-e sum to 2 (one token of weight 1, then halvings), and a top-k or top-p
    set exactly at a cumulative boundary of the descending order (or, sometimes, between two)."""
    weights = [0, 0]
    for _ in range(draw(st.integers(0, 14))):
        i = draw(st.integers(1, len(weights) - 1))
        if weights[i] < MAX_EXPONENT:
            weights[i] += 1
            weights.append(weights[i])
    exponents = draw(st.permutations(weights))
    temperature = draw(st.sampled_from([0.25, 0.5, 1.0, 2.0]))
    order = sorted(Fraction(1, 2 ** e) for e in exponents)[::-1]
    if draw(st.booleans()):
        top_k, top_p = draw(st.integers(1, len(exponents))), 1.0
    else:
        cut = draw(st.integers(1, len(order) - 1))
        mass = sum(order[:cut]) / 2
        if draw(st.booleans()):  # strictly between this boundary and the next
            mass += order[cut] / 4
        top_k, top_p = 0, float(mass)
    return exponents, temperature, top_k, top_p, draw(st.integers(0, 2**63 - 1)), draw(st.integers(0, 2**31 - 1))


# (exponents, temperature, top_k, top_p, seed, position): the boundaries, written out.
BOUNDARY_EXAMPLES = [
    ([0, 1, 2, 2], 1.0, 0, 0.5, 1, 3),       # top-p mass equal to the threshold after the first token
    ([2, 0, 1, 2], 0.5, 0, 0.75, 2, 4),      # ... after the second: the third (mass before 0.75) is cut
    ([1, 2, 2, 0], 2.0, 0, 0.875, 3, 5),     # ... inside a tie: the reference cuts the higher index
    ([0, 0], 1.0, 0, 0.5, 4, 6),             # ... inside a tie at the top
    ([1, 0, 1, 2, 1, 3, 3], 1.0, 2, 1.0, 5, 7),  # top-k boundary inside a tie of three
    ([0, 0, 1, 1], 0.25, 1, 1.0, 6, 8),      # top-k 1 with the maximum tied
    ([0, 1, 2, 3, 3], 1.0, 4, 1.0, 7, 9),    # top-k at V - 1, the cut inside the last tie
    ([0, 1, 2, 3, 3], 1.0, 5, 1.0, 8, 10),   # top-k = V: nothing cut
]


def _boundary_property(sampler: str):
    @settings(max_examples=budget(1.0 if sampler == "ref" else 0.25))
    @given(boundary_cases())
    def check(case):
        exponents, temperature, top_k, top_p, seed, position = case
        expected = _expected_allowed(exponents, top_k, Fraction(top_p), tie_classes=sampler == "triton")
        allowed, token = _run(sampler, exponents, temperature, top_k, top_p, seed, position)
        assert allowed == expected
        assert token in expected
        winner = _clear_draw(exponents, expected, seed, position)
        assert winner is None or token == winner

    for case in BOUNDARY_EXAMPLES:
        check = example(case)(check)
    return check


test_reference_filters_at_exact_boundaries = _boundary_property("ref")
test_reference_filters_at_exact_boundaries.__doc__ = "sample_ref / allowed_mask at exact top-k and top-p boundaries."
test_triton_filters_at_exact_boundaries = _boundary_property("triton")
test_triton_filters_at_exact_boundaries.__doc__ = "sample_triton at exact top-k and top-p boundaries (tie classes)."


@pytest.fixture(autouse=True)
def _needs_exact_exp():
    _exact_exp_or_skip()


# -- the greedy threshold ----------------------------------------------------------------------------


def test_sampling_params_greedy_threshold():
    """temperature below MIN_TEMPERATURE is greedy; MIN_TEMPERATURE itself already samples."""
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=math.nextafter(MIN_TEMPERATURE, 0.0)).greedy
    assert not SamplingParams(temperature=MIN_TEMPERATURE).greedy
    assert not SamplingParams(temperature=math.nextafter(MIN_TEMPERATURE, 1.0)).greedy


TIED_TOP = [0.25, 1.0, -0.5, 1.0, 1.0, 0.0]  # the maximum at indices 1, 3 and 4


@pytest.mark.parametrize("sampler", ["ref", "triton"])
def test_temperature_at_the_greedy_threshold(sampler):
    """Temperature 0 is greedy: the first maximum, whatever the seed. The smallest temperature
    that samples (MIN_TEMPERATURE) draws among the tied maxima by the noise, as the oracle says,
    and over a few seeds picks more than the first of them."""
    drawn = set()
    for seed in range(6):
        logits = torch.tensor([TIED_TOP])
        for temperature in (0.0, MIN_TEMPERATURE):
            params = _params(temperature, 0, 1.0, seed, 11)
            if sampler == "triton":
                token = int(_launch_sample(_on_device(logits), *map(_on_device, params), debug=False)[0][0])
            else:
                token = int(sample_ref(logits, *params)[0][0])
            if temperature == 0.0:
                assert token == 1
            else:
                u = uniforms(seed, 11, len(TIED_TOP))
                assert token == max((1, 3, 4), key=lambda v: -math.log(-math.log(u[v])))
                drawn.add(token)
    assert len(drawn) > 1
