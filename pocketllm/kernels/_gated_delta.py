"""Shared by `gated_delta_prefill` and `gated_delta_decode`: the gated delta rule of Gated
DeltaNet layers, over slotted fp32 recurrent states.

Per value head, with state S [Dk, Dv], for each token (q, k L2-normalised; q scaled by Dk^-1/2):
    S <- exp(g) * S;   S <- S + k (beta (v - S^T k))^T;   out = S^T q
Value heads outnumber key heads in groups: value head h reads key head h // (Hv / Hk).
"""

import torch

from .checks import check_dtype, check_groups, check_shape
from .grid import POSITION_GRID
from .spec import Cost, size

CHUNK_SIZE = POSITION_GRID  # chunks sit on the position grid, so a cut on it leaves them whole


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def _prepare(q: torch.Tensor, k: torch.Tensor, num_v_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, Hk, Dk] -> fp32 [Hv, n, Dk]: L2-normalised (eps 1e-6), q scaled, key heads repeated."""
    group = num_v_heads // q.shape[1]
    q = _l2norm(q.float()) * q.shape[-1] ** -0.5
    k = _l2norm(k.float())
    return (q.repeat_interleave(group, dim=1).transpose(0, 1).contiguous(),
            k.repeat_interleave(group, dim=1).transpose(0, 1).contiguous())


def _check_gated_delta_args(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                            states: torch.Tensor) -> int:
    """q, k [tokens, key_heads, Dk], v [tokens, value_heads, Dv], g and beta [tokens, value_heads],
    states fp32 [slots, value_heads, Dk, Dv]; returns the value heads per key head."""
    check_shape("q", q, (None, None, None))
    tokens, key_heads, dim_k = q.shape
    check_shape("k", k, (tokens, key_heads, dim_k))
    check_shape("v", v, (tokens, None, None))
    num_v_heads, dim_v = v.shape[1], v.shape[2]
    check_shape("g", g, (tokens, num_v_heads))
    check_shape("beta", beta, (tokens, num_v_heads))
    check_shape("states", states, (None, num_v_heads, dim_k, dim_v))
    check_dtype(torch.float32, states=states)
    return check_groups(num_v_heads, key_heads, "value heads", "key heads")


def gated_delta_cost(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     states: torch.Tensor, slot_ids: torch.Tensor, *indices: torch.Tensor) -> Cost:
    """Reads q, k, v, g, beta and each sequence's fp32 state [Hv, Dk, Dv], writes [T, Hv, Dv] and the
    states. The recurrent form per token and value head: decay S (Dk·Dv), S^T k (2·Dk·Dv), the
    rank-1 update (2·Dk·Dv), S^T q (2·Dk·Dv): 7·Dk·Dv FLOPs. Both gated delta ops."""
    state_bytes = slot_ids.numel() * states[0].numel() * states.element_size()
    tokens, v_heads, dim_v = v.shape
    written = tokens * v_heads * dim_v * v.element_size()
    return Cost(size(q, k, v, g, beta, slot_ids, *indices) + written + 2 * state_bytes,
                7 * tokens * v_heads * states.shape[2] * dim_v)
