"""`EngineArgs(speculative={...})`: speculative decoding, checked once into a typed config.

The keys are vLLM's `speculative_config` names. A draft only proposes: the engine verifies it in
one forward whose rows have the bits of decode steps (exact positions) and accepts a drafted token
exactly when it equals the token the request's own sampler draws there (same seed, same counter),
so a request's tokens and logprobs are the same with and without speculation; a wrong draft costs
time only.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

METHODS = ("ngram", "draft_model", "mtp", "custom")
# Methods vLLM names that are not built here yet: refused by name rather than as unknown.
NOT_YET = ("eagle", "eagle3", "medusa", "mlp_speculator", "suffix")
MAX_SPECULATIVE_TOKENS = 32
MAX_LOOKUP = 64  # the longest n-gram a prompt lookup matches
DEFAULT_LOOKUP = 5  # vLLM's prompt_lookup_min and _max when neither is given
KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model", "drafter")
# A custom drafter: the request's tokens so far (prompt and output) and the most drafts wanted -> drafts.
Drafter = Callable[[Sequence[int], int], Sequence[int]]


@dataclass(frozen=True)
class SpeculativeConfig:
    """At most `num_speculative_tokens` drafted per request and step (fewer while drafts miss).
    `method` "ngram": prompt lookup, the tokens that followed an earlier occurrence of the longest
    n-gram (prompt_lookup_max down to prompt_lookup_min tokens) that ends the request's tokens so
    far. "draft_model": `model`, a smaller checkpoint directory with the same vocabulary, drafts
    greedily (the method vLLM infers when only `model` is given). "mtp": the checkpoint's own
    multi-token-prediction layer (Qwen3.5's `mtp.*` tensors) drafts greedily. "custom": `drafter(tokens, count)`
    (a callable, or its import path "package.module:function") proposes up to `count` tokens after
    `tokens`, the request's prompt and output so far: a research drafter, or a test's adversary."""

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | None = None
    drafter: Drafter | None = None

    def as_dict(self) -> dict[str, Any]:
        """The keys that apply to its method, as `EngineArgs.speculative` shows them."""
        return {key: value for key, value in asdict(self).items() if value is not None}


def _int_key(raw: Mapping[str, Any], name: str, low: int, high: int) -> int | None:
    value = raw.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"speculative[{name!r}] must be an int in [{low}, {high}], got {value!r}")
    return value


def speculative_config(raw: Mapping[str, Any] | None) -> SpeculativeConfig | None:
    """The config `raw` describes (None: no speculation), every key checked: ValueError (TypeError
    for a value of the wrong kind) naming the key and what it accepts."""
    if raw is None:
        return None
    if not isinstance(raw, Mapping):
        raise TypeError(f"speculative must be None or a dict, got {type(raw).__name__}")
    unknown = set(raw) - set(KEYS)
    if unknown:
        raise ValueError(f"unknown speculative keys {sorted(unknown)}; allowed: {sorted(KEYS)}")
    model = raw.get("model")
    method = raw.get("method", "draft_model" if model is not None else None)
    if method in NOT_YET:
        raise ValueError(f"speculative['method']={method!r} is not supported yet; supported: {METHODS}")
    if method not in METHODS:
        raise ValueError(f"speculative['method'] must be one of {METHODS}, got {method!r}")
    count = _int_key(raw, "num_speculative_tokens", 1, MAX_SPECULATIVE_TOKENS)
    if count is None:
        raise ValueError(f"speculative['num_speculative_tokens'] is required: an int in [1, {MAX_SPECULATIVE_TOKENS}]")
    if method in ("custom", "mtp"):
        others = [key for key in ("prompt_lookup_min", "prompt_lookup_max", "model") if raw.get(key) is not None]
        if others:
            raise ValueError(f"speculative{others} do not apply to method {method!r}")
        if method == "mtp":
            if raw.get("drafter") is not None:
                raise ValueError("speculative['drafter'] applies to method 'custom' only, not 'mtp'")
            return SpeculativeConfig(method, count)
        return SpeculativeConfig(method, count, drafter=_drafter(raw.get("drafter")))
    if raw.get("drafter") is not None:
        raise ValueError(f"speculative['drafter'] applies to method 'custom' only, not {method!r}")
    if method == "draft_model":
        if not isinstance(model, (str, Path)) or not str(model):
            raise ValueError(f"speculative['model'] must name the draft checkpoint's directory for method "
                             f"'draft_model', got {model!r}")
        lookup = [key for key in ("prompt_lookup_min", "prompt_lookup_max") if raw.get(key) is not None]
        if lookup:
            raise ValueError(f"speculative{lookup} apply to method 'ngram' only, not 'draft_model'")
        return SpeculativeConfig(method, count, model=str(model))
    if model is not None:
        raise ValueError(f"speculative['model'] names a draft checkpoint, which method {method!r} does not take")
    low = _int_key(raw, "prompt_lookup_min", 1, MAX_LOOKUP)
    high = _int_key(raw, "prompt_lookup_max", 1, MAX_LOOKUP)
    if low is None and high is None:
        low = high = DEFAULT_LOOKUP
    low = high if low is None else low
    high = low if high is None else high
    assert low is not None and high is not None
    if low > high:
        raise ValueError(f"speculative['prompt_lookup_min']={low} must not exceed prompt_lookup_max={high}")
    return SpeculativeConfig(method, count, low, high)


def _drafter(value: Any) -> Drafter:
    """A custom drafter: a callable, or "package.module:function" imported here."""
    rule = "a callable (tokens, count) -> drafts, or its import path 'package.module:function'"
    if isinstance(value, str) and ":" in value:
        module, _, name = value.partition(":")
        try:
            value = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"speculative['drafter'] {value!r} cannot be imported: {exc}") from None
    if not callable(value):
        raise ValueError(f"speculative['drafter'] must be {rule}, got {value!r}")
    return value
