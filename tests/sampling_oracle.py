"""The documented sampling rule, written out from its specification (the docstring of
pocketllm/kernels/sample.py and docs/api.md), independently of the package's sampler.

Given float64 logits that may be off by up to `logit_error` from the ones the sampler saw, the
oracle says which token the rule draws, or that the draw is too close to call: a filter boundary
(top-k rank, top-p mass) or the Gumbel-max winner lies within what that error could move.

Nothing here imports pocketllm.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

MASK32 = 0xFFFFFFFF
POSITION_SALT = 0x9E3779B9
MAX_UNIFORM = 1.0 - 2.0**-24
GUMBEL_ERROR = 1e-5  # the sampler evaluates -log(-log u) in fp32; this bounds its error (|g| < 18)


def mix(x: int) -> int:
    """lowbias32 on a 32-bit value, with Python's exact integers reduced mod 2^32."""
    x ^= x >> 16
    x = (x * 0x7FEB352D) & MASK32
    x ^= x >> 15
    x = (x * 0x846CA68B) & MASK32
    return x ^ (x >> 16)


def uniforms(seed: int, position: int, vocab: int) -> list[float]:
    """u_v for v in [0, vocab): a hash of (seed, position, v), strictly inside (0, 1): the 24-bit
    draw plus one half, over 2^24, capped at the largest fp32 below 1 (exact here; fp32 rounds the
    draws of 2^23 and above to an even neighbour, never by more than 2^-25)."""
    key = mix((seed & MASK32) ^ mix(((seed >> 32) & MASK32) ^ mix((position & MASK32) ^ POSITION_SALT)))
    return [min(((mix(key ^ mix(v)) >> 8) + 0.5) / 2**24, MAX_UNIFORM) for v in range(vocab)]


@dataclass(frozen=True)
class Draw:
    token: int | None  # None: too close to call
    reason: str  # why it could not be called ("" when decided)


def draw(logits: list[float], temperature: float, top_k: int, top_p: float, seed: int, position: int,
         logit_error: float = 0.0) -> Draw:
    """The token the rule draws from `logits` (temperature > 0).

    Allowed set: the top_k largest logits / T (k = 0: all), then, in descending order, every token
    whose renormalised probability mass strictly before it is < top_p (top_p = 1: all); the most
    likely token always stays. Token: argmax over the allowed set of z_v + g_v, g_v = -log(-log u_v).
    """
    vocab = len(logits)
    z = [x / temperature for x in logits]
    delta = 2.0 * logit_error / temperature  # the most two scaled logits can move apart
    g = [-math.log(-math.log(u)) for u in uniforms(seed, position, vocab)]

    ascending = sorted(z)

    def count_above(v: int, threshold: float, strict: bool) -> int:
        """Tokens other than v whose scaled logit is > threshold (>= when not strict)."""
        index = bisect.bisect_right(ascending, threshold) if strict else bisect.bisect_left(ascending, threshold)
        own = (z[v] > threshold) if strict else (z[v] >= threshold)
        return vocab - index - int(own)

    # Top-k: certainly in if fewer than k others could be above it; certainly out if k others surely are.
    certain = [True] * vocab
    possible = [True] * vocab
    if 0 < top_k < vocab:
        for v in range(vocab):
            possible[v] = count_above(v, z[v] + delta, strict=True) < top_k
            certain[v] = count_above(v, z[v] - delta, strict=False) < top_k
    if top_p < 1.0:
        kept = sorted((v for v in range(vocab) if possible[v]), key=lambda v: z[v])  # ascending
        kept_z = [z[v] for v in kept]
        top = kept_z[-1]
        weights = [math.exp(x - top) for x in kept_z]
        total = sum(weights)
        probs = [w / total for w in weights]
        mass_from = [0.0] * (len(kept) + 1)  # mass_from[i]: probability of kept[i:]
        for i in range(len(kept) - 1, -1, -1):
            mass_from[i] = mass_from[i + 1] + probs[i]
        # Uncertain top-k members change the normalisation; perturbed logits change each probability.
        slack = sum(p for v, p in zip(kept, probs) if not certain[v]) + 2.0 * math.expm1(delta) + 1e-12
        for i, v in enumerate(kept):
            before_lo = mass_from[bisect.bisect_right(kept_z, z[v] + delta)]
            before_hi = mass_from[bisect.bisect_left(kept_z, z[v] - delta)] - probs[i]
            surely_first = bisect.bisect_left(kept_z, z[v] - delta) == len(kept) - 1
            maybe_first = bisect.bisect_right(kept_z, z[v] + delta) == len(kept)
            certain[v] = certain[v] and (surely_first or before_hi + slack < top_p)
            possible[v] = possible[v] and (maybe_first or before_lo - slack < top_p)
    score = [z[v] + g[v] for v in range(vocab)]
    candidates = [v for v in range(vocab) if certain[v]]
    if not candidates:
        return Draw(None, "no token certainly allowed")
    winner = max(candidates, key=lambda v: (score[v], -v))
    rivals = [score[v] for v in range(vocab) if possible[v] and v != winner]
    if rivals and max(rivals) >= score[winner] - delta - 2 * GUMBEL_ERROR:
        return Draw(None, "winner within the error margin")
    return Draw(winner, "")
