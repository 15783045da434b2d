"""Shared by `prefill_attention` and `decode_attention`: the one-sequence attention the torch
implementations apply per sequence, and the Triton online-softmax block step both kernels use.

Each sequence attends only to the keys of its own slot and is computed on its own: its result
depends on its queries and its slot's K/V, never on which other sequences share the call.
"""

from collections.abc import Callable

import torch
import torch.nn.functional as F

from ._triton import tl, triton
from .checks import check_dtype, check_groups, check_shape
from .cpu.extension import load_extension


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


def attention_rows_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, row_slots: torch.Tensor,
                       row_positions: torch.Tensor, scale: float) -> torch.Tensor | None:
    """Both attention ops' `own_order` implementation: each query row over its slot's keys 0 .. its
    position in pocketllm's C++ kernel (`kernels/cpu/attention.cpp`, its own fixed order), so a row
    gets the same bits decoded, in a prefill piece of any length or cut, or scored. None where it
    does not apply (no compiler, not fp32, a non-contiguous cache): the caller then runs its torch
    path, which the other op's fallback matches row for row."""
    module = load_extension()
    if module is None or not all(t.dtype == torch.float32 and t.is_contiguous() for t in (k_cache, v_cache)) \
            or q.dtype != torch.float32:
        return None
    return module.attention_rows(q.contiguous(), k_cache, v_cache, row_slots.long().contiguous(),
                                 row_positions.long().contiguous(), float(scale))


def _prefill_per_sequence(attend_one: Callable[..., torch.Tensor], q: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, slot_ids: torch.Tensor, start_positions: torch.Tensor,
                          cu_seqlens: torch.Tensor, scale: float) -> torch.Tensor:
    """`attend_one` on each sequence of a varlen batch, over its own slot's keys."""
    out = torch.empty_like(q)
    bounds = cu_seqlens.tolist()
    for i, (slot, start) in enumerate(zip(slot_ids.tolist(), start_positions.tolist())):
        lo, hi = bounds[i], bounds[i + 1]
        end = start + hi - lo
        out[lo:hi] = attend_one(q[lo:hi], k_cache[slot, :end], v_cache[slot, :end], start, scale)
    return out


def _decode_per_sequence(attend_one: Callable[..., torch.Tensor], q: torch.Tensor, k_cache: torch.Tensor,
                         v_cache: torch.Tensor, slot_ids: torch.Tensor, seq_lens: torch.Tensor,
                         scale: float) -> torch.Tensor:
    """`attend_one` on each sequence's one new token, at position seq_len - 1 of its slot."""
    out = torch.empty_like(q)
    for i, (slot, length) in enumerate(zip(slot_ids.tolist(), seq_lens.tolist())):
        out[i:i + 1] = attend_one(q[i:i + 1], k_cache[slot, :length], v_cache[slot, :length], length - 1, scale)
    return out


def _sdpa_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float) -> torch.Tensor:
    """As _attend_one, through torch's fused attention: q [n, Hq, D] at positions start..,
    k/v [start + n, Hkv, D] -> [n, Hq, D]. Query row i sees keys 0 .. start + i: every key for a
    single row, the built-in causal mask when start == 0, an explicit mask otherwise."""
    n = q.shape[0]
    mask = None
    if n > 1 and start > 0:
        mask = torch.arange(k.shape[0], device=q.device)[None, :] <= start + torch.arange(n, device=q.device)[:, None]
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         attn_mask=mask, is_causal=n > 1 and start == 0, scale=scale,
                                         enable_gqa=True)
    return out[0].transpose(0, 1)


def _dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs must not be rounded to TF32 on GPU; fp16/bf16 inputs use the default."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


@triton.jit
def _softmax_start(ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """Online-softmax state (m, l, acc) of ROWS query rows before their first key block."""
    m = tl.full([ROWS], float("-inf"), tl.float32)
    return m, tl.zeros([ROWS], tl.float32), tl.zeros([ROWS, BLOCK_D], tl.float32)


@triton.jit
def _attend_block(q, k_base, v_base, pos, kv_mask, visible, d, d_mask, stride_kl, stride_kd, stride_vl, stride_vd,
                  scale, m, l, acc, DOT_PRECISION: tl.constexpr):
    """One key block of online softmax for a tile of query rows: returns the updated (m, l, acc).
    `visible` masks (row, key) pairs; a row that sees no key of the block keeps (m, l, acc) bit
    for bit, provided its m is already finite (alpha = exp(0) = 1, p = exp(-inf) = 0)."""
    k = tl.load(k_base + pos[:, None].to(tl.int64) * stride_kl + d[None, :] * stride_kd,
                mask=kv_mask[:, None] & d_mask[None, :], other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    alpha = tl.exp(m - m_new)
    p = tl.exp(s - m_new[:, None])
    l = l * alpha + tl.sum(p, 1)
    v = tl.load(v_base + pos[:, None].to(tl.int64) * stride_vl + d[None, :] * stride_vd,
                mask=kv_mask[:, None] & d_mask[None, :], other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l, acc


def _check_attention_args(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> int:
    """q [tokens, heads, head_dim] and K/V caches [slots, max_seq_len, kv_heads, head_dim] that agree;
    returns the query heads per key/value head."""
    check_shape("q", q, (None, None, None))
    check_shape("k_cache", k_cache, (None, None, None, q.shape[2]))
    check_shape("v_cache", v_cache, (k_cache.shape[0], k_cache.shape[1], k_cache.shape[2], k_cache.shape[3]))
    check_dtype(q.dtype, k_cache=k_cache, v_cache=v_cache)
    return check_groups(q.shape[1], k_cache.shape[2])


def kv_bytes(k_cache: torch.Tensor, positions: int) -> int:
    """K and V bytes of `positions` cached tokens (the roofline of both attention ops)."""
    return 2 * positions * k_cache[0, 0].numel() * k_cache.element_size()
