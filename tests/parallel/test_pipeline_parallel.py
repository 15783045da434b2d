"""Pipeline parallelism (`pipeline_parallel_size`): each process holds a block of consecutive layers,
and the engine's tokens and logprobs are one process's, bit for bit, on every family; batched
pipelined runs are compared with single-process serial runs under Hypothesis, as the tensor-parallel
properties are."""

from __future__ import annotations

import pytest
import torch
from helpers import budget
from hypothesis import given, settings
from test_tensor_parallel import _fixed_jobs

from pocketllm import LLM, EngineArgs
from pocketllm.models import read_config
from pocketllm.models.registry import build_model
from pocketllm.op_table import op_table
from pocketllm.parallel.group import TensorParallel
from pocketllm.parallel.pipeline import PipelineStage, stage_layers
from pocketllm.testing import Engines, Schedule, Workload, assert_batch_invariant
from pocketllm.testing.strategies import preemption_workloads, prefix_workloads

VOCAB = 256
MAX_SEQ_LEN = 224
OPTIONS = {"exact_positions": True}
PP2 = {"pipeline_parallel_size": 2}


def test_stages_take_consecutive_layers_the_earlier_ones_more():
    assert [list(stage_layers(4, i, 2)) for i in range(2)] == [[0, 1], [2, 3]]
    assert [list(stage_layers(7, i, 3)) for i in range(3)] == [[0, 1, 2], [3, 4], [5, 6]]
    assert [len(stage_layers(5, i, 5)) for i in range(5)] == [1] * 5


@pytest.mark.parametrize("variant", ["qwen3.5_mm_untied", "qwen3-moe_per_expert"])
def test_a_stage_reads_only_its_layers(checkpoint_dir, variant):
    """A stage's model holds its layers' blocks (their weights those of one process) and the
    embedding, final norm and lm_head; no tensor of another stage's layers is read."""
    path = checkpoint_dir(variant)
    cfg = read_config(path)
    ops = op_table(EngineArgs(model=str(path)))
    whole = build_model(path, cfg, ops, torch.float32, "cpu", 64)
    for index in range(2):
        stage = PipelineStage(index, 2, stage_layers(cfg.num_hidden_layers, index, 2), TensorParallel(index, 2))
        part = build_model(path, cfg, ops, torch.float32, "cpu", 64, TensorParallel(pipeline=stage))
        assert len(part.blocks) == len(stage.layers)
        for mine, theirs in zip(part.blocks, [whole.blocks[i] for i in stage.layers]):
            assert all(torch.equal(a, b) for a, b in zip(mine.mlp.linear_weights(), theirs.mlp.linear_weights()))
        assert torch.equal(part.lm_head, whole.lm_head) and torch.equal(part.embed, whole.embed)


@pytest.fixture(scope="module", params=["qwen3.5", "qwen3-moe_per_expert"])
def engines(request, checkpoint_dir):
    """Two stages batched against one process serial, on a hybrid and on per-expert MoE layers."""
    with Engines(checkpoint_dir(request.param), max_seq_len=MAX_SEQ_LEN, batched_args=PP2, **OPTIONS) as pair:
        yield pair


@pytest.mark.slow
@settings(max_examples=budget(0.05))
@given(workload=prefix_workloads(VOCAB, max_prompt=160, max_jobs=6, max_tokens=10))
def test_pipelined_batched_equals_one_process_serial_bitwise(engines, workload):
    """Random budgets, chunk sizes, snapshot intervals, reuse, arrivals and cancellations over two
    stages: every request's tokens and logprobs are its cold serial run's in one process."""
    assert_batch_invariant(engines, workload)


@settings(max_examples=budget(0.05))
@given(workload=preemption_workloads(VOCAB, max_prompt=130, max_jobs=5, max_tokens=10, min_preempts=1))
def test_pipelined_preempted_equals_one_process_serial_bitwise(engines, workload):
    """Forced preemptions: each stage swaps its layers' slots out and back in; the same bits."""
    assert_batch_invariant(engines, workload)


@pytest.mark.slow  # four processes on two cores
def test_four_stages_equal_one_process(checkpoint_dir):
    """Qwen3.5's four layers one per stage (Gated DeltaNet stages and an attention stage), a
    prefix reused: the single-process serial bits."""
    engines = Engines(checkpoint_dir("qwen3.5"), max_seq_len=MAX_SEQ_LEN,
                      batched_args={"pipeline_parallel_size": 4}, **OPTIONS)
    try:
        schedule = Schedule(chunk_size=64, snapshot_interval=64, budget_slack=0, prefix_reuse=True)
        assert_batch_invariant(engines, Workload(tuple(_fixed_jobs(4)), 3, schedule))
    finally:
        engines.close()


def test_what_a_pipeline_cannot_do_is_refused_naming_the_field(checkpoint_dir):
    path = checkpoint_dir("tiny")  # two layers
    with pytest.raises(ValueError, match="pipeline_parallel_size=3 is more stages than num_hidden_layers=2"):
        LLM(EngineArgs(model=path, pipeline_parallel_size=3))
    with pytest.raises(ValueError, match="pipeline_parallel_size=2 with tensor_parallel_size=2: one of the two"):
        LLM(EngineArgs(model=path, pipeline_parallel_size=2, tensor_parallel_size=2))
    with pytest.raises(ValueError, match=r"pipeline_parallel_size must be an int in \[1, 64\], got 0"):
        EngineArgs(model=path, pipeline_parallel_size=0)
