"""SamplingParams: how one request picks its tokens, validated on construction."""

from __future__ import annotations

import math
import numbers
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

MAX_SEED = 2**64 - 1
# Below this temperature sampling is greedy: dividing logits by a smaller one overflows fp32.
MIN_TEMPERATURE = 1e-5
MAX_TOP_K = 2**63 - 1  # the sampler's int64
MAX_TEMPERATURE = 3.4028234663852886e38  # the largest fp32: the sampler divides fp32 logits by it
MAX_LOGPROBS = 20  # the most alternatives a position reports (OpenAI's and vLLM's default limit)


def _short(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _int_in(name: str, value: object, low: int, high: int | None, rule: str) -> int:
    """`value` as an int (numpy and other Integral types accepted, bool not) in [low, high]."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) \
            or not low <= value or (high is not None and value > high):  # type: ignore[operator]  # Integral lacks >=
        raise ValueError(f"{name} must be {rule}, got {_short(value)}")
    return int(value)


def _real(value: object) -> float | None:
    """`value` as a float (inf when too large for one), or None when it is not a real number."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    try:
        return float(value)
    except OverflowError:
        return math.inf


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 (or below MIN_TEMPERATURE) is greedy. top_k 0 and top_p 1 disable those filters. A request
    without a seed gets a random one at submission, reported in its result so the run can be replayed.
    Every field is checked on construction: ValueError (TypeError for a container of the wrong
    kind) naming the field and its allowed range.

    logprobs: k in [0, MAX_LOGPROBS] also reports, for each generated token, the k most likely tokens
    at its position with their logprobs (ties by lower token id); None or 0: only the token's own.
    prompt_logprobs: score the prompt. True or 0: the logprob of every prompt token given the tokens
    before it (the first has none); k in [1, MAX_LOGPROBS]: with each position's top k as well. A
    scoring request always runs its whole prompt: it reuses no cached prefix."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: bool | int | None = None

    def __post_init__(self) -> None:
        set_field = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731  (frozen)
        set_field("max_tokens", _int_in("max_tokens", self.max_tokens, 1, None, "an int >= 1"))
        temperature = _real(self.temperature)
        if temperature is None or not 0 <= temperature <= MAX_TEMPERATURE:  # NaN fails both comparisons
            raise ValueError(f"temperature must be a finite number >= 0 and <= {MAX_TEMPERATURE:.4g} (the largest "
                             f"fp32), got {_short(self.temperature)}")
        set_field("temperature", temperature)
        set_field("top_k", _int_in("top_k", self.top_k, 0, MAX_TOP_K, "an int >= 0 (0 disables it) and < 2**63"))
        top_p = _real(self.top_p)
        if top_p is None or not 0 < top_p <= 1:
            raise ValueError(f"top_p must be a number in (0, 1], got {_short(self.top_p)}")
        set_field("top_p", top_p)
        if self.seed is not None:
            set_field("seed", _int_in("seed", self.seed, 0, MAX_SEED, "None or an int in [0, 2**64 - 1]"))
        if isinstance(self.stop_token_ids, (str, bytes, bytearray)) or not hasattr(self.stop_token_ids, "__iter__"):
            raise TypeError(f"stop_token_ids must be a sequence of ints, got {_short(self.stop_token_ids)}")
        try:
            stop = tuple(self.stop_token_ids)
        except TypeError:  # iterable in name only (a 0-d tensor or array)
            raise TypeError(f"stop_token_ids must be a sequence of ints, got {_short(self.stop_token_ids)}") from None
        set_field("stop_token_ids", tuple(_int_in("stop_token_ids", t, 0, None, "ints >= 0")
                                          for t in stop))
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"ignore_eos must be a bool, got {_short(self.ignore_eos)}")
        rule = f"None or an int in [0, {MAX_LOGPROBS}]"
        if self.logprobs is not None:
            set_field("logprobs", _int_in("logprobs", self.logprobs, 0, MAX_LOGPROBS, rule))
        if isinstance(self.prompt_logprobs, bool):
            set_field("prompt_logprobs", 0 if self.prompt_logprobs else None)
        elif self.prompt_logprobs is not None:
            set_field("prompt_logprobs", _int_in("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS,
                                                 f"True, False, {rule}"))

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE

    def resolved_seed(self) -> int:
        """The request's seed: the one given, or a fresh random one."""
        return self.seed if self.seed is not None else secrets.randbits(64)


def params_for(sampling_params: Any, count: int) -> list[SamplingParams]:
    """One SamplingParams per prompt, from what `LLM.generate` takes for `count` prompts: None (the
    defaults) or one SamplingParams for all, or a list of them."""
    if sampling_params is None:
        sampling_params = SamplingParams()
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * count
    if isinstance(sampling_params, Mapping):
        raise TypeError("sampling_params must be a SamplingParams or a list of them, got a dict; "
                        "use SamplingParams(**the_dict)")
    if isinstance(sampling_params, (str, bytes)) or not isinstance(sampling_params, Sequence):
        raise TypeError(f"sampling_params must be a SamplingParams or a list of them, "
                        f"got {type(sampling_params).__name__}")
    if len(sampling_params) != count:
        raise ValueError(f"got {len(sampling_params)} sampling_params for {count} prompts")
    for params in sampling_params:  # None stands for the defaults only in place of the whole argument
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
    return list(sampling_params)
