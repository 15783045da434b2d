"""`pocketllm lab check`: every check an op's implementation must pass, as one verdict table.

- reference: the implementation against the op's reference on the op's case grid, within the
  tolerance of `testing.compare.TOLERANCES` (and against a second implementation with `vs`);
- batch invariance: each member's outputs bitwise equal alone (in another slot) and in the batch,
  in the batch's order and reversed;
- split invariance (prefill ops): a sequence prefilled in two pieces cut at an aligned position
  gives the bits of one piece, outputs and final slot state;
- engine property and parity (`lab/engine.py`): the Hypothesis invariance property of the whole engine
  with the implementation installed, and greedy parity against `transformers`.

An implementation that raises, SystemExit included, fails the check it raised in, with what it
raised: the verdict is always printed (only Ctrl-C stops the command).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from ..kernels.registry import IMPLEMENTATIONS, SPECS, ImplSpec, check_op_name, describe
from ..testing.cases import Case, op_cases
from ..testing.findings import (
    Finding,
    batch_findings,
    empty_findings,
    guarded,
    reference_findings,
    split_findings,
    under_test,
)
from .launches import QUICK, model_steps, op_calls


@dataclass
class Verdict:
    """All findings of one implementation of one op."""

    op: str
    impl: str
    findings: list[Finding] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(f.ok for f in self.findings)

    def summary(self) -> list[tuple[str, int, int]]:
        """(check, cases passed, cases run) per check, in the order the checks ran."""
        rows: dict[str, list[int]] = {}
        for f in self.findings:
            counts = rows.setdefault(f.check, [0, 0])
            counts[0] += f.ok
            counts[1] += 1
        return [(check, passed, total) for check, (passed, total) in rows.items()]

    def table(self) -> str:
        """A Markdown table: one row per check, then every failed case with its detail."""
        lines = [f"{self.op} <- {self.impl}: {'PASS' if self.ok else 'FAIL'}", "",
                 "| check | passed | cases |", "|---|---|---|"]
        lines += [f"| {check} | {passed} | {total} |" for check, passed, total in self.summary()]
        failed = [f for f in self.findings if not f.ok]
        if failed:
            lines += ["", "failed:"] + [f"- {f.check} [{f.case}]: {f.detail}" for f in failed]
        return "\n".join(lines)


def check_kernel(op: str, impl: ImplSpec, vs: Iterable[ImplSpec] = (), device: torch.device | str = "cpu",
                 dtypes: tuple[torch.dtype, ...] | None = None, cases: list[Case] | None = None,
                 invariance: bool = True, ref: ImplSpec = "ref") -> Verdict:
    """The op-level checks of `impl` (a registered name, "module:function" or a callable): the
    reference (`ref`, default the op's own) on the case grid (`cases`, default: the op's grid in
    `dtypes`), against every implementation in `vs`, and (with `invariance`) batch and split invariance."""
    check_op_name(op)
    fn = under_test(op, impl)
    if cases is None:
        cases = op_cases(op, dtypes or default_dtypes(device))
    verdict = Verdict(op, describe(impl))
    ref = IMPLEMENTATIONS[op]["ref"] if ref == "ref" else under_test(op, ref)
    others = [(describe(spec), under_test(op, spec)) for spec in vs]
    for dtype in dict.fromkeys(case.dtype for case in cases):
        verdict.findings.append(empty_findings(next(c for c in cases if c.dtype == dtype), fn, ref, device))
    for case in cases:
        verdict.findings.append(reference_findings(case, fn, ref, "reference", device))
        for name, other in others:
            verdict.findings.append(reference_findings(case, fn, other, f"vs {name}", device))
        if invariance:
            verdict.findings.append(batch_findings(case, fn, device))
            if case.splittable:
                verdict.findings += split_findings(case, fn, device)
    return verdict


def default_dtypes(device: torch.device | str) -> tuple[torch.dtype, ...]:
    """fp32 and fp16 everywhere; bf16 too on CUDA (the Triton interpreter has no bf16)."""
    if torch.device(device).type == "cuda":
        return torch.float32, torch.float16, torch.bfloat16
    return torch.float32, torch.float16


def engine_presets(op: str) -> tuple[str, ...]:
    """The tiny presets (`launches.QUICK`) whose engines call `op`: those with a step that makes a
    call of it (every one, for an op without launches: the embedding)."""
    if SPECS[op].launches is None:
        return QUICK.models
    return tuple(name for name in QUICK.models
                 if any(op_calls(op, step) for step in model_steps(dataclasses.replace(QUICK, models=(name,)))))


def check(op: str, impl: ImplSpec, vs: Iterable[ImplSpec] = (), device: torch.device | str = "cpu",
          dtypes: tuple[torch.dtype, ...] | None = None, examples: int = 10, parity: bool = True,
          presets: tuple[str, ...] | None = None) -> Verdict:
    """Every check of `impl` as op `op`: the op-level checks of `check_kernel`, then, with the
    implementation installed in whole engines on each preset (default: each tiny preset that calls
    the op), the invariance property (`examples` Hypothesis examples; 0 skips it) and greedy
    parity against `transformers`."""
    verdict = check_kernel(op, impl, vs, device, dtypes)
    fn = under_test(op, impl)
    if examples or parity:
        try:
            from .engine import engine_property, greedy_parity, quiet_engine

            if parity:
                importlib.import_module("transformers")
        except ImportError as exc:
            raise ImportError(f"the engine checks need hypothesis and transformers ({exc}): install "
                              f"pocketllm[dev], or pass examples=0 and parity=False (--examples 0 --no-parity)"
                              ) from exc
        with quiet_engine():
            for preset in presets or engine_presets(op):
                if examples:
                    verdict.findings.append(guarded("engine invariance property", f"{preset}, {examples} examples",
                                                     functools.partial(engine_property, {op: fn}, preset, examples)))
                if parity:
                    verdict.findings.append(guarded("greedy parity vs transformers", preset,
                                                     functools.partial(greedy_parity, {op: fn}, preset)))
    return verdict
