"""Request lifecycle and the batch scheduler."""

from .batch_scheduler import BatchScheduler
from .request import Request, RequestStatus, validate_prompt
from .stats import SchedulerStats

__all__ = ["BatchScheduler", "Request", "RequestStatus", "SchedulerStats", "validate_prompt"]
