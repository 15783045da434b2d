"""Assertions of the contract that explain themselves.

Engine level: `assert_batch_invariant` (every request of a workload run through the batch scheduler
is bitwise its cold serial run) and `assert_scoring_matches_generation` (a generation's logprobs and
alternatives are bitwise those of scoring prompt + output). Op level, on the kernel lab's case grid:
`assert_matches_reference` (within the lab's tolerance table), `assert_rows_invariant` (a member's
outputs alone and in any batch position, bit for bit) and `assert_split_invariant` (a prefill op's
sequence cut at an aligned position gives the bits of one piece). A failure raises
`ContractViolation` naming the request or case, the first differing position, both values and their
bits, and a snippet that reproduces it.
"""

from __future__ import annotations

import textwrap
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from ..config import check_device
from ..kernels.registry import IMPLEMENTATIONS, ImplSpec, describe
from ..llm import LLM
from ..sampling import SamplingParams
from . import _checks as check
from .cases import Case, op_cases
from .engines import Engines, check_run, find_mismatches, python_source
from .explain import class_import, describe_mismatch, reproduction, show, workload_source
from .findings import Finding, batch_findings, reference_findings, split_findings, under_test
from .strategies import Workload


class ContractViolation(AssertionError):
    """A property of the contract does not hold; the message says where and how to reproduce it."""


def _raise(summary: str, details: Sequence[str], snippet: str) -> None:
    body = "\n".join(f"- {line}" for line in details)
    raise ContractViolation(f"{summary}\n{body}\nReproduce with:\n{textwrap.indent(snippet, '    ')}")


def assert_batch_invariant(engines: Engines, workload: Workload) -> None:
    """Every request of `workload`, run through the batch scheduler of `engines` (arrivals,
    cancellations, preemptions at their steps, on the workload's schedule), has the tokens and
    logprobs of its cold serial run, bit for bit (a cancelled one: a prefix of them)."""
    check_run("assert_batch_invariant", engines, workload)
    found = find_mismatches(engines, workload)
    if found:
        _raise(f"batched output differs from the cold serial run for {len(found)} of {len(workload.jobs)} "
               f"requests (max_batch_size {workload.max_batch_size}, schedule {workload.schedule!r}):",
               [describe_mismatch(m, workload) for m in found],
               reproduction("assert_batch_invariant(engines, workload)", class_import(workload.schedule),
                            engines=repr(engines), workload=workload_source(workload)))


def _engine_source(llm: LLM) -> str:
    args = llm.args
    fields = [f"model={args.model!r}", f"backend={args.backend!r}", f"dtype={args.dtype!r}", f"device={args.device!r}",
              f"max_seq_len={args.max_seq_len}", f"backend_options={python_source(args.backend_options)}"]
    if args.op_overrides:
        fields.append(f"op_overrides={python_source(args.op_overrides)}")
    if args.weight_dtype is not None:
        fields.append(f"weight_dtype={args.weight_dtype!r}")
    if args.tensor_parallel_size > 1:
        fields.append(f"tensor_parallel_size={args.tensor_parallel_size}")
    return "LLM(EngineArgs(" + ", ".join(fields) + "))"


def assert_scoring_matches_generation(llm: LLM, prompts: Sequence[Sequence[int]], params: SamplingParams) -> None:
    """Each prompt generated with `params` (all at once: batched when `llm` batches), then prompt +
    output scored (`prompt_logprobs`, with as many alternatives as `params.logprobs` asks): every
    generated position's logprob and alternatives equal the score of the same position, bit for bit.
    Holds where `llm.capabilities.exact_positions` does."""
    lists = [list(p) for p in _checked_prompts(llm, prompts, params)]
    generated = llm.generate(lists, params)
    score = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=params.logprobs or True)
    scored = llm.generate([p + g.token_ids for p, g in zip(lists, generated)], [score] * len(lists))
    details = []
    for index, (prompt, gen, sc) in enumerate(zip(lists, generated, scored)):
        for position, (logprob, token) in enumerate(zip(gen.logprobs, gen.token_ids)):
            at = len(prompt) + position
            want = sc.prompt_logprobs[at] if sc.prompt_logprobs is not None else None
            got_top = want_top = None
            if params.logprobs:  # the alternatives, as (token, logprob) pairs best first
                got_top = _pairs(gen.top_logprobs[position] if gen.top_logprobs is not None else None)
                want_top = _pairs(sc.prompt_top_logprobs[at] if sc.prompt_top_logprobs is not None else None)
            if want != logprob or got_top != want_top:
                what = (f"logprob {show(logprob)} generated, {show(want)} scored" if want != logprob else
                        _first_alternative_difference(got_top, want_top))
                details.append(f"prompt {index} ({len(prompt)} tokens): first difference at generated position "
                               f"{position} (token {token}, sequence position {at}): {what}")
                break
    if details:
        _raise(f"generated logprobs differ from the scores of the same sequences for {len(details)} of "
               f"{len(lists)} prompts:", details,
               reproduction("assert_scoring_matches_generation(llm, prompts, params)", llm=_engine_source(llm),
                            prompts=repr(lists), params=repr(params)))


def _checked_prompts(llm: Any, prompts: Any, params: Any) -> list[Any]:
    """The prompts as a list, every argument checked; one prompt given as a flat list of ids is
    the likely slip, so each prompt is named by its index."""
    where = "assert_scoring_matches_generation"
    check.instance(where, "llm", llm, LLM, "an LLM (an Engines' serial engine is engines.serial)")
    listed = check.listed(where, "prompts", prompts, "a non-empty list of prompts")
    for index, prompt in enumerate(listed):
        if isinstance(prompt, (str, bytes)) or not isinstance(prompt, Iterable):
            raise check.refuse(TypeError, where, f"prompts[{index}]", "a sequence of token ids", prompt)
    check.instance(where, "params", params, SamplingParams, "a SamplingParams")
    return listed


def _first_alternative_difference(got: tuple[tuple[Any, ...], ...] | None,
                                  want: tuple[tuple[Any, ...], ...] | None) -> str:
    """Where two lists of (token, logprob) alternatives first differ, both entries with their bits."""
    got, want = got or (), want or ()
    rank = next(i for i in range(max(len(got), len(want)))
                if i >= len(got) or i >= len(want) or got[i] != want[i])

    def entry(pairs: tuple[tuple[Any, ...], ...]) -> str:
        return "nothing" if rank >= len(pairs) else f"token {pairs[rank][0]}, logprob {show(pairs[rank][1])}"

    return f"alternative {rank}: {entry(got)} generated, {entry(want)} scored"


def _pairs(entry: Sequence[Sequence[Any]] | None) -> tuple[tuple[Any, ...], ...] | None:
    return None if entry is None else tuple(tuple(pair) for pair in entry)


# -- op level ------------------------------------------------------------------------------------------


def op_case(op: str, index: int, dtype: str = "float32") -> Case:
    """Point `index` of `op`'s case grid in `dtype` (how a failure message names a case)."""
    check.op_name("op_case", op)
    check.dtype_name("op_case", "dtype", dtype)
    cases = op_cases(op, (getattr(torch, dtype),))
    check.integer("op_case", "index", index, 0, len(cases) - 1)
    return cases[index]


def _check_impl(where: str, impl: Any, device: Any) -> None:
    """What the registry resolves (its own message for a name it lacks), and the device to run on."""
    if not (isinstance(impl, str) or callable(impl)):
        raise check.refuse(TypeError, where, "impl", "a registered name, 'module:function' or a callable", impl)
    check_device(device, f"{where}: device")


def _check_case(where: str, name: str, case: Any, op: str) -> None:
    """A case of `op`'s grid: another op's case has other inputs."""
    check.instance(where, name, case, Case, "a Case")
    if case.op != op:
        raise ValueError(f"{where}: {name} must be a case of op {op!r}, got one of {case.op!r}")


def _check_case_call(where: str, op: Any, case: Any, impl: Any, device: Any) -> None:
    """The arguments of an assertion on one case, in their order."""
    check.op_name(where, op)
    _check_case(where, "case", case, op)
    _check_impl(where, impl, device)


def _case_source(case: Case) -> str:
    dtype = str(case.dtype).removeprefix("torch.")
    labels = [c.label for c in op_cases(case.op, (case.dtype,))]
    index = labels.index(case.label) if case.label in labels else -1
    return f"op_case({case.op!r}, {index}, {dtype!r})"


def _spec_source(impl: ImplSpec) -> str:
    return python_source(impl) if callable(impl) else repr(impl)


def _check_findings(kind: str, op: str, impl: ImplSpec, case: Case, findings: list[Finding],
                    call: str) -> None:
    failed = [f for f in findings if not f.ok]
    if failed:
        _raise(f"{op} <- {describe(impl)}: {kind} fails on {case.label}:", [f"{f.case}: {f.detail}" for f in failed],
               reproduction(call, case=_case_source(case), impl=_spec_source(impl)))


def assert_matches_reference(op: str, impl: ImplSpec, dtype: str = "float32", cases: Sequence[Case] | None = None,
                             device: str = "cpu") -> None:
    """`impl` (a registered name, "module:function" or a callable) against `op`'s reference on the
    op's case grid in `dtype` (or on `cases`), within the kernel lab's tolerance table; integer
    outputs (sampled tokens) equal."""
    where = "assert_matches_reference"
    check.op_name(where, op)
    _check_impl(where, impl, device)
    check.dtype_name(where, "dtype", dtype)
    grid = op_cases(op, (getattr(torch, dtype),)) if cases is None else \
        check.listed(where, "cases", cases, "None or a non-empty list of cases")
    for index, case in enumerate(grid):
        _check_case(where, f"cases[{index}]", case, op)
    fn, ref = under_test(op, impl), IMPLEMENTATIONS[op]["ref"]
    failed = [(case, f) for case in grid if not (f := reference_findings(case, fn, ref, "reference", device)).ok]
    if failed:
        case = failed[0][0]
        _raise(f"{op} <- {describe(impl)}: {len(failed)} of {len(grid)} cases out of the reference's tolerance:",
               [f"{c.label}: {f.detail}" for c, f in failed],
               reproduction(f"assert_matches_reference({op!r}, impl, cases=[case])", case=_case_source(case),
                            impl=_spec_source(impl)))


def assert_rows_invariant(op: str, case: Case, impl: ImplSpec, device: str = "cpu") -> None:
    """Each member of `case` (a row, a token, a sequence) gives the same bits alone (in another slot)
    and in the batch, in the batch's order and reversed."""
    _check_case_call("assert_rows_invariant", op, case, impl, device)
    _check_findings("batch invariance", op, impl, case, [batch_findings(case, under_test(op, impl), device)],
                    f"assert_rows_invariant({op!r}, case, impl)")


def assert_split_invariant(op: str, case: Case, impl: ImplSpec, device: str = "cpu") -> None:
    """Each sequence of `case` long enough, prefilled in two pieces cut at its first aligned position,
    gives the outputs and final slot state of one piece, bit for bit (a prefill op's property)."""
    _check_case_call("assert_split_invariant", op, case, impl, device)
    if not case.splittable:
        raise ValueError(f"{op} is not a prefill op: its cases have no sequences to cut")
    _check_findings("split invariance", op, impl, case, split_findings(case, under_test(op, impl), device),
                    f"assert_split_invariant({op!r}, case, impl)")

