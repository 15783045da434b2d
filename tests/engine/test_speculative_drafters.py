"""Speculation against adversarial drafters (`speculative={"method": "custom", "drafter": ...}`,
pocketllm.testing.drafters): random tokens, the right tokens one position late, and an oracle that
proposes exactly what the request will generate. Whatever is proposed, the output is the output
without speculation (the property, with preemption by swap and recompute, drawn budgets and cuts);
the counters see the oracle's drafts all accepted, the random ones almost never, and a prompt lookup
accepting a repeated span. Also: a drafter that raises or proposes token ids outside the vocabulary
costs its drafts only, and the Triton backend (interpreted here) verifies as the torch one does."""

from __future__ import annotations

import logging

import pytest
from helpers import budget
from hypothesis import given, settings

from pocketllm import LLM, EngineArgs, SamplingParams
from pocketllm.speculative import speculative_config
from pocketllm.testing import Engines, Workload, assert_batch_invariant
from pocketllm.testing.drafters import OracleDrafter, RandomDrafter
from pocketllm.testing.engines import as_policy
from pocketllm.testing.strategies import speculation_workloads

VOCAB = 256
MAX_SEQ_LEN = 160


def _custom(drafter, count: int = 4) -> dict:
    return {"method": "custom", "drafter": drafter, "num_speculative_tokens": count}


ORACLE = OracleDrafter()
DRAFTERS = {"random": RandomDrafter(VOCAB, seed=1), "one-late": OracleDrafter(offset=1), "oracle": ORACLE}


@pytest.fixture(scope="module", params=[("tiny", "random"), ("tiny", "one-late"), ("tiny", "oracle"),
                                        ("qwen3.5", "oracle")], ids="-".join)
def engines(request, checkpoint_dir):
    variant, drafter = request.param
    engines = Engines(checkpoint_dir(variant), max_seq_len=MAX_SEQ_LEN, preemption_mode="recompute",
                      batched_args={"speculative": _custom(DRAFTERS[drafter])})
    engines.drafter = DRAFTERS[drafter]
    yield engines
    engines.close()


def _teach(engines: Engines, workload: Workload) -> None:
    """The oracles learn each job's output without speculation (the serial reference's)."""
    policy = as_policy(workload.schedule, workload.max_batch_size, engines.max_seq_len)
    for drafter in (d for d in DRAFTERS.values() if isinstance(d, OracleDrafter)):
        for job in workload.jobs:
            drafter.learn(job.prompt, engines.serial_result(job, policy).token_ids)


@settings(max_examples=budget(0.5))
@given(workload=speculation_workloads(VOCAB, max_prompt=100, max_jobs=5, max_tokens=16))
def test_any_drafter_leaves_the_output_as_without_speculation(engines, workload):
    _teach(engines, workload)
    assert_batch_invariant(engines, workload)


PROMPTS = [[11, 12, 13], [40, 41, 42, 43, 44], [200, 7]]
PARAMS = SamplingParams(max_tokens=24, temperature=0.9, seed=3, ignore_eos=True)


def _stats(path, drafter, prompts=PROMPTS, params=PARAMS):
    with LLM(EngineArgs(model=str(path), max_seq_len=MAX_SEQ_LEN, speculative=_custom(drafter),
                        backend_options={"enable_batching": True, "background_thread": False})) as llm:
        results = llm.generate(prompts, params)
        return results, llm.scheduler.get_stats()


def test_the_oracle_is_always_accepted_and_random_drafts_almost_never(tiny_checkpoint):
    with LLM(EngineArgs(model=str(tiny_checkpoint), max_seq_len=MAX_SEQ_LEN)) as plain:
        expected = plain.generate(PROMPTS, PARAMS)
    oracle = OracleDrafter()
    for prompt, result in zip(PROMPTS, expected):
        oracle.learn(prompt, result.token_ids)
    results, stats = _stats(tiny_checkpoint, oracle)
    assert [(r.token_ids, r.logprobs) for r in results] == [(r.token_ids, r.logprobs) for r in expected]
    assert stats.spec_accepted_tokens == stats.spec_draft_tokens > 0
    assert stats.steps <= 3 + -(-24 // 5)  # the prefill, then 5 tokens a step
    results, stats = _stats(tiny_checkpoint, RandomDrafter(VOCAB, seed=5))
    assert [(r.token_ids, r.logprobs) for r in results] == [(r.token_ids, r.logprobs) for r in expected]
    assert stats.spec_draft_tokens > 0 and stats.spec_accepted_tokens <= 0.1 * stats.spec_draft_tokens


def test_a_prompt_lookup_accepts_a_repeated_span(tiny_checkpoint):
    """A logit bias and bad words make the model's output cycle through the prompt's span (after its
    first token, which repeats the prompt's last), which the lookup proposes: most drafts accepted,
    and the output is the plain engine's."""
    span = [17, 23, 5]
    params = SamplingParams(max_tokens=15, temperature=0.0, ignore_eos=True, logit_bias=dict.fromkeys(span, 100.0),
                            bad_words_token_ids=[[17, 17], [23, 23], [5, 5], [17, 5], [23, 17], [5, 23]])
    with LLM(EngineArgs(model=str(tiny_checkpoint), max_seq_len=MAX_SEQ_LEN)) as plain:
        expected = plain.generate(span * 3, params)
    with LLM(EngineArgs(model=str(tiny_checkpoint), max_seq_len=MAX_SEQ_LEN, speculative={
            "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 3},
            backend_options={"enable_batching": True, "background_thread": False})) as llm:
        result = llm.generate(span * 3, params)
        stats = llm.scheduler.get_stats()
    assert (result.token_ids, result.logprobs) == (expected.token_ids, expected.logprobs)
    first = span.index(result.token_ids[1])
    assert result.token_ids[1:] == (span * 6)[first:first + 14]  # the span, cycled
    assert stats.spec_accepted_tokens >= 9 and stats.spec_accepted_tokens >= 0.7 * stats.spec_draft_tokens


def _broken(tokens, count):
    raise RuntimeError("no drafts today")


@pytest.mark.parametrize(("drafter", "words"), [(_broken, "raised RuntimeError: no drafts today"),
                                                (lambda tokens, count: [VOCAB] * count, "proposed [256"),
                                                (lambda tokens, count: [True], "proposed [True]")])
def test_a_broken_drafter_costs_its_drafts_only(tiny_checkpoint, caplog, drafter, words):
    with LLM(EngineArgs(model=str(tiny_checkpoint), max_seq_len=MAX_SEQ_LEN)) as plain:
        expected = plain.generate(PROMPTS, PARAMS)
    with caplog.at_level(logging.WARNING, logger="pocketllm.scheduler.batch_scheduler"):
        results, stats = _stats(tiny_checkpoint, drafter)
    assert [(r.token_ids, r.logprobs) for r in results] == [(r.token_ids, r.logprobs) for r in expected]
    assert stats.spec_verifies == 0
    warnings = [r.getMessage() for r in caplog.records if "speculative drafter" in r.getMessage()]
    assert len(warnings) == len(PROMPTS) and all(words in w for w in warnings)  # once per request


def test_a_drafter_by_import_path_and_the_refusals():
    config = speculative_config(_custom("pocketllm.testing.drafters:RandomDrafter"))
    assert config is not None and config.drafter is RandomDrafter
    with pytest.raises(ValueError, match="cannot be imported"):
        speculative_config(_custom("pocketllm.testing.drafters:Nothing"))
    with pytest.raises(ValueError, match="must be a callable"):
        speculative_config(_custom(3))
    with pytest.raises(ValueError, match=r"\['prompt_lookup_min'\] do not apply to method 'custom'"):
        speculative_config({**_custom(RandomDrafter(VOCAB)), "prompt_lookup_min": 2})
    with pytest.raises(ValueError, match="applies to method 'custom' only"):
        speculative_config({"method": "ngram", "num_speculative_tokens": 2, "drafter": RandomDrafter(VOCAB)})


@pytest.mark.slow
def test_the_triton_backend_verifies_as_the_torch_one(checkpoint_dir):
    """Interpreted here: a few tokens on Qwen3 and Qwen3.5, random and one-late drafts."""
    for variant in ("tiny", "qwen3.5"):
        path = str(checkpoint_dir(variant))
        params = SamplingParams(max_tokens=6, temperature=0.8, seed=2, ignore_eos=True)
        prompts = [[3, 4, 3, 4, 3], [9]]
        with LLM(EngineArgs(model=path, backend="triton", max_seq_len=64)) as plain:
            expected = plain.generate(prompts, params)
        oracle = OracleDrafter(offset=1)
        for prompt, result in zip(prompts, expected):
            oracle.learn(prompt, result.token_ids)
        with LLM(EngineArgs(model=path, backend="triton", max_seq_len=64, speculative=_custom(oracle, 3),
                            backend_options={"enable_batching": True, "background_thread": False})) as llm:
            got = llm.generate(prompts, params)
            assert llm.scheduler.get_stats().spec_verifies > 0
        assert [(r.token_ids, r.logprobs) for r in got] == [(r.token_ids, r.logprobs) for r in expected]
