"""The build of the C++ kernels (pocketllm/kernels/cpu/extension.py, build_lock.py): nothing a
killed or a running build leaves behind makes a later process wait without a bound.

Each scenario builds a one-function module through `extension.build`, the path the kernels take,
in fresh processes run with a `timeout=`: a build that waits forever fails the test instead of
hanging it.

- a build killed with SIGKILL while its compiler runs: torch's `lock` stays in the directory, and
  the next process completes the build and imports the module;
- a process still building beside torch's `lock` (the ninja of a build whose Python process alone was
  killed, or a build guarded by torch's `lock` alone): the next build waits for it, saying so, then
  proceeds;
- a stale lock (a lock file naming a dead pid, torch's `lock` left in the directory): the next build
  proceeds, announces itself, and a cached build announces nothing;
- a build whose result does not import: wiped and built once more;
- a live owner of the lock: a waiter says whom it waits for, then fails after the timeout naming the
  lock file and the owner's pid; `load_extension` falls back with a warning naming them; once the
  owner is gone a build proceeds.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

import pytest

from pocketllm.kernels.cpu import extension
from pocketllm.kernels.cpu.build_lock import TIMEOUT_ENV, lock_path

REPO = Path(__file__).resolve().parents[2]

if extension._missing_tool() is not None or not os.path.isdir("/proc"):
    pytest.skip("needs a C++ compiler, ninja and /proc", allow_module_level=True)

# About half a second to build: for the scenarios that only need a build to happen.
QUICK = """
#include <Python.h>
#define POCKETLLM_CAT(a, b) a##b
#define POCKETLLM_INIT(name) POCKETLLM_CAT(PyInit_, name)
static PyObject* answer(PyObject*, PyObject*) { return PyLong_FromLong(42); }
static PyMethodDef methods[] = {{"answer", answer, METH_NOARGS, nullptr}, {nullptr, nullptr, 0, nullptr}};
static PyModuleDef module = {PyModuleDef_HEAD_INIT, "quick", nullptr, -1, methods};
PyMODINIT_FUNC POCKETLLM_INIT(TORCH_EXTENSION_NAME)() { return PyModule_Create(&module); }
"""
# Several seconds (pybind11's headers): long enough to be killed while the compiler runs.
SLOW = """
#include <pybind11/pybind11.h>
int answer() { return 42; }
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("answer", &answer); }
"""
BUILD = """
import sys
from pathlib import Path
from pocketllm.kernels.cpu.extension import build
name, source, directory = sys.argv[1:]
print("answer", build(name, [Path(source)], Path(directory), notice="building " + name).answer())
"""
# The lock module alone (it imports nothing of pocketllm), so the owner starts in a blink.
HOLD = """
import sys, time
from pathlib import Path
sys.path.insert(0, sys.argv[2])
from build_lock import hold
with hold(Path(sys.argv[1]), 10):
    print("held", flush=True)
    time.sleep(120)
"""

# load_extension while this very process holds the lock, on another descriptor (flock locks conflict
# across descriptors): the one warning it gives.
FALLBACK = """
import os, sys, warnings
from pathlib import Path
from pocketllm.kernels.cpu import extension
from pocketllm.kernels.cpu.build_lock import hold
root = Path(sys.argv[1])
with hold(extension.build_dir(root), 10), warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    fell_back = extension.load_extension(root) is None
print(os.getpid(), fell_back, len(caught), *[str(warning.message) for warning in caught])
"""


def _env(**extra: str) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(REPO), **extra)


def _args(tmp_path: Path, kind: str) -> list[str]:
    """The command that builds the module `kind` ("quick" or "slow") into tmp_path/kind."""
    source = tmp_path / f"{kind}.cpp"
    if not source.exists():  # written once: a newer source would make every build a compile
        source.write_text(QUICK if kind == "quick" else SLOW)
    return [sys.executable, "-c", BUILD, f"test_{kind}", str(source), str(tmp_path / kind)]


def _build(tmp_path: Path, kind: str = "quick", **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(_args(tmp_path, kind), env=_env(**env), capture_output=True, text=True, timeout=120)


def _line(stream: IO[str] | None, timeout: float) -> str:
    """The next line of a child's pipe, or "" if none comes within `timeout` seconds."""
    assert stream is not None
    ready, _, _ = select.select([stream], [], [], timeout)
    return stream.readline() if ready else ""


def _compiling_in(directory: Path) -> bool:
    """Whether a compiler proper (cc1plus, clang) runs with `directory` as its working directory."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            name = Path("/proc", pid, "comm").read_text().strip()
            if name.startswith(("cc1plus", "clang")) and os.readlink(f"/proc/{pid}/cwd") == str(directory):
                return True
        except OSError:
            continue
    return False


def _kill_while_compiling(tmp_path: Path) -> Path:
    """Start a build of the slow module and SIGKILL it (all its processes: nothing cleans up) once
    its compiler runs; its directory."""
    directory = (tmp_path / "slow").resolve()
    process = subprocess.Popen(_args(tmp_path, "slow"), env=_env(), start_new_session=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    try:
        while not _compiling_in(directory):
            assert process.poll() is None and time.monotonic() < deadline, "the build never ran its compiler"
            time.sleep(0.05)
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    return directory


def test_a_build_killed_while_compiling_is_completed_by_the_next_process(tmp_path):
    directory = _kill_while_compiling(tmp_path)
    assert (directory / "lock").exists()  # torch's baton, which nothing of the killed build will remove
    result = _build(tmp_path, "slow")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["answer", "42"]
    assert not (directory / "lock").exists()


def test_a_stale_lock_does_not_stop_the_next_build(tmp_path):
    directory = tmp_path / "quick"
    directory.mkdir()
    finished = subprocess.Popen(["true"])
    finished.wait()  # its pid now names no process
    lock_path(directory).write_text(f"pid {finished.pid} on host elsewhere building into {directory}\n")
    (directory / "lock").touch()
    first, cached = _build(tmp_path), _build(tmp_path)
    assert first.returncode == 0, first.stderr
    assert first.stdout.split() == ["answer", "42"] and "building test_quick" in first.stderr
    assert cached.stdout.split() == ["answer", "42"] and cached.stderr == ""  # a cached build says nothing
    assert lock_path(directory).read_text() == ""  # released: it names no one


def test_processes_still_building_beside_torch_lock_are_waited_for(tmp_path):
    """The ninja of a build whose Python process alone was killed, and a build guarded by torch's
    `lock` alone (which holds it open)."""
    directory = tmp_path / "quick"
    directory.mkdir()
    baton = directory / "lock"
    baton.touch()
    shutil.copy("/bin/sleep", tmp_path / "ninja")
    building = [subprocess.Popen([tmp_path / "ninja", "60"], cwd=directory)]
    with baton.open() as held:
        building.append(subprocess.Popen(["sleep", "60"], stdin=held))
    waiter = subprocess.Popen(_args(tmp_path, "quick"), env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True)
    try:
        notice = _line(waiter.stderr, 60)  # after 2 s of waiting
        pids = sorted(process.pid for process in building)
        assert notice.startswith(f"pocketllm: waiting for the processes still building in {directory.resolve()} "
                                 f"(pids {pids}) to finish"), notice
        for process in building:
            assert waiter.poll() is None and not (directory / "test_quick.so").exists()
            process.kill()
            process.wait()
        out, err = waiter.communicate(timeout=120)
    finally:
        for process in [*building, waiter]:
            process.kill()
            process.wait()
    assert waiter.returncode == 0, err
    assert out.split() == ["answer", "42"]


def test_a_build_that_does_not_import_is_built_again(tmp_path):
    assert _build(tmp_path).returncode == 0
    (tmp_path / "quick" / "test_quick.so").write_bytes(b"cut short")  # newer than its sources: ninja keeps it
    result = _build(tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["answer", "42"] and "building test_quick" in result.stderr


def test_a_live_owner_makes_a_waiter_fail_in_time_naming_the_lock_and_its_pid(tmp_path):
    directory = tmp_path / "quick"
    owner = subprocess.Popen([sys.executable, "-c", HOLD, str(directory), str(Path(extension.__file__).parent)],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert _line(owner.stdout, 60) == "held\n"
        start = time.monotonic()
        waiter = _build(tmp_path, **{TIMEOUT_ENV: "3"})
        assert time.monotonic() - start < 30
        assert waiter.returncode != 0
        assert f"pocketllm: waiting for pid {owner.pid} on host " in waiter.stderr  # said once, before failing
        assert waiter.stderr.count("pocketllm: waiting for") == 1
        error = waiter.stderr.strip().splitlines()[-1]
        assert error.startswith("pocketllm.kernels.cpu.build_lock.BuildWaitTimeout: the build lock ")
        assert str(lock_path(directory)) in error and f"pid {owner.pid} " in error and TIMEOUT_ENV in error
    finally:
        owner.kill()
        owner.wait()
    result = _build(tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["answer", "42"]


def test_load_extension_falls_back_with_a_warning_naming_a_lock_held_too_long(tmp_path):
    result = subprocess.run([sys.executable, "-c", FALLBACK, str(tmp_path)], env=_env(**{TIMEOUT_ENV: "0.2"}),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    pid, fell_back, warnings, message = result.stdout.strip().split(" ", 3)
    assert fell_back == "True" and warnings == "1"
    assert message.startswith("pocketllm's C++ CPU kernels are unavailable: the build lock ")
    assert str(lock_path(extension.build_dir(tmp_path))) in message and f"pid {pid} " in message
    assert not extension.build_dir(tmp_path).exists()  # nothing was built
