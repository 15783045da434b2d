"""Fixtures for the batch-scheduler tests: engines that are always closed, forward recorders and gates."""

from __future__ import annotations

import pytest

from pocketllm import LLM, EngineArgs

from .harness import Gate, RunRecorder, drain, scheduler_threads, wait_until


@pytest.fixture(autouse=True)
def one_torch_thread(single_torch_thread):
    """Every scheduler test runs on one intra-op thread: the tiny model gains nothing from two, and on a
    loaded 2-core machine OpenMP spin-waiting made its forwards 10x slower and runtimes erratic."""


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
