"""What the tests import (`from helpers import ...`): Hypothesis budgets (pocketllm.testing's) and the
checkpoint variants.

Kept out of conftest.py: pytest loads each conftest.py as its directory's plugin, and a module named
conftest, imported, is whichever of them Python finds first on its path."""

from __future__ import annotations

import json
import random

import pytest

from pocketllm.testing import budget  # noqa: F401  (the tests import it from here)

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


# Mixtures of experts: the three families, both expert layouts (fused, and per expert: "per_expert"), dense
# layers by mlp_only_layers and by decoder_sparse_step, top-k 1..3, the multimodal wrapper.
MOE_VARIANTS = {
    "qwen3-moe": {"preset": "qwen3-moe-tiny"},
    "qwen3-moe_per_expert": {"preset": "qwen3-moe-tiny", "per_expert": True, "tie_word_embeddings": False,
                             "num_hidden_layers": 4, "decoder_sparse_step": 2, "mlp_only_layers": [],
                             "norm_topk_prob": False, "num_experts_per_tok": 3},
    "qwen3.5-moe": {"preset": "qwen3.5-moe-tiny"},
    "qwen3.5-moe_mm_per_expert": {"preset": "qwen3.5-moe-tiny", "multimodal": True, "per_expert": True,
                                  "tie_word_embeddings": False, "num_experts_per_tok": 1, "num_experts": 6},
    # Qwen3-Next: its grouped Gated DeltaNet projections with two and with three value heads per key head.
    "qwen3-next": {"preset": "qwen3-next-tiny", "seed": 101},
    "qwen3-next_per_expert": {"preset": "qwen3-next-tiny", "seed": 102, "per_expert": True,
                              "tie_word_embeddings": False, "linear_num_key_heads": 1, "linear_num_value_heads": 3,
                              "linear_value_head_dim": 8, "mlp_only_layers": [], "decoder_sparse_step": 2,
                              "norm_topk_prob": False},
}


def variant_params(names, extras) -> list:
    """Fixture params for `names` with those in `extras` marked slow: the default run covers each
    model family and each decode strategy once, CI (`-m slow`) the further checkpoint layouts."""
    return [pytest.param(name, marks=pytest.mark.slow) if name in extras else name for name in sorted(names)]


def hf_model(path):
    """The transformers model of a checkpoint directory, by its config's architecture (the
    multimodal wrappers included), fp32 and eager attention, with no EOS in generate()."""
    import torch
    import transformers

    architecture = json.loads((path / "config.json").read_text())["architectures"][0]
    cls = getattr(transformers, architecture) if "ConditionalGeneration" in architecture \
        else transformers.AutoModelForCausalLM
    model = cls.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager")
    model.generation_config.eos_token_id = None
    return model.eval()


def prompt_of(length: int, vocab: int = 256) -> list[int]:
    """A random prompt of `length` tokens, seeded by its length."""
    import torch

    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(length)).tolist()


def greedy_jobs(rng: random.Random, vocab: int, max_prompt: int = 40, max_tokens: int = 16, max_jobs: int = 8) -> tuple:
    """2..max_jobs greedy requests (ignore_eos) arriving at steps 0..3: a negative control's workload."""
    from pocketllm import SamplingParams
    from pocketllm.testing import Job

    return tuple(Job(tuple(rng.randrange(vocab) for _ in range(rng.randint(1, max_prompt))),
                     SamplingParams(max_tokens=rng.randint(4, max_tokens), temperature=0.0, ignore_eos=True),
                     arrival_step=rng.randint(0, 3), cancel_step=None)
                 for _ in range(rng.randint(2, max_jobs)))
