"""Scoring output (`SamplingParams(prompt_logprobs=..., logprobs=k)`): prompt logprobs and top-k
alternatives against transformers, their shape and ordering, and the invariance contract extended
to them: bitwise the same serial and batched, with other requests in flight (reusing prefixes,
preempted by swap) and on both backends. A scoring request reuses no cached prefix: it is
checked directly."""

from __future__ import annotations

import pytest
import torch

from pocketllm import LLM, EngineArgs, SamplingParams
from pocketllm.sampling import MAX_LOGPROBS

transformers = pytest.importorskip("transformers")

CHUNK = 64  # prompts are cut at multiples of this: several pieces, each scoring its rows


def _engine(path, batched: bool, backend: str = "torch", **options) -> LLM:
    return LLM(EngineArgs(model=str(path), max_seq_len=256, backend=backend, backend_options={
        "enable_batching": batched, "background_thread": False, "prefill_chunk_size": CHUNK,
        "state_snapshot_interval": CHUNK, **options}))


def _prompt(length: int, seed: int, vocab: int = 200) -> list[int]:
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _outputs(result) -> tuple:
    """Everything a scoring result reports, for == comparisons."""
    return (result.token_ids, result.logprobs, result.top_logprobs, result.prompt_logprobs,
            result.prompt_top_logprobs, result.finish_reason)


@pytest.mark.parametrize("variant", ["tiny", "qwen3.5"])
def test_prompt_logprobs_match_transformers(checkpoint_dir, variant):
    """Every prompt position's logprob and its top 4 within 1e-4 of transformers' log-softmax of
    the full-sequence logits (fp32, eager); the first position has none; each reported
    alternative's value is transformers' logprob of that id."""
    path = checkpoint_dir(variant)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    prompt = _prompt(CHUNK + 21, seed=1)
    result = _engine(path, batched=False).generate(
        prompt, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=4))
    with torch.inference_mode():
        expected = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
    assert result.prompt_logprobs[0] is None and result.prompt_top_logprobs[0] is None
    assert len(result.prompt_logprobs) == len(result.prompt_top_logprobs) == len(prompt)
    got = torch.tensor(result.prompt_logprobs[1:])
    assert torch.allclose(got, expected[:-1].gather(-1, torch.tensor(prompt[1:])[:, None]).squeeze(-1), atol=1e-4)
    for position, top in enumerate(result.prompt_top_logprobs[1:]):
        row = expected[position]
        assert torch.allclose(torch.tensor([lp for _, lp in top]), row.topk(4).values, atol=1e-4)
        assert torch.allclose(torch.tensor([lp for _, lp in top]), row[[i for i, _ in top]], atol=1e-4)


def test_alternatives_are_ranked_and_hold_the_greedy_token(tiny_checkpoint):
    """Greedy: each generated token is its position's best alternative, with its logprob bit for
    bit; alternatives descend, ties by lower id; prompt_logprobs=True scores without alternatives."""
    result = _engine(tiny_checkpoint, batched=True).generate(
        _prompt(20, seed=2), SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=5,
                                            prompt_logprobs=True))
    assert len(result.top_logprobs) == 6 and result.prompt_top_logprobs is None
    assert len(result.prompt_logprobs) == 20 and result.prompt_logprobs[0] is None
    for token, logprob, top in zip(result.token_ids, result.logprobs, result.top_logprobs):
        assert len(top) == 5 and top[0] == (token, logprob)
        assert all((a[1], -a[0]) > (b[1], -b[0]) for a, b in zip(top, top[1:]))


def test_nothing_is_reported_unless_asked(tiny_checkpoint):
    result = _engine(tiny_checkpoint, batched=True).generate(_prompt(10, seed=3), SamplingParams(max_tokens=2))
    assert (result.top_logprobs, result.prompt_logprobs, result.prompt_top_logprobs) == (None, None, None)


def _workload(vocab: int = 200) -> list[tuple[list[int], SamplingParams]]:
    """Scoring and plain requests mixed: a shared system prompt (which the plain request that waits
    for a slot reuses, and the scoring one does not), greedy and seeded, prompts of one to three
    pieces, alternatives of different sizes."""
    system = _prompt(CHUNK, seed=10, vocab=vocab)
    return [
        (system + _prompt(9, seed=11, vocab=vocab), SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)),
        (system + _prompt(20, seed=12, vocab=vocab), SamplingParams(max_tokens=4, seed=7, temperature=0.8,
                                                                    logprobs=3, prompt_logprobs=2)),
        (_prompt(5, seed=13, vocab=vocab), SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1)),
        (system + _prompt(3, seed=14, vocab=vocab), SamplingParams(max_tokens=3, seed=8, top_k=5)),
        (system + _prompt(6, seed=16, vocab=vocab), SamplingParams(max_tokens=3, seed=9, prompt_logprobs=True)),
        (_prompt(2 * CHUNK + 2, seed=15, vocab=vocab), SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=5,
                                                           logprobs=MAX_LOGPROBS)),
    ]


@pytest.mark.parametrize("variant", ["tiny", "qwen3.5"])
def test_scores_are_the_same_serial_and_batched_with_reuse_and_swap(checkpoint_dir, variant):
    """Each request of a mixed workload reports, bit for bit, what it reports alone and serial:
    batched at once in 3 slots (some reusing a shared prefix, others waiting), then again with the
    scoring requests swapped out mid-prompt and mid-generation."""
    path = checkpoint_dir(variant)
    workload = _workload()
    serial = _engine(path, batched=False)
    alone = [_outputs(serial.generate(prompt, params)) for prompt, params in workload]
    batched = _engine(path, batched=True, max_batch_size=3)
    assert [_outputs(r) for r in batched.generate([p for p, _ in workload], [s for _, s in workload])] == alone
    assert batched.scheduler.get_stats().prefix_hits > 0  # a plain request reused the system prompt
    s = batched.scheduler
    ids = [s.submit_request(prompt, params) for prompt, params in workload]
    for step in range(40):
        if step in (1, 4):
            for i in (1, 5):
                s.preempt(ids[i])
        if not s.step():
            break
    assert s.get_stats().preemptions >= 2
    assert [_outputs(s.poll_result(i, None)) for i in ids] == alone


def test_a_scoring_request_reuses_no_prefix(tiny_checkpoint):
    """A prompt whose first 64 tokens a free slot holds: a plain request reuses them, a scoring
    request runs its whole prompt (its first positions' scores come from its own forward)."""
    llm = _engine(tiny_checkpoint, batched=True, max_batch_size=2)
    shared = _prompt(CHUNK + 4, seed=20)
    llm.generate(shared, SamplingParams(max_tokens=1))
    llm.generate(shared + [1, 2], SamplingParams(max_tokens=1, prompt_logprobs=True))
    assert llm.scheduler.get_stats().prefix_hits == 0
    llm.generate(shared + [3, 4], SamplingParams(max_tokens=1))
    assert llm.scheduler.get_stats().prefix_hits == 1


def test_triton_scores_equal_serial_and_batched_and_torch(tiny_checkpoint):
    """The triton backend (interpreted here): the same bits serial and batched, and within 1e-4 of
    the torch backend's scores with the same alternatives."""
    workload = [(_prompt(7, seed=30), SamplingParams(max_tokens=2, temperature=0.0, logprobs=2, prompt_logprobs=2)),
                (_prompt(4, seed=31), SamplingParams(max_tokens=3, seed=5, prompt_logprobs=True))]
    serial = _engine(tiny_checkpoint, batched=False, backend="triton")
    alone = [serial.generate(prompt, params) for prompt, params in workload]
    batched = _engine(tiny_checkpoint, batched=True, backend="triton")
    together = batched.generate([p for p, _ in workload], [s for _, s in workload])
    assert [_outputs(r) for r in together] == [_outputs(r) for r in alone]
    reference = _engine(tiny_checkpoint, batched=False).generate(*workload[0])
    assert torch.allclose(torch.tensor(alone[0].prompt_logprobs[1:]), torch.tensor(reference.prompt_logprobs[1:]),
                          atol=1e-4)
    assert [[i for i, _ in top] for top in alone[0].prompt_top_logprobs[1:]] == \
        [[i for i, _ in top] for top in reference.prompt_top_logprobs[1:]]


@pytest.mark.parametrize("field,value,message", [
    ("logprobs", MAX_LOGPROBS + 1, r"logprobs must be None or an int in \[0, 20\], got 21"),
    ("logprobs", -1, r"logprobs must be None or an int in \[0, 20\]"),
    ("logprobs", 2.0, r"logprobs must be None or an int in \[0, 20\], got 2.0"),
    ("prompt_logprobs", 21, r"prompt_logprobs must be True, False, None or an int in \[0, 20\], got 21"),
    ("prompt_logprobs", "yes", r"prompt_logprobs must be True, False, None or an int in \[0, 20\], got 'yes'"),
])
def test_bad_logprob_counts_are_refused_naming_the_field(field, value, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value})


def test_prompt_logprobs_true_and_false_mean_zero_and_none():
    assert SamplingParams(prompt_logprobs=True).prompt_logprobs == 0
    assert SamplingParams(prompt_logprobs=False).prompt_logprobs is None
