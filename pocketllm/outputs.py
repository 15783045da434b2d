"""GenerationResult: what a finished request returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "cancelled", "error"]


@dataclass
class GenerationResult:
    """Tokens and per-token logprobs (log-softmax of the raw logits at each sampled token).

    finish_reason: "stop" (EOS or a stop token, which is included in token_ids), "length"
    (max_tokens reached), "cancelled" or "error" (see `error`).
    text: token_ids decoded with special tokens (EOS among them) skipped, filled in by
    `LLM.generate` when the model directory has a tokenizer; None otherwise.
    """

    request_id: int
    prompt_tokens: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: str | None = None
    seed: int | None = None
    ttft_s: float | None = None
    total_time_s: float | None = None
    text: str | None = None
