"""Ops, one module each, and the table through which the model calls them.

A backend (`backends.BACKENDS`) is a choice of implementation (by name, from
`registry.IMPLEMENTATIONS`) for every op; `get_ops` builds the table, with any op overridden by a
registered name, an import path or a callable. The model code never imports an op directly; it
calls `ops.<name>` on the table.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from . import _triton  # noqa: F401  (sets TRITON_INTERPRET before anything imports triton)
from .backends import BACKENDS, get_backend
from .conv1d_decode import Conv1dDecode
from .conv1d_prefill import Conv1dPrefill
from .decode_attention import DecodeAttention
from .embedding import Embedding
from .gated_delta_decode import GatedDeltaDecode
from .gated_delta_prefill import GatedDeltaPrefill
from .linear import Linear
from .logprobs import Logprobs
from .moe import Moe
from .prefill_attention import PrefillAttention
from .registry import IMPLEMENTATIONS, OP_NAMES, ImplSpec, check_overrides, register, resolve
from .rms_norm import RmsNorm
from .rms_norm_gated import RmsNormGated
from .rope_write_kv import RopeWriteKv
from .sample import Sample
from .silu_and_mul import SiluAndMul

__all__ = ["BACKENDS", "IMPLEMENTATIONS", "OP_NAMES", "Ops", "backend_impls", "get_ops", "register", "resolve",
           "torch_ops"]


@dataclass(frozen=True)
class Ops:
    """The op table the model runs on: one callable per op, typed by the op's signature.

    Written out field by field rather than generated from the registry: mypy then checks every
    `ops.<name>(...)` call in the models against the op's Protocol, which a dataclass made at run
    time cannot give. The registry is the source of the ops; the check below this class refuses
    a table that disagrees with it, naming the field to add or remove."""

    embedding: Embedding
    rms_norm: RmsNorm
    rope_write_kv: RopeWriteKv
    prefill_attention: PrefillAttention
    decode_attention: DecodeAttention
    silu_and_mul: SiluAndMul
    linear: Linear  # decode rows and the lm_head
    prefill_linear: Linear  # the token rows of a prefill (may tile rows differently, never per batch)
    sample: Sample
    logprobs: Logprobs  # what a prompt position scores, and a token's top-k alternatives
    # Gated DeltaNet layers (Qwen3.5)
    conv1d_prefill: Conv1dPrefill
    conv1d_decode: Conv1dDecode
    gated_delta_prefill: GatedDeltaPrefill
    gated_delta_decode: GatedDeltaDecode
    rms_norm_gated: RmsNormGated
    # Mixture-of-experts layers (Qwen3-MoE, Qwen3.5-MoE)
    moe: Moe


if {f.name for f in fields(Ops)} != set(OP_NAMES):
    raise ImportError(f"kernels.Ops must have one field per registered op: missing "
                      f"{sorted(set(OP_NAMES) - {f.name for f in fields(Ops)})}, "
                      f"unregistered {sorted({f.name for f in fields(Ops)} - set(OP_NAMES))}")


def backend_impls(backend: str, batch_invariant: bool = True, decode_per_row: bool = False,
                  exact_positions: bool | None = None) -> dict[str, str]:
    """op -> implementation name for `backend` (see each backend's record in `backends.py`; the
    flags are the `backend_options` of the same names, read by the backends that list them)."""
    record = get_backend(backend)
    exact = record.exact(exact_positions, decode_per_row)
    return record.select(IMPLEMENTATIONS, batch_invariant, decode_per_row, exact)


def get_ops(backend: str, batch_invariant: bool = True, decode_per_row: bool = False,
            overrides: Mapping[str, ImplSpec] | None = None, exact_positions: bool | None = None) -> Ops:
    """The op table of `backend` (a name in `BACKENDS`), with each op in `overrides` replaced (a
    registered name, "module:function" or a callable)."""
    table: dict[str, Callable[..., Any]] = {op: IMPLEMENTATIONS[op][name]
                                            for op, name in backend_impls(backend, batch_invariant, decode_per_row,
                                                                          exact_positions).items()}
    table.update(check_overrides(overrides or {}))
    return Ops(**table)


def torch_ops(batch_invariant: bool = True, decode_per_row: bool = False, exact_positions: bool | None = None) -> Ops:
    """The torch backend's table (see `backend_impls`)."""
    return get_ops("torch", batch_invariant, decode_per_row, exact_positions=exact_positions)
