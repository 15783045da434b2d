"""pocketllm.testing checks its arguments at its boundary: each misuse of a public entry point
(strategies, the Engines factory and its methods, Job / Workload / Schedule, the assertions, the
message helpers) raises TypeError (a value of the wrong kind) or ValueError (out of range) whose
message names the entry point and the parameter, before Hypothesis or an engine sees the value.

Strategies are called, not drawn from: the check must happen when the strategy is made. No engine
is built: `Engines.__new__(Engines)` and `LLM.__new__(LLM)` are instances that built nothing, which
is enough, since every check runs before an engine is touched."""

from __future__ import annotations

import re
from collections import deque

import numpy as np
import pytest
import torch

from pocketllm import LLM, SamplingParams
from pocketllm.outputs import GenerationResult
from pocketllm.scheduler import PrefillPolicy
from pocketllm.testing import (
    Engines,
    Job,
    Mismatch,
    Schedule,
    Workload,
    assert_batch_invariant,
    assert_matches_reference,
    assert_rows_invariant,
    assert_scoring_matches_generation,
    assert_split_invariant,
    budget,
    find_mismatches,
    mismatches,
    op_case,
    run_batched,
    strategies,
)
from pocketllm.testing.engines import as_policy, first_difference
from pocketllm.testing.explain import describe_mismatch, fp32_bits, reproduction, workload_source

P = SamplingParams(max_tokens=2)
J = Job((1, 2, 3), P)
W = Workload((J,), 2)
S = Schedule(64, 64, 0, True)
BARE_ENGINES = Engines.__new__(Engines)
BARE_LLM = LLM.__new__(LLM)
LINEAR = op_case("linear", 0)
NORM = op_case("rms_norm", 0)
PREFILL = op_case("prefill_attention", 0)
RESULT = GenerationResult(request_id=0, prompt_tokens=[1])
PAST_THE_JOBS = Mismatch(job=3, position=0, batched=None, serial=None, batched_result=RESULT, serial_result=RESULT)
CHECKPOINT = "<a directory with a config.json>"  # replaced by one in the test


def misuse(fn, exc, fragment, **kwargs):
    return pytest.param(fn, kwargs, exc, fragment, id=fragment)


STRATEGIES = [
    misuse(strategies.sampling_params, ValueError, "sampling_params: max_tokens must be an int >= 1, got 0",
           max_tokens=0),
    misuse(strategies.sampling_params, TypeError, "sampling_params: max_tokens must be an int >= 1, got str",
           max_tokens="8"),
    misuse(strategies.sampling_params, TypeError, "sampling_params: logprobs must be a bool", logprobs=3),
    misuse(strategies.prompts, ValueError, "prompts: vocab must be an int >= 1, got 0", vocab=0),
    misuse(strategies.prompts, TypeError, "prompts: vocab must be an int >= 1, got NoneType", vocab=None),
    misuse(strategies.prompts, TypeError, "prompts: vocab must be an int >= 1, got float", vocab=256.0),
    misuse(strategies.prompts, ValueError, "prompts: max_len must be an int >= 1", vocab=10, max_len=0),
    misuse(strategies.prompts, ValueError, "prompts: min_len must be an int >= 0, got -1", vocab=10, min_len=-1),
    misuse(strategies.prompts, ValueError, "prompts: max_len must be an int >= 1 and >= min_len (5), got 3",
           vocab=10, max_len=3, min_len=5),
    misuse(strategies.request_streams, ValueError, "request_streams: vocab must be an int >= 1, got 0", vocab=0),
    misuse(strategies.request_streams, ValueError, "request_streams: max_prompt must be an int >= 1, got 0",
           vocab=256, max_prompt=0),
    misuse(strategies.request_streams, ValueError, "request_streams: max_jobs must be an int >= 1, got 0",
           vocab=256, max_jobs=0),
    misuse(strategies.request_streams, ValueError, "request_streams: max_tokens must be an int >= 1, got 0",
           vocab=256, max_tokens=0),
    misuse(strategies.request_streams, ValueError, "request_streams: max_batch_size must be an int >= 1, got 0",
           vocab=256, max_batch_size=0),
    misuse(strategies.request_streams, ValueError, "request_streams: preemptions must be None or an int >= 0, got -1",
           vocab=256, preemptions=-1),
    misuse(strategies.request_streams, TypeError, "request_streams: preemptions must be None or an int >= 0, got bool",
           vocab=256, preemptions=True),
    misuse(strategies.request_streams, TypeError, "request_streams: system_prompts must be a bool", vocab=256,
           system_prompts="yes"),
    misuse(strategies.request_streams, TypeError, "request_streams: priorities must be a bool", vocab=256,
           priorities=1),
    misuse(strategies.request_streams, TypeError, "request_streams: schedule must be a bool", vocab=256, schedule=S),
    misuse(strategies.request_streams, TypeError, "request_streams: params must be None or a Hypothesis strategy",
           vocab=256, params=P),
    misuse(strategies.workloads, ValueError, "workloads: vocab must be an int >= 1, got 0", vocab=0),
    misuse(strategies.workloads, ValueError, "workloads: max_prompt must be an int >= 1, got -3", vocab=256,
           max_prompt=-3),
    misuse(strategies.workloads, ValueError, "workloads: max_jobs must be an int >= 1, got 0", vocab=256, max_jobs=0),
    misuse(strategies.workloads, ValueError, "workloads: max_tokens must be an int >= 1, got 0", vocab=256,
           max_tokens=0),
    misuse(strategies.prefix_workloads, ValueError, "prefix_workloads: vocab must be an int >= 1, got 0", vocab=0),
    misuse(strategies.prefix_workloads, ValueError, "prefix_workloads: max_jobs must be an int >= 1, got 0",
           vocab=256, max_jobs=0),
    misuse(strategies.prefix_workloads, TypeError, "prefix_workloads: max_tokens must be an int >= 1, got NoneType",
           vocab=256, max_tokens=None),
    misuse(strategies.preemption_workloads, ValueError, "preemption_workloads: min_preempts must be an int >= 0",
           vocab=256, min_preempts=-1),
    misuse(strategies.preemption_workloads, TypeError, "preemption_workloads: vocab must be an int >= 1, got str",
           vocab="256"),
    misuse(strategies.preemption_workloads, ValueError, "preemption_workloads: max_prompt must be an int >= 1",
           vocab=256, max_prompt=0),
    misuse(strategies.checkpoints, TypeError, "checkpoints: presets must be a non-empty tuple of preset names, got str",
           presets="tiny"),
    misuse(strategies.checkpoints, ValueError, "checkpoints: presets must be a non-empty tuple of preset names, got ()",
           presets=()),
    misuse(strategies.checkpoints, ValueError, "checkpoints: presets[1] must be one of", presets=("tiny", "tiniest")),
    misuse(strategies.checkpoints, ValueError, "checkpoints: seed must be an int >= 0, got -1", seed=-1),
    misuse(strategies.checkpoints, TypeError, "checkpoints: seed must be an int >= 0, got str", seed="0"),
    misuse(strategies.op_cases, ValueError, "op_cases: op must be one of", op="attention"),
    misuse(strategies.op_cases, TypeError, "op_cases: op must be one of", op=None),
    misuse(strategies.op_cases, TypeError, "op_cases: dtypes must be a non-empty tuple of torch dtype names such as "
           "('float32',), got str", op="linear", dtypes="float32"),
    misuse(strategies.op_cases, ValueError, "op_cases: dtypes must be a non-empty tuple of torch dtype names such as "
           "('float32',), got ()", op="linear", dtypes=()),
    misuse(strategies.op_cases, ValueError, "op_cases: dtypes[0] must be the name of a torch dtype", op="linear",
           dtypes=("float33",)),
    misuse(strategies.op_cases, TypeError, "op_cases: dtypes[0] must be the name of a torch dtype", op="linear",
           dtypes=(torch.float32,)),
]

RECORDS = [
    misuse(Schedule, ValueError, "Schedule: chunk_size must be 0 or a positive multiple of 64, got 10", chunk_size=10,
           snapshot_interval=64, budget_slack=0, prefix_reuse=True),
    misuse(Schedule, ValueError, "Schedule: snapshot_interval must be 0 or a positive multiple of 64", chunk_size=64,
           snapshot_interval=-64, budget_slack=0, prefix_reuse=True),
    misuse(Schedule, ValueError, "Schedule: budget_slack must be an int >= 0, got -1", chunk_size=64,
           snapshot_interval=64, budget_slack=-1, prefix_reuse=True),
    misuse(Schedule, TypeError, "Schedule: prefix_reuse must be a bool", chunk_size=64, snapshot_interval=64,
           budget_slack=0, prefix_reuse="yes"),
    misuse(Schedule.policy, ValueError, "Schedule.policy: max_batch_size must be an int >= 1, got 0", self=S,
           max_batch_size=0, max_seq_len=96),
    misuse(Schedule.policy, TypeError, "Schedule.policy: max_seq_len must be an int >= 1, got NoneType", self=S,
           max_batch_size=2, max_seq_len=None),
    misuse(Job, TypeError, "Job: prompt must be a non-empty tuple of token ids, got list", prompt=[1, 2], params=P),
    misuse(Job, ValueError, "Job: prompt must be a non-empty tuple of token ids, got ()", prompt=(), params=P),
    misuse(Job, TypeError, "Job: prompt must be a non-empty tuple of token ids, got str", prompt="hello", params=P),
    misuse(Job, ValueError, "Job: prompt[1] must be an int >= 0, got -2", prompt=(1, -2), params=P),
    misuse(Job, TypeError, "Job: prompt[0] must be an int >= 0, got str", prompt=("a",), params=P),
    misuse(Job, TypeError, "Job: params must be a SamplingParams, got NoneType", prompt=(1,), params=None),
    misuse(Job, TypeError, "Job: params must be a SamplingParams, got dict", prompt=(1,), params={"max_tokens": 2}),
    misuse(Job, ValueError, "Job: arrival_step must be an int >= 0, got -1", prompt=(1,), params=P, arrival_step=-1),
    misuse(Job, ValueError, "Job: cancel_step must be None or an int >= 0, got -1", prompt=(1,), params=P,
           cancel_step=-1),
    misuse(Job, TypeError, "Job: priority must be an int, got str", prompt=(1,), params=P, priority="high"),
    misuse(Job, TypeError, "Job: preempt_steps must be a tuple of steps", prompt=(1,), params=P, preempt_steps=3),
    misuse(Job, ValueError, "Job: preempt_steps[0] must be an int >= 0, got -1", prompt=(1,), params=P,
           preempt_steps=(-1,)),
    misuse(Workload, ValueError, "Workload: jobs must be a non-empty tuple of Job, got ()", jobs=(), max_batch_size=2),
    misuse(Workload, TypeError, "Workload: jobs must be a non-empty tuple of Job, got Job", jobs=J, max_batch_size=2),
    misuse(Workload, TypeError, "Workload: jobs[0] must be a Job, got tuple", jobs=((1, 2, 3),), max_batch_size=2),
    misuse(Workload, ValueError, "Workload: max_batch_size must be an int >= 1, got 0", jobs=(J,), max_batch_size=0),
    misuse(Workload, TypeError, "Workload: schedule must be a Schedule, a PrefillPolicy or None, got str",
           jobs=(J,), max_batch_size=2, schedule="chunked"),
]

ENGINES = [
    misuse(Engines, TypeError, "Engines: path must be a checkpoint directory (a str or Path), got NoneType",
           path=None),
    misuse(Engines, ValueError, "Engines: path must be a checkpoint directory (one with a config.json), got "
           "'/nonexistent/checkpoint'", path="/nonexistent/checkpoint"),
    misuse(Engines, ValueError, "Engines: max_seq_len must be an int >= 2, got 0", path=CHECKPOINT, max_seq_len=0),
    misuse(Engines, TypeError, "Engines: max_seq_len must be an int >= 2, got str", path=CHECKPOINT,
           max_seq_len="96"),
    misuse(Engines, TypeError, "Engines: engine_args must be None or a dict of EngineArgs fields, got list",
           path=CHECKPOINT, engine_args=["op_overrides"]),
    misuse(Engines, ValueError, "Engines: engine_args must not set 'max_seq_len'", path=CHECKPOINT,
           engine_args={"max_seq_len": 128}),
    misuse(Engines, ValueError, "Engines: engine_args keys must be one of", path=CHECKPOINT,
           engine_args={"op_override": {}}),
    misuse(Engines, ValueError, "Engines: batched_args keys must be one of", path=CHECKPOINT,
           batched_args={"tensor_parallel": 2}),
    misuse(Engines.scheduler, ValueError, "Engines.scheduler: max_batch_size must be an int >= 1, got 0",
           self=BARE_ENGINES, max_batch_size=0),
    misuse(Engines.scheduler, TypeError, "Engines.scheduler: max_batch_size must be an int >= 1, got str",
           self=BARE_ENGINES, max_batch_size="4"),
    misuse(Engines.serial_result, TypeError, "Engines.serial_result: job must be a Job, got tuple",
           self=BARE_ENGINES, job=(1, 2, 3)),
    misuse(Engines.serial_result, TypeError, "Engines.serial_result: policy must be None or a PrefillPolicy (a "
           "Schedule's is schedule.policy(max_batch_size, max_seq_len)), got Schedule", self=BARE_ENGINES, job=J,
           policy=S),
    misuse(Engines.serial_output, TypeError, "Engines.serial_output: job must be a Job, got Workload",
           self=BARE_ENGINES, job=W),
    misuse(run_batched, TypeError, "run_batched: engines must be an Engines, got str", engines="tiny", workload=W),
    misuse(run_batched, TypeError, "run_batched: workload must be a Workload, got list", engines=BARE_ENGINES,
           workload=[J]),
    misuse(find_mismatches, TypeError, "find_mismatches: engines must be an Engines, got LLM", engines=BARE_LLM,
           workload=W),
    misuse(find_mismatches, TypeError, "find_mismatches: workload must be a Workload, got tuple",
           engines=BARE_ENGINES, workload=(J,)),
    misuse(mismatches, TypeError, "mismatches: engines must be an Engines, got NoneType", engines=None, workload=W),
    misuse(mismatches, TypeError, "mismatches: workload must be a Workload, got Job", engines=BARE_ENGINES,
           workload=J),
    misuse(first_difference, TypeError, "first_difference: batched must be a GenerationResult, got list",
           batched=[1, 2], serial=RESULT, prefix_only=False),
    misuse(first_difference, TypeError, "first_difference: prefix_only must be a bool", batched=RESULT,
           serial=RESULT, prefix_only="no"),
    misuse(as_policy, TypeError, "as_policy: schedule must be a Schedule, a PrefillPolicy or None, got str",
           schedule="chunked", max_batch_size=2, max_seq_len=96),
]

ASSERTIONS = [
    misuse(assert_batch_invariant, TypeError, "assert_batch_invariant: engines must be an Engines, got str",
           engines="tiny", workload=W),
    misuse(assert_batch_invariant, TypeError, "assert_batch_invariant: engines must be an Engines, got LLM",
           engines=BARE_LLM, workload=W),
    misuse(assert_batch_invariant, TypeError, "assert_batch_invariant: workload must be a Workload, got tuple",
           engines=BARE_ENGINES, workload=(J,)),
    misuse(assert_batch_invariant, TypeError, "assert_batch_invariant: workload must be a Workload, got NoneType",
           engines=BARE_ENGINES, workload=None),
    misuse(assert_scoring_matches_generation, TypeError, "assert_scoring_matches_generation: llm must be an LLM (an "
           "Engines' serial engine is engines.serial), got Engines", llm=BARE_ENGINES, prompts=[[1, 2]], params=P),
    misuse(assert_scoring_matches_generation, TypeError, "assert_scoring_matches_generation: llm must be an LLM (an "
           "Engines' serial engine is engines.serial), got str", llm="tiny", prompts=[[1, 2]], params=P),
    misuse(assert_scoring_matches_generation, TypeError, "assert_scoring_matches_generation: prompts[0] must be a "
           "sequence of token ids, got int", llm=BARE_LLM, prompts=[1, 2, 3], params=P),
    misuse(assert_scoring_matches_generation, TypeError, "assert_scoring_matches_generation: prompts must be a "
           "non-empty list of prompts, got str", llm=BARE_LLM, prompts="hello", params=P),
    misuse(assert_scoring_matches_generation, ValueError, "assert_scoring_matches_generation: prompts must be a "
           "non-empty list of prompts, got []", llm=BARE_LLM, prompts=[], params=P),
    misuse(assert_scoring_matches_generation, TypeError, "assert_scoring_matches_generation: prompts[1] must be a "
           "sequence of token ids, got str", llm=BARE_LLM, prompts=[[1], "two"], params=P),
    misuse(assert_scoring_matches_generation, TypeError, "assert_scoring_matches_generation: params must be a "
           "SamplingParams, got NoneType", llm=BARE_LLM, prompts=[[1, 2]], params=None),
    misuse(assert_scoring_matches_generation, TypeError, "assert_scoring_matches_generation: params must be a "
           "SamplingParams, got dict", llm=BARE_LLM, prompts=[[1, 2]], params={"max_tokens": 4}),
    misuse(assert_matches_reference, ValueError, "assert_matches_reference: op must be one of", op="attention",
           impl="ref"),
    misuse(assert_matches_reference, TypeError, "assert_matches_reference: impl must be a registered name, "
           "'module:function' or a callable, got NoneType", op="linear", impl=None),
    misuse(assert_matches_reference, TypeError, "assert_matches_reference: dtype must be the name of a torch dtype",
           op="linear", impl="ref", dtype=torch.float32),
    misuse(assert_matches_reference, ValueError, "assert_matches_reference: dtype must be the name of a torch dtype",
           op="linear", impl="ref", dtype="float33"),
    misuse(assert_matches_reference, ValueError, "assert_matches_reference: cases must be None or a non-empty list of "
           "cases, got []", op="linear", impl="ref", cases=[]),
    misuse(assert_matches_reference, TypeError, "assert_matches_reference: cases must be None or a non-empty list of "
           "cases, got Case", op="linear", impl="ref", cases=LINEAR),
    misuse(assert_matches_reference, TypeError, "assert_matches_reference: cases[0] must be a Case, got int",
           op="linear", impl="ref", cases=[0]),
    misuse(assert_matches_reference, ValueError, "assert_matches_reference: cases[0] must be a case of op 'linear', "
           "got one of 'rms_norm'", op="linear", impl="ref", cases=[NORM]),
    misuse(assert_matches_reference, ValueError, "assert_matches_reference: device must be 'cpu' or 'cuda[:index]'",
           op="linear", impl="ref", device="gpu"),
    misuse(assert_rows_invariant, TypeError, "assert_rows_invariant: case must be a Case, got int", op="linear",
           case=3, impl="ref"),
    misuse(assert_rows_invariant, TypeError, "assert_rows_invariant: case must be a Case, got str", op="linear",
           case="ref", impl=LINEAR),
    misuse(assert_rows_invariant, ValueError, "assert_rows_invariant: case must be a case of op 'linear', got one of "
           "'rms_norm'", op="linear", case=NORM, impl="ref"),
    misuse(assert_rows_invariant, ValueError, "assert_rows_invariant: op must be one of", op="matmul", case=LINEAR,
           impl="ref"),
    misuse(assert_rows_invariant, TypeError, "assert_rows_invariant: impl must be a registered name", op="linear",
           case=LINEAR, impl=3),
    misuse(assert_rows_invariant, TypeError, "assert_rows_invariant: device must be 'cpu' or 'cuda[:index]'",
           op="linear", case=LINEAR, impl="ref", device=0),
    misuse(assert_split_invariant, TypeError, "assert_split_invariant: case must be a Case, got list",
           op="prefill_attention", case=[PREFILL], impl="ref"),
    misuse(assert_split_invariant, ValueError, "assert_split_invariant: case must be a case of op "
           "'prefill_attention', got one of 'linear'", op="prefill_attention", case=LINEAR, impl="ref"),
    misuse(assert_split_invariant, TypeError, "assert_split_invariant: impl must be a registered name",
           op="prefill_attention", case=PREFILL, impl=None),
    misuse(assert_split_invariant, ValueError, "assert_split_invariant: device must be 'cpu' or 'cuda[:index]'",
           op="prefill_attention", case=PREFILL, impl="ref", device="tpu"),
    misuse(op_case, ValueError, "op_case: op must be one of", op="attention", index=0),
    misuse(op_case, ValueError, "op_case: index must be an int in [0, ", op="linear", index=-1),
    misuse(op_case, ValueError, "op_case: index must be an int in [0, ", op="linear", index=10**6),
    misuse(op_case, TypeError, "op_case: index must be an int in [0, ", op="linear", index="3"),
    misuse(op_case, ValueError, "op_case: dtype must be the name of a torch dtype", op="linear", index=0, dtype="fp32"),
    misuse(budget, ValueError, "budget: fraction must be a finite number > 0, got 0", fraction=0),
    misuse(budget, ValueError, "budget: fraction must be a finite number > 0, got -0.5", fraction=-0.5),
    misuse(budget, ValueError, "budget: fraction must be a finite number > 0, got nan", fraction=float("nan")),
    misuse(budget, TypeError, "budget: fraction must be a finite number > 0, got str", fraction="0.5"),
    misuse(budget, TypeError, "budget: fraction must be a finite number > 0, got bool", fraction=True),
]

MESSAGES = [
    misuse(fp32_bits, TypeError, "fp32_bits: value must be a real number, got str", value="-1.5"),
    misuse(fp32_bits, ValueError, "fp32_bits: value must be a real number within fp32's range", value=1e300),
    misuse(describe_mismatch, TypeError, "describe_mismatch: m must be a Mismatch, got str", m="job 0", workload=W),
    misuse(describe_mismatch, TypeError, "describe_mismatch: workload must be a Workload, got tuple",
           m=PAST_THE_JOBS, workload=(J,)),
    misuse(describe_mismatch, ValueError, "describe_mismatch: m.job must be an int in [0, 0], got 3", m=PAST_THE_JOBS,
           workload=W),
    misuse(reproduction, TypeError, "reproduction: call must be a str", call=None),
    misuse(reproduction, TypeError, "reproduction: imports must be a tuple of import lines (str), got str",
           call="f()", imports="import os"),
    misuse(reproduction, TypeError, "reproduction: engines must be Python source (a str), got Engines", call="f()",
           engines=BARE_ENGINES),
    misuse(workload_source, TypeError, "workload_source: workload must be a Workload, got list", workload=[J]),
]


@pytest.fixture
def checkpoint_like(tmp_path):
    """A directory that has a config.json (an empty one: no engine could be built from it)."""
    (tmp_path / "config.json").write_text("{}")
    return str(tmp_path)


@pytest.mark.parametrize("fn,kwargs,exc,fragment", STRATEGIES + RECORDS + ENGINES + ASSERTIONS + MESSAGES)
def test_a_misuse_is_refused_naming_the_parameter(fn, kwargs, exc, fragment, checkpoint_like):
    kwargs = {name: checkpoint_like if value is CHECKPOINT else value for name, value in kwargs.items()}
    with pytest.raises(exc, match=re.escape(fragment)):
        fn(**kwargs)


VALID = [
    pytest.param(strategies.prompts, dict(vocab=1, max_len=1), id="prompts of one token over a vocabulary of one"),
    pytest.param(strategies.prompts, dict(vocab=np.int64(300), max_len=4, min_len=0), id="numpy ints, empty prompts"),
    pytest.param(strategies.prompts, dict(vocab=10, max_len=5, min_len=5), id="prompts of one length"),
    pytest.param(strategies.request_streams, dict(vocab=1, max_prompt=1, max_jobs=1, max_tokens=1, max_batch_size=1,
                                                  preemptions=0, params=strategies.sampling_params(1)),
                 id="the smallest request streams"),
    pytest.param(strategies.preemption_workloads, dict(vocab=256, min_preempts=5), id="more preemptions than 3"),
    pytest.param(strategies.checkpoints, dict(presets=["tiny"], seed=np.int32(2)), id="presets as a list"),
    pytest.param(strategies.op_cases, dict(op="linear", dtypes=["float16"]), id="dtypes as a list"),
    pytest.param(Workload, dict(jobs=[J], max_batch_size=1, schedule=PrefillPolicy()), id="jobs as a list"),
    pytest.param(Job, dict(prompt=(0,), params=P, cancel_step=0, priority=-3, preempt_steps=[0, 5]),
                 id="job at its boundaries"),
    pytest.param(op_case, dict(op="linear", index=len(strategies.op_cases("linear").elements) - 1),
                 id="the grid's last case"),
    pytest.param(assert_matches_reference, dict(op="linear", impl="ref", cases=deque([LINEAR])),
                 id="cases as any iterable"),
    pytest.param(budget, dict(fraction=2.5), id="more than the profile's examples"),
    pytest.param(fp32_bits, dict(value=float("-inf")), id="an infinite logprob's bits"),
]


@pytest.mark.parametrize("fn,kwargs", VALID)
def test_valid_calls_at_their_boundaries_pass_the_checks(fn, kwargs):
    fn(**kwargs)
