"""The worker processes of a tensor-parallel engine, and rank 0's handle on them.

The engine's process is rank 0: it runs the scheduler, its own shard of the model and the
sampler. Ranks 1..n-1 are processes started here (spawned, never forked: the parent may hold
threads and an OpenMP team). Each loads its shard of the checkpoint, builds its slot cache, then
serves commands from rank 0 until told to stop: a forward (the batch's host-side description; every
rank builds the same ForwardBatch from it), or one of the slot cache's mutators, replayed so that
every rank's cache holds the same slots, prefix copies, snapshots and swaps as rank 0's.

Failure: a worker that raises exits (its traceback on stderr), which closes its connections, so
rank 0's next collective fails at once instead of hanging. A forward that raises on rank 0 leaves
the workers inside a collective rank 0 never reaches, so that ends the group too: rank 0 stops
the workers and fails that forward and every later one with `WorkerError` (the engine must be
rebuilt). Workers die with rank 0 too: they are daemonic, and a collective on a dead rank 0's
connections raises.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import multiprocessing
import multiprocessing.connection
import pickle
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .cache import LayerCacheSpec, SlotCache, StateSnapshot, SwappedSlot
from .kernels import Ops
from .kernels.linear import native_shards
from .models.batch import ForwardBatch
from .parallel.group import TensorParallel, open_store
from .parallel.pipeline import PipelineStage, stage_layers
from .parallel.tree import tree_enabled

if TYPE_CHECKING:
    from .config import EngineArgs

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 600.0  # loading a shard of a large checkpoint
STOP_TIMEOUT_S = 10.0


class WorkerError(RuntimeError):
    """A tensor-parallel worker exited or failed: this engine cannot run forwards any more."""


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank `rank`'s device: CUDA ranks take consecutive GPUs from the engine's; CPU ranks share it."""
    return torch.device("cuda", (device.index or 0) + rank) if device.type == "cuda" else device


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to build its shard (sent to the spawned process)."""

    args: EngineArgs
    rank: int
    size: int
    port: int
    replay: bool  # Gated DeltaNet replay buffers (see LLM._replay_buffers)
    threads: int  # torch threads: rank 0's, so every rank computes as a single process would


def model_tensors(obj: Any, path: str = "model", depth: int = 6) -> list[tuple[str, torch.Tensor]]:
    """Every tensor a model computes with (weights, their shards, RoPE tables), by attribute path,
    in the same order on every rank."""
    if isinstance(obj, torch.Tensor):
        return [(path, obj)]
    if depth == 0:
        return []
    if isinstance(obj, (list, tuple)):
        return [t for i, item in enumerate(obj) for t in model_tensors(item, f"{path}[{i}]", depth - 1)]
    fields = vars(obj) if hasattr(obj, "__dict__") else {}
    return [t for name, value in fields.items() for t in model_tensors(value, f"{path}.{name}", depth - 1)]


def state_names(model: Any) -> list[str]:
    """What `state_digest` hashes, in its order: the implementation of each op, the torch thread
    count, then every tensor of `model_tensors`."""
    return ["ops", "threads"] + [path for path, _ in model_tensors(model)]


def state_digest(model: Any) -> torch.Tensor:
    """One int64 per entry of `state_names`, a hash: gathered from every rank and set against a new
    engine's, it names what changed on which rank (a weight changed in place, another op chosen)."""
    ops = [f"{f.__module__}.{getattr(f, '__qualname__', repr(f))}" for f in vars(model.ops).values()]
    parts = [repr(ops).encode(), str(torch.get_num_threads()).encode()]
    parts += [t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes() for _, t in model_tensors(model)]
    return torch.tensor([int.from_bytes(hashlib.blake2b(part, digest_size=7).digest(), "little") for part in parts],
                        dtype=torch.int64)


def rank_parallel(args: EngineArgs, ops: Ops, rank: int, num_layers: int) -> tuple[TensorParallel, TensorParallel]:
    """(what rank `rank`'s model is built with, the group its process joins): under tensor
    parallelism one object, its shard's; in a pipeline, an unsharded model of its stage's layers,
    whose group is the stages'. The tree's default at one rank follows the kernels (`tree_enabled`)."""
    size, stages = args.tensor_parallel_size, args.pipeline_parallel_size
    native = all(native_shards(linear, args.torch_dtype) for linear in (ops.linear, ops.prefill_linear))
    tree = tree_enabled(args.options.backend.tree_reduction, size, native)
    if stages == 1:
        tp = TensorParallel(rank, size, tree=tree, expert_parallel=args.enable_expert_parallel, shards_in_place=native)
        return tp, tp
    group = TensorParallel(rank, stages)
    stage = PipelineStage(rank, stages, stage_layers(num_layers, rank, stages), group)
    return TensorParallel(0, 1, tree=tree, pipeline=stage, shards_in_place=native), group


def build_rank(args: EngineArgs, rank: int, replay: bool,
               device: torch.device) -> tuple[TensorParallel, Any, SlotCache]:
    """Rank `rank`'s group (not yet connected), its part of the model and its slot cache."""
    from .models import build_model, read_config
    from .op_table import op_table

    if device.type == "cuda":
        torch.cuda.set_device(device)
    ops, cfg = op_table(args), read_config(args.model)
    tp, group = rank_parallel(args, ops, rank, cfg.num_hidden_layers)
    model = build_model(args.model, cfg, ops, args.torch_dtype, device, args.max_seq_len, tp, args.torch_weight_dtype)
    cache = SlotCache(args.max_batch_size, args.max_seq_len, model.cache_specs(), args.torch_dtype, device,
                      replay=replay)
    return group, model, cache


def _worker_main(spec: WorkerSpec, status: multiprocessing.connection.Connection) -> None:
    """A worker process: build, report, join the group, serve. Imports happen here, in the child."""
    try:
        torch.set_num_threads(spec.threads)
        device = rank_device(torch.device(spec.args.device), spec.rank)
        tp, model, cache = build_rank(spec.args, spec.rank, spec.replay, device)
    except BaseException as exc:  # reported to rank 0, which raises it
        status.send(f"{type(exc).__name__}: {exc}")
        return
    status.send(None)
    tp.connect(spec.port, device)
    serve(tp, model, cache, device)


@torch.inference_mode()
def serve(tp: TensorParallel, model: Any, cache: SlotCache, device: torch.device) -> None:
    """Run rank 0's commands until "stop"; an exception ends the process (rank 0 notices)."""
    swaps: dict[int, SwappedSlot] = {}
    snapshot: StateSnapshot | None = None
    while True:
        name, *payload = tp.receive()
        if name == "stop":
            return
        if name == "forward":
            slots, starts, tokens, kinds, sampled, scored, keeps = payload
            cache.clear_kept()
            model.forward(ForwardBatch.build(slots, starts, tokens, kinds, device, sampled, scored, keeps), cache)
        elif name == "snapshot_states":
            snapshot = cache.snapshot_states(*payload)
        elif name == "restore_states":
            cache.restore_states(snapshot)
        elif name == "swap_out":
            handle, slot, length = payload
            swaps[handle] = cache.swap_out(slot, length)
        elif name == "swap_in":
            slot, handle = payload
            cache.swap_in(slot, swaps.pop(handle))
        elif name == "drop_swap":
            swaps.pop(payload[0], None)
        elif name == "digest":
            tp.all_gather(state_digest(model))
        elif name in ("reset", "forget", "save_prefix_state", "copy_prefix", "commit_kept", "restore_kept"):
            getattr(cache, name)(*payload)
        else:
            raise ValueError(f"unknown command {name!r}")


class Workers:
    """Rank 0's handle on ranks 1..n-1: start them (`spawn`) or meet them where torchrun started
    them (`launched`, see `pocketllm.launch`), send them commands, notice and report their end."""

    def __init__(self, size: int, store: Any, port: int = 0) -> None:
        self.size, self.store, self.port = size, store, port
        self.broken: str | None = None
        self.tp: TensorParallel | None = None
        self.processes: list[multiprocessing.process.BaseProcess] = []
        self._status: list[multiprocessing.connection.Connection] = []

    @classmethod
    def spawn(cls, args: EngineArgs, size: int, replay: bool) -> Workers:
        """Start ranks 1..size-1 as processes of this machine, on a store of this process's."""
        store = open_store(size)
        workers = cls(size, store, store.port)
        context = multiprocessing.get_context("spawn")
        for rank in range(1, size):
            receiver, sender = context.Pipe(duplex=False)
            spec = WorkerSpec(args, rank, size, store.port, replay, torch.get_num_threads())
            process = context.Process(target=_worker_main, args=(spec, sender), daemon=True,
                                      name=f"pocketllm-tp-rank{rank}")
            try:
                process.start()  # pickles the spec for the new interpreter
            except (pickle.PicklingError, AttributeError, TypeError) as exc:
                workers.stop()
                raise ValueError(f"tensor_parallel_size={size}: the engine's arguments must reach the worker "
                                 f"processes, and {exc}; pass op_overrides as registered names or "
                                 f"'module:function' paths") from None
            sender.close()
            workers.processes.append(process)
            workers._status.append(receiver)
        return workers

    def connect(self, tp: TensorParallel, device: torch.device) -> None:
        """Wait until every worker has built its shard (raising what one failed with), then join the group."""
        deadline = time.monotonic() + START_TIMEOUT_S
        for rank, (process, status) in enumerate(zip(self.processes, self._status), start=1):
            while not status.poll(0.1):
                if not process.is_alive():
                    raise self._exited_before_reporting(rank, process)
                if time.monotonic() > deadline:
                    self.stop()
                    raise WorkerError(f"tensor-parallel worker {rank} did not load its shard in "
                                      f"{START_TIMEOUT_S:.0f} s")
            try:
                error = status.recv()
            except EOFError:  # it exited between the poll and the read
                raise self._exited_before_reporting(rank, process) from None
            if error is not None:
                self.stop()
                raise WorkerError(f"tensor-parallel worker {rank} failed to load: {error}")
        tp.connect(self.port, device, self.store)
        self.tp = tp

    def _exited_before_reporting(self, rank: int, process: multiprocessing.process.BaseProcess) -> WorkerError:
        """A worker that ended without a word (a load error is reported, so it died importing, or was
        killed): stop the rest; the error says where its traceback is and the usual cause."""
        process.join(STOP_TIMEOUT_S)
        self.stop()
        return WorkerError(f"tensor-parallel worker {rank} exited with code {process.exitcode} while loading (its "
                           f"traceback, if any, is on stderr); workers are spawned, so a script that starts a "
                           f"tensor-parallel engine must do so under `if __name__ == '__main__':`")

    def send(self, message: Sequence[Any]) -> None:
        """Broadcast one command; after a failure, cache commands are dropped (no worker is left to
        keep in step) and a forward raises WorkerError."""
        if self.broken is None:
            assert self.tp is not None
            try:
                self.tp.broadcast(list(message))
                return
            except RuntimeError as exc:
                self.failed(exc)
        if message[0] == "forward":
            raise WorkerError(self.broken or "tensor-parallel workers stopped")

    def digests(self, model: Any) -> list[torch.Tensor]:
        """Every rank's `state_digest` of its model, in rank order (rank 0's from `model`)."""
        self.send(["digest"])
        assert self.tp is not None
        return self.tp.all_gather(state_digest(model))

    def failed(self, exc: BaseException) -> WorkerError:
        """Record that a collective with the workers failed; stop them all. The error to raise."""
        if self.broken is None:
            exits = [f"worker {rank} exited with code {p.exitcode}" for rank, p in enumerate(self.processes, 1)
                     if not p.is_alive()]
            self.broken = (f"tensor-parallel group failed ({'; '.join(exits) or type(exc).__name__}): {exc}")
            logger.error("%s", self.broken)
            self._terminate(wait_s=0.0)  # the others wait inside a collective that will not complete
        return WorkerError(self.broken)

    def stop(self) -> None:
        """Tell the workers to exit and wait for them (killing any that does not); idempotent."""
        if self.broken is None and self.tp is not None:
            with contextlib.suppress(RuntimeError):  # a worker already gone: terminated below
                self.tp.broadcast(["stop"])
        connected = self.tp is not None and self.broken is None
        self.broken = self.broken or "the engine was closed"
        self._terminate(STOP_TIMEOUT_S if connected else 0.0)  # unconnected workers wait for a group
        if self.tp is not None:
            self.tp.close()

    def _terminate(self, wait_s: float) -> None:
        """Give the workers `wait_s` seconds to exit, then kill the ones left."""
        deadline = time.monotonic() + wait_s
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join()
        for status in self._status:
            status.close()
        self._status = []


class ParallelCache(SlotCache):
    """Rank 0's slot cache: its own shard, and every mutation replayed on the workers' caches.

    Each rank holds an equal shard, so sizes that count host memory are rank 0's times the ranks.
    A worker keeps a swapped-out slot's shard under the handle rank 0's copy carries, and the
    latest state snapshot (a forward's `restore_states` only ever undoes the latest)."""

    def __init__(self, num_slots: int, max_seq_len: int, layers: list[LayerCacheSpec], dtype: torch.dtype,
                 device: torch.device | str, replay: bool, workers: Workers) -> None:
        super().__init__(num_slots, max_seq_len, layers, dtype, device, replay)
        self.workers = workers
        self._handles = iter(range(1 << 62))

    def reset(self, slot: int, keep: int = 0) -> None:
        super().reset(slot, keep)
        self.workers.send(["reset", slot, keep])

    def forget(self, slot: int) -> None:
        super().forget(slot)
        self.workers.send(["forget", slot])

    def save_prefix_state(self, slot: int, position: int, end: bool = False) -> None:
        super().save_prefix_state(slot, position, end)
        self.workers.send(["save_prefix_state", slot, position, end])

    def copy_prefix(self, source: int, target: int, length: int) -> None:
        super().copy_prefix(source, target, length)
        self.workers.send(["copy_prefix", source, target, length])

    def commit_kept(self, slot: int, positions: Sequence[int]) -> None:
        super().commit_kept(slot, positions)
        self.workers.send(["commit_kept", slot, list(positions)])

    def restore_kept(self, slot: int, position: int) -> None:
        super().restore_kept(slot, position)
        self.workers.send(["restore_kept", slot, position])

    def swap_bytes(self, length: int) -> int:
        return super().swap_bytes(length) * self.workers.size

    def swap_out(self, slot: int, length: int) -> SwappedSlot:
        local = super().swap_out(slot, length)
        handle = next(self._handles)
        self.workers.send(["swap_out", handle, slot, length])
        return ShardedSwap(local.length, local.kv, local.states, handle, self.workers.size)

    def swap_in(self, slot: int, swapped: SwappedSlot) -> None:
        assert isinstance(swapped, ShardedSwap)
        super().swap_in(slot, swapped)
        self.workers.send(["swap_in", slot, swapped.handle])

    def drop_swap(self, swapped: SwappedSlot) -> None:
        assert isinstance(swapped, ShardedSwap)
        self.workers.send(["drop_swap", swapped.handle])

    @property
    def prefix_state_nbytes(self) -> int:
        return super().prefix_state_nbytes * self.workers.size

    def snapshot_states(self, slots: list[int], starts: list[int]) -> StateSnapshot | None:
        snapshot = super().snapshot_states(slots, starts)
        if snapshot is not None:
            self.workers.send(["snapshot_states", slots, starts])
        return snapshot

    def restore_states(self, snapshot: StateSnapshot | None) -> None:
        super().restore_states(snapshot)
        if snapshot is not None:
            self.workers.send(["restore_states"])


@dataclass(frozen=True)
class ShardedSwap(SwappedSlot):
    """Rank 0's shard of a swapped-out slot; the workers hold theirs under `handle`."""

    handle: int = 0
    ranks: int = 1

    @property
    def nbytes(self) -> int:
        return super().nbytes * self.ranks
