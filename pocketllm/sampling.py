"""SamplingParams: how one request picks its tokens, validated on construction."""

from __future__ import annotations

import math
import numbers
import secrets
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from .structured_outputs import StructuredOutputsParams, structured_outputs

MAX_SEED = 2**64 - 1
# Below this temperature sampling is greedy: dividing logits by a smaller one overflows fp32.
MIN_TEMPERATURE = 1e-5
MAX_TOP_K = 2**63 - 1  # the sampler's int64
MAX_TEMPERATURE = 3.4028234663852886e38  # the largest fp32: the sampler divides fp32 logits by it
MAX_LOGPROBS = 20  # the most alternatives a position reports (OpenAI's and vLLM's default limit)
MAX_PENALTY = 2.0  # presence_penalty and frequency_penalty lie in [-MAX_PENALTY, MAX_PENALTY] (OpenAI's range)
MAX_LOGIT_BIAS = 100.0  # a logit_bias value lies in [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS] (OpenAI's range)


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


def _number_in(name: str, value: object, low: float, high: float, rule: str) -> float:
    number = _real(value)
    if number is None or not low <= number <= high:  # NaN fails both comparisons
        raise ValueError(f"{name} must be {rule}, got {_short(value)}")
    return number


def _iterable(name: str, value: object, rule: str, shown: object) -> tuple[Any, ...]:
    """The items of `value`, a sequence (not a str, bytes or dict); TypeError saying `rule` otherwise."""
    if isinstance(value, (str, bytes, bytearray, Mapping)) or not isinstance(value, Iterable):
        raise TypeError(f"{name} must be {rule}, got {_short(shown)}")
    try:
        return tuple(value)
    except TypeError:  # iterable in name only (a 0-d tensor or array)
        raise TypeError(f"{name} must be {rule}, got {_short(shown)}") from None


def _token_ids(name: str, value: object, rule: str, shown: object = None) -> tuple[int, ...]:
    """`value` as a tuple of token ids (ints >= 0); ValueError (TypeError for a non-sequence) saying
    `rule` and showing `shown` (default: `value`)."""
    shown = value if shown is None else shown
    items = _iterable(name, value, rule, shown)
    if any(isinstance(item, bool) or not isinstance(item, numbers.Integral) or item < 0 for item in items):
        raise ValueError(f"{name} must be {rule}, got {_short(shown)}")
    return tuple(int(item) for item in items)


class LogitBias(Mapping[int, float]):
    """`SamplingParams.logit_bias` as stored: a read-only {token id: bias} in token id order, hashable
    (as SamplingParams is), whose repr is the dict literal that builds it again."""

    def __init__(self, items: Mapping[int, float]) -> None:
        self._items = dict(sorted(items.items()))

    def __getitem__(self, token: int) -> float:
        return self._items[token]

    def __iter__(self) -> Iterator[int]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(tuple(self._items.items()))

    def __repr__(self) -> str:
        return repr(self._items)


def _logit_bias(value: object) -> LogitBias | None:
    """`logit_bias` as stored: None for None or an empty dict, else a LogitBias."""
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise TypeError(f"logit_bias must be None or a dict of token id -> bias, got {_short(value)}")
    items = {}
    for token, bias in value.items():
        if isinstance(token, bool) or not isinstance(token, numbers.Integral) or token < 0:
            raise ValueError(f"logit_bias keys must be token ids (ints >= 0), got {_short(token)}")
        number = _real(bias)
        if number is None or not -MAX_LOGIT_BIAS <= number <= MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias values must be numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                             f"got {_short(bias)} for token {token}")
        items[int(token)] = number
    return LogitBias(items) if items else None


# The logits controls and their neutral values (a request with all of them neutral samples as before).
CONTROLS: dict[str, Any] = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
                            "logit_bias": None, "min_p": 0.0, "min_tokens": 0, "allowed_token_ids": None,
                            "bad_words_token_ids": ()}


@dataclass(frozen=True, repr=False)
class SamplingParams:
    """temperature 0 (or below MIN_TEMPERATURE) is greedy. top_k 0 and top_p 1 disable those filters. A request
    without a seed gets a random one at submission, reported in its result so the run can be replayed.
    Every field is checked on construction: ValueError (TypeError for a container of the wrong
    kind) naming the field and its allowed range.

    logprobs: k in [0, MAX_LOGPROBS] also reports, for each generated token, the k most likely tokens
    at its position with their logprobs (ties by lower token id); None or 0: only the token's own.
    prompt_logprobs: score the prompt. True or 0: the logprob of every prompt token given the tokens
    before it (the first has none); k in [1, MAX_LOGPROBS]: with each position's top k as well. A
    scoring request always runs its whole prompt: it reuses no cached prefix.

    Logits controls, with vLLM's semantics, each off by default (a request that sets none samples
    exactly as without them). They change the request's own row of logits before the sampler, from
    this request's tokens only, so its output stays the same whatever else is in flight. In order:
    1. allowed_token_ids: None, or the only token ids that may be sampled (non-empty);
    2. bad_words_token_ids: token id sequences; a token that would complete one of them after the
       tokens generated so far is masked (a one-token sequence: always);
    3. min_tokens in [0, max_tokens]: while fewer tokens have been generated, the stop tokens
       (stop_token_ids, and EOS unless ignore_eos) are masked;
    4. logit_bias: {token id: bias in [-100, 100]}, added to those logits (kept as a LogitBias);
    5. repetition_penalty > 0 (1: off): a token of the prompt or of the output so far has its logit
       divided by it when positive, multiplied by it otherwise; then frequency_penalty * c and
       presence_penalty (c > 0), each in [-2, 2] (0: off), are subtracted from the logit of a token
       generated c times so far (the prompt does not count);
    6. min_p in [0, 1] (0: off; sampled requests only): after temperature, a token whose probability
       is below min_p times the most likely token's is masked;
    then top-k and top-p and the draw; a greedy request takes the argmax of the processed logits.
    Token ids must lie in the model's vocabulary (checked at submission). Reported logprobs are raw,
    as vLLM's default (`logprobs_mode="raw_logprobs"`): the sampled token's and the alternatives'
    are the model's log-softmax, not the processed distribution's.

    structured_outputs: None, or a StructuredOutputsParams (or a dict of its fields): the output must
    follow a JSON schema, be a JSON object, match a regex, be one of a list of strings, or follow an
    EBNF grammar (pocketllm.structured_outputs). Compiled by xgrammar at submission (the `structured`
    extra); at each step the tokens the grammar does not allow next are masked, before the controls
    above, and the request ends ("stop") once the grammar is complete and EOS is sampled. Logprobs
    stay raw, as with the controls."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: bool | int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] | None = None
    min_p: float = 0.0
    min_tokens: int = 0
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    structured_outputs: StructuredOutputsParams | None = None

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
        self._check_controls(set_field)
        set_field("structured_outputs", structured_outputs(self.structured_outputs))

    def _check_controls(self, set_field: Callable[[str, object], None]) -> None:
        """The logits controls, each checked and kept in its canonical form."""
        for name in ("presence_penalty", "frequency_penalty"):
            set_field(name, _number_in(name, getattr(self, name), -MAX_PENALTY, MAX_PENALTY,
                                       f"a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}] (0 disables it)"))
        penalty = _real(self.repetition_penalty)
        if penalty is None or not 0 < penalty <= MAX_TEMPERATURE:
            raise ValueError(f"repetition_penalty must be a finite number > 0 (1 disables it), "
                             f"got {_short(self.repetition_penalty)}")
        set_field("repetition_penalty", penalty)
        set_field("min_p", _number_in("min_p", self.min_p, 0.0, 1.0, "a number in [0, 1] (0 disables it)"))
        set_field("min_tokens", _int_in("min_tokens", self.min_tokens, 0, self.max_tokens,
                                        f"an int in [0, max_tokens] (max_tokens is {self.max_tokens})"))
        set_field("logit_bias", _logit_bias(self.logit_bias))
        if self.allowed_token_ids is not None:
            rule = "None or a non-empty sequence of token ids (ints >= 0)"
            allowed = _token_ids("allowed_token_ids", self.allowed_token_ids, rule)
            if not allowed:
                raise ValueError(f"allowed_token_ids must be {rule}, got an empty one")
            set_field("allowed_token_ids", allowed)
        rule = "a sequence of non-empty sequences of token ids (ints >= 0)"
        words = self.bad_words_token_ids
        checked = tuple(_token_ids("bad_words_token_ids", word, rule, words)
                        for word in _iterable("bad_words_token_ids", words, rule, words))
        if not all(checked):
            raise ValueError(f"bad_words_token_ids must be {rule}, got an empty one in {_short(words)}")
        set_field("bad_words_token_ids", checked)

    def __repr__(self) -> str:
        """Python that builds it again: every field but the logits controls and structured_outputs,
        which appear when set."""
        optional = {**CONTROLS, "structured_outputs": None}
        shown = [f.name for f in fields(self) if f.name not in optional or getattr(self, f.name) != optional[f.name]]
        return f"SamplingParams({', '.join(f'{name}={getattr(self, name)!r}' for name in shown)})"

    @property
    def controls_logits(self) -> bool:
        """Whether a logits control is set: the runner then processes the request's logits before sampling."""
        return any(getattr(self, name) != neutral for name, neutral in CONTROLS.items())

    def control_token_ids(self) -> list[tuple[str, int]]:
        """(field, token id) for every token id the logits controls name: each must be in the vocabulary."""
        named = [("logit_bias", token) for token in self.logit_bias or ()]
        named += [("allowed_token_ids", token) for token in self.allowed_token_ids or ()]
        return named + [("bad_words_token_ids", token) for word in self.bad_words_token_ids for token in word]


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
