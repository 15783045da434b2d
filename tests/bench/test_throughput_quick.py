"""The throughput benchmark's code paths run in CI: `--quick` end to end, in process.

No timing is asserted: numbers depend on the machine; only that every run measured something
and every output was written.
"""

from __future__ import annotations

import json
import sys

import pytest

from pocketllm.bench import command, main
from pocketllm.bench.workloads import summarize

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_quick_benchmark_writes_report_and_plots(tmp_path, single_torch_thread):
    pytest.importorskip("matplotlib")
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


def test_plain_install_writes_report_says_what_it_skipped(tmp_path, monkeypatch, capsys):
    """Without matplotlib and transformers (a plain `pip install pocketllm`), the benchmark writes
    its JSON and Markdown, names what it skipped and the extra that brings it, and exits 0. The
    runs are stubbed: this test is about what the benchmark does without the extras."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "transformers", None)

    def fake_runs(path, scale, workloads, hf_model, timeline):
        assert hf_model is None
        runs = []
        for w in workloads:
            samples = [(0.01, 0.1, n) for n in w.output_lens]
            runs.append(summarize(w, "pocketllm", "serial", 1, 1.0, samples))
            runs += [summarize(w, "pocketllm", "batched", c, 1.0 / c, samples) for c in scale.concurrencies]
        return {"serial_s": 1.0, "batched_thread_s": 1.0, "batched_caller_s": 1.0}, runs

    monkeypatch.setattr(command, "run_all", fake_runs)
    assert main(["--quick", "--out", str(tmp_path)]) == 0

    err = capsys.readouterr().err
    assert "skipping plots: matplotlib is not installed: pip install 'pocketllm[plot]'" in err
    assert "skipping transformers baseline: transformers is not installed: pip install 'pocketllm[baseline]'" in err
    report = json.loads((tmp_path / "throughput.json").read_text())
    assert set(report["skipped"]) == {"plots", "transformers_baseline"}
    assert report["vs_transformers"] is None and not report["config"]["transformers_baselines"]
    md = (tmp_path / "throughput.md").read_text()
    assert "## The seed's table" in md
    assert "Skipped plots: matplotlib is not installed: pip install 'pocketllm[plot]'." in md
    assert not list(tmp_path.glob("*.png"))


@pytest.mark.slow
def test_real_shapes_quick_writes_every_point(tmp_path, monkeypatch, single_torch_thread):
    """`pocketllm bench --real-shapes --quick`: both model families, transformers and every pocketllm
    configuration at every point, verdicts against the goals, JSON, Markdown and the plot."""
    monkeypatch.setenv("POCKETLLM_CACHE", str(tmp_path / "cache"))
    assert main(["--real-shapes", "--quick", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "real_shapes.json").read_text())
    from pocketllm.bench.real_shapes import CONFIGS, GOALS, kernel_info

    avx512 = kernel_info()["fixed_order"] == "avx512"
    ran = [name for name, config in CONFIGS.items() if avx512 or not config.needs_avx512]
    assert report["kernels"] == kernel_info() and report["machine"]["processor"]
    assert [m["preset"] for m in report["models"]] == ["tiny", "qwen3.5-tiny"]
    for model in report["models"]:
        assert [p["engine"] for p in model["points"]] == ["transformers", "transformers (bf16)", *ran]
        for point in model["points"]:
            assert point["decode_tpot_s"] > 0 and point["batched_tokens_per_s"] > 0 and point["prefill_s"] > 0
        bf16 = next(p for p in model["points"] if p["engine"] == "pocketllm (bf16 weights)")
        assert 2 * bf16["bytes_per_token"] == model["bytes_per_token"]
        verdicts = model["verdicts"]
        assert set(GOALS) <= set(verdicts) and verdicts["bandwidth_limit_tokens_per_s"] > 0
        assert set(verdicts["decode_1"]["ratio"]) == set(ran)
    assert report["read_bandwidth_gb_s"] > 0
    assert "| batch-1 decode |" in (tmp_path / "real_shapes.md").read_text()
    from pocketllm.bench.real_shapes import first_divergence

    for model in report["models"]:  # every pocketllm configuration's greedy tokens against transformers'
        assert set(first_divergence(model)) == set(ran)
    assert "Greedy batch-1 decode against transformers" in (tmp_path / "real_shapes.md").read_text()
    assert (tmp_path / "real_shapes.png").read_bytes().startswith(PNG_SIGNATURE)
