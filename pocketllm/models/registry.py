"""Architecture name (config.json `architectures[0]`) -> model class and its weight rules."""

from __future__ import annotations

from pathlib import Path

import torch

from ..config import ModelConfig
from ..kernels import Ops
from . import qwen3, qwen3_5
from .loader import CheckpointError, load_weights

ARCHITECTURES = {
    "Qwen3ForCausalLM": (qwen3.Qwen3Model, qwen3.expected_weights, qwen3.skip_weight),
    "Qwen3_5ForCausalLM": (qwen3_5.Qwen3_5Model, qwen3_5.expected_weights, qwen3_5.skip_weight),
    "Qwen3_5ForConditionalGeneration": (qwen3_5.Qwen3_5Model, qwen3_5.expected_weights, qwen3_5.skip_weight),
}


def build_model(path: str | Path, cfg: ModelConfig, ops: Ops, dtype: torch.dtype,
                device: torch.device | str, max_seq_len: int) -> qwen3.Qwen3Model | qwen3_5.Qwen3_5Model:
    """Load the checkpoint at `path` into the model class its architecture names."""
    if cfg.architecture not in ARCHITECTURES:
        raise CheckpointError(
            f"{Path(path) / 'config.json'}: unknown architecture {cfg.architecture!r}; "
            f"supported: {sorted(ARCHITECTURES)}"
        )
    model_cls, expected, skip = ARCHITECTURES[cfg.architecture]
    weights = load_weights(path, expected(cfg), dtype, device, skip=skip)
    return model_cls(cfg, weights, ops, max_seq_len)
