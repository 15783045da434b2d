"""Shared by `gated_delta_prefill` and `gated_delta_decode`: the gated delta rule of Gated
DeltaNet layers, over slotted fp32 recurrent states.

Per value head, with state S [Dk, Dv], for each token (q, k L2-normalised; q scaled by Dk^-1/2):
    S <- exp(g) * S;   S <- S + k (beta (v - S^T k))^T;   out = S^T q
Value heads outnumber key heads in groups: value head h reads key head h // (Hv / Hk).

Exact replay (`gated_delta_prefill` with a `replay` buffer, the exact-positions mode): the slot's
state stays at the last absolute chunk boundary b, and the replay buffer holds the raw k, v, g
and beta of positions b .. n - 1 (row = position % CHUNK_SIZE, fp32: exact for every input dtype).
Every later piece, a one-token decode step included, recomputes that chunk from b with the
chunked arithmetic, so a position's output is the same whatever piece computed it; the state
moves on only when a chunk is complete. The work per step is bounded by the chunk size.
"""

import torch

from .checks import check_dtype, check_groups, check_shape
from .cpu.extension import load_extension, unavailable_reason
from .grid import POSITION_GRID
from .pointwise import elementwise_invariant
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


def replay_width(key_heads: int, dim_k: int, value_heads: int, dim_v: int) -> int:
    """fp32 values one position of the replay buffer holds: its raw k, v, g and beta, side by side."""
    return key_heads * dim_k + value_heads * dim_v + 2 * value_heads


def with_replayed(replay: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                  beta: torch.Tensor, slot_ids: torch.Tensor, start_positions: torch.Tensor,
                  cu_seqlens: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """The batch with each sequence preceded by its replayed positions (its chunk's rows before the
    piece, from the replay buffer; q zero there, as their outputs are dropped): ((q, k, v, g, beta,
    start_positions, cu_seqlens) of the extended batch, and a mask of its rows that are the
    piece's). Values keep their dtypes: the buffer's fp32 copies convert back exactly."""
    held = start_positions % CHUNK_SIZE
    lengths = held + cu_seqlens[1:] - cu_seqlens[:-1]
    cu = torch.cat([cu_seqlens.new_zeros(1), torch.cumsum(lengths, 0)])
    total = int(cu[-1])
    seq = torch.repeat_interleave(torch.arange(lengths.shape[0], device=k.device), lengths, output_size=total)
    row = torch.arange(total, device=k.device) - cu[:-1][seq]  # row within the extended sequence
    replayed = row < held[seq]
    kept = replay[slot_ids[seq], torch.where(replayed, row, 0)]
    source = torch.where(replayed, 0, cu_seqlens[:-1][seq] + row - held[seq])
    k_held, v_held, g_held, beta_held = kept.split([k.shape[1] * k.shape[2], v.shape[1] * v.shape[2], v.shape[1],
                                                    v.shape[1]], dim=-1)

    def extend(x: torch.Tensor, held_values: torch.Tensor | None) -> torch.Tensor:
        rows = x[source]
        fill = torch.zeros_like(rows) if held_values is None else held_values.reshape(rows.shape).to(x.dtype)
        return torch.where(replayed.view(-1, *[1] * (x.dim() - 1)), fill, rows)

    return (extend(q, None), extend(k, k_held), extend(v, v_held), extend(g, g_held), extend(beta, beta_held),
            start_positions - held, cu), ~replayed


def check_replay(replay: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """A replay buffer is fp32 [slots, CHUNK_SIZE, replay_width] with contiguous rows."""
    width = replay_width(k.shape[1], k.shape[2], v.shape[1], v.shape[2])
    check_shape("replay", replay, (None, CHUNK_SIZE, width))
    check_dtype(torch.float32, replay=replay)
    if replay.stride(2) != 1:
        raise ValueError("replay must have contiguous rows (stride 1 along its last dim)")


def save_replay(replay: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                slot_ids: torch.Tensor, start_positions: torch.Tensor, cu_seqlens: torch.Tensor) -> None:
    """Write each sequence's positions past its last complete chunk into its slot's replay buffer
    (after the step has read the rows it replays: a piece that completes a chunk overwrites them)."""
    tokens = k.shape[0]
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    seq = torch.repeat_interleave(torch.arange(lengths.shape[0], device=k.device), lengths, output_size=tokens)
    positions = start_positions[seq] + torch.arange(tokens, device=k.device) - cu_seqlens[:-1][seq]
    end = (start_positions + lengths)[seq]
    pending = positions >= end - end % CHUNK_SIZE
    rows = torch.cat([k.reshape(tokens, -1).float(), v.reshape(tokens, -1).float(), g.float(), beta.float()], dim=1)
    replay[slot_ids[seq][pending], positions[pending] % CHUNK_SIZE] = rows[pending]


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


def gated_delta_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                          states: torch.Tensor, slot_ids: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Both ops' `recurrent` implementation: the rule token by token in pocketllm's C++ kernel
    (`kernels/cpu/gated_delta.cpp`, its own fixed order), for prefill pieces and decode steps
    alike, so a position gets the same bits in either and wherever a prompt was cut, without
    replay buffers (the torch backend's choice with exact positions)."""
    module = load_extension()
    if module is None:
        raise RuntimeError(f"the recurrent gated delta rule needs pocketllm's C++ CPU kernels: {unavailable_reason()}")
    _check_gated_delta_args(q, k, v, g, beta, states)
    if not states.is_contiguous():
        raise ValueError("states must be contiguous for the recurrent gated delta rule")
    decay = elementwise_invariant(torch.exp, g.float())
    out = module.gated_delta_recurrent(q.float().contiguous(), k.float().contiguous(), v.float().contiguous(),
                                       decay.contiguous(), beta.float().contiguous(), states,
                                       slot_ids.long().contiguous(), cu_seqlens.long().contiguous())
    return out.to(v.dtype)
