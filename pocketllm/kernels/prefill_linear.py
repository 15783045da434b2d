"""Op `prefill_linear`: the linear layers on the token rows of a prefill.

Its own op so that a backend may tile prefill rows differently from decode rows (never per
batch): the torch backend multiplies them in PREFILL_ROW_TILE-row tiles (see `linear.py`); the
Triton kernel is the same as `linear`'s. The signature is `linear.Linear`.
"""

import torch

from . import linear
from .linear import DECODE_ROW_TILE, PREFILL_ROW_TILE, Linear, linear_ref, linear_row_invariant, linear_triton
from .spec import Call, OpSpec, Step

# The same product as `linear`'s reference and kernel: only the torch backend tiles prefill rows apart.
prefill_linear_ref = linear_ref
prefill_linear_triton = linear_triton
# Its order does not depend on the row count, so prefill rows get the bits of the same rows decoded.
prefill_linear_fixed_order = linear.linear_fixed_order
prefill_linear_fixed_order_avx2 = linear.linear_fixed_order_avx2
prefill_linear_bf16_dot = linear.linear_bf16_dot
prefill_linear_bf16_dot_avx2 = linear.linear_bf16_dot_avx2


def prefill_linear_row_invariant(x: torch.Tensor, weight: torch.Tensor,
                                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """linear_row_invariant in PREFILL_ROW_TILE-row tiles, for the token rows of a prefill."""
    return linear_row_invariant(x, weight, bias, PREFILL_ROW_TILE)


def prefill_linear_decode_tiles(x: torch.Tensor, weight: torch.Tensor,
                                bias: torch.Tensor | None = None) -> torch.Tensor:
    """linear_row_invariant in the decode rows' DECODE_ROW_TILE-row tiles: a prefilled row gets the
    bits of the same row decoded (the torch backend's op with `exact_positions`)."""
    return linear_row_invariant(x, weight, bias, DECODE_ROW_TILE)


def _launches(step: Step) -> list[Call]:
    return [] if step.batch.is_decode else linear.body_calls(step)


OP = OpSpec("prefill_linear", Linear, {"ref": prefill_linear_ref, "row_invariant": prefill_linear_row_invariant,
                                       "decode_tiles": prefill_linear_decode_tiles,
                                       "fixed_order": prefill_linear_fixed_order,
                                       "fixed_order_avx2": prefill_linear_fixed_order_avx2,
                                       "bf16_dot": prefill_linear_bf16_dot,
                                       "bf16_dot_avx2": prefill_linear_bf16_dot_avx2,
                                       "triton": prefill_linear_triton},
            order=70, cases=linear.CASES,
            launches=_launches, cost=linear.cost)
