"""Token embedding lookup: a gather of rows, exact in every dtype."""

from typing import Protocol

import torch

from ._cases import ROWS, randn
from .spec import Layout, OpSpec


class Embedding(Protocol):
    """token_ids [T] int, table [V, H] -> [T, H]."""

    def __call__(self, token_ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor: ...


def embedding_ref(token_ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """[T] int ids, [V, H] table -> [T, H]."""
    return table.index_select(0, token_ids)


OP = OpSpec("embedding", Embedding, {"ref": embedding_ref}, order=0, cases=Layout(
    lambda gen, n, dims, dtype: {"token_ids": torch.randint(0, dims["vocab"], (n,), generator=gen)}, None,
    lambda gen, dims, dtype: {"table": randn(gen, dims["vocab"], dims["hidden"], dtype=dtype)},
    [({"vocab": 50, "hidden": 24}, rows) for rows in ROWS]))
