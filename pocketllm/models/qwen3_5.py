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

import logging

import torch
import torch.nn.functional as F

from ..cache import AttentionCacheSpec, LayerCacheSpec, RecurrentCacheSpec, SlotCache
from ..config import ModelConfig
from ..kernels import Ops
from ..kernels.pointwise import elementwise_invariant
from ..kernels.rope import rope_table
from .batch import ForwardBatch

logger = logging.getLogger(__name__)

SKIPPED_PREFIXES = ("mtp.", "model.visual.", "visual.")  # multi-token prediction and vision towers


def text_prefix(cfg: ModelConfig) -> str:
    """Where the language model's tensors live: nested under the multimodal wrapper or not."""
    return "model.language_model." if cfg.architecture == "Qwen3_5ForConditionalGeneration" else "model."


def gdn_dims(cfg: ModelConfig) -> tuple[int, int]:
    """(key_dim, value_dim): widths of all key heads and all value heads together."""
    return (cfg.linear_num_key_heads * cfg.linear_key_head_dim, cfg.linear_num_value_heads * cfg.linear_value_head_dim)


def expected_weights(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor names and shapes of the language model, as Hugging Face writes them."""
    hidden, d, prefix = cfg.hidden_size, cfg.head_dim, text_prefix(cfg)
    key_dim, value_dim = gdn_dims(cfg)
    v_heads = cfg.linear_num_value_heads
    shapes: dict[str, tuple[int, ...]] = {prefix + "embed_tokens.weight": (cfg.vocab_size, hidden),
                                          prefix + "norm.weight": (hidden,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, hidden)
    for i, kind in enumerate(cfg.layer_types):
        p = f"{prefix}layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "mlp.gate_proj.weight": (cfg.intermediate_size, hidden),
            p + "mlp.up_proj.weight": (cfg.intermediate_size, hidden),
            p + "mlp.down_proj.weight": (hidden, cfg.intermediate_size),
        })
        if kind == "full_attention":
            a = p + "self_attn."
            shapes.update({
                a + "q_proj.weight": (2 * cfg.num_attention_heads * d, hidden),
                a + "k_proj.weight": (cfg.num_key_value_heads * d, hidden),
                a + "v_proj.weight": (cfg.num_key_value_heads * d, hidden),
                a + "o_proj.weight": (hidden, cfg.num_attention_heads * d),
                a + "q_norm.weight": (d,),
                a + "k_norm.weight": (d,),
            })
        else:
            g = p + "linear_attn."
            shapes.update({
                g + "in_proj_qkv.weight": (2 * key_dim + value_dim, hidden),
                g + "in_proj_z.weight": (value_dim, hidden),
                g + "in_proj_b.weight": (v_heads, hidden),
                g + "in_proj_a.weight": (v_heads, hidden),
                g + "conv1d.weight": (2 * key_dim + value_dim, 1, cfg.linear_conv_kernel_dim),
                g + "dt_bias": (v_heads,),
                g + "A_log": (v_heads,),
                g + "norm.weight": (cfg.linear_value_head_dim,),
                g + "out_proj.weight": (hidden, value_dim),
            })
    return shapes


def skip_weight(name: str) -> bool:
    """Vision and MTP tensors belong to parts pocketllm does not run; they are skipped by rule."""
    return name.startswith(SKIPPED_PREFIXES) or name.endswith("rotary_emb.inv_freq")


def _offset_norm(weight: torch.Tensor) -> torch.Tensor:
    """This family's RMSNorm scales by (1 + weight): fold the 1 in once, in fp32."""
    return (1.0 + weight.float()).to(weight.dtype)


class AttentionLayer:
    def __init__(self, w: dict[str, torch.Tensor], p: str) -> None:
        self.qkv = torch.cat([w[p + "q_proj.weight"], w[p + "k_proj.weight"], w[p + "v_proj.weight"]])
        self.o_proj = w[p + "o_proj.weight"]
        self.q_norm = _offset_norm(w[p + "q_norm.weight"])
        self.k_norm = _offset_norm(w[p + "k_norm.weight"])


class DeltaNetLayer:
    def __init__(self, w: dict[str, torch.Tensor], p: str) -> None:
        self.in_proj = torch.cat([w[p + "in_proj_qkv.weight"], w[p + "in_proj_z.weight"], w[p + "in_proj_b.weight"],
                                  w[p + "in_proj_a.weight"]])
        self.conv = w[p + "conv1d.weight"].squeeze(1).contiguous()  # [conv_dim, K]
        self.dt_bias = w[p + "dt_bias"]
        self.neg_decay_rate = -w[p + "A_log"].float().exp()
        self.norm = w[p + "norm.weight"]
        self.out_proj = w[p + "out_proj.weight"]


class Block:
    def __init__(self, w: dict[str, torch.Tensor], p: str, kind: str) -> None:
        self.kind = kind
        self.input_norm = _offset_norm(w[p + "input_layernorm.weight"])
        self.post_attention_norm = _offset_norm(w[p + "post_attention_layernorm.weight"])
        self.gate_up = torch.cat([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]])
        self.down = w[p + "mlp.down_proj.weight"]
        self.mixer = AttentionLayer(w, p + "self_attn.") if kind == "full_attention" else DeltaNetLayer(w, p + "linear_attn.")


class Qwen3_5Model:
    """Runs a ForwardBatch through the hybrid decoder; returns the logits of each sequence's last token."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], ops: Ops, max_seq_len: int) -> None:
        self.cfg = cfg
        self.ops = ops
        prefix = text_prefix(cfg)
        self.embed = weights[prefix + "embed_tokens.weight"]
        self.final_norm = _offset_norm(weights[prefix + "norm.weight"])
        self.lm_head = self.embed if cfg.tie_word_embeddings else weights["lm_head.weight"]
        self.blocks = [Block(weights, f"{prefix}layers.{i}.", kind) for i, kind in enumerate(cfg.layer_types)]
        self.cos, self.sin = rope_table(cfg.rotary_dim, max_seq_len, cfg.rope_theta, device=self.embed.device)
        self.scale = cfg.head_dim ** -0.5

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    def linear_weights(self) -> list[torch.Tensor]:
        """Every matrix the model multiplies through `ops.linear`, lm_head last."""
        mixers = [(b.mixer.qkv, b.mixer.o_proj) if b.kind == "full_attention" else (b.mixer.in_proj, b.mixer.out_proj)
                  for b in self.blocks]
        return [w for b, m in zip(self.blocks, mixers) for w in (*m, b.gate_up, b.down)] + [self.lm_head]

    def cache_specs(self) -> list[LayerCacheSpec]:
        """K/V for attention layers; conv and recurrent state for Gated DeltaNet layers."""
        cfg = self.cfg
        key_dim, value_dim = gdn_dims(cfg)
        attention = AttentionCacheSpec(cfg.num_key_value_heads, cfg.head_dim)
        recurrent = RecurrentCacheSpec(2 * key_dim + value_dim, cfg.linear_conv_kernel_dim, cfg.linear_num_value_heads,
                                       cfg.linear_key_head_dim, cfg.linear_value_head_dim)
        return [attention if kind == "full_attention" else recurrent for kind in cfg.layer_types]

    def forward(self, batch: ForwardBatch, cache: SlotCache) -> torch.Tensor:
        """-> fp32 logits [B, vocab]."""
        ops, eps = self.ops, self.cfg.rms_norm_eps
        hidden = ops.embedding(batch.input_ids, self.embed)
        for index, block in enumerate(self.blocks):
            normed = ops.rms_norm(hidden, block.input_norm, eps)
            if block.kind == "full_attention":
                mixed = self._attention(block.mixer, normed, batch, cache.k[index], cache.v[index])
            else:
                mixed = self._delta_net(block.mixer, normed, batch, cache.conv[index], cache.recurrent[index])
            hidden = hidden + mixed
            normed = ops.rms_norm(hidden, block.post_attention_norm, eps)
            hidden = hidden + ops.linear(ops.silu_and_mul(ops.linear(normed, block.gate_up)), block.down)
        last = hidden.index_select(0, batch.last_token_indices)
        return ops.linear(ops.rms_norm(last, self.final_norm, eps), self.lm_head).float()

    def _attention(self, layer: AttentionLayer, x: torch.Tensor, batch: ForwardBatch, k_cache: torch.Tensor,
                   v_cache: torch.Tensor) -> torch.Tensor:
        ops, cfg = self.ops, self.cfg
        tokens, d = x.shape[0], cfg.head_dim
        heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        query_gate, k, v = ops.linear(x, layer.qkv).split([2 * heads * d, kv_heads * d, kv_heads * d], dim=-1)
        query_gate = query_gate.reshape(tokens, heads, 2 * d)
        q = ops.rms_norm(query_gate[..., :d], layer.q_norm, cfg.rms_norm_eps)
        gate = query_gate[..., d:].reshape(tokens, heads * d)
        k = ops.rms_norm(k.reshape(tokens, kv_heads, d), layer.k_norm, cfg.rms_norm_eps)
        q = ops.rope_write_kv(q, k, v.reshape(tokens, kv_heads, d), batch.positions, self.cos, self.sin,
                              k_cache, v_cache, batch.token_slots)
        if batch.is_decode:
            out = ops.decode_attention(q, k_cache, v_cache, batch.slot_ids, batch.start_positions + 1, self.scale)
        else:
            out = ops.prefill_attention(q, k_cache, v_cache, batch.slot_ids, batch.start_positions,
                                        batch.cu_seqlens, self.scale)
        return ops.linear(out.reshape(tokens, heads * d) * elementwise_invariant(torch.sigmoid, gate), layer.o_proj)

    def _delta_net(self, layer: DeltaNetLayer, x: torch.Tensor, batch: ForwardBatch, conv_state: torch.Tensor,
                   recurrent_state: torch.Tensor) -> torch.Tensor:
        ops, cfg = self.ops, self.cfg
        tokens = x.shape[0]
        key_dim, value_dim = gdn_dims(cfg)
        k_heads, v_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        qkv, z, b, a = ops.linear(x, layer.in_proj).split([2 * key_dim + value_dim, value_dim, v_heads, v_heads],
                                                           dim=-1)
        if batch.is_decode:
            qkv = ops.conv1d_decode(qkv, layer.conv, conv_state, batch.slot_ids)
        else:
            qkv = ops.conv1d_prefill(qkv, layer.conv, conv_state, batch.slot_ids, batch.cu_seqlens)
        q, k, v = qkv.split([key_dim, key_dim, value_dim], dim=-1)
        q = q.reshape(tokens, k_heads, cfg.linear_key_head_dim)
        k = k.reshape(tokens, k_heads, cfg.linear_key_head_dim)
        v = v.reshape(tokens, v_heads, cfg.linear_value_head_dim)
        beta = elementwise_invariant(torch.sigmoid, b.float())
        g = layer.neg_decay_rate * elementwise_invariant(F.softplus, a.float() + layer.dt_bias.float())
        if batch.is_decode:
            out = ops.gated_delta_decode(q, k, v, g, beta, recurrent_state, batch.slot_ids)
        else:
            out = ops.gated_delta_prefill(q, k, v, g, beta, recurrent_state, batch.slot_ids, batch.start_positions,
                                          batch.cu_seqlens)
        out = ops.rms_norm_gated(out, z.reshape(tokens, v_heads, cfg.linear_value_head_dim), layer.norm,
                                 cfg.rms_norm_eps)
        return ops.linear(out.reshape(tokens, value_dim), layer.out_proj)
