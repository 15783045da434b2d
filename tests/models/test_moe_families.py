"""Mixtures of experts (Qwen3-MoE, Qwen3.5-MoE, Qwen3-Next): against Hugging Face transformers on the
triton backend (interpreted, slow; the torch backend's parity tests are tests/models/test_qwen3_5.py's,
run on MOE_VARIANTS too: every family, both expert layouts), a Qwen3-Next checkpoint transformers
itself writes, the loader's two expert layouts, and the config's MoE fields."""

from __future__ import annotations

import pytest
import torch
from helpers import hf_model, prompt_of

from pocketllm import LLM, EngineArgs, SamplingParams, write_checkpoint
from pocketllm.config import CheckpointError
from pocketllm.models import ForwardBatch, config_from_dict

transformers = pytest.importorskip("transformers")

ATOL = 1e-4  # the parity tolerance of tests/models/test_hf_parity.py


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["qwen3-moe", "qwen3.5-moe_mm_per_expert"])  # both families and layouts
def test_triton_backend_matches_transformers(checkpoint_dir, variant):
    """The triton backend (the grouped-GEMM moe kernel among the others; interpreted here): greedy
    tokens equal transformers', last-token logits within the tolerance."""
    path = checkpoint_dir(variant)
    _assert_matches(LLM(EngineArgs(model=str(path), backend="triton", max_seq_len=64)), hf_model(path), prompt_of(9), 6)


def _assert_matches(llm: LLM, hf, prompt: list[int], new_tokens: int) -> None:
    """The prompt's last logits within ATOL of transformers', and `new_tokens` greedy tokens equal."""
    with torch.no_grad():
        reference = hf(input_ids=torch.tensor([prompt])).logits[0, -1]
        expected = hf.generate(input_ids=torch.tensor([prompt]), max_new_tokens=new_tokens,
                               min_new_tokens=new_tokens, do_sample=False)[0, len(prompt):].tolist()
    slot = llm.slots.allocate()
    try:
        logits = llm.model.forward(ForwardBatch.build([slot], [0], [prompt], False, "cpu"), llm.cache)[0]
    finally:
        llm.slots.free(slot, [])
    torch.testing.assert_close(logits, reference, atol=ATOL, rtol=ATOL)
    result = llm.generate(prompt_tokens=prompt, sampling_params=SamplingParams(max_tokens=new_tokens, temperature=0.0,
                                                                               ignore_eos=True))
    assert result.token_ids == expected


def test_a_qwen3_next_checkpoint_transformers_writes_matches_transformers(tmp_path):
    """Qwen3NextForCausalLM saved by transformers (its own tensor layout: the grouped in_proj_qkvz and
    in_proj_ba, dense and sparse layers, three value heads per key head): greedy tokens equal
    transformers', and the prompt's last logits are within the tolerance."""
    config = transformers.Qwen3NextConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=8,
        linear_value_head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=48, decoder_sparse_step=1, mlp_only_layers=[2], eos_token_id=255)
    torch.manual_seed(0)
    hf = transformers.Qwen3NextForCausalLM(config).eval()
    with torch.no_grad():
        for name, tensor in hf.named_parameters():  # transformers' init leaves norms at 0 and A_log flat
            if tensor.dim() == 1 and "norm" in name or name.endswith(("dt_bias", "A_log")):
                tensor.normal_(0.0, 0.1)
    hf.save_pretrained(tmp_path)
    hf.generation_config.eos_token_id = None
    _assert_matches(LLM(EngineArgs(model=str(tmp_path), max_seq_len=64)), hf, prompt_of(21), 8)


# -- checkpoint layouts --------------------------------------------------------------------------------


def test_per_expert_and_fused_layouts_load_to_the_same_bits(tmp_path):
    """The same weights written fused and per expert give bitwise the same logits."""
    from safetensors.torch import load_file, save_file

    from pocketllm.models.moe import split_experts

    fused = write_checkpoint(tmp_path / "fused", "qwen3-moe-tiny", seed=3)
    split = write_checkpoint(tmp_path / "split", "qwen3-moe-tiny", seed=3)
    save_file(split_experts(load_file(str(split / "model.safetensors"))), str(split / "model.safetensors"))
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in load_file(str(split / "model.safetensors"))
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=2)
    a, b = (LLM(EngineArgs(model=str(p), max_seq_len=64)).generate(prompt_tokens=prompt_of(20), sampling_params=params)
            for p in (fused, split))
    assert (a.token_ids, a.logprobs, a.top_logprobs) == (b.token_ids, b.logprobs, b.top_logprobs)


def test_a_missing_expert_names_the_tensor(tmp_path):
    """A per-expert checkpoint without one expert's matrix is refused, naming it."""
    from safetensors.torch import load_file, save_file

    from pocketllm.models.moe import split_experts

    path = write_checkpoint(tmp_path / "ckpt", "qwen3-moe-tiny", seed=3)
    tensors = split_experts(load_file(str(path / "model.safetensors")))
    del tensors["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.2\.mlp\.experts\.5\.up_proj\.weight'"):
        LLM(EngineArgs(model=str(path), max_seq_len=64))


# -- config ---------------------------------------------------------------------------------------------


def _raw(preset: str, **fields) -> dict:
    from pocketllm.models import PRESETS

    return {**PRESETS[preset], **fields}


def test_moe_fields_are_parsed_and_sparse_layers_follow_transformers():
    cfg = config_from_dict(_raw("qwen3-moe-tiny", num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3]))
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.norm_topk_prob) == (8, 2, 32, True)
    assert [cfg.sparse_layer(i) for i in range(6)] == [False, True, False, False, False, True]
    hybrid = config_from_dict(_raw("qwen3.5-moe-tiny", decoder_sparse_step=2, mlp_only_layers=[0]))
    assert hybrid.norm_topk_prob and hybrid.shared_expert_intermediate_size == 64 and hybrid.intermediate_size == 0
    assert all(hybrid.sparse_layer(i) for i in range(hybrid.num_hidden_layers))  # no dense layers in Qwen3.5-MoE


@pytest.mark.parametrize("fields,message", [
    ({"num_experts_per_tok": 9}, "'num_experts_per_tok' must be at most num_experts=8"),
    ({"num_experts": 0}, "'num_experts' must be an integer >= 1"),
    ({"moe_intermediate_size": None}, "missing required field 'moe_intermediate_size'"),
    ({"mlp_only_layers": [3]}, r"'mlp_only_layers' must list layer indices in \[0, 3\)"),
    ({"norm_topk_prob": "yes"}, "'norm_topk_prob' must be a JSON boolean"),
])
def test_bad_moe_fields_are_refused_naming_the_field(fields, message):
    with pytest.raises(CheckpointError, match=message):
        config_from_dict(_raw("qwen3-moe-tiny", **fields))


def test_qwen3_5_moe_needs_its_shared_expert_width():
    raw = _raw("qwen3.5-moe-tiny")
    raw.pop("shared_expert_intermediate_size")
    with pytest.raises(CheckpointError, match="missing required field 'shared_expert_intermediate_size'"):
        config_from_dict(raw)


@pytest.mark.parametrize("architecture", ["Qwen2MoeForCausalLM", "Qwen3OmniMoeForCausalLM"])
def test_an_unknown_architecture_is_named_with_the_supported_ones(architecture):
    """Refused before any field is read (a MoE config of an unsupported family has no
    intermediate_size: the error must name the architecture, not that field)."""
    raw = _raw("qwen3.5-moe-tiny", architectures=[architecture])
    with pytest.raises(CheckpointError, match=rf"unknown architecture '{architecture}'; supported: .*"
                                              r"'Qwen3MoeForCausalLM'.*'Qwen3_5MoeForConditionalGeneration'"):
        config_from_dict(raw)
