"""What `pocketllm bench --real-shapes` counts as the bytes a generated token reads (its batch-1
bandwidth limit)."""

from __future__ import annotations

import json

from pocketllm import LLM, EngineArgs
from pocketllm.bench.real_shapes import token_bytes


def test_a_token_of_a_mixture_of_experts_reads_its_top_k_experts_only(checkpoint_dir):
    """The batch-1 bandwidth limit's bytes: every matrix of a dense model; of a MoE layer's experts,
    num_experts_per_tok of num_experts (counted here from the checkpoint's config.json)."""
    for variant in ("tiny", "qwen3-moe", "qwen3-moe_per_expert"):
        path = checkpoint_dir(variant)
        c = json.loads((path / "config.json").read_text())
        step, dense = c.get("decoder_sparse_step", 1), set(c.get("mlp_only_layers", []))
        moe_layers = sum((i + 1) % step == 0 and i not in dense for i in range(c["num_hidden_layers"]))
        experts = c.get("num_experts", 0)
        per_layer = experts * 3 * c["hidden_size"] * c.get("moe_intermediate_size", 0) * 4
        unread = moe_layers * per_layer * (experts - c.get("num_experts_per_tok", 0)) // max(experts, 1)
        with LLM(EngineArgs(model=str(path), backend_options={"invariance_probe": False})) as llm:
            every = sum(w.numel() * 4 for w in llm.model.linear_weights())
            assert token_bytes(llm) == every - unread
        assert (unread > 0) == (variant != "tiny")
