"""Qwen3-Next hybrid decoder (Hugging Face `Qwen3NextForCausalLM`, transformers `qwen3_next`).

Qwen3.5-MoE's layers (Gated DeltaNet or gated full attention, (1 + weight) norms, a mixture of
experts with a gated shared expert), with two differences of its own:
- The Gated DeltaNet's input projections are two matrices grouped by key head:
  `in_proj_qkvz` holds, for each key head g, its q rows, its k rows, then the v and z rows of the
  value heads g reads (num_value_heads / num_key_heads of them); `in_proj_ba` holds, for each key
  head, the b rows then the a rows of those value heads. At load time the rows are regrouped into
  Qwen3.5's q/k/v, z, b and a blocks (`regroup`): a permutation of rows, so the products' bits
  are Qwen3.5's. Under tensor parallelism a rank reads a block of whole key-head groups, which
  regroup into its block of Qwen3.5's.
- Like Qwen3-MoE, a layer in `mlp_only_layers` or off the `decoder_sparse_step` grid keeps a dense
  SwiGLU of width `intermediate_size`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..config import ConfigDefaults, ModelConfig
from . import qwen3_5, qwen3_5_moe
from .family import Family, Matrices
from .layers import Attention, FeedForward, Shapes, Weights
from .moe import checkpoint_layout, layer_mlp, mlp_matrices, moe_init, sparse_mlp_shapes

QWEN3_5_PROJECTIONS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")


def expected_weights(cfg: ModelConfig) -> Shapes:
    """Checkpoint tensor names and shapes, as transformers 5 writes them (fused experts)."""
    shapes: Shapes = {}
    key_dim, value_dim, _ = qwen3_5.gdn_dims(cfg)
    v_heads, hidden = cfg.linear_num_value_heads, cfg.hidden_size
    for name, shape in qwen3_5.expected_weights(cfg).items():
        if name.endswith("linear_attn.in_proj_qkv.weight"):
            g = name[:-len("in_proj_qkv.weight")]
            shapes[g + "in_proj_qkvz.weight"] = (2 * key_dim + 2 * value_dim, hidden)
            shapes[g + "in_proj_ba.weight"] = (2 * v_heads, hidden)
        elif not name.endswith(tuple(f"linear_attn.{p}.weight" for p in QWEN3_5_PROJECTIONS[1:])):
            shapes[name] = shape
    return sparse_mlp_shapes(cfg, shapes, "model.")


def regroup(cfg: ModelConfig, qkvz: torch.Tensor, ba: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(in_proj_qkv, in_proj_z, in_proj_b, in_proj_a) in Qwen3.5's layout from Qwen3-Next's
    key-head groups (all of them, or a tensor-parallel rank's block: the count is read off the rows)."""
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    ratio = cfg.linear_num_value_heads // cfg.linear_num_key_heads  # value heads per key head
    groups = qkvz.shape[0] // (2 * dk + 2 * ratio * dv)
    q, k, v, z = qkvz.view(groups, -1, qkvz.shape[1]).split([dk, dk, ratio * dv, ratio * dv], dim=1)
    b, a = ba.view(groups, 2 * ratio, ba.shape[1]).split([ratio, ratio], dim=1)
    flat = [part.reshape(-1, qkvz.shape[1]) for part in (q, k, v, z, b, a)]
    return torch.cat(flat[:3]).contiguous(), *(part.contiguous() for part in flat[3:])


def layout(cfg: ModelConfig, path: Path, expected: Shapes) -> tuple[Shapes, Callable[[Weights], Weights]]:
    """The experts' layouts (fused or per expert, `moe.checkpoint_layout`), then each Gated DeltaNet
    layer's projections regrouped into Qwen3.5's names."""
    to_load, fuse = checkpoint_layout(cfg, path, expected)

    def convert(weights: Weights) -> Weights:
        weights = fuse(weights)
        for name in [n for n in weights if n.endswith("in_proj_qkvz.weight")]:
            g = name[:-len("in_proj_qkvz.weight")]
            parts = regroup(cfg, weights.pop(name), weights.pop(g + "in_proj_ba.weight"))
            weights.update({f"{g}{p}.weight": tensor for p, tensor in zip(QWEN3_5_PROJECTIONS, parts)})
        return weights

    return to_load, convert


class Qwen3NextModel(qwen3_5_moe.Qwen3_5MoeModel):
    """Qwen3.5-MoE's layers; a layer off the sparse grid keeps the dense SwiGLU."""

    def build_mlp(self, weights: Weights, prefix: str) -> FeedForward:
        return layer_mlp(self.cfg, weights, prefix, self.tp)


def matrices(cfg: ModelConfig) -> Matrices:
    return Attention.matrices(cfg, gated=True) + mlp_matrices(cfg) + qwen3_5.DeltaNet.matrices(cfg)


def _next(preset: str, **fields: Any) -> dict[str, Any]:
    raw = {**qwen3_5_moe.PRESETS[preset], "architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next",
           "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], **fields}
    return raw


PRESETS: dict[str, dict[str, Any]] = {
    # Qwen3.5-MoE-tiny's widths, layer 1 dense (mlp_only_layers), two value heads per key head: tests.
    "qwen3-next-tiny": _next("qwen3.5-moe-tiny", intermediate_size=96, mlp_only_layers=[1]),
    # The qwen3.5-moe-small preset's widths: CPU benchmarks.
    "qwen3-next-small": _next("qwen3.5-moe-small"),
}

FAMILY = Family("qwen3-next", ("Qwen3NextForCausalLM",), Qwen3NextModel, expected_weights, qwen3_5.skip_weight,
                matrices, PRESETS,
                defaults=ConfigDefaults(head_dim=256, partial_rotary_factor=0.25, full_attention_interval=4, moe=True,
                                        norm_topk_prob=True, shared_expert=True),
                gated_attention=True, recurrent_spec=qwen3_5.recurrent_spec, init_weight=moe_init(qwen3_5.init_weight),
                checkpoint_layout=layout)
