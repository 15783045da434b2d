"""The pytest plugin of `pocketllm.testing` (entry point `pytest11`: pytest loads it wherever pocketllm
is installed). A module of its own, outside the `pocketllm` package: it loads in every pytest run of
the environment, so it imports nothing of pocketllm (torch, the Triton interpreter's setting) until an
option or a fixture asks for it.

Options:
- `--impl OP=SPEC` (repeatable): registers SPEC (a registered name or "package.module:function") as
  op OP's implementation "under_test"; the `pocketllm_impl` fixture hands it to a test;
- `--pocketllm-profile {dev,ci,thorough}` (or $POCKETLLM_PROFILE): the Hypothesis profile, 10, 40 or
  400 examples per property (`ci` also prints each failure's reproduction blob); without either the
  active Hypothesis profile is left alone.

Fixtures (each builds on first use and keeps what it built for the session):
- `pocketllm_checkpoint(preset="tiny", seed=0, **config)`: a random-weight checkpoint's path;
- `pocketllm_engines(model="tiny", **engine_options)`: an `Engines` (serial reference and batched
  engines) on a preset's checkpoint or a checkpoint directory; closed at the end of the session;
- `pocketllm_serial_engine(model="tiny", **engine_args)`: one `LLM` in serial mode;
- `pocketllm_impl(op)`: the implementation `--impl` gave for `op`, or None.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

PROFILES = {"dev": 10, "ci": 40, "thorough": 400}
PROFILE_ENV = "POCKETLLM_PROFILE"
UNDER_TEST = "under_test"


def _register_profiles() -> None:
    from hypothesis import HealthCheck, settings

    relaxed: dict[str, Any] = dict(deadline=None, suppress_health_check=[
        HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large])
    for name, examples in PROFILES.items():
        settings.register_profile(f"pocketllm-{name}", max_examples=examples, print_blob=name == "ci", **relaxed)


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("pocketllm", "pocketllm.testing")
    group.addoption("--impl", action="append", default=[], metavar="OP=SPEC",
                    help="register SPEC (a registered name or package.module:function) as op OP's implementation "
                         "under test (repeatable); the pocketllm_impl fixture and the kernel tests take it")
    group.addoption("--pocketllm-profile", choices=sorted(PROFILES), default=None,
                    help=f"Hypothesis profile: {', '.join(f'{k} ({v} examples)' for k, v in PROFILES.items())}; "
                         f"default ${PROFILE_ENV}, else the active profile is kept")


def pytest_configure(config: pytest.Config) -> None:
    profile = config.getoption("pocketllm_profile") or os.environ.get(PROFILE_ENV)
    if profile:
        if profile not in PROFILES:
            raise pytest.UsageError(f"{PROFILE_ENV} must be one of {sorted(PROFILES)}, got {profile!r}")
        from hypothesis import settings

        _register_profiles()
        settings.load_profile(f"pocketllm-{profile}")
    impls = config.getoption("impl")
    if impls:
        from pocketllm.kernels.registry import register, resolve

        for item in impls:
            op, sep, spec = item.partition("=")
            if not sep or not spec:
                raise pytest.UsageError(f"--impl takes OP=SPEC, e.g. decode_attention=mypkg.mymod:my_decode; "
                                        f"got {item!r}")
            try:
                register(op, UNDER_TEST, resolve(op, spec))
            except (ImportError, ValueError, TypeError) as exc:
                raise pytest.UsageError(f"--impl {item}: {exc}") from exc


@pytest.fixture(scope="session")
def pocketllm_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Factory: (preset="tiny", seed=0, **config overrides) -> the path of that random-weight
    checkpoint, written on first use into the session's temporary directory."""
    written: dict[str, Path] = {}

    def make(preset: str = "tiny", seed: int = 0, **overrides: Any) -> Path:
        from pocketllm.models import write_checkpoint

        key = json.dumps([preset, seed, overrides], sort_keys=True)
        if key not in written:
            written[key] = write_checkpoint(tmp_path_factory.mktemp(f"ckpt_{preset}"), preset, seed, **overrides)
        return written[key]

    return make


def _model_path(make_checkpoint: Callable[..., Path], model: str | Path) -> Path:
    """A preset's session checkpoint, or `model` itself when it is a directory."""
    from pocketllm.models import PRESETS

    return make_checkpoint(model) if isinstance(model, str) and model in PRESETS else Path(model)


@pytest.fixture(scope="session")
def pocketllm_engines(pocketllm_checkpoint: Callable[..., Path]) -> Iterator[Callable[..., Any]]:
    """Factory: (model="tiny": a preset or a checkpoint directory, **Engines arguments: max_seq_len,
    engine_args, batched_args, backend options) -> an `Engines`, one per distinct arguments."""
    from pocketllm.testing.engines import Engines, python_source

    built: dict[str, Engines] = {}

    def make(model: str | Path = "tiny", **kwargs: Any) -> Engines:
        path = _model_path(pocketllm_checkpoint, model)
        key = python_source({"path": str(path), **kwargs})
        if key not in built:
            built[key] = Engines(path, **kwargs)
        return built[key]

    yield make
    for engines in built.values():
        engines.close()


@pytest.fixture(scope="session")
def pocketllm_serial_engine(pocketllm_checkpoint: Callable[..., Path]) -> Iterator[Callable[..., Any]]:
    """Factory: (model="tiny", **EngineArgs fields) -> an `LLM` in serial mode, one per distinct arguments."""
    from pocketllm import LLM, EngineArgs
    from pocketllm.testing.engines import python_source

    built: dict[str, LLM] = {}

    def make(model: str | Path = "tiny", **args: Any) -> LLM:
        path = _model_path(pocketllm_checkpoint, model)
        key = python_source({"path": str(path), **args})
        if key not in built:
            built[key] = LLM(EngineArgs(model=str(path), **args))
        return built[key]

    yield make
    for llm in built.values():
        llm.close()


@pytest.fixture
def pocketllm_impl() -> Callable[[str], Callable[..., Any] | None]:
    """op -> the implementation `--impl` registered for it, or None."""
    from pocketllm.kernels.registry import IMPLEMENTATIONS

    return lambda op: IMPLEMENTATIONS[op].get(UNDER_TEST)
