"""ModelRunner: a list of sequences -> one ForwardBatch -> model forward -> a sampled token for
each sequence that samples (decode rows, and prefill pieces that end their prompt).

The serial path and the batch scheduler both step requests through here, on the same slot cache.
A forward either returns a finite (token, logprob) for every sequence, or raises; it touches the
cache only through the model's forward (what the slots hold is the slot manager's business, and so
is putting their states back before a failed batch is rerun: see `scheduler/execute.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .cache import SlotCache
from .models import ForwardBatch, Model
from .sampling import SamplingParams


@dataclass(frozen=True)
class SequenceInput:
    """New tokens of one sequence: `start` tokens of it are already in slot `slot`. `decode`: one
    token through the decode ops; otherwise a prefill piece. `sample`: whether a token is sampled
    after it (not for a prefill piece that ends inside the prompt)."""

    slot: int
    start: int
    token_ids: list[int]
    params: SamplingParams
    seed: int
    decode: bool = False
    sample: bool = True


class NonFiniteOutputError(RuntimeError):
    """Logits or a sampled logprob that is NaN or infinite, or a sampled token outside the vocabulary."""


def _as_int64(seed: int) -> int:
    """A seed in [0, 2^64) as the int64 with the same 64 bits."""
    return seed - (1 << 64) if seed >= 1 << 63 else seed


class ModelRunner:
    def __init__(self, model: Model, cache: SlotCache, device: torch.device | str) -> None:
        self.model = model
        self.cache = cache
        self.device = torch.device(device)

    @torch.inference_mode()
    def run(self, seqs: list[SequenceInput]) -> list[tuple[int, float] | None]:
        """One forward over all `seqs` (decode rows and prefill pieces mixed); returns, in order,
        (token, logprob) for each sequence that samples and None for each that does not.
        Raises NonFiniteOutputError for a non-finite output."""
        if not seqs:
            return []
        # Decode sequences first: the batch layout the ops dispatch on (see ForwardBatch).
        order = sorted(range(len(seqs)), key=lambda i: not seqs[i].decode)
        ordered = [seqs[i] for i in order]
        sampled = iter(self._forward_and_sample(ordered, [s.slot for s in ordered], [s.start for s in ordered]))
        outputs: list[tuple[int, float] | None] = [None] * len(seqs)
        for i in order:
            if seqs[i].sample:
                outputs[i] = next(sampled)
        return outputs

    def _forward_and_sample(self, seqs: list[SequenceInput], slots: list[int],
                            starts: list[int]) -> list[tuple[int, float]]:
        """(token, logprob) for each sequence of `seqs` that samples, in order."""
        batch = ForwardBatch.build(slots, starts, [s.token_ids for s in seqs], [s.decode for s in seqs], self.device,
                                   [s.sample for s in seqs])
        logits = self.model.forward(batch, self.cache)
        seqs = [s for s in seqs if s.sample]
        if not seqs:
            return []
        finite = torch.isfinite(logits).all(dim=-1)
        if not bool(finite.all()):
            raise NonFiniteOutputError(f"the model produced non-finite logits (NaN or inf) for sequence(s) "
                                       f"{_false_rows(finite)} of {len(seqs)}")

        def column(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=self.device)

        tokens, logprobs = self.model.ops.sample(
            logits,
            column([0.0 if s.params.greedy else float(s.params.temperature) for s in seqs], torch.float32),
            column([s.params.top_k for s in seqs], torch.int64),
            column([float(s.params.top_p) for s in seqs], torch.float32),
            column([_as_int64(s.seed) for s in seqs], torch.int64),
            column([s.start + len(s.token_ids) for s in seqs], torch.int64),
        )
        valid = torch.isfinite(logprobs) & (tokens >= 0) & (tokens < logits.shape[-1])
        if not bool(valid.all()):
            raise NonFiniteOutputError(f"the sampler returned a non-finite logprob or a token outside the vocabulary "
                                       f"for sequence(s) {_false_rows(valid)} of {len(seqs)}")
        return list(zip(tokens.tolist(), logprobs.tolist()))


def _false_rows(mask: torch.Tensor) -> list[int]:
    return [i for i, ok in enumerate(mask.tolist()) if not ok]
