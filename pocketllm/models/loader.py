"""Load Hugging Face safetensors checkpoints: one file or sharded with an index.

Every tensor is checked against the shapes the model expects; errors name the file and the
tensor. Pickled formats (.bin, .pt, .pth) are refused, never loaded: unpickling runs code.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
PICKLED_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")

logger = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded as asked; the message names file and tensor."""


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a model directory, in load order."""
    index = path / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: no 'weight_map' object")
        files = [path / name for name in sorted(set(weight_map.values()))]
        for file in files:
            if not file.is_file():
                raise CheckpointError(f"{index}: lists shard {file.name}, which does not exist")
        return files
    if (path / SINGLE_FILE).is_file():
        return [path / SINGLE_FILE]
    pickled = sorted(p.name for p in path.iterdir() if p.suffix in PICKLED_SUFFIXES)
    if pickled:
        raise CheckpointError(
            f"{path}: weights are only in pickled files {pickled}; pocketllm loads safetensors only "
            "and never unpickles (convert with safetensors.torch.save_file)"
        )
    raise CheckpointError(f"{path}: no {SINGLE_FILE} or {INDEX_FILE}")


def load_weights(path: str | Path, expected: dict[str, tuple[int, ...]], dtype: torch.dtype,
                 device: torch.device | str, skip: Callable[[str], bool] = lambda name: False) -> dict[str, torch.Tensor]:
    """Read every expected tensor, converted to `dtype` on `device`.

    `expected` maps names to shapes; a tensor for which `skip(name)` holds is ignored, any other
    name not in `expected` is an error, as is a missing tensor or a shape mismatch.
    """
    path = Path(path)
    weights: dict[str, torch.Tensor] = {}
    skipped: list[str] = []
    files = checkpoint_files(path)
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for name in handle.keys():
                if skip(name):
                    skipped.append(name)
                    continue
                if name in weights:
                    raise CheckpointError(f"{file.name}: tensor {name!r} is also in an earlier shard")
                if name not in expected:
                    raise CheckpointError(f"{file.name}: unexpected tensor {name!r}")
                shape = tuple(handle.get_slice(name).get_shape())
                if shape != tuple(expected[name]):
                    raise CheckpointError(
                        f"{file.name}: tensor {name!r} has shape {list(shape)}, expected {list(expected[name])}"
                    )
                weights[name] = handle.get_tensor(name).to(device=device, dtype=dtype)
    if skipped:
        logger.info("%s: skipped %d tensors that pocketllm does not run (e.g. %s)", path, len(skipped), skipped[0])
    missing = [name for name in expected if name not in weights]
    if missing:
        shown = ", ".join(repr(n) for n in missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise CheckpointError(f"{path}: missing tensor {shown} (searched {[f.name for f in files]})")
    return weights
