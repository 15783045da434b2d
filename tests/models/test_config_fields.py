"""config.json as transformers writes it, in the field names of either major version.

Each family's config written by the installed transformers' own config class (weights from the
transformers model built on it) loads with transformers' greedy tokens and logits; the names that
transformers 4.x wrote for the same fields parse to the same ModelConfig; two names of one field
that disagree, and a field under none of its names, are refused naming the names."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import hf_model, prompt_of

from pocketllm import LLM, EngineArgs, SamplingParams
from pocketllm.config import CheckpointError
from pocketllm.models import ForwardBatch, config_from_dict

transformers = pytest.importorskip("transformers")

ATOL = 1e-4  # the parity tolerance of tests/models/test_hf_parity.py
NEW_TOKENS = 8

# Tiny sizes; rope_theta, partial_rotary_factor and rms_norm_eps off their defaults, so that a field
# read from the wrong place shows; initializer_range 0.1 so that greedy tokens are not near ties.
ATTENTION = dict(vocab_size=256, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=512, rms_norm_eps=1e-5, eos_token_id=255, rope_theta=1e6,
                 initializer_range=0.1)
EXPERTS = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
HYBRID = dict(num_hidden_layers=3, head_dim=32, partial_rotary_factor=0.5, linear_num_key_heads=2,
              linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
              layer_types=["linear_attention", "full_attention", "linear_attention"])
VISION = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "patch_size": 2,
          "spatial_merge_size": 2, "temporal_patch_size": 2, "num_position_embeddings": 16, "out_hidden_size": 64}

# Architecture -> its config, built by the installed transformers' config class.
CONFIGS = {
    "Qwen3ForCausalLM": lambda: transformers.Qwen3Config(
        **ATTENTION, intermediate_size=128, num_hidden_layers=2, head_dim=32, tie_word_embeddings=True,
        attention_bias=True),
    # Qwen3MoeConfig declares no head_dim: the heads are hidden_size / num_attention_heads wide.
    "Qwen3MoeForCausalLM": lambda: transformers.Qwen3MoeConfig(
        **ATTENTION, **EXPERTS, intermediate_size=128, num_hidden_layers=3, mlp_only_layers=[1]),
    "Qwen3_5ForCausalLM": lambda: transformers.Qwen3_5TextConfig(
        **ATTENTION, **HYBRID, intermediate_size=128, tie_word_embeddings=True),
    "Qwen3_5ForConditionalGeneration": lambda: transformers.Qwen3_5Config(
        text_config={**ATTENTION, **HYBRID, "intermediate_size": 128}, vision_config=VISION),
    # Qwen3_5MoeTextConfig declares no norm_topk_prob: its router renormalises whatever this says.
    "Qwen3_5MoeForCausalLM": lambda: transformers.Qwen3_5MoeTextConfig(
        **ATTENTION, **HYBRID, **{**EXPERTS, "norm_topk_prob": False}, shared_expert_intermediate_size=64),
    "Qwen3_5MoeForConditionalGeneration": lambda: transformers.Qwen3_5MoeConfig(
        text_config={**ATTENTION, **HYBRID, **EXPERTS, "shared_expert_intermediate_size": 64}, vision_config=VISION,
        tie_word_embeddings=True),
}

# Where transformers 4.x wrote what 5.x writes under another name ("a.b": key b of the object a).
# Recorded by `save_pretrained` of Qwen3Config and Qwen3MoeConfig under transformers 4.57.1 (4.55.4
# wrote the same but `torch_dtype` for `dtype`, a field pocketllm does not read). 4.57 has no Qwen3.5
# classes; its hybrid predecessor Qwen3NextConfig wrote partial_rotary_factor at the top level.
NAMES_4X = {"num_local_experts": "num_experts", "rope_parameters.rope_theta": "rope_theta",
            "rope_parameters.partial_rotary_factor": "partial_rotary_factor", "rope_parameters": "rope_scaling"}

# `Qwen3MoeConfig(**ATTENTION, **EXPERTS, intermediate_size=128, num_hidden_layers=3, mlp_only_layers=[1])`
# with architectures set, as transformers 4.57.1's save_pretrained wrote it.
QWEN3_MOE_4_57_1 = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "decoder_sparse_step": 1, "eos_token_id": 255, "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.1,
    "intermediate_size": 128, "max_position_embeddings": 512, "mlp_only_layers": [1], "model_type": "qwen3_moe",
    "moe_intermediate_size": 32, "norm_topk_prob": True, "num_attention_heads": 4, "num_experts": 8,
    "num_experts_per_tok": 2, "num_hidden_layers": 3, "num_key_value_heads": 2, "output_router_logits": False,
    "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
    "sliding_window": None, "tie_word_embeddings": False, "transformers_version": "4.57.1", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 256}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """Factory: architecture -> a directory that transformers' save_pretrained wrote its model to
    (config.json, generation_config.json, model.safetensors; weights from seed 0)."""
    paths = {}

    def write(architecture: str):
        if architecture not in paths:
            torch.manual_seed(0)
            model = getattr(transformers, architecture)(CONFIGS[architecture]())
            paths[architecture] = tmp_path_factory.mktemp(architecture)
            model.save_pretrained(paths[architecture])
        return paths[architecture]

    return write


def _config_json(path) -> dict:
    return json.loads((path / "config.json").read_text())


@torch.no_grad()
def _prefill_logits(llm: LLM, prompt: list[int]) -> torch.Tensor:
    slot = llm.slots.allocate()
    try:
        return llm.model.forward(ForwardBatch.build([slot], [0], [prompt], False, "cpu"), llm.cache)[0]
    finally:
        llm.slots.free(slot, [])


@pytest.mark.parametrize("architecture", sorted(CONFIGS))
def test_a_checkpoint_transformers_wrote_loads_with_parity(written, architecture, single_torch_thread):
    """Prefill logits within the tolerance, greedy tokens equal to generate(), and the logprob of
    each greedy token the log-softmax of transformers' logits there."""
    path = written(architecture)
    hf = hf_model(path)
    llm = LLM(EngineArgs(model=str(path), max_seq_len=64))
    prompt = prompt_of(9)
    with torch.no_grad():
        expected = hf.generate(input_ids=torch.tensor([prompt]), max_new_tokens=NEW_TOKENS,
                               min_new_tokens=NEW_TOKENS, do_sample=False)[0, len(prompt):].tolist()
        reference = hf(input_ids=torch.tensor([prompt + expected])).logits[0, len(prompt) - 1:-1]
    torch.testing.assert_close(_prefill_logits(llm, prompt), reference[0], atol=ATOL, rtol=ATOL)
    result = llm.generate(prompt_tokens=prompt, sampling_params=SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0,
                                                                               ignore_eos=True))
    assert result.token_ids == expected
    logprobs = torch.log_softmax(reference.double(), dim=-1)
    assert result.logprobs == pytest.approx([float(logprobs[i, t]) for i, t in enumerate(expected)], abs=ATOL)


def _as_4x(config: dict) -> dict:
    """A config.json that transformers 5 wrote, in NAMES_4X's 4.x names (text_config's too)."""
    old = {NAMES_4X.get(key, key): value for key, value in config.items() if key != "rope_parameters"}
    if "rope_parameters" in config:
        rope = dict(config["rope_parameters"])
        for name in ("rope_theta", "partial_rotary_factor"):
            if name in rope:
                old[NAMES_4X[f"rope_parameters.{name}"]] = rope.pop(name)
        old[NAMES_4X["rope_parameters"]] = None if rope == {"rope_type": "default"} else rope  # 4.x: null
    if "text_config" in old:
        old["text_config"] = _as_4x(old["text_config"])
    return old


@pytest.mark.parametrize("architecture", sorted(CONFIGS))
def test_the_4x_field_names_parse_like_the_5x_ones(written, architecture):
    config = _config_json(written(architecture))
    old = _as_4x(config)
    text = old.get("text_config", old)
    assert "rope_theta" in text and "rope_parameters" not in text and "num_local_experts" not in text
    assert config_from_dict(old) == config_from_dict(config)


def test_what_transformers_4_57_wrote_parses_like_what_the_installed_one_writes(written):
    """The recorded 4.57.1 config.json against the same config saved here: the same ModelConfig, and
    renamed by NAMES_4X, the installed version's file has the 4.57.1 file's field names (less the
    null token ids and the dtype that the model's save adds)."""
    config = _config_json(written("Qwen3MoeForCausalLM"))
    assert config_from_dict(QWEN3_MOE_4_57_1) == config_from_dict(config)
    added = set(_as_4x(config)) - set(QWEN3_MOE_4_57_1)
    assert added <= {"bos_token_id", "pad_token_id", "dtype"}
    assert set(QWEN3_MOE_4_57_1) <= set(_as_4x(config))


def _moe(**fields) -> dict:
    from pocketllm.models import PRESETS

    raw = {**PRESETS["qwen3-moe-tiny"], **fields}
    return {key: value for key, value in raw.items() if value is not ...}


@pytest.mark.parametrize("fields,message", [
    ({"num_local_experts": 6}, r"'num_experts'=8 and 'num_local_experts'=6 disagree"),
    ({"rope_theta": 1e6, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}},
     r"'rope_parameters\.rope_theta'=10000\.0 and 'rope_theta'=1000000\.0 disagree"),
    ({"rope_parameters": {"rope_type": "default"}, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
     r"'rope_parameters'=.* and 'rope_scaling'=.* disagree"),
    ({"partial_rotary_factor": 0.5, "rope_parameters": {"partial_rotary_factor": 0.25}},
     r"'rope_parameters\.partial_rotary_factor'=0\.25 and 'partial_rotary_factor'=0\.5 disagree"),
    ({"num_experts": ...}, r"missing required field 'num_experts' \(accepted names: 'num_experts', "
                           r"'num_local_experts'\)"),
    ({"num_experts": ..., "num_local_experts": 0}, r"field 'num_local_experts' must be an integer >= 1"),
])
def test_two_names_that_disagree_or_none_are_refused_naming_them(fields, message):
    with pytest.raises(CheckpointError, match=message):
        config_from_dict(_moe(**fields))


def test_two_names_that_agree_are_read_once():
    cfg = config_from_dict(_moe(num_local_experts=8, rope_theta=5e5,
                                     rope_parameters={"rope_type": "default", "rope_theta": 5e5}))
    assert (cfg.num_experts, cfg.rope_theta) == (8, 5e5)
    assert config_from_dict(_moe(num_experts=..., num_local_experts=8)) == config_from_dict(_moe())


def test_a_qwen3_moe_config_without_head_dim_has_heads_of_hidden_size_over_heads():
    """As transformers' Qwen3-MoE attention computes them (its config class declares no head_dim)."""
    assert config_from_dict(_moe(head_dim=...)).head_dim == 64 // 4


def test_qwen3_5_moe_renormalises_the_top_k_whatever_norm_topk_prob_says():
    """As transformers' Qwen3.5-MoE router does (its config class declares no norm_topk_prob)."""
    from pocketllm.models import PRESETS

    assert config_from_dict({**PRESETS["qwen3.5-moe-tiny"], "norm_topk_prob": False}).norm_topk_prob
