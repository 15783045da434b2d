"""StructuredOutputsParams: a request's structured-output constraint (`SamplingParams.structured_outputs`),
vLLM's `StructuredOutputsParams` (formerly `GuidedDecodingParams`): exactly one of

- json: a JSON schema (a dict, or its JSON text): the output is a JSON value that the schema accepts;
- json_object: True: the output is a JSON object, any one;
- regex: the output matches this regular expression (xgrammar's dialect), all of it;
- choice: the output is one of these strings;
- grammar: the output is a sentence of this EBNF grammar (xgrammar's / GBNF's: `root ::= ...`);

and disable_any_whitespace (True by default): a JSON output has no free whitespace, one space after
each ':' and ',' (json.dumps' default separators), so even a random-weight model finishes a small
schema in a few dozen tokens; False lets the model put whitespace anywhere JSON allows it.

Checked on construction (ValueError, TypeError for a value of the wrong kind, naming the field);
whether xgrammar can compile the schema, regex or grammar is checked at submission
(`pocketllm.grammar`), which needs the `structured` extra (`pip install 'pocketllm[structured]'`).
"""

from __future__ import annotations

import json as json_module
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from typing import Any

KINDS = ("json", "json_object", "regex", "choice", "grammar")


def _short(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _schema_text(value: object) -> str:
    """A JSON schema as stored: its JSON text, one line (a dict dumped, a text parsed and dumped
    again, its keys' order kept: the order of the properties an object is written in)."""
    rule = "a JSON schema: a dict, or its JSON text"
    if isinstance(value, str):
        try:
            parsed = json_module.loads(value)
        except ValueError as exc:
            raise ValueError(f"structured_outputs.json must be {rule}; the text is not JSON ({exc})") from None
    elif isinstance(value, Mapping):
        parsed = value
    else:
        raise TypeError(f"structured_outputs.json must be {rule}, got {_short(value)}")
    if not isinstance(parsed, Mapping):
        raise ValueError(f"structured_outputs.json must be {rule} (a JSON object), got {_short(value)}")
    try:
        return json_module.dumps(parsed, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"structured_outputs.json must be {rule}; it does not serialize to JSON ({exc})") from None


def _text(name: str, value: object, what: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"structured_outputs.{name} must be {what} (a str), got {_short(value)}")
    if not value:
        raise ValueError(f"structured_outputs.{name} must be {what}, got an empty string")
    return value


def _choices(value: object) -> tuple[str, ...]:
    rule = "a non-empty list of strings"
    if isinstance(value, (str, bytes, bytearray, Mapping)) or not isinstance(value, Iterable):
        raise TypeError(f"structured_outputs.choice must be {rule}, got {_short(value)}")
    choices = tuple(value)
    if not choices:
        raise ValueError(f"structured_outputs.choice must be {rule}, got an empty one")
    if not all(isinstance(choice, str) for choice in choices):
        raise TypeError(f"structured_outputs.choice must be {rule}, got {_short(value)}")
    return choices


@dataclass(frozen=True, repr=False)
class StructuredOutputsParams:
    """Exactly one of json, json_object, regex, choice, grammar (see the module docstring). Kept
    canonical and hashable: json as its JSON text, choice as a tuple."""

    json: str | Mapping[str, Any] | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    disable_any_whitespace: bool = True

    def __post_init__(self) -> None:
        set_field = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731  (frozen)
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise TypeError(f"structured_outputs.json_object must be None or a bool, got {_short(self.json_object)}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise TypeError(f"structured_outputs.disable_any_whitespace must be a bool, "
                            f"got {_short(self.disable_any_whitespace)}")
        given = [name for name in KINDS if getattr(self, name) is not None and getattr(self, name) is not False]
        if len(given) != 1:
            raise ValueError(f"structured_outputs must set exactly one of {', '.join(KINDS)}; "
                             f"got {' and '.join(given) if given else 'none'}")
        if self.json is not None:
            set_field("json", _schema_text(self.json))
        if self.regex is not None:
            set_field("regex", _text("regex", self.regex, "a regular expression"))
        if self.choice is not None:
            set_field("choice", _choices(self.choice))
        if self.grammar is not None:
            set_field("grammar", _text("grammar", self.grammar, "an EBNF grammar"))
        if self.json_object is False:
            set_field("json_object", None)

    @property
    def kind(self) -> str:
        """The constraint's field: "json", "json_object", "regex", "choice" or "grammar"."""
        return next(name for name in KINDS if getattr(self, name) is not None)

    @property
    def spec(self) -> str | bool | tuple[str, ...]:
        """The constraint's value (a schema's JSON text, a regex, the choices...)."""
        return getattr(self, self.kind)

    def __repr__(self) -> str:
        """Python that builds it again: the constraint, and disable_any_whitespace when it is False."""
        shown = [f"{self.kind}={self.spec!r}"]
        if not self.disable_any_whitespace:
            shown.append("disable_any_whitespace=False")
        return f"StructuredOutputsParams({', '.join(shown)})"


FIELDS = tuple(f.name for f in fields(StructuredOutputsParams))


def structured_outputs(value: object) -> StructuredOutputsParams | None:
    """`SamplingParams.structured_outputs` as stored: None, or a StructuredOutputsParams (a dict of
    its fields is turned into one)."""
    if value is None or isinstance(value, StructuredOutputsParams):
        return value
    if not isinstance(value, Mapping):
        raise TypeError(f"structured_outputs must be None, a StructuredOutputsParams or a dict of its fields "
                        f"({', '.join(FIELDS)}), got {_short(value)}")
    unknown = [key for key in value if key not in FIELDS]
    if unknown:
        raise ValueError(f"structured_outputs has no field {unknown[0]!r}; its fields are {', '.join(FIELDS)}")
    return StructuredOutputsParams(**value)

