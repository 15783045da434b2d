"""Write new K/V rows into their slots of the cache, at their absolute positions (after RoPE).

Attention reads K/V from the slot only after this write, so a token attends to exactly the
bytes every later step will read too.
"""

import torch

from .rope import apply_rope_ref


def write_kv_ref(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 token_slots: torch.Tensor, positions: torch.Tensor) -> None:
    """k_cache/v_cache [slots, max_seq_len, kv_heads, D]; k/v [T, kv_heads, D]; token_slots/positions [T]."""
    k_cache[token_slots, positions] = k.to(k_cache.dtype)
    v_cache[token_slots, positions] = v.to(v_cache.dtype)


def rope_write_kv_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                      cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      token_slots: torch.Tensor) -> torch.Tensor:
    """Rotate q and k by their positions, write rotated k and v into the slots; returns rotated q.

    The op the model calls: one launch in the Triton backend, this composition in the reference.
    """
    write_kv_ref(k_cache, v_cache, apply_rope_ref(k, positions, cos, sin), v, token_slots, positions)
    return apply_rope_ref(q, positions, cos, sin)
