"""The process group a tensor-parallel engine's ranks talk through, and the one for a single process.

`torch.distributed` process groups built as objects (a `TCPStore` per engine and a Gloo or NCCL
group on it), never the global default group: two engines in one process each have their own, and
nothing is left initialised when an engine closes. Gloo carries the commands on every device (JSON,
never pickle); the collectives run on the group of the device (NCCL for CUDA tensors).
"""

from __future__ import annotations

import datetime
import json
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from .pipeline import PipelineStage

# How long a collective waits for the other ranks. A rank that dies is noticed at once (its
# connections close); this bounds only a rank that is alive but stuck.
TIMEOUT = datetime.timedelta(minutes=10)


class TensorParallel:
    """This process's place among the ranks, and the collectives the model layers call.

    `size == 1` needs no group: every collective is the identity. `tree`: row-parallel products are
    summed over fixed K shards in one binary tree (see `parallel/tree.py`); otherwise one product
    per rank and a plain all-reduce, whose order is the library's. `expert_parallel`: a mixture of
    experts' layers hold whole experts, a block of them per rank, rather than a block of every
    expert's intermediate features (see `models/experts.py`). `shards_in_place`: the linear kernel
    reads the tree's shards as column slices of one matrix (the C++ kernels), so the layers keep
    them as views of it; other kernels get each shard as a matrix of its own (aligned, contiguous).
    """

    def __init__(self, rank: int = 0, size: int = 1, tree: bool = False, expert_parallel: bool = False,
                 pipeline: PipelineStage | None = None, shards_in_place: bool = False) -> None:
        self.rank, self.size, self.tree, self.expert_parallel = rank, size, tree, expert_parallel
        self.shards_in_place = shards_in_place
        self.pipeline = pipeline  # the pipeline stage this process runs (None: every layer)
        self.sent_bytes = 0  # what this rank put into collectives (its own tensor, once per call)
        self._group: Any = None
        self._commands: Any = None

    def connect(self, port: int, device: torch.device, store: dist.Store | None = None) -> None:
        """Join the engine's ranks (blocks until all have): commands on Gloo, collectives on the
        device's group. Rank 0 passes the store it opened, a launched rank the rendezvous store
        (`pocketllm.launch`); spawned workers reach rank 0's by `port`."""
        if store is None:
            store = dist.TCPStore("127.0.0.1", port, self.size, is_master=False, timeout=TIMEOUT)
        self._commands = dist.ProcessGroupGloo(dist.PrefixStore("commands/", store), self.rank, self.size, TIMEOUT)
        prefix = dist.PrefixStore("collectives/", store)
        if device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = TIMEOUT
            self._group = dist.ProcessGroupNCCL(prefix, self.rank, self.size, options)
        else:
            self._group = dist.ProcessGroupGloo(prefix, self.rank, self.size, TIMEOUT)

    def close(self) -> None:
        """Let go of the groups now (their threads end here), not at interpreter exit, where a
        group's destructor can abort the process."""
        self._group = self._commands = None

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `tensor` (same shape everywhere), in rank order."""
        if self.size == 1:
            return [tensor]
        tensor = tensor.contiguous()
        self.sent_bytes += tensor.numel() * tensor.element_size()
        out = [torch.empty_like(tensor) for _ in range(self.size)]
        self._group.allgather([out], [tensor]).wait()
        return out

    def send(self, tensor: torch.Tensor, rank: int) -> None:
        """`tensor` to rank `rank` (which receives it with `recv`)."""
        tensor = tensor.contiguous()
        self.sent_bytes += tensor.numel() * tensor.element_size()
        self._group.send([tensor], rank, 0).wait()

    def recv(self, into: torch.Tensor, rank: int) -> torch.Tensor:
        """`into`, filled with what rank `rank` sends."""
        self._group.recv([into], rank, 0).wait()
        return into

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The sum over ranks in the library's own order (the tree's negative control)."""
        if self.size == 1:
            return tensor
        tensor = tensor.contiguous()
        self.sent_bytes += tensor.numel() * tensor.element_size()
        self._group.allreduce([tensor]).wait()
        return tensor

    def broadcast(self, message: Any) -> None:
        """Rank 0: send a JSON-able message to every other rank (on Gloo: host tensors)."""
        data = torch.frombuffer(bytearray(json.dumps(message).encode()), dtype=torch.uint8)
        self._commands.broadcast(torch.tensor([data.numel()], dtype=torch.int64), 0).wait()
        self._commands.broadcast(data, 0).wait()

    def receive(self) -> Any:
        """Another rank: the next message rank 0 broadcasts."""
        length = torch.zeros(1, dtype=torch.int64)
        self._commands.broadcast(length, 0).wait()
        data = torch.empty(int(length.item()), dtype=torch.uint8)
        self._commands.broadcast(data, 0).wait()
        return json.loads(bytes(data.numpy()).decode())


SINGLE = TensorParallel()


def open_store(size: int, port: int = 0) -> dist.TCPStore:
    """Rank 0's store on a free local port (`store.port`), for `size` ranks."""
    return dist.TCPStore("127.0.0.1", port, size, is_master=True, timeout=TIMEOUT, wait_for_workers=False)
