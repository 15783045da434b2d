"""Qwen3.5-MoE hybrid decoder (Hugging Face `Qwen3_5MoeForCausalLM`, transformers `qwen3_5_moe`,
and the text part of `Qwen3_5MoeForConditionalGeneration`).

Qwen3.5's layers (Gated DeltaNet or gated full attention, (1 + weight) norms); every layer's MLP
is the mixture of experts (`moe.SparseMoe`) with the top-k weights always renormalised and a
shared expert, a SwiGLU of width `shared_expert_intermediate_size` scaled by
sigmoid(shared_expert_gate(x)) and added to the routed experts' sum. transformers' Qwen3.5-MoE has
no dense layers: `decoder_sparse_step` and `mlp_only_layers` are not read. Experts load in the
fused or the per-expert layout (see `moe.py`).
"""

from __future__ import annotations

from typing import Any

import torch

from ..config import ConfigDefaults, ModelConfig
from . import qwen3_5
from .family import Family, Matrices
from .layers import Attention, FeedForward, Shapes, Weights
from .moe import SparseMoe, checkpoint_layout, moe_init, sparse_mlp_shapes


def expected_weights(cfg: ModelConfig) -> Shapes:
    """Checkpoint tensor names and shapes of the language model, as transformers 5 writes them."""
    return sparse_mlp_shapes(cfg, qwen3_5.expected_weights(cfg), qwen3_5.text_prefix(cfg))


class Qwen3_5MoeModel(qwen3_5.Qwen3_5Model):
    """Qwen3.5 with a mixture of experts (and its shared expert) in every layer."""

    def build_mlp(self, weights: Weights, prefix: str) -> FeedForward:
        return SparseMoe(self.cfg, weights, prefix + "mlp.", self.tp)


def matrices(cfg: ModelConfig) -> Matrices:
    return Attention.matrices(cfg, gated=True) + SparseMoe.matrices(cfg) + qwen3_5.DeltaNet.matrices(cfg)


def multimodal(raw: dict[str, Any],
               weights: dict[str, torch.Tensor]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The Qwen3_5MoeForConditionalGeneration layout: Qwen3.5's, under the MoE names."""
    config, nested = qwen3_5.multimodal(raw, weights)
    config.update(architectures=["Qwen3_5MoeForConditionalGeneration"], model_type="qwen3_5_moe")
    config["text_config"]["model_type"] = "qwen3_5_moe_text"
    config["vision_config"]["model_type"] = "qwen3_5_moe_vision"
    return config, nested


def _moe(preset: str, **fields: Any) -> dict[str, Any]:
    raw = {**qwen3_5.PRESETS[preset], "architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text",
           **fields}
    raw.pop("intermediate_size")
    return raw


PRESETS: dict[str, dict[str, Any]] = {
    # 8 experts of width 32, top 2, a shared expert of width 64: tests and the demo.
    "qwen3.5-moe-tiny": _moe("qwen3.5-tiny", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                             shared_expert_intermediate_size=64),
    # The `qwen3.5-small` preset's mixers, 16 experts of width 256, top 4, shared width 512: CPU benchmarks.
    "qwen3.5-moe-small": _moe("qwen3.5-small", num_experts=16, num_experts_per_tok=4, moe_intermediate_size=256,
                              shared_expert_intermediate_size=512),
}

FAMILY = Family("qwen3.5-moe", ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"), Qwen3_5MoeModel,
                expected_weights, qwen3_5.skip_weight, matrices, PRESETS,
                defaults=ConfigDefaults(head_dim=256, partial_rotary_factor=0.25, full_attention_interval=4, moe=True,
                                        norm_topk_prob=True, shared_expert=True, dense_mlp=False),
                gated_attention=True, recurrent_spec=qwen3_5.recurrent_spec, init_weight=moe_init(qwen3_5.init_weight),
                multimodal=multimodal, checkpoint_layout=checkpoint_layout)
