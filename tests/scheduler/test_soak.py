"""Soak, CI size: 2000 mixed requests on the tiny preset (random cancels and preemptions, streamed
tokens, raising callbacks and callbacks that cancel others, policy changes while idle, injected
sampler faults, a draining stop) through bench/soak.py; `python bench/soak.py` runs the large size."""

from __future__ import annotations

from .soak_loader import load

REQUESTS = 2000
RSS_BOUND_MIB = 32  # resident memory growth allowed after warm-up (measured: under 1 MiB)


def test_soak_every_promise_holds(tiny_checkpoint):
    """Exactly one terminal state per request (callbacks once each), errors exactly for the
    requests carrying a fault, no leaked slot, bounded memory growth, and a sample of survivors
    bitwise equal to their serial runs."""
    report = load().soak(tiny_checkpoint, REQUESTS, seed=1, serial_sample=20)
    assert report["problems"] == []
    assert report["requests"] == REQUESTS
    assert report["faulty_requests"] > 0 and report["errored"] > 0 and report["cancelled"] > 0
    assert report["raising_callbacks"] > 0 and report["serial_checked"] == 20
    assert report["preemptions"] > 0 and report["streamed"] > 0 and report["reconfigured"] > 0
    assert report["rss_growth_mib"] < RSS_BOUND_MIB, report
