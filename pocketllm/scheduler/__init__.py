"""Request lifecycle and the batch scheduler."""

from .batch_scheduler import BatchScheduler
from .policy import PrefillPolicy
from .request import Request, RequestStatus, is_array, validate_prompt
from .stats import SchedulerStats
from .timeline import SlotEvent, plot_timeline

__all__ = ["BatchScheduler", "PrefillPolicy", "Request", "RequestStatus", "SchedulerStats", "SlotEvent", "is_array",
           "plot_timeline", "validate_prompt"]
