"""Pipeline parallelism's primitives: which layers a stage holds, and how a step's activations pass
from stage to stage.

With `pipeline_parallel_size` = n the decoder's layers are cut into n consecutive blocks, one per
process (rank r holds block r); every stage also holds the embedding, the final norm and the
lm_head, which are small against a large model's layers. A forward runs stage after stage: rank 0
embeds the batch and runs its layers, each stage sends its last hidden rows to the next, and the
last stage computes the logits and sends them back to rank 0, which samples. One activation per
step crosses each boundary (vLLM's reason to prefer pipeline over tensor parallelism across
hosts), and every layer computes what it computes in one process: the bits are one process's by
construction. (No micro-batches: one step is in flight at a time, so the stages take turns.)
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from ..config import ModelConfig
from .group import TensorParallel
from .shard import NOT_HELD, ShardPlan, TensorShard

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def stage_layers(num_layers: int, index: int, count: int) -> range:
    """Stage `index` of `count`'s layers: consecutive, the earlier stages one more where they do not divide."""
    per, extra = divmod(num_layers, count)
    start = index * per + min(index, extra)
    return range(start, start + per + (index < extra))


@dataclass(frozen=True)
class PipelineStage:
    """This process's stage: its index among `count`, its layers, and the ranks' group (rank = index)."""

    index: int
    count: int
    layers: range
    group: TensorParallel

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.count - 1

    def receive(self, rows: int, width: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The previous stage's hidden rows [rows, width]."""
        return self.group.recv(torch.empty(rows, width, dtype=dtype, device=device), self.index - 1)

    def send(self, hidden: torch.Tensor) -> None:
        """This stage's hidden rows, to the next stage."""
        self.group.send(hidden, self.index + 1)

    def logits_to_first(self, logits: torch.Tensor) -> None:
        """The last stage's logits, to rank 0 (which samples)."""
        if not self.first:
            self.group.send(logits, 0)

    def logits_from_last(self, rows: int, vocab: int, device: torch.device) -> torch.Tensor:
        """Rank 0: the last stage's fp32 logits [rows, vocab]."""
        return self.group.recv(torch.empty(rows, vocab, dtype=torch.float32, device=device), self.count - 1)


def check_pipeline(cfg: ModelConfig, size: int, tensor_parallel_size: int) -> None:
    """ValueError naming the field when `size` stages cannot share `cfg`'s layers, or with tensor parallelism."""
    if size > 1 and tensor_parallel_size > 1:
        raise ValueError(f"pipeline_parallel_size={size} with tensor_parallel_size={tensor_parallel_size}: "
                         f"one of the two at a time, for now")
    if size > cfg.num_hidden_layers:
        raise ValueError(f"pipeline_parallel_size={size} is more stages than num_hidden_layers="
                         f"{cfg.num_hidden_layers}")


def pipeline_plan(stage: PipelineStage) -> ShardPlan:
    """What a stage reads: the tensors of its own layers and those outside every layer, whole."""
    def plan(name: str, shape: tuple[int, ...]) -> TensorShard | None:
        match = _LAYER.search(name)
        return NOT_HELD if match is not None and int(match.group(1)) not in stage.layers else None

    return plan
