"""Qwen3 dense decoder (Hugging Face `Qwen3ForCausalLM`).

Pre-norm blocks: RMSNorm -> GQA attention with per-head q/k RMSNorm and RoPE -> residual ->
RMSNorm -> SwiGLU MLP -> residual; every block is the shared one of `layers`. At load time q/k/v
and gate/up are fused into one matrix each so a layer runs four GEMMs.
"""

from __future__ import annotations

from ..config import ModelConfig
from .layers import Attention, DecoderBlock, DecoderModel, Shapes, SwiGLU, Weights


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
        return DecoderBlock(weights, prefix, Attention(self.cfg, weights, prefix + "self_attn.", self.rope),
                            SwiGLU(weights, prefix + "mlp."), self.norm_weight)
