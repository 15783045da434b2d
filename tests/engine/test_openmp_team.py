"""A thread that waits for the scheduler thread lets its idle OpenMP team go (`release_openmp_team`):
GNU OpenMP lets a team spin between parallel regions only while it manages no more threads than
CPUs, so a caller's leftover team (it ran torch before) would make the scheduler thread's team sleep
on futexes between regions. Seen in the process's thread count, in a fresh interpreter each (a team
lives as long as its thread); the control waits without releasing, and the caller's team stays."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pocketllm.machine import _openmp_pause

SCRIPT = """
import os, sys, time, torch
from pocketllm import LLM, EngineArgs, SamplingParams
import pocketllm.scheduler.loop as loop
torch.set_num_threads(2)
if sys.argv[2] == "control":
    loop.release_openmp_team = lambda: None
llm = LLM(EngineArgs(model=sys.argv[1], max_seq_len=64, backend_options={"enable_batching": True}))
greedy = SamplingParams(max_tokens=3, temperature=0.0)
llm.generate([1, 2, 3], greedy)
threads = lambda: len(os.listdir("/proc/self/task"))
before = threads()
torch.randn(1 << 22).sum()  # a parallel region on this thread: it gets a team
with_team = threads()
llm.generate([1, 2, 3], greedy)  # waits for the scheduler thread
deadline = time.monotonic() + 5
while threads() > before and time.monotonic() < deadline:
    time.sleep(0.01)
print(before, with_team, threads())
llm.close()
"""


def _counts(path, mode: str) -> list[int]:
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(path), mode], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return [int(n) for n in out.stdout.split()]


@pytest.mark.slow
@pytest.mark.skipif(_openmp_pause() is None, reason="torch runs on another OpenMP runtime than GNU OpenMP here")
def test_a_caller_waiting_for_the_scheduler_thread_lets_its_idle_team_go(tiny_checkpoint):
    before, with_team, after = _counts(tiny_checkpoint, "release")
    assert with_team == before + 1 and after == before
    before, with_team, after = _counts(tiny_checkpoint, "control")
    assert with_team == before + 1 and after == with_team
