"""Driving the engines of the scheduler tests: the scheduler thread's name, waiting with a bound,
stepping until idle, and wrappers of llm.runner.run that record or hold forwards."""

from __future__ import annotations

import functools
import threading
import time

import pytest

from pocketllm import LLM, EngineArgs

THREAD_NAME = "pocketllm-scheduler"


def scheduler_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == THREAD_NAME and t.is_alive()}


def wait_until(predicate, timeout_s: float = 10.0, what: str = "condition") -> None:
    """Poll `predicate` until it holds; fail (never hang) after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.001)


def drain(scheduler, limit: int = 10_000) -> int:
    """Step a manually driven scheduler until it has no work; returns the number of steps."""
    steps = 0
    while scheduler.has_work:
        scheduler.step()
        steps += 1
        assert steps < limit, "scheduler did not run out of work"
    return steps


class RunRecorder:
    """Wraps llm.runner.run and records every forward: (all decode rows?, [(slot, start, token_ids)]),
    and which of its sequences were decode rows (`kinds`)."""

    def __init__(self, llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[bool, list[tuple[int, int, list[int]]]]] = []
        self.kinds: list[list[bool]] = []
        self._real = llm.runner.run
        monkeypatch.setattr(llm.runner, "run", self.run)

    def run(self, seqs):
        self.calls.append((all(s.decode for s in seqs), [(s.slot, s.start, list(s.token_ids)) for s in seqs]))
        self.kinds.append([s.decode for s in seqs])
        return self._real(seqs)

    def _part(self, decode: bool):
        """Per forward that has any, its sequences of one kind."""
        parts = [[fed for fed, kind in zip(seqs, kinds) if kind == decode]
                 for (_, seqs), kinds in zip(self.calls, self.kinds)]
        return [part for part in parts if part]

    def prefills(self):
        return self._part(False)

    def decodes(self):
        return self._part(True)


class Gate:
    """Wraps llm.runner.run so that each forward (each one `holds(seqs)` picks, by default all)
    blocks until `opened` is set; `entered` is set as soon as a forward is blocked. Bounded: after
    30 s a blocked forward raises instead."""

    def __init__(self, llm: LLM, monkeypatch: pytest.MonkeyPatch, holds=lambda seqs: True) -> None:
        self._real = llm.runner.run
        self._holds = holds
        self.opened = threading.Event()
        self.entered = threading.Event()
        monkeypatch.setattr(llm.runner, "run", self.run)

    def run(self, seqs):
        if self._holds(seqs):
            self.entered.set()
            if not self.opened.wait(30):
                raise AssertionError("gate was never opened")
        return self._real(seqs)


@functools.cache
def swap_size(path, cached: int) -> int:
    """Host bytes a swapped-out request with `cached` positions takes on the checkpoint at `path`
    (per position and per slot state, whatever the engine's other options)."""
    with LLM(EngineArgs(model=str(path), max_seq_len=2 * cached + 64,
                        backend_options={"enable_batching": True, "background_thread": False})) as probe:
        return probe.cache.swap_bytes(cached)
