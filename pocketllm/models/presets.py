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
from .mtp import mtp_weights
from .registry import FAMILIES, config_from_dict, family_of

PRESETS: dict[str, dict[str, Any]] = {name: raw for family in FAMILIES for name, raw in family.presets.items()}


def random_weights(cfg: ModelConfig, seed: int, init_std: float = 0.02) -> dict[str, torch.Tensor]:
    """fp32 weights for every tensor the architecture expects: matrices ~ N(0, init_std); norm
    scales ~ 1 + N(0, 0.1), so a norm that is skipped or misapplied shows in the output; a family's
    own tensors as its `init_weight` says."""
    generator = torch.Generator().manual_seed(seed)
    family = family_of(cfg)
    weights = {}
    for name, shape in family.expected_weights(cfg).items():
        noise = torch.randn(shape, generator=generator)
        own = family.init_weight(name, noise, generator)
        if own is not None:
            weights[name] = own
        elif len(shape) == 1 and "norm" in name:
            weights[name] = 1.0 + 0.1 * noise
        else:
            weights[name] = init_std * noise
    return weights


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
                     max_shard_bytes: int | None = None, multimodal: bool = False, mtp: bool = False,
                     **overrides: Any) -> Path:
    """Write a random checkpoint of `preset` (config fields replaced by `overrides`) to `path`.

    `multimodal=True` writes the family's multimodal layout (Qwen3.5: Qwen3_5ForConditionalGeneration).
    `mtp=True` (Qwen3.5 families) also writes the multi-token-prediction layer, `mtp.*` beside the
    model as published, and `mtp_num_hidden_layers: 1`; the model's own tensors are the same as without.
    With `max_shard_bytes`, weights are split into model-0000N-of-0000M.safetensors shards with a
    model.safetensors.index.json, as large Hugging Face checkpoints are.
    A byte-level tokenizer.json and tokenizer_config.json come with it (see pocketllm.tokenizer),
    unless an override makes vocab_size smaller than the 256 bytes. The files of an earlier
    checkpoint in `path` (CHECKPOINT_FILES, CHECKPOINT_PATTERNS) are removed first.
    """
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
    raw = {**PRESETS[preset], **overrides}
    cfg = config_from_dict(raw, source=f"preset {preset!r}")
    nest = family_of(cfg).multimodal
    if multimodal and nest is None:
        with_layout = sorted(name for family in FAMILIES if family.multimodal for name in family.presets)
        raise ValueError(f"multimodal=True needs a preset of a family with a multimodal layout ({with_layout}), "
                         f"got {preset!r}")
    if mtp and not family_of(cfg).gated_attention:
        raise ValueError(f"mtp=True needs a Qwen3.5 preset (a family that ships an MTP layer), got {preset!r}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    _remove_checkpoint_files(path)
    weights = random_weights(cfg, seed, init_std)
    if multimodal and nest is not None:
        raw, weights = nest(raw, weights)
    if mtp:
        _add_mtp(raw, weights, cfg, seed, init_std)
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


def _add_mtp(raw: dict[str, Any], weights: dict[str, torch.Tensor], cfg: ModelConfig, seed: int,
             init_std: float) -> None:
    """The MTP layer's tensors (from a generator of their own: the model's stay as without) and its
    config key, in the text config where the layout nests one."""
    weights.update(mtp_weights(cfg, torch.Generator().manual_seed(seed + 1), init_std))
    raw.get("text_config", raw)["mtp_num_hidden_layers"] = 1


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
