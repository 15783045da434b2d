"""embedding (pocketllm/kernels/embedding.py): the reference against the definition, an exact row
gather checked row by row. The op has no Triton kernel; its batch invariance is the lab grid's
(test_lab_grid.py)."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import gen as _gen
from kernel_cases import randn as _randn

from pocketllm.kernels.embedding import embedding_ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 2, 17, 65])
def test_embedding_is_exact_row_gather(dtype, num_tokens):
    """embedding_ref returns table row `id` for each id, bit for bit, repeats and extremes included."""
    table = _randn(300, 24, seed=1, dtype=dtype)
    ids = torch.randint(0, 300, (num_tokens,), generator=_gen(num_tokens))
    ids[0] = 299
    if num_tokens > 1:
        ids[-1] = 0
    out = embedding_ref(ids, table)
    expected = torch.stack([table[int(i)] for i in ids])
    assert out.dtype == dtype and out.shape == (num_tokens, 24)
    assert torch.equal(out, expected)
