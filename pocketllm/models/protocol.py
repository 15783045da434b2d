"""Model: what the runner, the engine and the registry need from an architecture.

A Protocol, not a base class: any object with these members can be served, whether or not it is
built from the shared blocks in `layers`.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..cache import LayerCacheSpec, SlotCache
from ..config import ModelConfig
from ..kernels import Ops
from .batch import ForwardBatch


class Model(Protocol):
    cfg: ModelConfig
    ops: Ops  # the engine's one op table: every op the model and the sampler run
    keep_normed: bool  # forward keeps `normed`, every token row's final-normed hidden state (MTP drafts)
    normed: torch.Tensor | None

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the weights and of the cache built for them."""
        ...

    def linear_weights(self) -> list[torch.Tensor]:
        """Every matrix the model multiplies through `ops.linear`, the lm_head last (the start-up
        probe runs them)."""
        ...

    def cache_specs(self) -> list[LayerCacheSpec]:
        """What each layer keeps per slot (K/V, or conv and recurrent state)."""
        ...

    def forward(self, batch: ForwardBatch, cache: SlotCache) -> torch.Tensor:
        """fp32 logits [B, vocab] of each sequence's last new token; writes the batch's state into `cache`."""
        ...
