"""The invariance contract on the mixtures of experts (Qwen3-MoE, Qwen3.5-MoE): a token's experts
are chosen from its own logits (ties by the lower expert index), each expert's rows are multiplied
in fixed tiles, and its contributions are summed in rank order, so its bits never depend on which
other tokens chose the same experts. Random workloads through the batch scheduler (arrivals,
cancellations, chunked prefill, prefix reuse, priorities and swap preemption) equal each request's
cold serial run with `==`; positions are exact (decoded, prefilled in any piece, scored) with
`exact_positions` on the torch backend and on the triton backend (its grouped-GEMM kernel,
interpreted here). A negative control sums the contributions in the order the batch's expert groups
are visited and must be caught.

These run at a fraction of the profile's budget in the default run; the full-budget runs of the
same properties are the MoE variants of test_invariance*.py, under `slow`."""

from __future__ import annotations

import random

import pytest
from helpers import budget, greedy_jobs, variant_params
from hypothesis import given, settings
from test_exact_positions import _engine, _mismatch
from test_exact_positions_hybrid import _fresh_slots, sequences

from pocketllm import SamplingParams
from pocketllm.testing import Engines, Job, Workload, assert_batch_invariant, mismatches
from pocketllm.testing.planted import moe_grouping_order
from pocketllm.testing.strategies import preemption_workloads, prefix_workloads, workloads

VOCAB = 256  # the tiny presets
MAX_SEQ_LEN = 224

# (checkpoint variant, backend options): both families; the torch backend with exact positions too.
VARIANTS = {"qwen3-moe": ("qwen3-moe", {}), "qwen3.5-moe": ("qwen3.5-moe", {}), "qwen3-next": ("qwen3-next", {}),
            "qwen3-moe_exact": ("qwen3-moe_per_expert", {"exact_positions": True})}


@pytest.fixture(scope="module", params=variant_params(VARIANTS, {"qwen3-moe_exact"}))  # exact: also below
def engines(request, checkpoint_dir):
    variant, options = VARIANTS[request.param]
    engines = Engines(checkpoint_dir(variant), max_seq_len=MAX_SEQ_LEN, **options)
    yield engines
    engines.close()


@settings(max_examples=budget(0.25))
@given(workload=workloads(VOCAB, max_jobs=8, max_tokens=12))
def test_moe_batched_equals_serial_bitwise(engines, workload):
    assert_batch_invariant(engines, workload)


@settings(max_examples=budget(0.25))
@given(workload=prefix_workloads(VOCAB, max_jobs=6))
def test_moe_chunked_and_reused_equals_cold_serial_bitwise(engines, workload):
    assert_batch_invariant(engines, workload)


@settings(max_examples=budget(0.1))
@given(workload=preemption_workloads(VOCAB, max_prompt=130, max_jobs=6, max_tokens=12))
def test_moe_preempted_and_prioritised_equals_uninterrupted_serial_bitwise(engines, workload):
    assert_batch_invariant(engines, workload)


@settings(max_examples=budget(0.1))
@given(case=sequences)
def test_moe_positions_are_exact_property(checkpoint_dir, case):
    """Random sequences and cuts on the hybrid MoE: every position's scores equal decoded, cut or whole."""
    tokens, cuts = case
    assert _mismatch(_hybrid_engine(checkpoint_dir("qwen3.5-moe")), tokens, cuts) is None


_ENGINES: dict = {}


def _hybrid_engine(path):
    if str(path) not in _ENGINES:
        _ENGINES[str(path)] = _fresh_slots(_engine(path, "torch"))
    return _ENGINES[str(path)]


@pytest.mark.parametrize("variant", ["qwen3-moe", "qwen3.5-moe", "qwen3-next"])
def test_moe_positions_are_exact_on_the_torch_backend(checkpoint_dir, variant):
    """Cuts off the chunk grid, a sequence crossing position 64, every position decoded too."""
    llm = _fresh_slots(_engine(checkpoint_dir(variant), "torch"))
    assert _mismatch(llm, [(13 * i + 5) % 256 for i in range(75)], [3, 40, 66]) is None


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["qwen3-moe", "qwen3.5-moe"])
def test_moe_positions_are_exact_on_the_triton_backend(checkpoint_dir, variant):
    llm = _fresh_slots(_engine(checkpoint_dir(variant), "triton"))
    assert _mismatch(llm, [(13 * i + 5) % 256 for i in range(7)], [3]) is None


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["qwen3-moe", "qwen3.5-moe_mm_per_expert"])
def test_moe_triton_backend_batched_equals_serial_bitwise(checkpoint_dir, variant):
    """Interpreted: a few short requests through 3 slots."""
    engines = Engines(checkpoint_dir(variant), engine_args={"backend": "triton"})
    rng = random.Random(4)
    try:
        jobs = [Job(tuple(rng.randrange(VOCAB) for _ in range(rng.randint(1, 8))),
                    SamplingParams(max_tokens=rng.randint(2, 4), temperature=rng.choice([0.0, 0.8]),
                                   seed=rng.randrange(2**32), ignore_eos=True),
                    arrival_step=rng.randint(0, 2), cancel_step=None) for _ in range(4)]
        assert_batch_invariant(engines, Workload(tuple(jobs), 3))
    finally:
        engines.close()


def test_negative_control_contributions_summed_in_grouping_order(checkpoint_dir):
    """A moe that sums a token's contributions in the order its batch's expert groups are visited
    (pocketllm.testing.planted) fails the batched == serial property: the check has teeth."""
    engines = Engines(checkpoint_dir("qwen3-moe"), invariance_probe=False,
                      engine_args={"op_overrides": {"moe": moe_grouping_order}})
    rng = random.Random(0)
    try:
        for _ in range(20):
            if mismatches(engines, Workload(greedy_jobs(rng, VOCAB, max_tokens=12, max_jobs=6), max_batch_size=6)):
                return
        pytest.fail("no counterexample with contributions summed in grouping order: the property cannot see it")
    finally:
        engines.close()
