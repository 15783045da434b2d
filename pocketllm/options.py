"""Typed options, parsed once from the `backend_options` dict of `EngineArgs`.

`backend_options` keeps the name and flat dict shape of the C++ design; each key belongs to one
of two groups, and the engine reads the typed, frozen group, never the dict:
- `EngineOptions`: how the engine runs requests (cache slots, the batch scheduler, its thread,
  its timeline). Read by `LLM` when it builds the cache and the scheduler.
- `BackendOptions`: how the backend's op table is built. Read by `LLM` when it calls `kernels.get_ops`.
Every option's default, meaning and allowed range live in its field below, and nowhere else.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from .kernels.grid import POSITION_GRID

PreemptionMode = Literal["swap", "recompute"]
PREEMPTION_MODES: tuple[PreemptionMode, ...] = ("swap", "recompute")


def _option(default: Any, doc: str, low: int | None = None, high: int | None = None, multiple: int = 1,
            choices: tuple[str, ...] = ()) -> Any:
    """A dataclass field carrying its meaning and, for ints, its allowed range (and step), for
    strings the values allowed."""
    return field(default=default, metadata={"doc": doc, "range": None if low is None else (low, high),
                                            "multiple": multiple, "choices": choices})


@dataclass(frozen=True)
class EngineOptions:
    """How the engine runs requests: cache slots and the batch scheduler."""

    enable_batching: bool = _option(False, "route generate() through the batch scheduler")
    max_batch_size: int = _option(8, "number of cache slots: the most requests running at once", 1, 1024)
    background_thread: bool = _option(True, "batched mode: a thread drives the scheduler loop")
    record_timeline: bool = _option(False, "batched mode: record which slot ran which request at each step")
    max_num_batched_tokens: int = _option(2048, "batched mode: tokens one step runs (a decode row for each running "
                                                "request, then prefill pieces); at least the longest piece plus "
                                                "max_batch_size - 1", 1, 1 << 24)
    prefill_chunk_size: int = _option(512, "prompts are cut into pieces at multiples of this many tokens, "
                                           "request-local (0: not cut)", 0, 1 << 20, POSITION_GRID)
    max_waiting: int = _option(0, "batched mode: a submission beyond this many waiting requests raises "
                                  "QueueFullError (or waits for room, as the caller asks); 0: no limit", 0, 1 << 31)
    max_swap_bytes: int = _option(0, "batched mode: host memory preempted (swapped-out) requests may hold; a "
                                     "preemption that would exceed it does not happen; 0: no limit", 0, 1 << 62)
    preemption_mode: PreemptionMode = _option("swap", "batched mode: what preempting a running request does: "
                                                      "'swap' copies its slot to host memory and back, bit for "
                                                      "bit; 'recompute' frees the slot and prefills its prompt "
                                                      "and generated tokens again when it is readmitted (no host "
                                                      "memory; needs exact positions)", choices=PREEMPTION_MODES)
    enable_prefix_reuse: bool = _option(True, "batched mode: a prompt reuses the prefix a cache slot holds "
                                              "(bitwise as a cold run)")
    state_snapshot_interval: int = _option(512, "prompts are also cut at multiples of this, the positions a prefix "
                                                "is reused from; hybrid models keep each slot's Gated DeltaNet "
                                                "states there (memory per slot in capabilities). 0: reuse at "
                                                "chunk boundaries, none on hybrid models", 0, 1 << 20, POSITION_GRID)
    fine_snapshot_until: int = _option(512, "hybrid models with exact positions also keep each slot's Gated "
                                            "DeltaNet states every 64 positions up to this one, inside prefill "
                                            "pieces (no cut), so a shared prefix under it is reused to within 64 "
                                            "tokens (memory per slot in capabilities); 0: off", 0, 1 << 20,
                                       POSITION_GRID)


@dataclass(frozen=True)
class BackendOptions:
    """How the backend's op table is built. Which backend reads which option is in its record
    (`kernels.backends.BACKENDS`, `Backend.options`); the others ignore it."""

    batch_invariant: bool = _option(True, "fixed-shape row tiles so results do not depend on the batch")
    invariance_probe: bool = _option(True, "a backend not invariant by construction: check at start-up that the "
                                           "row-wise ops are invariant here")
    decode_per_row: bool = _option(False, "without exact positions: decode rows multiply W one row per call (MKL's "
                                          "fastest for batches of 1-2) instead of in 4-row tiles; turns the "
                                          "exact_positions default off, and refuses exact_positions=True")
    tree_reduction: bool | None = _option(None, "row-parallel products (o_proj, down_proj, out_proj) are summed "
                                                "over 8 fixed input-feature shards in one binary tree whose subtrees "
                                                "are the tensor-parallel ranks' sums, so tensor_parallel_size 1, 2, 4 "
                                                "and 8 give the same bits; False: one product per rank and a plain "
                                                "all-reduce; None: on when tensor_parallel_size > 1, and at 1 where "
                                                "the linear kernel sums its shards itself, in one call (the torch "
                                                "backend's C++ kernels, the triton backend's kernel); elsewhere at "
                                                "1 it costs one product per shard: set True to compare with sharded "
                                                "runs")
    exact_positions: bool | None = _option(None, "a position's logits are bitwise the same decoded, prefilled in a "
                                                 "piece of any length, or scored (prompt_logprobs); None: the "
                                                 "backend's default (triton: on; torch: on where its C++ kernels "
                                                 "build, which own every reduction order; off without a C++ "
                                                 "compiler, and with decode_per_row)")


@dataclass(frozen=True)
class Options:
    """Both groups, as parsed from one `backend_options` dict."""

    engine: EngineOptions = EngineOptions()
    backend: BackendOptions = BackendOptions()

    def as_dict(self) -> dict[str, Any]:
        """The flat `backend_options` form, every key filled in."""
        return {f.name: getattr(group, f.name) for group in (self.engine, self.backend) for f in fields(group)}


GROUPS = (EngineOptions, BackendOptions)
KNOWN = {f.name: f for group in GROUPS for f in fields(group)}


def parse_backend_options(raw: Mapping[str, Any] | None) -> Options:
    """Check every key and value of `raw` (None: all defaults) and fill in the defaults.

    Unknown keys raise ValueError listing the known ones. A bool option given anything but a bool
    raises TypeError; an int option given anything but an int in its range (a bool included, which
    Python counts as an int) raises ValueError, and so does a string option given anything but one
    of its values."""
    raw = {} if raw is None else raw
    if not isinstance(raw, Mapping):
        raise TypeError(f"backend_options must be a dict, got {type(raw).__name__}")
    unknown = set(raw) - set(KNOWN)
    if unknown:
        raise ValueError(f"unknown backend_options {sorted(unknown)}; allowed: {sorted(KNOWN)}")
    for name, value in raw.items():
        _check(name, value)
    backend = BackendOptions(**_given(BackendOptions, raw))
    if backend.decode_per_row and backend.exact_positions is True:
        raise ValueError("backend_options['decode_per_row']=True needs backend_options['exact_positions']=False: a "
                         "row multiplied alone rounds differently from the same row prefilled in a 4-row tile")
    return Options(EngineOptions(**_given(EngineOptions, raw)), backend)


def _given(group: type, raw: Mapping[str, Any]) -> dict[str, Any]:
    """The keys of `raw` that belong to `group`; the others keep their defaults."""
    return {f.name: raw[f.name] for f in fields(group) if f.name in raw}


def _check(name: str, value: Any) -> None:
    spec = KNOWN[name]
    if spec.default is None:  # a bool, or None for the backend's choice
        if value is not None and not isinstance(value, bool):
            raise TypeError(f"backend_options[{name!r}] must be a bool or None, got {value!r}")
        return
    if isinstance(spec.default, bool):
        if not isinstance(value, bool):
            raise TypeError(f"backend_options[{name!r}] must be a bool, got {value!r}")
        return
    choices = spec.metadata["choices"]
    if choices:
        if not isinstance(value, str) or value not in choices:
            raise ValueError(f"backend_options[{name!r}] must be one of {', '.join(map(repr, choices))}, got {value!r}")
        return
    low, high = spec.metadata["range"]
    multiple = spec.metadata["multiple"]
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high or value % multiple:
        step = f" and a multiple of {multiple}" if multiple > 1 else ""
        raise ValueError(f"backend_options[{name!r}] must be an int in [{low}, {high}]{step}, got {value!r}")
