"""Token deltas: what streaming hands out as tokens are sampled.

`TokenDelta` is one sampled token (and, with a tokenizer, the text it completes). `TextDeltas`
turns a growing list of token ids into text pieces: a byte-level token can end inside a UTF-8
character, whose decoded form then ends in U+FFFD; such text is held back until a later token
completes the character, so the pieces always concatenate to the decoded whole. `DeltaText`
gives one consumer's deltas their text: a delta whose token leaves the text inside a character
waits for the next token, or for the request's end, however it ends, which flushes what is held
back; so the text handed out adds up to the result's text whether the request stopped, ran to
its length, was cancelled or failed. `Subscriber` is who hears of one request: its callbacks and
its `DeltaText`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from ..outputs import GenerationResult, TopLogprobs

REPLACEMENT = "\ufffd"


@dataclass(frozen=True)
class TokenDelta:
    """Token number `index` (from 0) of request `request_id`. `text`: the text this token adds
    (None without a tokenizer; "" while a character is incomplete). `last`: the request finished
    with this token (it stopped or reached max_tokens). `top_logprobs`: with
    `SamplingParams.logprobs=k`, the k best tokens at this position, the entry the result's
    `top_logprobs` holds for it (None otherwise), so a streaming client needs no final result.
    `prompt_logprobs` / `prompt_top_logprobs`: on token 0 of a request that scores its prompt
    (`SamplingParams.prompt_logprobs`), the result's: the prompt is scored by the time its first
    token is sampled (None otherwise)."""

    request_id: int
    index: int
    token_id: int
    logprob: float
    text: str | None = None
    last: bool = False
    top_logprobs: TopLogprobs | None = None
    prompt_logprobs: list[float | None] | None = None
    prompt_top_logprobs: list[TopLogprobs | None] | None = None


class TextDeltas:
    """Incremental detokenizer over `decode(token_ids) -> str`."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self._tokens: list[int] = []
        self._sent = ""
        self.holding = False  # the text so far ends inside a character: add() held it back

    def add(self, token_id: int) -> str:
        """The text that `token_id` adds to what was handed out; "" while a character is incomplete."""
        self._tokens.append(token_id)
        text = self._decode(self._tokens)
        self.holding = text.endswith(REPLACEMENT) or not text.startswith(self._sent)
        if self.holding:
            return ""
        delta, self._sent = text[len(self._sent):], text
        return delta

    def flush(self) -> str:
        """What is left once the request has ended (an incomplete character as U+FFFD)."""
        text = self._decode(self._tokens)
        delta = text[len(self._sent):] if text.startswith(self._sent) else ""
        self._sent, self.holding = text, False
        return delta


class DeltaText:
    """One consumer's token deltas of one request, with their text (`texts` None: no tokenizer,
    deltas pass as they are). `push` returns the deltas ready to hand out, in order; `end`, once
    the request has ended, the one still held, with what was held back. At most one delta is held:
    the latest, while the text ends inside a character; it goes out with the next token."""

    def __init__(self, texts: TextDeltas | None) -> None:
        self._texts = texts
        self._held: TokenDelta | None = None

    def push(self, delta: TokenDelta) -> list[TokenDelta]:
        texts = self._texts
        if texts is None:
            return [delta]
        piece = texts.add(delta.token_id)
        ready = [] if self._held is None else [dataclasses.replace(self._held, text="")]
        if texts.holding and not delta.last:
            self._held = delta
            return ready
        self._held = None
        return ready + [dataclasses.replace(delta, text=piece + (texts.flush() if delta.last else ""))]

    def end(self) -> list[TokenDelta]:
        if self._texts is None or self._held is None:
            return []
        held, self._held = self._held, None
        return [dataclasses.replace(held, text=self._texts.flush())]


Callback = Callable[[GenerationResult], None]
TokenCallback = Callable[[TokenDelta], None]


@dataclass
class Subscriber:
    """Who hears of one request: `callback(result)` once it has ended, `on_token(delta)` after
    each token, with `deltas` giving them their text when the engine detokenizes."""

    callback: Callback | None
    on_token: TokenCallback | None
    deltas: DeltaText
    queued: int = 0  # tokens whose deltas are queued for on_token so far
