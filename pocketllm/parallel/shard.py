"""What one rank of a tensor-parallel engine holds: its share of the config and of each tensor.

- Column-parallel (each rank computes a block of the outputs, with every input feature): q/k/v,
  gate/up, the Gated DeltaNet in-projections and its conv channels, the embedding and lm_head
  (a block of the vocabulary each).
- Row-parallel (each rank reads a block of the input features): o_proj, down_proj, out_proj; the
  ranks' products are summed in the fixed tree (`parallel/tree.py`).
- Attention heads, KV heads and Gated DeltaNet heads are split with their slots and states. With
  fewer KV heads than ranks, each rank keeps the one KV head its query heads read (replicated).
- Everything else (norms, per-head norm weights) is replicated.
A rank's model is then the ordinary model built on `local_config`: the layer code is unchanged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..config import ModelConfig
from .tree import REDUCTION_SHARDS, SIZES

Ranges = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class TensorShard:
    """The rows (dim 0) or columns (dim 1) of a checkpoint tensor a rank reads: `ranges`, concatenated."""

    dim: int
    ranges: Ranges


ShardPlan = Callable[[str, tuple[int, ...]], TensorShard | None]  # (name, full shape) -> its shard, None: all of it


def check_parallel(cfg: ModelConfig, size: int, tree: bool, device: torch.device) -> None:
    """ValueError naming the field when `size` ranks cannot share `cfg`, when `size` is not one of
    the sizes the tree's shards allow (with the tree), or when CUDA has too few devices from `device` on."""
    if device.type == "cuda" and (device.index or 0) + size > torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size={size} needs {size} CUDA devices from {device}; "
                         f"torch finds {torch.cuda.device_count()}")
    if size > 1 and cfg.num_experts:
        raise ValueError(f"tensor_parallel_size={size}: mixture-of-experts models run on one process for now "
                         f"(num_experts={cfg.num_experts}); use tensor_parallel_size=1")
    if tree and size not in SIZES:
        raise ValueError(f"tensor_parallel_size must be one of {SIZES} (the fixed reduction tree has "
                         f"{REDUCTION_SHARDS} shards), got {size}")
    need = {"num_attention_heads": cfg.num_attention_heads, "intermediate_size": cfg.intermediate_size,
            "vocab_size": cfg.vocab_size}
    if cfg.linear_num_value_heads:
        need.update(linear_num_key_heads=cfg.linear_num_key_heads, linear_num_value_heads=cfg.linear_num_value_heads)
    for name, value in need.items():
        if value % size:
            raise ValueError(f"tensor_parallel_size={size} must divide {name}={value}")
    kv = cfg.num_key_value_heads
    if kv % size and size % kv:
        raise ValueError(f"tensor_parallel_size={size} and num_key_value_heads={kv} must divide one another "
                         f"(KV heads are split, or replicated when there are fewer than ranks)")


def local_config(cfg: ModelConfig, size: int) -> ModelConfig:
    """One rank's share of `cfg`: heads, KV heads (at least one), intermediate size and vocabulary / size."""
    if size == 1:
        return cfg
    return dataclasses.replace(
        cfg, vocab_size=cfg.vocab_size // size, intermediate_size=cfg.intermediate_size // size,
        num_attention_heads=cfg.num_attention_heads // size,
        num_key_value_heads=max(1, cfg.num_key_value_heads // size),
        linear_num_key_heads=cfg.linear_num_key_heads // size,
        linear_num_value_heads=cfg.linear_num_value_heads // size)


def _block(total: int, rank: int, size: int, offset: int = 0) -> tuple[int, int]:
    width = total // size
    return offset + rank * width, offset + (rank + 1) * width


def shard_plan(cfg: ModelConfig, rank: int, size: int) -> ShardPlan:
    """Which part of each checkpoint tensor rank `rank` of `size` reads (names as both Qwen families write them)."""
    kv, d = cfg.num_key_value_heads, cfg.head_dim
    kv_head = rank * kv // size  # replicated KV: the head this rank's query heads read
    kv_rows = _block(kv * d, rank, size) if kv >= size else (kv_head * d, (kv_head + 1) * d)
    key_dim = cfg.linear_num_key_heads * cfg.linear_key_head_dim
    value_dim = cfg.linear_num_value_heads * cfg.linear_value_head_dim
    conv = (_block(key_dim, rank, size), _block(key_dim, rank, size, key_dim),
            _block(value_dim, rank, size, 2 * key_dim))

    def plan(name: str, shape: tuple[int, ...]) -> TensorShard | None:
        leaf = name.rsplit(".", 2)
        part = ".".join(leaf[-2:])  # e.g. "q_proj.weight", "linear_attn.dt_bias"
        if part in ("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias"):
            return TensorShard(0, (kv_rows,))
        if part in ("in_proj_qkv.weight", "conv1d.weight"):
            return TensorShard(0, conv)
        if part in ("o_proj.weight", "down_proj.weight", "out_proj.weight"):
            return TensorShard(1, (_block(shape[1], rank, size),))
        if part in ("q_proj.weight", "q_proj.bias", "gate_proj.weight", "up_proj.weight", "in_proj_z.weight",
                    "in_proj_b.weight", "in_proj_a.weight", "linear_attn.dt_bias", "linear_attn.A_log",
                    "embed_tokens.weight") or name == "lm_head.weight":
            return TensorShard(0, (_block(shape[0], rank, size),))
        return None  # norms, q/k norm weights, o_proj bias: every rank holds them whole

    return plan
