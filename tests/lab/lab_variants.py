"""Variants defined outside the package, as a kernel developer would write them: one correct, the
others deliberately broken in the ways the lab must catch (the batch- and piece-dependent ones
planted by construction, tests/planted.py, so the lab catches them on every machine)."""

import torch
import torch.nn.functional as F

from pocketllm.kernels.decode_attention import decode_attention_ref
from pocketllm.testing.planted import linear_row_count_dependent, prefill_attention_first_row_nudged


def silu_and_mul_split(gate_up: torch.Tensor) -> torch.Tensor:
    """Correct: silu(gate) * up, one row at a time (each row its own computation)."""
    half = gate_up.shape[-1] // 2
    rows = [F.silu(row[None, :half].float()).to(gate_up.dtype) * row[None, half:] for row in gate_up]
    return torch.cat(rows) if rows else gate_up[:, :half].clone()


def decode_attention_one_key_short(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                   slot_ids: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """Broken: attends to every key but the newest one (seq_len - 1 keys)."""
    return decode_attention_ref(q, k_cache, v_cache, slot_ids, (seq_lens - 1).clamp(min=1), scale)


# Broken: a row's bits depend on how many rows share the call (another path from 4 rows up).
linear_batch_tiled = linear_row_count_dependent

# Broken: the first query row of every prefill piece takes another path, so cuts change bits.
prefill_attention_piece_dependent = prefill_attention_first_row_nudged


def decode_attention_wrong_signature(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                     slot_ids: torch.Tensor, scale: float) -> torch.Tensor:
    """Broken: no seq_lens parameter."""
    return q


def silu_and_mul_up_gate_swapped(gate_up: torch.Tensor) -> torch.Tensor:
    """Broken: reads up first and gate second."""
    half = gate_up.shape[-1] // 2
    return F.silu(gate_up[:, half:]) * gate_up[:, :half]


def silu_and_mul_raises(gate_up: torch.Tensor) -> torch.Tensor:
    """Broken: raises on every call."""
    raise TypeError("silu_and_mul_raises takes no tensors")


def silu_and_mul_exits(gate_up: torch.Tensor) -> torch.Tensor:
    """Broken: exits with status 0 on every call (what CI would read as a pass)."""
    raise SystemExit(0)


def silu_and_mul_interrupted(gate_up: torch.Tensor) -> torch.Tensor:
    """Ctrl-C arriving during the call."""
    raise KeyboardInterrupt


def silu_and_mul_nan(gate_up: torch.Tensor) -> torch.Tensor:
    """Broken: NaN everywhere, so every engine step fails on non-finite logits."""
    return torch.full_like(gate_up[:, : gate_up.shape[-1] // 2], float("nan"))
