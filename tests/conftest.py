"""Fixtures, hooks and options for every test: Hypothesis profiles, `--impl`, the `gpu` skip, and
random-weight checkpoints written once per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from helpers import CHECKPOINT_VARIANTS, MOE_VARIANTS, QWEN3_5_VARIANTS
from hypothesis import HealthCheck, settings

from pocketllm import write_checkpoint

# Hypothesis profiles (HYPOTHESIS_PROFILE selects one; CI=true selects "ci" by default):
#   default  40 examples per property: the local run;
#   ci       40 examples per property, failing examples printed as reproduction blobs;
#   thorough 400 examples per property (ten times more).
# Every property takes its budget from the active profile through `helpers.budget`, so a profile reaches
# all of them; a property that is expensive per example asks for a fraction of it.
_RELAXED = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                                      HealthCheck.data_too_large])
settings.register_profile("default", max_examples=40, **_RELAXED)
settings.register_profile("ci", max_examples=40, print_blob=True, **_RELAXED)
settings.register_profile("thorough", max_examples=400, **_RELAXED)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "default"))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--impl", action="append", default=[], metavar="OP=SPEC",
                     help="run the kernel tests on this implementation of OP: a registered name or "
                          "package.module:function (repeatable)")


def pytest_configure(config: pytest.Config) -> None:
    """Each --impl OP=SPEC is resolved (checked against the op's signature) and registered as the
    op's "under_test" implementation, which the kernel tests take (tests/kernels/kernel_impls.py)."""
    from pocketllm.kernels.registry import register, resolve

    for item in config.getoption("impl"):
        op, sep, spec = item.partition("=")
        if not sep or not spec:
            raise pytest.UsageError(f"--impl takes OP=SPEC, e.g. decode_attention=mypkg.mymod:my_decode; got {item!r}")
        try:
            register(op, "under_test", resolve(op, spec))
        except (ImportError, ValueError, TypeError) as exc:
            raise pytest.UsageError(f"--impl {item}: {exc}") from exc


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked `gpu` are skipped here when torch sees no CUDA device: the one place that decides."""
    if torch.cuda.is_available():
        return
    no_cuda = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(no_cuda)


@pytest.fixture
def single_torch_thread():
    """One intra-op thread for the test, restored after: tiny models gain nothing from more, and a
    loaded machine's OpenMP spin-waiting makes their forwards erratic."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def checkpoint_dir(tmp_path_factory: pytest.TempPathFactory):
    """Factory: variant name (CHECKPOINT_VARIANTS, QWEN3_5_VARIANTS or MOE_VARIANTS) -> path of its
    checkpoint, written on first use ("per_expert": the experts rewritten in the per-expert layout)."""
    written: dict[str, Path] = {}

    def make(variant: str = "tiny") -> Path:
        if variant not in written:
            path = tmp_path_factory.mktemp(f"ckpt_{variant}")
            overrides = dict({**CHECKPOINT_VARIANTS, **QWEN3_5_VARIANTS, **MOE_VARIANTS}[variant])
            preset = overrides.pop("preset", "tiny")
            per_expert = overrides.pop("per_expert", False)
            written[variant] = write_checkpoint(path, preset, seed=len(written) + 1, **overrides)
            if per_expert:
                from safetensors.torch import load_file, save_file

                from pocketllm.models.moe import split_experts

                file = str(path / "model.safetensors")
                save_file(split_experts(load_file(file)), file, metadata={"format": "pt"})
        return written[variant]

    return make


@pytest.fixture(scope="session")
def tiny_checkpoint(checkpoint_dir) -> Path:
    return checkpoint_dir("tiny")
