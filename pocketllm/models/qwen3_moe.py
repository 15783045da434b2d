"""Qwen3-MoE decoder (Hugging Face `Qwen3MoeForCausalLM`, transformers `qwen3_moe`).

Qwen3's attention blocks; each layer's MLP is the mixture of experts (`moe.SparseMoe`: a softmax
router over `num_experts`, the top `num_experts_per_tok`, renormalised when `norm_topk_prob`), except
the layers in `mlp_only_layers` and those off the `decoder_sparse_step` grid, which keep the dense
SwiGLU of width `intermediate_size`. No shared expert. Experts load in the fused or the per-expert
layout (see `moe.py`). transformers' Qwen3MoeConfig declares no head_dim: a config.json without one
has heads of hidden_size // num_attention_heads, as transformers' attention computes them.
"""

from __future__ import annotations

from typing import Any

from ..config import ConfigDefaults, ModelConfig
from . import qwen3
from .family import Family, Matrices, default_init
from .layers import Attention, FeedForward, Shapes, Weights
from .moe import checkpoint_layout, layer_mlp, mlp_matrices, moe_init, sparse_mlp_shapes


def expected_weights(cfg: ModelConfig) -> Shapes:
    """Checkpoint tensor names and shapes, as transformers 5 writes them (fused experts)."""
    return sparse_mlp_shapes(cfg, qwen3.expected_weights(cfg), "model.")


class Qwen3MoeModel(qwen3.Qwen3Model):
    """Qwen3 with a mixture of experts in every sparse layer."""

    def build_mlp(self, weights: Weights, prefix: str) -> FeedForward:
        return layer_mlp(self.cfg, weights, prefix, self.tp)


def matrices(cfg: ModelConfig) -> Matrices:
    return Attention.matrices(cfg) + mlp_matrices(cfg)


_BASE: dict[str, Any] = {**qwen3.PRESETS["tiny"], "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                         "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []}

PRESETS: dict[str, dict[str, Any]] = {
    # 8 experts, top 2; layer 1 dense (mlp_only_layers): tests and the demo.
    "qwen3-moe-tiny": {**_BASE, "num_hidden_layers": 3, "num_experts": 8, "num_experts_per_tok": 2,
                       "moe_intermediate_size": 32, "mlp_only_layers": [1]},
    # The `small` preset's attention, 16 experts of width 256, top 4: CPU benchmarks.
    "qwen3-moe-small": {**qwen3.PRESETS["small"], "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                        "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
                        "num_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 256},
    # Qwen3-30B-A3B's widths (hidden 2048, 128 experts of width 768, top 8, 32 query and 4 K/V heads)
    # in 2 of its 48 layers: the real-shape benchmark's MoE, at a size two engines hold in memory.
    "qwen3-30b-a3b-2l": {**qwen3.PRESETS["qwen3-0.6b"], "architectures": ["Qwen3MoeForCausalLM"],
                         "model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
                         "num_hidden_layers": 2, "num_attention_heads": 32, "num_key_value_heads": 4,
                         "tie_word_embeddings": False, "norm_topk_prob": True, "decoder_sparse_step": 1,
                         "mlp_only_layers": [], "num_experts": 128, "num_experts_per_tok": 8,
                         "moe_intermediate_size": 768},
}

FAMILY = Family("qwen3-moe", ("Qwen3MoeForCausalLM",), Qwen3MoeModel, expected_weights, qwen3.skip_weight, matrices,
                PRESETS, defaults=ConfigDefaults(head_dim=None, moe=True), init_weight=moe_init(default_init),
                checkpoint_layout=checkpoint_layout)
