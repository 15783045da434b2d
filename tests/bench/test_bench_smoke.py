"""The kernel benchmark's code paths run in CI: `bench/kernels.py --smoke` on the interpreter."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_kernel_bench_smoke_writes_report(tmp_path):
    """Every kernel is timed and checked against its reference; JSON and Markdown are written."""
    subprocess.run([sys.executable, str(ROOT / "bench" / "kernels.py"), "--smoke", "--out", str(tmp_path)],
                   check=True, cwd=ROOT, timeout=600, capture_output=True)
    report = json.loads((tmp_path / "kernels.json").read_text())
    ops = {row["op"].split()[0] for row in report["rows"]}
    assert ops == {"decode_attention", "prefill_attention", "linear", "rms_norm", "silu_and_mul", "rope_write_kv",
                   "sample", "conv1d_prefill", "conv1d_decode", "gated_delta_prefill", "gated_delta_decode",
                   "rms_norm_gated"}
    assert report["interpreted"] is True
    for row in report["rows"]:
        assert row["kernel_ms"] > 0
        assert row["max_abs_err_vs_reference"] < 1e-3, row
    assert "| decode_attention |" in (tmp_path / "kernels.md").read_text()
