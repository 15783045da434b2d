"""Ops, one module each, and the table through which the model calls them.

A backend is a choice of implementation (by name, from `registry.IMPLEMENTATIONS`) for every op;
`get_ops` builds the table, with any op overridden by a registered name, an import path or a
callable. The model code never imports an op directly; it calls `ops.<name>` on the table.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from . import _triton  # noqa: F401  (sets TRITON_INTERPRET before anything imports triton)
from .conv1d_decode import Conv1dDecode
from .conv1d_prefill import Conv1dPrefill
from .decode_attention import DecodeAttention
from .embedding import Embedding
from .gated_delta_decode import GatedDeltaDecode
from .gated_delta_prefill import GatedDeltaPrefill
from .linear import Linear
from .prefill_attention import PrefillAttention
from .registry import IMPLEMENTATIONS, OP_NAMES, ImplSpec, check_overrides, register, resolve
from .rms_norm import RmsNorm
from .rms_norm_gated import RmsNormGated
from .rope_write_kv import RopeWriteKv
from .sample import Sample
from .silu_and_mul import SiluAndMul

__all__ = ["IMPLEMENTATIONS", "OP_NAMES", "Ops", "backend_impls", "get_ops", "register", "resolve", "torch_ops",
           "triton_ops"]


@dataclass(frozen=True)
class Ops:
    """The op table the model runs on: one callable per op, typed by the op's signature."""

    embedding: Embedding
    rms_norm: RmsNorm
    rope_write_kv: RopeWriteKv
    prefill_attention: PrefillAttention
    decode_attention: DecodeAttention
    silu_and_mul: SiluAndMul
    linear: Linear  # decode rows and the lm_head
    prefill_linear: Linear  # the token rows of a prefill (may tile rows differently, never per batch)
    sample: Sample
    # Gated DeltaNet layers (Qwen3.5)
    conv1d_prefill: Conv1dPrefill
    conv1d_decode: Conv1dDecode
    gated_delta_prefill: GatedDeltaPrefill
    gated_delta_decode: GatedDeltaDecode
    rms_norm_gated: RmsNormGated


def backend_impls(backend: str, batch_invariant: bool = True, decode_per_row: bool = False) -> dict[str, str]:
    """op -> implementation name for `backend`.

    torch: the references, except attention through torch's fused attention and the linear layers
    in fixed row tiles (`linear.py`): 4-row tiles for decode rows, or one row per call with
    `decode_per_row`; 64-row tiles for prefill rows. `batch_invariant=False` makes the linear
    layers one plain GEMM call per batch (a negative control for the invariance tests, and a speed
    baseline). triton: every op with a Triton kernel uses it (compiled on CUDA, interpreted on
    CPU); they are batch invariant by construction, so the flags do not apply. The embedding
    stays a gather: it does no arithmetic."""
    if backend == "torch":
        impls = dict.fromkeys(OP_NAMES, "ref")
        impls.update(prefill_attention="fused", decode_attention="fused")
        if batch_invariant:
            impls.update(linear="per_row" if decode_per_row else "row_invariant", prefill_linear="row_invariant")
        return impls
    if backend == "triton":
        return {op: "ref" if op == "embedding" else "triton" for op in OP_NAMES}
    raise ValueError(f"backend must be 'torch' or 'triton', got {backend!r}")


def get_ops(backend: str, batch_invariant: bool = True, decode_per_row: bool = False,
            overrides: Mapping[str, ImplSpec] | None = None) -> Ops:
    """The op table of `backend` ("torch" or "triton"; the flags are the torch backend's), with
    each op in `overrides` replaced (a registered name, "module:function" or a callable)."""
    table: dict[str, Callable[..., Any]] = {op: IMPLEMENTATIONS[op][name]
                                            for op, name in backend_impls(backend, batch_invariant,
                                                                          decode_per_row).items()}
    table.update(check_overrides(overrides or {}))
    return Ops(**table)


def torch_ops(batch_invariant: bool = True, decode_per_row: bool = False) -> Ops:
    """The torch backend's table (see `backend_impls`)."""
    return get_ops("torch", batch_invariant, decode_per_row)


def triton_ops() -> Ops:
    """The Triton backend's table (see `backend_impls`)."""
    return get_ops("triton")
