"""Launchers refuse bad arguments before launching: a kernel trusts its pointers, so a wrong shape
or dtype would read the wrong memory instead of failing. Slot misuse raises one error type."""

from __future__ import annotations

import pytest
import torch
from kernel_impls import DEVICE

from pocketllm.cache import AttentionCacheSpec, SlotCache, SlotCacheError
from pocketllm.kernels.decode_attention import decode_attention_triton
from pocketllm.kernels.gated_delta_decode import gated_delta_decode_triton
from pocketllm.kernels.gated_delta_prefill import gated_delta_prefill_triton
from pocketllm.kernels.prefill_attention import prefill_attention_triton
from pocketllm.scheduler.policy import PrefillPolicy
from pocketllm.scheduler.slots import SlotManager

pytest.importorskip("triton")


def _long(*values: int) -> torch.Tensor:
    """An int64 index tensor on DEVICE (launchers take CPU tensors only under the interpreter)."""
    return torch.tensor(values, device=DEVICE)


def _attention_args(heads: int = 4, kv_heads: int = 2, d: int = 16, dtype: torch.dtype = torch.float32):
    q = torch.zeros(3, heads, d, device=DEVICE)
    k_cache = torch.zeros(2, 32, kv_heads, d, dtype=dtype, device=DEVICE)
    return q, k_cache, torch.zeros_like(k_cache)


def _gated_delta_args(tokens: int = 3, hk: int = 2, hv: int = 4, dk: int = 16, dv: int = 16,
                      state_dtype: torch.dtype = torch.float32, state_shape: tuple[int, ...] | None = None):
    q, k = torch.zeros(tokens, hk, dk, device=DEVICE), torch.zeros(tokens, hk, dk, device=DEVICE)
    v = torch.zeros(tokens, hv, dv, device=DEVICE)
    g, beta = torch.zeros(tokens, hv, device=DEVICE), torch.zeros(tokens, hv, device=DEVICE)
    return q, k, v, g, beta, torch.zeros(state_shape or (2, hv, dk, dv), dtype=state_dtype, device=DEVICE)


@pytest.mark.parametrize("kwargs,message", [
    (dict(heads=6, kv_heads=4), r"6 query heads are not a multiple of 4 key/value heads"),
    (dict(dtype=torch.float16), r"k_cache must be torch.float32, got torch.float16"),
])
def test_attention_launchers_check_heads_and_dtypes(kwargs, message):
    q, k_cache, v_cache = _attention_args(**kwargs)
    slots, lens = _long(0, 1, 0), _long(4, 4, 4)
    with pytest.raises(ValueError, match=message):
        decode_attention_triton(q, k_cache, v_cache, slots, lens, 0.25)
    with pytest.raises(ValueError, match=message):
        prefill_attention_triton(q, k_cache, v_cache, _long(0), _long(0), _long(0, 3), 0.25)


def test_attention_launchers_check_shapes():
    q, k_cache, v_cache = _attention_args()
    with pytest.raises(ValueError, match=r"k_cache must have shape \[\*, \*, \*, 8\]"):
        decode_attention_triton(q[..., :8], k_cache, v_cache, _long(0, 1, 0), _long(4, 4, 4), 0.25)
    with pytest.raises(ValueError, match=r"seq_lens must have shape \[3\], got \[2\]"):
        decode_attention_triton(q, k_cache, v_cache, _long(0, 1, 0), _long(4, 4), 0.25)
    with pytest.raises(ValueError, match=r"cu_seqlens must have shape \[2\], got \[3\]"):
        prefill_attention_triton(q, k_cache, v_cache, _long(0), _long(0), _long(0, 1, 3), 0.25)


@pytest.mark.parametrize("kwargs,message", [
    (dict(state_dtype=torch.float16), r"states must be torch.float32, got torch.float16"),
    (dict(state_shape=(2, 4, 16, 8)), r"states must have shape \[\*, 4, 16, 16\], got \[2, 4, 16, 8\]"),
    (dict(hk=3, hv=4), r"4 value heads are not a multiple of 3 key heads"),
])
def test_gated_delta_launchers_check_state_and_heads(kwargs, message):
    q, k, v, g, beta, states = _gated_delta_args(**kwargs)
    with pytest.raises(ValueError, match=message):
        gated_delta_decode_triton(q, k, v, g, beta, states, _long(0, 1, 0))
    with pytest.raises(ValueError, match=message):
        gated_delta_prefill_triton(q, k, v, g, beta, states, _long(0), _long(0), _long(0, 3))


def test_slot_misuse_raises_one_error_type():
    slots = SlotManager(SlotCache(1, 8, [AttentionCacheSpec(1, 4)], torch.float32), PrefillPolicy())
    slot = slots.allocate()
    with pytest.raises(SlotCacheError, match="all 1 cache slots are in use"):
        slots.allocate()
    slots.free(slot, [])
    with pytest.raises(SlotCacheError, match="slot 0 is not allocated"):
        slots.free(slot, [])
