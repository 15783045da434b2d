"""Argument checks at the toolkit's boundary, shared by its entry points.

A misuse raises TypeError (a value of the wrong kind) or ValueError (one out of range) whose
message reads "<entry point>: <parameter> must be <what it takes>, got <what was given>", before
Hypothesis or an engine sees the value: their own messages name neither the entry point nor the
parameter (`Cannot have max_size=0 < min_size=1`, `'str' object has no attribute ...`).
"""

from __future__ import annotations

import numbers
from collections.abc import Collection, Iterable, Sequence
from typing import Any

import torch

from ..kernels.registry import OP_NAMES


def given(value: Any, kind: bool = True) -> str:
    """What was given, as a message shows it: its type (with `kind`) and its repr, cut short (an
    object whose repr fails, one half built, by the default repr)."""
    try:
        text = repr(value)
    except Exception:
        text = object.__repr__(value)
    text = text if len(text) <= 60 else text[:57] + "..."
    return f"{type(value).__name__} {text}" if kind else text


def refuse(error: type[Exception], where: str, name: str, rule: str, value: Any) -> Exception:
    """The error to raise: a TypeError shows the given value's type, a ValueError only the value."""
    return error(f"{where}: {name} must be {rule}, got {given(value, kind=error is TypeError)}")


def is_int(value: Any) -> bool:
    """An int (numpy's and other Integral types too), bool not: the engine's own rule."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def integer(where: str, name: str, value: Any, low: int | None = None, high: int | None = None,
            rule: str | None = None) -> None:
    """`value` an int in [low, high] (either bound None: open)."""
    if rule is None:
        rule = f"an int in [{low}, {high}]" if low is not None and high is not None else \
            f"an int >= {low}" if low is not None else "an int"
    if not is_int(value):
        raise refuse(TypeError, where, name, rule, value)
    if (low is not None and value < low) or (high is not None and value > high):
        raise refuse(ValueError, where, name, rule, value)


def positive(where: str, **values: Any) -> None:
    """Each of `values` an int >= 1: the sizes and counts a strategy draws up to."""
    for name, value in values.items():
        integer(where, name, value, 1)


def optional_int(where: str, name: str, value: Any, low: int) -> None:
    """`value` None or an int >= `low`."""
    if value is not None:
        integer(where, name, value, low, rule=f"None or an int >= {low}")


def flag(where: str, name: str, value: Any) -> None:
    """`value` True or False: a truthy str or int would silently switch a feature on."""
    if not isinstance(value, bool):
        raise refuse(TypeError, where, name, "a bool (True or False)", value)


def instance(where: str, name: str, value: Any, kind: type | tuple[type, ...], what: str) -> None:
    """`value` an instance of `kind`, described in the message as `what`."""
    if not isinstance(value, kind):
        raise refuse(TypeError, where, name, what, value)


def real(where: str, name: str, value: Any, what: str = "a real number") -> None:
    """`value` a real number (int or float; bool not)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise refuse(TypeError, where, name, what, value)


def one_of(where: str, name: str, value: Any, allowed: Collection[str]) -> None:
    """`value` one of the names `allowed`; TypeError when it is no str at all."""
    if not isinstance(value, str) or value not in allowed:
        raise refuse(ValueError if isinstance(value, str) else TypeError, where, name, f"one of {tuple(allowed)}",
                     value)


SEQUENCES: tuple[type[Sequence[Any]], ...] = (tuple, list)


def items(where: str, name: str, value: Any, what: str, kinds: tuple[type[Sequence[Any]], ...] = SEQUENCES,
          min_len: int = 1) -> None:
    """`value` a tuple or list (`kinds`) of at least `min_len` items, described as `what`; the
    items themselves are the caller's to check."""
    if not isinstance(value, kinds):
        raise refuse(TypeError, where, name, what, value)
    if len(value) < min_len:
        raise refuse(ValueError, where, name, what, value)


def listed(where: str, name: str, value: Any, what: str) -> list[Any]:
    """`value`, any iterable but a str, as a list of at least one item (described as `what`)."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise refuse(TypeError, where, name, what, value)
    values = list(value)
    if not values:
        raise refuse(ValueError, where, name, what, value)
    return values


def int_items(where: str, name: str, value: Any, low: int, what: str,
              kinds: tuple[type[Sequence[Any]], ...] = SEQUENCES, min_len: int = 0) -> None:
    """`items`, each an int >= `low`."""
    items(where, name, value, what, kinds, min_len)
    if not all(type(item) is int and item >= low for item in value):  # the common case, fast
        for index, item in enumerate(value):
            integer(where, f"{name}[{index}]", item, low)


def op_name(where: str, op: Any) -> None:
    """`op` a registered op."""
    one_of(where, "op", op, OP_NAMES)


def dtype_name(where: str, name: str, value: Any) -> None:
    """`value` the name of a torch dtype ("float32"), as the case grids take it."""
    rule = "the name of a torch dtype such as 'float32'"
    if not isinstance(value, str):
        raise refuse(TypeError, where, name, rule, value)
    if not isinstance(getattr(torch, value, None), torch.dtype):
        raise refuse(ValueError, where, name, rule, value)


def dtype_names(where: str, name: str, values: Any) -> None:
    """`values` a non-empty tuple of torch dtype names."""
    items(where, name, values, "a non-empty tuple of torch dtype names such as ('float32',)")
    for index, value in enumerate(values):
        dtype_name(where, f"{name}[{index}]", value)


def each(where: str, name: str, values: Iterable[Any], kind: type, what: str) -> None:
    """Each of `values` an instance of `kind` (`what`), named by its index."""
    for index, value in enumerate(values):
        instance(where, f"{name}[{index}]", value, kind, what)
