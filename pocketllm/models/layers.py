"""Blocks every Qwen-family decoder is built from, so an architecture file holds only what is its own.

- `DecoderModel`: embedding -> blocks -> final RMSNorm -> lm_head; the RoPE table; the cache
  layout gathered from the blocks' mixers. A subclass says how one layer is built.
- `DecoderBlock`: pre-norm residual block, `x + mixer(norm(x))` then `x + mlp(norm(x))`.
- `Attention`: GQA full attention over the slot cache (fused qkv, per-head q/k RMSNorm, RoPE and
  the K/V write in one op, prefill or decode attention, o_proj), with an optional output gate.
- `SwiGLU`: the gated MLP, gate and up fused into one matrix.
- `attention`, `conv1d`, `gated_delta`, `body_ops`: the one place an op is picked by the kind of
  row (decode or prefill); a mixed batch runs each kind's rows through its own op.

Each block also lists the checkpoint tensors it reads (`weight_shapes`), beside the code that reads
them. The ops run in a fixed order the invariance tests rely on; a refactor here must keep it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from ..cache import LayerCacheSpec, SlotCache, attention_spec
from ..config import ModelConfig
from ..kernels import Ops
from ..kernels.pointwise import elementwise_invariant
from ..kernels.rope import rope_table
from ..parallel.group import SINGLE, TensorParallel
from ..parallel.tree import tree_sum
from .batch import DecodeRows, ForwardBatch, PrefillRows
from .rounds import Keep, conv1d_keeping, gated_delta_keeping
from .row_parallel import RowParallel

Weights = dict[str, torch.Tensor]
Shapes = dict[str, tuple[int, ...]]
NormWeight = Callable[[torch.Tensor], torch.Tensor]  # how a checkpoint's RMSNorm weight is prepared


def as_is(weight: torch.Tensor) -> torch.Tensor:
    """RMSNorm weights used as the checkpoint stores them."""
    return weight


def layer_state(states: list[torch.Tensor | None], layer: int) -> torch.Tensor:
    """One layer's slot tensor (`cache.k`, `cache.conv`, ...); None there means the cache was
    built from another model's layer specs."""
    state = states[layer]
    if state is None:
        raise ValueError(f"the slot cache has no such state for layer {layer}: it was built for another model")
    return state


# -- prefill/decode dispatch of paired ops -----------------------------------------------------
# Decode rows come first in a batch (see ForwardBatch): each kind's rows go through its own op, and
# a mixed batch concatenates the two results in row order.

def _by_kind(batch: ForwardBatch, decode: Callable[[DecodeRows, slice], torch.Tensor],
             prefill: Callable[[PrefillRows, slice], torch.Tensor]) -> torch.Tensor:
    """Run `decode` on the decode rows and `prefill` on the prefill rows; one result in row order."""
    rows = batch.num_decode
    parts = []
    if batch.decode is not None:
        parts.append(decode(batch.decode, slice(0, rows)))
    if batch.prefill is not None:
        parts.append(prefill(batch.prefill, slice(rows, None)))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def attention(ops: Ops, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: ForwardBatch,
              scale: float) -> torch.Tensor:
    """Attention of the batch's new tokens over their slots' K/V (already written)."""
    return _by_kind(
        batch,
        lambda d, rows: ops.decode_attention(q[rows], k_cache, v_cache, d.slot_ids, d.seq_lens, scale),
        lambda p, rows: ops.prefill_attention(q[rows], k_cache, v_cache, p.slot_ids, p.start_positions,
                                              p.cu_seqlens, scale))


def conv1d(ops: Ops, x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor, batch: ForwardBatch,
           keep: Keep | None = None) -> torch.Tensor:
    """Depthwise causal conv (with SiLU) continuing each slot's conv state; `keep` copies a slot's
    state where the batch keeps it inside a piece (rounds.py)."""
    if batch.keeps and keep is not None:
        return conv1d_keeping(ops, x, weight, state, batch, keep)
    return _by_kind(batch, lambda d, rows: ops.conv1d_decode(x[rows], weight, state, d.slot_ids),
                    lambda p, rows: ops.conv1d_prefill(x[rows], weight, state, p.slot_ids, p.cu_seqlens))


def gated_delta(ops: Ops, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                state: torch.Tensor, batch: ForwardBatch, replay: torch.Tensor | None = None,
                keep: Keep | None = None) -> torch.Tensor:
    """The gated delta rule over each slot's recurrent state. With replay buffers (exact positions)
    every row, decode rows too, goes through the chunked op's exact replay: a position's output is
    then the same whichever piece or step computes it. `keep`: as conv1d's."""
    if batch.keeps and keep is not None:
        return gated_delta_keeping(ops, q, k, v, g, beta, state, batch, replay, keep)
    if replay is not None:
        return ops.gated_delta_prefill(q, k, v, g, beta, state, batch.slot_ids, batch.start_positions,
                                       batch.cu_seqlens, replay)
    return _by_kind(
        batch,
        lambda d, rows: ops.gated_delta_decode(q[rows], k[rows], v[rows], g[rows], beta[rows], state, d.slot_ids),
        lambda p, rows: ops.gated_delta_prefill(q[rows], k[rows], v[rows], g[rows], beta[rows], state, p.slot_ids,
                                                p.start_positions, p.cu_seqlens))


def body_ops(ops: Ops, batch: ForwardBatch) -> Ops:
    """The op table for the token rows of `batch`: decode rows multiply through `linear`, prefill
    rows through `prefill_linear` (a backend may tile them differently); a mixed batch splits each
    product at the first prefill row, unless both ops are the same function."""
    if batch.prefill is None:
        return ops
    if batch.decode is None or ops.linear is ops.prefill_linear:
        return dataclasses.replace(ops, linear=ops.prefill_linear)
    rows, decode_linear, prefill_linear = batch.num_decode, ops.linear, ops.prefill_linear

    def split_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return torch.cat([decode_linear(x[:rows], weight, bias), prefill_linear(x[rows:], weight, bias)])

    return dataclasses.replace(ops, linear=split_linear)


# -- blocks ------------------------------------------------------------------------------------

class Mixer(Protocol):
    """The token-mixing half of a block (attention, Gated DeltaNet, ...)."""

    @property
    def cache_spec(self) -> LayerCacheSpec:
        """What the mixer keeps per slot."""
        ...

    def linear_weights(self) -> tuple[torch.Tensor, ...]:
        """The matrices it multiplies through `ops.linear`."""
        ...

    def forward(self, ops: Ops, x: torch.Tensor, batch: ForwardBatch, cache: SlotCache, layer: int) -> torch.Tensor:
        ...


class FeedForward(Protocol):
    """The per-token half of a block (a dense MLP today; experts later)."""

    def linear_weights(self) -> tuple[torch.Tensor, ...]:
        """The matrices it multiplies through `ops.linear`."""
        ...

    def forward(self, ops: Ops, x: torch.Tensor) -> torch.Tensor:
        ...


@dataclass(frozen=True)
class Rope:
    """cos/sin tables [max_seq_len, rotary_dim / 2], shared by every attention layer of a model."""

    cos: torch.Tensor
    sin: torch.Tensor

    @classmethod
    def build(cls, cfg: ModelConfig, max_seq_len: int, device: torch.device) -> Rope:
        return cls(*rope_table(cfg.rotary_dim, max_seq_len, cfg.rope_theta, device=device))


class Attention:
    """GQA attention over the slot cache. `gated`: q_proj yields per head [query, gate] and the
    output is multiplied by sigmoid(gate) before o_proj (Qwen3.5)."""

    def __init__(self, cfg: ModelConfig, w: Weights, prefix: str, rope: Rope, norm_weight: NormWeight = as_is,
                 gated: bool = False, tp: TensorParallel = SINGLE) -> None:
        self.heads, self.kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.eps, self.scale, self.rope, self.gated = cfg.rms_norm_eps, cfg.head_dim ** -0.5, rope, gated
        self.qkv = torch.cat([w[prefix + n] for n in ("q_proj.weight", "k_proj.weight", "v_proj.weight")])
        bias = cfg.attention_bias
        self.qkv_bias = (torch.cat([w[prefix + n] for n in ("q_proj.bias", "k_proj.bias", "v_proj.bias")])
                         if bias else None)
        self.o_proj = RowParallel(w[prefix + "o_proj.weight"], w[prefix + "o_proj.bias"] if bias else None, tp,
                                  prefix + "o_proj")
        self.q_norm = norm_weight(w[prefix + "q_norm.weight"])
        self.k_norm = norm_weight(w[prefix + "k_norm.weight"])
        self.cache_spec = attention_spec(cfg)

    @staticmethod
    def weight_shapes(cfg: ModelConfig, prefix: str, gated: bool = False) -> Shapes:
        hidden, d = cfg.hidden_size, cfg.head_dim
        q_out, kv_out = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
        shapes: Shapes = {
            prefix + "q_proj.weight": ((2 if gated else 1) * q_out, hidden),
            prefix + "k_proj.weight": (kv_out, hidden),
            prefix + "v_proj.weight": (kv_out, hidden),
            prefix + "o_proj.weight": (hidden, q_out),
            prefix + "q_norm.weight": (d,),
            prefix + "k_norm.weight": (d,),
        }
        if cfg.attention_bias:
            shapes.update({prefix + "q_proj.bias": (q_out,), prefix + "k_proj.bias": (kv_out,),
                           prefix + "v_proj.bias": (kv_out,), prefix + "o_proj.bias": (hidden,)})
        return shapes

    @staticmethod
    def matrices(cfg: ModelConfig, gated: bool = False) -> list[tuple[str, int, int]]:
        """(name, in, out) of the matrices `linear_weights` gives: fused qkv, o_proj."""
        hidden, d, heads, kv_heads = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
        return [("qkv", hidden, (2 if gated else 1) * heads * d + 2 * kv_heads * d), ("o_proj", heads * d, hidden)]

    def linear_weights(self) -> tuple[torch.Tensor, ...]:
        return self.qkv, *self.o_proj.weights()

    def forward(self, ops: Ops, x: torch.Tensor, batch: ForwardBatch, cache: SlotCache, layer: int) -> torch.Tensor:
        tokens, d, heads, kv_heads = x.shape[0], self.head_dim, self.heads, self.kv_heads
        k_cache, v_cache = layer_state(cache.k, layer), layer_state(cache.v, layer)
        q_width = (2 if self.gated else 1) * heads * d
        q, k, v = ops.linear(x, self.qkv, self.qkv_bias).split([q_width, kv_heads * d, kv_heads * d], dim=-1)
        gate = None
        if self.gated:
            query_gate = q.reshape(tokens, heads, 2 * d)
            q, gate = query_gate[..., :d], query_gate[..., d:].reshape(tokens, heads * d)
        else:
            q = q.reshape(tokens, heads, d)
        q = ops.rms_norm(q, self.q_norm, self.eps)
        k = ops.rms_norm(k.reshape(tokens, kv_heads, d), self.k_norm, self.eps)
        q = ops.rope_write_kv(q, k, v.reshape(tokens, kv_heads, d), batch.positions, self.rope.cos, self.rope.sin,
                              k_cache, v_cache, batch.token_slots)
        out = attention(ops, q, k_cache, v_cache, batch, self.scale).reshape(tokens, heads * d)
        if gate is not None:
            out = out * elementwise_invariant(torch.sigmoid, gate)
        return self.o_proj.forward(ops, out)


class SwiGLU:
    """down(silu(gate(x)) * up(x)), gate and up fused."""

    def __init__(self, w: Weights, prefix: str, tp: TensorParallel = SINGLE) -> None:
        self.gate_up = torch.cat([w[prefix + "gate_proj.weight"], w[prefix + "up_proj.weight"]])
        self.down = RowParallel(w[prefix + "down_proj.weight"], None, tp, prefix + "down_proj")

    @staticmethod
    def weight_shapes(cfg: ModelConfig, prefix: str) -> Shapes:
        hidden, inner = cfg.hidden_size, cfg.intermediate_size
        return {prefix + "gate_proj.weight": (inner, hidden), prefix + "up_proj.weight": (inner, hidden),
                prefix + "down_proj.weight": (hidden, inner)}

    @staticmethod
    def matrices(cfg: ModelConfig) -> list[tuple[str, int, int]]:
        """(name, in, out) of the matrices `linear_weights` gives: fused gate_up, down."""
        hidden, inner = cfg.hidden_size, cfg.intermediate_size
        return [("gate_up", hidden, 2 * inner), ("down", inner, hidden)]

    def linear_weights(self) -> tuple[torch.Tensor, ...]:
        return self.gate_up, *self.down.weights()

    def forward(self, ops: Ops, x: torch.Tensor) -> torch.Tensor:
        return self.down.forward(ops, ops.silu_and_mul(ops.linear(x, self.gate_up)))


class DecoderBlock:
    """Pre-norm residual block: x + mixer(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, w: Weights, prefix: str, mixer: Mixer, mlp: FeedForward, norm_weight: NormWeight) -> None:
        self.input_norm = norm_weight(w[prefix + "input_layernorm.weight"])
        self.post_attention_norm = norm_weight(w[prefix + "post_attention_layernorm.weight"])
        self.mixer = mixer
        self.mlp = mlp

    @staticmethod
    def weight_shapes(cfg: ModelConfig, prefix: str) -> Shapes:
        """The block's own norms and its SwiGLU MLP; the mixer lists its own."""
        return {prefix + "input_layernorm.weight": (cfg.hidden_size,),
                prefix + "post_attention_layernorm.weight": (cfg.hidden_size,),
                **SwiGLU.weight_shapes(cfg, prefix + "mlp.")}

    def forward(self, ops: Ops, hidden: torch.Tensor, batch: ForwardBatch, cache: SlotCache, layer: int,
                eps: float) -> torch.Tensor:
        hidden = hidden + self.mixer.forward(ops, ops.rms_norm(hidden, self.input_norm, eps), batch, cache, layer)
        return hidden + self.mlp.forward(ops, ops.rms_norm(hidden, self.post_attention_norm, eps))


class DecoderModel:
    """Runs a ForwardBatch through the decoder and returns the logits of each sequence's last token.

    Subclasses implement `build_block`, and `norm_weight` where RMSNorm weights need preparing.
    Under tensor parallelism (`tp`) `cfg` is this rank's share (see `parallel/shard.py`): the
    embedding and lm_head hold a block of the vocabulary, and the logits are gathered in rank order.
    """

    keep_normed = False  # set for an MTP layer: forward keeps every row's final-normed hidden state
    normed: torch.Tensor | None = None  # ... of the latest forward, there

    def __init__(self, cfg: ModelConfig, weights: Weights, ops: Ops, max_seq_len: int, tp: TensorParallel = SINGLE,
                 prefix: str = "model.") -> None:
        self.cfg = cfg
        self.ops = ops
        self.tp = tp
        self.embed = weights[prefix + "embed_tokens.weight"]
        self.final_norm = self.norm_weight(weights[prefix + "norm.weight"])
        self.lm_head = self.embed if cfg.tie_word_embeddings else weights["lm_head.weight"]
        self.rope = Rope.build(cfg, max_seq_len, self.embed.device)
        layers = tp.pipeline.layers if tp.pipeline is not None else range(cfg.num_hidden_layers)
        self.blocks = [self.build_block(weights, f"{prefix}layers.{i}.", cfg.layer_types[i]) for i in layers]

    @staticmethod
    def weight_shapes(cfg: ModelConfig, prefix: str = "model.") -> Shapes:
        """Embedding, final norm and (untied) lm_head."""
        shapes: Shapes = {prefix + "embed_tokens.weight": (cfg.vocab_size, cfg.hidden_size),
                          prefix + "norm.weight": (cfg.hidden_size,)}
        if not cfg.tie_word_embeddings:
            shapes["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)
        return shapes

    def build_block(self, weights: Weights, prefix: str, kind: str) -> DecoderBlock:
        """Layer `prefix` of kind `kind` ("full_attention", "linear_attention", ...)."""
        raise NotImplementedError

    def norm_weight(self, weight: torch.Tensor) -> torch.Tensor:
        """An RMSNorm weight as the model uses it: as the checkpoint stores it, unless overridden."""
        return weight

    @property
    def dtype(self) -> torch.dtype:
        """The dtype rows are computed in (the weight matrices may be kept narrower)."""
        return self.final_norm.dtype

    def linear_weights(self) -> list[torch.Tensor]:
        """Every matrix multiplied through `ops.linear`, block by block, lm_head last."""
        return [w for block in self.blocks for part in (block.mixer, block.mlp) for w in part.linear_weights()] + [
            self.lm_head]

    def cache_specs(self) -> list[LayerCacheSpec]:
        """What each layer keeps per slot, as its mixer says."""
        return [block.mixer.cache_spec for block in self.blocks]

    def forward(self, batch: ForwardBatch, cache: SlotCache) -> torch.Tensor:
        """-> fp32 logits [L, vocab], one row per entry of `batch.logit_rows`."""
        ops, eps = self.ops, self.cfg.rms_norm_eps
        # Token rows go through their kind's linear (body_ops); the lm_head sees only the rows whose logits are wanted.
        rows_ops = body_ops(ops, batch)
        stage, rows = self.tp.pipeline, batch.logit_rows.numel()
        hidden = self._embed(batch.input_ids) if stage is None or stage.first else stage.receive(
            batch.input_ids.numel(), self.cfg.hidden_size, self.dtype, self.embed.device)
        for index, block in enumerate(self.blocks):
            hidden = block.forward(rows_ops, hidden, batch, cache, index, eps)
        if self.keep_normed:
            self.normed = ops.rms_norm(hidden, self.final_norm, eps)
        if stage is not None and not stage.last:  # the later stages compute the logits; rank 0 gets them
            stage.send(hidden)
            if stage.first and rows:
                return stage.logits_from_last(rows, self.lm_head.shape[0], hidden.device)
        if rows == 0 or (stage is not None and not stage.last):  # only pieces that end inside their prompts
            return hidden.new_empty(0, self.lm_head.shape[0], dtype=torch.float32)
        last = hidden.index_select(0, batch.logit_rows)
        logits = ops.linear(ops.rms_norm(last, self.final_norm, eps), self.lm_head).float()
        logits = logits if self.tp.size == 1 else torch.cat(self.tp.all_gather(logits), dim=-1)
        if stage is not None:
            stage.logits_to_first(logits)
        return logits

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Embedding rows; under tensor parallelism each rank looks up the ids of its vocabulary
        block, zeros elsewhere, and the ranks' rows are summed: one of them is not zero, so exactly."""
        if self.tp.size == 1:
            return self.ops.embedding(input_ids, self.embed).to(self.dtype)
        block = self.embed.shape[0]
        local = input_ids - self.tp.rank * block
        mine = (local >= 0) & (local < block)
        rows = self.ops.embedding(torch.where(mine, local, 0), self.embed).to(self.dtype)
        return tree_sum(self.tp.all_gather(torch.where(mine[:, None], rows, 0)))
