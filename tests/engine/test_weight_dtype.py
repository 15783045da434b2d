"""bf16 weights under fp32 rows (`EngineArgs(weight_dtype="bfloat16")`): the weight matrices kept in
bf16 (half the bytes a decode step reads), everything else in fp32, the products by the C++ kernels.

With `bf16_product="widen"` the kernel widens each weight exactly as it loads it, so the engine computes
exactly what an fp32 engine computes on the same checkpoint with its matrices rounded to bf16: the
tests check that bit for bit, and parity with transformers on that rounded checkpoint. The default,
"dot", multiplies rows rounded to bf16 on bf16 dot products: the tests check that it is what runs,
batched == serial (the Hypothesis property), scoring == generation (exact positions), and closeness to
"widen"; and the configurations that cannot run bf16 weights refused by name.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from helpers import budget, hf_model
from hypothesis import given, settings
from safetensors.torch import load_file, save_file

from pocketllm import LLM, EngineArgs, SamplingParams
from pocketllm.kernels.cpu.extension import load_extension
from pocketllm.kernels.linear import linear_bf16_dot
from pocketllm.kernels.moe import moe_bf16_dot
from pocketllm.models.registry import is_matrix
from pocketllm.testing import Engines, assert_batch_invariant, assert_scoring_matches_generation
from pocketllm.testing.strategies import workloads

pytestmark = pytest.mark.skipif(load_extension() is None, reason="needs pocketllm's C++ CPU kernels")
VARIANTS = ["tiny", "qwen3.5_mm_untied", "qwen3-moe"]


@pytest.fixture(scope="module", params=VARIANTS)
def checkpoints(request, checkpoint_dir, tmp_path_factory):
    """(the checkpoint, a copy whose matrices hold their bf16 roundings, stored in fp32)."""
    path = checkpoint_dir(request.param)
    rounded = tmp_path_factory.mktemp(f"rounded_{request.param}")
    for item in path.iterdir():
        if item.suffix != ".safetensors":
            shutil.copy(item, rounded / item.name)
    for file in path.glob("*.safetensors"):
        tensors = load_file(str(file))
        save_file({name: t.bfloat16().float() if is_matrix(name, t) else t for name, t in tensors.items()},
                  str(rounded / file.name), metadata={"format": "pt"})
    return path, rounded


def _engine(path, **args) -> LLM:
    return LLM(EngineArgs(model=str(path), max_seq_len=128, **args))


def test_bf16_weights_compute_the_rounded_checkpoint_bit_for_bit(checkpoints):
    path, rounded = checkpoints
    narrow = _engine(path, weight_dtype="bfloat16", bf16_product="widen")
    wide = _engine(rounded)
    *matrices, lm_head = narrow.model.linear_weights()
    assert {w.dtype for w in [*matrices, lm_head]} == {torch.bfloat16}
    assert narrow.model.final_norm.dtype == torch.float32 and narrow.model.embed.dtype == torch.bfloat16
    assert narrow.capabilities.exact_positions and narrow.capabilities.batch_invariant
    params = SamplingParams(max_tokens=12, temperature=0.9, seed=5, logprobs=3, ignore_eos=True)
    for prompt in ([1, 2, 3], list(range(5, 75))):
        a, b = narrow.generate(prompt, params), wide.generate(prompt, params)
        assert (a.token_ids, a.logprobs, a.top_logprobs) == (b.token_ids, b.logprobs, b.top_logprobs)


@torch.inference_mode()
def test_bf16_weights_match_transformers_on_the_rounded_weights(checkpoints):
    path, rounded = checkpoints
    hf = hf_model(rounded)
    llm = _engine(path, weight_dtype="bfloat16", bf16_product="widen")
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False)[0, len(prompt):].tolist()
    got = llm.generate(prompt, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)).token_ids
    assert got == want


@pytest.fixture(scope="module")
def bf16_engines(checkpoints):
    engines = Engines(checkpoints[0], engine_args={"weight_dtype": "bfloat16"})
    yield engines
    engines.close()


@settings(max_examples=budget(0.25))
@given(workload=workloads(256, max_prompt=40, max_jobs=6, max_tokens=8))
def test_bf16_weights_batched_equals_serial_bitwise(bf16_engines, workload):
    assert_batch_invariant(bf16_engines, workload)


def test_bf16_dot_products_are_the_default_exact_along_the_sequence_and_near_widening(checkpoints):
    path, _ = checkpoints
    dot = _engine(path, weight_dtype="bfloat16")
    assert dot.model.ops.linear is linear_bf16_dot and dot.model.ops.prefill_linear is linear_bf16_dot
    assert dot.model.ops.moe is moe_bf16_dot  # the experts on the dot products too
    assert dot.tree_reduction  # the kernel sums its shards itself: the tree is free at one process too
    params = SamplingParams(max_tokens=10, temperature=0.8, seed=3, logprobs=2, ignore_eos=True)
    assert_scoring_matches_generation(dot, [[1, 2, 3], list(range(7, 60))], params)
    widen = _engine(path, weight_dtype="bfloat16", bf16_product="widen")
    greedy = SamplingParams(max_tokens=1, temperature=0.0, logprobs=5)
    a, b = dot.generate(list(range(3, 40)), greedy), widen.generate(list(range(3, 40)), greedy)
    assert a.logprobs != b.logprobs  # rows rounded to bf16: other bits...
    assert abs(a.logprobs[0] - b.logprobs[0]) < 0.05  # ...within bf16's rounding


@pytest.mark.parametrize("args,message", [
    ({"weight_dtype": "float16"}, "weight_dtype must be None or one of .*'bfloat16'.* with dtype 'float32'"),
    ({"weight_dtype": "float32", "dtype": "bfloat16"}, "weight_dtype must be None or one of \\('bfloat16',\\)"),
    ({"weight_dtype": "bfloat16", "backend_options": {"exact_positions": False}, "bf16_product": "widen"},
     "weight_dtype='bfloat16' with dtype='float32' needs the torch backend's C\\+\\+ fixed-order kernels.*linear, "
     "prefill_linear, moe"),
    ({"weight_dtype": "bfloat16", "backend": "triton"},
     "needs the torch backend's C\\+\\+ fixed-order kernels.*runs backend='triton'"),
    ({"weight_dtype": "bfloat16", "bf16_product": "amx"}, "bf16_product must be one of \\('dot', 'widen'\\)"),
])
def test_configurations_that_cannot_run_bf16_weights_are_refused(tiny_checkpoint, args, message):
    with pytest.raises(ValueError, match=message):
        _engine(tiny_checkpoint, **args)


def test_the_weight_dtype_is_what_the_config_said_for_the_other_tensors(tiny_checkpoint):
    """Norms stay in the row dtype; the checkpoint's config is not touched."""
    before = json.loads((tiny_checkpoint / "config.json").read_text())
    llm = _engine(tiny_checkpoint, weight_dtype="bfloat16")
    assert llm.model.blocks[0].input_norm.dtype == torch.float32
    assert json.loads((tiny_checkpoint / "config.json").read_text()) == before
