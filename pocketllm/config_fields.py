"""Typed reading of a config.json's fields, under every name a transformers version writes them,
and the check of the one engine field that asks the machine (`check_device`).

Checkpoints saved by transformers 4.x and 5.x spell some fields differently (see `ALIASES`), and both
are published: `ModelConfig` reads either spelling, and refuses a file in which two spellings of
one field disagree, since the versions do not agree on which one wins.
"""

from __future__ import annotations

import math
from typing import Any, NoReturn

import torch

# The name `ModelConfig` reads -> where config.json may hold it, each written by some transformers
# version ("a.b": key b of the object a). Recorded from `XConfig(...).save_pretrained()` under
# transformers 4.57.1 and 5.24.0 (4.57 has no Qwen3.5 classes; its hybrid predecessor Qwen3-Next
# wrote partial_rotary_factor beside rope_theta at the top level):
ALIASES: dict[str, tuple[str, ...]] = {
    # Qwen3MoeConfig: 4.x `num_experts`, 5.x `num_local_experts`; Qwen3_5MoeTextConfig (5.x): `num_experts`.
    "num_experts": ("num_experts", "num_local_experts"),
    # 5.x: one `rope_parameters` object holding rope_type, rope_theta and partial_rotary_factor; 4.x:
    # `rope_scaling` (null for plain RoPE; `type` in configs older than `rope_type`), rope_theta and
    # partial_rotary_factor at the top level.
    "rope_parameters": ("rope_parameters", "rope_scaling"),
    "rope_type": ("rope_parameters.rope_type", "rope_parameters.type", "rope_scaling.rope_type", "rope_scaling.type"),
    "rope_theta": ("rope_parameters.rope_theta", "rope_scaling.rope_theta", "rope_theta"),
    "partial_rotary_factor": ("rope_parameters.partial_rotary_factor", "rope_scaling.partial_rotary_factor",
                              "partial_rotary_factor"),
}

REQUIRED = object()
_ABSENT = object()
_JSON_NAMES = {int: "integer", float: "number", bool: "boolean (true/false)", str: "string", list: "array",
               dict: "object"}


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be loaded as asked; the message names the file and the
    field or tensor at fault."""


def short(value: Any, limit: int = 80) -> str:
    """`value`'s repr, cut to `limit` characters: error messages quote untrusted values."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _names(key: str) -> tuple[str, ...]:
    return ALIASES.get(key, (key,))


def _lookup(raw: dict[str, Any], path: str) -> Any:
    """The value at `path` ("a.b": key b of the object a), or _ABSENT when some part is missing."""
    *parents, last = path.split(".")
    node: Any = raw
    for part in parents:
        node = node.get(part)
        if not isinstance(node, dict):
            return _ABSENT
    return node.get(last, _ABSENT)


class Fields:
    """Typed access to one JSON object's fields, each under any of its `ALIASES`; errors name the
    file and the field as the file spells it."""

    def __init__(self, raw: dict[str, Any], source: str) -> None:
        self.raw, self.source = raw, source

    def fail(self, key: str, rule: str, value: Any) -> NoReturn:
        raise CheckpointError(f"{self.source}: field {key!r} {rule}, got {short(value)}")

    def find(self, key: str) -> tuple[str, Any]:
        """(the name `key` is held under, its value): the first of its names with a non-null value;
        (key, None) when none has one. A CheckpointError when two names hold different values."""
        found = [(name, value) for name in _names(key) if (value := _lookup(self.raw, name)) not in (None, _ABSENT)]
        for name, value in found[1:]:
            if value != found[0][1]:
                raise CheckpointError(f"{self.source}: fields {found[0][0]!r}={short(found[0][1])} and {name!r}="
                                      f"{short(value)} disagree; they are two transformers versions' names for "
                                      f"{key!r}, so keep one")
        return found[0] if found else (key, None)

    def _missing(self, key: str) -> str:
        names = _names(key)
        accepted = f" (accepted names: {', '.join(map(repr, names))})" if len(names) > 1 else ""
        return f"{self.source}: missing required field {key!r}{accepted}"

    def get(self, key: str, kind: type, default: Any = REQUIRED, null: Any = REQUIRED) -> Any:
        """The field, which must be a `kind` (an int is accepted as a float). Absent or null: `default`
        (an error when there is none), except that a null gives `null` when that is given."""
        name, value = self.find(key)
        if value is None:
            if null is not REQUIRED and any(_lookup(self.raw, n) is None for n in _names(key)):
                return null
            if default is REQUIRED:
                raise CheckpointError(self._missing(key))
            return default
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            try:
                return float(value)
            except OverflowError:
                self.fail(name, "must be a finite number", value)
        if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
            self.fail(name, f"must be a JSON {_JSON_NAMES[kind]}", value)
        return value

    def positive_int(self, key: str, default: Any = REQUIRED, minimum: int = 1, null: Any = REQUIRED) -> Any:
        value = self.get(key, int, default, null)
        if value is not None and value < minimum:
            self.fail(self.find(key)[0], f"must be an integer >= {minimum}", value)
        return value

    def positive_float(self, key: str, default: Any = REQUIRED) -> float:
        value = self.get(key, float, default)
        if not (math.isfinite(value) and value > 0):
            self.fail(self.find(key)[0], "must be a finite number > 0", value)
        return value


def check_device(value: Any, name: str = "device") -> None:
    """A device this machine has: 'cpu', or 'cuda' / 'cuda:N' when torch sees that CUDA device.
    TypeError/ValueError naming `name` (a field, or a command's option such as "--device"), the value
    and what it takes: a typo or a missing GPU is refused before anything is built."""
    if not isinstance(value, (str, torch.device)):
        raise TypeError(f"{name} must be 'cpu' or 'cuda[:index]', got {type(value).__name__}")
    try:
        device = torch.device(value)
    except (RuntimeError, ValueError):
        raise ValueError(f"{name} must be 'cpu' or 'cuda[:index]', got {short(value)}") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise ValueError(f"{name} {str(value)!r} is not available: torch finds no CUDA device here; use 'cpu'")
        if device.index is not None and device.index >= count:
            raise ValueError(f"{name} {str(value)!r} is not available: the CUDA devices here are "
                             f"cuda:0..cuda:{count - 1}")
    elif device.type != "cpu":
        raise ValueError(f"{name} must be 'cpu' or 'cuda[:index]', got {str(value)!r}")
