"""The logits controls (presence, frequency and repetition penalties, logit_bias, min_p, min_tokens,
allowed_token_ids, bad words): each against an independent oracle (tests/controls_oracle.py, plain
Python from the specification), in the engine against transformers' logits, by what they guarantee
(no banned token, no early stop), batched == serial bitwise with random controls (TP=2 too), raw
logprobs, and the checks at the boundary."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest
import torch
from controls_oracle import Controls, controlled, controlled_float64
from helpers import budget
from hypothesis import given, settings
from hypothesis import strategies as st
from sampling_oracle import draw

from pocketllm import LLM, EngineArgs, SamplingParams, write_checkpoint
from pocketllm.kernels.sample import sample_ref
from pocketllm.logits_processors import LogitsControlError, TokenHistory, process_row
from pocketllm.testing import Engines, Job, Workload, assert_batch_invariant, assert_scoring_matches_generation

VOCAB = 256  # the tiny preset's
EOS = 255
CONTROLS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "min_p", "min_tokens",
            "allowed_token_ids", "bad_words")


def _params(c: Controls, **extra) -> SamplingParams:
    return SamplingParams(temperature=c.temperature, presence_penalty=c.presence_penalty,
                          frequency_penalty=c.frequency_penalty, repetition_penalty=c.repetition_penalty,
                          logit_bias=dict(c.logit_bias) or None, min_p=c.min_p, min_tokens=c.min_tokens,
                          allowed_token_ids=c.allowed_token_ids, bad_words_token_ids=c.bad_words, **extra)


def _random_controls(rng: random.Random, vocab: int, names: tuple[str, ...], output: list[int]) -> Controls:
    """Controls `names` at random values (others off); bad words often end the way the output does."""
    def word() -> tuple[int, ...]:
        n = rng.randint(1, 3)
        tail = output[len(output) - n + 1:] if n > 1 and rng.random() < 0.6 and len(output) >= n - 1 else \
            [rng.randrange(vocab) for _ in range(n - 1)]
        return (*tail, rng.randrange(vocab))

    penalty = lambda: rng.choice([-2.0, 2.0, 0.5, -0.3, rng.uniform(-2, 2)])  # noqa: E731
    return Controls(
        temperature=rng.choice([0.0, 0.7, 1.0, 1.6]),
        presence_penalty=penalty() if "presence_penalty" in names else 0.0,
        frequency_penalty=penalty() if "frequency_penalty" in names else 0.0,
        repetition_penalty=rng.choice([0.5, 1.3, 2.0, rng.uniform(0.1, 3)]) if "repetition_penalty" in names else 1.0,
        logit_bias={rng.randrange(vocab): rng.choice([-100.0, 100.0, rng.uniform(-5, 5)])
                    for _ in range(rng.randint(1, 4))} if "logit_bias" in names else {},
        min_p=rng.choice([0.05, 0.3, 0.9, 1.0, rng.random()]) if "min_p" in names else 0.0,
        min_tokens=rng.randint(0, 6) if "min_tokens" in names else 0,
        allowed_token_ids=rng.sample(range(vocab), rng.randint(1, min(vocab, 12)))
        if "allowed_token_ids" in names else None,
        bad_words=[word() for _ in range(rng.randint(1, 4))] if "bad_words" in names else ())


def _argmax(values: list[float]) -> int:
    return max(range(len(values)), key=lambda v: (values[v], -v))


@pytest.mark.parametrize("names", [(name,) for name in CONTROLS] + [CONTROLS], ids=[*CONTROLS, "all"])
def test_each_control_gives_the_oracles_logits_and_token(names):
    """The processed row equals the oracle's fp32 logits bit for bit (a token min_p cannot call
    apart), and the sampler on it draws the oracle's token (sampling_oracle.draw; greedy: argmax)."""
    rng = random.Random(" ".join(names))
    generator = torch.Generator().manual_seed(len(names))
    for _ in range(40):
        vocab = rng.choice([7, 50, 300])
        logits = torch.randn(vocab, generator=generator) * 3
        logits[rng.randrange(vocab)] = 0.0
        alphabet = rng.sample(range(vocab), min(vocab, 5))  # few tokens, so they repeat
        prompt = [rng.choice(alphabet) for _ in range(rng.randint(1, 8))]
        output = [rng.choice(alphabet) for _ in range(rng.randint(0, 8))]
        stop_ids = tuple(rng.sample(range(vocab), 2))
        c = _random_controls(rng, vocab, names, output)
        expected, unsure = controlled(logits.tolist(), c, prompt, output, stop_ids)
        params = _params(c, top_k=rng.choice([0, 3]), top_p=rng.choice([1.0, 0.8]), seed=rng.randrange(2**64))
        if all(x == -math.inf for x in expected):
            with pytest.raises(LogitsControlError, match="left no token to sample"):
                process_row(logits, params, TokenHistory(prompt, output, stop_ids))
            continue
        row = process_row(logits, params, TokenHistory(prompt, output, stop_ids))
        decided = [t for t in range(vocab) if t not in unsure]
        assert [row[t].item() for t in decided] == [expected[t] for t in decided]
        if unsure:
            continue
        position = len(prompt) + len(output)
        token = sample_ref(row[None], torch.tensor([0.0 if params.greedy else c.temperature]),
                           torch.tensor([params.top_k]), torch.tensor([params.top_p]),
                           torch.tensor([params.seed - (1 << 64) if params.seed >= 1 << 63 else params.seed]),
                           torch.tensor([position]))[0].item()
        if params.greedy:
            assert token == _argmax(expected)
        else:
            temperature = float(torch.tensor(c.temperature, dtype=torch.float32))
            top_p = float(torch.tensor(params.top_p, dtype=torch.float32))
            want = draw(expected, temperature, params.top_k, top_p, params.seed, position)
            assert want.token is None or token == want.token


def test_a_row_that_overflows_is_refused():
    row = torch.tensor([3e38, -1.0, 0.5])
    with pytest.raises(LogitsControlError, match=r"\+inf or NaN"):
        process_row(row, SamplingParams(repetition_penalty=1e-3), TokenHistory([0], []))


# -- in the engine ---------------------------------------------------------------------------------

ORACLE_REQUESTS = [  # (prompt, controls, seed): on this checkpoint each control changes the tokens
    ([5, 6, 7, 5, 6, 7], Controls(repetition_penalty=1.3), 0),
    ([5, 6, 7, 5, 6, 7], Controls(presence_penalty=0.4, frequency_penalty=0.2), 0),
    ([9] * 12, Controls(temperature=0.9, frequency_penalty=0.4, logit_bias={177: -1.0, 3: 1.0}, min_p=0.2), 5),
    ([9] * 12, Controls(repetition_penalty=1.2), 0),
    ([40, 41, 42], Controls(temperature=1.2, repetition_penalty=0.6, allowed_token_ids=list(range(30, 90)),
                            bad_words=[(31,), (50, 51)]), 2**63 + 5),
    ([1, 2, 3, 4], Controls(min_tokens=4, logit_bias={EOS: 5.0}, presence_penalty=-1.0), 3),
]
NEW_TOKENS = 10


def test_generation_follows_the_oracle_on_transformers_logits(tmp_path):
    """The serial and the batched engine's tokens are the oracle's, the controls applied in float64
    to transformers' logits, wherever the logit error (1e-4, scaled by the repetition penalty) cannot
    change the result; the logprobs are transformers' raw log-softmax."""
    transformers = pytest.importorskip("transformers")
    path = write_checkpoint(tmp_path / "ckpt", "tiny", seed=3, init_std=0.1)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    params = [_params(c, max_tokens=NEW_TOKENS, seed=seed) for _, c, seed in ORACLE_REQUESTS]
    prompts = [prompt for prompt, _, _ in ORACLE_REQUESTS]
    results = []
    for batching in (False, True):
        options = {"enable_batching": batching, "background_thread": False, "max_batch_size": len(prompts)}
        with LLM(EngineArgs(model=str(path), max_seq_len=64, backend_options=options)) as llm:
            results.append(llm.generate(prompts, params))
    assert [r.token_ids for r in results[0]] == [r.token_ids for r in results[1]]
    decided = total = 0
    with torch.inference_mode():
        for (prompt, c, seed), result in zip(ORACLE_REQUESTS, results[0]):
            logits = hf.eval()(torch.tensor([prompt + result.token_ids])).logits[0].double()
            for step, token in enumerate(result.token_ids):
                raw = logits[len(prompt) + step - 1]
                assert result.logprobs[step] == pytest.approx(torch.log_softmax(raw, 0)[token].item(), abs=2e-4)
                x, error, certain = controlled_float64(raw.tolist(), c, prompt, result.token_ids[:step], (EOS,), 1e-4)
                total += 1
                if not certain:
                    continue
                if c.temperature == 0.0:
                    best = _argmax(x)
                    if any(v >= x[best] - 2 * error for t, v in enumerate(x) if t != best):
                        continue
                    decided += 1
                    assert token == best, (prompt, step)
                else:
                    want = draw(x, c.temperature, 0, 1.0, seed, len(prompt) + step, logit_error=error)
                    decided += want.token is not None
                    assert want.token is None or token == want.token, (prompt, step)
    print(f"oracle decided {decided} of {total} steps")
    assert total == sum(len(r.token_ids) for r in results[0]) and decided >= 0.8 * total, (decided, total)


@pytest.fixture(scope="module")
def llm(tiny_batched_llm):
    return tiny_batched_llm


def test_min_tokens_holds_back_eos_and_stop_tokens(llm):
    """EOS pushed up by +100: the request stops at once, or after exactly min_tokens tokens; a stop
    token likewise; with ignore_eos, EOS is no stop token and min_tokens leaves it alone."""
    prompt = [3, 4, 5]
    at_once = llm.generate(prompt, SamplingParams(max_tokens=10, temperature=0, logit_bias={EOS: 100}))
    held = llm.generate(prompt, SamplingParams(max_tokens=10, temperature=0, logit_bias={EOS: 100}, min_tokens=4))
    assert at_once.token_ids == [EOS] and at_once.finish_reason == "stop"
    assert len(held.token_ids) == 5 and held.token_ids[-1] == EOS and EOS not in held.token_ids[:4]
    assert held.finish_reason == "stop"
    stop = llm.generate(prompt, SamplingParams(max_tokens=10, temperature=0.8, seed=1, logit_bias={7: 100},
                                               stop_token_ids=[7], min_tokens=3, ignore_eos=True))
    assert stop.token_ids[3:] == [7] and 7 not in stop.token_ids[:3]
    ignoring = llm.generate(prompt, SamplingParams(max_tokens=5, temperature=0, logit_bias={EOS: 100}, min_tokens=3,
                                                   ignore_eos=True))
    assert ignoring.token_ids == [EOS] * 5 and ignoring.finish_reason == "length"


def test_allowed_and_bad_words_are_never_sampled(llm):
    prompt = [10, 11, 12, 13]
    allowed = (20, 21, 22, 23, EOS)
    results = llm.generate([prompt] * 3, [SamplingParams(max_tokens=12, temperature=1.5, seed=s,
                                                         allowed_token_ids=allowed) for s in range(3)])
    assert all(set(r.token_ids) <= set(allowed) for r in results)
    plain = llm.generate(prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)).token_ids
    first = llm.generate(prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                                                bad_words_token_ids=[[plain[0]]])).token_ids
    assert plain[0] not in first
    pair = llm.generate(prompt, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                                               bad_words_token_ids=[plain[:2]])).token_ids
    assert pair[0] == plain[0] and all(pair[i:i + 2] != plain[:2] for i in range(len(pair) - 1))


def test_logprobs_are_raw_and_score_as_generated(llm):
    """With controls the reported logprobs and alternatives are the raw model's: scoring prompt +
    output gives them bit for bit (pocketllm.testing.assert_scoring_matches_generation)."""
    params = SamplingParams(max_tokens=8, temperature=0.8, seed=4, logprobs=3, presence_penalty=1.0,
                            repetition_penalty=1.5, logit_bias={9: 3.0}, min_p=0.1, bad_words_token_ids=[[9, 9]])
    assert_scoring_matches_generation(llm, [[1, 2, 3], [9, 9, 8, 7, 9]], params)


def test_a_request_whose_controls_mask_everything_fails_alone(llm):
    masked = SamplingParams(max_tokens=4, temperature=0, allowed_token_ids=[EOS], min_tokens=2)
    plain = SamplingParams(max_tokens=4, temperature=0)
    failed, ok = llm.generate([[1, 2], [1, 2]], [masked, plain])
    assert failed.finish_reason == "error" and "left no token to sample" in failed.error
    assert ok.finish_reason == "length" and ok.token_ids == llm.generate([1, 2], plain).token_ids


def test_requests_without_controls_never_reach_the_processor(llm, monkeypatch):
    def refuse(*_):
        raise AssertionError("processed a request without controls")

    monkeypatch.setattr("pocketllm.runner.process_row", refuse)
    # ignore_eos: a random seed that samples EOS within 3 tokens would end the request early.
    neutral = SamplingParams(max_tokens=3, ignore_eos=True, logit_bias={}, bad_words_token_ids=[],
                             presence_penalty=0.0, min_p=0)
    assert not neutral.controls_logits and neutral == SamplingParams(max_tokens=3, ignore_eos=True)
    result = llm.generate([1, 2, 3], neutral)
    assert (result.finish_reason, len(result.token_ids)) == ("length", 3)


# -- batched == serial with random controls --------------------------------------------------------

@st.composite
def controlled_params(draw_: st.DrawFn) -> SamplingParams:
    rng = random.Random(draw_(st.integers(0, 2**32)))
    names = tuple(name for name in CONTROLS if draw_(st.booleans()))
    c = _random_controls(rng, VOCAB, names, [rng.randrange(VOCAB) for _ in range(2)])
    if c.allowed_token_ids is not None:  # room for min_tokens: EOS alone allowed could mask everything
        c = dataclasses.replace(c, allowed_token_ids=[*c.allowed_token_ids[:8], 1, 2])
    return _params(c, max_tokens=draw_(st.integers(6, 10)), seed=draw_(st.integers(0, 2**64 - 1)),
                   logprobs=draw_(st.sampled_from([None, 2])), ignore_eos=draw_(st.booleans()))


def _jobs(prompts: list[tuple[int, ...]], params: list[SamplingParams], arrivals: list[int]) -> tuple[Job, ...]:
    return tuple(Job(p, sp, arrival_step=a) for p, sp, a in zip(prompts, params, arrivals))


@pytest.fixture(scope="module")
def engines(checkpoint_dir):
    with Engines(checkpoint_dir("tiny")) as engines:
        yield engines


@settings(max_examples=budget(0.1), deadline=None)
@given(prompts=st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=20).map(tuple), min_size=2,
                        max_size=4),
       params=st.lists(controlled_params(), min_size=4, max_size=4), arrivals=st.lists(st.integers(0, 3), min_size=4,
                                                                                       max_size=4),
       slots=st.integers(2, 4))
def test_batched_equals_serial_with_random_controls(engines, prompts, params, arrivals, slots):
    """Requests with random controls (and some without) share batches: each one's tokens and
    logprobs equal its cold serial run, bit for bit."""
    assert_batch_invariant(engines, Workload(_jobs(prompts, params, arrivals), max_batch_size=slots))


def test_tp2_with_controls_equals_tp1(checkpoint_dir):
    """Only rank 0 samples: a TP=2 batched engine gives the controlled requests TP=1's serial bits."""
    path = checkpoint_dir("tiny")
    prompts = [[(7 * i + j) % VOCAB for j in range(n)] for i, n in enumerate((3, 20, 9))]
    params = [SamplingParams(max_tokens=6, temperature=0.0, repetition_penalty=1.7, logit_bias={5: 2.0}),
              SamplingParams(max_tokens=6, temperature=0.9, seed=8, presence_penalty=1.0, min_p=0.2, logprobs=2),
              SamplingParams(max_tokens=6, temperature=1.0, seed=9, allowed_token_ids=list(range(50)), min_tokens=6,
                             bad_words_token_ids=[[1, 2]], frequency_penalty=-0.5)]
    with LLM(EngineArgs(model=path, max_seq_len=64)) as one, \
            LLM(EngineArgs(model=path, max_seq_len=64, tensor_parallel_size=2,
                           backend_options={"enable_batching": True})) as two:
        serial = [one.generate(p, sp) for p, sp in zip(prompts, params)]
        for a, b in zip(serial, two.generate(prompts, params)):
            assert (a.token_ids, a.logprobs, a.top_logprobs) == (b.token_ids, b.logprobs, b.top_logprobs)


# -- the checks at the boundary --------------------------------------------------------------------

@pytest.mark.parametrize(("fields", "error", "message"), [
    ({"presence_penalty": 2.5}, ValueError, r"presence_penalty must be a number in \[-2, 2\]"),
    ({"frequency_penalty": math.nan}, ValueError, r"frequency_penalty must be a number in \[-2, 2\]"),
    ({"frequency_penalty": "1"}, ValueError, r"frequency_penalty must be a number"),
    ({"repetition_penalty": 0}, ValueError, r"repetition_penalty must be a finite number > 0"),
    ({"repetition_penalty": math.inf}, ValueError, r"repetition_penalty must be a finite number > 0"),
    ({"min_p": 1.01}, ValueError, r"min_p must be a number in \[0, 1\]"),
    ({"min_p": -0.1}, ValueError, r"min_p must be a number in \[0, 1\]"),
    ({"min_tokens": 17}, ValueError, r"min_tokens must be an int in \[0, max_tokens\] \(max_tokens is 16\)"),
    ({"min_tokens": 1.0}, ValueError, r"min_tokens must be an int"),
    ({"logit_bias": {5: 100.5}}, ValueError, r"logit_bias values must be numbers in \[-100, 100\], got 100.5"),
    ({"logit_bias": {"5": 1.0}}, ValueError, r"logit_bias keys must be token ids \(ints >= 0\), got '5'"),
    ({"logit_bias": {-1: 1.0}}, ValueError, r"logit_bias keys must be token ids"),
    ({"logit_bias": [(5, 1.0)]}, TypeError, r"logit_bias must be None or a dict of token id -> bias"),
    ({"allowed_token_ids": []}, ValueError, r"allowed_token_ids must be None or a non-empty sequence"),
    ({"allowed_token_ids": [1, -2]}, ValueError, r"allowed_token_ids must be None or a non-empty sequence"),
    ({"allowed_token_ids": 5}, TypeError, r"allowed_token_ids must be"),
    ({"bad_words_token_ids": [1, 2]}, TypeError, r"bad_words_token_ids must be a sequence of non-empty sequences"),
    ({"bad_words_token_ids": [[1], []]}, ValueError, r"bad_words_token_ids must be .* got an empty one"),
    ({"bad_words_token_ids": "ab"}, TypeError, r"bad_words_token_ids must be"),
])
def test_bad_controls_are_refused_naming_the_field(fields, error, message):
    with pytest.raises(error, match=message):
        SamplingParams(**fields)


@pytest.mark.parametrize("fields", [{"logit_bias": {VOCAB: 1.0}}, {"allowed_token_ids": [1, VOCAB]},
                                    {"bad_words_token_ids": [[1], [2, VOCAB + 3]]}])
def test_token_ids_outside_the_vocabulary_are_refused_at_submission(llm, fields):
    name = next(iter(fields))
    with pytest.raises(ValueError, match=rf"{name} entry \d+ is outside the vocabulary \[0, {VOCAB}\)"):
        llm.generate([1, 2], SamplingParams(**fields))


def test_controls_are_kept_canonical_hashable_and_repr_as_python():
    params = SamplingParams(logit_bias={7: 1, 2: -0.5}, allowed_token_ids=[3, 1], bad_words_token_ids=[[4, 5]],
                            min_p=0.5)
    assert params.logit_bias == {2: -0.5, 7: 1.0} and list(params.logit_bias) == [2, 7]
    assert params.allowed_token_ids == (3, 1) and params.bad_words_token_ids == ((4, 5),)
    assert hash(params) == hash(SamplingParams(logit_bias={2: -0.5, 7: 1.0}, allowed_token_ids=(3, 1),
                                               bad_words_token_ids=((4, 5),), min_p=0.5))
    assert eval(repr(params)) == params and "presence_penalty" not in repr(params)
    assert repr(SamplingParams()) == ("SamplingParams(max_tokens=16, temperature=1.0, top_k=0, top_p=1.0, seed=None, "
                                      "stop_token_ids=(), ignore_eos=False, logprobs=None, prompt_logprobs=None)")
