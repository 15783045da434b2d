"""The lock a build of the C++ kernels holds: it names its owner, dies with it, and is waited on
for a bounded time.

torch's own guard (`FileBaton`: a `lock` file created in the build directory, removed at the end)
outlives a build that is killed, and every later build then waits on it forever, silently. This
lock is an `fcntl.flock` on `<build directory>.lock`, beside the build directory: the kernel drops
it when its owner exits, however it exits (SIGKILL included), and the file names the owner (pid,
host, directory) for the message of a process that waits. Whoever holds it is the only build of
that directory that takes it, so a torch `lock` found there is a killed build's leftover, or the
guard of a build that does not take it (an older pocketllm): it is removed once nothing builds there
any more (no ninja works there, no process holds the `lock` open; found in /proc).

Every wait says once on stderr, after `NOTICE_AFTER` seconds, what it waits for, and gives up after
$POCKETLLM_BUILD_TIMEOUT seconds (600 unless set) with `BuildWaitTimeout`, naming the lock file,
its owner and what to do.
"""

from __future__ import annotations

import fcntl
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

TIMEOUT_ENV = "POCKETLLM_BUILD_TIMEOUT"
# Enough for the kernels' real build on two busy cores.
DEFAULT_TIMEOUT = 600.0
# A build that is cached holds the lock for well under this: only a real wait is announced.
NOTICE_AFTER = 2.0
POLL = 0.1


class BuildWaitTimeout(RuntimeError):
    """A wait for the build lock, or for the processes still building in its directory, ran past its bound."""


def timeout() -> float:
    """The bound on each wait, in seconds: $POCKETLLM_BUILD_TIMEOUT, else `DEFAULT_TIMEOUT`."""
    value = os.environ.get(TIMEOUT_ENV, "")
    try:
        seconds = float(value) if value else DEFAULT_TIMEOUT
    except ValueError:
        raise ValueError(f"${TIMEOUT_ENV} must be a number of seconds, not {value!r}") from None
    if seconds < 0:
        raise ValueError(f"${TIMEOUT_ENV} must be a number of seconds >= 0, not {value!r}")
    return seconds


def lock_path(directory: Path) -> Path:
    """The lock file of a build directory: beside it, so wiping the directory keeps the lock."""
    return directory.with_name(directory.name + ".lock")


def owner(path: Path) -> str:
    """Who holds the lock at `path`, as its file names them ("pid N on host H building into DIR")."""
    try:
        text = path.read_text().strip()
    except OSError:
        text = ""
    return text or "a process that has not written its name yet"


def _wait(ready: Callable[[], bool], waiting_for: Callable[[], str], give_up: Callable[[float], str],
          timeout_s: float) -> None:
    """Poll `ready` until it is true: say once what we wait for after NOTICE_AFTER s, and raise
    BuildWaitTimeout with `give_up(timeout_s)` after `timeout_s`."""
    start = time.monotonic()
    noticed = False
    while not ready():
        waited = time.monotonic() - start
        if waited >= timeout_s:
            raise BuildWaitTimeout(give_up(timeout_s))
        if not noticed and waited >= NOTICE_AFTER:
            print(f"pocketllm: waiting for {waiting_for()}", file=sys.stderr, flush=True)
            noticed = True
        time.sleep(POLL)


def _try_flock(fd: int) -> bool:
    """Take the flock on `fd` if no one holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _held_too_long(path: Path) -> Callable[[float], str]:
    """The error of a lock wait that timed out: the lock file, its owner, what to do."""
    def message(timeout_s: float) -> str:
        return (f"the build lock {path} is still held after {timeout_s:g} s by {owner(path)}; if that process "
                f"is no longer building, remove {path}; to wait longer, set ${TIMEOUT_ENV} (seconds)")
    return message


@contextmanager
def hold(directory: Path, timeout_s: float) -> Iterator[None]:
    """Hold the build lock of `directory` for the block, waiting at most `timeout_s` for its owner;
    the lock file names this process while it holds it."""
    path = lock_path(directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        _wait(lambda: _try_flock(fd), lambda: f"{owner(path)} (lock file {path})", _held_too_long(path), timeout_s)
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on host {socket.gethostname()} building into {directory}\n".encode())
        try:
            yield
        finally:
            os.ftruncate(fd, 0)  # the file names no one while no one holds it
    finally:
        os.close(fd)  # and the flock goes with the descriptor


def _link(path: str) -> str:
    """Where a /proc link points, or "" (gone, or another user's)."""
    try:
        return os.readlink(path)
    except OSError:
        return ""


def _builds_in(pid: str, directory: str, baton: str) -> bool:
    """Whether process `pid` is building in `directory`: a ninja working there, or a process holding
    torch's `lock` there open (torch keeps it open while its build runs)."""
    try:
        if Path("/proc", pid, "comm").read_text().strip() == "ninja" and _link(f"/proc/{pid}/cwd") == directory:
            return True
        descriptors = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    return any(_link(f"/proc/{pid}/fd/{fd}") == baton for fd in descriptors)


def _building_in(directory: Path) -> list[int]:
    """The processes still building in `directory` without our lock: the ninja a killed build left
    running, or a build guarded by torch's `lock` alone. Empty where there is no /proc."""
    if not os.path.isdir("/proc"):
        return []
    target = os.path.realpath(directory)
    baton = os.path.join(target, "lock")
    return sorted(int(pid) for pid in filter(str.isdigit, os.listdir("/proc")) if _builds_in(pid, target, baton))


def clear_torch_baton(directory: Path, timeout_s: float) -> None:
    """Remove the `lock` torch's builder left in `directory` (a killed build's, or an older pocketllm's),
    once no process builds there any more: the killed build's ninja may run on. Call it only while
    holding `hold(directory)`."""
    baton = directory / "lock"
    if not baton.exists():
        return
    def give_up(waited: float) -> str:
        return (f"processes (pids {_building_in(directory)}) still build in {directory} beside torch's {baton} "
                f"after {waited:g} s; end them, or set ${TIMEOUT_ENV} (seconds) to wait longer")
    _wait(lambda: not _building_in(directory),
          lambda: f"the processes still building in {directory} (pids {_building_in(directory)}) to finish",
          give_up, timeout_s)
    baton.unlink(missing_ok=True)
