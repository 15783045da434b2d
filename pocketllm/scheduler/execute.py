"""The forward of a step's work, and what happens when it raises.

A failure is its own request's: when a batched forward raises (an op's exception, out of memory,
non-finite output), the recurrent states of its slots are put back and each of its requests is
rerun alone. Ops are batch invariant, so the requests that succeed get bitwise the tokens of the
batched (and serial) run; the ones that fail again end with their exception.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from ..runner import ModelRunner, SequenceInput, SequenceOutput
from .request import Request
from .slots import SlotManager
from .timeline import Span

# The scheduler's parts log under the facade's name: one logger to configure for the scheduler.
logger = logging.getLogger("pocketllm.scheduler.batch_scheduler")

Work = list[tuple[Request, SequenceInput]]
# What the forward gave a request whose forward succeeded, else the exception that ended it.
Outcome = SequenceOutput | BaseException


def execute(runner: ModelRunner, slots: SlotManager, work: Work, spans: list[Span]) -> Sequence[Outcome]:
    """One forward for the batch; if it raises, one forward per request, so that only the
    requests that fail alone end with their exception. An exception that is not an Exception
    (KeyboardInterrupt, SystemExit) propagates."""
    try:
        return _timed_run(runner, slots, work, spans)
    except Exception as exc:
        if len(work) == 1:
            logger.error("forward pass failed for request %d", work[0][0].request_id, exc_info=exc)
            return [exc]
        logger.warning("forward pass of %d requests failed (%s: %s); rerunning each alone",
                       len(work), type(exc).__name__, exc)
    outcomes: list[Outcome] = []
    for item in work:
        try:
            outcomes += _timed_run(runner, slots, [item], spans)
        except Exception as exc:
            logger.error("forward pass failed for request %d", item[0].request_id, exc_info=exc)
            outcomes.append(exc)
    return outcomes


def _timed_run(runner: ModelRunner, slots: SlotManager, work: Work, spans: list[Span]) -> list[Outcome]:
    """runner.run over `work`, its slots' recurrent states restored if it raises."""
    seqs = [seq for _, seq in work]
    saved = slots.guard(seqs)
    start = time.perf_counter()
    try:
        outputs = runner.run(seqs)
    except BaseException:
        slots.restore(saved)
        raise
    end = time.perf_counter()
    spans.extend(Span(r, seq, start, end) for r, seq in work)
    return list(outputs)
