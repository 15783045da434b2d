"""The logits controls (SamplingParams' penalties, logit_bias, min_p, min_tokens, allowed_token_ids and
bad words), written out from their specification (vLLM's semantics, the SamplingParams docstring),
one row at a time in plain Python, independently of pocketllm/logits_processors.py.

`controlled(...)` mimics the engine's fp32 arithmetic exactly (each +, -, *, / rounded to fp32, which
is what an fp32 operation gives: a double result rounded once more to fp32 is the correctly rounded
fp32 result for these operations), so its logits equal the engine's bit for bit; only min_p, which
compares an exponential, has tokens too close to its threshold to call (returned apart).
`controlled_float64(...)` applies the same rule to float64 logits (transformers'), for oracles that
allow for an error in the logits.

Nothing here imports pocketllm.
"""

from __future__ import annotations

import math
import struct
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

NEG_INF = float("-inf")
MIN_TEMPERATURE = 1e-5  # below it a request is greedy, and min_p does not apply
MIN_P_MARGIN = 1e-6  # relative: fp32 exp and subtraction move p / p_max by far less than this


def f32(x: float) -> float:
    """x rounded to the nearest fp32 (inf beyond its range)."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


@dataclass(frozen=True)
class Controls:
    """The controls of one request, as plain values (the SamplingParams fields of the same names)."""

    temperature: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    min_p: float = 0.0
    min_tokens: int = 0
    allowed_token_ids: Sequence[int] | None = None
    bad_words: Sequence[Sequence[int]] = ()


def masked(c: Controls, output: Sequence[int], stop_ids: Sequence[int], vocab: int) -> set[int]:
    """Tokens set to -inf: those not allowed, those that complete a bad word after the output so far
    (its tokens but the last are the output's last ones), and the stop tokens before min_tokens."""
    out = set() if c.allowed_token_ids is None else set(range(vocab)) - set(c.allowed_token_ids)
    for word in c.bad_words:
        prefix = list(word[:-1])
        if len(prefix) <= len(output) and list(output)[len(output) - len(prefix):] == prefix:
            out.add(word[-1])
    if len(output) < c.min_tokens:
        out |= set(stop_ids)
    return out


def _apply(logits: Sequence[float], c: Controls, prompt: Sequence[int], output: Sequence[int],
           stop_ids: Sequence[int], r: Callable[[float], float]) -> list[float]:
    """Masks, bias, then the penalties, with `r` rounding each result (f32, or nothing)."""
    x = list(logits)
    for token in masked(c, output, stop_ids, len(x)):
        x[token] = NEG_INF
    for token, bias in c.logit_bias.items():
        x[token] = r(x[token] + r(bias))
    if c.repetition_penalty != 1.0:
        p = r(c.repetition_penalty)
        for token in set(prompt) | set(output):
            x[token] = r(x[token] / p) if x[token] > 0 else r(x[token] * p)
    counts = Counter(output)
    if c.frequency_penalty:
        for token, n in counts.items():
            x[token] = r(x[token] - r(r(c.frequency_penalty) * n))
    if c.presence_penalty:
        for token in counts:
            x[token] = r(x[token] - r(c.presence_penalty))
    return x


def controlled(logits: Sequence[float], c: Controls, prompt: Sequence[int], output: Sequence[int],
               stop_ids: Sequence[int] = ()) -> tuple[list[float], set[int]]:
    """(fp32 logits after the controls, tokens min_p is too close to call for). `logits` are fp32
    values. min_p (a sampled request): a token with exp(z - z_max) < min_p, z = logits / T, is masked."""
    x = _apply(logits, c, prompt, output, stop_ids, f32)
    unsure: set[int] = set()
    if c.min_p > 0 and c.temperature >= MIN_TEMPERATURE:
        t, threshold = f32(c.temperature), f32(c.min_p)
        z = [f32(v / t) for v in x]
        top = max(z)
        for token, value in enumerate(z):
            ratio = math.exp(f32(value - top)) if value > NEG_INF else 0.0
            if abs(ratio - threshold) <= MIN_P_MARGIN * threshold:
                unsure.add(token)
            elif ratio < threshold:
                x[token] = NEG_INF
    return x, unsure


def controlled_float64(logits: Sequence[float], c: Controls, prompt: Sequence[int], output: Sequence[int],
                       stop_ids: Sequence[int], logit_error: float) -> tuple[list[float], float, bool]:
    """(float64 logits after the controls, the error they may have, whether min_p's cut is certain)
    for logits off by up to `logit_error` from the engine's: the penalties scale that error by the
    repetition penalty, and a token whose p / p_max lies within what the error can move is unsure."""
    x = _apply(logits, c, prompt, output, stop_ids, lambda v: v)
    error = logit_error * max(c.repetition_penalty, 1 / c.repetition_penalty) + 1e-5  # + fp32 rounding
    certain = True
    if c.min_p > 0 and c.temperature >= MIN_TEMPERATURE:
        top = max(x)
        for token, value in enumerate(x):
            if value == NEG_INF:
                continue
            log_ratio, log_threshold = (value - top) / c.temperature, math.log(c.min_p)
            if abs(log_ratio - log_threshold) <= 2 * error / c.temperature + 1e-6:
                certain = False
            elif log_ratio < log_threshold:
                x[token] = NEG_INF
    return x, error, certain
