"""The op registry: op names are module names, every implementation fits its op's signature, and
`op_overrides` runs the engine on a variant (by name, import path or callable) or refuses it with
an error naming the field, the op and what is wrong."""

from __future__ import annotations

import importlib
import sys
import types

import pytest
import torch

from pocketllm import LLM, EngineArgs, SamplingParams
from pocketllm.kernels import IMPLEMENTATIONS, OP_NAMES, Ops, backend_impls, get_ops
from pocketllm.kernels.registry import SIGNATURES, check_signature, register, resolve


def test_every_op_is_a_module_of_its_name_with_its_reference():
    for op in OP_NAMES:
        module = importlib.import_module(f"pocketllm.kernels.{op}")
        assert getattr(module, f"{op}_ref") is IMPLEMENTATIONS[op]["ref"]
        if "triton" in IMPLEMENTATIONS[op]:
            assert getattr(module, f"{op}_triton") is IMPLEMENTATIONS[op]["triton"]
    assert set(OP_NAMES) == {f.name for f in Ops.__dataclass_fields__.values()}


@pytest.mark.parametrize("op", OP_NAMES)
def test_every_registered_implementation_fits_the_signature(op):
    for name, fn in IMPLEMENTATIONS[op].items():
        check_signature(op, fn)  # raises on a mismatch
        assert resolve(op, name) is fn


def test_backends_name_registered_implementations():
    for backend in ("torch", "triton"):
        for flags in ((True, False, True), (True, True, False), (True, False, False), (False, False, True)):
            for op, name in backend_impls(backend, *flags).items():
                assert name in IMPLEMENTATIONS[op], (backend, op, name)
    assert get_ops("torch", decode_per_row=True, exact_positions=False).linear is IMPLEMENTATIONS["linear"]["per_row"]
    assert get_ops("torch", batch_invariant=False).prefill_linear is IMPLEMENTATIONS["linear"]["ref"]


def _decode_variant(q, k_cache, v_cache, slot_ids, seq_lens, scale):
    return IMPLEMENTATIONS["decode_attention"]["ref"](q, k_cache, v_cache, slot_ids, seq_lens, scale)


@pytest.mark.parametrize("bad, message", [
    (lambda q, k_cache, v_cache, slot_ids, scale: q, "missing parameter 'scale'"),
    (lambda q, k_cache, v_cache, slot_ids, lengths, scale: q, "parameter 4 is 'lengths', expected 'seq_lens'"),
    (lambda q, k_cache, v_cache, slot_ids, seq_lens, scale, block: q, "extra parameter 'block' has no default"),
])
def test_a_variant_with_the_wrong_signature_is_refused(bad, message):
    with pytest.raises(TypeError, match=message):
        resolve("decode_attention", bad)
    with pytest.raises(TypeError, match=r"op_overrides\['decode_attention'\]"):
        EngineArgs(model="unused", op_overrides={"decode_attention": bad})


def test_an_optional_parameter_must_stay_optional():
    with pytest.raises(TypeError, match="'bias' must be optional"):
        resolve("linear", lambda x, weight, bias: x)
    resolve("linear", lambda x, weight, bias=None: x)
    resolve("linear", lambda *args: args[0])  # *args takes anything


@pytest.mark.parametrize("overrides, error, message", [
    ({"decode_attn": "ref"}, ValueError, r"a key of op_overrides must be one of \("),
    ({"decode_attention": "nope"}, ValueError, r"must be one of \('ref', 'fused', 'triton'"),
    ({"decode_attention": "no_such_module_xyz:fn"}, ValueError, "no_such_module_xyz"),
    ({"decode_attention": "math:no_such_fn"}, ValueError, "math has no attribute 'no_such_fn'"),
    ({"decode_attention": 3}, ValueError, "got 3"),
    (["decode_attention"], TypeError, "op_overrides must be a dict"),
])
def test_bad_overrides_name_the_field(overrides, error, message):
    with pytest.raises(error, match=message):
        EngineArgs(model="unused", op_overrides=overrides)


@pytest.mark.parametrize("module, source, cause, chained", [
    ("override_missing_xyz", None, "ModuleNotFoundError: No module named 'override_missing_xyz'", True),
    ("override_syntax", "def fn(:\n", "SyntaxError: ", True),
    ("override_raises", "raise RuntimeError('broken at import')\n", "RuntimeError: broken at import", True),
    ("override_exits", "import sys\nsys.exit(3)\n", "SystemExit: 3", True),
    ("override_no_fn", "other = 1\n", "override_no_fn has no attribute 'fn'", False),
    ("override_not_callable", "fn = 42\n", "override_not_callable.fn is not callable (type int)", False),
])
def test_an_override_that_cannot_be_imported_is_a_value_error_naming_the_key(module, source, cause, chained, tmp_path,
                                                                             monkeypatch):
    """Whatever importing a "module:function" spec raises (a missing module, a syntax error, the
    module's own exception, even SystemExit), a missing attribute or one that is not callable: a
    ValueError naming the key, the spec and the cause, the original exception chained."""
    monkeypatch.syspath_prepend(str(tmp_path))
    if source is not None:
        (tmp_path / f"{module}.py").write_text(source)
    try:
        with pytest.raises(ValueError) as info:
            EngineArgs(model="unused", op_overrides={"rms_norm": f"{module}:fn"})
    finally:
        sys.modules.pop(module, None)
    message = str(info.value)
    assert message.startswith(f"op_overrides['rms_norm']: cannot import '{module}:fn': "), message
    assert cause in message, message
    if chained:  # the import raised: that exception is in the chain of causes
        causes, exc = [], info.value.__cause__
        while exc is not None:
            causes.append(type(exc).__name__)
            exc = exc.__cause__
        assert cause.split(":")[0] in causes, causes


@pytest.fixture
def variant_module(monkeypatch):
    """A module outside the package, as a user's `mypkg.mymod`, with a counting decode attention."""
    module = types.ModuleType("user_kernels_for_test")
    module.calls = 0

    def my_decode(q, k_cache, v_cache, slot_ids, seq_lens, scale):
        module.calls += 1
        return _decode_variant(q, k_cache, v_cache, slot_ids, seq_lens, scale)

    module.my_decode = my_decode
    monkeypatch.setitem(sys.modules, module.__name__, module)
    return module


def _generate(path, **kwargs) -> tuple[list[int], list[float]]:
    llm = LLM(EngineArgs(model=str(path), max_seq_len=64, **kwargs))
    params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0)
    result = llm.generate(prompt_tokens=[5, 6, 7, 8], sampling_params=params)
    return result.token_ids, result.logprobs


def test_op_overrides_runs_the_engine_on_the_variant(tiny_checkpoint, variant_module):
    baseline = _generate(tiny_checkpoint, op_overrides={"decode_attention": "ref"})
    via_path = _generate(tiny_checkpoint, op_overrides={"decode_attention": "user_kernels_for_test:my_decode"})
    per_run = variant_module.calls
    assert per_run == 5 * 2  # 5 decode steps after the prefill's token, 2 attention layers
    via_callable = _generate(tiny_checkpoint, op_overrides={"decode_attention": variant_module.my_decode})
    assert variant_module.calls == 2 * per_run
    assert via_path == baseline and via_callable == baseline


def test_registered_variant_is_selectable_by_name(tiny_checkpoint, monkeypatch):
    monkeypatch.setitem(IMPLEMENTATIONS, "rms_norm", dict(IMPLEMENTATIONS["rms_norm"]))
    seen = []

    def traced(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        seen.append(x.shape)
        return IMPLEMENTATIONS["rms_norm"]["ref"](x, weight, eps)

    register("rms_norm", "traced", traced)
    with pytest.raises(ValueError, match="without ':'"):
        register("rms_norm", "a:b", traced)
    llm = LLM(EngineArgs(model=str(tiny_checkpoint), max_seq_len=32, op_overrides={"rms_norm": "traced"}))
    assert llm.model.ops.rms_norm is traced
    llm.generate(prompt_tokens=[1, 2], sampling_params=SamplingParams(max_tokens=1))
    assert seen, "the registered variant never ran"
    assert set(SIGNATURES) == set(OP_NAMES)
