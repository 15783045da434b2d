"""Soak: thousands of mixed requests through the batch scheduler, with random cancels and
preemptions, streamed tokens, raising callbacks and callbacks that cancel other requests, policy
changes while idle, injected faults and a draining stop at the end, checking the scheduler's
promises over the whole run.

    python bench/soak.py                      # 20000 requests on the tiny preset
    python bench/soak.py --requests 2000      # what the test suite runs (tests/scheduler/test_soak.py)

Checked: every request reaches exactly one terminal state (polled once; its callback, if any, ran
once), a request carrying a fault ends "error" and no other does, a streamed request's deltas are
its tokens in order, all before its result, no slot or swap space leaks, resident memory grows less
than a bound after warm-up, and a sample of survivors equals its serial run bitwise.
Faults are keyed by the request's seed (seed % 100: 1 the sampler raises, 2 it returns a NaN
logprob, at position (seed // 100) % 1000), so they follow the request whatever slot or batch
it lands in. Figures are printed and written to bench/results/soak.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

import pocketllm.op_table
from pocketllm import LLM, EngineArgs, SamplingParams, write_checkpoint
from pocketllm.kernels import Ops

TERMINAL = ("stop", "length", "cancelled", "error")
CALLBACK_ERRORS = (ValueError, SystemExit, KeyboardInterrupt)  # raised by callbacks, fresh each time


class InjectedFault(RuntimeError):
    pass


def fault_seed(base: int, kind: int, position: int) -> int:
    """A seed that makes SeedFault strike (kind 1: raise, 2: NaN logprob) when sampling `position`."""
    return (base * 1000 + position % 1000) * 100 + kind


@dataclasses.dataclass
class SeedFault:
    """Wraps an op table's sampler so that it fails for rows whose seed asks for it."""

    strikes: int = 0

    def edit(self, ops: Ops) -> Ops:
        real = ops.sample

        def sample(logits, temperature, top_k, top_p, seeds, positions):
            tokens, logprobs = real(logits, temperature, top_k, top_p, seeds, positions)
            hits = [(i, seed % 100) for i, (seed, pos) in enumerate(zip(seeds.tolist(), positions.tolist()))
                    if seed >= 0 and seed % 100 in (1, 2) and (seed // 100) % 1000 == pos]
            for i, kind in hits:
                self.strikes += 1
                if kind == 1:
                    raise InjectedFault(f"injected sampler fault at position {positions[i].item()}")
                logprobs = logprobs.clone()
                logprobs[i] = float("nan")
            return tokens, logprobs

        return dataclasses.replace(ops, sample=sample)


def rss_bytes() -> int:
    """Resident set size of this process, from /proc/self/statm."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@dataclasses.dataclass
class Planned:
    prompt: list[int]
    params: SamplingParams
    faulty: bool
    cancel_after: int | None  # steps after submission; None: never cancelled
    preempt_after: int | None  # steps after submission; None: never preempted by hand
    callback_error: type[BaseException] | None
    has_callback: bool
    cancels_another: bool  # its callback cancels the oldest request not yet collected
    streamed: bool  # with on_token


def plan(count: int, vocab: int, rng: random.Random, fault_rate: float, cancel_rate: float) -> list[Planned]:
    work = []
    for i in range(count):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 8))]
        max_tokens = rng.randint(1, 4)
        faulty = rng.random() < fault_rate
        if faulty:  # ignore_eos: it surely reaches the position where its fault strikes
            seed = fault_seed(i, rng.choice([1, 2]), len(prompt) + rng.randrange(max_tokens))
        else:
            seed = rng.randrange(2**40) * 100  # seed % 100 == 0: never a fault
        params = SamplingParams(max_tokens=max_tokens, temperature=rng.choice([0.0, 0.7, 1.0]),
                                top_k=rng.choice([0, 0, 20]), top_p=rng.choice([1.0, 1.0, 0.9]), seed=seed,
                                ignore_eos=faulty or rng.random() < 0.5)
        has_callback = rng.random() < 0.3
        callback_error = rng.choice(CALLBACK_ERRORS) if has_callback and rng.random() < 0.3 else None
        cancel_after = rng.randint(0, 4) if rng.random() < cancel_rate else None
        preempt_after = rng.randint(1, 3) if rng.random() < 0.05 else None
        cancels_another = has_callback and callback_error is None and rng.random() < 0.2
        work.append(Planned(prompt, params, faulty, cancel_after, preempt_after, callback_error, has_callback,
                            cancels_another, streamed=rng.random() < 0.2))
    return work


def soak(path: Path, requests: int, seed: int = 0, max_batch_size: int = 8, fault_rate: float = 0.03,
         cancel_rate: float = 0.1, serial_sample: int = 20) -> dict:
    """Run the soak on the checkpoint at `path`; returns the figures and the failures found (an
    empty `problems` list when every promise held)."""
    rng = random.Random(seed)
    fault = SeedFault()
    real_get_ops = pocketllm.op_table.get_ops
    pocketllm.op_table.get_ops = lambda *a, **k: fault.edit(real_get_ops(*a, **k))
    try:
        llm = LLM(EngineArgs(model=str(path), max_seq_len=16,
                             backend_options={"enable_batching": True, "max_batch_size": max_batch_size,
                                              "background_thread": False}))
    finally:
        pocketllm.op_table.get_ops = real_get_ops
    s = llm.scheduler
    work = plan(requests, llm.model_config.vocab_size, rng, fault_rate, cancel_rate)
    callback_calls = [0] * len(work)
    deltas: dict[int, list[int]] = {}  # request id -> indices its on_token saw
    problems: list[str] = []

    def callback_for(index: int, item: Planned):
        def callback(result):
            callback_calls[index] += 1
            if item.streamed and deltas.get(result.request_id, []) != list(range(len(result.token_ids))):
                problems.append(f"request {result.request_id}: deltas {deltas.get(result.request_id, [])} before "
                                f"its result of {len(result.token_ids)} tokens")
            if item.cancels_another and pending:
                s.cancel_request(pending[0])  # back into the scheduler, from its own delivery
            if item.callback_error is not None:
                raise item.callback_error("raised by a soak callback")
        return callback

    def on_token(delta) -> None:
        deltas.setdefault(delta.request_id, []).append(delta.index)

    # Streaming bookkeeping: per-request state is preallocated, results are checked as they are
    # collected and kept only for the serial sample, so memory growth is the engine's own.
    serial_ids = set(rng.sample(range(len(work)), min(serial_sample * 3, len(work))))
    kept: dict[int, object] = {}
    reasons = dict.fromkeys(TERMINAL, 0)
    index_of: dict[int, int] = {}
    pending: list[int] = []  # submitted ids not yet collected, in order
    cancels: dict[int, list[int]] = {}  # step -> ids to cancel then
    preempts: dict[int, list[int]] = {}  # step -> ids to preempt then
    policies = [s.policy, dataclasses.replace(s.policy, prefix_reuse=not s.policy.prefix_reuse),
                dataclasses.replace(s.policy, max_num_batched_tokens=s.policy.max_num_batched_tokens + 7)]
    reconfigured = 0
    step = 0
    rss_warm = None
    start = time.perf_counter()
    next_item = 0

    def collect(rid: int, result) -> None:
        i = index_of.pop(rid)
        item = work[i]
        reason = result.finish_reason
        reasons[reason] = reasons.get(reason, 0) + 1
        if reason not in TERMINAL:
            problems.append(f"request {rid}: no terminal state ({reason!r})")
        if reason == "error" and not item.faulty:
            problems.append(f"request {rid} without a fault ended with error: {result.error}")
        if item.faulty and reason not in ("error", "cancelled"):
            problems.append(f"request {rid} carried a fault but ended {reason}")
        if item.streamed and deltas.pop(rid, []) != list(range(len(result.token_ids))):
            problems.append(f"request {rid}: its deltas are not its {len(result.token_ids)} tokens in order")
        if i in serial_ids and reason in ("stop", "length"):
            kept[i] = result

    while next_item < len(work):
        if not s.has_work:  # idle: another policy, with the same cuts (so the same bits)
            s.configure(policies[reconfigured % len(policies)])
            reconfigured += 1
        for _ in range(rng.randint(0, 2 * max_batch_size // 3 + 1)):
            if next_item == len(work):
                break
            item = work[next_item]
            callback = callback_for(next_item, item) if item.has_callback else None
            rid = s.submit_request(item.prompt, item.params, callback, on_token=on_token if item.streamed else None)
            index_of[rid] = next_item
            pending.append(rid)
            if item.cancel_after is not None:
                cancels.setdefault(step + item.cancel_after, []).append(rid)
            if item.preempt_after is not None:
                preempts.setdefault(step + item.preempt_after, []).append(rid)
            next_item += 1
        for rid in cancels.pop(step, []):
            s.cancel_request(rid)
        for rid in preempts.pop(step, []):
            s.preempt(rid)
        s.step()
        step += 1
        still = []
        for rid in pending:
            result = s.poll_result(rid)
            if result is None:
                still.append(rid)
            else:
                collect(rid, result)
        pending = still
        if rss_warm is None and next_item >= len(work) // 10:
            rss_warm = rss_bytes()
    s.stop(drain=True)  # what is left runs to its end
    for rid in pending:
        collect(rid, s.poll_result(rid))
    elapsed = time.perf_counter() - start
    rss_end = rss_bytes()
    stats = s.get_stats()

    for i, item in enumerate(work):
        if callback_calls[i] != (1 if item.has_callback else 0):
            problems.append(f"request #{i}: callback ran {callback_calls[i]} times")
    if llm.slots.num_free != max_batch_size or stats.running or stats.waiting or stats.swap_bytes_held:
        problems.append(f"leak: {llm.slots.num_free}/{max_batch_size} slots free, {stats.running} running, "
                        f"{stats.waiting} waiting, {stats.swap_bytes_held} swap bytes held")
    counted = stats.finished + stats.cancelled + stats.errored
    if counted != len(work) or sum(reasons.values()) != len(work):
        problems.append(f"{counted} terminal states counted, {sum(reasons.values())} collected, for {len(work)}")
    expected_callback_errors = sum(1 for item in work if item.callback_error is not None)
    if stats.callback_errors != expected_callback_errors:
        problems.append(f"callback_errors {stats.callback_errors}, expected {expected_callback_errors}")

    sample = sorted(kept)[:serial_sample]
    serial = LLM(EngineArgs(model=str(path), max_seq_len=16, backend_options={"max_batch_size": 1}))
    for i in sample:
        got, want = kept[i], serial.generate(work[i].prompt, work[i].params)
        if (got.token_ids, got.logprobs, got.finish_reason) != (want.token_ids, want.logprobs, want.finish_reason):
            problems.append(f"request #{i} differs from its serial run")
    llm.close()
    return {
        "requests": len(work), "steps": step, "seconds": round(elapsed, 2),
        "requests_per_s": round(len(work) / elapsed, 1),
        "faulty_requests": sum(item.faulty for item in work), "fault_strikes": fault.strikes,
        "errored": stats.errored, "cancelled": stats.cancelled, "finished": stats.finished,
        "callbacks": sum(item.has_callback for item in work), "raising_callbacks": expected_callback_errors,
        "generated_tokens": stats.generated_tokens, "serial_checked": len(sample),
        "preemptions": stats.preemptions, "streamed": sum(item.streamed for item in work),
        "reconfigured": reconfigured,
        "rss_after_warmup_mib": round(rss_warm / 2**20, 1), "rss_end_mib": round(rss_end / 2**20, 1),
        "rss_growth_mib": round((rss_end - rss_warm) / 2**20, 2),
        "problems": problems,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-batch-size", type=int, default=8)
    parser.add_argument("--serial-sample", type=int, default=100)
    parser.add_argument("--rss-bound-mib", type=float, default=64.0)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.CRITICAL)  # the injected faults and raising callbacks are logged by design
    with tempfile.TemporaryDirectory() as tmp:
        path = write_checkpoint(Path(tmp) / "tiny", "tiny", seed=0)
        report = soak(path, args.requests, args.seed, args.max_batch_size, serial_sample=args.serial_sample)
    if report["rss_growth_mib"] > args.rss_bound_mib:
        report["problems"].append(f"resident memory grew {report['rss_growth_mib']} MiB > {args.rss_bound_mib} MiB")
    report["rss_bound_mib"] = args.rss_bound_mib
    for key, value in report.items():
        if key != "problems":
            print(f"{key:>24}: {value}")
    print(f"{'problems':>24}: {len(report['problems'])}")
    for problem in report["problems"][:20]:
        print(f"  {problem}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak.json").write_text(json.dumps(report, indent=2) + "\n")
    return 1 if report["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
