"""Build and load the C++ CPU kernels (`linear.cpp`, `lanes.h`, `tile.h`, `attend.h`, `gated_delta.cpp`,
`attention.cpp`, `rows.cpp`, `moe.cpp`) once per process.

Built with `torch.utils.cpp_extension.load` on first use, into a directory named by a hash of the
sources, their place, the flags and the torch version (so an edit, another checkout or a torch
upgrade rebuilds, and nothing else does). A build holds that directory's lock (`build_lock`): it
dies with its owner, so a build killed midway blocks nothing, and a process that finds it held by a
live build waits at most $POCKETLLM_BUILD_TIMEOUT seconds (600), saying so on stderr after 2 s. A
compile that starts says so on stderr; a cached build says nothing. A machine without a C++ compiler
or ninja, a failed build or a lock wait that timed out still runs the engine on its other
implementations: `load_extension` then warns once, naming the reason (the lock file and its owner
for a timeout), and returns None.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType

import torch

from . import build_lock

SOURCE_DIR = Path(__file__).resolve().parent
SOURCES = ("linear.cpp", "lanes.h", "tile.h", "attend.h", "gated_delta.cpp", "attention.cpp", "rows.cpp",
           "moe.cpp")
# -ffp-contract=off: the source's FMAs are its intrinsics; the compiler fuses nothing else.
# -fno-trapping-math: selects over floats may become blends (no FP exception is ever read), so that
# loops such as the softmax's vectorise under AVX2 as they do under AVX-512's masks; no value changes.
CFLAGS = ("-O3", "-fopenmp", "-ffp-contract=off", "-fno-trapping-math")
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
    """A hash of the sources, their place, the flags and the torch version, read once per process (every
    call of the op looks the module up by it). Two checkouts build apart: torch's build script names
    the sources' paths, so sharing one directory would recompile at every switch between them."""
    digest = hashlib.sha256(torch.__version__.encode() + " ".join(CFLAGS + LDFLAGS).encode())
    digest.update(str(SOURCE_DIR).encode())
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


def _built(directory: Path, name: str, sources: Sequence[Path]) -> bool:
    """Whether `directory` holds module `name` linked from these `sources`: ninja logs an output only
    once its command has completed (a link cut short does not count), and a build of the same
    sources at another path (another checkout) compiles them all again."""
    log, script, library = directory / ".ninja_log", directory / "build.ninja", f"{name}.so"
    if not ((directory / library).exists() and log.exists() and script.exists()):
        return False
    commands = script.read_text()
    return library in log.read_text().split() and all(os.path.abspath(path).replace(" ", "$ ") in commands
                                                      for path in sources)  # as torch writes them there


def _run(load: Callable[[], ModuleType], directory: Path, name: str, sources: Sequence[Path],
         notice: str | None) -> ModuleType:
    """Say so when a compile is about to start (not when the build is cached), then build and import."""
    directory.mkdir(parents=True, exist_ok=True)
    if notice is not None and not _built(directory, name, sources):
        print(notice, file=sys.stderr, flush=True)
    return load()


def build(name: str, sources: Sequence[Path], directory: Path, *, cflags: Sequence[str] = (),
          ldflags: Sequence[str] = (), include_paths: Sequence[Path] = (), notice: str | None = None) -> ModuleType:
    """Compile `sources` into `directory` as module `name` (or reuse the build there) and import it,
    under the directory's build lock, so that a build killed midway neither blocks the next one nor
    breaks its result. `notice` goes to stderr when a compile actually starts."""
    from torch.utils import cpp_extension
    load = functools.partial(cpp_extension.load, name=name, sources=[str(path) for path in sources],
                             extra_cflags=list(cflags), extra_ldflags=list(ldflags),
                             extra_include_paths=[str(path) for path in include_paths],
                             build_directory=str(directory), verbose=False)
    timeout_s = build_lock.timeout()
    with build_lock.hold(directory, timeout_s):
        build_lock.clear_torch_baton(directory, timeout_s)
        try:
            return _run(load, directory, name, sources, notice)
        except ImportError:  # a result that does not import (a build cut short): once more, from nothing
            shutil.rmtree(directory)
            cpp_extension.JIT_EXTENSION_VERSIONER.entries.pop(name, None)  # else torch skips a build it ran
            return _run(load, directory, name, sources, notice)


def _build(directory: Path) -> ModuleType:
    """Compile (or reuse the build in `directory`) and import the kernels."""
    return build(f"pocketllm_{directory.name}", [SOURCE_DIR / name for name in SOURCES if name.endswith(".cpp")],
                 directory, cflags=CFLAGS, ldflags=LDFLAGS, include_paths=[SOURCE_DIR],
                 notice=f"pocketllm: building the C++ CPU kernels into {directory} (first use; about a minute)…")


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
            except build_lock.BuildWaitTimeout as exc:  # a live build elsewhere: fall back, naming its lock
                reason = str(exc)
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
