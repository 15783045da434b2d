"""pocketllm.testing tests itself: each assertion passes on the shipped implementations and fails on a
planted broken one (one key short, a batch-dependent tile, a budget-dependent cut, an off-by-one
sampling position, a cut that rounds differently), and its message names the request or case, the
first differing position, both values with their bits, and a reproduction that fails again when run."""

from __future__ import annotations

import re

import pytest
from hypothesis import find, given, settings

from pocketllm import LLM, EngineArgs, SamplingParams
from pocketllm.scheduler import PrefillPolicy
from pocketllm.testing import (
    ContractViolation,
    Engines,
    Job,
    Schedule,
    Workload,
    assert_batch_invariant,
    assert_matches_reference,
    assert_rows_invariant,
    assert_scoring_matches_generation,
    assert_split_invariant,
    budget,
    op_case,
    planted,
    strategies,
)
from pocketllm.testing.engines import replay

BITS = re.compile(r"0x[0-9a-f]{8}")


def _violation(call) -> str:
    with pytest.raises(ContractViolation) as caught:
        call()
    return str(caught.value)


def _reproduces(message: str) -> None:
    """The message's snippet, run on its own, raises the same violation."""
    snippet = message.split("Reproduce with:\n", 1)[1]
    code = "\n".join(line[4:] for line in snippet.splitlines())
    with pytest.raises(ContractViolation):
        exec(compile(code, "<reproduction>", "exec"), {})


def _jobs(*lengths: int, tokens: int = 6) -> tuple[Job, ...]:
    return tuple(Job(tuple((7 * i + n) % 250 for i in range(n)),
                     SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True), arrival_step=i % 2)
                 for i, n in enumerate(lengths))


def test_batch_invariance_holds_and_a_batch_dependent_tile_is_caught(tiny_checkpoint):
    workload = Workload(_jobs(5, 17, 3, 30, 9), max_batch_size=4)
    with Engines(tiny_checkpoint) as engines:
        assert_batch_invariant(engines, workload)
    with Engines(tiny_checkpoint, invariance_probe=False,
                 engine_args={"op_overrides": {"linear": planted.linear_row_count_dependent}}) as broken:
        message = _violation(lambda: assert_batch_invariant(broken, workload))
    assert message.startswith("batched output differs from the cold serial run for ")
    assert re.search(r"- job \d \(a prompt of \d+ tokens, arriving at step \d.*first difference at generated "
                     r"position \d+: batched token \d+", message), message
    assert len(BITS.findall(message)) >= 2  # both logprobs' bits
    assert "'pocketllm.testing.planted:linear_row_count_dependent'" in message
    _reproduces(message)


def test_engines_keep_their_history_and_replay_runs_it_on_fresh_engines(tiny_checkpoint):
    """What the batched engines ran, in order, replays on other engines: no mismatch on the
    engine, every one of a batch-dependent tile's (a counterexample that needs earlier workloads
    to show is replayed the same way)."""
    workloads = [Workload(_jobs(30, 9), max_batch_size=2), Workload(_jobs(5, 17, 3, 30, 9), max_batch_size=4)]
    with Engines(tiny_checkpoint) as engines:
        for workload in workloads:
            assert_batch_invariant(engines, workload)
        assert engines.history == workloads
    with Engines(tiny_checkpoint) as fresh:
        assert replay(fresh, workloads) == []
    with Engines(tiny_checkpoint, invariance_probe=False,
                 engine_args={"op_overrides": {"linear": planted.linear_row_count_dependent}}) as broken:
        assert replay(broken, workloads) != []


def test_a_budget_dependent_cut_is_caught_without_exact_positions(tiny_checkpoint):
    """Cuts that follow the step's token budget, with a prefill op that rounds a piece's first row
    apart: the cold serial run is cut elsewhere, so the bits differ (with exact positions any cut is
    allowed, so the check runs without them). Whether one workload shows it depends on the weights:
    the first of a few that does is checked. Eight tokens each: every decode step reads the nudged
    rows' keys again (with three, 2 of 15 budgets showed it once the RoPE table moved by an ulp;
    with eight, 14 of 15)."""
    overrides = {"prefill_attention": planted.prefill_attention_first_row_nudged}
    with Engines(tiny_checkpoint, max_seq_len=224, exact_positions=False,
                 engine_args={"op_overrides": overrides}) as engines:
        jobs = _jobs(150, 120, 90, tokens=8)
        on_grid = Workload(jobs, 2, Schedule(chunk_size=64, snapshot_interval=64, budget_slack=0, prefix_reuse=False))
        assert_batch_invariant(engines, on_grid)
        messages = []
        for budget_ in (200, 150, 260, 180, 120, 100):
            cuts = planted.BudgetCuts(max_num_batched_tokens=budget_, chunk_size=0, snapshot_interval=0,
                                      prefix_reuse=False)
            try:
                assert_batch_invariant(engines, Workload(jobs, 2, cuts))
            except ContractViolation as exc:
                messages.append(str(exc))
                break
    assert messages, "budget-dependent cuts changed no output: the assertion cannot see them"
    assert "schedule BudgetCuts(max_num_batched_tokens=" in messages[0]
    assert "from pocketllm.testing.planted import BudgetCuts" in messages[0]
    _reproduces(messages[0])


def test_scoring_matches_generation_and_a_decoded_row_that_rounds_apart_is_caught(tiny_checkpoint):
    params = SamplingParams(max_tokens=8, temperature=0.8, seed=3, logprobs=2, ignore_eos=True)
    prompts = [[1, 2, 3], list(range(40, 110))]
    llm = LLM(EngineArgs(model=str(tiny_checkpoint), max_seq_len=128))
    assert llm.capabilities.exact_positions
    assert_scoring_matches_generation(llm, prompts, params)
    broken = LLM(EngineArgs(model=str(tiny_checkpoint), max_seq_len=128,
                            op_overrides={"decode_attention": planted.decode_attention_nudged}))
    message = _violation(lambda: assert_scoring_matches_generation(broken, prompts, params))
    assert message.startswith("generated logprobs differ from the scores of the same sequences for 2 of 2 prompts")
    value = r"-?[0-9.e-]+ \(0x[0-9a-f]{8}\)"
    assert re.search(rf"- prompt 0 \(3 tokens\): first difference at generated position \d+ \(token \d+, sequence "
                     rf"position \d+\): (logprob {value} generated, {value} scored|alternative \d: token \d+, "
                     rf"logprob {value} generated, token \d+, logprob {value} scored)", message), message
    _reproduces(message)


def test_reference_holds_and_attention_one_key_short_is_caught():
    for impl in ("ref", "fused", "own_order"):
        assert_matches_reference("decode_attention", impl)
    message = _violation(lambda: assert_matches_reference("decode_attention", planted.decode_attention_one_key_short))
    assert re.match(r"decode_attention <- pocketllm\.testing\.planted:decode_attention_one_key_short: \d+ of \d+ "
                    r"cases out of the reference's tolerance", message), message
    assert "max |diff|" in message and "worst at" in message
    _reproduces(message)


def test_an_off_by_one_sampling_position_is_caught():
    assert_matches_reference("sample", "ref")
    message = _violation(lambda: assert_matches_reference("sample", planted.sample_position_off_by_one))
    assert re.search(r"values differ \(first at \[\d+\]\)", message), message
    _reproduces(message)


def test_rows_invariance_holds_and_a_batch_dependent_tile_is_caught():
    case = op_case("linear", 3)  # several members: a batch past the planted tile
    assert len(case.members) >= 4
    assert_rows_invariant("linear", case, "fixed_order")
    message = _violation(lambda: assert_rows_invariant("linear", case, planted.linear_row_count_dependent))
    assert f"linear <- pocketllm.testing.planted:linear_row_count_dependent: batch invariance fails on {case.label}" \
        in message
    assert re.search(r"values differ in their bits; the first at \[\d+, \d+\]: [-0-9.e]+ \(0x[0-9a-f]{8}\) vs", message)
    _reproduces(message)


def test_split_invariance_holds_and_a_cut_that_rounds_apart_is_caught():
    grid = [op_case("prefill_attention", i) for i in range(10)]
    case = next(c for c in grid if any(m.start < 64 < m.start + m.n for m in c.members))  # a member to cut at 64
    assert_split_invariant("prefill_attention", case, "own_order")
    message = _violation(lambda: assert_split_invariant("prefill_attention", case,
                                                        planted.prefill_attention_first_row_nudged))
    assert re.search(r"member \d+: cut at position 64: member 0, out: \d+ of \d+ values differ in their bits", message)
    _reproduces(message)
    with pytest.raises(ValueError, match="linear is not a prefill op"):
        assert_split_invariant("linear", op_case("linear", 0), "ref")


@settings(max_examples=budget(0.5))
@given(workload=strategies.request_streams(300, max_prompt=180, system_prompts=True, priorities=True, preemptions=1,
                                           schedule=True, params=strategies.sampling_params(8, logprobs=True)))
def test_strategies_draw_valid_workloads_whose_repr_is_python(workload):
    namespace = {"Workload": Workload, "Job": Job, "SamplingParams": SamplingParams, "Schedule": Schedule,
                 "PrefillPolicy": PrefillPolicy}
    assert eval(repr(workload), namespace) == workload
    assert 1 <= workload.max_batch_size <= 8 and isinstance(workload.schedule, Schedule)
    for job in workload.jobs:
        assert 1 <= len(job.prompt) <= 180 and all(0 <= t < 300 for t in job.prompt)
        assert 0 <= job.priority <= 2 and 1 <= len(job.preempt_steps) <= 3


@settings(max_examples=budget(0.75))
@given(params=strategies.sampling_params())
def test_sampling_strategies_draw_from_their_boundaries(params):
    assert params.top_k in strategies.TOP_KS and params.top_p in strategies.TOP_PS
    assert params.temperature in strategies.TEMPERATURES


def test_the_checkpoint_strategy_writes_each_preset_once(tmp_path, monkeypatch):
    monkeypatch.setenv("POCKETLLM_CACHE", str(tmp_path))
    first = find(strategies.checkpoints(("tiny",), seed=3), lambda path: True)
    again = find(strategies.checkpoints(("tiny",), seed=3), lambda path: True)
    assert first == again and (first / "config.json").is_file() and tmp_path in first.parents
