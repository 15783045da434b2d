"""Qwen3 dense decoder (Hugging Face `Qwen3ForCausalLM`).

Pre-norm blocks: RMSNorm -> GQA attention with per-head q/k RMSNorm and RoPE -> residual ->
RMSNorm -> SwiGLU MLP -> residual; every block is the shared one of `layers`. At load time q/k/v
and gate/up are fused into one matrix each so a layer runs four GEMMs.
"""

from __future__ import annotations

from typing import Any

from ..config import ModelConfig
from .family import Family, Matrices
from .layers import Attention, DecoderBlock, DecoderModel, FeedForward, Shapes, SwiGLU, Weights


def expected_weights(cfg: ModelConfig) -> Shapes:
    """Checkpoint tensor names and shapes, as Hugging Face writes them."""
    shapes = DecoderModel.weight_shapes(cfg)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update(DecoderBlock.weight_shapes(cfg, p))
        shapes.update(Attention.weight_shapes(cfg, p + "self_attn."))
    return shapes


def skip_weight(name: str) -> bool:
    """Tensors some checkpoints carry that the model recomputes (rotary inverse frequencies)."""
    return name.endswith("rotary_emb.inv_freq")


class Qwen3Model(DecoderModel):
    """Every layer is full attention + SwiGLU."""

    def build_block(self, weights: Weights, prefix: str, kind: str) -> DecoderBlock:
        return DecoderBlock(weights, prefix, Attention(self.cfg, weights, prefix + "self_attn.", self.rope,
                                                       tp=self.tp),
                            self.build_mlp(weights, prefix), self.norm_weight)

    def build_mlp(self, weights: Weights, prefix: str) -> FeedForward:
        """Layer `prefix`'s feed-forward half: the SwiGLU (a MoE family overrides it)."""
        return SwiGLU(weights, prefix + "mlp.", self.tp)


def matrices(cfg: ModelConfig) -> Matrices:
    return Attention.matrices(cfg) + SwiGLU.matrices(cfg)


_BASE: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "use_sliding_window": False,
    "max_position_embeddings": 4096,
    "dtype": "float32",
}

PRESETS: dict[str, dict[str, Any]] = {
    # A few hundred thousand parameters: tests and the demo.
    "tiny": {**_BASE, "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
             "tie_word_embeddings": True, "eos_token_id": 255},
    # About 40M parameters: CPU benchmarks.
    "small": {**_BASE, "vocab_size": 32000, "hidden_size": 512, "intermediate_size": 1408,
              "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64,
              "tie_word_embeddings": True, "eos_token_id": 31999},
    # The exact shapes of the published checkpoint (random weights): real-size CPU benchmarks.
    "qwen3-0.6b": {**_BASE, "vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072,
                   "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
                   "tie_word_embeddings": True, "eos_token_id": 151645},
}

FAMILY = Family("qwen3", ("Qwen3ForCausalLM",), Qwen3Model, expected_weights, skip_weight, matrices, PRESETS,
                lab_presets=("tiny", "qwen3-0.6b"))
