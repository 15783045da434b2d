"""Request lifecycle and the batch scheduler, one part per job:

- `batch_scheduler`: the threaded facade (`BatchScheduler`): the lock, the conditions, the loop
  thread and the public API; it wires the parts below together and does nothing else.
- `planner`: each step's work within the token budget: admission, prefill pieces, preemption.
  No lock of its own, so its decisions can be read (and tested) as plain code.
- `execute`: the forward, and the one-request-at-a-time rerun that keeps a failure its own request's.
- `delivery`: token deltas and result callbacks, one subscriber record per request.
- `slots`: the one owner of what the slots hold (allocation, prefix reuse, snapshots, swap), for
  the serial path as for the scheduler.
- `stats`, `timeline`: what was done, as counters and as a per-slot picture.
- `request`, `policy`, `prefix_index`, `stream`, `waits`: the records and rules the others share.
"""

from .batch_scheduler import BatchScheduler
from .policy import PrefillPolicy
from .request import Request, RequestStatus, check_submission, is_array, validate_prompt
from .stats import SchedulerStats
from .timeline import SlotEvent, plot_timeline

__all__ = ["BatchScheduler", "PrefillPolicy", "Request", "RequestStatus", "SchedulerStats", "SlotEvent", "is_array",
           "check_submission", "plot_timeline", "validate_prompt"]
