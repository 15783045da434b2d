"""Ops, one module each, and the table through which the model calls them.

A backend is a choice of implementation for every op. The model code never imports an op
directly; it calls `ops.<name>` on the table `get_ops` returns, so swapping a kernel in is a
one-line change here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .activation import silu_and_mul_ref
from .attention import decode_attention_ref, prefill_attention_ref
from .embedding import embedding_ref
from .kv_write import rope_write_kv_ref
from .linear import linear_ref, linear_row_invariant
from .rmsnorm import rms_norm_ref
from .sampling import sample_ref


@dataclass(frozen=True)
class Ops:
    """The op table the model runs on."""

    embedding: Callable
    rms_norm: Callable
    rope_write_kv: Callable
    prefill_attention: Callable
    decode_attention: Callable
    silu_and_mul: Callable
    linear: Callable
    sample: Callable


def torch_ops(batch_invariant: bool = True) -> Ops:
    """Every op is its torch reference; `batch_invariant=False` drops the row padding of the
    linear layers (a negative control for the invariance tests, and a speed baseline)."""
    return Ops(
        embedding=embedding_ref,
        rms_norm=rms_norm_ref,
        rope_write_kv=rope_write_kv_ref,
        prefill_attention=prefill_attention_ref,
        decode_attention=decode_attention_ref,
        silu_and_mul=silu_and_mul_ref,
        linear=linear_row_invariant if batch_invariant else linear_ref,
        sample=sample_ref,
    )


def get_ops(backend: str, batch_invariant: bool = True) -> Ops:
    if backend == "torch":
        return torch_ops(batch_invariant)
    raise ValueError(f"backend {backend!r} has no op table yet; available: 'torch'")
