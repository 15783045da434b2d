"""Fixtures and hooks for every test: the `gpu` skip and the checkpoint variants, on top of
pocketllm.testing's pytest plugin (`pytest_pocketllm`: `--impl`, the Hypothesis profiles, the
checkpoint writer), which the install registers; a tree run without installing loads it from here."""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path

import pytest
import torch
from helpers import CHECKPOINT_VARIANTS, MOE_VARIANTS, QWEN3_5_VARIANTS

# The project's properties run on the "ci" profile (40 examples each, failures printed as reproduction
# blobs) unless $POCKETLLM_PROFILE or --pocketllm-profile asks for "dev" or "thorough".
os.environ.setdefault("POCKETLLM_PROFILE", "ci")
_INSTALLED = any(ep.value == "pytest_pocketllm" for ep in importlib.metadata.entry_points(group="pytest11"))
pytest_plugins = [] if _INSTALLED and not os.environ.get("PYTEST_DISABLE_PLUGIN_AUTOLOAD") else ["pytest_pocketllm"]
VARIANTS = {**CHECKPOINT_VARIANTS, **QWEN3_5_VARIANTS, **MOE_VARIANTS}


def pytest_configure(config: pytest.Config) -> None:
    """A pytest-xdist worker takes its share of the intra-op threads (and passes it to the processes it
    starts): two workers of two OpenMP teams each on two cores would spin-wait against each other.
    The kernels' own tests set 1 and 2 threads themselves. With POCKETLLM_TEST_SHARE_THREADS=0 each
    worker keeps the default thread count: `.ci/run` runs the invariance tests again so, with
    OpenMP's threads waiting passively (OMP_WAIT_POLICY=PASSIVE) instead of spinning."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1 and os.environ.get("POCKETLLM_TEST_SHARE_THREADS", "1") != "0":
        threads = max(1, torch.get_num_threads() // workers)
        torch.set_num_threads(threads)
        os.environ["OMP_NUM_THREADS"] = str(threads)


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


@pytest.fixture(scope="module")
def tiny_batched_llm(checkpoint_dir):
    """A caller-stepped batched engine on the tiny checkpoint (4 slots, 96 positions), one per module."""
    from pocketllm import LLM, EngineArgs

    with LLM(EngineArgs(model=str(checkpoint_dir("tiny")), max_seq_len=96,
                        backend_options={"enable_batching": True, "background_thread": False,
                                         "max_batch_size": 4})) as engine:
        yield engine


@pytest.fixture(scope="session")
def checkpoint_dir(pocketllm_checkpoint):
    """Factory: variant name (CHECKPOINT_VARIANTS, QWEN3_5_VARIANTS or MOE_VARIANTS) -> path of its
    checkpoint, written on first use, each variant from its own seed (its "seed", else its place among
    the variants without one, so that a variant added with a seed changes no other's; "per_expert":
    the experts rewritten in the per-expert layout)."""
    written: dict[str, Path] = {}

    def make(variant: str = "tiny") -> Path:
        if variant not in written:
            overrides = dict(VARIANTS[variant])
            preset = overrides.pop("preset", "tiny")
            unseeded = sorted(name for name, fields in VARIANTS.items() if "seed" not in fields)
            seed = overrides.pop("seed") if "seed" in overrides else 1 + unseeded.index(variant)
            per_expert = overrides.pop("per_expert", False)
            path = pocketllm_checkpoint(preset, seed=seed, **overrides)
            if per_expert:
                from safetensors.torch import load_file, save_file

                from pocketllm.models.moe import split_experts

                file = str(path / "model.safetensors")
                save_file(split_experts(load_file(file)), file, metadata={"format": "pt"})
            written[variant] = path
        return written[variant]

    return make


@pytest.fixture(scope="session")
def tiny_checkpoint(checkpoint_dir) -> Path:
    return checkpoint_dir("tiny")
