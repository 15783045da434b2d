"""Token embedding lookup: a gather of rows, exact in every dtype."""

import torch


def embedding_ref(token_ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """[T] int ids, [V, H] table -> [T, H]."""
    return table.index_select(0, token_ids)
