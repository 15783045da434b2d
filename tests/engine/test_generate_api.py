"""The public API: LLM.generate's shapes and result fields, stop / EOS / length endings, seeds and
determinism, and the validation of SamplingParams, requests and EngineArgs."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch

from pocketllm import LLM, EngineArgs, GenerationResult, SamplingParams

PROMPT = [17, 4, 99, 250, 3, 64, 128, 7]
MAX_SEQ_LEN = 64


@pytest.fixture(scope="module")
def llm(tiny_checkpoint) -> LLM:
    return LLM(EngineArgs(model=str(tiny_checkpoint), max_seq_len=MAX_SEQ_LEN))


@pytest.fixture(scope="module")
def vocab(llm) -> int:
    return llm.model_config.vocab_size


def _first_new_token(tokens: list[int], at_least: int) -> int:
    """Index of the first token at index >= at_least that does not occur earlier in `tokens`."""
    for i in range(at_least, len(tokens)):
        if tokens[i] not in tokens[:i]:
            return i
    raise AssertionError(f"no fresh token after index {at_least} in {tokens}")


# -- shapes and fields ----------------------------------------------------------------------------------


def test_single_prompt_returns_one_result_with_consistent_fields(llm, vocab):
    """A list of ints gives one GenerationResult: prompt echoed, one logprob per token, each a
    valid log-probability, tokens in the vocabulary, positive timings."""
    result = llm.generate(PROMPT, SamplingParams(max_tokens=5, seed=3, ignore_eos=True))
    assert isinstance(result, GenerationResult)
    assert result.prompt_tokens == PROMPT and result.error is None
    assert len(result.token_ids) == len(result.logprobs) == 5
    assert all(isinstance(t, int) and 0 <= t < vocab for t in result.token_ids)
    assert all(isinstance(lp, float) and -math.inf < lp <= 0.0 for lp in result.logprobs)
    assert result.finish_reason == "length" and result.seed == 3
    assert 0 < result.ttft_s <= result.total_time_s


def test_list_of_prompts_returns_list_in_order(llm):
    """A list of prompts gives a list of results in the same order, each what the prompt gives
    alone, with distinct request ids; a one-prompt list still gives a list."""
    prompts = [PROMPT, [5], [200, 201, 202]]
    params = SamplingParams(max_tokens=4, seed=11, ignore_eos=True)
    results = llm.generate(prompts, params)
    assert isinstance(results, list) and len(results) == 3
    for prompt, result in zip(prompts, results):
        alone = llm.generate(prompt, params)
        assert result.prompt_tokens == prompt
        assert (result.token_ids, result.logprobs) == (alone.token_ids, alone.logprobs)
    again = llm.generate([PROMPT], params)
    assert isinstance(again, list) and len(again) == 1
    ids = [r.request_id for r in results] + [again[0].request_id]
    assert len(set(ids)) == len(ids)


def test_sampling_params_list_applies_per_prompt(llm):
    """sampling_params given as a list applies the i-th params to the i-th prompt; a length
    mismatch is a ValueError."""
    results = llm.generate([PROMPT, PROMPT], [SamplingParams(max_tokens=2, ignore_eos=True),
                                              SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)])
    assert [len(r.token_ids) for r in results] == [2, 6]
    greedy = llm.generate(PROMPT, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert results[1].token_ids == greedy.token_ids
    with pytest.raises(ValueError, match="got 1 sampling_params for 2 prompts"):
        llm.generate([PROMPT, PROMPT], [SamplingParams()])


def test_default_sampling_params(llm):
    """Without sampling_params: 16 tokens at most, a drawn seed, temperature-1 sampling."""
    result = llm.generate(PROMPT)
    assert 1 <= len(result.token_ids) <= 16 and isinstance(result.seed, int)
    if result.finish_reason == "length":
        assert len(result.token_ids) == 16


# -- endings ------------------------------------------------------------------------------------------------


def test_max_tokens_ends_with_length(llm):
    """max_tokens tokens exactly, finish_reason 'length' (max_tokens 1 included)."""
    for n in (1, 7):
        result = llm.generate(PROMPT, SamplingParams(max_tokens=n, seed=1, ignore_eos=True))
        assert len(result.token_ids) == n and result.finish_reason == "length"


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_stop_token_ends_generation_and_is_included(llm, temperature):
    """A stop token the run really produces ends it right there with 'stop', the stop token last;
    the tokens before it are unchanged. Stop wins over length on the last allowed token."""
    params = dict(temperature=temperature, seed=21, ignore_eos=True)
    full = llm.generate(PROMPT, SamplingParams(max_tokens=12, **params)).token_ids
    k = _first_new_token(full, at_least=0 if temperature == 0 else 3)
    stopped = llm.generate(PROMPT, SamplingParams(max_tokens=12, stop_token_ids=[full[k]], **params))
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == full[:k + 1] and len(stopped.logprobs) == k + 1
    exact = llm.generate(PROMPT, SamplingParams(max_tokens=k + 1, stop_token_ids=(full[k],), **params))
    assert exact.finish_reason == "stop" and exact.token_ids == full[:k + 1]


@pytest.fixture(scope="module")
def eos_case(tiny_checkpoint, tmp_path_factory):
    """A copy of the tiny checkpoint whose generation_config.json EOS is a token a seeded run
    produces at index k >= 2 (first occurrence): (engine, params, full run tokens, k)."""
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=5, ignore_eos=True)
    base = LLM(EngineArgs(model=str(tiny_checkpoint), max_seq_len=MAX_SEQ_LEN))
    full = base.generate(PROMPT, params).token_ids
    k = _first_new_token(full, at_least=2)
    path = Path(shutil.copytree(tiny_checkpoint, tmp_path_factory.mktemp("eos") / "ckpt"))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": full[k]}))
    return LLM(EngineArgs(model=str(path), max_seq_len=MAX_SEQ_LEN)), params, full, k


def test_checkpoint_eos_ends_generation(eos_case):
    """The EOS id from the checkpoint's generation_config ends a run with 'stop', EOS included."""
    engine, params, full, k = eos_case
    assert full[k] in engine.model_config.eos_token_ids
    result = engine.generate(PROMPT, SamplingParams(max_tokens=12, temperature=1.0, seed=5))
    assert result.finish_reason == "stop" and result.token_ids == full[:k + 1]


def test_ignore_eos_generates_past_eos(eos_case):
    """With ignore_eos the same run goes on through the EOS token to max_tokens."""
    engine, params, full, k = eos_case
    result = engine.generate(PROMPT, params)
    assert result.finish_reason == "length" and result.token_ids == full
    assert full[k] in result.token_ids[:-1]


# -- seeds and determinism ----------------------------------------------------------------------------------------


def test_same_seed_reproduces_tokens_and_logprobs(llm):
    """Same prompt and seed: identical tokens and bitwise identical logprobs, top-k/top-p included."""
    for params in (SamplingParams(max_tokens=10, seed=77, ignore_eos=True),
                   SamplingParams(max_tokens=10, seed=77, temperature=0.7, top_k=20, top_p=0.9, ignore_eos=True)):
        a, b = llm.generate(PROMPT, params), llm.generate(PROMPT, params)
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs


def test_different_seeds_give_different_tokens(llm):
    """At temperature 1 another seed (also one differing only above bit 63) gives other tokens."""
    runs = [llm.generate(PROMPT, SamplingParams(max_tokens=12, seed=s, ignore_eos=True)).token_ids
            for s in (1, 2, 1 + 2**63)]
    assert runs[0] != runs[1] and runs[0] != runs[2] and runs[1] != runs[2]


def test_seed_is_reported_and_replayable(llm):
    """A given seed is echoed (up to 2**64 - 1); without one a 64-bit seed is drawn, reported,
    differs between requests, and replaying it reproduces the run."""
    assert llm.generate(PROMPT, SamplingParams(max_tokens=2, seed=2**64 - 1)).seed == 2**64 - 1
    assert llm.generate(PROMPT, SamplingParams(max_tokens=2, seed=0)).seed == 0
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    first, second = llm.generate(PROMPT, params), llm.generate(PROMPT, params)
    for result in (first, second):
        assert isinstance(result.seed, int) and 0 <= result.seed < 2**64
    assert first.seed != second.seed
    replay = llm.generate(PROMPT, SamplingParams(max_tokens=10, ignore_eos=True, seed=first.seed))
    assert replay.token_ids == first.token_ids and replay.logprobs == first.logprobs


def test_greedy_ignores_seed(llm):
    """temperature 0 gives the same tokens whatever the seed."""
    runs = {tuple(llm.generate(PROMPT, SamplingParams(max_tokens=6, temperature=0, seed=s, ignore_eos=True)).token_ids)
            for s in (0, 1, 2**64 - 1)}
    assert len(runs) == 1


def test_capabilities_without_batching(tiny_checkpoint):
    """enable_batching False: no batch support; the other fields echo the engine args."""
    engine = LLM(EngineArgs(model=str(tiny_checkpoint), max_seq_len=48,
                            backend_options={"enable_batching": False, "max_batch_size": 3}))
    caps = engine.capabilities
    assert caps.supports_batch is False
    assert (caps.backend, caps.max_batch_size, caps.max_seq_len) == ("torch", 3, 48)


# -- validation ------------------------------------------------------------------------------------------------------

BAD_SAMPLING_PARAMS = [
    ("max_tokens", 0, ValueError, r"max_tokens must be an int >= 1"),
    ("max_tokens", -5, ValueError, r"max_tokens must be an int >= 1"),
    ("max_tokens", True, ValueError, r"max_tokens must be an int >= 1"),
    ("max_tokens", 4.0, ValueError, r"max_tokens must be an int >= 1"),
    ("max_tokens", "4", ValueError, r"max_tokens must be an int >= 1"),
    ("temperature", -0.01, ValueError, r"temperature must be a finite number >= 0"),
    ("temperature", float("nan"), ValueError, r"temperature must be a finite number >= 0"),
    ("temperature", float("inf"), ValueError, r"temperature must be a finite number >= 0"),
    ("temperature", True, ValueError, r"temperature must be a finite number >= 0"),
    ("temperature", "1.0", ValueError, r"temperature must be a finite number >= 0"),
    ("top_p", 0.0, ValueError, r"top_p must be a number in \(0, 1\]"),
    ("top_p", 1.0001, ValueError, r"top_p must be a number in \(0, 1\]"),
    ("top_p", -0.5, ValueError, r"top_p must be a number in \(0, 1\]"),
    ("top_p", float("nan"), ValueError, r"top_p must be a number in \(0, 1\]"),
    ("top_p", True, ValueError, r"top_p must be a number in \(0, 1\]"),
    ("top_p", "0.9", ValueError, r"top_p must be a number in \(0, 1\]"),
    ("top_k", -1, ValueError, r"top_k must be an int >= 0"),
    ("top_k", 3.0, ValueError, r"top_k must be an int >= 0"),
    ("top_k", True, ValueError, r"top_k must be an int >= 0"),
    ("seed", -1, ValueError, r"seed must be None or an int in \[0, 2\*\*64 - 1\]"),
    ("seed", 2**64, ValueError, r"seed must be None or an int in \[0, 2\*\*64 - 1\]"),
    ("seed", True, ValueError, r"seed must be None or an int in \[0, 2\*\*64 - 1\]"),
    ("seed", 1.0, ValueError, r"seed must be None or an int in \[0, 2\*\*64 - 1\]"),
    ("seed", "7", ValueError, r"seed must be None or an int in \[0, 2\*\*64 - 1\]"),
    ("stop_token_ids", "ab", TypeError, r"stop_token_ids must be a sequence of ints"),
    ("stop_token_ids", 5, TypeError, r"stop_token_ids must be a sequence of ints"),
    ("stop_token_ids", [-1], ValueError, r"stop_token_ids must be ints >= 0"),
    ("stop_token_ids", [True], ValueError, r"stop_token_ids must be ints >= 0"),
    ("stop_token_ids", [2.0], ValueError, r"stop_token_ids must be ints >= 0"),
    ("ignore_eos", 1, TypeError, r"ignore_eos must be a bool"),
]


@pytest.mark.parametrize("field,value,error,message", BAD_SAMPLING_PARAMS,
                         ids=[f"{f}={v!r}" for f, v, _, _ in BAD_SAMPLING_PARAMS])
def test_sampling_params_validation(field, value, error, message):
    """Each out-of-range or wrongly typed SamplingParams field raises, naming field and range."""
    with pytest.raises(error, match=message):
        SamplingParams(**{field: value})


def test_sampling_params_boundaries_are_accepted():
    """The edges of every range are valid: greedy, top_p 1, top_k 0, seeds 0 and 2**64 - 1."""
    for kwargs in (dict(max_tokens=1), dict(temperature=0), dict(temperature=0.0), dict(top_p=1), dict(top_p=1e-9),
                   dict(top_k=0), dict(seed=0), dict(seed=2**64 - 1), dict(stop_token_ids=[0, 5])):
        SamplingParams(**kwargs)
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)


def _bad_requests(vocab: int):
    """(prompt, params, error, message) for requests valid as SamplingParams but not for this engine."""
    ok = SamplingParams(max_tokens=4)
    return [
        ([], ok, ValueError, r"prompt_tokens must not be empty"),
        ([PROMPT, []], ok, ValueError, r"prompt_tokens must not be empty"),
        ([1, vocab], ok, ValueError, rf"prompt_tokens\[1\]={vocab} is outside the vocabulary \[0, {vocab}\)"),
        ([-1, 2], ok, ValueError, rf"prompt_tokens\[0\]=-1 is outside the vocabulary \[0, {vocab}\)"),
        ([True, 2], ok, TypeError, r"prompt_tokens\[0\] must be an int, got bool"),
        ([1, 2.0], ok, TypeError, r"prompt_tokens"),
        ([[1, 2.0]], ok, TypeError, r"prompt_tokens\[1\] must be an int, got float"),
        ("hello", ok, TypeError, r"prompt_tokens must be a list of ints"),
        ([PROMPT, "hi"], ok, TypeError, r"prompt_tokens must be a list of ints, got str"),
        ([1] * 61, ok, ValueError, rf"prompt length 61 \+ max_tokens 4 exceeds max_seq_len {MAX_SEQ_LEN}"),
        ([1, 2], SamplingParams(max_tokens=MAX_SEQ_LEN), ValueError,
         rf"prompt length 2 \+ max_tokens {MAX_SEQ_LEN} exceeds max_seq_len {MAX_SEQ_LEN}"),
        ([1, 2], SamplingParams(stop_token_ids=[vocab]), ValueError,
         rf"stop_token_ids entry {vocab} is outside the vocabulary \[0, {vocab}\)"),
        ([1, 2], {"max_tokens": 3}, TypeError, r"sampling_params must be a SamplingParams"),
    ]


def test_bad_requests_raise_and_engine_keeps_working(llm, vocab):
    """Each invalid request raises ValueError/TypeError naming the field and range, runs nothing
    (cache and slots untouched, even when an earlier prompt of the list was valid), and the engine
    then generates exactly what it generated before."""
    params = SamplingParams(max_tokens=8, seed=123, ignore_eos=True)
    before = llm.generate(PROMPT, params)
    k_before = [k.clone() for k in llm.cache.k]

    def held() -> list[list[int]]:
        return [llm.slots.held_tokens(slot) for slot in range(llm.cache.num_slots)]

    slots_before = held()
    free_before = llm.slots.num_free
    for prompt, bad_params, error, message in _bad_requests(vocab):
        with pytest.raises(error, match=message):
            llm.generate(prompt, bad_params)
    assert all(torch.equal(a, b) for a, b in zip(k_before, llm.cache.k))
    assert held() == slots_before and llm.slots.num_free == free_before
    after = llm.generate(PROMPT, params)
    assert (after.token_ids, after.logprobs) == (before.token_ids, before.logprobs)


def test_prompt_forms_and_element_errors(llm):
    """A tuple of ints is one prompt; a bad element is named by its index; a non-SamplingParams
    entry in a params list is named."""
    ok = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    assert llm.generate((3, 4, 5), ok).token_ids == llm.generate([3, 4, 5], ok).token_ids
    with pytest.raises(TypeError, match=r"prompt_tokens\[2\] must be an int, got float"):
        llm.generate([[1, 2, 3.0]], ok)
    with pytest.raises(TypeError, match=r"sampling_params must be a SamplingParams, got NoneType"):
        llm.generate([1, 2], [None])


def test_prompt_plus_max_tokens_equal_to_max_seq_len_is_allowed(llm):
    """The limit is inclusive: prompt length + max_tokens == max_seq_len generates fully."""
    result = llm.generate([9] * 60, SamplingParams(max_tokens=MAX_SEQ_LEN - 60, seed=1, ignore_eos=True))
    assert result.error is None and result.finish_reason == "length" and len(result.token_ids) == 4


# -- EngineArgs --------------------------------------------------------------------------------------------------------

MAX_BATCH_SIZE_RANGE = r"backend_options\['max_batch_size'\] must be an int in \[1, 1024\]"

BAD_ENGINE_ARGS = [
    (dict(backend="tensorflow"), ValueError, r"backend must be one of .*'tensorflow'"),
    (dict(dtype="float64"), ValueError, r"dtype must be one of .*'float64'"),
    (dict(dtype=torch.float32), ValueError, r"dtype must be one of"),
    (dict(max_seq_len=1), ValueError, r"max_seq_len must be an int >= 2, got 1"),
    (dict(max_seq_len=0), ValueError, r"max_seq_len must be an int >= 2"),
    (dict(max_seq_len=True), ValueError, r"max_seq_len must be an int >= 2, got True"),
    (dict(max_seq_len=64.0), ValueError, r"max_seq_len must be an int >= 2"),
    (dict(max_seq_len="64"), ValueError, r"max_seq_len must be an int >= 2"),
    (dict(backend_options={"max_batch": 4}), ValueError, r"unknown backend_options \['max_batch'\]; allowed: "),
    (dict(backend_options={"max_batch_size": 0}), ValueError, MAX_BATCH_SIZE_RANGE),
    (dict(backend_options={"max_batch_size": 1025}), ValueError, MAX_BATCH_SIZE_RANGE),
    (dict(backend_options={"max_batch_size": True}), ValueError, MAX_BATCH_SIZE_RANGE),
    (dict(backend_options={"max_batch_size": 4.0}), ValueError, MAX_BATCH_SIZE_RANGE),
    (dict(backend_options={"enable_batching": "yes"}), TypeError,
     r"backend_options\['enable_batching'\] must be a bool"),
    (dict(backend_options={"batch_invariant": 1}), TypeError, r"backend_options\['batch_invariant'\] must be a bool"),
    (dict(model=42), TypeError, r"model must be a path to a checkpoint directory, got int"),
]


@pytest.mark.parametrize("kwargs,error,message", BAD_ENGINE_ARGS, ids=[repr(k) for k, _, _ in BAD_ENGINE_ARGS])
def test_engine_args_validation(tiny_checkpoint, kwargs, error, message):
    """Every bad EngineArgs field raises, naming the field and what is allowed."""
    with pytest.raises(error, match=message):
        EngineArgs(**{"model": str(tiny_checkpoint), **kwargs})


def test_engine_args_defaults_and_normalisation(tiny_checkpoint):
    """A Path model becomes a str; backend_options are completed with defaults without touching
    the caller's dict; the edges max_seq_len 2 and max_batch_size 1 / 1024 are valid."""
    options = {"max_batch_size": 1}
    args = EngineArgs(model=Path(tiny_checkpoint), backend_options=options)
    assert args.model == str(tiny_checkpoint) and options == {"max_batch_size": 1}
    assert args.max_batch_size == 1 and args.backend_options["enable_batching"] is False
    assert args.torch_dtype == torch.float32
    EngineArgs(model="x", max_seq_len=2, backend_options={"max_batch_size": 1024})


@pytest.mark.parametrize("temperature", [1e-40, 1e-6])
def test_temperature_below_minimum_is_greedy(llm, temperature):
    """A temperature too small to divide by in fp32 samples greedily instead of picking the
    first overflowed logit."""
    prompt = [5, 9, 30]
    greedy = llm.generate(prompt_tokens=prompt, sampling_params=SamplingParams(max_tokens=6, temperature=0.0))
    tiny = llm.generate(prompt_tokens=prompt, sampling_params=SamplingParams(max_tokens=6, temperature=temperature,
                                                                             seed=1))
    assert tiny.token_ids == greedy.token_ids


def test_mixed_int_and_float_prompt_names_the_element(llm):
    """A flat prompt with a float in it is one bad prompt, and the error names the element."""
    with pytest.raises(TypeError, match=r"prompt_tokens\[1\] must be an int"):
        llm.generate(prompt_tokens=[1, 2.0])
