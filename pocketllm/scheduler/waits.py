"""Deadlines for the calls that wait (a poll for a result, a submission for room in the queue):
the timeout argument checked once, and one way to wait on the scheduler's condition until then."""

from __future__ import annotations

import math
import numbers
import threading
import time


def deadline(timeout: float | None, field: str, per_second: float = 1000.0) -> float | None:
    """The monotonic time at which a wait of `timeout` (milliseconds; seconds with per_second=1)
    gives up; None to wait forever (None or math.inf). `field`: the argument's name, for the error."""
    if timeout is None:
        return None
    unit = "seconds" if per_second == 1 else "milliseconds"
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise TypeError(f"{field} must be a number of {unit} >= 0, None or math.inf, got {type(timeout).__name__}")
    try:
        timeout_s = float(timeout) / per_second
    except OverflowError:  # an int too large for a float: longer than anyone waits
        return None
    if math.isnan(timeout_s) or timeout_s < 0:
        raise ValueError(f"{field} must be >= 0, None or math.inf (wait forever), got {timeout!r}")
    return None if math.isinf(timeout_s) else time.monotonic() + timeout_s


def wait_until(condition: threading.Condition, until: float | None) -> bool:
    """Wait on `condition` (its lock held) until notified or `until`; False once it has passed."""
    remaining = None if until is None else until - time.monotonic()
    if remaining is not None and remaining <= 0:
        return False
    condition.wait(None if remaining is None else min(remaining, threading.TIMEOUT_MAX))
    return True
