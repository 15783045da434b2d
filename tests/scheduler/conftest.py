"""Fixtures for the batch-scheduler tests: engines that are always closed, forward recorders and gates."""

from __future__ import annotations

import threading
import time

import pytest
import torch

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
    """Wraps llm.runner.run so that each forward blocks until `opened` is set; `entered` is set
    as soon as a forward is blocked. Bounded: after 30 s a blocked forward raises instead."""

    def __init__(self, llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
        self._real = llm.runner.run
        self.opened = threading.Event()
        self.entered = threading.Event()
        monkeypatch.setattr(llm.runner, "run", self.run)

    def run(self, seqs):
        self.entered.set()
        if not self.opened.wait(30):
            raise AssertionError("gate was never opened")
        return self._real(seqs)


@pytest.fixture(autouse=True)
def single_torch_thread():
    """Run the scheduler tests with one intra-op thread. The tiny model gains nothing from two, and
    on a loaded 2-core machine OpenMP spin-waiting made forwards 10x slower and runtimes erratic."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def make_llm(tiny_checkpoint):
    """Factory for batched engines on the tiny checkpoint; every engine made is closed afterwards."""
    made: list[LLM] = []

    def make(max_batch_size: int = 2, background: bool = False, max_seq_len: int = 128) -> LLM:
        llm = LLM(EngineArgs(model=str(tiny_checkpoint), max_seq_len=max_seq_len,
                             backend_options={"enable_batching": True, "max_batch_size": max_batch_size,
                                              "background_thread": background}))
        made.append(llm)
        return llm

    yield make
    for llm in made:
        llm.close()


@pytest.fixture
def recorder(monkeypatch):
    """recorder(llm) -> a RunRecorder installed on llm.runner."""
    return lambda llm: RunRecorder(llm, monkeypatch)


@pytest.fixture
def gate(monkeypatch, make_llm):
    """gate(llm) -> a Gate installed on llm.runner; opened at teardown, before the engines close."""
    gates: list[Gate] = []

    def make(llm: LLM) -> Gate:
        g = Gate(llm, monkeypatch)
        gates.append(g)
        return g

    yield make
    for g in gates:
        g.opened.set()


@pytest.fixture(name="wait_until")
def wait_until_fixture():
    return wait_until


@pytest.fixture(name="drain")
def drain_fixture():
    return drain


@pytest.fixture(name="scheduler_threads")
def scheduler_threads_fixture():
    return scheduler_threads
