"""Architecture name (config.json `architectures[0]`) -> model class and its weight rules."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ..config import ModelConfig
from ..kernels import Ops
from . import qwen3, qwen3_5
from .layers import Shapes, Weights
from .loader import CheckpointError, load_weights
from .protocol import Model


@dataclass(frozen=True)
class Architecture:
    """How to build one architecture: the model, the tensors it reads, the tensors it skips."""

    model: Callable[[ModelConfig, Weights, Ops, int], Model]  # (cfg, weights, ops, max_seq_len) -> model
    expected_weights: Callable[[ModelConfig], Shapes]
    skip_weight: Callable[[str], bool]


QWEN3 = Architecture(qwen3.Qwen3Model, qwen3.expected_weights, qwen3.skip_weight)
QWEN3_5 = Architecture(qwen3_5.Qwen3_5Model, qwen3_5.expected_weights, qwen3_5.skip_weight)
ARCHITECTURES: dict[str, Architecture] = {
    "Qwen3ForCausalLM": QWEN3,
    "Qwen3_5ForCausalLM": QWEN3_5,
    "Qwen3_5ForConditionalGeneration": QWEN3_5,
}


def build_model(path: str | Path, cfg: ModelConfig, ops: Ops, dtype: torch.dtype,
                device: torch.device | str, max_seq_len: int) -> Model:
    """Load the checkpoint at `path` into the model class its architecture names."""
    if cfg.architecture not in ARCHITECTURES:
        raise CheckpointError(
            f"{Path(path) / 'config.json'}: unknown architecture {cfg.architecture!r}; "
            f"supported: {sorted(ARCHITECTURES)}"
        )
    arch = ARCHITECTURES[cfg.architecture]
    weights = load_weights(path, arch.expected_weights(cfg), dtype, device, skip=arch.skip_weight)
    return arch.model(cfg, weights, ops, max_seq_len)
