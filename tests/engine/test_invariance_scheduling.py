"""The invariance contract under the step scheduler's features: token budgets, chunked prefill,
mixed decode + prefill steps and exact prefix reuse (retained slots, copies from busy slots,
Gated DeltaNet state snapshots). Every request's tokens and logprobs must equal its cold serial
run (reusing nothing, its prompt cut at the same request-local positions) with `==`; a negative
control shows the property would catch cuts that move with the budget.

Why the cold run is cut the same way: the torch backend's prefill attention is torch's fused
attention, one call per piece, whose blocking follows the piece's length, so it is not split
invariant by construction (whether a prompt in one piece and in two differ depends on the CPU).
The pieces themselves, and so the bits, depend only on the request: that is the contract."""

from __future__ import annotations

import random

import pytest
import torch
from helpers import budget, variant_params
from hypothesis import given, settings

from pocketllm import SamplingParams
from pocketllm.scheduler import PrefillPolicy
from pocketllm.testing import Engines, Job, Schedule, Workload, assert_batch_invariant, mismatches, run_batched
from pocketllm.testing.planted import (
    BudgetCuts,
    gated_delta_prefill_first_row_nudged,
    prefill_attention_first_row_nudged,
)
from pocketllm.testing.strategies import prefix_workloads

VOCAB = 256  # the tiny presets
MAX_SEQ_LEN = 224  # prompts up to 200 tokens, 12 new ones

# Qwen3 and Qwen3.5 (attention-only and hybrid) on the torch backend's C++ kernels (exact positions:
# pieces may be cut where a step's budget runs out), and without exact positions (pieces cut on the
# request's grid only) on the MKL tiles and on per-row decode.
VARIANTS = {"tiny": ("tiny", {}), "qwen3.5": ("qwen3.5", {}),
            "tiny_mkl_tiles": ("tiny", {"exact_positions": False}),
            "tiny_per_row": ("tiny", {"decode_per_row": True}),
            "qwen3.5_mm_untied": ("qwen3.5_mm_untied", {}),
            # Mixtures of experts at the full budget (test_invariance_moe.py runs them by default)
            "qwen3-moe_per_expert": ("qwen3-moe_per_expert", {}), "qwen3.5-moe": ("qwen3.5-moe", {})}


@pytest.fixture(scope="module", params=variant_params(VARIANTS, {"qwen3.5_mm_untied", "qwen3-moe_per_expert",
                                                               "qwen3.5-moe", "tiny_per_row", "tiny_mkl_tiles"}))
def engines(request, checkpoint_dir):
    variant, options = VARIANTS[request.param]
    engines = Engines(checkpoint_dir(variant), max_seq_len=MAX_SEQ_LEN, **options)
    yield engines
    engines.close()


# The contract is the product's signature: three times the profile's examples, as the other property.
@settings(max_examples=3 * budget())
@given(workload=prefix_workloads(VOCAB))
def test_chunked_mixed_and_reused_equals_cold_serial_bitwise(engines, workload):
    """Random budgets, chunk sizes, snapshot intervals and reuse, shared system prompts, arrivals
    and cancellations: every request equals its cold serial run, bit for bit."""
    assert_batch_invariant(engines, workload)


def _system_prompt_jobs(rng: random.Random, systems: int = 2, jobs: int = 10) -> tuple[Job, ...]:
    prefixes = [[rng.randrange(VOCAB) for _ in range(rng.randint(130, 150))] for _ in range(systems)]
    return tuple(Job(tuple(prefixes[i % systems] + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 30))]),
                     SamplingParams(max_tokens=rng.randint(2, 10), temperature=rng.choice([0.0, 0.8]),
                                    seed=rng.randrange(2**32), ignore_eos=True),
                     arrival_step=rng.randint(0, 6), cancel_step=None)
                 for i in range(jobs))


@pytest.mark.parametrize("variant", ["tiny", "qwen3.5"])
def test_reuse_happens_from_retained_and_busy_slots(checkpoint_dir, variant):
    """The property above is not vacuous: on system-prompt traffic the scheduler reuses prefixes,
    both by taking a retained slot and by copying from a busy one, chunks prompts and mixes steps;
    and every output still equals its cold serial run."""
    engines = Engines(checkpoint_dir(variant), max_seq_len=MAX_SEQ_LEN)
    try:
        jobs = _system_prompt_jobs(random.Random(3))
        schedule = Schedule(chunk_size=64, snapshot_interval=64, budget_slack=0, prefix_reuse=True)
        assert_batch_invariant(engines, Workload(jobs, 3, schedule))
        # Again, on the slots the first round left: every prompt now finds its system prompt.
        assert_batch_invariant(engines, Workload(jobs, 3, schedule))
        stats = engines.scheduler(3).get_stats()
        assert stats.prefix_hits >= len(jobs) and stats.prefix_copies > 0
        assert stats.prefix_tokens_reused >= 128 * len(jobs)
        assert stats.mixed_steps > 0 and stats.prefill_chunks > 2 * len(jobs)
        if variant == "qwen3.5":
            assert stats.state_snapshot_bytes > 0
    finally:
        engines.close()


# What makes a cut show in the bits, by construction on every machine (the torch ops are otherwise
# split invariant or torch's choice; Qwen3.5's Gated DeltaNet runs token by token), pocketllm.testing.planted:
# a prefill op whose pieces round their first row differently, attention on Qwen3, the Gated DeltaNet
# rule on Qwen3.5 (its one attention layer is the last, where a row's output reaches no other row).
CUT_SENSITIVE = {"tiny": {"op_overrides": {"prefill_attention": prefill_attention_first_row_nudged}},
                 "qwen3.5": {"op_overrides": {"gated_delta_prefill": gated_delta_prefill_first_row_nudged}}}


@pytest.mark.parametrize("variant", sorted(CUT_SENSITIVE))
def test_negative_control_budget_dependent_cuts(checkpoint_dir, variant):
    """With cuts that depend on the budget the same comparison fails: the property has teeth on
    both model families. Passes when a counterexample is found."""
    engines = Engines(checkpoint_dir(variant), max_seq_len=MAX_SEQ_LEN, engine_args=CUT_SENSITIVE[variant],
                      exact_positions=False)  # with exact positions a budget cut is allowed: any cut is exact
    rng = random.Random(0)
    try:
        for _ in range(10):
            jobs = tuple(Job(tuple(rng.randrange(VOCAB) for _ in range(rng.randint(40, 200))),
                             SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)) for _ in range(3))
            policy = BudgetCuts(max_num_batched_tokens=rng.choice([150, 200, 260]), chunk_size=0,
                                snapshot_interval=0, prefix_reuse=False)
            if mismatches(engines, Workload(jobs, 2, policy)):
                return
        pytest.fail("budget-dependent cuts changed no output: the property cannot see them")
    finally:
        engines.close()


def test_run_batched_runs_on_the_given_policy(checkpoint_dir):
    """A policy passed to run_batched is the one the scheduler runs on."""
    engines = Engines(checkpoint_dir("tiny"), max_seq_len=MAX_SEQ_LEN)
    try:
        policy = PrefillPolicy(max_num_batched_tokens=200, chunk_size=64)
        run_batched(engines, Workload((Job(tuple(range(150)), SamplingParams(max_tokens=1)),), 2, policy))
        scheduler = engines.scheduler(2)
        assert scheduler.policy is policy and scheduler.get_stats().prefill_chunks == 3
    finally:
        engines.close()


# The Triton backend under the interpreter: one short example per family (about a second a forward).
TRITON_EXAMPLES = budget() if torch.cuda.is_available() else 1


@pytest.fixture(scope="module", params=["tiny", "qwen3.5"])
def triton_engines(request, checkpoint_dir):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    engines = Engines(checkpoint_dir(request.param), max_seq_len=MAX_SEQ_LEN,
                      engine_args={"backend": "triton", "device": device})
    yield engines
    engines.close()


@pytest.mark.slow
@settings(max_examples=TRITON_EXAMPLES)
@given(workload=prefix_workloads(VOCAB, max_prompt=100, max_jobs=3, max_tokens=3))
def test_triton_backend_chunked_and_reused_equals_cold_serial(triton_engines, workload):
    assert_batch_invariant(triton_engines, workload)
