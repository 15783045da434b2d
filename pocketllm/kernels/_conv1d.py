"""Shared by `conv1d_prefill` and `conv1d_decode`: the depthwise causal conv1d with SiLU of Gated
DeltaNet layers, over slotted conv states.

Each output is silu(sum_j w[c, j] * x[t - K + 1 + j, c]) with the K taps summed in a fixed order
in fp32, so a token's output depends only on its own K inputs: the same whichever batch it is in
and however its prompt was split. A slot's conv state holds the last K - 1 inputs of its sequence
(zeros for a new request), which precede the first new token.
"""

import torch
import torch.nn.functional as F

from .pointwise import elementwise_invariant
from .spec import Cost, size


def _conv_window(window: torch.Tensor, weight: torch.Tensor, steps: int) -> torch.Tensor:
    """window [steps + K - 1, C] (fp32), weight [C, K] -> silu(conv) [steps, C] fp32."""
    kernel = weight.shape[1]
    w = weight.float()
    acc = window[0:steps] * w[:, 0]
    for j in range(1, kernel):
        acc = acc + window[j:j + steps] * w[:, j]
    return elementwise_invariant(F.silu, acc)


BLOCK_C_STATE = 256  # channels per program of the state-update and decode kernels


def _check_conv_args(x: torch.Tensor, weight: torch.Tensor, conv_states: torch.Tensor) -> int:
    """The kernel width K, after checking the shapes agree."""
    channels, kernel = weight.shape
    if not 2 <= kernel <= 4:
        raise ValueError(f"kernel width {kernel} unsupported (2..4)")
    if x.dim() != 2 or x.shape[1] != channels or conv_states.dim() != 3 or \
            conv_states.shape[1:] != (channels, kernel - 1):
        raise ValueError(f"x {tuple(x.shape)}, weight {tuple(weight.shape)}, conv_states "
                         f"{tuple(conv_states.shape)}: need [T, C], [C, K], [slots, C, K - 1]")
    return kernel


def conv1d_cost(x: torch.Tensor, weight: torch.Tensor, conv_states: torch.Tensor, slot_ids: torch.Tensor,
                *indices: torch.Tensor) -> Cost:
    """Reads x [T, C], the taps and each sequence's state, writes [T, C] and the states; K
    multiply-adds and a silu (~4) an output: (2K + 4)·T·C FLOPs. Both conv1d ops."""
    width, states = weight.shape[1], slot_ids.numel() * conv_states[0].numel() * conv_states.element_size()
    return Cost(2 * size(x) + size(weight, slot_ids, *indices) + 2 * states, (2 * width + 4) * x.numel())
