"""Ranks started by torchrun: one engine over processes on one host or several, with the bits of one.

Every rank runs the same program under torchrun, N processes in all: a script that builds
`LLM(EngineArgs(..., tensor_parallel_size=N))`, or `pocketllm serve ... --tensor-parallel-size N`.
On each host:

    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint HOST:29400 \\
        -m pocketllm serve --model DIR --tensor-parallel-size 4

Rank 0 runs the engine (the scheduler, its shard, the sampler, the server). On every other rank
the `LLM(...)` call builds that rank's shard, serves rank 0's commands, and ends the process
(exit status 0) when rank 0 closes the engine. The ranks meet through torch.distributed's own
rendezvous (`env://`: the store torchrun's agent holds); each engine's groups live under a prefix
of their own on that store, never in the default group. A rank that fails ends its process;
torchrun then stops the others, and a rank that is alive but stuck is bounded by the groups'
timeout (`parallel.group.TIMEOUT`).
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, NoReturn

import torch
import torch.distributed as dist

from .parallel.group import TIMEOUT
from .workers import Workers, build_rank, serve

if TYPE_CHECKING:
    from .config import EngineArgs

_ENGINES = itertools.count()  # every rank builds its engines in the same order: their store prefixes agree


@dataclass(frozen=True)
class LaunchedRank:
    """This process's place among the ranks torchrun started."""

    rank: int
    size: int
    local_rank: int  # its place on this host (its GPU, on CUDA)
    local_size: int  # ranks on this host


def launched_rank(size: int) -> LaunchedRank | None:
    """Where torchrun put this process, for an engine of `size` ranks; None outside torchrun (no
    TORCHELASTIC_RUN_ID in the environment) or for a one-process engine. ValueError when torchrun
    started another number of processes than the engine has ranks."""
    if size == 1 or "TORCHELASTIC_RUN_ID" not in os.environ:
        return None
    world = int(os.environ["WORLD_SIZE"])
    if world != size:
        raise ValueError(f"tensor_parallel_size={size}, but torchrun started {world} processes (WORLD_SIZE): "
                         f"every process is one rank of the engine, so they must be equal")
    return LaunchedRank(int(os.environ["RANK"]), world, int(os.environ.get("LOCAL_RANK", "0")),
                        int(os.environ.get("LOCAL_WORLD_SIZE", str(world))))


def rank_device(device: torch.device, launched: LaunchedRank) -> torch.device:
    """A launched rank's device: its host's GPU `local_rank` on CUDA; CPU ranks share the CPU."""
    return torch.device("cuda", launched.local_rank) if device.type == "cuda" else device


def _store() -> dist.Store:
    """This engine's part of the rendezvous store torchrun's ranks share."""
    store, _, _ = next(dist.rendezvous("env://", timeout=TIMEOUT))
    return dist.PrefixStore(f"pocketllm/engine{next(_ENGINES)}/", store)


def launched_workers(launched: LaunchedRank) -> Workers:
    """Rank 0's handle on the other launched ranks (nothing to start: torchrun did)."""
    return Workers(launched.size, _store())


def serve_launched_rank(args: EngineArgs, launched: LaunchedRank, replay: bool) -> NoReturn:
    """A launched rank other than 0: build its shard, join the engine's groups, serve rank 0 until
    it stops the engine, then end the process."""
    device = rank_device(torch.device(args.device), launched)
    tp, model, cache = build_rank(args, launched.rank, replay, device)
    tp.connect(0, device, _store())
    serve(tp, model, cache, device)
    tp.close()
    raise SystemExit(0)
