"""What an op module declares about its op, in one record (`OpSpec`, exported as `OP`).

The registry, the op table, the lab's case grids, its real-shape launches and their rooflines are
all read from these records, so an op is declared once, beside its code. The lab's types that a
declaration needs (`Layout`, `Step`, `Call`, `Cost`) live here, in the kernels layer, because op
modules import nothing from pocketllm above them: `Step` is a Protocol that the lab's model steps
satisfy, saying what a launch builder may read of a step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

TokensFn = Callable[[torch.Generator, int, dict, torch.dtype], dict[str, torch.Tensor]]
SlotsFn = Callable[[torch.Generator, int, int, dict, torch.dtype], dict[str, torch.Tensor]]
SharedFn = Callable[[torch.Generator, dict, torch.dtype], dict[str, Any]]


@dataclass(frozen=True)
class Layout:
    """How an op's lab case members are made: per-token inputs, per-slot contents, shared inputs."""

    tokens: TokensFn
    slots: SlotsFn | None
    shared: SharedFn
    grid: list[tuple[dict, list[tuple[int, int]]]]  # (dims, [(n, start) per member])
    splittable: bool = False  # a prefill op whose sequences may be cut at aligned positions


@dataclass(frozen=True)
class Call:
    """One call of an op in a step. Its arguments are built when asked: real-shape caches are large."""

    label: str  # the step, and which of the op's calls in it
    args: Callable[[], tuple[Any, ...]]
    shards: int = 1  # a row-parallel matrix's call: its K in the fixed tree's shards (`linear.in_shards`)


@dataclass(frozen=True)
class Cost:
    """A call's roofline: the bytes it must move and the floating-point operations it must do."""

    bytes: int
    flops: int


class ModelDims(Protocol):
    """The model hyper-parameters a launch builder reads (`config.ModelConfig` has them)."""

    @property
    def hidden_size(self) -> int: ...
    @property
    def intermediate_size(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def num_attention_heads(self) -> int: ...
    @property
    def num_key_value_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def rotary_dim(self) -> int: ...
    @property
    def rms_norm_eps(self) -> float: ...
    @property
    def linear_value_head_dim(self) -> int: ...


class StepBatch(Protocol):
    """The index tensors of a step's batch (`models.ForwardBatch` has them)."""

    @property
    def is_decode(self) -> bool: ...
    @property
    def positions(self) -> torch.Tensor: ...
    @property
    def token_slots(self) -> torch.Tensor: ...
    @property
    def slot_ids(self) -> torch.Tensor: ...
    @property
    def start_positions(self) -> torch.Tensor: ...
    @property
    def cu_seqlens(self) -> torch.Tensor: ...
    @property
    def logit_rows(self) -> torch.Tensor: ...


class Step(Protocol):
    """One model step as launch builders see it: its shapes, its tensors, and the views of the
    model's activations an op is called on (the model family decides their layout)."""

    @property
    def name(self) -> str: ...
    @property
    def cfg(self) -> ModelDims: ...
    @property
    def batch(self) -> StepBatch: ...
    @property
    def tokens(self) -> int: ...
    @property
    def sequences(self) -> int: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def max_seq_len(self) -> int: ...
    @property
    def linear_attention(self) -> bool:
        """Whether the model has Gated DeltaNet layers."""
        ...

    def tensor(self, *shape: int, dtype: torch.dtype | None = None) -> torch.Tensor: ...
    def uniform(self, low: float, high: float, *shape: int) -> torch.Tensor: ...
    def matrices(self) -> list[tuple[str, int, int]]:
        """(name, in features, out features) of the matrices a layer multiplies."""
        ...

    def kv_cache(self) -> torch.Tensor: ...
    def attention_views(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v [tokens, heads, head_dim] as the attention layer slices its fused projection."""
        ...

    def gdn_in_proj(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(qkv [tokens, conv_dim], z [tokens, value heads, value dim]) of a Gated DeltaNet layer."""
        ...

    def conv_state(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv weight [conv_dim, K], conv states [slots, conv_dim, K - 1])."""
        ...

    def gated_delta_args(self) -> tuple[torch.Tensor, ...]:
        """(q, k, v, g, beta, states) as a Gated DeltaNet layer passes them."""
        ...

    def replay_buffers(self) -> torch.Tensor:
        """A Gated DeltaNet layer's replay buffers [slots, CHUNK_SIZE, width] (exact positions)."""
        ...


LaunchesFn = Callable[[Step], list[Call]]


@dataclass(frozen=True)
class OpSpec:
    """An op: its name (its module's name), its signature, its implementations by name ("ref" is
    the reference every other is tested against), where it sits in the model's order (reports
    list ops in that order), its lab case layout, and, for an op with a Triton kernel, the calls a
    model step makes of it (what `lab compile` compiles and `lab bench` times) and their cost."""

    name: str
    signature: type
    implementations: dict[str, Callable[..., Any]]
    order: int
    cases: Layout
    launches: LaunchesFn | None = None
    cost: Callable[..., Cost] | None = None


def size(*tensors: torch.Tensor | None) -> int:
    """Bytes of the tensors' elements (a strided view counts only its own elements)."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)
