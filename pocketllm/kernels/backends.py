"""The backends: each is a choice of implementation (by name) for every op, in one record.

A backend record says which implementation each op runs (given the flags of `backend_options`
it reads), whether its outputs are batch invariant by construction (then the engine does not
probe the BLAS at start-up), and which `backend_options` it reads. `EngineArgs`, `LLM` and the
CLI take the backend names from `BACKENDS`, so a backend is added here and nowhere else.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from .cpu.extension import load_extension

Implementations = Mapping[str, Mapping[str, Callable[..., Any]]]


@dataclass(frozen=True)
class Backend:
    """`select(implementations, batch_invariant, decode_per_row, exact_positions)` -> op -> implementation name."""

    name: str
    select: Callable[[Implementations, bool, bool, bool], dict[str, str]]
    invariant_by_construction: bool
    options: tuple[str, ...]  # the backend_options whose values change what it runs
    exact_by_default: Callable[[], bool]  # exact_positions when the option is None, on this machine

    def exact(self, requested: bool | None, decode_per_row: bool = False) -> bool:
        """Whether decoded and prefilled positions get the same bits, given `exact_positions`; a
        `decode_per_row` request (a decode strategy of the non-exact configuration) turns the
        default off."""
        if requested is not None:
            return requested
        return not decode_per_row and self.exact_by_default()


def _torch(implementations: Implementations, batch_invariant: bool, decode_per_row: bool,
           exact_positions: bool) -> dict[str, str]:
    """The references, except attention through torch's fused attention and the linear layers in
    fixed row tiles (`linear.py`): 4-row tiles for decode rows, or one row per call with
    `decode_per_row`; prefill rows in 64-row tiles, or, with `exact_positions`, every row through the
    C++ fixed-order kernel (`kernels/cpu`; where it cannot be built, the decode rows' 4-row tiles)
    and attention, prefill and decode rows alike, through its C++ kernel (where it cannot be built,
    prefill attention one row per call as a decode step computes it), so a position gets the same
    bits decoded or prefilled. The gated delta rule runs token by token in the C++ kernel for
    prefill and decode alike, exact along the sequence and faster than the references at real
    shapes (where it cannot be built: the references, chunked prefill with replay buffers when exact).
    Mixture-of-experts layers multiply each expert's rows, decode and prefill rows alike, in the decode
    rows' fixed tiles (with `exact_positions`, by the C++ kernel). RMSNorm (gated too),
    SiLU-and-multiply, RoPE with the K/V write and the decode step's conv1d run one C++ call each
    where it builds (the references' five to a dozen torch ops per call are most of a decode step's
    time besides the products).
    `batch_invariant=False` makes the linear layers one plain GEMM call per batch (a negative
    control for the invariance tests, and a speed baseline)."""
    impls = dict.fromkeys(implementations, "ref")
    impls.update(prefill_attention="per_row" if exact_positions else "fused", decode_attention="fused")
    if exact_positions and load_extension() is not None:  # every row as one C++ function computes it
        impls.update(prefill_attention="own_order", decode_attention="own_order")
    if batch_invariant:
        impls.update(linear="per_row" if decode_per_row else "row_invariant",
                     prefill_linear="decode_tiles" if exact_positions else "row_invariant")
        impls.update(moe="row_invariant")  # decode and prefill rows alike: in the decode rows' tiles
        if exact_positions and load_extension() is not None:  # else the MKL tiles, after its warning
            impls.update(linear="fixed_order", prefill_linear="fixed_order", moe="fixed_order")
    if load_extension() is not None:  # else the references (chunked prefill; replay buffers when exact)
        impls.update(gated_delta_prefill="recurrent", gated_delta_decode="recurrent")
        impls.update(rms_norm="own_order", silu_and_mul="own_order", rope_write_kv="own_order",
                     rms_norm_gated="own_order", conv1d_decode="own_order")
    return impls


def _triton(implementations: Implementations, batch_invariant: bool, decode_per_row: bool,
            exact_positions: bool) -> dict[str, str]:
    """Every op with a Triton kernel uses it (compiled on CUDA, interpreted on CPU); the others (the
    embedding: a gather, no arithmetic) their reference. Invariant by construction: the first two
    flags do not apply. Without `exact_positions`, decode attention is the split-KV kernel (more
    parallel on long contexts; a decoded position then rounds differently from a prefilled one)."""
    impls = {op: "triton" if "triton" in names else "ref" for op, names in implementations.items()}
    if not exact_positions:
        impls["decode_attention"] = "split_kv"
    return impls


def _own_kernels_build() -> bool:
    """The torch backend is exact by default where its C++ kernels build: they own every reduction
    order, so exactness costs nothing there (see docs/measurements.md's real-shape tables); without
    them the exact configuration would multiply prefill rows in 4-row MKL tiles and attend one row
    per call."""
    return load_extension() is not None


BACKENDS: dict[str, Backend] = {backend.name: backend for backend in (
    Backend("torch", _torch, invariant_by_construction=False,
            options=("batch_invariant", "invariance_probe", "decode_per_row", "exact_positions", "tree_reduction"),
            exact_by_default=_own_kernels_build),
    Backend("triton", _triton, invariant_by_construction=True, options=("exact_positions", "tree_reduction"),
            exact_by_default=lambda: True),
)}

DEFAULT_BACKEND = "torch"  # runs anywhere; the fast path on CPU


def get_backend(name: str) -> Backend:
    """The backend called `name`; ValueError naming the registered ones otherwise."""
    if not isinstance(name, str) or name not in BACKENDS:
        raise ValueError(f"backend must be one of {tuple(BACKENDS)}, got {name!r}")
    return BACKENDS[name]
