"""Deadlines for the calls that wait (a poll for a result, a submission for room in the queue):
the timeout argument checked once, and one way to wait on the scheduler's condition until then."""

from __future__ import annotations

import math
import numbers
import threading
import time


def deadline(timeout_ms: float | None, field: str) -> float | None:
    """The monotonic time at which a wait gives up; None to wait forever (None or math.inf).
    `field`: the argument's name, for the error."""
    if timeout_ms is None:
        return None
    if isinstance(timeout_ms, bool) or not isinstance(timeout_ms, numbers.Real):
        raise TypeError(f"{field} must be a number of milliseconds >= 0, None or math.inf, "
                        f"got {type(timeout_ms).__name__}")
    try:
        timeout_s = float(timeout_ms) / 1000.0
    except OverflowError:  # an int too large for a float: longer than anyone waits
        return None
    if math.isnan(timeout_s) or timeout_s < 0:
        raise ValueError(f"{field} must be >= 0, None or math.inf (wait forever), got {timeout_ms!r}")
    return None if math.isinf(timeout_s) else time.monotonic() + timeout_s


def wait_until(condition: threading.Condition, until: float | None) -> bool:
    """Wait on `condition` (its lock held) until notified or `until`; False once it has passed."""
    remaining = None if until is None else until - time.monotonic()
    if remaining is not None and remaining <= 0:
        return False
    condition.wait(None if remaining is None else min(remaining, threading.TIMEOUT_MAX))
    return True
