"""Fault injection: op tables whose ops fail for chosen requests only.

Engines built after `install(monkeypatch, edit)` run on `edit(ops)` instead of their backend's op
table, so a fault strikes inside the model forward, as a real one would.
- SlotFault: the attention ops fail for the rows of one cache slot (raise, NaN rows, or out of
  memory for a prompt longer than a limit), in prefill or decode; in a Qwen3.5 model the full
  attention layer runs after Gated DeltaNet layers, so the fault strikes mid-forward.
- SeedFault (from bench/soak.py): the sampler fails for rows whose seed asks for it (see
  fault_seed), whatever slot or batch the request is in.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch

import pocketllm.op_table
from pocketllm.kernels import Ops

from .soak_loader import load

SeedFault = load().SeedFault
fault_seed = load().fault_seed

OutOfMemory = getattr(torch, "OutOfMemoryError", MemoryError)


def install(monkeypatch: pytest.MonkeyPatch, edit: Callable[[Ops], Ops]) -> None:
    """Engines made from now on (in this test) run on edit(their op table)."""
    real = pocketllm.op_table.get_ops
    monkeypatch.setattr(pocketllm.op_table, "get_ops", lambda *args, **kwargs: edit(real(*args, **kwargs)))


class InjectedFault(RuntimeError):
    pass


@dataclasses.dataclass
class SlotFault:
    phase: str  # "prefill" or "decode"
    kind: str  # "raise", "nan" or "oom" (prefill: a prompt longer than `oom_len` runs out of memory)
    slot: int = 0
    min_len: int = 0  # decode: strike once the slot holds this many tokens
    oom_len: int = 0
    strikes: int = 0

    def edit(self, ops: Ops) -> Ops:
        return dataclasses.replace(ops, prefill_attention=self._prefill(ops.prefill_attention),
                                   decode_attention=self._decode(ops.decode_attention))

    def _prefill(self, real: Callable) -> Callable:
        def prefill_attention(q, k_cache, v_cache, slot_ids, start_positions, cu_seqlens, scale):
            out = real(q, k_cache, v_cache, slot_ids, start_positions, cu_seqlens, scale)
            if self.phase != "prefill":
                return out
            bounds = cu_seqlens.tolist()
            if self.kind == "oom":
                lengths = [b - a for a, b in zip(bounds, bounds[1:])]
                if max(lengths) > self.oom_len:
                    self.strikes += 1
                    raise OutOfMemory(f"injected: no memory for a prompt of {max(lengths)} tokens")
                return out
            rows = [i for i, slot in enumerate(slot_ids.tolist()) if slot == self.slot]
            if rows:
                self.strikes += 1
                if self.kind == "raise":
                    raise InjectedFault(f"injected prefill fault in slot {self.slot}")
                out = out.clone()
                for i in rows:
                    out[bounds[i]:bounds[i + 1]] = float("nan")
            return out

        return prefill_attention

    def _decode(self, real: Callable) -> Callable:
        def decode_attention(q, k_cache, v_cache, slot_ids, seq_lens, scale):
            out = real(q, k_cache, v_cache, slot_ids, seq_lens, scale)
            if self.phase != "decode":
                return out
            rows = [i for i, (slot, n) in enumerate(zip(slot_ids.tolist(), seq_lens.tolist()))
                    if slot == self.slot and n >= self.min_len]
            if rows:
                self.strikes += 1
                if self.kind == "raise":
                    raise InjectedFault(f"injected decode fault in slot {self.slot}")
                out = out.clone()
                out[rows] = float("nan")
            return out

        return decode_attention
