"""Causal attention over slotted K/V caches, grouped-query.

Each sequence attends only to the keys of its own slot, and is computed on its own: its result
depends on its queries and its slot's K/V, never on which other sequences share the call. The
cache holds K/V for positions [0, start + n) of a sequence by the time attention runs.

- `prefill_attention_ref`: varlen queries (cu_seqlens) of several sequences, each at absolute
  positions start .. start + n - 1 of its slot.
- `decode_attention_ref`: one query per sequence, at position seq_len - 1 of its slot.
"""

import torch


def _attend_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """q [n, Hq, D] at positions start.., k/v [start + n, Hkv, D] -> [n, Hq, D]."""
    n, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    # Query heads of one KV group become rows of one matmul: [Hkv, group * n, D].
    qg = q.reshape(n, num_kv_heads, group, head_dim).permute(1, 2, 0, 3).reshape(num_kv_heads, group * n, head_dim)
    scores = torch.matmul(qg.float(), k.permute(1, 2, 0).float()) * scale  # [Hkv, group * n, L]
    query_pos = start + torch.arange(n, device=q.device).repeat(group)
    key_pos = torch.arange(k.shape[0], device=q.device)
    scores.masked_fill_(key_pos[None, :] > query_pos[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    out = torch.matmul(probs, v.permute(1, 0, 2))  # [Hkv, group * n, D]
    return out.reshape(num_kv_heads, group, n, head_dim).permute(2, 0, 1, 3).reshape(n, num_heads, head_dim)


def prefill_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          slot_ids: torch.Tensor, start_positions: torch.Tensor,
                          cu_seqlens: torch.Tensor, scale: float) -> torch.Tensor:
    """q [T, Hq, D] (sequences concatenated), caches [slots, max_seq_len, Hkv, D],
    slot_ids/start_positions [B], cu_seqlens [B + 1] -> [T, Hq, D]."""
    out = torch.empty_like(q)
    bounds = cu_seqlens.tolist()
    for i, (slot, start) in enumerate(zip(slot_ids.tolist(), start_positions.tolist())):
        lo, hi = bounds[i], bounds[i + 1]
        end = start + hi - lo
        out[lo:hi] = _attend_one(q[lo:hi], k_cache[slot, :end], v_cache[slot, :end], start, scale)
    return out


def decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         slot_ids: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, Hq, D], one token per sequence at position seq_len - 1 -> [B, Hq, D]."""
    out = torch.empty_like(q)
    for i, (slot, length) in enumerate(zip(slot_ids.tolist(), seq_lens.tolist())):
        out[i:i + 1] = _attend_one(q[i:i + 1], k_cache[slot, :length], v_cache[slot, :length], length - 1, scale)
    return out
