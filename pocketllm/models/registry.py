"""The model families pocketllm loads, and architecture name (config.json `architectures[0]`) -> family.

A family is one module under `models/` that builds its `Family` record; listing it in `FAMILIES`
is its registration: the loader, the config parser, the presets and the lab read it from here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..cache import LayerCacheSpec, attention_spec
from ..config import ConfigDefaults, ModelConfig
from ..kernels import Ops
from ..parallel.group import SINGLE, TensorParallel
from ..parallel.pipeline import pipeline_plan
from ..parallel.shard import NOT_HELD, local_config, shard_plan
from . import qwen3, qwen3_5, qwen3_5_moe, qwen3_moe, qwen3_next
from .family import Family
from .loader import CheckpointError, load_weights
from .protocol import Model

FAMILIES: tuple[Family, ...] = (qwen3.FAMILY, qwen3_5.FAMILY, qwen3_moe.FAMILY, qwen3_5_moe.FAMILY, qwen3_next.FAMILY)
ARCHITECTURES: dict[str, Family] = {name: family for family in FAMILIES for name in family.architectures}


def family_defaults(architecture: str, source: str) -> ConfigDefaults:
    """What the family of `architecture` lets a config.json leave out; a CheckpointError naming
    `source` and the supported architectures when no family loads it."""
    family = ARCHITECTURES.get(architecture)
    if family is None:
        raise CheckpointError(f"{source}: unknown architecture {architecture!r}; supported: {sorted(ARCHITECTURES)}")
    return family.defaults


def read_config(path: str | Path) -> ModelConfig:
    """The ModelConfig of the checkpoint directory `path` (its config.json, generation_config.json),
    with its family's defaults."""
    return ModelConfig.from_dir(path, family_defaults)


def config_from_dict(raw: dict[str, Any], generation: dict[str, Any] | None = None,
                     source: str = "config.json") -> ModelConfig:
    """The ModelConfig of a config.json's contents `raw`, with its family's defaults."""
    return ModelConfig.from_dict(raw, family_defaults, generation, source=source)


def family_of(cfg: ModelConfig) -> Family:
    """The family of `cfg`'s architecture; ValueError naming the supported ones otherwise."""
    if cfg.architecture not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {cfg.architecture!r}; supported: {sorted(ARCHITECTURES)}")
    return ARCHITECTURES[cfg.architecture]


def is_matrix(name: str, tensor: torch.Tensor) -> bool:
    """A weight matrix (kept in the engine's weight dtype): every tensor of two or more dimensions
    (linear layers, experts, the embedding and lm_head) but the Gated DeltaNet convolutions."""
    return tensor.dim() >= 2 and not name.endswith("conv1d.weight")


def build_model(path: str | Path, cfg: ModelConfig, ops: Ops, dtype: torch.dtype,
                device: torch.device | str, max_seq_len: int, tp: TensorParallel = SINGLE,
                weight_dtype: torch.dtype | None = None) -> Model:
    """Load the checkpoint at `path` into the model class its architecture names; under tensor
    parallelism, this rank's share of it (its tensors read from the files slice by slice); in a
    pipeline stage (`tp.pipeline`), its layers only. The weight
    matrices (`is_matrix`) are kept in `weight_dtype` (None: `dtype`), everything else in `dtype`."""
    if cfg.architecture not in ARCHITECTURES:
        raise CheckpointError(
            f"{Path(path) / 'config.json'}: unknown architecture {cfg.architecture!r}; "
            f"supported: {sorted(ARCHITECTURES)}"
        )
    family = ARCHITECTURES[cfg.architecture]
    plan = (shard_plan(cfg, tp.rank, tp.size, tp.expert_parallel) if tp.size > 1
            else pipeline_plan(tp.pipeline) if tp.pipeline is not None else None)
    expected = family.expected_weights(cfg)
    to_load, convert = ((expected, lambda weights: weights) if family.checkpoint_layout is None
                        else family.checkpoint_layout(cfg, Path(path), expected))
    others = set() if plan is None else {name for name, shape in to_load.items() if plan(name, shape) == NOT_HELD}
    to_load = {name: shape for name, shape in to_load.items() if name not in others}
    weights = convert(load_weights(path, to_load, dtype, device, shard=plan,
                                   skip=lambda name: name in others or family.skip_weight(name)))
    if weight_dtype is not None and weight_dtype != dtype:
        weights = {name: t.to(weight_dtype) if is_matrix(name, t) else t for name, t in weights.items()}
    return family.model(local_config(cfg, tp.size, tp.expert_parallel), weights, ops, max_seq_len, tp)


def layer_specs(cfg: ModelConfig) -> list[LayerCacheSpec]:
    """What each layer of `cfg` keeps per slot, known before the model is built (for sizing); the
    mixers take their specs from the same functions (attention's, and the family's recurrent one)."""
    family = ARCHITECTURES.get(cfg.architecture)  # unknown: build_model refuses it, naming config.json
    recurrent = family.recurrent_spec if family is not None else None
    specs: list[LayerCacheSpec] = []
    for kind in cfg.layer_types:
        if kind == "full_attention":
            specs.append(attention_spec(cfg))
        elif recurrent is None:
            raise ValueError(f"{cfg.architecture}: layer type {kind!r} needs a family with a recurrent state")
        else:
            specs.append(recurrent(cfg))
    return specs
