"""The serial path: one request at a time through the runner, in a slot of the shared cache."""

from __future__ import annotations

from collections.abc import Callable

from ..outputs import GenerationResult
from ..runner import ModelRunner
from .draft_model import Drafting
from .policy import PrefillPolicy
from .request import Request
from .slots import SlotManager


def run_serial(runner: ModelRunner, slots: SlotManager, policy: PrefillPolicy, request: Request,
               drafter: Drafting | None = None, detokenize: Callable[[list[int]], str] | None = None
               ) -> GenerationResult:
    """Prefill piece by piece (the cuts of the batched path), then decode one token at a time (or
    verify drafts), cold: nothing is reused. An exception ends the request "error", not the engine."""
    slots.admit_cold(request)
    try:
        while not request.finished:
            seq = request.next_input(policy)
            if drafter is not None:
                seq = drafter.fill([(request, seq)])[0][1]
            request.advance(seq, runner.run([seq])[0])
            if seq.drafts:  # a verify piece: the states back to its accepted end
                slots.verified(request, seq)
    except Exception as exc:
        request.finish("error", f"{type(exc).__name__}: {exc}")
    finally:
        slots.release(request)
    request.text = None if detokenize is None else detokenize(request.token_ids)
    return request.result()
