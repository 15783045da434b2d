"""Fuzz the public API's inputs: arbitrary values and types for every SamplingParams field, the
top-level EngineArgs fields (model, backend, dtype, device, max_seq_len), prompts and
sampling_params. Each call returns a result or raises ValueError/TypeError naming the field;
never another exception."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pocketllm import LLM, EngineArgs, GenerationResult, SamplingParams
from pocketllm.models import read_config

MAX_SEQ_LEN = 32
SAMPLING_FIELDS = ("max_tokens", "temperature", "top_k", "top_p", "seed", "stop_token_ids", "ignore_eos")

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-5, 300), st.integers(), st.integers(-10**500, 10**500),
    st.floats(allow_nan=True, allow_infinity=True), st.floats(0, 2), st.text(max_size=8), st.binary(max_size=8),
    st.sampled_from([np.int64(3), np.float32(0.5), np.bool_(True), np.uint8(7), torch.tensor(2), torch.tensor(0.5),
                     complex(1, 1), object(), math.pi, 2**63, 2**64 - 1, 2**64, -(2**63) - 1]),
)
containers = st.one_of(
    st.lists(st.integers(-3, 300), max_size=6), st.tuples(st.integers(0, 255)), st.lists(scalars, max_size=3),
    st.lists(st.lists(st.integers(0, 255), max_size=4), max_size=3),
    st.dictionaries(st.text(max_size=3), scalars, max_size=2),
    st.frozensets(st.integers(0, 255), max_size=3), st.builds(range, st.integers(0, 5), st.integers(0, 9)),
    st.builds(lambda xs, dt: np.array(xs, dtype=dt), st.lists(st.integers(0, 255), max_size=5),
              st.sampled_from(["int64", "int32", "uint8", "float32", "bool"])),
    st.builds(lambda xs, dt: torch.tensor(xs, dtype=dt), st.lists(st.integers(0, 255), max_size=5),
              st.sampled_from([torch.int64, torch.int32, torch.uint8, torch.float32, torch.bool])),
    st.builds(lambda n: np.zeros((n, 2), dtype=np.int64), st.integers(0, 2)),
)
anything = st.one_of(scalars, containers)


pytestmark = pytest.mark.usefixtures("single_torch_thread")


@pytest.fixture(scope="module")
def llm(checkpoint_dir):
    return LLM(EngineArgs(model=str(checkpoint_dir("tiny")), max_seq_len=MAX_SEQ_LEN,
                          backend_options={"max_batch_size": 1}))


def outcome(fn):
    """fn()'s result, or the ValueError/TypeError it raised; any other exception fails the test."""
    try:
        return fn()
    except (ValueError, TypeError) as exc:
        assert str(exc), "an error must say what is wrong"
        return exc


@given(values=st.dictionaries(st.sampled_from(SAMPLING_FIELDS), anything, min_size=1, max_size=3))
def test_fuzz_sampling_params(values):
    """Any values for any SamplingParams fields: constructed (then every field has its documented
    type and range) or ValueError/TypeError naming one of the given fields."""
    made = outcome(lambda: SamplingParams(**values))
    if isinstance(made, Exception):
        assert any(name in str(made) for name in values), str(made)
        return
    assert type(made.max_tokens) is int and made.max_tokens >= 1
    assert type(made.temperature) is float and 0 <= made.temperature < math.inf
    assert type(made.top_k) is int and 0 <= made.top_k < 2**63
    assert type(made.top_p) is float and 0 < made.top_p <= 1
    assert made.seed is None or (type(made.seed) is int and 0 <= made.seed < 2**64)
    assert all(type(t) is int and t >= 0 for t in made.stop_token_ids)


ENGINE_VALUES = {
    "backend": st.one_of(st.sampled_from(["torch", "triton", "TORCH", "", "cuda"]), scalars),
    "dtype": st.one_of(st.sampled_from(["float32", "bfloat16", "float16", "float64", "int8"]), scalars,
                       st.just(torch.float32)),
    "device": st.one_of(st.sampled_from(["cpu", "cuda", "cuda:0", "cuda:7", "meta", "mps", "xla", "cpu:0", "cuda:-1",
                                         "gpu", ""]), st.just(torch.device("cpu")), scalars),
    # Bounded so that an accepted value allocates little: huge ones must be refused before allocation.
    "max_seq_len": st.one_of(st.integers(-5, 300), st.integers(10**9, 10**30), scalars.filter(
        lambda v: not (isinstance(v, int) and 300 < v < 10**9))),
}


@settings(max_examples=max(1, settings().max_examples // 2))
@given(data=st.data())
def test_fuzz_engine_args(checkpoint_dir, data):
    """One top-level EngineArgs field set to anything: the engine is built (and generates) or the
    constructor raises ValueError/TypeError naming that field (or, for a cache too large for this
    machine, max_seq_len)."""
    field = data.draw(st.sampled_from(sorted(ENGINE_VALUES)), label="field")
    value = data.draw(ENGINE_VALUES[field], label="value")
    path = str(checkpoint_dir("tiny"))
    llm = outcome(lambda: LLM(EngineArgs(model=path, backend_options={"max_batch_size": 1},
                                         **{"max_seq_len": MAX_SEQ_LEN, field: value})))
    if isinstance(llm, Exception):
        assert field in str(llm), str(llm)
        return
    if llm.args.backend == "triton":
        return  # the interpreted Triton backend is tested elsewhere; building it is what counts here
    result = llm.generate([1, 2], SamplingParams(max_tokens=1, temperature=0.0))
    assert result.finish_reason == "length"


@given(model=anything)
def test_fuzz_engine_args_model(model):
    """model must be a path: anything that is not a str or Path is a TypeError naming model."""
    made = outcome(lambda: EngineArgs(model=model))
    assert isinstance(made, EngineArgs) and isinstance(made.model, str) or "model" in str(made)


@given(prompt=anything)
def test_fuzz_prompt_tokens(llm, prompt):
    """Any value as prompt_tokens: results (one per prompt; a 1-D integer array or tensor is one
    prompt) or ValueError/TypeError; a failed call leaves the cache's slots free. EOS is ignored:
    which prompt makes the random model's greedy token EOS depends on its last bits, so on the CPU."""
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    got = outcome(lambda: llm.generate(prompt, params))
    assert llm.slots.num_free == llm.cache.num_slots
    if isinstance(got, Exception):
        return
    results = got if isinstance(got, list) else [got]
    assert all(isinstance(r, GenerationResult) and r.finish_reason == "length" for r in results)
    if isinstance(prompt, (np.ndarray, torch.Tensor)):
        assert isinstance(got, GenerationResult) and got.prompt_tokens == prompt.tolist()


@given(params=anything)
def test_fuzz_sampling_params_argument(llm, params):
    """Any value as generate()'s sampling_params (a dict included): a result or ValueError/TypeError."""
    got = outcome(lambda: llm.generate([1, 2], params))
    if isinstance(got, Exception):
        assert "sampling_params" in str(got), str(got)


@given(text=st.one_of(st.text(max_size=12), st.lists(st.text(max_size=6), max_size=3), anything))
def test_fuzz_text_prompts(llm, text):
    """Any value as prompts (text): results or ValueError/TypeError."""
    outcome(lambda: llm.generate(prompts=text, sampling_params=SamplingParams(max_tokens=1, temperature=0.0)))


@given(prompt=anything, params=st.one_of(st.just(SamplingParams(max_tokens=1)), anything), callback=anything)
def test_fuzz_scheduler_submit(checkpoint_dir, prompt, params, callback):
    """submit_request with any prompt, params and callback: an id (the request then completes) or
    ValueError/TypeError with nothing queued."""
    with LLM(EngineArgs(model=str(checkpoint_dir("tiny")), max_seq_len=MAX_SEQ_LEN,
                        backend_options={"enable_batching": True, "max_batch_size": 1,
                                         "background_thread": False})) as engine:
        s = engine.scheduler
        rid = outcome(lambda: s.submit_request(prompt, params, callback=callback))
        if isinstance(rid, Exception):
            assert not s.has_work
            return
        while s.has_work:
            s.step()
        assert s.poll_result(rid).finish_reason in ("stop", "length")


# -- the examples the fuzzing stands for ----------------------------------------------------------------------


@pytest.mark.parametrize("field,value,message", [
    ("temperature", 10**400, r"temperature must be a finite number >= 0 and <= 3\.403e\+38"),
    ("top_p", 10**400, r"top_p must be a number in \(0, 1\]"),
    ("top_k", 2**63, r"top_k must be an int >= 0 \(0 disables it\) and < 2\*\*63"),
    ("max_tokens", np.float64(3.0), r"max_tokens must be an int >= 1"),
])
def test_values_that_overflow_name_field_and_range(field, value, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{field: value})


def test_numpy_scalars_are_accepted_as_plain_numbers():
    params = SamplingParams(max_tokens=np.int64(3), temperature=np.float32(0.5), seed=np.uint64(2**64 - 1),
                            stop_token_ids=np.array([1, 2]))
    assert (params.max_tokens, params.temperature, params.seed, params.stop_token_ids) == (3, 0.5, 2**64 - 1, (1, 2))
    assert type(params.max_tokens) is int and type(params.stop_token_ids[0]) is int


def test_integer_arrays_and_tensors_are_one_prompt(llm):
    params = SamplingParams(max_tokens=2, temperature=0.0)
    expected = llm.generate([4, 5, 6], params).token_ids
    for prompt in (np.array([4, 5, 6]), np.array([4, 5, 6], dtype=np.uint8), torch.tensor([4, 5, 6]),
                   torch.tensor([4, 5, 6], dtype=torch.int32)):
        assert llm.generate(prompt, params).token_ids == expected
    both = llm.generate([np.array([4, 5, 6]), torch.tensor([4, 5, 6])], params)
    assert [r.token_ids for r in both] == [expected, expected]


@pytest.mark.parametrize("prompt,message", [
    (np.array([[4, 5, 6]]), r"must be 1-D \(one prompt\), got 2-D"),
    (np.array([4.0, 5.0]), "must have an integer dtype, got float64"),
    (torch.tensor([True, False]), "must have an integer dtype, got torch.bool"),
    ({1, 2}, "prompt_tokens must be a list of ints, got set"),
])
def test_arrays_that_are_not_one_integer_prompt_are_explained(llm, prompt, message):
    with pytest.raises(TypeError, match=message):
        llm.generate(prompt, SamplingParams(max_tokens=1))


def test_sampling_params_as_a_dict_is_explained(llm):
    with pytest.raises(TypeError, match=r"got a dict; use SamplingParams\(\*\*the_dict\)"):
        llm.generate([1, 2], {"max_tokens": 3})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without CUDA")
@pytest.mark.parametrize("device,message", [("cuda", "torch finds no CUDA device here"),
                                            ("cuda:1", "torch finds no CUDA device here"),
                                            ("meta", r"device must be 'cpu' or 'cuda\[:index\]', got 'meta'"),
                                            ("nonsense", r"device must be 'cpu' or 'cuda\[:index\]'")])
def test_devices_that_do_not_exist_here_are_refused(tiny_checkpoint, device, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(model=str(tiny_checkpoint), device=device)


def test_cache_larger_than_memory_is_refused_before_loading(tiny_checkpoint, monkeypatch):
    """max_seq_len=10**9: refused at once, naming max_seq_len, max_batch_size, the bytes needed and
    available, before any weight is read."""
    import pocketllm.models.registry as registry

    monkeypatch.setattr(registry, "load_weights", lambda *a, **k: pytest.fail("weights were read"))
    with pytest.raises(ValueError) as info:
        LLM(EngineArgs(model=str(tiny_checkpoint), max_seq_len=10**9))
    text = str(info.value)
    for part in ("max_seq_len=1000000000", "max_batch_size=8", "bytes", "available"):
        assert part in text, text


def test_cache_size_is_reported(llm, checkpoint_dir):
    """Capabilities and scheduler stats report the slot cache's size: here K and V of every layer."""

    cfg = read_config(checkpoint_dir("tiny"))
    expected = 2 * cfg.num_hidden_layers * 1 * MAX_SEQ_LEN * cfg.num_key_value_heads * cfg.head_dim * 4
    assert llm.capabilities.cache_bytes == expected == sum(t.numel() * 4 for t in llm.cache.k + llm.cache.v)
    with LLM(EngineArgs(model=str(checkpoint_dir("tiny")), max_seq_len=MAX_SEQ_LEN,
                        backend_options={"enable_batching": True, "max_batch_size": 1,
                                         "background_thread": False})) as batched:
        assert batched.scheduler.get_stats().cache_bytes == expected


@pytest.mark.parametrize("variant", ["tiny", "untied_gqa4_bias", "qwen3.5", "qwen3.5_mm_untied", "qwen3.5_mha"])
def test_cache_sizing_uses_the_models_own_cache_layout(checkpoint_dir, variant):
    """The size checked before the model is built comes from the same per-layer layout the model
    asks for once built."""
    from pocketllm.models.registry import layer_specs

    engine = LLM(EngineArgs(model=str(checkpoint_dir(variant)), max_seq_len=MAX_SEQ_LEN,
                            backend_options={"max_batch_size": 1}))
    assert layer_specs(engine.model_config) == engine.model.cache_specs()


def test_stop_token_ids_that_only_look_iterable_are_explained():
    """A 0-d tensor has __iter__ but cannot be iterated: the error still names the field."""
    with pytest.raises(TypeError, match=r"stop_token_ids must be a sequence of ints, got tensor\(2\)"):
        SamplingParams(stop_token_ids=torch.tensor(2))
