"""Qwen3 dense decoder (Hugging Face `Qwen3ForCausalLM`).

Pre-norm blocks: RMSNorm -> GQA attention with per-head q/k RMSNorm and RoPE -> residual ->
RMSNorm -> SwiGLU MLP -> residual. At load time q/k/v and gate/up are fused into one matrix each
so a layer runs four GEMMs.
"""

from __future__ import annotations

import torch

from ..cache import AttentionCacheSpec, SlotCache
from ..config import ModelConfig
from ..kernels import Ops
from ..kernels.rope import rope_table
from .batch import ForwardBatch


def expected_weights(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor names and shapes, as Hugging Face writes them."""
    hidden, head_dim = cfg.hidden_size, cfg.head_dim
    q_out, kv_out = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (cfg.vocab_size, hidden),
        "model.norm.weight": (hidden,),
    }
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, hidden)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (q_out, hidden),
            p + "self_attn.k_proj.weight": (kv_out, hidden),
            p + "self_attn.v_proj.weight": (kv_out, hidden),
            p + "self_attn.o_proj.weight": (hidden, q_out),
            p + "self_attn.q_norm.weight": (head_dim,),
            p + "self_attn.k_norm.weight": (head_dim,),
            p + "mlp.gate_proj.weight": (cfg.intermediate_size, hidden),
            p + "mlp.up_proj.weight": (cfg.intermediate_size, hidden),
            p + "mlp.down_proj.weight": (hidden, cfg.intermediate_size),
        })
        if cfg.attention_bias:
            shapes.update({
                p + "self_attn.q_proj.bias": (q_out,),
                p + "self_attn.k_proj.bias": (kv_out,),
                p + "self_attn.v_proj.bias": (kv_out,),
                p + "self_attn.o_proj.bias": (hidden,),
            })
    return shapes


def skip_weight(name: str) -> bool:
    """Tensors some checkpoints carry that the model recomputes (rotary inverse frequencies)."""
    return name.endswith("rotary_emb.inv_freq")


class Qwen3Layer:
    """One decoder block's weights, q/k/v and gate/up fused."""

    def __init__(self, w: dict[str, torch.Tensor], prefix: str, attention_bias: bool) -> None:
        attn, mlp = prefix + "self_attn.", prefix + "mlp."
        self.input_norm = w[prefix + "input_layernorm.weight"]
        self.post_attention_norm = w[prefix + "post_attention_layernorm.weight"]
        self.qkv = torch.cat([w[attn + "q_proj.weight"], w[attn + "k_proj.weight"], w[attn + "v_proj.weight"]])
        self.qkv_bias = (
            torch.cat([w[attn + "q_proj.bias"], w[attn + "k_proj.bias"], w[attn + "v_proj.bias"]])
            if attention_bias else None
        )
        self.o_proj = w[attn + "o_proj.weight"]
        self.o_proj_bias = w[attn + "o_proj.bias"] if attention_bias else None
        self.q_norm = w[attn + "q_norm.weight"]
        self.k_norm = w[attn + "k_norm.weight"]
        self.gate_up = torch.cat([w[mlp + "gate_proj.weight"], w[mlp + "up_proj.weight"]])
        self.down = w[mlp + "down_proj.weight"]


class Qwen3Model:
    """Runs a ForwardBatch through the decoder and returns the logits of each sequence's last token."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], ops: Ops, max_seq_len: int) -> None:
        self.cfg = cfg
        self.ops = ops
        self.embed = weights["model.embed_tokens.weight"]
        self.final_norm = weights["model.norm.weight"]
        self.lm_head = self.embed if cfg.tie_word_embeddings else weights["lm_head.weight"]
        self.layers = [Qwen3Layer(weights, f"model.layers.{i}.", cfg.attention_bias)
                       for i in range(cfg.num_hidden_layers)]
        self.cos, self.sin = rope_table(cfg.head_dim, max_seq_len, cfg.rope_theta, device=self.embed.device)
        self.scale = cfg.head_dim ** -0.5

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    def linear_weights(self) -> list[torch.Tensor]:
        """Every matrix the model multiplies through `ops.linear`, lm_head last."""
        return [w for layer in self.layers for w in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)] + [
            self.lm_head]

    def cache_specs(self) -> list[AttentionCacheSpec]:
        """What each layer keeps per slot: K/V for every layer."""
        return [AttentionCacheSpec(self.cfg.num_key_value_heads, self.cfg.head_dim)] * self.cfg.num_hidden_layers

    def forward(self, batch: ForwardBatch, cache: SlotCache) -> torch.Tensor:
        """-> fp32 logits [B, vocab]."""
        ops, cfg = self.ops, self.cfg
        hidden = ops.embedding(batch.input_ids, self.embed)
        for index, layer in enumerate(self.layers):
            normed = ops.rms_norm(hidden, layer.input_norm, cfg.rms_norm_eps)
            hidden = hidden + self._attention(layer, normed, batch, cache.k[index], cache.v[index])
            normed = ops.rms_norm(hidden, layer.post_attention_norm, cfg.rms_norm_eps)
            hidden = hidden + ops.linear(ops.silu_and_mul(ops.linear(normed, layer.gate_up)), layer.down)
        last = hidden.index_select(0, batch.last_token_indices)
        return ops.linear(ops.rms_norm(last, self.final_norm, cfg.rms_norm_eps), self.lm_head).float()

    def _attention(self, layer: Qwen3Layer, x: torch.Tensor, batch: ForwardBatch,
                   k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        ops, cfg = self.ops, self.cfg
        tokens, d = x.shape[0], cfg.head_dim
        heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        qkv = ops.linear(x, layer.qkv, layer.qkv_bias)
        q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
        q = ops.rms_norm(q.reshape(tokens, heads, d), layer.q_norm, cfg.rms_norm_eps)
        k = ops.rms_norm(k.reshape(tokens, kv_heads, d), layer.k_norm, cfg.rms_norm_eps)
        q = ops.rope_write_kv(q, k, v.reshape(tokens, kv_heads, d), batch.positions, self.cos, self.sin,
                              k_cache, v_cache, batch.token_slots)
        if batch.is_decode:
            out = ops.decode_attention(q, k_cache, v_cache, batch.slot_ids, batch.start_positions + 1, self.scale)
        else:
            out = ops.prefill_attention(q, k_cache, v_cache, batch.slot_ids, batch.start_positions,
                                        batch.cu_seqlens, self.scale)
        return ops.linear(out.reshape(tokens, heads * d), layer.o_proj, layer.o_proj_bias)
