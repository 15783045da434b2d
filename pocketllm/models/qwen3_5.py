"""Qwen3.5 hybrid decoder (Hugging Face `Qwen3_5ForCausalLM`, and the text part of
`Qwen3_5ForConditionalGeneration`).

Layers are Gated DeltaNet ("linear_attention") or gated full attention ("full_attention"), as
`layer_types` says; every layer then has the SwiGLU MLP. Differences from Qwen3:
- RMSNorm scales by (1 + weight); the (1 + weight) is folded into the weight at load time.
- Full attention: q_proj yields per head [query, gate]; the output is multiplied by
  sigmoid(gate); RoPE rotates only the first head_dim * partial_rotary_factor dims.
- Gated DeltaNet: one fused input projection (qkv, z, b, a), a depthwise causal conv with SiLU
  over qkv, L2-normalised q/k, decay g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b),
  the gated delta rule over the slot's recurrent state, a gated RMSNorm with z, out_proj.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..cache import SlotCache, recurrent_spec
from ..config import ModelConfig
from ..kernels import Ops
from ..kernels.pointwise import elementwise_invariant
from .batch import ForwardBatch
from .layers import Attention, DecoderBlock, DecoderModel, Shapes, SwiGLU, Weights, conv1d, gated_delta, layer_state

SKIPPED_PREFIXES = ("mtp.", "model.visual.", "visual.")  # multi-token prediction and vision towers


def text_prefix(cfg: ModelConfig) -> str:
    """Where the language model's tensors live: nested under the multimodal wrapper or not."""
    return "model.language_model." if cfg.architecture == "Qwen3_5ForConditionalGeneration" else "model."


def gdn_dims(cfg: ModelConfig) -> tuple[int, int]:
    """(key_dim, value_dim): widths of all key heads and all value heads together."""
    return (cfg.linear_num_key_heads * cfg.linear_key_head_dim, cfg.linear_num_value_heads * cfg.linear_value_head_dim)


def expected_weights(cfg: ModelConfig) -> Shapes:
    """Checkpoint tensor names and shapes of the language model, as Hugging Face writes them."""
    prefix = text_prefix(cfg)
    shapes = DecoderModel.weight_shapes(cfg, prefix)
    for i, kind in enumerate(cfg.layer_types):
        p = f"{prefix}layers.{i}."
        shapes.update(DecoderBlock.weight_shapes(cfg, p))
        if kind == "full_attention":
            shapes.update(Attention.weight_shapes(cfg, p + "self_attn.", gated=True))
        else:
            shapes.update(DeltaNet.weight_shapes(cfg, p + "linear_attn."))
    return shapes


def skip_weight(name: str) -> bool:
    """Vision and MTP tensors belong to parts pocketllm does not run; they are skipped by rule."""
    return name.startswith(SKIPPED_PREFIXES) or name.endswith("rotary_emb.inv_freq")


def offset_norm(weight: torch.Tensor) -> torch.Tensor:
    """This family's RMSNorm scales by (1 + weight): fold the 1 in once, in fp32."""
    return (1.0 + weight.float()).to(weight.dtype)


class DeltaNet:
    """Gated DeltaNet mixer: state per slot (conv window, fp32 recurrent state), no K/V."""

    def __init__(self, cfg: ModelConfig, w: Weights, p: str) -> None:
        self.cfg = cfg
        self.in_proj = torch.cat([w[p + "in_proj_qkv.weight"], w[p + "in_proj_z.weight"], w[p + "in_proj_b.weight"],
                                  w[p + "in_proj_a.weight"]])
        self.conv = w[p + "conv1d.weight"].squeeze(1).contiguous()  # [conv_dim, K]
        self.dt_bias = w[p + "dt_bias"]
        self.neg_decay_rate = -w[p + "A_log"].float().exp()
        self.norm = w[p + "norm.weight"]
        self.out_proj = w[p + "out_proj.weight"]
        self.cache_spec = recurrent_spec(cfg)

    def linear_weights(self) -> tuple[torch.Tensor, ...]:
        return self.in_proj, self.out_proj

    @staticmethod
    def weight_shapes(cfg: ModelConfig, g: str) -> Shapes:
        key_dim, value_dim = gdn_dims(cfg)
        hidden, v_heads, conv_dim = cfg.hidden_size, cfg.linear_num_value_heads, 2 * key_dim + value_dim
        return {
            g + "in_proj_qkv.weight": (conv_dim, hidden),
            g + "in_proj_z.weight": (value_dim, hidden),
            g + "in_proj_b.weight": (v_heads, hidden),
            g + "in_proj_a.weight": (v_heads, hidden),
            g + "conv1d.weight": (conv_dim, 1, cfg.linear_conv_kernel_dim),
            g + "dt_bias": (v_heads,),
            g + "A_log": (v_heads,),
            g + "norm.weight": (cfg.linear_value_head_dim,),
            g + "out_proj.weight": (hidden, value_dim),
        }

    def forward(self, ops: Ops, x: torch.Tensor, batch: ForwardBatch, cache: SlotCache, layer: int) -> torch.Tensor:
        cfg, tokens = self.cfg, x.shape[0]
        key_dim, value_dim = gdn_dims(cfg)
        k_heads, v_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        qkv, z, b, a = ops.linear(x, self.in_proj).split([2 * key_dim + value_dim, value_dim, v_heads, v_heads],
                                                          dim=-1)
        qkv = conv1d(ops, qkv, self.conv, layer_state(cache.conv, layer), batch)
        q, k, v = qkv.split([key_dim, key_dim, value_dim], dim=-1)
        q = q.reshape(tokens, k_heads, cfg.linear_key_head_dim)
        k = k.reshape(tokens, k_heads, cfg.linear_key_head_dim)
        v = v.reshape(tokens, v_heads, cfg.linear_value_head_dim)
        beta = elementwise_invariant(torch.sigmoid, b.float())
        g = self.neg_decay_rate * elementwise_invariant(F.softplus, a.float() + self.dt_bias.float())
        out = gated_delta(ops, q, k, v, g, beta, layer_state(cache.recurrent, layer), batch)
        out = ops.rms_norm_gated(out, z.reshape(tokens, v_heads, cfg.linear_value_head_dim), self.norm,
                                 cfg.rms_norm_eps)
        return ops.linear(out.reshape(tokens, value_dim), self.out_proj)


class Qwen3_5Model(DecoderModel):
    """Gated DeltaNet or gated full attention per layer, as `layer_types` says; (1 + weight) norms."""

    def __init__(self, cfg: ModelConfig, weights: Weights, ops: Ops, max_seq_len: int) -> None:
        super().__init__(cfg, weights, ops, max_seq_len, prefix=text_prefix(cfg))

    def norm_weight(self, weight: torch.Tensor) -> torch.Tensor:
        return offset_norm(weight)

    def build_block(self, weights: Weights, prefix: str, kind: str) -> DecoderBlock:
        if kind == "full_attention":
            mixer: Attention | DeltaNet = Attention(self.cfg, weights, prefix + "self_attn.", self.rope,
                                                    self.norm_weight, gated=True)
        else:
            mixer = DeltaNet(self.cfg, weights, prefix + "linear_attn.")
        return DecoderBlock(weights, prefix, mixer, SwiGLU(weights, prefix + "mlp."), self.norm_weight)
