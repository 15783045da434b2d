"""Load Hugging Face safetensors checkpoints: one file or sharded with an index.

A checkpoint directory is untrusted input. Every tensor is checked against the shapes the model
expects; errors name the file and the tensor. Pickled formats (.bin, .pt, .pth) are refused,
never loaded: unpickling runs code. An index may only name files inside the model directory
(symlinked files, as in the Hugging Face cache, are fine). A corrupt safetensors file is a
CheckpointError naming it. Only floating-point tensors load: fp32, fp16, bf16 and fp64, each
converted to the engine dtype; a tensor that is not finite after that conversion is refused.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

import torch
from safetensors import safe_open

from ..config import CheckpointError, read_json_object
from ..parallel.shard import ShardPlan, TensorShard

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
PICKLED_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
# safetensors dtype names that load (converted to the engine dtype); integer, bool and fp8 do not.
FLOAT_DTYPES = ("F32", "F16", "BF16", "F64")

logger = logging.getLogger(__name__)

__all__ = ["CheckpointError", "checkpoint_files", "load_weights"]


def _shard_path(path: Path, index: Path, name: object) -> Path:
    """The file an index entry names, which must be a plain relative path inside `path`."""
    if not isinstance(name, str) or not name or "\0" in name:
        raise CheckpointError(f"{index}: weight_map entry {name!r} is not a file name")
    posix, windows = PurePosixPath(name), PureWindowsPath(name)
    if posix.is_absolute() or windows.is_absolute() or windows.drive or ".." in posix.parts or ".." in windows.parts:
        raise CheckpointError(f"{index}: weight_map entry {name!r} is outside the model directory; "
                              "shards must be named relative to it")
    return path / name


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a model directory, in load order."""
    index = path / INDEX_FILE
    if index.is_file():
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: no 'weight_map' object")
        files = sorted({_shard_path(path, index, name) for name in weight_map.values()})
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


def load_weights(path: str | Path, expected: dict[str, tuple[int, ...]], dtype: torch.dtype, device: torch.device | str,
                 skip: Callable[[str], bool] = lambda name: False,
                 shard: ShardPlan | None = None) -> dict[str, torch.Tensor]:
    """Read every expected tensor, converted to `dtype` on `device`; with `shard` (a tensor-parallel
    rank's plan) only the part of each tensor the plan names is read from the file.

    `expected` maps names to shapes; a tensor for which `skip(name)` holds is ignored, any other
    name not in `expected` is an error, as is a missing tensor, a shape mismatch, a dtype that is
    not floating point, or a non-finite value.
    """
    path = Path(path)
    weights: dict[str, torch.Tensor] = {}
    skipped: list[str] = []
    files = checkpoint_files(path)
    for file in files:
        try:
            _load_file(file, expected, dtype, device, skip, weights, skipped, shard)
        except (CheckpointError, KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # safetensors' own errors (a Rust panic included) and I/O errors
            raise CheckpointError(f"{file}: not a readable safetensors file ({type(exc).__name__}: {exc})") from None
    if skipped:
        logger.info("%s: skipped %d tensors that pocketllm does not run (e.g. %s)", path, len(skipped), skipped[0])
    missing = [name for name in expected if name not in weights]
    if missing:
        shown = ", ".join(repr(n) for n in missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise CheckpointError(f"{path}: missing tensor {shown} (searched {[f.name for f in files]})")
    return weights


def _load_file(file: Path, expected: dict[str, tuple[int, ...]], dtype: torch.dtype, device: torch.device | str,
               skip: Callable[[str], bool], weights: dict[str, torch.Tensor], skipped: list[str],
               shard: ShardPlan | None) -> None:
    """Add the tensors of one safetensors file to `weights` (or their names to `skipped`)."""
    with safe_open(str(file), framework="pt", device="cpu") as handle:
        for name in handle.keys():  # noqa: SIM118 (a safe_open handle is not iterable)
            if skip(name):
                skipped.append(name)
                continue
            if name in weights:
                raise CheckpointError(f"{file}: tensor {name!r} is also in an earlier shard")
            if name not in expected:
                raise CheckpointError(f"{file}: unexpected tensor {name!r}")
            info = handle.get_slice(name)
            shape = tuple(info.get_shape())
            if shape != tuple(expected[name]):
                raise CheckpointError(
                    f"{file}: tensor {name!r} has shape {list(shape)}, expected {list(expected[name])}"
                )
            stored = info.get_dtype()
            if stored not in FLOAT_DTYPES:
                raise CheckpointError(f"{file}: tensor {name!r} has dtype {stored}; only floating-point weights "
                                      f"load ({', '.join(FLOAT_DTYPES)})")
            # A copy of our own, in the allocator's 64-byte alignment: a tensor read from the file
            # sits wherever its offset puts it, and BLAS results can depend on the alignment of W.
            part = None if shard is None else shard(name, shape)
            tensor = (handle.get_tensor(name) if part is None else _read_part(info, shape, part)).to(
                device=device, dtype=dtype, copy=True)
            if not bool(torch.isfinite(tensor).all()):
                raise CheckpointError(f"{file}: tensor {name!r} holds NaN or infinite values "
                                      f"(after conversion from {stored} to {dtype})")
            weights[name] = tensor


def _read_part(info: Any, shape: tuple[int, ...], part: TensorShard) -> torch.Tensor:
    """The rows or columns `part` names of a tensor, read from the file slice by slice."""
    pieces = []
    for start, stop in part.ranges:
        index = (slice(None),) * part.dim + (slice(start, stop),) + (slice(None),) * (len(shape) - part.dim - 1)
        pieces.append(info[index])
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=part.dim)
