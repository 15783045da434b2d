"""Drafters for the speculation properties (`speculative={"method": "custom", "drafter": ...}`): an
adversary that proposes random tokens, an oracle that proposes what the request will generate (taken
from a run without speculation), and the oracle's tokens at a wrong offset. Whatever they propose,
a speculating engine's output must be its output without speculation; the oracle's drafts must all
be accepted and the random ones almost never, which checks the counters."""

from __future__ import annotations

import random
from collections.abc import Sequence

from . import _checks as check


class RandomDrafter:
    """`count` token ids below `vocab`, drawn from the tokens so far (the same tokens, the same drafts)."""

    def __init__(self, vocab: int, seed: int = 0) -> None:
        check.positive("RandomDrafter", vocab=vocab)
        self.vocab, self.seed = vocab, seed

    def __call__(self, tokens: Sequence[int], count: int) -> list[int]:
        rng = random.Random(hash((self.seed, *tokens)))
        return [rng.randrange(self.vocab) for _ in range(count)]

    def __repr__(self) -> str:
        return f"RandomDrafter({self.vocab}, seed={self.seed})"


class OracleDrafter:
    """The tokens a request will generate after `tokens`, for the prompts it was taught (`learn`:
    a prompt and its output without speculation), shifted by `offset` positions (0: the oracle; 1:
    the right tokens one position late). Nothing for a prompt it was not taught."""

    def __init__(self, offset: int = 0) -> None:
        check.integer("OracleDrafter", "offset", offset, 0)
        self.offset = offset
        self.outputs: dict[tuple[int, ...], list[int]] = {}

    def learn(self, prompt: Sequence[int], output: Sequence[int]) -> None:
        self.outputs[tuple(prompt)] = list(output)

    def __call__(self, tokens: Sequence[int], count: int) -> list[int]:
        for prompt, output in self.outputs.items():
            done = len(tokens) - len(prompt)
            if 0 <= done <= len(output) and tuple(tokens[:len(prompt)]) == prompt \
                    and list(tokens[len(prompt):]) == output[:done]:
                start = done - self.offset
                return output[start:start + count] if start >= 0 else []
        return []

    def __repr__(self) -> str:
        return f"OracleDrafter(offset={self.offset})"
