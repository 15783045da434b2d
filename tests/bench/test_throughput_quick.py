"""The throughput benchmark's code paths run in CI: `--quick` end to end, in process.

No timing is asserted: numbers depend on the machine; only that every run measured something
and every output was written.
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("matplotlib")

from pocketllm.benchmark import main  # noqa: E402

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def one_torch_thread():
    """The test checks code paths, not speed. On a CPU shared with other work, two OpenMP threads
    wait on each other and slow this tiny model down many times over; one thread keeps it quick."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_quick_benchmark_writes_report_and_plots(tmp_path, one_torch_thread):
    assert main(["--quick", "--out", str(tmp_path)]) == 0

    report = json.loads((tmp_path / "throughput.json").read_text())
    assert {"machine", "config", "workloads", "latency", "seed_table", "vs_transformers", "runs"} <= set(report)
    assert {"platform", "processor", "torch", "torch_threads"} <= set(report["machine"])
    assert set(report["workloads"]) == {"fixed", "random", "heavy_tail"}
    assert set(report["latency"]) == {"serial_s", "batched_thread_s", "batched_caller_s"}

    runs = report["runs"]
    for name, workload in report["workloads"].items():
        pocketllm = {(r["mode"], r["batch_size"]) for r in runs if r["workload"] == name and r["engine"] == "pocketllm"}
        assert pocketllm == {("serial", 1), ("batched", 1), ("batched", 2), ("batched", 4)}
        assert all(r["output_tokens"] == sum(workload["output_lens"]) for r in runs if r["workload"] == name)
    for run in runs:
        assert run["tokens_per_s"] > 0, run
        assert run["wall_s"] > 0 and len(run["ttft_s"]) == run["requests"], run
    if report["config"]["transformers_baselines"]:
        assert {r["batch_size"] for r in runs if r["engine"] == "transformers"} == {1, 2, 4}
        assert report["vs_transformers"]["ratio"] > 0

    for name in ("throughput_vs_concurrency.png", "ttft_distribution.png", "slot_timeline.png"):
        data = (tmp_path / name).read_bytes()
        assert data.startswith(PNG_SIGNATURE) and len(data) > 1000, name

    md = (tmp_path / "throughput.md").read_text()
    assert "## The seed's table" in md
    assert "| single-request latency, batched (background thread) / serial |" in md
    assert "| single-request latency, batched (caller-driven step()) / serial |" in md
    for concurrency, goal in ((2, "1.7"), (4, "3.0")):
        assert f"| concurrency {concurrency} / 1 |" in md and f">= {goal}x" in md
