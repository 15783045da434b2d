"""The mixture-of-experts feed-forward half of a block, shared by the MoE families (Qwen3-MoE,
Qwen3.5-MoE), and the two checkpoint layouts of its experts.

`SparseMoe` (a `layers.FeedForward`): router logits through `ops.linear`, routing by
`kernels.moe_routing.route` (softmax in fp32, top-k with ties broken by the lower expert index, optionally
renormalised), the experts through the op `moe` (contributions summed in rank order, see
`kernels/moe.py`; split over tensor-parallel ranks as `experts.py` says), plus, where the config
has one, the shared expert, a SwiGLU scaled by sigmoid(shared_expert_gate(x)) and added after the
routed experts, as transformers adds it.

Checkpoint layouts of a sparse layer's experts (the loader takes either, layer by layer):
- fused, as transformers 5 holds them: `mlp.experts.gate_up_proj` [E, 2I, H] (each expert's gate
  rows, then its up rows) and `mlp.experts.down_proj` [E, H, I];
- per expert, as the published Qwen3-MoE / Qwen3.5-MoE checkpoints store them:
  `mlp.experts.{e}.gate_proj.weight` [I, H], `.up_proj.weight` [I, H], `.down_proj.weight` [H, I],
  stacked at load time into the fused tensors (transformers' own conversion does the same).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open

from ..config import ModelConfig
from ..kernels import Ops
from ..kernels.moe_routing import route
from ..kernels.pointwise import elementwise_invariant
from ..parallel.group import SINGLE, TensorParallel
from .experts import Experts
from .family import InitWeight, Matrices
from .layers import FeedForward, Shapes, SwiGLU, Weights
from .loader import checkpoint_files

FUSED_GATE_UP, FUSED_DOWN = "experts.gate_up_proj", "experts.down_proj"
PER_EXPERT = ("gate_proj", "up_proj", "down_proj")


def layer_index(prefix: str) -> int:
    """The layer number of a block prefix "...layers.{i}."."""
    return int(prefix.rstrip(".").rsplit(".", 1)[1])


def shared_cfg(cfg: ModelConfig) -> ModelConfig:
    """The shared expert's SwiGLU sizes: intermediate_size is shared_expert_intermediate_size."""
    return dataclasses.replace(cfg, intermediate_size=cfg.shared_expert_intermediate_size)


class SparseMoe:
    """Router, experts (fused [E, 2I, H] / [E, H, I]) and an optional gated shared expert."""

    def __init__(self, cfg: ModelConfig, w: Weights, prefix: str, tp: TensorParallel = SINGLE) -> None:
        self.top_k, self.normalize = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.router = w[prefix + "gate.weight"]
        self.experts = Experts(w[prefix + FUSED_GATE_UP], w[prefix + FUSED_DOWN], tp)
        self.shared: SwiGLU | None = None
        self.shared_gate: torch.Tensor | None = None
        if cfg.shared_expert_intermediate_size:
            self.shared = SwiGLU(w, prefix + "shared_expert.", tp)
            self.shared_gate = w[prefix + "shared_expert_gate.weight"]

    @staticmethod
    def weight_shapes(cfg: ModelConfig, prefix: str) -> Shapes:
        """The fused layout's tensors (see `checkpoint_layout` for the per-expert one)."""
        experts, hidden, inter = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        shapes: Shapes = {prefix + "gate.weight": (experts, hidden),
                          prefix + FUSED_GATE_UP: (experts, 2 * inter, hidden),
                          prefix + FUSED_DOWN: (experts, hidden, inter)}
        if cfg.shared_expert_intermediate_size:
            shapes.update(SwiGLU.weight_shapes(shared_cfg(cfg), prefix + "shared_expert."))
            shapes[prefix + "shared_expert_gate.weight"] = (1, hidden)
        return shapes

    @staticmethod
    def matrices(cfg: ModelConfig) -> Matrices:
        """(name, in, out) of what goes through `ops.linear`: the router, the shared expert and its
        gate (the experts go through the op `moe`)."""
        found: Matrices = [("router", cfg.hidden_size, cfg.num_experts)]
        if cfg.shared_expert_intermediate_size:
            found += [("shared " + name, i, o) for name, i, o in SwiGLU.matrices(shared_cfg(cfg))]
            found.append(("shared gate", cfg.hidden_size, 1))
        return found

    def linear_weights(self) -> tuple[torch.Tensor, ...]:
        """The router and shared expert matrices (through `ops.linear`), then each expert's two
        matrices, which the op `moe` multiplies row by row as the linear layers do (for the
        start-up probe's shapes and alignments, and parameter counts)."""
        shared = () if self.shared is None or self.shared_gate is None else (*self.shared.linear_weights(),
                                                                              self.shared_gate)
        return (self.router, *shared, *self.experts.matrices())

    def forward(self, ops: Ops, x: torch.Tensor) -> torch.Tensor:
        topk_ids, topk_weights = route(ops.linear(x, self.router), self.top_k, self.normalize)
        out = self.experts.forward(ops, x, topk_ids, topk_weights)
        if self.shared is not None and self.shared_gate is not None:
            gate = elementwise_invariant(torch.sigmoid, ops.linear(x, self.shared_gate))
            out = out + gate * self.shared.forward(ops, x)
        return out


def layer_mlp(cfg: ModelConfig, w: Weights, prefix: str, tp: TensorParallel) -> FeedForward:
    """Layer `prefix`'s feed-forward half where some layers may be dense (Qwen3-MoE, Qwen3-Next): the
    mixture of experts on a sparse layer (`ModelConfig.sparse_layer`), else the dense SwiGLU."""
    if cfg.sparse_layer(layer_index(prefix)):
        return SparseMoe(cfg, w, prefix + "mlp.", tp)
    return SwiGLU(w, prefix + "mlp.", tp)


def mlp_matrices(cfg: ModelConfig) -> Matrices:
    """The matrices of `layer_mlp`'s layers: the dense SwiGLU's where some layer is dense, the MoE's."""
    dense = any(not cfg.sparse_layer(i) for i in range(cfg.num_hidden_layers))
    return (SwiGLU.matrices(cfg) if dense else []) + SparseMoe.matrices(cfg)


def sparse_mlp_shapes(cfg: ModelConfig, shapes: Shapes, prefix: str) -> Shapes:
    """`shapes` (a dense family's, every layer with a SwiGLU) with each sparse layer's MLP replaced
    by the mixture of experts; `prefix` is where the layers live ("model.", ...)."""
    out = dict(shapes)
    for i in range(cfg.num_hidden_layers):
        if cfg.sparse_layer(i):
            mlp = f"{prefix}layers.{i}.mlp."
            out = {name: shape for name, shape in out.items() if not name.startswith(mlp)}
            out.update(SparseMoe.weight_shapes(cfg, mlp))
    return out


def _tensor_names(path: Path) -> set[str]:
    """The tensor names of the checkpoint at `path`; none where it cannot be read (the loader then
    says what is wrong with it)."""
    names: set[str] = set()
    try:
        for file in checkpoint_files(path):
            with safe_open(str(file), framework="pt", device="cpu") as handle:
                names.update(handle.keys())
    except Exception:  # noqa: BLE001 (load_weights reports it, naming the file)
        return set()
    return names


def checkpoint_layout(cfg: ModelConfig, path: Path,
                      expected: Shapes) -> tuple[Shapes, Callable[[Weights], Weights]]:
    """(what to load, how to fuse it): each sparse layer whose checkpoint holds expert 0 in the
    per-expert layout loads every expert's three matrices, stacked afterwards into the fused
    tensors; the other layers load as `expected` says."""
    names = _tensor_names(path)
    to_load = dict(expected)
    per_expert: list[str] = []
    for gate_up in [name for name in expected if name.endswith(FUSED_GATE_UP)]:
        mlp = gate_up[:-len(FUSED_GATE_UP)]
        if gate_up in names or f"{mlp}experts.0.gate_proj.weight" not in names:
            continue
        per_expert.append(mlp)
        experts, inter2, hidden = expected[gate_up]
        del to_load[gate_up], to_load[mlp + FUSED_DOWN]
        for e in range(experts):
            for matrix in PER_EXPERT:
                shape = (hidden, inter2 // 2) if matrix == "down_proj" else (inter2 // 2, hidden)
                to_load[f"{mlp}experts.{e}.{matrix}.weight"] = shape

    def fuse(weights: Weights) -> Weights:  # the experts loaded (an expert-parallel rank's), in order
        for mlp in per_expert:
            experts = [e for e in range(expected[mlp + FUSED_GATE_UP][0])
                       if f"{mlp}experts.{e}.down_proj.weight" in weights]
            if not experts:  # another pipeline stage's layer
                continue
            parts = [[weights.pop(f"{mlp}experts.{e}.{matrix}.weight") for matrix in PER_EXPERT] for e in experts]
            weights[mlp + FUSED_GATE_UP] = torch.stack([torch.cat([gate, up]) for gate, up, _ in parts])
            weights[mlp + FUSED_DOWN] = torch.stack([down for _, _, down in parts])
        return weights

    return to_load, fuse


# Random checkpoints: a router decisive enough that routing is not a near tie everywhere (logits of
# a normalised row have standard deviation 0.2 * sqrt(hidden)), and experts whose output shows.
ROUTER_STD, EXPERT_STD = 0.2, 0.1


def moe_init(base: InitWeight) -> InitWeight:
    """`base` (a family's init_weight), with the router's and the experts' values of this module."""
    def init(name: str, noise: torch.Tensor, generator: torch.Generator) -> torch.Tensor | None:
        if name.endswith("mlp.gate.weight"):
            return ROUTER_STD * noise
        if name.endswith((FUSED_GATE_UP, FUSED_DOWN)):
            return EXPERT_STD * noise
        return base(name, noise, generator)

    return init


def split_experts(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Fused expert tensors rewritten in the per-expert layout (for writing such checkpoints)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        if name.endswith(FUSED_GATE_UP):
            mlp, inter = name[:-len(FUSED_GATE_UP)], tensor.shape[1] // 2
            for e, expert in enumerate(tensor):
                out[f"{mlp}experts.{e}.gate_proj.weight"] = expert[:inter].clone()
                out[f"{mlp}experts.{e}.up_proj.weight"] = expert[inter:].clone()
        elif name.endswith(FUSED_DOWN):
            mlp = name[:-len(FUSED_DOWN)]
            for e, expert in enumerate(tensor):
                out[f"{mlp}experts.{e}.down_proj.weight"] = expert.clone()
        else:
            out[name] = tensor
    return out
