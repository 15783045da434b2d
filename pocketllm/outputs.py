"""GenerationResult: what a finished request returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "cancelled", "error"]
TopLogprobs = list[tuple[int, float]]  # (token id, logprob), best first, ties by lower id


@dataclass
class GenerationResult:
    """Tokens and per-token logprobs (log-softmax of the raw logits at each sampled token).

    finish_reason: "stop" (EOS or a stop token, which is included in token_ids), "length"
    (max_tokens reached), "cancelled" or "error" (see `error`).
    text: token_ids decoded with special tokens (EOS among them) skipped, filled in by
    `LLM.generate` when the model directory has a tokenizer; None otherwise.
    top_logprobs: with `SamplingParams.logprobs=k`, the k best tokens at each generated position.
    prompt_logprobs / prompt_top_logprobs: with `SamplingParams.prompt_logprobs`, one entry per
    prompt token (None for the first, which nothing predicts): its logprob given the tokens before
    it, and (k >= 1) that position's k best tokens. Every logprob is the log-softmax of the raw
    logits, as for generated tokens; None where not asked for.
    spec_draft_tokens / spec_accepted_tokens: with speculative decoding, the tokens drafted for
    this request and those accepted (0 without); its tokens and logprobs are the same either way.
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
    top_logprobs: list[TopLogprobs] | None = None
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[TopLogprobs | None] | None = None
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
