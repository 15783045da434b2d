"""SlotCache: a fixed set of slots, each owning one request's cached state.

A slotted cache is a block table with one block per request: a request owns one slot from
admission to completion and kernels need no per-token index loads.
- Full-attention layers: K and V [num_slots, max_seq_len, num_kv_heads, head_dim]; a token's K/V
  live at [slot, position].
- Gated DeltaNet layers: a conv state [num_slots, conv_dim, conv_width - 1] (the last inputs of the
  causal conv) and an fp32 recurrent state [num_slots, heads, key_dim, value_dim]. Both are zeroed
  when a slot is reset for a new tenant, so a slot's previous tenant never leaks into the next.
  With exact positions (`replay=True`) each also has a replay buffer [num_slots, CHUNK_SIZE, width]
  fp32: the raw inputs since the last chunk boundary, which the recurrent state stays at (exact
  replay, see `kernels/_gated_delta.py`). It is swapped and snapshotted with the states, and kept
  in a prefix state copy only off the chunk grid (on it, a chunk has no replayed rows).
Prefix reuse (see `scheduler/prefix_index.py`) resets a slot keeping its first `keep` positions,
or copies a prefix from another slot. K/V of a prefix are complete as they stand; a Gated
DeltaNet layer also needs its states as they were after the prefix, so the scheduler keeps
`prefix_states`: copies of a slot's conv and recurrent state at positions of its snapshot grid, and
with exact positions one more, off the grid, where its last tenant ended (a chat's next turn
resumes there). A slot keeps at most one copy off the chunk grid, so the copies' memory has a
bound known before the cache is built (`LLM.capabilities.state_snapshot_bytes_per_slot`).
The cache holds tensors only: these are primitives. Which slots are free, which request holds
which slot, what a freed slot holds, and when contents may be reused, swapped or must be
forgotten, is decided in one place, `scheduler/slots.py`.

`cache_bytes` sizes a cache before anything is allocated, so that the engine refuses a cache
larger than the memory the device has free (`require_memory`) before it reads any weight,
instead of failing deep inside the allocator.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import ModelConfig
from .kernels._gated_delta import CHUNK_SIZE


class SlotCacheError(RuntimeError):
    """The one error slot misuse raises: no free slot, a slot that is not free or not allocated
    (the SlotManager's bookkeeping), or a state copy that is missing (the cache's tensors)."""


@dataclass(frozen=True)
class AttentionCacheSpec:
    num_kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class RecurrentCacheSpec:
    conv_dim: int
    conv_width: int
    num_heads: int
    key_dim: int
    value_dim: int

    @property
    def replay_width(self) -> int:
        """fp32 values per position of the replay buffer: raw k (all key heads), v, g and beta."""
        values = self.num_heads * self.value_dim
        return (self.conv_dim - values) // 2 + values + 2 * self.num_heads


LayerCacheSpec = AttentionCacheSpec | RecurrentCacheSpec


def attention_spec(cfg: ModelConfig) -> AttentionCacheSpec:
    """K/V per slot of a full-attention layer."""
    return AttentionCacheSpec(cfg.num_key_value_heads, cfg.head_dim)


def cache_bytes(num_slots: int, max_seq_len: int, layers: list[LayerCacheSpec], dtype: torch.dtype,
                replay: bool = False) -> int:
    """Bytes the slot tensors of these layers take, replay buffers too with `replay` (Python ints:
    no overflow for absurd sizes)."""
    item = torch.empty((), dtype=dtype).element_size()
    total = 0
    for spec in layers:
        if isinstance(spec, AttentionCacheSpec):
            total += 2 * num_slots * max_seq_len * spec.num_kv_heads * spec.head_dim * item
        else:
            total += num_slots * spec.conv_dim * (spec.conv_width - 1) * item
            total += num_slots * spec.num_heads * spec.key_dim * spec.value_dim * 4
            total += num_slots * CHUNK_SIZE * spec.replay_width * 4 if replay else 0
    return total


def available_bytes(device: torch.device | str) -> int | None:
    """Memory free for new tensors on `device` (host: MemAvailable), or None when unknown."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "cpu":
        meminfo = Path("/proc/meminfo")
        if meminfo.is_file():
            for line in meminfo.read_text().splitlines():
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    return None


def require_memory(needed: int, device: torch.device | str, what: str) -> None:
    """ValueError when `needed` bytes exceed what `device` has available; `what` says what needs them."""
    available = available_bytes(device)
    if available is not None and needed > available:
        raise ValueError(f"{what} needs {needed} bytes ({_gib(needed)}) but {torch.device(device)} has {available} "
                         f"bytes ({_gib(available)}) available; lower max_seq_len or max_batch_size")


def _gib(nbytes: int) -> str:
    """Integer arithmetic: the sizes of absurd configurations do not fit in a float."""
    return f"{nbytes // 2**30}.{nbytes % 2**30 * 100 // 2**30:02d} GiB"


@dataclass(frozen=True)
class SwappedSlot:
    """A slot's contents in host memory (pinned on CUDA): K/V rows [0, length) of each attention
    layer (None for other layers) and every recurrent state, copied bit for bit."""

    length: int
    kv: list[tuple[torch.Tensor, torch.Tensor] | None]
    states: list[torch.Tensor]

    @property
    def nbytes(self) -> int:
        tensors = [t for pair in self.kv if pair is not None for t in pair] + self.states
        return sum(t.numel() * t.element_size() for t in tensors)


@dataclass(frozen=True)
class StateSnapshot:
    """Recurrent states of some slots, copied before a forward (see SlotCache.snapshot_states)."""

    copied_slots: torch.Tensor  # [n] int64
    copies: list[torch.Tensor]  # per state tensor, its rows for copied_slots
    fresh_slots: torch.Tensor  # [m] int64: slots whose states were zero (nothing cached yet)


class SlotCache:
    """Per-layer slot tensors (None where a layer has no such state) and the copies of their
    states; the bookkeeping of who holds a slot lives in the SlotManager."""

    def __init__(self, num_slots: int, max_seq_len: int, layers: list[LayerCacheSpec], dtype: torch.dtype,
                 device: torch.device | str = "cpu", replay: bool = False) -> None:
        self.num_slots = num_slots
        self.max_seq_len = max_seq_len
        self.device = torch.device(device)
        self.nbytes = cache_bytes(num_slots, max_seq_len, layers, dtype, replay)
        self.k: list[torch.Tensor | None] = []
        self.v: list[torch.Tensor | None] = []
        self.conv: list[torch.Tensor | None] = []
        self.recurrent: list[torch.Tensor | None] = []
        self.replay: list[torch.Tensor | None] = []
        for spec in layers:
            if isinstance(spec, AttentionCacheSpec):
                kv_shape = (num_slots, max_seq_len, spec.num_kv_heads, spec.head_dim)
                self.k.append(torch.zeros(kv_shape, dtype=dtype, device=device))
                self.v.append(torch.zeros(kv_shape, dtype=dtype, device=device))
                self.conv.append(None)
                self.recurrent.append(None)
                self.replay.append(None)
            else:
                self.k.append(None)
                self.v.append(None)
                self.conv.append(torch.zeros(num_slots, spec.conv_dim, spec.conv_width - 1, dtype=dtype, device=device))
                self.recurrent.append(torch.zeros(
                    num_slots, spec.num_heads, spec.key_dim, spec.value_dim, dtype=torch.float32, device=device))
                self.replay.append(torch.zeros(num_slots, CHUNK_SIZE, spec.replay_width, dtype=torch.float32,
                                               device=device) if replay else None)
        # Per slot: position -> copies of its states (one per layer with states) after that many tokens.
        self.prefix_states: list[dict[int, list[torch.Tensor]]] = [{} for _ in range(num_slots)]
        self.end_copy: list[int | None] = [None] * num_slots  # per slot: the position of its `end` copy
        # States a forward kept inside its prefill pieces, (slot, position) -> a copy being filled
        # layer by layer (`keep_state`), until the scheduler commits it (`commit_kept`).
        self.kept: dict[tuple[int, int], list[torch.Tensor | None]] = {}
        self._state_layers = [i for i, c in enumerate(self.conv) if c is not None]  # layers with states, in order
        self.prefix_state_bytes = sum(s[0].numel() * s.element_size() for s in self._states())  # one copy

    @property
    def has_states(self) -> bool:
        """Whether some layer keeps recurrent state (a hybrid model)."""
        return bool(self._states())

    def _states(self) -> list[torch.Tensor]:
        """What a prefix state copy holds: conv and recurrent states."""
        return [s for s in self.conv + self.recurrent if s is not None]

    def _slot_states(self) -> list[torch.Tensor]:
        """Everything a slot holds besides K/V: its states and replay buffers (swap, snapshots)."""
        return self._states() + [r for r in self.replay if r is not None]

    def reset(self, slot: int, keep: int = 0) -> None:
        """Ready a slot for a new tenant. Its first `keep` positions stay as they are (a reused
        prefix: the recurrent states are set to their copy at `keep`, which must exist, else
        SlotCacheError before anything changes); with keep=0 its states are zeroed, so the previous
        tenant's state never leaks into the next."""
        if keep and self.has_states and keep not in self.prefix_states[slot]:
            raise SlotCacheError(f"slot {slot} has no state copy at position {keep} to resume from")
        self._set_states(slot, slot, keep)

    def forget(self, slot: int) -> None:
        """Drop a slot's state copies: its contents are no longer trusted (a failed forward)."""
        self.prefix_states[slot] = {}
        self.end_copy[slot] = None

    def save_prefix_state(self, slot: int, position: int, end: bool = False) -> None:
        """Keep a copy of the slot's states as they are with `position` tokens cached (off the chunk
        grid with the replay buffers too). `end`: where the slot's tenant ended; it replaces the
        slot's previous such copy, so a slot keeps at most one besides its snapshot grid (the copies'
        memory bound)."""
        if not self.has_states:
            return
        copies = self.prefix_states[slot]
        if end:
            if position in copies:  # a snapshot position
                return
            previous, self.end_copy[slot] = self.end_copy[slot], position
            if previous is not None:
                del copies[previous]
        states = self._slot_states() if position % CHUNK_SIZE else self._states()
        copies[position] = [s[slot].clone() for s in states]

    def keep_state(self, slot: int, position: int, layer: int, kind: str) -> None:
        """Copy layer `layer`'s conv or recurrent state (`kind`) of `slot`, as it is with `position`
        positions cached, into the copy kept at that position (called inside a forward, between the
        pieces of a split recurrent op: models/rounds.py)."""
        index = self._state_layers.index(layer) + (len(self._state_layers) if kind == "recurrent" else 0)
        state = (self.conv if kind == "conv" else self.recurrent)[layer]
        assert state is not None, f"layer {layer} keeps no {kind} state"
        self.kept.setdefault((slot, position), [None] * len(self._states()))[index] = state[slot].clone()

    def commit_kept(self, slot: int, positions: Sequence[int]) -> None:
        """The states the last forward kept for `slot` at `positions` become its state copies there."""
        for position in positions:
            copy = self.kept.pop((slot, position))
            assert all(t is not None for t in copy), f"slot {slot}: a layer kept no state at {position}"
            self.prefix_states[slot][position] = [t for t in copy if t is not None]

    def restore_kept(self, slot: int, position: int) -> None:
        """Set `slot`'s conv and recurrent states to the copy the last forward kept at `position`
        (a verify piece's accepted end); its replay rows stay, being the same tokens' up to there."""
        copy = self.kept[(slot, position)]
        for state, kept in zip(self._states(), copy):
            assert kept is not None, f"slot {slot}: a layer kept no state at {position}"
            state[slot].copy_(kept)

    def clear_kept(self) -> None:
        """Drop what a forward kept and nobody committed (a failed forward's)."""
        self.kept.clear()

    def resume_point(self, slot: int, length: int) -> int:
        """The longest prefix of at most `length` positions slot `slot` can be resumed from: `length`
        for a model without recurrent states, else the furthest position with a state copy (0: none)."""
        if not self.has_states:
            return length
        return max((p for p in self.prefix_states[slot] if p <= length), default=0)

    def copy_prefix(self, source: int, target: int, length: int) -> None:
        """Give slot `target` the first `length` positions of slot `source`: K/V rows copied bit for
        bit, and the states (and state copies up to `length`) of `source` at `length`."""
        if self.has_states and length not in self.prefix_states[source]:
            raise SlotCacheError(f"slot {source} has no state copy at position {length} to copy")
        for cache in self.k + self.v:
            if cache is not None:
                cache[target, :length] = cache[source, :length]
        self._set_states(source, target, length)

    def _set_states(self, source: int, target: int, length: int) -> None:
        """Slot `target`'s states := `source`'s copy at `length` (zero for 0); its copies beyond
        `length` are dropped and `source`'s copies up to `length` shared (they are never written)."""
        kept = {p: c for p, c in self.prefix_states[source].items() if p <= length} if length else {}
        self.prefix_states[target] = kept
        end = self.end_copy[source]
        self.end_copy[target] = end if end is not None and end in kept else None
        if not length:
            for state in self._slot_states():
                state[target].zero_()
            return
        # A copy on the chunk grid holds no replay buffers: no row of them is read there.
        for state, copy in zip(self._slot_states(), kept[length] if self.has_states else []):
            state[target].copy_(copy)

    def swap_bytes(self, length: int) -> int:
        """Host bytes a slot with `length` positions takes once swapped out."""
        rows = sum(t[0, 0].numel() * t.element_size() for t in self.k + self.v if t is not None)
        return rows * length + sum(s[0].numel() * s.element_size() for s in self._slot_states())

    def swap_out(self, slot: int, length: int) -> SwappedSlot:
        """Copy slot `slot`'s first `length` positions and its states to host memory (the slot stays
        allocated: free it once the copy is taken)."""
        pin = self.device.type == "cuda"

        def host(t: torch.Tensor) -> torch.Tensor:
            copy = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
            copy.copy_(t)
            return copy

        kv = [None if k is None or v is None else (host(k[slot, :length]), host(v[slot, :length]))
              for k, v in zip(self.k, self.v)]
        return SwappedSlot(length, kv, [host(s[slot]) for s in self._slot_states()])

    def swap_in(self, slot: int, swapped: SwappedSlot) -> None:
        """Write a swapped-out slot's contents into allocated slot `slot`, bit for bit."""
        for k, v, pair in zip(self.k, self.v, swapped.kv):
            if k is not None and v is not None and pair is not None:
                k[slot, :swapped.length].copy_(pair[0])
                v[slot, :swapped.length].copy_(pair[1])
        for state, copy in zip(self._slot_states(), swapped.states):
            state[slot].copy_(copy)

    def drop_swap(self, swapped: SwappedSlot) -> None:
        """Let go of a swapped-out slot that will not be swapped in: the host copy is the object
        itself here (a tensor-parallel cache also tells its workers, see `workers.py`)."""

    @property
    def prefix_state_nbytes(self) -> int:
        """Bytes held by state copies now (copies shared between slots counted once)."""
        unique = {id(c[0]): c for states in self.prefix_states for c in states.values()}
        return sum(t.numel() * t.element_size() for copy in unique.values() for t in copy)

    def snapshot_states(self, slots: list[int], starts: list[int]) -> StateSnapshot | None:
        """What `restore_states` needs to undo a forward over `slots` (with `starts` tokens cached):
        None without recurrent layers; a slot with nothing cached is restored by zeroing, not copied."""
        states = self._slot_states()
        if not states:
            return None
        index = lambda values: torch.tensor(values, dtype=torch.int64, device=self.device)  # noqa: E731
        copied = index([slot for slot, start in zip(slots, starts) if start > 0])
        fresh = index([slot for slot, start in zip(slots, starts) if start == 0])
        return StateSnapshot(copied, [s.index_select(0, copied) for s in states], fresh)

    def restore_states(self, snapshot: StateSnapshot | None) -> None:
        """Put the recurrent states of a snapshot's slots back, bit for bit."""
        if snapshot is None:
            return
        for state, copy in zip(self._slot_states(), snapshot.copies):
            state.index_copy_(0, snapshot.copied_slots, copy)
            state.index_fill_(0, snapshot.fresh_slots, 0)
