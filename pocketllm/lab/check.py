"""`pocketllm lab check`: every check an op's implementation must pass, as one verdict table.

- reference: the implementation against the op's reference on the op's case grid, within the
  tolerance of `compare.TOLERANCES` (and against a second implementation with `vs`);
- batch invariance: each member's outputs bitwise equal alone (in another slot) and in the batch,
  in the batch's order and reversed;
- split invariance (prefill ops): a sequence prefilled in two pieces cut at an aligned position
  gives the bits of one piece, outputs and final slot state;
- engine property and parity (`engine.py`): the Hypothesis invariance property of the whole engine
  with the implementation installed, and greedy parity against `transformers`.

An implementation that raises, SystemExit included, fails the check it raised in, with what it
raised: the verdict is always printed (only Ctrl-C stops the command).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..kernels.registry import IMPLEMENTATIONS, SPECS, ImplSpec, check_op_name, describe, resolve
from .cases import Case, Member, call, op_cases, pack, results, run, run_members, split_member
from .compare import bits_error, close_error
from .launches import QUICK, model_steps, op_calls


@dataclass(frozen=True)
class Finding:
    """One line of the verdict: a check on one case; `detail` says what failed and by how much."""

    check: str
    case: str
    ok: bool
    detail: str = ""


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


def _members_error(got: list[dict[str, torch.Tensor]], want: list[dict[str, torch.Tensor]],
                   compare: Callable[[torch.Tensor, torch.Tensor], str | None]) -> str | None:
    for i, (g, w) in enumerate(zip(got, want)):
        for name in w:
            error = compare(g[name], w[name])
            if error:
                return f"member {i}, {name}: {error}"
    return None


class ImplementationExit(Exception):
    """A SystemExit (or another BaseException but KeyboardInterrupt) raised by an implementation
    under test, as an Exception: the check it ran in fails, the engine ends that request, and the
    command goes on to its verdict instead of exiting with the implementation's status (0 would
    read as a pass). Its cause is what was raised."""


def under_test(op: str, spec: ImplSpec) -> Callable[..., Any]:
    """The implementation `spec` names (`registry.resolve`), each call's SystemExit turned into
    an `ImplementationExit`; Ctrl-C still interrupts."""
    fn = resolve(op, spec)

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (Exception, KeyboardInterrupt):
            raise
        except BaseException as exc:
            raise ImplementationExit(f"{type(exc).__name__}: {exc}") from exc

    return call


def _guarded(check: str, label: str, body: Callable[[], str | None]) -> Finding:
    """The finding of `body` (None: passed); an exception is a failure that names it."""
    try:
        error = body()
    except ImplementationExit as exc:
        error = f"raised {exc}"
    except Exception as exc:  # a variant may fail in any way; the verdict must say how
        error = f"raised {type(exc).__name__}: {exc}"
    return Finding(check, label, error is None, error or "")


def reference_findings(case: Case, impl: Callable[..., Any], ref: Callable[..., Any], check: str,
                       device: torch.device | str) -> Finding:
    """impl against ref on the case, each member's every output within tolerance."""
    return _guarded(check, case.label, lambda: _members_error(
        run(case, impl, device=device), run(case, ref, device=device),
        lambda a, e: close_error(a, e, case.dtype)))


def empty_findings(case: Case, impl: Callable[..., Any], ref: Callable[..., Any],
                   device: torch.device | str) -> Finding:
    """An empty batch (no rows, no sequences) returns what the reference returns: empty results
    of the same shapes and dtypes, and no error."""
    def body() -> str | None:
        got, want = (results(call(case.op, fn, pack(case, [], [], device))) for fn in (impl, ref))
        for i, (g, w) in enumerate(zip(got, want)):
            if g.shape != w.shape or g.dtype != w.dtype:
                return f"result {i}: {g.dtype}{list(g.shape)}, the reference gives {w.dtype}{list(w.shape)}"
        return None
    return _guarded("empty batch", case.label, body)


def batch_findings(case: Case, impl: Callable[..., Any], device: torch.device | str) -> Finding:
    """Each member alone (slot 0) and in the batch (forward and reversed) bitwise equal."""
    def body() -> str | None:
        count = len(case.members)
        full = run(case, impl, device=device)
        # Reversed order, same slots: each member at another position of the batch.
        reversed_run = run(case, impl, order=list(range(count))[::-1], slot_order=list(range(count)), device=device)
        error = _members_error(reversed_run[::-1], full, bits_error)
        if error:
            return f"batch reversed vs the batch: {error}"
        for i in range(count):
            error = _members_error(run(case, impl, order=[i], slot_order=[0], device=device), [full[i]], bits_error)
            if error:
                return f"member {i} alone vs the batch: {error}"
        return None
    return _guarded("batch invariance", case.label, body)


def split_findings(case: Case, impl: Callable[..., Any], device: torch.device | str) -> list[Finding]:
    """Every member long enough: prefilled in two pieces at its first aligned position vs in one."""
    findings = []
    for index, member in enumerate(case.members):
        pieces = split_member(member)
        if pieces is None:
            continue

        def body(member: Member = member, pieces: tuple[Member, Member] = pieces) -> str | None:
            whole = run_members(case, impl, [member], [0], device)[0]
            first = run_members(case, impl, [pieces[0]], [0], device)[0]
            second_member = Member(pieces[1].start, pieces[1].tokens,
                                   {name: first[name].cpu() for name in member.slots})
            second = run_members(case, impl, [second_member], [0], device)[0]
            joined = {name: torch.cat([first[name], second[name]]) for name in whole if name not in member.slots}
            joined.update({name: second[name] for name in member.slots})
            error = _members_error([joined], [whole], bits_error)
            return f"cut at position {pieces[1].start}: {error}" if error else None

        findings.append(_guarded("split invariance", f"{case.label} member {index}", body))
    return findings


def check_kernel(op: str, impl: ImplSpec, vs: Iterable[ImplSpec] = (), device: torch.device | str = "cpu",
                 dtypes: tuple[torch.dtype, ...] | None = None, cases: list[Case] | None = None,
                 invariance: bool = True) -> Verdict:
    """The op-level checks of `impl` (a registered name, "module:function" or a callable): the
    reference on the case grid (`cases`, default: the op's grid in `dtypes`), against every
    implementation in `vs`, and (with `invariance`) batch and split invariance."""
    check_op_name(op)
    fn = under_test(op, impl)
    if cases is None:
        cases = op_cases(op, dtypes or default_dtypes(device))
    verdict = Verdict(op, describe(impl))
    ref = IMPLEMENTATIONS[op]["ref"]
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
                    verdict.findings.append(_guarded("engine invariance property", f"{preset}, {examples} examples",
                                                     functools.partial(engine_property, {op: fn}, preset, examples)))
                if parity:
                    verdict.findings.append(_guarded("greedy parity vs transformers", preset,
                                                     functools.partial(greedy_parity, {op: fn}, preset)))
    return verdict
