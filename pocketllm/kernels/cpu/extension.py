"""Build and load the C++ CPU kernels (`linear.cpp`, `tile.h`, `gated_delta.cpp`, `attention.cpp`,
`rows.cpp`) once per process.

Built with `torch.utils.cpp_extension.load` on first use, into a directory named by a hash of the
sources, the flags and the torch version (so an edit or a torch upgrade rebuilds, and nothing else
does). A machine without a C++ compiler or ninja still runs the engine on its other
implementations: `load_extension` then warns once, naming the reason, and returns None.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import warnings
from pathlib import Path
from types import ModuleType

import torch

SOURCE_DIR = Path(__file__).resolve().parent
SOURCES = ("linear.cpp", "tile.h", "gated_delta.cpp", "attention.cpp", "rows.cpp")
# -ffp-contract=off: the source's FMAs are its intrinsics; the compiler fuses nothing else.
CFLAGS = ("-O3", "-fopenmp", "-ffp-contract=off")
LDFLAGS = ("-fopenmp",)
# Where the builds go: $POCKETLLM_EXTENSIONS_DIR, else ~/.cache/pocketllm/extensions.
DIR_ENV = "POCKETLLM_EXTENSIONS_DIR"

# _key(root) -> the module, or None; and why it is None.
_LOADED: dict[tuple[str, str, str], ModuleType | None] = {}
_REASONS: dict[tuple[str, str, str], str] = {}


def compiler() -> str:
    """The C++ compiler torch's builder runs: $CXX, else c++."""
    return os.environ.get("CXX", "c++")


@functools.cache
def _digest() -> str:
    """A hash of the sources, flags and torch version, read once per process (every call of the op
    looks the module up by it)."""
    digest = hashlib.sha256(torch.__version__.encode() + " ".join(CFLAGS + LDFLAGS).encode())
    for name in SOURCES:
        digest.update((SOURCE_DIR / name).read_bytes())
    return digest.hexdigest()[:16]


def build_dir(root: Path | None = None) -> Path:
    """The build directory of these sources, flags and torch version under `root`."""
    base = root or Path(os.environ.get(DIR_ENV) or Path.home() / ".cache" / "pocketllm" / "extensions")
    return base / f"cpu_linear_{_digest()}"


def _missing_tool() -> str | None:
    """Why a build cannot start (no compiler, no ninja), or None."""
    if shutil.which(compiler()) is None:
        return f"no C++ compiler {compiler()!r} on PATH (set CXX)"
    from torch.utils.cpp_extension import is_ninja_available
    if not is_ninja_available():
        return "ninja is not installed"
    return None


def _build(directory: Path) -> ModuleType:
    """Compile (or reuse the build in `directory`) and import the extension."""
    from torch.utils.cpp_extension import load
    directory.mkdir(parents=True, exist_ok=True)
    module = load(name=f"pocketllm_{directory.name}", sources=[str(SOURCE_DIR / name) for name in SOURCES
                                                               if name.endswith(".cpp")],
                  extra_cflags=list(CFLAGS), extra_ldflags=list(LDFLAGS), build_directory=str(directory),
                  extra_include_paths=[str(SOURCE_DIR)], verbose=False)
    return module


def _key(root: Path | None) -> tuple[str, str, str]:
    """What decides a build (the root, $POCKETLLM_EXTENSIONS_DIR, the compiler): cheap enough for
    every call of the op, unlike the build directory's path."""
    return str(root or ""), os.environ.get(DIR_ENV, ""), compiler()


def load_extension(root: Path | None = None) -> ModuleType | None:
    """The compiled module (functions `linear`, `best_variant`, `gated_delta_recurrent`,
    `attention_rows`, `rms_norm_rows`, `silu_and_mul_rows`, `rope_write_kv_rows`), or None
    after one warning naming why it cannot be built. Built at most once per process per build directory and compiler."""
    key = _key(root)
    if key not in _LOADED:
        reason = _missing_tool()
        module = None
        if reason is None:
            try:
                module = _build(build_dir(root))
            except Exception as exc:  # a compiler error, a linker error, a broken toolchain
                lines = str(exc).strip().splitlines()
                reason = f"the build failed: {lines[-1] if lines else type(exc).__name__}"
        if reason is not None:
            warnings.warn(f"pocketllm's C++ CPU kernels are unavailable: {reason}", RuntimeWarning, stacklevel=2)
            _REASONS[key] = reason
        _LOADED[key] = module
    return _LOADED[key]


def unavailable_reason(root: Path | None = None) -> str:
    """Why `load_extension(root)` returned None, for the error of an op that needs it."""
    return _REASONS.get(_key(root), "it has not been built")
