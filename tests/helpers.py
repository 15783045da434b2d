"""What the tests import (`from helpers import ...`): Hypothesis budgets and the checkpoint variants.

Kept out of conftest.py: pytest loads each conftest.py as its directory's plugin, and a module named
conftest, imported, is whichever of them Python finds first on its path."""

from __future__ import annotations

import pytest
from hypothesis import settings


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


def variant_params(names, extras) -> list:
    """Fixture params for `names` with those in `extras` marked slow: the default run covers each
    model family and each decode strategy once, CI (`-m slow`) the further checkpoint layouts."""
    return [pytest.param(name, marks=pytest.mark.slow) if name in extras else name for name in sorted(names)]
