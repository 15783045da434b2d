"""The op registry: every op's signature and its named implementations, in one place.

An op `name` lives in the module `pocketllm/kernels/<name>.py`, which defines the op's signature
(a `Protocol` whose `__call__` is the call the model makes), its implementations side by side
(`<name>_ref`, the reference every other implementation is tested against, `<name>_triton`, and
any other variant) and one `OP` record (`spec.OpSpec`) naming them. The registry finds the op
modules by scanning the package (modules whose names start with `_` hold what two ops share), so
adding an op touches no list here. `IMPLEMENTATIONS` below names them; `register` adds a variant
from outside the package (a notebook, a test file), and `resolve` turns what a user writes in
`EngineArgs(op_overrides=...)` — a registered name, "module:function", or a callable — into a
checked callable, or a ValueError / TypeError saying why it cannot be one.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import pkgutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from .spec import OpSpec


def _discover() -> dict[str, OpSpec]:
    """The `OP` record of every op module of this package, in the model's order (`OpSpec.order`)."""
    specs = []
    for module_info in pkgutil.iter_modules([str(Path(__file__).parent)]):
        if module_info.name.startswith("_"):
            continue
        spec = getattr(importlib.import_module(f"{__package__}.{module_info.name}"), "OP", None)
        if isinstance(spec, OpSpec):
            if spec.name != module_info.name:
                raise ImportError(f"kernels/{module_info.name}.py declares op {spec.name!r}: an op is named "
                                  "after its module")
            specs.append(spec)
    return {spec.name: spec for spec in sorted(specs, key=lambda spec: spec.order)}


SPECS: dict[str, OpSpec] = _discover()
# op name -> its signature (a Protocol). The order is the model's: embedding first, sample last.
SIGNATURES: dict[str, type] = {name: spec.signature for name, spec in SPECS.items()}
OP_NAMES: tuple[str, ...] = tuple(SIGNATURES)

# op name -> implementation name -> function. "ref" is the reference of every op; `register` adds here.
IMPLEMENTATIONS: dict[str, dict[str, Callable[..., Any]]] = {name: dict(spec.implementations)
                                                             for name, spec in SPECS.items()}

ImplSpec = str | Callable[..., Any]


def check_op_name(op: str, field: str = "op") -> None:
    """ValueError naming `field` and the registered ops unless `op` is one."""
    if not isinstance(op, str) or op not in SIGNATURES:
        raise ValueError(f"{field} must be one of {OP_NAMES}, got {op!r}")


@functools.cache
def parameters(op: str) -> tuple[inspect.Parameter, ...]:
    """The parameters of op `op`'s signature in call order (its Protocol's `__call__` without self)."""
    return tuple(inspect.signature(SIGNATURES[op].__call__).parameters.values())[1:]


def check_signature(op: str, fn: Callable[..., Any]) -> None:
    """TypeError unless `fn` can be called as op `op`'s signature says: the same parameters, in
    the same order and with the same names, each optional one optional too; anything `fn` takes
    beyond them must have a default. A function taking *args is accepted as it is."""
    if not callable(fn):
        raise TypeError(f"an implementation of {op} must be callable, got {type(fn).__name__}")
    want = parameters(op)
    try:
        got = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return  # a builtin without a signature: the engine-level checks will tell
    if any(p.kind is p.VAR_POSITIONAL for p in got):
        return
    positional = [p for p in got if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    problems = []
    for i, expected in enumerate(want):
        if i >= len(positional):
            problems.append(f"missing parameter {expected.name!r} (position {i})")
        elif positional[i].name != expected.name and positional[i].kind is not positional[i].POSITIONAL_ONLY:
            problems.append(f"parameter {i} is {positional[i].name!r}, expected {expected.name!r}")
        elif expected.default is not expected.empty and positional[i].default is positional[i].empty:
            problems.append(f"parameter {expected.name!r} must be optional")
    problems += [f"extra parameter {p.name!r} has no default" for p in got[len(want):]
                 if p.default is p.empty and p.kind not in (p.VAR_KEYWORD,)]
    if problems:
        expected_sig = "(" + ", ".join(str(p) for p in want) + ")"
        raise TypeError(f"{describe(fn)} does not match the signature of op {op}{expected_sig}: "
                        + "; ".join(problems))


def register(op: str, name: str, fn: Callable[..., Any]) -> None:
    """Add implementation `name` of `op` (checked against the op's signature), so that
    `op_overrides={op: name}`, the lab and the kernel tests can select it by name."""
    check_op_name(op)
    if not isinstance(name, str) or not name or ":" in name:
        raise ValueError(f"an implementation name must be a non-empty str without ':', got {name!r}")
    check_signature(op, fn)
    IMPLEMENTATIONS[op][name] = fn


def resolve(op: str, spec: ImplSpec) -> Callable[..., Any]:
    """The implementation `spec` names for `op`: a registered name ("ref", "triton", ...), an
    import path "package.module:function", or a callable; checked against the op's signature."""
    check_op_name(op)
    if callable(spec):
        fn = spec
    elif isinstance(spec, str) and spec in IMPLEMENTATIONS[op]:
        return IMPLEMENTATIONS[op][spec]
    elif isinstance(spec, str) and ":" in spec:
        fn = import_path(spec)
    else:
        raise ValueError(f"implementation of {op} must be one of {tuple(IMPLEMENTATIONS[op])}, "
                         f"'module:function' or a callable, got {spec!r}")
    check_signature(op, fn)
    return fn


def import_path(spec: str) -> Callable[..., Any]:
    """The callable at "package.module:attr[.attr...]", else a ValueError saying why it cannot be
    had. Importing a user's module runs its code, so whatever that raises (a missing module, a
    syntax error, its own exception, SystemExit too: a module must not end the process) is the
    chained cause; KeyboardInterrupt still interrupts."""
    module_name, _, attr_path = spec.partition(":")
    if not module_name or not attr_path:
        raise ValueError(f"an import path must look like 'package.module:function', got {spec!r}")
    try:
        obj: Any = importlib.import_module(module_name)
    except (Exception, SystemExit) as exc:
        raise ValueError(f"cannot import {spec!r}: {type(exc).__name__}: {exc}") from exc
    for attr in attr_path.split("."):
        if not hasattr(obj, attr):
            raise ValueError(f"cannot import {spec!r}: {module_name} has no attribute {attr_path!r}")
        obj = getattr(obj, attr)
    if not callable(obj):
        raise ValueError(f"cannot import {spec!r}: {module_name}.{attr_path} is not callable "
                         f"(type {type(obj).__name__})")
    return obj


def check_overrides(overrides: Mapping[str, ImplSpec], field: str = "op_overrides") -> dict[str, Callable[..., Any]]:
    """Every override resolved, or an error naming `field`, the op and what went wrong."""
    if not isinstance(overrides, Mapping):
        raise TypeError(f"{field} must be a dict of op name -> implementation, got {type(overrides).__name__}")
    resolved = {}
    for op, spec in overrides.items():
        check_op_name(op, f"a key of {field}")
        try:
            resolved[op] = resolve(op, spec)
        except (ValueError, TypeError) as exc:
            raise type(exc)(f"{field}[{op!r}]: {exc}") from exc
    return resolved


def describe(spec: ImplSpec) -> str:
    """How reports name an implementation: a registered name or import path as given, a callable
    as "module:qualname" (the form `resolve` takes back)."""
    if isinstance(spec, str):
        return spec
    name = getattr(spec, "__qualname__", None) or type(spec).__name__
    module = getattr(spec, "__module__", None)
    return f"{module}:{name}" if module else name
