"""Drafts for speculative decoding, one `Speculation` per request: what to propose, and how many.

Proposing is the only part that may guess: the runner verifies every draft against the tokens the
request's sampler draws (runner.py), so what is proposed changes the speed, never the output.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from ..kernels._gated_delta import CHUNK_SIZE
from ..speculative import SpeculativeConfig

logger = logging.getLogger("pocketllm.scheduler.batch_scheduler")
MAX_CANDIDATES = 64  # earlier occurrences of the last token a lookup examines, latest first
MAX_BACKOFF = 16  # the most decode steps a request goes without drafting after its drafts missed


def check_speculative(config: SpeculativeConfig | None, exact_positions: bool) -> None:
    """ValueError unless speculation (when asked for) is exact here: a verified row must have the bits
    its decode step would, which exact positions give."""
    if config is not None and not exact_positions:
        raise ValueError("speculative decoding needs exact positions (a verified row has its decode step's bits): "
                         "this engine runs without them (the torch backend without a C++ compiler, or "
                         "backend_options exact_positions=False or decode_per_row=True)")


def speculation_for(config: SpeculativeConfig | None, recurrent: bool, vocab_size: int) -> Speculation | None:
    """A new request's drafting under the engine's config (None: it does not speculate);
    `recurrent`: the model has Gated DeltaNet states (see Speculation)."""
    return None if config is None else Speculation(config, recurrent, vocab_size)


class NgramIndex:
    """Where each token occurs in a request's tokens, grown as tokens come (a lookup then reads only
    the occurrences of the last token, not the whole sequence)."""

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.at: dict[int, list[int]] = {}

    def extend(self, tokens: Sequence[int]) -> None:
        for token in tokens[len(self.tokens):]:
            self.at.setdefault(token, []).append(len(self.tokens))
            self.tokens.append(token)

    def propose(self, count: int, low: int, high: int) -> list[int]:
        """Up to `count` tokens: those that followed an earlier occurrence of the longest n-gram,
        `high` down to `low` tokens, that ends the tokens (none without a match); among equally long
        matches the latest that is followed by `count` tokens, else the one followed by the most."""
        tokens, n = self.tokens, len(self.tokens)
        if n < 2 or count < 1:
            return []
        best, best_score = -1, (0, 0)
        for end in reversed(self.at[tokens[-1]][-MAX_CANDIDATES - 1:-1]):  # end: an earlier occurrence
            length = 1
            while length < high and length <= end and tokens[end - length] == tokens[n - 1 - length]:
                length += 1
            score = (length, min(count, n - 1 - end))
            if score > best_score:
                best, best_score = end, score
                if score == (high, count):
                    break
        if best_score[0] < low:
            return []
        return tokens[best + 1:best + 1 + count]


class Speculation:
    """A request's drafting: its n-gram index, how many tokens it drafts next (all of
    num_speculative_tokens after a full hit, one more than it had accepted after a miss, and after
    a miss of a single draft none for a number of steps that doubles up to MAX_BACKOFF, so a request
    whose drafts never hit runs almost as without speculation), and its counts.

    `recurrent` (a model with Gated DeltaNet layers): a verify piece keeps the slot's states after
    each of its positions (`keeps`), so a partly accepted one takes them back to its accepted end
    (`SlotManager.verified`), and it ends inside its first position's chunk of the exact replay
    (CHUNK_SIZE): the replay rows of that chunk, which the kept states go with, are never written
    over by the next chunk's."""

    def __init__(self, config: SpeculativeConfig, recurrent: bool = False, vocab_size: int = 2**31) -> None:
        self.config = config
        self.recurrent, self.vocab_size = recurrent, vocab_size
        self.refused = False  # a custom drafter's bad proposal was logged
        self.index = NgramIndex()
        self.width = config.num_speculative_tokens
        self.backoff = self.wait = 0
        self.drafted = self.accepted = self.verifies = 0
        self.pending = 0  # draft_model, mtp: the drafts its model may propose before this step's forward
        self.draft_cached = 0  # draft_model, mtp: positions its draft slot holds (mtp: pairs, see mtp_drafts.py)
        self.hidden: torch.Tensor | None = None  # mtp: the model's normed hidden states of positions
        self.hidden_start = 0  # hidden_start.., as the forwards gave them and the MTP layer has not fed yet

    def most_drafts(self, start: int, most: int) -> int:
        """The most drafts a verify piece from position `start` may hold: `most`, and on a recurrent
        model no further than the end of its chunk."""
        return min(most, CHUNK_SIZE - 1 - start % CHUNK_SIZE) if self.recurrent else most

    def keeps(self, start: int, drafts: int) -> tuple[int, ...]:
        """Where a verify piece from `start` with `drafts` drafts keeps the slot's states (see above)."""
        return tuple(range(start + 1, start + drafts + 1)) if self.recurrent else ()

    def propose(self, tokens: Sequence[int], most: int) -> list[int]:
        """The drafts for the step after `tokens` (at most `most`): a prompt lookup's, at once; a draft
        model's come in the step (`draft_model.py`), which may propose `pending` of them."""
        if self.wait:
            self.wait -= 1
            return []
        count = min(self.width, most)
        if self.config.method in ("draft_model", "mtp"):
            self.pending = count
            return []
        if self.config.drafter is not None:
            return self._custom(tokens, count)
        low, high = self.config.prompt_lookup_min, self.config.prompt_lookup_max
        assert low is not None and high is not None  # an n-gram config has both
        self.index.extend(tokens)
        return self.index.propose(count, low, high)

    def observe(self, start: int, rows: torch.Tensor) -> None:
        """The model's normed hidden states of positions start.. (rows it computed for the request's
        tokens), kept for the MTP layer: appended, or in place of what they overlap or leave a gap to."""
        held = self.hidden
        if held is not None and self.hidden_start <= start <= self.hidden_start + held.shape[0]:
            self.hidden = torch.cat([held[:start - self.hidden_start], rows])
        else:  # a copy: `rows` may be a view of the whole batch's rows
            self.hidden, self.hidden_start = rows.clone(), start

    def hidden_rows(self, begin: int, end: int) -> torch.Tensor | None:
        """The kept hidden states of positions begin..end-1, None unless all are kept."""
        held, first = self.hidden, begin - self.hidden_start
        if held is None or first < 0 or end - self.hidden_start > held.shape[0]:
            return None
        return held[first:end - self.hidden_start]

    def forget_hidden(self, below: int) -> None:
        """Drop the kept hidden states of positions below `below` (the MTP layer has fed them)."""
        if self.hidden is not None and below > self.hidden_start:
            self.hidden, self.hidden_start = self.hidden[below - self.hidden_start:], below

    def _custom(self, tokens: Sequence[int], count: int) -> list[int]:
        """A custom drafter's drafts, up to `count` token ids in the vocabulary; a drafter that raises
        or proposes anything else costs the request its drafts (logged once), never its output."""
        assert self.config.drafter is not None
        try:
            drafts = list(self.config.drafter(list(tokens), count))[:count]
            if all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < self.vocab_size for t in drafts):
                return drafts
            problem = f"proposed {drafts!r}: token ids in [0, {self.vocab_size}) wanted"
        except Exception as exc:
            problem = f"raised {type(exc).__name__}: {exc}"
        if not self.refused:
            logger.warning("speculative drafter %r %s; the request goes on without its drafts",
                           self.config.drafter, problem)
            self.refused = True
        return []

    def verified(self, start: int, drafted: int, accepted: int) -> None:
        """A verify piece from position `start` of `drafted` drafts accepted the first `accepted`."""
        self.drafted, self.accepted, self.verifies = self.drafted + drafted, self.accepted + accepted, self.verifies + 1
        self.draft_cached = min(self.draft_cached, start + 1 + accepted)  # the draft slot's tokens that stand
        if accepted == drafted:
            self.width, self.backoff = self.config.num_speculative_tokens, 0
        elif accepted:
            self.width, self.backoff = accepted + 1, 0
        else:
            self.width = 1
            if drafted == 1:
                self.backoff = min(max(1, 2 * self.backoff), MAX_BACKOFF)
                self.wait = self.backoff
