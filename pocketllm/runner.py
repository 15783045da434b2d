"""ModelRunner: a list of sequences -> one ForwardBatch -> model forward -> a sampled token for
each sequence that samples (decode rows, and prefill pieces that end their prompt), and the scores
of the rows a prefill piece asks to score (prompt logprobs).

The serial path and the batch scheduler both step requests through here, on the same slot cache.
A forward either returns finite logprobs for every sequence, or raises; it touches the
cache only through the model's forward (what the slots hold is the slot manager's business, and so
is putting their states back before a failed batch is rerun: see `scheduler/execute.py`).
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field

import torch

from .cache import SlotCache
from .grammar import GrammarState
from .logits_processors import TokenHistory, process_row
from .models import ForwardBatch, Model
from .sampling import SamplingParams
from .workers import Workers


@dataclass(frozen=True)
class SequenceInput:
    """New tokens of one sequence: `start` tokens of it are already in slot `slot`. `decode`: one
    token through the decode ops; otherwise a prefill piece. `sample`: whether a token is sampled
    after it (not for a prefill piece that ends inside the prompt). `targets`: the tokens its first
    rows are scored against (row i: the token after token_ids[i]; empty: nothing is scored).
    `keeps`: positions inside a prefill piece where the slot's recurrent states are kept on the way
    (`SlotCache.keep_state`), for prefix reuse. `history`: the request's tokens, which a sequence that
    samples needs when its params set a logits control (`SamplingParams.controls_logits`). `grammar`:
    the matcher of a request with structured outputs, whose mask a sequence that samples applies.
    `drafts`: a verify piece (speculative decoding), token_ids being [its last sampled token,
    *drafts]: every row samples, as a decode step at its position would, and the drafts are accepted
    in order while each equals the token sampled before it (`SequenceOutput.accepted`)."""

    slot: int
    start: int
    token_ids: list[int]
    params: SamplingParams
    seed: int
    decode: bool = False
    sample: bool = True
    targets: list[int] = field(default_factory=list)
    keeps: tuple[int, ...] = ()
    history: TokenHistory | None = None
    grammar: GrammarState | None = None
    drafts: tuple[int, ...] = ()

    @property
    def logit_rows(self) -> int:
        """Rows before its sampling row that need logits: its scored rows, or a verify piece's drafted ones."""
        return len(self.drafts) or len(self.targets)

    def draw_history(self, row: int) -> TokenHistory | None:
        """What its logits controls read when row `row` samples: in a verify piece, the history as
        it would be had the drafts before that row been accepted."""
        if self.history is None or not row:
            return self.history
        h = self.history
        return TokenHistory(h.prompt, [*h.output, *self.drafts[:row]], h.stop_ids)

    @property
    def processes_logits(self) -> bool:
        """Whether its sampling row is changed before the sampler: a logits control or a grammar."""
        return self.params.controls_logits or self.grammar is not None


@dataclass(frozen=True)
class TokenLogprob:
    """A token at a position, its logprob, and the position's best alternatives (best first, ties by
    token id) when they were asked for."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class SequenceOutput:
    """What a forward gave one sequence: the token sampled after it (None: a piece inside its
    prompt; a verify piece's: the one sampled after its first row), the scores of its first rows
    against `SequenceInput.targets`, and a verify piece's tokens sampled after each accepted draft
    (`accepted[i]` after drafts[i])."""

    sampled: TokenLogprob | None = None
    scores: tuple[TokenLogprob, ...] = ()
    accepted: tuple[TokenLogprob, ...] = ()
    hidden: torch.Tensor | None = None  # its rows' final-normed hidden states, when the model keeps them


class NonFiniteOutputError(RuntimeError):
    """Logits or a sampled logprob that is NaN or infinite, or a sampled token outside the vocabulary."""


def _as_int64(seed: int) -> int:
    """A seed in [0, 2^64) as the int64 with the same 64 bits."""
    return seed - (1 << 64) if seed >= 1 << 63 else seed


class ModelRunner:
    """`workers`: a tensor-parallel engine's other ranks, which run each forward on their shards
    of the model from the same batch description (see `workers.py`)."""

    def __init__(self, model: Model, cache: SlotCache, device: torch.device | str,
                 workers: Workers | None = None) -> None:
        self.model = model
        self.cache = cache
        self.device = torch.device(device)
        self.workers = workers

    @torch.inference_mode()
    def run(self, seqs: list[SequenceInput]) -> list[SequenceOutput]:
        """One forward over all `seqs` (decode rows and prefill pieces mixed); returns their outputs
        in order. Raises NonFiniteOutputError for a non-finite output."""
        if not seqs:
            return []
        # Decode sequences first: the batch layout the ops dispatch on (see ForwardBatch).
        order = sorted(range(len(seqs)), key=lambda i: not seqs[i].decode)
        ordered = self._forward([seqs[i] for i in order])
        outputs = [SequenceOutput()] * len(seqs)
        for i, output in zip(order, ordered):
            outputs[i] = output
        return outputs

    def _forward(self, seqs: list[SequenceInput]) -> list[SequenceOutput]:
        """The outputs of `seqs`, in order: logits of their scored rows and sampling rows, then the
        sampler on the sampling rows and the scoring op on the rest."""
        slots, starts, tokens, kinds = [s.slot for s in seqs], [s.start for s in seqs], [s.token_ids for s in seqs], \
            [s.decode for s in seqs]
        samples, scores, keeps = [s.sample for s in seqs], [s.logit_rows for s in seqs], [s.keeps for s in seqs]
        batch = ForwardBatch.build(slots, starts, tokens, kinds, self.device, samples, scores, keeps)
        self.cache.clear_kept()  # what a failed forward kept on the way is never committed
        if self.workers is None:
            logits = self.model.forward(batch, self.cache)
        else:
            self.workers.send(["forward", slots, starts, tokens, kinds, samples, scores, keeps])
            try:
                logits = self.model.forward(batch, self.cache)
            except Exception as exc:  # a worker died, or this rank left the others inside a collective
                raise self.workers.failed(exc) from exc
        bad = non_finite_rows(logits)
        if bad:
            raise NonFiniteOutputError(f"the model produced non-finite logits (NaN or inf) for logit row(s) "
                                       f"{bad} of {logits.shape[0]}")
        rows = iter(range(logits.shape[0]))  # sequence by sequence: its scored rows, then its sampling row
        scored: list[list[int]] = []
        sample_rows: list[int | None] = []
        for s in seqs:
            scored.append([next(rows) for _ in range(s.logit_rows)])
            sample_rows.append(next(rows) if s.sample else None)
        # A verify piece's rows, each a decode step's: the sampling row after every drafted one.
        verify = {i: [*scored[i], row] for i, (s, row) in enumerate(zip(seqs, sample_rows))
                  if s.drafts and row is not None}
        draws = [_Draw(s, row, s.start + len(s.token_ids), s.history)
                 for i, (s, row) in enumerate(zip(seqs, sample_rows)) if row is not None and i not in verify]
        draws += [_Draw(seqs[i], row, seqs[i].start + j + 1, seqs[i].draw_history(j))
                  for i, rows_of in verify.items() for j, row in enumerate(rows_of)]
        sampled = self._sample(logits, draws)
        emitted = {i: rows_of[:_verified(seqs[i], [sampled[row] for row in rows_of])] for i, rows_of in verify.items()}
        # Rows to score: every target, and each sampled token whose alternatives are asked for.
        wanted = [(row, target, s.params.prompt_logprobs or 0)
                  for s, rows_of in zip(seqs, scored) for row, target in zip(rows_of, s.targets)]
        wanted += [(row, sampled[row][0], s.params.logprobs) for i, (s, row) in enumerate(zip(seqs, sample_rows))
                   if row is not None and i not in verify and s.params.logprobs]
        wanted += [(row, sampled[row][0], seqs[i].params.logprobs or 0) for i, rows_of in emitted.items()
                   if seqs[i].params.logprobs for row in rows_of]
        tops = self._alternatives(logits, wanted)

        def token(row: int) -> TokenLogprob:
            return TokenLogprob(*sampled[row], tops[row][1] if row in tops else ())

        outputs = [SequenceOutput(token(emitted[i][0]), accepted=tuple(map(token, emitted[i][1:]))) if i in emitted
                   else SequenceOutput(None if row is None else token(row), tuple(
                       TokenLogprob(target, tops[r][0], tops[r][1]) for r, target in zip(rows_of, s.targets)))
                   for i, (s, rows_of, row) in enumerate(zip(seqs, scored, sample_rows))]
        normed = self.model.normed if self.model.keep_normed else None
        if normed is not None:  # each sequence's token rows, in the batch's order
            ends = list(itertools.accumulate(len(s.token_ids) for s in seqs))
            outputs = [dataclasses.replace(o, hidden=normed[end - len(s.token_ids):end])
                       for o, s, end in zip(outputs, seqs, ends)]
        return outputs

    def _sample(self, logits: torch.Tensor, draws: list[_Draw]) -> dict[int, tuple[int, float]]:
        """logit row -> (token, logprob) sampled there, for each of `draws`. A sequence with a grammar
        or logits controls samples from its row as they change it (`_processed`, row by row) and
        reports the raw logprob, as the scoring op computes it."""
        if not draws:
            return {}
        seqs = [d.seq for d in draws]

        def column(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=self.device)

        raw = logits[column([d.row for d in draws], torch.int64)]
        controlled = [i for i, s in enumerate(seqs) if s.processes_logits]
        picked = raw.clone() if controlled else raw
        for i in controlled:
            picked[i] = _processed(raw[i], seqs[i], draws[i].history)
        tokens, logprobs = self.model.ops.sample(
            picked,
            column([0.0 if s.params.greedy else float(s.params.temperature) for s in seqs], torch.float32),
            column([s.params.top_k for s in seqs], torch.int64),
            column([float(s.params.top_p) for s in seqs], torch.float32),
            column([_as_int64(s.seed) for s in seqs], torch.int64),
            column([d.counter for d in draws], torch.int64),
        )
        if controlled:  # their logprobs are the raw distribution's (vLLM's default, "raw_logprobs")
            at = column(controlled, torch.int64)
            logprobs = logprobs.clone()
            logprobs[at] = self.model.ops.logprobs(raw[at], tokens[at].clamp(0, logits.shape[-1] - 1), 0)[0]
        valid = torch.isfinite(logprobs) & (tokens >= 0) & (tokens < logits.shape[-1])
        if not bool(valid.all()):
            raise NonFiniteOutputError(f"the sampler returned a non-finite logprob or a token outside the vocabulary "
                                       f"for sequence(s) {_false_rows(valid)} of {len(seqs)}")
        return {d.row: out for d, out in zip(draws, zip(tokens.tolist(), logprobs.tolist()))}

    def _alternatives(self, logits: torch.Tensor, wanted: list[tuple[int, int, int]]
                      ) -> dict[int, tuple[float, tuple[tuple[int, float], ...]]]:
        """logit row -> (logprob of its token, its best `k` alternatives) for each (row, token, k)
        of `wanted`, in one call of the scoring op (each row's first k of the largest k asked)."""
        if not wanted:
            return {}
        index = torch.tensor([row for row, _, _ in wanted], dtype=torch.int64, device=self.device)
        tokens = torch.tensor([token for _, token, _ in wanted], dtype=torch.int64, device=self.device)
        num_top = max(k for _, _, k in wanted)
        chosen, top_ids, top_logprobs = self.model.ops.logprobs(logits[index], tokens, num_top)
        pairs = [list(zip(ids, lps)) for ids, lps in zip(top_ids.tolist(), top_logprobs.tolist())]
        return {row: (lp, tuple(pair[:k])) for (row, _, k), lp, pair in zip(wanted, chosen.tolist(), pairs)}


@dataclass(frozen=True)
class _Draw:
    """One token to sample: the sequence, its logit row, the sampler's counter (the position the
    token is drawn for) and the history its logits controls read."""

    seq: SequenceInput
    row: int
    counter: int
    history: TokenHistory | None


def _verified(seq: SequenceInput, draws: list[tuple[int, float]]) -> int:
    """How many tokens a verify piece emits: the token after its first row, then one more for each
    draft, in order, that equals the token sampled before it."""
    count = 1
    while count <= len(seq.drafts) and draws[count - 1][0] == seq.drafts[count - 1]:
        count += 1
    return count


def _processed(row: torch.Tensor, seq: SequenceInput, history: TokenHistory | None) -> torch.Tensor:
    """A sequence's row of logits as it samples from it: its grammar's mask first (as vLLM applies the
    structured-output bitmask before the sampler's controls), then its logits controls."""
    if seq.grammar is not None:
        row = seq.grammar.apply(row)
    if seq.params.controls_logits:
        if history is None:
            raise ValueError("a sequence whose params set logits controls needs its history (TokenHistory)")
        row = process_row(row, seq.params, history)
    return row


def non_finite_rows(logits: torch.Tensor) -> list[int]:
    """The rows of `logits` [rows, vocab] that hold a NaN or an infinity. A row's sum is finite only
    where all its elements are, so one reduction clears the usual step (an elementwise check of a
    step's logits cost 0.45 ms at 8 rows of a 32000-token vocabulary, the sums 0.04); a sum that is
    not finite, which finite elements also give when it overflows, is settled element by element."""
    if bool(torch.isfinite(logits.sum(dim=-1)).all()):
        return []
    return _false_rows(torch.isfinite(logits).all(dim=-1))


def _false_rows(mask: torch.Tensor) -> list[int]:
    return [i for i, ok in enumerate(mask.tolist()) if not ok]
