"""ModelRunner: a list of sequences -> one ForwardBatch -> model forward -> one sampled token each.

The serial path and the batch scheduler both step requests through here, on the same slot cache.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .cache import SlotCache
from .kernels import Ops
from .models import ForwardBatch, Model
from .sampling import SamplingParams


@dataclass(frozen=True)
class SequenceInput:
    """New tokens of one sequence: `start` tokens of it are already in slot `slot`."""

    slot: int
    start: int
    token_ids: list[int]
    params: SamplingParams
    seed: int


def _as_int64(seed: int) -> int:
    """A seed in [0, 2^64) as the int64 with the same 64 bits."""
    return seed - (1 << 64) if seed >= 1 << 63 else seed


class ModelRunner:
    def __init__(self, model: Model, cache: SlotCache, ops: Ops, device: torch.device | str) -> None:
        self.model = model
        self.cache = cache
        self.ops = ops
        self.device = torch.device(device)

    @torch.inference_mode()
    def run(self, seqs: list[SequenceInput], is_decode: bool) -> list[tuple[int, float]]:
        """One forward over all `seqs`; returns (token, logprob) sampled for each, in order."""
        if not seqs:
            return []
        batch = ForwardBatch.build([s.slot for s in seqs], [s.start for s in seqs], [s.token_ids for s in seqs],
                                   is_decode, self.device)
        logits = self.model.forward(batch, self.cache)

        def column(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=self.device)

        tokens, logprobs = self.ops.sample(
            logits,
            column([0.0 if s.params.greedy else float(s.params.temperature) for s in seqs], torch.float32),
            column([s.params.top_k for s in seqs], torch.int64),
            column([float(s.params.top_p) for s in seqs], torch.float32),
            column([_as_int64(s.seed) for s in seqs], torch.int64),
            column([s.start + len(s.token_ids) for s in seqs], torch.int64),
        )
        return list(zip(tokens.tolist(), logprobs.tolist()))
