"""The end-to-end benchmark and the GPU check's summary run in CI: `bench/e2e.py --smoke` on CPU,
`bench/gpu_summary.py` on synthetic step outputs, and the GPU check script parses."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_SPEC = importlib.util.spec_from_file_location("gpu_summary", ROOT / "bench" / "gpu_summary.py")
assert _SPEC is not None and _SPEC.loader is not None
gpu_summary = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(gpu_summary)


@pytest.mark.slow
def test_e2e_smoke_writes_report(tmp_path: Path) -> None:
    """The tiny preset on the torch backend: every number is positive; JSON and Markdown are written."""
    subprocess.run([sys.executable, str(ROOT / "bench" / "e2e.py"), "--smoke", "--out", str(tmp_path)],
                   check=True, cwd=ROOT, timeout=120, capture_output=True)
    report = json.loads((tmp_path / "e2e.json").read_text())
    assert (report["backend"], report["dtype"], report["device"]) == ("torch", "float32", "cpu")
    (model,) = report["models"]
    assert model["preset"] == "tiny" and model["batched_requests"] == 8
    for key in ("prefill_ttft_s", "prefill_tokens_per_s", "decode_1_tpot_s", "decode_1_tokens_per_s",
                "batched_wall_s", "batched_tokens_per_s"):
        assert model[key] > 0, key
    assert "| tiny |" in (tmp_path / "e2e.md").read_text()


def test_gpu_check_script_parses() -> None:
    subprocess.run(["bash", "-n", str(ROOT / "bench" / "gpu_check.sh")], check=True)


def test_gpu_summary_of_synthetic_steps(tmp_path: Path) -> None:
    """Failing compile rows are counted and listed, a step's rc decides ok, a missing file is None."""
    (tmp_path / "device.txt").write_text("2.11.0 NVIDIA H200\n")
    (tmp_path / "gpu_tests.txt").write_text("...\n12 passed in 40.0s\n")
    compile_row = {"op": "rms_norm", "kernel": "_rms_norm", "shape": "[8, 1024]", "target": "sm_90", "regs": 32,
                   "stack": 0, "shared": 0, "num_warps": 4, "ok": True, "reason": ""}
    (tmp_path / "compile.json").write_text(json.dumps([compile_row, {**compile_row, "ok": False, "reason": "spills"}]))
    (tmp_path / "kernels.json").write_text(json.dumps({"rows": [
        {"op": "rms_norm", "call": "decode", "impl": "triton", "time_us": 4.0, "pct_bound": 50.0},
        {"op": "rms_norm", "call": "decode", "impl": "torch", "time_us": 9.0, "pct_bound": 22.0}]}))
    summary = gpu_summary.gather(tmp_path, {"tests": 0, "kernels": 0, "compile": 1, "e2e": 124})
    assert summary["device"] == "2.11.0 NVIDIA H200" and summary["gpu_tests"] == "12 passed in 40.0s"
    assert not summary["ok"] and summary["steps"]["e2e"] == {"rc": 124, "ok": False}
    assert summary["compile"]["kernels"] == 2 and summary["compile"]["failing"] == 1
    assert summary["compile"]["failures"] == ["sm_90 rms_norm _rms_norm [[8, 1024]]: spills"]
    assert summary["kernels"] == [{"op": "rms_norm", "call": "decode", "time_us": 4.0, "pct_bound": 50.0}]
    assert summary["e2e"] is None
    text = gpu_summary.markdown(summary)
    assert "| e2e | 124 | FAIL |" in text and "1 failing" in text and "| rms_norm | decode | 4.0 | 50 |" in text

    assert gpu_summary.main(["--out", str(tmp_path), "--rc", "tests=0"]) == 0
    assert json.loads((tmp_path / "summary.json").read_text())["ok"] is True
    assert (tmp_path / "summary.md").is_file()
