"""What an assertion says when it fails: the request or case, the first differing position, both
values with their bits, and a snippet that reproduces the failure when pasted into a Python session."""

from __future__ import annotations

import struct
from typing import Any

from . import _checks as check
from .engines import Engines, Mismatch, check_run, find_mismatches
from .strategies import Workload


def fp32_bits(value: float) -> str:
    """The fp32 bit pattern of `value` (a logprob is an fp32 number held in a Python float)."""
    check.real("fp32_bits", "value", value)
    try:
        return "0x" + struct.pack(">f", value).hex()
    except OverflowError:
        raise check.refuse(ValueError, "fp32_bits", "value", "a real number within fp32's range", value) from None


def show(value: float | int | None) -> str:
    """A value as the messages print it: floats with every digit of their fp32 value and their bits."""
    if value is None:
        return "nothing (the output ended)"
    if isinstance(value, float):
        return f"{value!r} ({fp32_bits(value)})"
    return repr(value)


def describe_mismatch(m: Mismatch, workload: Workload) -> str:
    """One line: which job, where it first differs, both runs' token and logprob there."""
    check.instance("describe_mismatch", "m", m, Mismatch, "a Mismatch")
    check.instance("describe_mismatch", "workload", workload, Workload, "a Workload")
    check.integer("describe_mismatch", "m.job", m.job, 0, len(workload.jobs) - 1)
    job = workload.jobs[m.job]
    where = f"generated position {m.position}"
    if m.batched is not None and m.serial is not None:
        (bt, bl), (st, sl) = m.batched, m.serial
        values = (f"batched token {bt}, logprob {show(bl)}; serial token {st}, logprob {show(sl)}"
                  if bt == st else f"batched token {bt} (logprob {show(bl)}), serial token {st} (logprob {show(sl)})")
    else:
        values = (f"batched {show(None) if m.batched is None else m.batched}, "
                  f"serial {show(None) if m.serial is None else m.serial}")
    return (f"job {m.job} (a prompt of {len(job.prompt)} tokens, arriving at step {job.arrival_step}, "
            f"{len(m.batched_result.token_ids)} tokens batched ({m.batched_result.finish_reason}) against "
            f"{len(m.serial_result.token_ids)} serial): first difference at {where}: {values}")


def reproduction(call: str, imports: tuple[str, ...] = (), **values: str) -> str:
    """A snippet that runs `call` after `imports` and after binding each of `values` (Python source)."""
    _check_source("reproduction", call, imports, values)
    lines = ["from pocketllm import LLM, EngineArgs, SamplingParams",
             "from pocketllm.scheduler import PrefillPolicy",
             "from pocketllm.testing import *", *imports, ""]
    lines += [f"{name} = {source}" for name, source in values.items()]
    return "\n".join(lines + [call])


def class_import(value: object) -> tuple[str, ...]:
    """The import a snippet needs for `value`'s class, unless the snippet's own imports give it."""
    cls = type(value)
    if value is None or cls.__name__ in ("PrefillPolicy", "Schedule"):
        return ()
    return (f"from {cls.__module__} import {cls.__qualname__}",)


def workload_source(workload: Workload) -> str:
    """`workload` as Python source, one job per line."""
    check.instance("workload_source", "workload", workload, Workload, "a Workload")
    jobs = "".join(f"\n        {job!r}," for job in workload.jobs)
    return f"Workload(\n    jobs=({jobs}\n    ),\n    max_batch_size={workload.max_batch_size},\n" \
           f"    schedule={workload.schedule!r})"


def _check_source(where: str, call: Any, imports: Any, values: dict[str, Any]) -> None:
    """Every piece of a snippet is source text: an object would be pasted as its repr."""
    check.instance(where, "call", call, str, "a str")
    check.items(where, "imports", imports, "a tuple of import lines (str)", min_len=0)
    check.each(where, "imports", imports, str, "an import line (str)")
    for name, source in values.items():
        check.instance(where, name, source, str, "Python source (a str)")


def mismatches(engines: Engines, workload: Workload) -> list[str]:
    """`find_mismatches`, each as one line (the lab's verdicts and the negative controls read these)."""
    check_run("mismatches", engines, workload)
    return [describe_mismatch(m, workload) for m in find_mismatches(engines, workload)]
