"""Ops, one module each, and the table through which the model calls them.

A backend is a choice of implementation for every op. The model code never imports an op
directly; it calls `ops.<name>` on the table `get_ops` returns, so swapping a kernel in is a
one-line change here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from . import _triton  # noqa: F401  (sets TRITON_INTERPRET before anything imports triton)
from .activation import silu_and_mul_ref
from .attention import decode_attention_fused, prefill_attention_fused
from .conv1d import causal_conv1d_decode_ref, causal_conv1d_prefill_ref
from .embedding import embedding_ref
from .gated_delta import gated_delta_decode_ref, gated_delta_prefill_ref
from .kv_write import rope_write_kv_ref
from .linear import linear_per_row, linear_ref, linear_row_invariant, prefill_linear_row_invariant
from .rmsnorm import rms_norm_gated_ref, rms_norm_ref
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
    linear: Callable  # decode rows and the lm_head
    prefill_linear: Callable  # the token rows of a prefill (may tile rows differently, never per batch)
    sample: Callable
    # Gated DeltaNet layers (Qwen3.5)
    conv1d_prefill: Callable
    conv1d_decode: Callable
    gated_delta_prefill: Callable
    gated_delta_decode: Callable
    rms_norm_gated: Callable


def torch_ops(batch_invariant: bool = True, decode_per_row: bool = False) -> Ops:
    """Torch implementations. Decode rows multiply W in 4-row tiles (`linear_row_invariant`), or
    one row per call with `decode_per_row` (`linear_per_row`); prefill rows in 64-row tiles.
    `batch_invariant=False` makes the linear layers one plain GEMM call per batch (a negative
    control for the invariance tests, and a speed baseline)."""
    decode_linear = linear_per_row if decode_per_row else linear_row_invariant
    return Ops(
        embedding=embedding_ref,
        rms_norm=rms_norm_ref,
        rope_write_kv=rope_write_kv_ref,
        prefill_attention=prefill_attention_fused,
        decode_attention=decode_attention_fused,
        silu_and_mul=silu_and_mul_ref,
        linear=decode_linear if batch_invariant else linear_ref,
        prefill_linear=prefill_linear_row_invariant if batch_invariant else linear_ref,
        sample=sample_ref,
        conv1d_prefill=causal_conv1d_prefill_ref,
        conv1d_decode=causal_conv1d_decode_ref,
        gated_delta_prefill=gated_delta_prefill_ref,
        gated_delta_decode=gated_delta_decode_ref,
        rms_norm_gated=rms_norm_gated_ref,
    )


def triton_ops() -> Ops:
    """Every op with a Triton kernel uses it (compiled on CUDA, interpreted on CPU). The kernels
    are batch invariant by construction (fixed tiles, no split-K, fixed split size), so this table
    has no padding switch. The embedding stays a gather: it does no arithmetic."""
    from .activation import silu_and_mul_triton
    from .attention import decode_attention_triton, prefill_attention_triton
    from .conv1d import causal_conv1d_decode_triton, causal_conv1d_prefill_triton
    from .gated_delta import gated_delta_decode_triton, gated_delta_prefill_triton
    from .kv_write import rope_write_kv_triton
    from .linear import linear_triton
    from .rmsnorm import rms_norm_gated_triton, rms_norm_triton
    from .sampling import sample_triton

    return Ops(
        embedding=embedding_ref,
        rms_norm=rms_norm_triton,
        rope_write_kv=rope_write_kv_triton,
        prefill_attention=prefill_attention_triton,
        decode_attention=decode_attention_triton,
        silu_and_mul=silu_and_mul_triton,
        linear=linear_triton,
        prefill_linear=linear_triton,
        sample=sample_triton,
        conv1d_prefill=causal_conv1d_prefill_triton,
        conv1d_decode=causal_conv1d_decode_triton,
        gated_delta_prefill=gated_delta_prefill_triton,
        gated_delta_decode=gated_delta_decode_triton,
        rms_norm_gated=rms_norm_gated_triton,
    )


def get_ops(backend: str, batch_invariant: bool = True, decode_per_row: bool = False) -> Ops:
    """The op table of `backend` ("torch" or "triton"); the flags are the torch backend's."""
    if backend == "torch":
        return torch_ops(batch_invariant, decode_per_row)
    if backend == "triton":
        return triton_ops()
    raise ValueError(f"backend must be 'torch' or 'triton', got {backend!r}")
