"""logprobs (pocketllm/kernels/logprobs.py): the reference against a float64 log-softmax and a
plain-Python ranking, the kernel under test (by default the Triton one) against the reference, and
the two properties scoring rests on, checked bitwise: a row's results do not depend on the rows
beside it or on how many alternatives the batch asks for, and a row's logprob has the bits the
same backend's sampler reports for the same token."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import gen as _gen
from kernel_impls import DEVICE, implementation

from pocketllm.kernels.logprobs import logprobs_ref
from pocketllm.kernels.sample import sample_ref, sample_triton

logprobs_impl = implementation("logprobs")
IMPLS = {"ref": logprobs_ref, "under_test": logprobs_impl}
SAMPLERS = {"ref": sample_ref, "under_test": sample_triton}


def _logits(rows: int, vocab: int, seed: int, ties: bool = True) -> torch.Tensor:
    """Random fp32 logits; with `ties`, every 5th entry of a row equals its largest."""
    logits = torch.randn(rows, vocab, generator=_gen(seed)) * 3.0
    if ties:
        logits[:, ::5] = logits.max(dim=-1, keepdim=True).values
    return logits


def _ranked(row: torch.Tensor, k: int) -> list[int]:
    """The k best ids of one row of logprobs: by value descending, then id ascending, in Python."""
    values = row.tolist()
    return sorted(range(len(values)), key=lambda i: (-values[i], i))[:k]


@pytest.mark.parametrize("rows,vocab,k", [(1, 7, 3), (3, 300, 5), (5, 1030, 20), (2, 9, 9), (4, 300, 0)])
def test_reference_against_float64_and_a_python_ranking(rows, vocab, k):
    """logprobs within 1e-5 of a float64 log-softmax at the given tokens; the alternatives are the k
    best by (logprob, then lower id), their values the row's logprobs at those ids, bit for bit."""
    logits = _logits(rows, vocab, seed=rows * vocab + k)
    tokens = torch.randint(0, vocab, (rows,), generator=_gen(k))
    chosen, top_ids, top_logprobs = logprobs_ref(logits, tokens, k)
    exact = torch.log_softmax(logits.double(), dim=-1)
    assert torch.allclose(chosen.double(), exact.gather(-1, tokens[:, None]).squeeze(-1), atol=1e-5, rtol=0)
    full = torch.log_softmax(logits, dim=-1)
    assert top_ids.shape == (rows, k) and top_logprobs.dtype == torch.float32
    for r in range(rows):
        assert top_ids[r].tolist() == _ranked(full[r], k)
        assert torch.equal(top_logprobs[r], full[r, top_ids[r]])


@pytest.mark.parametrize("vocab,k", [(7, 3), (300, 5), (1030, 4), (2048, 0)])
def test_kernel_matches_reference(vocab, k):
    """The kernel under test: logprobs within 1e-5 of the reference, the same alternatives (ids
    equal: ties resolved by id, and the logits have ties at the top of every row)."""
    logits = _logits(4, vocab, seed=vocab + k).to(DEVICE)
    tokens = torch.randint(0, vocab, (4,), generator=_gen(vocab)).to(DEVICE)
    got, expected = logprobs_impl(logits, tokens, k), logprobs_ref(logits, tokens, k)
    assert torch.allclose(got[0], expected[0], atol=1e-5, rtol=0)
    assert torch.equal(got[1], expected[1])
    assert torch.allclose(got[2], expected[2], atol=1e-5, rtol=0)


@pytest.mark.parametrize("impl", IMPLS)
def test_a_row_is_the_same_alone_in_any_batch_and_for_any_larger_k(impl):
    """Row r's results alone equal its results inside a batch of 9 rows at any place, and its top 2
    are the first 2 of its top 6, bit for bit."""
    fn = IMPLS[impl]
    logits = _logits(9, 300, seed=11).to(DEVICE)
    tokens = torch.randint(0, 300, (9,), generator=_gen(12)).to(DEVICE)
    batched = fn(logits, tokens, 6)
    for r in (0, 4, 8):
        alone = fn(logits[r:r + 1].clone(), tokens[r:r + 1].clone(), 2)
        assert torch.equal(alone[0], batched[0][r:r + 1])
        assert torch.equal(alone[1], batched[1][r:r + 1, :2])
        assert torch.equal(alone[2], batched[2][r:r + 1, :2])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("vocab", [7, 1030])
def test_a_tokens_logprob_has_the_bits_the_sampler_reports(impl, vocab):
    """The logprob scored for the token the same backend's sampler picked is the sampler's logprob,
    bit for bit (greedy and seeded rows): what scoring a generated sequence relies on."""
    logits = _logits(6, vocab, seed=vocab, ties=False).to(DEVICE)
    column = lambda values, dtype: torch.tensor(values, dtype=dtype, device=DEVICE)  # noqa: E731
    tokens, logprobs = SAMPLERS[impl](logits, column([0.0, 0.7, 1.0, 0.0, 1.3, 0.5], torch.float32),
                                      column([0, 0, 5, 0, 0, 3], torch.int64),
                                      column([1.0, 0.9, 1.0, 1.0, 0.8, 1.0], torch.float32),
                                      column(list(range(6)), torch.int64), column([3] * 6, torch.int64))
    scored, _, _ = IMPLS[impl](logits, tokens, 0)
    assert torch.equal(scored, logprobs)
