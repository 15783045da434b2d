"""What one rank of a tensor-parallel engine holds: its share of the config and of each tensor.

- Column-parallel (each rank computes a block of the outputs, with every input feature): q/k/v,
  gate/up, the Gated DeltaNet in-projections and its conv channels, the embedding and lm_head
  (a block of the vocabulary each).
- Row-parallel (each rank reads a block of the input features): o_proj, down_proj, out_proj; the
  ranks' products are summed in the fixed tree (`parallel/tree.py`).
- Attention heads, KV heads and Gated DeltaNet heads are split with their slots and states. With
  fewer KV heads than ranks, each rank keeps the one KV head its query heads read (replicated).
- Mixtures of experts: the router is replicated and the shared expert split as a dense MLP. The
  routed experts are split one of two ways (`expert_parallel`, vLLM's `enable_expert_parallel`):
  off, every rank holds a block of every expert's intermediate features (gate/up column-parallel,
  down row-parallel); on, every rank holds a block of whole experts and reads none of the others.
- Everything else (norms, per-head norm weights) is replicated.
A rank's model is then the ordinary model built on `local_config`: the layer code is unchanged.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

from ..config import ModelConfig
from .tree import REDUCTION_SHARDS, SIZES

Ranges = tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class TensorShard:
    """The slices along `dim` of a checkpoint tensor a rank reads: `ranges`, concatenated."""

    dim: int
    ranges: Ranges


ShardPlan = Callable[[str, tuple[int, ...]], TensorShard | None]  # (name, full shape) -> its shard, None: all of it
NOT_HELD = TensorShard(0, ())  # a plan's answer for a tensor the rank does not read at all (another rank's expert)


def check_parallel(cfg: ModelConfig, size: int, tree: bool, device: torch.device,
                   expert_parallel: bool = False, here: int | None = None) -> None:
    """ValueError naming the field when `size` ranks cannot share `cfg` (its experts split as
    `expert_parallel` says), when `size` is not one of the sizes the tree's shards allow (with the
    tree), or when CUDA has too few devices from `device` on for the `here` ranks of this host
    (None: all of them)."""
    here = size if here is None else here
    if device.type == "cuda" and (device.index or 0) + here > torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size={size} needs {here} CUDA devices from {device} on this host; "
                         f"torch finds {torch.cuda.device_count()}")
    if cfg.num_experts:
        _check_experts(cfg, size, tree, expert_parallel)
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


def _check_experts(cfg: ModelConfig, size: int, tree: bool, expert_parallel: bool) -> None:
    """What a mixture of experts needs at `size` ranks: the experts (expert parallel) or their
    intermediate features (tensor parallel) divide by `size`, the shared expert's too, and with the
    tree above one rank each expert's down matrix splits into the tree's shards."""
    need = {"shared_expert_intermediate_size": cfg.shared_expert_intermediate_size}
    need["num_experts" if expert_parallel else "moe_intermediate_size"] = (
        cfg.num_experts if expert_parallel else cfg.moe_intermediate_size)
    for name, value in need.items():
        if value % size:
            raise ValueError(f"tensor_parallel_size={size} must divide {name}={value} "
                             f"(enable_expert_parallel={expert_parallel})")
    if tree and size > 1 and cfg.moe_intermediate_size % REDUCTION_SHARDS:
        raise ValueError(f"moe_intermediate_size={cfg.moe_intermediate_size} does not split into the "
                         f"{REDUCTION_SHARDS} shards of the fixed reduction tree; use tensor_parallel_size=1")


def local_config(cfg: ModelConfig, size: int, expert_parallel: bool = False) -> ModelConfig:
    """One rank's share of `cfg`: heads, KV heads (at least one), intermediate sizes (the experts'
    unless `expert_parallel`) and vocabulary / size. The expert count stays whole: the router is."""
    if size == 1:
        return cfg
    return dataclasses.replace(
        cfg, vocab_size=cfg.vocab_size // size, intermediate_size=cfg.intermediate_size // size,
        num_attention_heads=cfg.num_attention_heads // size,
        num_key_value_heads=max(1, cfg.num_key_value_heads // size),
        linear_num_key_heads=cfg.linear_num_key_heads // size,
        linear_num_value_heads=cfg.linear_num_value_heads // size,
        moe_intermediate_size=cfg.moe_intermediate_size // (1 if expert_parallel else size),
        shared_expert_intermediate_size=cfg.shared_expert_intermediate_size // size)


def _block(total: int, rank: int, size: int, offset: int = 0) -> tuple[int, int]:
    width = total // size
    return offset + rank * width, offset + (rank + 1) * width


def _expert_of(name: str) -> int | None:
    """The expert a per-expert tensor belongs to ("...mlp.experts.{e}.gate_proj.weight"), else None."""
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part == "experts" and parts[i + 1].isdigit():
            return int(parts[i + 1])
    return None


def _experts_plan(name: str, shape: tuple[int, ...], experts: int, rank: int, size: int,
                  expert_parallel: bool) -> TensorShard | Literal[False] | None:
    """A routed expert tensor's shard, or False for any other tensor. Fused [E, 2I, H] / [E, H, I]:
    a block of the `experts` (expert parallel) or a block of every expert's features; per expert:
    all or nothing (expert parallel), else the dense MLP's rule (returned as False)."""
    if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
        if expert_parallel:
            return TensorShard(0, (_block(shape[0], rank, size),))
        if name.endswith("down_proj"):
            return TensorShard(2, (_block(shape[2], rank, size),))
        inter = shape[1] // 2
        return TensorShard(1, (_block(inter, rank, size), _block(inter, rank, size, inter)))
    expert = _expert_of(name)
    if expert is None or not expert_parallel:
        return False
    lo, hi = _block(experts, rank, size)
    return None if lo <= expert < hi else NOT_HELD


def shard_plan(cfg: ModelConfig, rank: int, size: int, expert_parallel: bool = False) -> ShardPlan:
    """Which part of each checkpoint tensor rank `rank` of `size` reads (names as both Qwen families
    write them; the routed experts split as `expert_parallel` says)."""
    kv, d = cfg.num_key_value_heads, cfg.head_dim
    kv_head = rank * kv // size  # replicated KV: the head this rank's query heads read
    kv_rows = _block(kv * d, rank, size) if kv >= size else (kv_head * d, (kv_head + 1) * d)
    key_dim = cfg.linear_num_key_heads * cfg.linear_key_head_dim
    value_dim = cfg.linear_num_value_heads * cfg.linear_value_head_dim
    conv = (_block(key_dim, rank, size), _block(key_dim, rank, size, key_dim),
            _block(value_dim, rank, size, 2 * key_dim))

    def plan(name: str, shape: tuple[int, ...]) -> TensorShard | None:
        expert = _experts_plan(name, shape, cfg.num_experts, rank, size, expert_parallel)
        if expert is not False:
            return expert
        leaf = name.rsplit(".", 2)
        part = ".".join(leaf[-2:])  # e.g. "q_proj.weight", "linear_attn.dt_bias"
        if part in ("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias"):
            return TensorShard(0, (kv_rows,))
        if part in ("in_proj_qkv.weight", "conv1d.weight"):
            return TensorShard(0, conv)
        if part in ("o_proj.weight", "down_proj.weight", "out_proj.weight"):
            return TensorShard(1, (_block(shape[1], rank, size),))
        if part in ("q_proj.weight", "q_proj.bias", "gate_proj.weight", "up_proj.weight", "in_proj_z.weight",
                    "in_proj_b.weight", "in_proj_a.weight", "in_proj_qkvz.weight", "in_proj_ba.weight",
                    "linear_attn.dt_bias", "linear_attn.A_log",
                    "embed_tokens.weight") or name == "lm_head.weight":
            return TensorShard(0, (_block(shape[0], rank, size),))
        return None  # norms, q/k norm weights, o_proj bias: every rank holds them whole

    return plan
