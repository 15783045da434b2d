"""The op-level checks of an implementation, one `Finding` each: against a reference within the
tolerance table (`compare.py`), batch invariance, split invariance, the empty batch. The kernel lab's
verdicts (`pocketllm lab check`) and the toolkit's assertions are made of them.

An implementation that raises, SystemExit included, fails the check it raised in, with what it
raised (`under_test`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..kernels.registry import ImplSpec, resolve
from .cases import Case, Member, call, pack, results, run, run_members, split_member
from .compare import bits_error, close_error


@dataclass(frozen=True)
class Finding:
    """One line of the verdict: a check on one case; `detail` says what failed and by how much."""

    check: str
    case: str
    ok: bool
    detail: str = ""



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


def guarded(check: str, label: str, body: Callable[[], str | None]) -> Finding:
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
    return guarded(check, case.label, lambda: _members_error(
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
    return guarded("empty batch", case.label, body)


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
    return guarded("batch invariance", case.label, body)


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

        findings.append(guarded("split invariance", f"{case.label} member {index}", body))
    return findings
