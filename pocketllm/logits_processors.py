"""The logits controls of SamplingParams (penalties, logit_bias, min_p, min_tokens, allowed_token_ids,
bad_words_token_ids): one request's row of logits changed before the sampler, from that request's
own tokens, in vLLM's order (see SamplingParams' docstring for each control's meaning).

Row-local by construction: `process_row` takes one row, a 1-D tensor as long as the vocabulary,
and runs the same ops on it whatever rows the batch holds beside it, so a request gets the same
bits batched or alone. Its arithmetic is fp32 +, -, *, / and comparisons, each correctly rounded
and so the same on any code path; the one transcendental (min_p's exp) runs through
`elementwise_invariant`, so no element's bits depend on where it falls in a vectorized loop.
The runner calls it only for requests that set a control: the others sample exactly as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .kernels.pointwise import elementwise_invariant
from .sampling import SamplingParams


class LogitsControlError(RuntimeError):
    """A request's logits controls left no token to sample (every one masked), or made a logit
    infinite (a repetition_penalty that overflows fp32): that request fails."""


@dataclass(frozen=True)
class TokenHistory:
    """What a request's controls read when it samples: its prompt, the tokens it generated before
    this one, and the tokens that would stop it (stop_token_ids, and EOS unless ignore_eos), which
    min_tokens masks. The sequences are read during the forward, before the sampled token is added."""

    prompt: Sequence[int]
    output: Sequence[int]
    stop_ids: tuple[int, ...] = ()


def _ids(tokens: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(list(tokens), dtype=torch.int64, device=device)


def _fp32(value: float, device: torch.device) -> torch.Tensor:
    """A parameter as the fp32 scalar every op below computes with (the sampler's temperature is one too)."""
    return torch.tensor(value, dtype=torch.float32, device=device)


def completes_bad_word(word: Sequence[int], output: Sequence[int]) -> bool:
    """Whether the output so far ends with all of `word` but its last token (vLLM's rule: only the
    generated tokens count, so a one-token word always does)."""
    prefix = len(word) - 1
    return prefix <= len(output) and list(output[len(output) - prefix:]) == list(word[:prefix])


def masked_tokens(params: SamplingParams, history: TokenHistory) -> list[int]:
    """The tokens bad_words_token_ids and min_tokens mask at this step."""
    masked = [word[-1] for word in params.bad_words_token_ids if completes_bad_word(word, history.output)]
    if len(history.output) < params.min_tokens:
        masked += history.stop_ids
    return masked


def process_row(logits: torch.Tensor, params: SamplingParams, history: TokenHistory) -> torch.Tensor:
    """One row of logits [V] with `params`' controls applied (a new fp32 tensor): masks (-inf) of
    allowed_token_ids, bad words and min_tokens, logit_bias, then the repetition, frequency and
    presence penalties, then min_p on logits / temperature. LogitsControlError when no token is left
    or a logit became +inf or NaN."""
    row = logits.float().clone()
    device = row.device
    if params.allowed_token_ids is not None:
        banned = torch.ones(row.shape[0], dtype=torch.bool, device=device)
        banned[_ids(params.allowed_token_ids, device)] = False
        row.masked_fill_(banned, float("-inf"))
    masked = masked_tokens(params, history)
    if masked:
        row[_ids(masked, device)] = float("-inf")
    if params.logit_bias:
        index = _ids(list(params.logit_bias), device)
        row[index] += torch.tensor(list(params.logit_bias.values()), dtype=torch.float32, device=device)
    _penalize(row, params, history)
    if params.min_p > 0 and not params.greedy:
        scaled = row / _fp32(params.temperature, device)
        ratio = elementwise_invariant(torch.exp, scaled - scaled.max())  # p / p_max; 1 at the most likely
        row.masked_fill_(ratio < _fp32(params.min_p, device), float("-inf"))
    if not bool((row > float("-inf")).any()):
        raise LogitsControlError("the logits controls left no token to sample: allowed_token_ids, "
                                 "bad_words_token_ids and min_tokens mask every one")
    if bool((torch.isnan(row) | (row == float("inf"))).any()):
        raise LogitsControlError("the logits controls made a logit +inf or NaN (a repetition_penalty this small "
                                 "overflows fp32)")
    return row


def _penalize(row: torch.Tensor, params: SamplingParams, history: TokenHistory) -> None:
    """vLLM's penalties, in place: repetition over the prompt's and the output's tokens, then
    frequency (times each output token's count) and presence over the output's."""
    device = row.device
    if params.repetition_penalty != 1.0:
        seen = torch.unique(_ids([*history.prompt, *history.output], device))
        values = row[seen]
        penalty = _fp32(params.repetition_penalty, device)
        row[seen] = torch.where(values > 0, values / penalty, values * penalty)
    if (params.frequency_penalty or params.presence_penalty) and history.output:
        tokens, counts = torch.unique(_ids(history.output, device), return_counts=True)
        if params.frequency_penalty:
            row[tokens] -= _fp32(params.frequency_penalty, device) * counts.float()
        if params.presence_penalty:
            row[tokens] -= _fp32(params.presence_penalty, device)
