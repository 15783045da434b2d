"""Request lifecycle and the batch scheduler."""

from .batch_scheduler import BatchScheduler
from .request import Request, RequestStatus, is_array, validate_prompt
from .stats import SchedulerStats
from .timeline import SlotEvent, plot_timeline

__all__ = ["BatchScheduler", "Request", "RequestStatus", "SchedulerStats", "SlotEvent", "is_array", "plot_timeline",
           "validate_prompt"]
