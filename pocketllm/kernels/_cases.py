"""Shared by the ops' lab case layouts (`OpSpec.cases`): random inputs, slot contents, and the
member grids several ops use. A member is n tokens at positions start .. start + n - 1."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .spec import Layout


def randn(gen: torch.Generator, *shape: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def rows(name: str, width: str, scale: float = 1.0) -> Callable[..., dict[str, torch.Tensor]]:
    """Per-token inputs: one tensor `name` of dims[width] columns."""
    return lambda gen, n, dims, dtype: {name: randn(gen, n, dims[width], dtype=dtype, scale=scale)}


def no_shared(gen: torch.Generator, dims: dict, dtype: torch.dtype) -> dict[str, Any]:
    return {}


def decode_grid(lengths: list[int]) -> list[tuple[int, int]]:
    """One decoded token per member, after length - 1 cached positions."""
    return [(1, length - 1) for length in lengths]


def kv_slot(gen: torch.Generator, start: int, n: int, dims: dict, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """K/V of positions [0, start + n) in a slot, NaN past them: a kernel reading beyond fails loudly."""
    shape = (dims["max_len"], dims["kv_heads"], dims["head_dim"])
    k, v = randn(gen, *shape, dtype=dtype), randn(gen, *shape, dtype=dtype)
    k[start + n:], v[start + n:] = float("nan"), float("nan")
    return {"k_cache": k, "v_cache": v}


def attention_shared(gen: torch.Generator, dims: dict, dtype: torch.dtype) -> dict[str, Any]:
    return {"scale": dims["head_dim"] ** -0.5}


def attention_layout(max_len: int, grids: list[list[tuple[int, int]]], splittable: bool = False) -> Layout:
    """The case layout of an attention op: q per token, K/V in each member's slot (a cache of
    `max_len` positions), every head layout of HEADS with each member grid of `grids`."""
    return Layout(lambda gen, n, dims, dtype: {"q": randn(gen, n, dims["heads"], dims["head_dim"], dtype=dtype)},
                  kv_slot, attention_shared,
                  [({**heads, "max_len": max_len}, grid) for heads in HEADS for grid in grids], splittable=splittable)


def conv_slot(gen: torch.Generator, start: int, n: int, dims: dict, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {"conv_states": randn(gen, dims["channels"], dims["width"] - 1, dtype=dtype)}


def conv_shared(gen: torch.Generator, dims: dict, dtype: torch.dtype) -> dict[str, Any]:
    return {"weight": randn(gen, dims["channels"], dims["width"], dtype=dtype)}


def gdn_tokens(gen: torch.Generator, n: int, dims: dict, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    hk, hv = dims["k_heads"], dims["v_heads"]
    return {"q": randn(gen, n, hk, dims["dk"], dtype=dtype), "k": randn(gen, n, hk, dims["dk"], dtype=dtype),
            "v": randn(gen, n, hv, dims["dv"], dtype=dtype),
            "g": -torch.rand(n, hv, generator=gen) * 0.5, "beta": torch.rand(n, hv, generator=gen)}


def gdn_slot(gen: torch.Generator, start: int, n: int, dims: dict, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    state = torch.randn(dims["v_heads"], dims["dk"], dims["dv"], generator=gen) * 0.1 if start else \
        torch.zeros(dims["v_heads"], dims["dk"], dims["dv"])
    return {"states": state}


HEADS = [{"heads": 4, "kv_heads": 4, "head_dim": 16}, {"heads": 4, "kv_heads": 2, "head_dim": 24},
         {"heads": 8, "kv_heads": 2, "head_dim": 40}, {"heads": 8, "kv_heads": 1, "head_dim": 8}]
ROWS = [[(1, 0)], [(1, 0), (3, 0), (2, 0)], [(2, 0)] * 5]  # one row; rows in groups; five members
GDN = [{"k_heads": 1, "v_heads": 2, "dk": 16, "dv": 8}, {"k_heads": 2, "v_heads": 2, "dk": 8, "dv": 24}]
