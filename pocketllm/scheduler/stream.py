"""Token deltas: what streaming hands out as tokens are sampled.

`TokenDelta` is one sampled token (and, with a tokenizer, the text it completes). `TextDeltas`
turns a growing list of token ids into text pieces: a byte-level token can end inside a UTF-8
character, whose decoded form then ends in U+FFFD; such text is held back until a later token
completes the character, so the pieces always concatenate to the decoded whole.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

REPLACEMENT = "\ufffd"


@dataclass(frozen=True)
class TokenDelta:
    """Token number `index` (from 0) of request `request_id`. `text`: the text this token adds
    (None without a tokenizer; "" while a character is incomplete). `last`: the request finished
    with this token (it stopped or reached max_tokens)."""

    request_id: int
    index: int
    token_id: int
    logprob: float
    text: str | None = None
    last: bool = False


class TextDeltas:
    """Incremental detokenizer over `decode(token_ids) -> str`."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self._tokens: list[int] = []
        self._sent = ""

    def add(self, token_id: int) -> str:
        """The text that `token_id` adds to what was handed out; "" while a character is incomplete."""
        self._tokens.append(token_id)
        text = self._decode(self._tokens)
        if text.endswith(REPLACEMENT) or not text.startswith(self._sent):
            return ""
        delta, self._sent = text[len(self._sent):], text
        return delta

    def flush(self) -> str:
        """What is left once the request has ended (an incomplete character as U+FFFD)."""
        text = self._decode(self._tokens)
        delta = text[len(self._sent):] if text.startswith(self._sent) else ""
        self._sent = text
        return delta
