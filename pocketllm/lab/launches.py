"""The ops' benchmark shapes: every call the model makes of each op in one step, at real model shapes.

A `Step` is one model step (the Qwen3-0.6B and Qwen3.5-0.8B presets, decode at batch 1 and 8 and a
two-sequence prefill); `op_calls` gives the calls an op's launcher sees in it, with arguments laid
out as the models lay them out (views of fused projections, slotted caches, fp32 recurrent states).
`lab compile` compiles the launches these calls make and `lab bench` times them, so both see the
same shapes. Beside each call builder, a cost function gives the call's roofline: the bytes it must
move (each input byte read once, each output byte written once) and the FLOPs it must do.

Tensors are uninitialised unless the step has a generator (only layouts reach the compiler); with
one they hold values a call can run on (decays below one, probabilities in (0, 1)).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..config import ModelConfig
from ..models.batch import ForwardBatch
from ..models.presets import PRESETS

Phases = dict[str, tuple[tuple[int, ...], tuple[int, ...]]]  # name -> (tokens cached, new tokens) per sequence


@dataclass(frozen=True)
class Shapes:
    """A family of steps: which presets, which phases, the caches' length and the activations' dtype."""

    models: tuple[str, ...]
    phases: Phases
    max_seq_len: int
    dtype: torch.dtype  # activations, weights and caches; recurrent states are fp32


SLOTS = 8
REAL = Shapes(("qwen3-0.6b", "qwen3.5-0.8b"),  # the exact shapes of the published checkpoints
              {"decode b1": ((4095,), (1,)),  # the longest context: 16 key splits
               "decode b8": ((2999, 2047, 1500, 1023, 700, 255, 100, 16), (1,) * 8),  # 12 splits
               "prefill 2 seqs": ((0, 64), (200, 312))},  # 512 tokens, the second after a cached prefix
              4096, torch.bfloat16)
# The same phases, shorter, on the tiny presets in fp32: what the Triton interpreter runs in seconds.
QUICK = Shapes(("tiny", "qwen3.5-tiny"),
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
    """One model step: the shapes every op of the step sees, and how its tensors are made."""

    name: str
    cfg: ModelConfig
    batch: ForwardBatch
    shapes: Shapes
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


@dataclass(frozen=True)
class Call:
    """One call of an op in a step. Its arguments are built when asked: real-shape caches are large."""

    label: str  # the step, and which of the op's calls in it
    args: Callable[[], tuple[Any, ...]]


@dataclass(frozen=True)
class Cost:
    """A call's roofline: the bytes it must move and the floating-point operations it must do."""

    bytes: int
    flops: int


def _step(name: str, cfg: ModelConfig, phase: str, shapes: Shapes, device: str, seed: int | None) -> Step:
    starts, lengths = shapes.phases[phase]
    batch = ForwardBatch.build(list(range(len(starts))), list(starts), [[0] * n for n in lengths],
                               is_decode=phase.startswith("decode"), device=device)
    generator = None if seed is None else torch.Generator(device=device).manual_seed(seed)
    return Step(f"{name} {phase}", cfg, batch, shapes, generator)


def _config(name: str) -> ModelConfig:
    return ModelConfig.from_dict(PRESETS[name], source=f"preset {name!r}")


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


def _size(*tensors: torch.Tensor | None) -> int:
    """Bytes of the tensors' elements (a strided view counts only its own elements)."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _hybrid(cfg: ModelConfig) -> bool:
    """Qwen3.5: Gated DeltaNet layers, and full attention with an output gate."""
    return cfg.architecture.startswith("Qwen3_5")


# -- projections ---------------------------------------------------------------------------------


def _gdn_sizes(cfg: ModelConfig) -> tuple[int, int, int]:
    """(key_dim, value_dim, conv_dim) of a Gated DeltaNet layer, as `DeltaNet` sizes them."""
    key_dim = cfg.linear_num_key_heads * cfg.linear_key_head_dim
    value_dim = cfg.linear_num_value_heads * cfg.linear_value_head_dim
    return key_dim, value_dim, 2 * key_dim + value_dim


def _projections(cfg: ModelConfig) -> list[tuple[str, int, int]]:
    """(name, in features, out features) of a layer's matrices."""
    heads, kv_heads, d, hidden = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
    q_width = (2 if _hybrid(cfg) else 1) * heads * d
    shapes = [("qkv", hidden, q_width + 2 * kv_heads * d), ("o_proj", heads * d, hidden),
              ("gate_up", hidden, 2 * cfg.intermediate_size), ("down", cfg.intermediate_size, hidden)]
    if _hybrid(cfg):
        _, value_dim, conv_dim = _gdn_sizes(cfg)
        shapes += [("in_proj", hidden, conv_dim + value_dim + 2 * cfg.linear_num_value_heads),
                   ("out_proj", value_dim, hidden)]
    return shapes


def _body_linear(step: Step) -> list[Call]:
    def matrix(features_in: int, features_out: int) -> Callable[[], tuple[Any, ...]]:
        return lambda: (step.tensor(step.tokens, features_in), step.tensor(features_out, features_in))

    return [Call(f"{step.name}: {name}", matrix(i, o)) for name, i, o in _projections(step.cfg)]


def _linear_calls(step: Step) -> list[Call]:
    """Decode rows go through `linear`, and the lm_head rows of every step."""
    cfg = step.cfg
    lm_head = Call(f"{step.name}: lm_head", lambda: (step.tensor(step.sequences, cfg.hidden_size),
                                                     step.tensor(cfg.vocab_size, cfg.hidden_size)))
    return (_body_linear(step) if step.batch.is_decode else []) + [lm_head]


def _prefill_linear_calls(step: Step) -> list[Call]:
    return [] if step.batch.is_decode else _body_linear(step)


def _linear_cost(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Cost:
    """[M, K] x [N, K]: reads x, W (once) and the bias, writes [M, N]; 2·M·N·K FLOPs."""
    (m, k), n = x.shape, weight.shape[0]
    return Cost(_size(x, weight, bias) + m * n * x.element_size(), 2 * m * n * k)


# -- norms and activations -----------------------------------------------------------------------


def _attention_views(step: Step) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v [tokens, heads, head_dim] as `Attention.forward` slices the fused projection."""
    cfg, tokens = step.cfg, step.tokens
    heads, kv_heads, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    q_width = (2 if _hybrid(cfg) else 1) * heads * d
    q, k, v = step.tensor(tokens, q_width + 2 * kv_heads * d).split([q_width, kv_heads * d, kv_heads * d], dim=-1)
    q = q.reshape(tokens, heads, 2 * d)[..., :d] if _hybrid(cfg) else q.reshape(tokens, heads, d)
    return q, k.reshape(tokens, kv_heads, d), v.reshape(tokens, kv_heads, d)


def _rms_norm_calls(step: Step) -> list[Call]:
    cfg, eps = step.cfg, step.cfg.rms_norm_eps

    def rows(n: int) -> tuple[Any, ...]:
        return step.tensor(n, cfg.hidden_size), step.tensor(cfg.hidden_size), eps

    return [Call(f"{step.name}: hidden", lambda: rows(step.tokens)),
            Call(f"{step.name}: q norm", lambda: (_attention_views(step)[0], step.tensor(cfg.head_dim), eps)),
            Call(f"{step.name}: k norm", lambda: (_attention_views(step)[1], step.tensor(cfg.head_dim), eps)),
            Call(f"{step.name}: final norm", lambda: rows(step.sequences))]


def _rms_norm_cost(x: torch.Tensor, weight: torch.Tensor, eps: float) -> Cost:
    """Reads x and the weight, writes x's shape; ~4 FLOPs an element (square, sum, two scalings)."""
    return Cost(2 * _size(x) + _size(weight), 4 * x.numel())


def _silu_and_mul_calls(step: Step) -> list[Call]:
    return [Call(step.name, lambda: (step.tensor(step.tokens, 2 * step.cfg.intermediate_size),))]


def _silu_and_mul_cost(gate_up: torch.Tensor) -> Cost:
    """Reads [T, 2I], writes [T, I]; ~5 FLOPs an output (silu's exp, add and divide, two multiplies)."""
    outputs = gate_up.numel() // 2
    return Cost(_size(gate_up) + outputs * gate_up.element_size(), 5 * outputs)


def _gdn_in_proj(step: Step) -> tuple[torch.Tensor, torch.Tensor]:
    """(qkv [tokens, conv_dim], z [tokens, value heads, value dim]): views of the fused input
    projection's output, as `DeltaNet.forward` splits it."""
    cfg, tokens = step.cfg, step.tokens
    _, value_dim, conv_dim = _gdn_sizes(cfg)
    v_heads = cfg.linear_num_value_heads
    qkv, z, _, _ = step.tensor(tokens, conv_dim + value_dim + 2 * v_heads).split(
        [conv_dim, value_dim, v_heads, v_heads], dim=-1)
    return qkv, z.reshape(tokens, v_heads, cfg.linear_value_head_dim)


def _rms_norm_gated_calls(step: Step) -> list[Call]:
    cfg = step.cfg
    if not _hybrid(cfg):
        return []

    def args() -> tuple[Any, ...]:
        _, z = _gdn_in_proj(step)
        out = step.tensor(*z.shape)  # the gated delta rule's output
        return out, z, step.tensor(cfg.linear_value_head_dim), cfg.rms_norm_eps

    return [Call(step.name, args)]


def _rms_norm_gated_cost(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> Cost:
    """Reads x, the gate and the weight, writes x's shape; ~9 FLOPs an element (norm 4, silu 4, product)."""
    return Cost(2 * _size(x) + _size(gate, weight), 9 * x.numel())


# -- attention -----------------------------------------------------------------------------------


def _kv_cache(step: Step) -> torch.Tensor:
    cfg = step.cfg
    return step.tensor(SLOTS, step.shapes.max_seq_len, cfg.num_key_value_heads, cfg.head_dim)


def _rope_write_kv_calls(step: Step) -> list[Call]:
    cfg, batch = step.cfg, step.batch

    def args() -> tuple[Any, ...]:
        q, k, v = _attention_views(step)  # q and k are normed into new tensors first
        table = step.tensor(step.shapes.max_seq_len, cfg.rotary_dim, dtype=torch.float32)
        return (step.tensor(*q.shape), step.tensor(*k.shape), v, batch.positions, table, table, _kv_cache(step),
                _kv_cache(step), batch.token_slots)

    return [Call(step.name, args)]


def _rope_write_kv_cost(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                        cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        token_slots: torch.Tensor) -> Cost:
    """Reads q, k, v, each token's cos/sin row and its position and slot; writes the rotated q and
    the tokens' cache rows. 3 FLOPs a rotated element (x·cos + rotate(x)·sin)."""
    tokens, rotary_dim = q.shape[0], cos.shape[1]
    cache_rows = (k.numel() + v.numel()) * k_cache.element_size()
    rows = 2 * tokens * rotary_dim * cos.element_size()
    rotated = tokens * (q.shape[1] + k.shape[1]) * rotary_dim
    return Cost(2 * _size(q) + _size(k, v, positions, token_slots) + rows + cache_rows, 3 * rotated)


def _decode_attention_calls(step: Step) -> list[Call]:
    cfg, batch = step.cfg, step.batch
    if not batch.is_decode:
        return []
    return [Call(step.name, lambda: (step.tensor(step.tokens, cfg.num_attention_heads, cfg.head_dim),
                                     _kv_cache(step), _kv_cache(step), batch.slot_ids, batch.start_positions + 1,
                                     cfg.head_dim ** -0.5))]


def _kv_bytes(k_cache: torch.Tensor, positions: int) -> int:
    """K and V bytes of `positions` cached tokens."""
    return 2 * positions * k_cache[0, 0].numel() * k_cache.element_size()


def _decode_attention_cost(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_ids: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float) -> Cost:
    """Reads q and the first seq_len positions of each sequence's K and V (not the whole cache),
    writes q's shape; 4·heads·D FLOPs a key per query row (q·k and p·v)."""
    keys = int(seq_lens.sum())
    heads, d = q.shape[1], q.shape[2]
    return Cost(2 * _size(q) + _kv_bytes(k_cache, keys) + _size(slot_ids, seq_lens), 4 * heads * d * keys)


def _prefill_attention_calls(step: Step) -> list[Call]:
    cfg, batch = step.cfg, step.batch
    if batch.is_decode:
        return []
    return [Call(step.name, lambda: (step.tensor(step.tokens, cfg.num_attention_heads, cfg.head_dim),
                                     _kv_cache(step), _kv_cache(step), batch.slot_ids, batch.start_positions,
                                     batch.cu_seqlens, cfg.head_dim ** -0.5))]


def _prefill_attention_cost(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_ids: torch.Tensor,
                            start_positions: torch.Tensor, cu_seqlens: torch.Tensor, scale: float) -> Cost:
    """Reads q and each sequence's K and V up to its last new token, writes q's shape. Causal: the
    row at position p sees p + 1 keys, so n rows after s cached see n·s + n(n+1)/2 keys in all;
    4·heads·D FLOPs a key seen."""
    starts, lengths = start_positions.tolist(), (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    positions = sum(s + n for s, n in zip(starts, lengths))
    seen = sum(n * s + n * (n + 1) // 2 for s, n in zip(starts, lengths))
    heads, d = q.shape[1], q.shape[2]
    indices = _size(slot_ids, start_positions, cu_seqlens)
    return Cost(2 * _size(q) + _kv_bytes(k_cache, positions) + indices, 4 * heads * d * seen)


# -- Gated DeltaNet (Qwen3.5) ----------------------------------------------------------------------


def _conv_state(step: Step) -> tuple[torch.Tensor, torch.Tensor]:
    """(conv weight [conv_dim, K], conv states [slots, conv_dim, K - 1])."""
    conv_dim, width = _gdn_sizes(step.cfg)[2], step.cfg.linear_conv_kernel_dim
    return step.tensor(conv_dim, width), step.tensor(SLOTS, conv_dim, width - 1)


def _conv1d_prefill_calls(step: Step) -> list[Call]:
    if not _hybrid(step.cfg) or step.batch.is_decode:
        return []
    return [Call(step.name, lambda: (_gdn_in_proj(step)[0], *_conv_state(step), step.batch.slot_ids,
                                     step.batch.cu_seqlens))]


def _conv1d_decode_calls(step: Step) -> list[Call]:
    if not _hybrid(step.cfg) or not step.batch.is_decode:
        return []
    return [Call(step.name, lambda: (_gdn_in_proj(step)[0], *_conv_state(step), step.batch.slot_ids))]


def _conv1d_cost(x: torch.Tensor, weight: torch.Tensor, conv_states: torch.Tensor, slot_ids: torch.Tensor,
                 *indices: torch.Tensor) -> Cost:
    """Reads x [T, C], the taps and each sequence's state, writes [T, C] and the states; K
    multiply-adds and a silu (~4) an output: (2K + 4)·T·C FLOPs. Both conv1d ops."""
    width, states = weight.shape[1], slot_ids.numel() * conv_states[0].numel() * conv_states.element_size()
    return Cost(2 * _size(x) + _size(weight, slot_ids, *indices) + 2 * states, (2 * width + 4) * x.numel())


def _gated_delta_args(step: Step) -> tuple[torch.Tensor, ...]:
    """(q, k, v, g, beta, states) as `DeltaNet.forward` passes them: q, k, v views of the conv output."""
    cfg, tokens = step.cfg, step.tokens
    key_dim, value_dim, conv_dim = _gdn_sizes(cfg)
    k_heads, v_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    q, k, v = step.tensor(tokens, conv_dim).split([key_dim, key_dim, value_dim], dim=-1)
    g, beta = step.uniform(-1.0, 0.0, tokens, v_heads), step.uniform(0.0, 1.0, tokens, v_heads)
    states = step.tensor(SLOTS, v_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim, dtype=torch.float32)
    return (q.reshape(tokens, k_heads, -1), k.reshape(tokens, k_heads, -1), v.reshape(tokens, v_heads, -1), g, beta,
            states)


def _gated_delta_prefill_calls(step: Step) -> list[Call]:
    batch = step.batch
    if not _hybrid(step.cfg) or batch.is_decode:
        return []
    return [Call(step.name, lambda: (*_gated_delta_args(step), batch.slot_ids, batch.start_positions,
                                     batch.cu_seqlens))]


def _gated_delta_decode_calls(step: Step) -> list[Call]:
    if not _hybrid(step.cfg) or not step.batch.is_decode:
        return []
    return [Call(step.name, lambda: (*_gated_delta_args(step), step.batch.slot_ids))]


def _gated_delta_cost(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                      states: torch.Tensor, slot_ids: torch.Tensor, *indices: torch.Tensor) -> Cost:
    """Reads q, k, v, g, beta and each sequence's fp32 state [Hv, Dk, Dv], writes [T, Hv, Dv] and the
    states. The recurrent form per token and value head: decay S (Dk·Dv), S^T k (2·Dk·Dv), the
    rank-1 update (2·Dk·Dv), S^T q (2·Dk·Dv): 7·Dk·Dv FLOPs. Both gated delta ops."""
    state_bytes = slot_ids.numel() * states[0].numel() * states.element_size()
    tokens, v_heads, dim_v = v.shape
    written = tokens * v_heads * dim_v * v.element_size()
    return Cost(_size(q, k, v, g, beta, slot_ids, *indices) + written + 2 * state_bytes,
                7 * tokens * v_heads * states.shape[2] * dim_v)


# -- sampling ------------------------------------------------------------------------------------


def _sample_calls(step: Step) -> list[Call]:
    rows = step.sequences

    def full(value: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.full((rows,), value, dtype=dtype, device=step.device)

    def args() -> tuple[Any, ...]:
        logits = step.tensor(rows, step.cfg.vocab_size, dtype=torch.float32)  # the model's logits are fp32
        return (logits, full(0.8), full(50, torch.int64), full(0.9), torch.arange(rows, device=step.device),
                step.batch.positions[step.batch.last_token_indices] + 1)

    return [Call(step.name, args)]


def _sample_cost(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                 seeds: torch.Tensor, positions: torch.Tensor) -> Cost:
    """Reads the logits once and the per-row parameters, writes a token (int64) and a logprob (fp32)
    a row; ~5 FLOPs a logit (temperature, softmax's exp and sum, the noise's log, the comparison).
    Extra passes for top-k/top-p are the implementation's choice, not counted."""
    rows = logits.shape[0]
    return Cost(_size(logits, temperature, top_k, top_p, seeds, positions) + rows * (8 + 4), 5 * logits.numel())


# Op table field -> (the calls a step makes of it, their cost). Every op with a Triton kernel (not the embedding).
_OPS: dict[str, tuple[Callable[[Step], list[Call]], Callable[..., Cost]]] = {
    "rms_norm": (_rms_norm_calls, _rms_norm_cost),
    "rope_write_kv": (_rope_write_kv_calls, _rope_write_kv_cost),
    "prefill_attention": (_prefill_attention_calls, _prefill_attention_cost),
    "decode_attention": (_decode_attention_calls, _decode_attention_cost),
    "silu_and_mul": (_silu_and_mul_calls, _silu_and_mul_cost),
    "linear": (_linear_calls, _linear_cost),
    "prefill_linear": (_prefill_linear_calls, _linear_cost),
    "sample": (_sample_calls, _sample_cost),
    "conv1d_prefill": (_conv1d_prefill_calls, _conv1d_cost),
    "conv1d_decode": (_conv1d_decode_calls, _conv1d_cost),
    "gated_delta_prefill": (_gated_delta_prefill_calls, _gated_delta_cost),
    "gated_delta_decode": (_gated_delta_decode_calls, _gated_delta_cost),
    "rms_norm_gated": (_rms_norm_gated_calls, _rms_norm_gated_cost),
}
OPS = tuple(_OPS)


def op_calls(op: str, step: Step) -> list[Call]:
    """The calls `step` makes of `op` (none where the step does not run it)."""
    return _OPS[op][0](step)


def call_cost(op: str, args: Sequence[Any]) -> Cost:
    """The roofline of one call of `op` with `args` (see each op's cost function for its formula)."""
    return _OPS[op][1](*args)
