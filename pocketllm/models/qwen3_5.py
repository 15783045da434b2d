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

from typing import Any

import torch
import torch.nn.functional as F

from ..cache import RecurrentCacheSpec, SlotCache
from ..config import ConfigDefaults, ModelConfig
from ..kernels import Ops
from ..kernels.pointwise import elementwise_invariant
from ..parallel.group import SINGLE, TensorParallel
from .batch import ForwardBatch
from .family import Family, Matrices
from .layers import (
    Attention,
    DecoderBlock,
    DecoderModel,
    FeedForward,
    Shapes,
    SwiGLU,
    Weights,
    conv1d,
    gated_delta,
    layer_state,
)
from .row_parallel import RowParallel

SKIPPED_PREFIXES = ("mtp.", "model.visual.", "visual.")  # multi-token prediction and vision towers


# The multimodal wrappers (dense and MoE), whose language model's tensors are nested.
MULTIMODAL_ARCHITECTURES = ("Qwen3_5ForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration")


def text_prefix(cfg: ModelConfig) -> str:
    """Where the language model's tensors live: nested under the multimodal wrapper or not."""
    return "model.language_model." if cfg.architecture in MULTIMODAL_ARCHITECTURES else "model."


def gdn_dims(cfg: ModelConfig) -> tuple[int, int, int]:
    """(key_dim, value_dim, conv_dim): widths of all key heads, of all value heads, and of the
    conv's channels (q, k and v side by side)."""
    key_dim, value_dim = cfg.linear_num_key_heads * cfg.linear_key_head_dim, \
        cfg.linear_num_value_heads * cfg.linear_value_head_dim
    return key_dim, value_dim, 2 * key_dim + value_dim


def recurrent_spec(cfg: ModelConfig) -> RecurrentCacheSpec:
    """Conv window and recurrent state per slot of a Gated DeltaNet layer."""
    return RecurrentCacheSpec(gdn_dims(cfg)[2], cfg.linear_conv_kernel_dim, cfg.linear_num_value_heads,
                              cfg.linear_key_head_dim, cfg.linear_value_head_dim)


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

    def __init__(self, cfg: ModelConfig, w: Weights, p: str, tp: TensorParallel = SINGLE) -> None:
        self.cfg = cfg
        self.in_proj = torch.cat([w[p + "in_proj_qkv.weight"], w[p + "in_proj_z.weight"], w[p + "in_proj_b.weight"],
                                  w[p + "in_proj_a.weight"]])
        self.conv = w[p + "conv1d.weight"].squeeze(1).contiguous()  # [conv_dim, K]
        self.dt_bias = w[p + "dt_bias"]
        self.neg_decay_rate = -w[p + "A_log"].float().exp()
        self.norm = w[p + "norm.weight"]
        self.out_proj = RowParallel(w[p + "out_proj.weight"], None, tp, p + "out_proj")
        self.cache_spec = recurrent_spec(cfg)

    def linear_weights(self) -> tuple[torch.Tensor, ...]:
        return self.in_proj, *self.out_proj.weights()

    @staticmethod
    def matrices(cfg: ModelConfig) -> Matrices:
        """(name, in, out) of the matrices `linear_weights` gives: fused in_proj (qkv, z, b, a), out_proj."""
        _, value_dim, conv_dim = gdn_dims(cfg)
        hidden = cfg.hidden_size
        return [("in_proj", hidden, conv_dim + value_dim + 2 * cfg.linear_num_value_heads),
                ("out_proj", value_dim, hidden)]

    @staticmethod
    def weight_shapes(cfg: ModelConfig, g: str) -> Shapes:
        _, value_dim, conv_dim = gdn_dims(cfg)
        hidden, v_heads = cfg.hidden_size, cfg.linear_num_value_heads
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
        key_dim, value_dim, conv_dim = gdn_dims(cfg)
        k_heads, v_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        qkv, z, b, a = ops.linear(x, self.in_proj).split([conv_dim, value_dim, v_heads, v_heads], dim=-1)
        keep_conv = lambda slot, position: cache.keep_state(slot, position, layer, "conv")  # noqa: E731
        qkv = conv1d(ops, qkv, self.conv, layer_state(cache.conv, layer), batch, keep_conv)
        q, k, v = qkv.split([key_dim, key_dim, value_dim], dim=-1)
        q = q.reshape(tokens, k_heads, cfg.linear_key_head_dim)
        k = k.reshape(tokens, k_heads, cfg.linear_key_head_dim)
        v = v.reshape(tokens, v_heads, cfg.linear_value_head_dim)
        beta = elementwise_invariant(torch.sigmoid, b.float())
        g = self.neg_decay_rate * elementwise_invariant(F.softplus, a.float() + self.dt_bias.float())
        keep = lambda slot, position: cache.keep_state(slot, position, layer, "recurrent")  # noqa: E731
        out = gated_delta(ops, q, k, v, g, beta, layer_state(cache.recurrent, layer), batch, cache.replay[layer], keep)
        out = ops.rms_norm_gated(out, z.reshape(tokens, v_heads, cfg.linear_value_head_dim), self.norm,
                                 cfg.rms_norm_eps)
        return self.out_proj.forward(ops, out.reshape(tokens, value_dim))


class Qwen3_5Model(DecoderModel):
    """Gated DeltaNet or gated full attention per layer, as `layer_types` says; (1 + weight) norms."""

    def __init__(self, cfg: ModelConfig, weights: Weights, ops: Ops, max_seq_len: int,
                 tp: TensorParallel = SINGLE) -> None:
        super().__init__(cfg, weights, ops, max_seq_len, prefix=text_prefix(cfg), tp=tp)

    def norm_weight(self, weight: torch.Tensor) -> torch.Tensor:
        return offset_norm(weight)

    def build_block(self, weights: Weights, prefix: str, kind: str) -> DecoderBlock:
        if kind == "full_attention":
            mixer: Attention | DeltaNet = Attention(self.cfg, weights, prefix + "self_attn.", self.rope,
                                                    self.norm_weight, gated=True, tp=self.tp)
        else:
            mixer = DeltaNet(self.cfg, weights, prefix + "linear_attn.", self.tp)
        return DecoderBlock(weights, prefix, mixer, self.build_mlp(weights, prefix), self.norm_weight)

    def build_mlp(self, weights: Weights, prefix: str) -> FeedForward:
        """Layer `prefix`'s feed-forward half: the SwiGLU (a MoE family overrides it)."""
        return SwiGLU(weights, prefix + "mlp.", self.tp)


def matrices(cfg: ModelConfig) -> Matrices:
    return Attention.matrices(cfg, gated=True) + SwiGLU.matrices(cfg) + DeltaNet.matrices(cfg)


def init_weight(name: str, noise: torch.Tensor, generator: torch.Generator) -> torch.Tensor | None:
    """Random-checkpoint values of this family's own tensors: zero-centred norm scales ~ N(0, 0.1)
    (the gated norm's are not zero-centred), conv taps ~ N(0, 0.3), A_log = log U(1, 4) and
    dt_bias ~ N(0, 0.1), so the recurrence neither vanishes nor explodes."""
    if name.endswith("A_log"):
        return torch.log(1.0 + 3.0 * torch.rand(noise.shape, generator=generator))
    if name.endswith("dt_bias"):
        return 0.1 * noise
    if name.endswith("conv1d.weight"):
        return 0.3 * noise
    if noise.dim() == 1 and "norm" in name and not name.endswith("linear_attn.norm.weight"):
        return 0.1 * noise
    return None


# A small vision tower config, only so that the multimodal layout's config.json is complete.
_TINY_VISION = {"model_type": "qwen3_5_vision", "depth": 1, "hidden_size": 32, "intermediate_size": 64,
                "num_heads": 2, "patch_size": 2, "spatial_merge_size": 2, "temporal_patch_size": 2,
                "num_position_embeddings": 16}


def multimodal(raw: dict[str, Any],
               weights: dict[str, torch.Tensor]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The Qwen3_5ForConditionalGeneration layout: text config nested, text weights under
    model.language_model., plus a vision and an MTP tensor that a loader must skip by rule."""
    text = {**raw, "model_type": "qwen3_5_text"}
    text.pop("architectures")
    config = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "text_config": text,
              "vision_config": {**_TINY_VISION, "out_hidden_size": raw["hidden_size"]},
              "tie_word_embeddings": raw["tie_word_embeddings"], "eos_token_id": raw["eos_token_id"]}
    nested = {("model.language_model." + name[len("model."):] if name.startswith("model.") else name): tensor
              for name, tensor in weights.items()}
    nested["model.visual.merger.linear_fc2.bias"] = torch.zeros(raw["hidden_size"])
    nested["mtp.fc.weight"] = torch.zeros(raw["hidden_size"], 2 * raw["hidden_size"])
    return config, nested


_BASE: dict[str, Any] = {
    "architectures": ["Qwen3_5ForCausalLM"],
    "model_type": "qwen3_5_text",
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    "attention_bias": False,
    "attention_dropout": 0.0,
    "max_position_embeddings": 4096,
    "linear_conv_kernel_dim": 4,
    "dtype": "float32",
}

# Three Gated DeltaNet layers, then one gated full-attention layer, repeated.
PRESETS: dict[str, dict[str, Any]] = {
    "qwen3.5-tiny": {**_BASE, "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
                     "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
                     "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
                     "linear_value_head_dim": 16, "tie_word_embeddings": True, "eos_token_id": 255},
    "qwen3.5-small": {**_BASE, "vocab_size": 32000, "hidden_size": 512, "intermediate_size": 1408,
                      "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
                      "linear_num_key_heads": 4, "linear_num_value_heads": 8, "linear_key_head_dim": 64,
                      "linear_value_head_dim": 64, "tie_word_embeddings": True, "eos_token_id": 31999},
    # The exact shapes of the published checkpoint (random weights): real-size CPU benchmarks.
    "qwen3.5-0.8b": {**_BASE, "vocab_size": 248320, "hidden_size": 1024, "intermediate_size": 3584,
                     "num_hidden_layers": 24, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256,
                     "linear_num_key_heads": 16, "linear_num_value_heads": 16, "linear_key_head_dim": 128,
                     "linear_value_head_dim": 128, "tie_word_embeddings": True, "eos_token_id": 248044},
}

FAMILY = Family("qwen3.5", ("Qwen3_5ForCausalLM", "Qwen3_5ForConditionalGeneration"), Qwen3_5Model,
                expected_weights, skip_weight, matrices, PRESETS,
                defaults=ConfigDefaults(head_dim=256, partial_rotary_factor=0.25, full_attention_interval=4),
                lab_presets=("qwen3.5-tiny", "qwen3.5-0.8b"), gated_attention=True, recurrent_spec=recurrent_spec,
                init_weight=init_weight, multimodal=multimodal)
