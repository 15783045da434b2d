"""The ops' benchmark shapes: every call the model makes of each op in one step, at real model shapes.

A `Step` is one model step (each model family's real preset — Qwen3-0.6B, Qwen3.5-0.8B — decode
at batch 1 and 8 and a two-sequence prefill); `op_calls` gives the calls an op's launcher sees in
it, with arguments laid out as the models lay them out (views of fused projections, slotted
caches, fp32 recurrent states). Each op declares its call builder and its cost function (the
call's roofline: the bytes it must move, each input byte read once and each output byte written
once, and the FLOPs it must do) in its module (`OpSpec.launches`, `OpSpec.cost`); a step supplies
the views of the model's activations they read, laid out as the step's model family says.
`lab compile` compiles the launches these calls make and `lab bench` times them, so both see the
same shapes.

Tensors are uninitialised unless the step has a generator (only layouts reach the compiler); with
one they hold values a call can run on (decays below one, probabilities in (0, 1)).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..cache import RecurrentCacheSpec
from ..config import ModelConfig
from ..kernels._gated_delta import CHUNK_SIZE
from ..kernels.linear import in_shards
from ..kernels.registry import SPECS
from ..kernels.spec import Call, Cost
from ..models.batch import ForwardBatch
from ..models.family import Family
from ..models.presets import PRESETS
from ..models.registry import FAMILIES, config_from_dict, family_of

Phases = dict[str, tuple[tuple[int, ...], tuple[int, ...]]]  # name -> (tokens cached, new tokens) per sequence


@dataclass(frozen=True)
class Shapes:
    """A family of steps: which presets, which phases, the caches' length and the activations' dtype."""

    models: tuple[str, ...]
    phases: Phases
    max_seq_len: int
    dtype: torch.dtype  # activations, weights and caches; recurrent states are fp32


SLOTS = 8
_LAB_PRESETS = [family.lab_presets for family in FAMILIES if family.lab_presets]
REAL = Shapes(tuple(real for _, real in _LAB_PRESETS),  # the exact shapes of the published checkpoints
              {"decode b1": ((4095,), (1,)),  # the longest context: 16 key splits
               "decode b8": ((2999, 2047, 1500, 1023, 700, 255, 100, 16), (1,) * 8),  # 12 splits
               "prefill 2 seqs": ((0, 64), (200, 312))},  # 512 tokens, the second after a cached prefix
              4096, torch.bfloat16)
# The same phases, shorter, on the tiny presets in fp32: what the Triton interpreter runs in seconds.
QUICK = Shapes(tuple(quick for quick, _ in _LAB_PRESETS),
               {"decode b1": ((300,), (1,)),  # two key splits
                "decode b8": ((299, 200, 150, 100, 70, 25, 10, 1), (1,) * 8),
                "prefill 2 seqs": ((0, 40), (24, 40))},  # the second crosses position 64 (block, chunk)
              512, torch.float32)
# Attention is also compiled at these head dims and query heads per K/V head (16 query heads).
SWEEP_HEAD_DIMS = (64, 128, 256)
SWEEP_GROUPS = (1, 2, 4, 8)
SWEEP_PHASES = ("decode b8", "prefill 2 seqs")
ATTENTION_OPS = ("prefill_attention", "decode_attention")


@dataclass(frozen=True)
class Step:
    """One model step: the shapes every op of the step sees, and how its tensors are made; the
    views of the model's activations that ops are called on (`kernels.spec.Step`)."""

    name: str
    cfg: ModelConfig
    batch: ForwardBatch
    shapes: Shapes
    family: Family
    generator: torch.Generator | None = None  # None: uninitialised tensors

    @property
    def tokens(self) -> int:
        return self.batch.positions.numel()

    @property
    def sequences(self) -> int:
        return self.batch.slot_ids.numel()

    @property
    def device(self) -> torch.device:
        return self.batch.positions.device

    @property
    def max_seq_len(self) -> int:
        return self.shapes.max_seq_len

    @property
    def linear_attention(self) -> bool:
        return "linear_attention" in self.cfg.layer_types

    def tensor(self, *shape: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Standard normal values (uninitialised without a generator), in the step's dtype by default."""
        dtype = dtype or self.shapes.dtype
        if self.generator is None:
            return torch.empty(shape, dtype=dtype, device=self.device)
        return torch.randn(shape, generator=self.generator, device=self.device).to(dtype)

    def uniform(self, low: float, high: float, *shape: int) -> torch.Tensor:
        """fp32 values uniform in [low, high) (uninitialised without a generator)."""
        if self.generator is None:
            return torch.empty(shape, device=self.device)
        return low + (high - low) * torch.rand(shape, generator=self.generator, device=self.device)

    def matrices(self) -> list[tuple[str, int, int]]:
        return self.family.matrices(self.cfg)

    def kv_cache(self) -> torch.Tensor:
        cfg = self.cfg
        return self.tensor(SLOTS, self.max_seq_len, cfg.num_key_value_heads, cfg.head_dim)

    def attention_views(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cfg, tokens, gated = self.cfg, self.tokens, self.family.gated_attention
        heads, kv_heads, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        q_width = (2 if gated else 1) * heads * d
        q, k, v = self.tensor(tokens, q_width + 2 * kv_heads * d).split([q_width, kv_heads * d, kv_heads * d], dim=-1)
        q = q.reshape(tokens, heads, 2 * d)[..., :d] if gated else q.reshape(tokens, heads, d)
        return q, k.reshape(tokens, kv_heads, d), v.reshape(tokens, kv_heads, d)

    def _recurrent(self) -> RecurrentCacheSpec:
        if self.family.recurrent_spec is None:
            raise ValueError(f"the {self.family.name} family has no linear-attention layers")
        return self.family.recurrent_spec(self.cfg)

    def gdn_in_proj(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of the fused input projection's output [qkv | z | b | a]."""
        spec = self._recurrent()
        value_dim = spec.num_heads * spec.value_dim
        qkv, z, _, _ = self.tensor(self.tokens, spec.conv_dim + value_dim + 2 * spec.num_heads).split(
            [spec.conv_dim, value_dim, spec.num_heads, spec.num_heads], dim=-1)
        return qkv, z.reshape(self.tokens, spec.num_heads, spec.value_dim)

    def conv_state(self) -> tuple[torch.Tensor, torch.Tensor]:
        spec = self._recurrent()
        return self.tensor(spec.conv_dim, spec.conv_width), self.tensor(SLOTS, spec.conv_dim, spec.conv_width - 1)

    def gated_delta_args(self) -> tuple[torch.Tensor, ...]:
        """q, k, v are views of the conv output [q | k | v]; g a decay's log, beta in (0, 1)."""
        spec, tokens = self._recurrent(), self.tokens
        value_dim = spec.num_heads * spec.value_dim
        key_dim = (spec.conv_dim - value_dim) // 2
        k_heads = key_dim // spec.key_dim
        q, k, v = self.tensor(tokens, spec.conv_dim).split([key_dim, key_dim, value_dim], dim=-1)
        g, beta = self.uniform(-1.0, 0.0, tokens, spec.num_heads), self.uniform(0.0, 1.0, tokens, spec.num_heads)
        states = self.tensor(SLOTS, spec.num_heads, spec.key_dim, spec.value_dim, dtype=torch.float32)
        return (q.reshape(tokens, k_heads, -1), k.reshape(tokens, k_heads, -1), v.reshape(tokens, spec.num_heads, -1),
                g, beta, states)

    def replay_buffers(self) -> torch.Tensor:
        """Replayed k and v as `tensor` makes them; their g (log decays) and beta in range, as the
        layer writes them."""
        spec = self._recurrent()
        buffers = self.tensor(SLOTS, CHUNK_SIZE, spec.replay_width, dtype=torch.float32)
        heads = spec.num_heads
        buffers[..., -2 * heads:-heads] = self.uniform(-1.0, 0.0, SLOTS, CHUNK_SIZE, heads)
        buffers[..., -heads:] = self.uniform(0.0, 1.0, SLOTS, CHUNK_SIZE, heads)
        return buffers


def _step(name: str, cfg: ModelConfig, phase: str, shapes: Shapes, device: str, seed: int | None) -> Step:
    starts, lengths = shapes.phases[phase]
    batch = ForwardBatch.build(list(range(len(starts))), list(starts), [[0] * n for n in lengths],
                               is_decode=phase.startswith("decode"), device=device)
    generator = None if seed is None else torch.Generator(device=device).manual_seed(seed)
    return Step(f"{name} {phase}", cfg, batch, shapes, family_of(cfg), generator)


def _config(name: str) -> ModelConfig:
    return config_from_dict(PRESETS[name], source=f"preset {name!r}")


def model_steps(shapes: Shapes = REAL, device: str = "cpu", seed: int | None = None) -> list[Step]:
    """Every phase of every model of `shapes`; with a `seed`, the steps' tensors hold random values."""
    return [_step(name, _config(name), phase, shapes, device, seed) for name in shapes.models
            for phase in shapes.phases]


def sweep_steps() -> list[Step]:
    """Attention at other head dims and GQA ratios than the models', on the first model's other shapes."""
    base = _config(REAL.models[0])
    heads = base.num_attention_heads
    return [_step(f"sweep d{d} gqa{g}", dataclasses.replace(base, head_dim=d, num_key_value_heads=heads // g), phase,
                  REAL, "cpu", None)
            for d in SWEEP_HEAD_DIMS for g in SWEEP_GROUPS for phase in SWEEP_PHASES]


# Every op with launches (every op with a Triton kernel: not the embedding), in the model's order.
OPS = tuple(name for name, spec in SPECS.items() if spec.launches is not None)


def op_calls(op: str, step: Step) -> list[Call]:
    """The calls `step` makes of `op` (none where the step does not run it)."""
    launches = SPECS[op].launches
    return launches(step) if launches else []


def invoke(launcher: Callable[..., Any], call: Call, args: Sequence[Any]) -> Any:
    """`launcher` on a call's arguments as the model calls it: a row-parallel matrix in its shards."""
    if call.shards == 1:
        return launcher(*args)
    return in_shards(launcher, args[0], list(args[1].chunk(call.shards, dim=1)))


def call_cost(op: str, args: Sequence[Any]) -> Cost:
    """The roofline of one call of `op` with `args` (see each op's cost function for its formula)."""
    cost = SPECS[op].cost
    if cost is None:
        raise ValueError(f"op {op} declares no cost")
    return cost(*args)
