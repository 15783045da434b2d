"""A model family, in one record: everything outside its module needs to know about it.

The loader builds a checkpoint's model from the family its `architectures[0]` names; the config
parser fills in what the family's config.json may leave out; the checkpoint writer takes the
family's presets and how it initialises its tensors; the lab reads the matrices a layer holds,
whether attention is gated and what a linear-attention layer keeps per slot. A family is one
module that builds its `FAMILY` record, and one line in `registry.FAMILIES`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..cache import RecurrentCacheSpec
from ..config import ConfigDefaults, ModelConfig
from ..kernels import Ops
from ..parallel.group import TensorParallel
from .layers import Shapes, Weights
from .protocol import Model

Matrices = list[tuple[str, int, int]]  # (name, in features, out features)
# (tensor name, standard normal noise of its shape, generator) -> its initial value, or None: the default rule
InitWeight = Callable[[str, torch.Tensor, torch.Generator], torch.Tensor | None]
# (config.json dict, weights) -> the same checkpoint in the family's multimodal layout
Multimodal = Callable[[dict[str, Any], dict[str, torch.Tensor]], tuple[dict[str, Any], dict[str, torch.Tensor]]]
# (cfg, model directory, expected_weights(cfg)) -> (the names and shapes to load from this checkpoint,
# how to bring what was loaded to expected_weights' layout): a family whose checkpoints come in
# more than one tensor layout
CheckpointLayout = Callable[[ModelConfig, Path, Shapes], tuple[Shapes, Callable[[Weights], Weights]]]


def default_init(name: str, noise: torch.Tensor, generator: torch.Generator) -> torch.Tensor | None:
    """No tensor of its own: every tensor takes the writer's default rule."""
    return None


@dataclass(frozen=True)
class Family:
    """One model family: its architecture names, how to build and load it, and its shapes."""

    name: str
    architectures: tuple[str, ...]  # config.json `architectures[0]` values it loads
    model: Callable[[ModelConfig, Weights, Ops, int, TensorParallel], Model]  # (cfg, weights, ops, max_seq_len, tp)
    expected_weights: Callable[[ModelConfig], Shapes]
    skip_weight: Callable[[str], bool]
    matrices: Callable[[ModelConfig], Matrices]  # the distinct matrices of its layers, multiplied per token row
    presets: dict[str, dict[str, Any]]  # random-checkpoint presets: config.json dicts
    defaults: ConfigDefaults = ConfigDefaults()
    lab_presets: tuple[str, str] | None = None  # (quick, real): the presets the lab steps run on
    gated_attention: bool = False  # q_proj yields [query, gate] per head
    recurrent_spec: Callable[[ModelConfig], RecurrentCacheSpec] | None = None  # a linear-attention layer's slot
    init_weight: InitWeight = default_init
    multimodal: Multimodal | None = None
    checkpoint_layout: CheckpointLayout | None = None
