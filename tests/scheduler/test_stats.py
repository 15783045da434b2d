"""SchedulerStats from get_stats(): counts and token sums agree with the results, latency
percentiles are consistent; and the nearest-rank percentile helper."""

from __future__ import annotations

import pytest

from pocketllm import SamplingParams
from pocketllm.scheduler import SchedulerStats
from pocketllm.scheduler.stats import percentile


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("values, q, expected", [
    # The classic nearest-rank example: 15, 20, 35, 40, 50 (given unsorted).
    ([40, 15, 50, 35, 20], 0, 15),
    ([40, 15, 50, 35, 20], 5, 15),
    ([40, 15, 50, 35, 20], 30, 20),
    ([40, 15, 50, 35, 20], 40, 20),
    ([40, 15, 50, 35, 20], 50, 35),
    ([40, 15, 50, 35, 20], 99, 50),
    ([40, 15, 50, 35, 20], 100, 50),
    # 10 values: rank = ceil(n q / 100).
    ([float(v) for v in range(10, 0, -1)], 90, 9.0),
    ([float(v) for v in range(10, 0, -1)], 91, 10.0),
    ([float(v) for v in range(10, 0, -1)], 10, 1.0),
    ([float(v) for v in range(10, 0, -1)], 11, 2.0),
    # Fractional q: 8 * 12.5 / 100 == 1 exactly, 8 * 12.6 / 100 rounds up to 2.
    ([0.8, 0.1, 0.5, 0.3, 0.2, 0.7, 0.4, 0.6], 12.5, 0.1),
    ([0.8, 0.1, 0.5, 0.3, 0.2, 0.7, 0.4, 0.6], 12.6, 0.2),
    ([3.5], 50, 3.5),
    ([], 50, 0.0),
])
def test_percentile_nearest_rank(values, q, expected):
    """percentile() is the nearest-rank percentile (hand-computed values), 0.0 for no values."""
    assert percentile(values, q) == expected


def test_percentile_does_not_reorder_its_input():
    """percentile() sorts a copy: the caller's list is left as it was."""
    values = [3.0, 1.0, 2.0]
    percentile(values, 50)
    assert values == [3.0, 1.0, 2.0]


def test_initial_stats_are_zero(make_llm):
    """A fresh scheduler reports zero everywhere."""
    stats = make_llm().scheduler.get_stats()
    assert isinstance(stats, SchedulerStats)
    assert (stats.waiting, stats.running, stats.finished, stats.cancelled, stats.errored) == (0, 0, 0, 0, 0)
    assert (stats.prompt_tokens, stats.generated_tokens, stats.steps) == (0, 0, 0)
    assert (stats.prefill_batches, stats.decode_batches, stats.callback_errors) == (0, 0, 0)
    assert stats.busy_time_s == 0.0 and stats.tokens_per_s == 0.0
    assert stats.ttft_p50_s == stats.ttft_p99_s == stats.total_time_p50_s == stats.total_time_p99_s == 0.0


def test_stats_agree_with_results(make_llm, recorder, drain, monkeypatch):
    """After a mixed workload (length, stop, cancelled waiting and running, errored) the counts,
    prompt/generated token sums, steps and batch counts equal what the results and the forwards
    show; latency stats are the mean and nearest-rank percentiles of the results' own latencies."""
    llm = make_llm(max_batch_size=2)
    s = llm.scheduler
    submitted: list[tuple[int, list[int]]] = []
    collected = {}
    steps = 0

    def submit(prompt, params):
        submitted.append((s.submit_request(prompt, params), prompt))
        return submitted[-1][0]

    def step():
        nonlocal steps
        s.step()
        steps += 1

    # 1) an errored request: its prefill forward raises
    real_run = llm.runner.run

    def failing(seqs):
        raise RuntimeError("boom")

    monkeypatch.setattr(llm.runner, "run", failing)
    submit([9, 9, 9], greedy(3))
    step()
    monkeypatch.setattr(llm.runner, "run", real_run)
    rec = recorder(llm)  # records every later forward

    # 2) a seeded probe ("length"), whose 4th token becomes the stop token of a later request
    probe = submit([1, 2, 3], SamplingParams(max_tokens=6, temperature=1.0, seed=11, ignore_eos=True))
    while s.has_work:
        step()
    collected[probe] = s.poll_result(probe)
    stop_token = collected[probe].token_ids[3]

    # 3) cancelled-running, length, cancelled-waiting, stop
    running_victim = submit([6], greedy(6))
    submit([4, 5], greedy(4))
    waiting_victim = submit([7, 8, 9, 10], greedy(2))
    submit([1, 2, 3], SamplingParams(max_tokens=6, temperature=1.0, seed=11, ignore_eos=True,
                                     stop_token_ids=(stop_token,)))
    step()
    assert s.cancel_request(waiting_victim)
    step()
    assert s.cancel_request(running_victim)
    while s.has_work:
        step()
    assert drain(s) == 0

    stats = s.get_stats()
    results = [collected[rid] if rid in collected else s.poll_result(rid) for rid, _ in submitted]
    reasons = [r.finish_reason for r in results]
    assert sorted(reasons) == sorted(["error", "length", "stop", "length", "cancelled", "cancelled"])
    assert stats.finished == reasons.count("stop") + reasons.count("length") == 3
    assert stats.cancelled == reasons.count("cancelled") == 2
    assert stats.errored == reasons.count("error") == 1
    assert (stats.waiting, stats.running) == (0, 0)
    assert stats.prompt_tokens == sum(len(p) for _, p in submitted)
    assert stats.generated_tokens == sum(len(r.token_ids) for r in results) > 0
    assert stats.steps == steps
    assert stats.prefill_batches == 1 + len(rec.prefills())
    assert stats.decode_batches == len(rec.decodes())
    assert stats.callback_errors == 0

    ttfts = [r.ttft_s for r in results if r.ttft_s is not None]
    totals = [r.total_time_s for r in results]
    assert len(ttfts) == 4  # the errored request and the waiting-cancelled one never got a token
    assert stats.ttft_p50_s == percentile(ttfts, 50) and stats.ttft_p99_s == percentile(ttfts, 99)
    assert stats.total_time_p50_s == percentile(totals, 50) and stats.total_time_p99_s == percentile(totals, 99)
    assert stats.ttft_mean_s == pytest.approx(sum(ttfts) / len(ttfts))
    assert stats.total_time_mean_s == pytest.approx(sum(totals) / len(totals))
    assert 0 < stats.ttft_p50_s <= stats.ttft_p99_s
    assert 0 < stats.total_time_p50_s <= stats.total_time_p99_s
    assert min(ttfts) <= stats.ttft_mean_s <= max(ttfts)
    assert all(0 < t <= r.total_time_s for r in results if (t := r.ttft_s) is not None)
    assert stats.busy_time_s > 0
    assert stats.tokens_per_s == pytest.approx(stats.generated_tokens / stats.busy_time_s)


def test_stats_count_steps_without_work(make_llm):
    """A step with nothing to do is counted as a step but runs no forward and adds no busy time."""
    s = make_llm().scheduler
    assert s.step() is False
    stats = s.get_stats()
    assert (stats.steps, stats.prefill_batches, stats.decode_batches, stats.busy_time_s) == (1, 0, 0, 0.0)
    s.submit_request([1], greedy(1))
    assert s.step() is True
    assert s.get_stats().steps == 2 and s.get_stats().busy_time_s > 0
