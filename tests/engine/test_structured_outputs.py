"""Structured outputs (SamplingParams.structured_outputs, xgrammar): every output of the random-weight
tiny model follows its constraint (JSON schema, JSON object, regex, choice, EBNF grammar); a
constrained request gives the same tokens and logprobs batched with others as alone, preempted by
swap or by recompute too (its matcher takes each token once); logprobs stay raw; the checks at
construction and at submission name the field."""

from __future__ import annotations

import json
import re

import pytest
from helpers import budget
from hypothesis import given, settings
from hypothesis import strategies as st

from pocketllm import LLM, EngineArgs, SamplingParams
from pocketllm.structured_outputs import StructuredOutputsParams
from pocketllm.testing import Engines, Job, Workload, assert_batch_invariant, assert_scoring_matches_generation

xgr = pytest.importorskip("xgrammar", reason="structured outputs need xgrammar (pip install 'pocketllm[structured]')")

from pocketllm.grammar import INSTALL_HINT, GrammarError, Grammars, GrammarState, choice_grammar  # noqa: E402

VOCAB = 256  # the tiny preset's byte-level vocabulary: ids 0..254 are bytes, 255 is EOS
EOS = 255
CLOSE = ord("}")
INTEGER = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
SMALL = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["n"]}
COLOUR = {"type": "object", "properties": {"c": {"type": "string", "enum": ["red", "green", "blue"]}},
          "required": ["c"]}
CHOICES = ["yes", "no", "maybe"]
SPECS = {
    "integer": StructuredOutputsParams(json=INTEGER),
    "small": StructuredOutputsParams(json=json.dumps(SMALL)),
    "enum": StructuredOutputsParams(json=COLOUR),
    "regex": StructuredOutputsParams(regex="[ab]{3}c"),
    "choice": StructuredOutputsParams(choice=CHOICES),
    "grammar": StructuredOutputsParams(grammar='root ::= "x" [0-9] [0-9]?'),
    "object": StructuredOutputsParams(json_object=True),
}
# A random-weight model may write an unbounded integer (or object) for a long time: '}' pushed up ends it.
BIASED = {"integer", "object"}


def follows(name: str, text: str) -> bool:
    """Whether `text` is an output the constraint SPECS[name] allows."""
    if name in ("integer", "small", "enum", "object"):
        try:
            value = json.loads(text)
        except ValueError:
            return False
        if name == "object":
            return isinstance(value, dict)
        key = {"integer": "a", "small": "n", "enum": "c"}[name]
        if not isinstance(value, dict) or set(value) != {key}:
            return False
        item = value[key]
        return {"integer": isinstance(item, int), "small": isinstance(item, int) and 0 <= item <= 99,
                "enum": item in ("red", "green", "blue")}[name]
    pattern = {"regex": "[ab]{3}c", "grammar": "x[0-9][0-9]?", "choice": "|".join(CHOICES)}[name]
    return re.fullmatch(pattern, text) is not None


def constrained(name: str, **fields) -> SamplingParams:
    bias = {CLOSE: 8.0} if name in BIASED else None
    return SamplingParams(structured_outputs=SPECS[name], logit_bias=bias, **{"max_tokens": 40, **fields})


@pytest.fixture(scope="module")
def llm(tiny_batched_llm):
    return tiny_batched_llm


@pytest.mark.parametrize("name", sorted(SPECS))
def test_every_output_follows_its_constraint(llm, name):
    """Greedy and sampled, several prompts in one batch: each output is complete ("stop", EOS last)
    and is what the constraint allows."""
    prompts = [[1, 2, 3], [40, 41], [7] * 9]
    params = [constrained(name, temperature=t, seed=s) for t, s in ((0.0, 0), (1.0, 1), (1.0, 2))]
    for result in llm.generate(prompts, params):
        assert result.finish_reason == "stop" and result.token_ids[-1] == EOS, (name, result)
        assert follows(name, result.text), (name, result.text)


def test_the_grammar_ends_the_request_even_with_ignore_eos(llm):
    """The matcher terminates when it takes EOS after a complete output: "stop", whatever ignore_eos."""
    result = llm.generate([5, 6], constrained("regex", temperature=0.0, ignore_eos=True))
    assert result.finish_reason == "stop" and follows("regex", result.text) and len(result.token_ids) == 5


def test_the_serial_path_constrains_too(checkpoint_dir, llm):
    with LLM(EngineArgs(model=str(checkpoint_dir("tiny")), max_seq_len=96)) as serial:
        params = constrained("enum", temperature=1.0, seed=5, logprobs=2)
        alone, batched = serial.generate([9, 8, 7], params), llm.generate([9, 8, 7], params)
    assert follows("enum", alone.text)
    assert (alone.token_ids, alone.logprobs, alone.top_logprobs) == \
        (batched.token_ids, batched.logprobs, batched.top_logprobs)


def test_logprobs_are_raw_and_score_as_generated(llm):
    """With a grammar the reported logprobs and alternatives are the raw model's, as with the controls."""
    params = constrained("enum", temperature=0.9, seed=3, logprobs=3)
    assert_scoring_matches_generation(llm, [[1, 2, 3], [60, 61, 62, 63]], params)


def test_the_mask_leaves_the_allowed_logits_bits_alone(llm):
    import torch

    state = llm.grammars.state(constrained("regex"))
    assert isinstance(state, GrammarState)
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(0))
    row = state.apply(logits)
    allowed = torch.zeros(VOCAB, dtype=torch.bool)
    allowed[[ord("a"), ord("b")]] = True
    assert torch.equal(row[allowed], logits[allowed]) and bool((row[~allowed] == float("-inf")).all())
    assert state.advance([ord("a")]) and state.advance([ord("a")]) and state.accepted == 1  # taken once
    assert not state.advance([ord("a"), ord("z")]) and state.accepted == 1


# -- batched == alone, preemption -------------------------------------------------------------------

@pytest.fixture(scope="module")
def engines(checkpoint_dir):
    with Engines(checkpoint_dir("tiny")) as engines:
        yield engines


@st.composite
def mixed_params(draw: st.DrawFn) -> SamplingParams:
    """Constrained (any of SPECS, sometimes with controls) or not."""
    fields = {"max_tokens": draw(st.integers(4, 10)), "temperature": draw(st.sampled_from([0.0, 0.8, 1.5])),
              "seed": draw(st.integers(0, 2**64 - 1)), "logprobs": draw(st.sampled_from([None, 2]))}
    name = draw(st.sampled_from([None, *sorted(SPECS)]))
    if name is None:
        return SamplingParams(**fields, ignore_eos=draw(st.booleans()))
    controls = draw(st.sampled_from([{}, {"presence_penalty": 1.0}, {"min_p": 0.2}]))
    return constrained(name, **fields, **controls)


@settings(max_examples=budget(0.1), deadline=None)
@given(prompts=st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=8).map(tuple), min_size=4,
                        max_size=4),
       params=st.lists(mixed_params(), min_size=4, max_size=4),
       arrivals=st.lists(st.integers(0, 3), min_size=4, max_size=4), slots=st.integers(2, 4))
def test_constrained_requests_batched_equal_their_serial_runs(engines, prompts, params, arrivals, slots):
    """Constrained and unconstrained requests share batches: each one's tokens and logprobs equal its
    cold serial run, bit for bit."""
    jobs = tuple(Job(p, sp, arrival_step=a) for p, sp, a in zip(prompts, params, arrivals))
    assert_batch_invariant(engines, Workload(jobs, max_batch_size=slots))


def _preempted_jobs() -> tuple[Job, ...]:
    """Two constrained requests, each preempted twice mid-output, and a more urgent one in between."""
    return (Job((3, 1, 4, 1, 5), constrained("enum", temperature=0.9, seed=1), priority=1, preempt_steps=(2, 6)),
            Job((2, 7, 1, 8), constrained("small", temperature=1.0, seed=2), priority=1, preempt_steps=(3, 5)),
            Job((9, 9), constrained("choice", temperature=0.0), arrival_step=4, priority=0))


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_preempted_constrained_requests_equal_their_serial_runs(checkpoint_dir, mode):
    """Preempted by swap or by recompute (the tokens prefilled again are not fed to the matcher
    again): the outputs follow their constraints and equal the uninterrupted serial runs."""
    options = {"exact_positions": True, "preemption_mode": "recompute"} if mode == "recompute" else {}
    with Engines(checkpoint_dir("tiny"), **options) as engines:
        assert_batch_invariant(engines, Workload(_preempted_jobs(), max_batch_size=2))
        stats = engines.scheduler(2).get_stats()
        assert stats.preemptions >= 3 and stats.recomputes == (stats.preemptions if mode == "recompute" else 0)
        for job, name in zip(_preempted_jobs(), ("enum", "small", "choice")):
            result = engines.serial_result(job)
            assert result.finish_reason == "stop" and follows(name, result.text), (name, result.text)


# -- the checks --------------------------------------------------------------------------------------

@pytest.mark.parametrize(("fields", "error", "message"), [
    ({}, ValueError, r"structured_outputs must set exactly one of json, json_object, regex, choice, grammar; "
                     r"got none"),
    ({"json": INTEGER, "regex": "a"}, ValueError, r"exactly one of .*; got json and regex"),
    ({"json_object": False}, ValueError, r"exactly one of .*; got none"),
    ({"json": "{not json"}, ValueError, r"structured_outputs.json must be a JSON schema: a dict, or its JSON text; "
                                        r"the text is not JSON"),
    ({"json": "[1]"}, ValueError, r"structured_outputs.json must be a JSON schema.*\(a JSON object\)"),
    ({"json": 5}, TypeError, r"structured_outputs.json must be a JSON schema"),
    ({"json_object": 1}, TypeError, r"structured_outputs.json_object must be None or a bool"),
    ({"regex": ""}, ValueError, r"structured_outputs.regex must be a regular expression, got an empty string"),
    ({"regex": 3}, TypeError, r"structured_outputs.regex must be a regular expression \(a str\)"),
    ({"choice": []}, ValueError, r"structured_outputs.choice must be a non-empty list of strings, got an empty one"),
    ({"choice": "yes"}, TypeError, r"structured_outputs.choice must be a non-empty list of strings"),
    ({"choice": ["a", 1]}, TypeError, r"structured_outputs.choice must be a non-empty list of strings"),
    ({"grammar": ""}, ValueError, r"structured_outputs.grammar must be an EBNF grammar"),
    ({"regex": "a", "disable_any_whitespace": None}, TypeError,
     r"structured_outputs.disable_any_whitespace must be a bool"),
])
def test_bad_constraints_are_refused_naming_the_field(fields, error, message):
    with pytest.raises(error, match=message):
        StructuredOutputsParams(**fields)


def test_sampling_params_take_a_dict_and_stay_hashable_with_a_python_repr():
    params = SamplingParams(structured_outputs={"json": INTEGER, "disable_any_whitespace": False})
    assert params.structured_outputs == StructuredOutputsParams(json=json.dumps(INTEGER), disable_any_whitespace=False)
    assert params.structured_outputs.kind == "json" and json.loads(params.structured_outputs.spec) == INTEGER
    assert hash(params) == hash(SamplingParams(structured_outputs=StructuredOutputsParams(
        json=INTEGER, disable_any_whitespace=False)))
    assert eval(repr(params)) == params and "structured_outputs" not in repr(SamplingParams())
    assert SamplingParams(structured_outputs={"choice": ["a", "b"]}).structured_outputs.choice == ("a", "b")
    with pytest.raises(ValueError, match=r"structured_outputs has no field 'schema'; its fields are json, "):
        SamplingParams(structured_outputs={"schema": INTEGER})
    with pytest.raises(TypeError, match=r"structured_outputs must be None, a StructuredOutputsParams or a dict"):
        SamplingParams(structured_outputs="json")


@pytest.mark.parametrize(("spec", "kind"), [
    (StructuredOutputsParams(json={"type": 5}), "json"),
    (StructuredOutputsParams(regex="[ab"), "regex"),
    (StructuredOutputsParams(grammar="root ::= foo"), "grammar"),
])
def test_what_xgrammar_cannot_compile_is_refused_at_submission(llm, spec, kind):
    with pytest.raises(GrammarError, match=rf"^structured_outputs\.{kind}: xgrammar cannot compile it: \w") as info:
        llm.generate([1, 2], SamplingParams(structured_outputs=spec))
    assert info.value.kind == kind and "/project/" not in str(info.value)
    assert not llm.scheduler.has_work  # nothing queued


def test_compiled_grammars_are_cached_per_constraint(llm):
    spec = StructuredOutputsParams(regex="[xy]{2}")
    assert llm.grammars.compile(spec) is llm.grammars.compile(StructuredOutputsParams(regex="[xy]{2}"))
    assert llm.grammars.compile(spec) is not llm.grammars.compile(StructuredOutputsParams(regex="[xy]{3}"))
    assert choice_grammar(['a"b', "c\\d"]) == 'root ::= "a\\"b" | "c\\\\d"'


def test_without_xgrammar_a_constrained_request_names_the_extra(checkpoint_dir, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "xgrammar", None)
    grammars = Grammars(checkpoint_dir("tiny"), VOCAB, (EOS,))
    with pytest.raises(ImportError, match=re.escape(INSTALL_HINT)):
        grammars.compile(SPECS["regex"])
    assert "pip install 'pocketllm[structured]'" in INSTALL_HINT


def test_a_model_without_eos_or_tokenizer_is_refused_clearly(tmp_path, checkpoint_dir):
    with pytest.raises(ValueError, match=r"structured_outputs needs the model's EOS token"):
        Grammars(checkpoint_dir("tiny"), VOCAB, ()).compile(SPECS["regex"])
    with pytest.raises(ValueError, match=r"structured_outputs needs the model's tokenizer; .* has no tokenizer.json"):
        Grammars(tmp_path, VOCAB, (EOS,)).compile(SPECS["regex"])
