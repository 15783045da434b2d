"""Mixtures of experts over several processes (Gloo on CPU): tensor parallel (a block of every
expert's features per rank) and expert parallel (a block of whole experts per rank) give the bits
of one process, and without the reduction tree they do not.

As in test_tensor_parallel.py, sharded batched runs are compared with single-process serial runs,
so one property proves batched == serial and size n == size 1 together, with chunked prefill,
prefix reuse and preemption in the mix, on the three MoE families (Qwen3-Next's grouped Gated
DeltaNet projections split by whole key-head groups) and both checkpoint layouts."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import budget
from hypothesis import given, settings
from test_tensor_parallel import _fixed_jobs

from pocketllm import LLM, EngineArgs, SamplingParams
from pocketllm.models import read_config
from pocketllm.models.loader import load_weights
from pocketllm.models.registry import build_model, family_of
from pocketllm.op_table import op_table
from pocketllm.parallel.group import TensorParallel
from pocketllm.parallel.shard import NOT_HELD, check_parallel, local_config, shard_plan
from pocketllm.testing import Engines, Schedule, Workload, assert_batch_invariant, mismatches
from pocketllm.testing.strategies import preemption_workloads, prefix_workloads

VOCAB = 256
MAX_SEQ_LEN = 224
OPTIONS = {"exact_positions": True, "tree_reduction": True}
LAYOUTS = {"tensor": {"tensor_parallel_size": 2}, "expert": {"tensor_parallel_size": 2, "enable_expert_parallel": True}}


def _expert_blocks(path, size: int, expert_parallel: bool, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each sparse layer's (w_gate_up, w_down) as rank `rank` builds them (without the tree: as read)."""
    cfg = read_config(path)
    args = EngineArgs(model=str(path))
    model = build_model(path, cfg, op_table(args), torch.float32, "cpu", 64,
                        TensorParallel(rank, size, tree=False, expert_parallel=expert_parallel))
    return [(block.mlp.experts.w_gate_up, block.mlp.experts.w_down) for block in model.blocks
            if hasattr(block.mlp, "experts")]


@pytest.mark.parametrize("variant", ["qwen3-moe", "qwen3.5-moe_mm_per_expert"], ids=["fused", "per-expert"])
@pytest.mark.parametrize("layout", ["tensor", "expert"])
def test_each_rank_holds_its_share_of_the_experts(checkpoint_dir, variant, layout):
    """Tensor parallel: rank r holds block r of every expert's gate rows, up rows and down columns;
    expert parallel: experts [r E/2, (r+1) E/2) whole, and reads no tensor of the others'."""
    path = checkpoint_dir(variant)
    cfg = read_config(path)
    full = _expert_blocks(path, 1, False, 0)
    expert_parallel = layout == "expert"
    for rank in range(2):
        for (gate_up, down), (mine_gate_up, mine_down) in zip(full, _expert_blocks(path, 2, expert_parallel, rank)):
            if expert_parallel:
                half = gate_up.shape[0] // 2
                assert torch.equal(mine_gate_up, gate_up[rank * half:(rank + 1) * half])
                assert torch.equal(mine_down, down[rank * half:(rank + 1) * half])
            else:
                inter = gate_up.shape[1] // 2
                block = slice(rank * inter // 2, (rank + 1) * inter // 2)
                assert torch.equal(mine_gate_up, torch.cat([gate_up[:, block], gate_up[:, inter:][:, block]], dim=1))
                assert torch.equal(mine_down, down[:, :, block])
    local = local_config(cfg, 2, expert_parallel)
    assert local.num_experts == cfg.num_experts  # the router is whole on every rank
    assert local.moe_intermediate_size == cfg.moe_intermediate_size // (1 if expert_parallel else 2)
    if variant.endswith("per_expert"):
        plan = shard_plan(cfg, 0, 2, expert_parallel)
        held = [plan(f"model.language_model.layers.0.mlp.experts.{e}.down_proj.weight",
                     (cfg.hidden_size, cfg.moe_intermediate_size)) != NOT_HELD for e in range(cfg.num_experts)]
        assert held == ([e < cfg.num_experts // 2 for e in range(cfg.num_experts)] if expert_parallel
                        else [True] * cfg.num_experts)


def test_an_expert_parallel_rank_loads_only_its_experts(checkpoint_dir):
    """Per-expert checkpoints: the tensors of the other rank's experts are never read into memory."""
    path = checkpoint_dir("qwen3.5-moe_mm_per_expert")
    cfg = read_config(path)
    family = family_of(cfg)
    to_load, _ = family.checkpoint_layout(cfg, path, family.expected_weights(cfg))
    plan = shard_plan(cfg, 1, 2, expert_parallel=True)
    others = {name for name, shape in to_load.items() if plan(name, shape) == NOT_HELD}
    loaded = load_weights(path, {n: s for n, s in to_load.items() if n not in others}, torch.float32, "cpu",
                          skip=lambda name: name in others or family.skip_weight(name), shard=plan)
    experts = {int(name.split("experts.")[1].split(".")[0]) for name in loaded if ".experts." in name}
    assert experts == set(range(cfg.num_experts // 2, cfg.num_experts)) and others


@pytest.fixture(scope="module", params=[("qwen3-moe", "tensor"), ("qwen3-moe", "expert"),
                                        ("qwen3.5-moe_mm_per_expert", "expert"), ("qwen3.5-moe", "tensor"),
                                        ("qwen3-next", "tensor")],
                ids=lambda p: f"{p[0]}-{p[1]}")
def engines(request, checkpoint_dir):
    variant, layout = request.param
    engines = Engines(checkpoint_dir(variant), max_seq_len=MAX_SEQ_LEN, batched_args=LAYOUTS[layout], **OPTIONS)
    yield engines
    engines.close()


@pytest.mark.slow
@settings(max_examples=budget(0.05))
@given(workload=prefix_workloads(VOCAB, max_prompt=160, max_jobs=6, max_tokens=10))
def test_moe_sharded_batched_equals_one_process_serial_bitwise(engines, workload):
    """Random budgets, chunk sizes, snapshot intervals, reuse, arrivals and cancellations, the experts
    split by features or whole: every request's tokens and logprobs are its cold serial run's in one
    process, bit for bit."""
    assert_batch_invariant(engines, workload)


@settings(max_examples=budget(0.05))
@given(workload=preemption_workloads(VOCAB, max_prompt=130, max_jobs=5, max_tokens=10, min_preempts=1))
def test_moe_sharded_preempted_equals_one_process_serial_bitwise(engines, workload):
    """Priorities and forced preemptions (swap and recompute, each rank its own shard): the same bits."""
    assert_batch_invariant(engines, workload)


@pytest.mark.parametrize("layout", ["expert", pytest.param("tensor", marks=pytest.mark.slow)])
def test_without_the_tree_the_sizes_differ(checkpoint_dir, layout):
    """Negative control: each rank combines its own experts' contributions and a plain all-reduce
    adds the ranks' (under expert parallelism: the experts combined rank by rank, not in each token's
    top-k order); the comparison above notices."""
    engines = Engines(checkpoint_dir("qwen3-moe"), max_seq_len=MAX_SEQ_LEN, batched_args=LAYOUTS[layout],
                      **{**OPTIONS, "tree_reduction": False})
    try:
        schedule = Schedule(chunk_size=64, snapshot_interval=64, budget_slack=0, prefix_reuse=True)
        assert mismatches(engines, Workload(tuple(_fixed_jobs()), 2, schedule)) != []
    finally:
        engines.close()


def test_with_default_options_one_process_and_both_layouts_give_the_same_bits(checkpoint_dir):
    """No option set but the layout: one process, TP=2 and EP=2 (batched) give the same tokens,
    logprobs and alternatives; the expert-parallel rank sends fewer bytes than the tensor-parallel one."""
    path = checkpoint_dir("qwen3.5-moe")
    prompts = [[(5 * i + 3 * j) % VOCAB for j in range(n)] for i, n in enumerate((1, 30, 100))]
    params = [SamplingParams(max_tokens=8, temperature=t, seed=i, logprobs=2, ignore_eos=True)
              for i, t in enumerate((0.0, 0.9, 0.0))]

    def run(**args) -> tuple[list, int]:
        with LLM(EngineArgs(model=path, max_seq_len=MAX_SEQ_LEN, backend_options={"enable_batching": True},
                            **args)) as llm:
            assert llm.capabilities.tree_reduction
            results = llm.generate(prompts, params)
            return [(r.token_ids, r.logprobs, r.top_logprobs) for r in results], llm.model.tp.sent_bytes

    one, _ = run()
    tensor, tensor_bytes = run(**LAYOUTS["tensor"])
    expert, expert_bytes = run(**LAYOUTS["expert"])
    assert one == tensor == expert
    assert 0 < expert_bytes < tensor_bytes


def test_bf16_experts_on_dot_products_give_one_process_bits_split_whole(checkpoint_dir):
    """bf16 weights (the experts on bf16 dot products, their down matrices' shards summed by the dot
    kernel's own tree): EP=2 batched equals one process serial."""
    engines = Engines(checkpoint_dir("qwen3-moe"), max_seq_len=MAX_SEQ_LEN, batched_args=LAYOUTS["expert"],
                      engine_args={"weight_dtype": "bfloat16"}, **OPTIONS)
    try:
        assert_batch_invariant(engines, Workload(tuple(_fixed_jobs(3)), 2))
    finally:
        engines.close()


def test_sizes_the_experts_do_not_divide_are_refused_naming_the_field(checkpoint_dir):
    path = checkpoint_dir("qwen3.5-moe_mm_per_expert")  # 6 experts of width 32
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 must divide num_experts=6 "
                                         r"\(enable_expert_parallel=True\)"):
        LLM(EngineArgs(model=path, tensor_parallel_size=4, enable_expert_parallel=True))
    with pytest.raises(ValueError, match="enable_expert_parallel must be True or False, got 'yes'"):
        EngineArgs(model=path, enable_expert_parallel="yes")
    odd = dataclasses.replace(read_config(path), moe_intermediate_size=36)
    with pytest.raises(ValueError, match="moe_intermediate_size=36 does not split into the 8 shards"):
        check_parallel(odd, 2, True, torch.device("cpu"))
    with pytest.raises(ValueError, match="must divide moe_intermediate_size=36"):
        check_parallel(odd, 8, True, torch.device("cpu"))


@pytest.mark.slow  # four ranks on two cores
@pytest.mark.parametrize("layout", ["tensor", "expert"])
def test_size_4_batched_equals_one_process_serial(checkpoint_dir, layout):
    """Four ranks (two experts each, or a quarter of every expert's features), a prefix reused:
    every request's tokens and logprobs are the single-process serial bits."""
    args = {**LAYOUTS[layout], "tensor_parallel_size": 4}
    engines = Engines(checkpoint_dir("qwen3-moe"), max_seq_len=MAX_SEQ_LEN, batched_args=args, **OPTIONS)
    try:
        schedule = Schedule(chunk_size=64, snapshot_interval=64, budget_slack=0, prefix_reuse=True)
        assert_batch_invariant(engines, Workload(tuple(_fixed_jobs(4)), 3, schedule))
    finally:
        engines.close()
