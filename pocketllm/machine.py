"""The machine: what a measurement ran on (the reports of `pocketllm bench` and `pocketllm lab
bench`), and the CPU threads a process's OpenMP teams hold."""

from __future__ import annotations

import ctypes
import functools
import platform
from collections.abc import Callable
from pathlib import Path

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: release the threads, keep what can be kept


def cpu_name() -> str:
    """The CPU model (platform.processor() is empty on most Linux systems)."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


@functools.cache
def _openmp_pause() -> Callable[[int], int] | None:
    """`omp_pause_resource_all` of the GNU OpenMP runtime this process loaded (torch's copy, found in
    /proc/self/maps), or None: another OpenMP runtime, or none."""
    maps = Path("/proc/self/maps")
    if not maps.is_file():
        return None
    paths = sorted({line.split()[-1] for line in maps.read_text().splitlines() if "/libgomp" in line})
    for path in paths:
        try:
            return ctypes.CDLL(path).omp_pause_resource_all
        except (OSError, AttributeError):
            continue
    return None


def release_openmp_team() -> None:
    """Let the calling thread's idle OpenMP worker threads go (GNU OpenMP; nothing elsewhere).

    Why: GNU OpenMP lets a team's threads spin between parallel regions only while it manages no
    more threads than the machine has CPUs, and a thread that once ran a parallel torch op keeps its
    team for life. A caller that ran torch (a notebook, a benchmark beside transformers) and then
    waits for the scheduler thread would make that thread's team sleep on futexes between regions:
    on 2 cores, a lone request's decode 10.5 ms a token instead of 7.7. A thread that waits
    releases its team first; it gets a new one if it runs torch again."""
    pause = _openmp_pause()
    if pause is not None:
        pause(OMP_PAUSE_SOFT)
