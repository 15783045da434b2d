"""Token embedding lookup: a gather of rows, exact in every dtype."""

from typing import Protocol

import torch


class Embedding(Protocol):
    """token_ids [T] int, table [V, H] -> [T, H]."""

    def __call__(self, token_ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor: ...


def embedding_ref(token_ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """[T] int ids, [V, H] table -> [T, H]."""
    return table.index_select(0, token_ids)
