"""Speculation with the checkpoint's own multi-token-prediction layer (`speculative={"method": "mtp",
...}`): `write_checkpoint(mtp=True)` writes Qwen3.5's `mtp.*` tensors in the published layout (which
transformers skips and the model's own loader skips by rule), the engine loads the layer beside the
model and drafts with it, and the output is bitwise the output without speculation (the property,
with preemption by swap and recompute, on Qwen3.5 and Qwen3.5-MoE, and in the multimodal layout)."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import budget
from hypothesis import given, settings
from safetensors import safe_open

from pocketllm import LLM, EngineArgs, SamplingParams, write_checkpoint
from pocketllm.config_fields import CheckpointError
from pocketllm.models.mtp import mtp_shapes
from pocketllm.models.registry import read_config
from pocketllm.testing import Engines, assert_batch_invariant
from pocketllm.testing.strategies import speculation_workloads

VOCAB = 256
MAX_SEQ_LEN = 160
MTP = {"method": "mtp", "num_speculative_tokens": 3}


def _tensors(path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (not a dict)


@pytest.fixture(scope="module")
def mtp_checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp")
    return {"qwen3.5": write_checkpoint(root / "dense", "qwen3.5-tiny", seed=4, mtp=True),
            "qwen3.5-moe": write_checkpoint(root / "moe", "qwen3.5-moe-tiny", seed=5, mtp=True),
            "qwen3.5-mm": write_checkpoint(root / "mm", "qwen3.5-tiny", seed=6, mtp=True, multimodal=True)}


def test_the_mtp_layer_is_written_as_published_and_the_model_is_unchanged(mtp_checkpoints, tmp_path):
    path = mtp_checkpoints["qwen3.5"]
    plain = _tensors(write_checkpoint(tmp_path / "plain", "qwen3.5-tiny", seed=4))
    written = _tensors(path)
    mtp = {name: t for name, t in written.items() if name.startswith("mtp.")}
    assert {name: tuple(t.shape) for name, t in mtp.items()} == mtp_shapes(read_config(path))
    assert {"mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight",
            "mtp.layers.0.self_attn.q_proj.weight", "mtp.layers.0.mlp.down_proj.weight",
            "mtp.layers.0.input_layernorm.weight"} <= set(mtp)
    assert all(torch.equal(written[name], t) for name, t in plain.items())  # the model's own tensors unchanged
    assert json.loads((path / "config.json").read_text())["mtp_num_hidden_layers"] == 1
    nested = json.loads((mtp_checkpoints["qwen3.5-mm"] / "config.json").read_text())
    assert nested["text_config"]["mtp_num_hidden_layers"] == 1 and "mtp.fc.weight" in _tensors(
        mtp_checkpoints["qwen3.5-mm"])


def test_transformers_loads_the_checkpoint_skipping_the_mtp_layer(mtp_checkpoints, tmp_path):
    """The model's logits are transformers' with or without the MTP tensors beside it."""
    transformers = pytest.importorskip("transformers")
    path = mtp_checkpoints["qwen3.5"]
    plain = write_checkpoint(tmp_path / "plain", "qwen3.5-tiny", seed=4)
    ids = torch.tensor([[3, 14, 15, 92, 65]])
    logits = [transformers.AutoModelForCausalLM.from_pretrained(str(p), dtype=torch.float32)(ids).logits
              for p in (path, plain)]
    assert torch.equal(logits[0], logits[1])


def test_the_mtp_layer_computes_what_transformers_blocks_compute(mtp_checkpoints):
    """The layer's logits for a prompt, against the same arithmetic from transformers' parts: the
    model's normed hidden states (last_hidden_state), Qwen3.5's (1 + w) RMSNorm, `fc` over
    [embedding, hidden], a Qwen3_5DecoderLayer holding mtp.layers.0 at positions 0.. (pair q: token
    q + 1 with hidden state q), the MTP norm, the tied lm_head. To the reference tolerance."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    from pocketllm.models.batch import ForwardBatch
    from pocketllm.runner import SequenceInput

    path = mtp_checkpoints["qwen3.5"]
    tokens = [3, 14, 15, 92, 65, 35, 89, 79, 32]
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                               attn_implementation="sdpa")
    weights = _tensors(path)
    with torch.no_grad():
        hidden = model.model(torch.tensor([tokens])).last_hidden_state[0]

        def norm(x, name):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + weights[name])

        embedded = norm(model.model.embed_tokens(torch.tensor(tokens[1:])), "mtp.pre_fc_norm_embedding.weight")
        x = torch.cat([embedded, norm(hidden[:-1], "mtp.pre_fc_norm_hidden.weight")], -1) @ weights["mtp.fc.weight"].T
        layer = hf.Qwen3_5DecoderLayer(model.config, model.config.layer_types.index("full_attention"))
        layer.load_state_dict({n[len("mtp.layers.0."):]: t for n, t in weights.items()
                               if n.startswith("mtp.layers.0.")})
        positions = torch.arange(len(tokens) - 1)[None]
        out = layer(x[None], position_embeddings=model.model.rotary_emb(x[None], positions), position_ids=positions)
        out = out[0] if isinstance(out, tuple) else out
        want = model.lm_head(norm(out[0], "mtp.norm.weight"))
    with LLM(EngineArgs(model=str(path), max_seq_len=64, speculative=MTP)) as llm:
        llm.runner.run([SequenceInput(0, 0, tokens, SamplingParams(), 0)])
        normed = llm.model.normed
        batch = ForwardBatch.build([0], [0], [tokens[1:]], False, "cpu", scored=[len(tokens) - 2])
        got, _ = llm.drafter.layer.forward(batch, llm.drafter.cache, normed[:-1])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module", params=[("qwen3.5", "swap"), ("qwen3.5", "recompute"), ("qwen3.5-moe", "swap"),
                                        ("qwen3.5-mm", "recompute")], ids="-".join)
def engines(request, mtp_checkpoints):
    variant, mode = request.param
    engines = Engines(mtp_checkpoints[variant], max_seq_len=MAX_SEQ_LEN, batched_args={"speculative": MTP},
                      preemption_mode=mode)
    yield engines
    engines.close()


@pytest.mark.slow
@settings(max_examples=budget(0.5))
@given(workload=speculation_workloads(VOCAB, max_prompt=100, max_jobs=5, max_tokens=16))
def test_mtp_speculation_equals_plain_cold_serial_bitwise(engines, workload):
    assert_batch_invariant(engines, workload)


def test_mtp_drafts_are_verified_serial_and_batched(mtp_checkpoints):
    path = str(mtp_checkpoints["qwen3.5"])
    prompts = [[7, 8, 9] * 5, [100, 3, 5]]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=1)
    with LLM(EngineArgs(model=path, max_seq_len=MAX_SEQ_LEN)) as plain:
        expected = [(r.token_ids, r.logprobs, r.top_logprobs) for r in plain.generate(prompts, params)]
    for batched in (False, True):
        with LLM(EngineArgs(model=path, max_seq_len=MAX_SEQ_LEN, speculative=MTP,
                            backend_options={"enable_batching": batched, "background_thread": False})) as llm:
            assert [(r.token_ids, r.logprobs, r.top_logprobs) for r in llm.generate(prompts, params)] == expected
            if batched:
                assert llm.scheduler.get_stats().spec_verifies > 0


def test_mtp_is_refused_where_it_cannot_run(mtp_checkpoints, checkpoint_dir):
    with pytest.raises(CheckpointError, match="has no multi-token-prediction tensors"):
        LLM(EngineArgs(model=str(checkpoint_dir("qwen3.5")), max_seq_len=64, speculative=MTP))
    with pytest.raises(CheckpointError, match="has no multi-token-prediction tensors"):
        LLM(EngineArgs(model=str(checkpoint_dir("tiny")), max_seq_len=64, speculative=MTP))
    for sizes in ({"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}):
        with pytest.raises(ValueError, match=r"'mtp' runs in one process only \(tensor_parallel_size and "
                                             r"pipeline_parallel_size 1\)"):
            LLM(EngineArgs(model=str(mtp_checkpoints["qwen3.5"]), max_seq_len=64, speculative=MTP, **sizes))
    with pytest.raises(ValueError, match="mtp=True needs a Qwen3.5 preset"):
        write_checkpoint(checkpoint_dir("tiny").parent / "no-mtp", "tiny", mtp=True)
