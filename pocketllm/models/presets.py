"""Write random-weight checkpoints in Hugging Face format (config.json + safetensors).

No model can be downloaded where pocketllm is tested, so the demo, tests and benchmarks run on
checkpoints written here: deterministic from a seed, loadable by `transformers` as well.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ..config import ModelConfig
from . import qwen3

_QWEN3_BASE: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "use_sliding_window": False,
    "max_position_embeddings": 4096,
    "dtype": "float32",
}

PRESETS: dict[str, dict[str, Any]] = {
    # A few hundred thousand parameters: tests and the demo.
    "tiny": {**_QWEN3_BASE, "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
             "tie_word_embeddings": True, "eos_token_id": 255},
    # About 40M parameters: CPU benchmarks.
    "small": {**_QWEN3_BASE, "vocab_size": 32000, "hidden_size": 512, "intermediate_size": 1408,
              "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64,
              "tie_word_embeddings": True, "eos_token_id": 31999},
}


def random_weights(cfg: ModelConfig, seed: int, init_std: float = 0.02) -> dict[str, torch.Tensor]:
    """fp32 weights for every tensor the architecture expects: matrices ~ N(0, init_std),
    norm scales ~ 1 + N(0, 0.1) so a norm that is skipped or misapplied shows in the output."""
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in qwen3.expected_weights(cfg).items():
        noise = torch.randn(shape, generator=generator)
        weights[name] = 1.0 + 0.1 * noise if len(shape) == 1 and "norm" in name else init_std * noise
    return weights


def write_checkpoint(path: str | Path, preset: str = "tiny", seed: int = 0, init_std: float = 0.02,
                     max_shard_bytes: int | None = None, **overrides: Any) -> Path:
    """Write a random checkpoint of `preset` (config fields replaced by `overrides`) to `path`.

    With `max_shard_bytes`, weights are split into model-0000N-of-0000M.safetensors shards with a
    model.safetensors.index.json, as large Hugging Face checkpoints are.
    """
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
    raw = {**PRESETS[preset], **overrides}
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = ModelConfig.from_dict(raw, source=f"preset {preset!r}")
    weights = random_weights(cfg, seed, init_std)
    (path / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": raw["eos_token_id"]}, indent=2) + "\n")
    if max_shard_bytes is None:
        save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
        return path
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in weights.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        file_name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / file_name), metadata={"format": "pt"})
        weight_map.update({name: file_name for name in shard})
    total = sum(t.numel() * t.element_size() for t in weights.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return path
