"""SamplingParams: how one request picks its tokens, validated on construction."""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass

MAX_SEED = 2**64 - 1
# Below this temperature sampling is greedy: dividing logits by a smaller one overflows fp32.
MIN_TEMPERATURE = 1e-5


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 (or below MIN_TEMPERATURE) is greedy. top_k 0 and top_p 1 disable those filters. A request without a
    seed gets a random one at submission, reported in its result so the run can be replayed."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or isinstance(self.temperature, bool) \
                or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 disables it), got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or isinstance(self.top_p, bool) \
                or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be a number in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= MAX_SEED):
            raise ValueError(f"seed must be None or an int in [0, 2**64 - 1], got {self.seed!r}")
        if isinstance(self.stop_token_ids, (str, bytes)) or not hasattr(self.stop_token_ids, "__iter__"):
            raise TypeError(f"stop_token_ids must be a sequence of ints, got {self.stop_token_ids!r}")
        stop = tuple(self.stop_token_ids)
        if not all(_is_int(t) and t >= 0 for t in stop):
            raise ValueError(f"stop_token_ids must be ints >= 0, got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop_token_ids", stop)
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE

    def resolved_seed(self) -> int:
        """The request's seed: the one given, or a fresh random one."""
        return self.seed if self.seed is not None else secrets.randbits(64)
