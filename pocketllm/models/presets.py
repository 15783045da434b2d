"""Write random-weight checkpoints in Hugging Face format (config.json + safetensors + tokenizer.json).

No model can be downloaded where pocketllm is tested, so the demo, tests and benchmarks run on
checkpoints written here: deterministic from a seed, loadable by `transformers` as well.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from ..config import ModelConfig
from ..tokenizer import byte_level_tokenizer_files
from .registry import ARCHITECTURES

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

_QWEN3_5_BASE: dict[str, Any] = {
    "architectures": ["Qwen3_5ForCausalLM"],
    "model_type": "qwen3_5_text",
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
    "attention_bias": False,
    "attention_dropout": 0.0,
    "max_position_embeddings": 4096,
    "linear_conv_kernel_dim": 4,
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
    # Qwen3.5 hybrids: three Gated DeltaNet layers, then one gated full-attention layer, repeated.
    "qwen3.5-tiny": {**_QWEN3_5_BASE, "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
                     "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
                     "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
                     "linear_value_head_dim": 16, "tie_word_embeddings": True, "eos_token_id": 255},
    "qwen3.5-small": {**_QWEN3_5_BASE, "vocab_size": 32000, "hidden_size": 512, "intermediate_size": 1408,
                      "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
                      "linear_num_key_heads": 4, "linear_num_value_heads": 8, "linear_key_head_dim": 64,
                      "linear_value_head_dim": 64, "tie_word_embeddings": True, "eos_token_id": 31999},
    # The exact shapes of published checkpoints (random weights): real-size CPU benchmarks.
    "qwen3-0.6b": {**_QWEN3_BASE, "vocab_size": 151936, "hidden_size": 1024, "intermediate_size": 3072,
                   "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
                   "tie_word_embeddings": True, "eos_token_id": 151645},
    "qwen3.5-0.8b": {**_QWEN3_5_BASE, "vocab_size": 248320, "hidden_size": 1024, "intermediate_size": 3584,
                     "num_hidden_layers": 24, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 256,
                     "linear_num_key_heads": 16, "linear_num_value_heads": 16, "linear_key_head_dim": 128,
                     "linear_value_head_dim": 128, "tie_word_embeddings": True, "eos_token_id": 248044},
}

# A small vision tower config, only so that the multimodal layout's config.json is complete.
_TINY_VISION = {"model_type": "qwen3_5_vision", "depth": 1, "hidden_size": 32, "intermediate_size": 64,
                "num_heads": 2, "patch_size": 2, "spatial_merge_size": 2, "temporal_patch_size": 2,
                "num_position_embeddings": 16}


def random_weights(cfg: ModelConfig, seed: int, init_std: float = 0.02) -> dict[str, torch.Tensor]:
    """fp32 weights for every tensor the architecture expects: matrices ~ N(0, init_std); norm
    scales ~ 1 + N(0, 0.1) (Qwen3.5's zero-centred norms ~ N(0, 0.1)), so a norm that is skipped or
    misapplied shows in the output; Gated DeltaNet conv taps ~ N(0, 0.3), A_log = log U(1, 4) and
    dt_bias ~ N(0, 0.1), so the recurrence neither vanishes nor explodes."""
    generator = torch.Generator().manual_seed(seed)
    zero_centred = cfg.architecture.startswith("Qwen3_5")
    weights = {}
    for name, shape in ARCHITECTURES[cfg.architecture].expected_weights(cfg).items():
        noise = torch.randn(shape, generator=generator)
        if name.endswith("A_log"):
            weights[name] = torch.log(1.0 + 3.0 * torch.rand(shape, generator=generator))
        elif name.endswith("dt_bias"):
            weights[name] = 0.1 * noise
        elif name.endswith("conv1d.weight"):
            weights[name] = 0.3 * noise
        elif len(shape) == 1 and "norm" in name:
            gated_norm = name.endswith("linear_attn.norm.weight")
            weights[name] = 0.1 * noise if zero_centred and not gated_norm else 1.0 + 0.1 * noise
        else:
            weights[name] = init_std * noise
    return weights


def _multimodal(raw: dict[str, Any],
                weights: dict[str, torch.Tensor]) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The Qwen3_5ForConditionalGeneration layout: text config nested, text weights under
    model.language_model., plus a vision and an MTP tensor that a loader must skip by rule."""
    text = {**raw, "model_type": "qwen3_5_text"}
    text.pop("architectures")
    config = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "text_config": text,
              "vision_config": {**_TINY_VISION, "out_hidden_size": raw["hidden_size"]},
              "tie_word_embeddings": raw["tie_word_embeddings"], "eos_token_id": raw["eos_token_id"]}
    nested = {("model.language_model." + name[len("model."):] if name.startswith("model.") else name): tensor
              for name, tensor in weights.items()}
    nested["model.visual.merger.linear_fc2.bias"] = torch.zeros(raw["hidden_size"])
    nested["mtp.fc.weight"] = torch.zeros(raw["hidden_size"], 2 * raw["hidden_size"])
    return config, nested


# What a loader reads from a model directory: stale copies of these must not outlive a rewrite
# (an old shard index would otherwise win over new single-file weights).
CHECKPOINT_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")
CHECKPOINT_PATTERNS = ("*.safetensors", "*.safetensors.index.json")


def _remove_checkpoint_files(path: Path) -> None:
    """Delete the checkpoint files of an earlier checkpoint in `path`; other files stay."""
    stale = [path / name for name in CHECKPOINT_FILES]
    stale += [p for pattern in CHECKPOINT_PATTERNS for p in path.glob(pattern)]
    for file in stale:
        if file.is_file() or file.is_symlink():
            file.unlink()


def write_checkpoint(path: str | Path, preset: str = "tiny", seed: int = 0, init_std: float = 0.02,
                     max_shard_bytes: int | None = None, multimodal: bool = False, **overrides: Any) -> Path:
    """Write a random checkpoint of `preset` (config fields replaced by `overrides`) to `path`.

    `multimodal=True` (Qwen3.5 presets) writes the Qwen3_5ForConditionalGeneration layout.
    With `max_shard_bytes`, weights are split into model-0000N-of-0000M.safetensors shards with a
    model.safetensors.index.json, as large Hugging Face checkpoints are.
    A byte-level tokenizer.json and tokenizer_config.json come with it (see pocketllm.tokenizer),
    unless an override makes vocab_size smaller than the 256 bytes. The files of an earlier
    checkpoint in `path` (CHECKPOINT_FILES, CHECKPOINT_PATTERNS) are removed first.
    """
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
    raw = {**PRESETS[preset], **overrides}
    cfg = ModelConfig.from_dict(raw, source=f"preset {preset!r}")
    if multimodal and not cfg.architecture.startswith("Qwen3_5"):
        raise ValueError(f"multimodal=True needs a Qwen3.5 preset, got {preset!r}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    _remove_checkpoint_files(path)
    weights = random_weights(cfg, seed, init_std)
    if multimodal:
        raw, weights = _multimodal(raw, weights)
    (path / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": raw["eos_token_id"]}, indent=2) + "\n")
    tokenizer_files = byte_level_tokenizer_files(cfg.vocab_size, cfg.eos_token_ids, cfg.max_position_embeddings)
    for name, content in (tokenizer_files or {}).items():
        (path / name).write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
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


def cache_dir() -> Path:
    """Where generated checkpoints are kept: $POCKETLLM_CACHE, else ~/.cache/pocketllm."""
    return Path(os.environ.get("POCKETLLM_CACHE", Path.home() / ".cache" / "pocketllm"))


def cached_checkpoint(preset: str = "tiny", seed: int = 0) -> Path:
    """The checkpoint of `preset` and `seed` in the cache directory: written once, reused afterwards
    (the demo's embedded default, and the real-shape benchmark's gigabyte-sized checkpoints)."""
    path = cache_dir() / f"{preset}-seed{seed}"
    if not all((path / name).is_file() for name in ("config.json", "model.safetensors", "tokenizer.json")):
        write_checkpoint(path, preset, seed=seed)
    return path
