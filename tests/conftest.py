"""Shared fixtures: random-weight checkpoints written once per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

from pocketllm import write_checkpoint

# Hypothesis profiles (HYPOTHESIS_PROFILE selects one; CI=true selects "ci" by default):
#   default  40 examples per property: the local run;
#   ci       40 examples per property, failing examples printed as reproduction blobs;
#   thorough 400 examples per property (ten times more).
# Every property takes its budget from the active profile through `budget`, so a profile reaches
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


def budget(fraction: float = 1.0) -> int:
    """Examples for one property: `fraction` of the active profile's max_examples (at least 1)."""
    return max(1, int(settings().max_examples * fraction))


# Checkpoint variants the model tests run on: tied/untied embeddings, GQA ratios 2/4/1, head dims 32/16/24.
CHECKPOINT_VARIANTS = {
    "tiny": {},
    "untied_gqa4_bias": {"tie_word_embeddings": False, "num_attention_heads": 8, "num_key_value_heads": 2,
                         "head_dim": 16, "attention_bias": True, "num_hidden_layers": 3},
    "mha_hd24": {"num_attention_heads": 3, "num_key_value_heads": 3, "head_dim": 24, "hidden_size": 48,
                 "intermediate_size": 96, "vocab_size": 300, "eos_token_id": 299},
}


# Qwen3.5 hybrids: both checkpoint layouts, different layer counts and head layouts.
QWEN3_5_VARIANTS = {
    "qwen3.5": {"preset": "qwen3.5-tiny"},
    "qwen3.5_mm_untied": {"preset": "qwen3.5-tiny", "multimodal": True, "tie_word_embeddings": False,
                          "num_hidden_layers": 6, "linear_num_key_heads": 1, "linear_num_value_heads": 3,
                          "linear_key_head_dim": 24, "linear_value_head_dim": 8,
                          "layer_types": ["linear_attention", "full_attention", "linear_attention",
                                          "linear_attention", "linear_attention", "full_attention"]},
    "qwen3.5_mha": {"preset": "qwen3.5-tiny", "num_hidden_layers": 2, "num_attention_heads": 2,
                    "num_key_value_heads": 2, "head_dim": 64, "linear_num_key_heads": 4, "linear_num_value_heads": 4,
                    "linear_key_head_dim": 8, "linear_value_head_dim": 32, "layer_types": ["linear_attention",
                                                                                      "full_attention"]},
}


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
    """Factory: variant name (CHECKPOINT_VARIANTS or QWEN3_5_VARIANTS) -> path of its checkpoint,
    written on first use."""
    written: dict[str, Path] = {}

    def make(variant: str = "tiny") -> Path:
        if variant not in written:
            path = tmp_path_factory.mktemp(f"ckpt_{variant}")
            overrides = dict({**CHECKPOINT_VARIANTS, **QWEN3_5_VARIANTS}[variant])
            preset = overrides.pop("preset", "tiny")
            written[variant] = write_checkpoint(path, preset, seed=len(written) + 1, **overrides)
        return written[variant]

    return make


@pytest.fixture(scope="session")
def tiny_checkpoint(checkpoint_dir) -> Path:
    return checkpoint_dir("tiny")
