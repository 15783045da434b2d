"""Shared fixtures: random-weight checkpoints written once per test session."""

from __future__ import annotations

from pathlib import Path

import os

import pytest
from hypothesis import HealthCheck, settings

from pocketllm import write_checkpoint

# Hypothesis: the default profile fits the CI budget; HYPOTHESIS_PROFILE=thorough runs ten times more.
_RELAXED = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                                      HealthCheck.data_too_large])
settings.register_profile("default", max_examples=40, **_RELAXED)
settings.register_profile("thorough", max_examples=400, **_RELAXED)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

# Checkpoint variants the model tests run on: tied/untied embeddings, GQA ratios 2/4/1, head dims 32/16/24.
CHECKPOINT_VARIANTS = {
    "tiny": {},
    "untied_gqa4_bias": {"tie_word_embeddings": False, "num_attention_heads": 8, "num_key_value_heads": 2,
                         "head_dim": 16, "attention_bias": True, "num_hidden_layers": 3},
    "mha_hd24": {"num_attention_heads": 3, "num_key_value_heads": 3, "head_dim": 24, "hidden_size": 48,
                 "intermediate_size": 96, "vocab_size": 300, "eos_token_id": 299},
}


@pytest.fixture(scope="session")
def checkpoint_dir(tmp_path_factory: pytest.TempPathFactory):
    """Factory: variant name -> path of its checkpoint, written on first use."""
    written: dict[str, Path] = {}

    def make(variant: str = "tiny") -> Path:
        if variant not in written:
            path = tmp_path_factory.mktemp(f"ckpt_{variant}")
            written[variant] = write_checkpoint(path, "tiny", seed=len(written) + 1, **CHECKPOINT_VARIANTS[variant])
        return written[variant]

    return make


@pytest.fixture(scope="session")
def tiny_checkpoint(checkpoint_dir) -> Path:
    return checkpoint_dir("tiny")
