"""The kernel benchmark's code paths run in CI: `bench/kernel_rooflines.py --smoke` on the interpreter."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pocketllm.lab.launches import OPS

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_kernel_bench_smoke_writes_report(tmp_path):
    """Every op's Triton kernel is timed beside its other implementations, which agree with it;
    JSON and Markdown are written."""
    subprocess.run([sys.executable, str(ROOT / "bench" / "kernel_rooflines.py"), "--smoke", "--out", str(tmp_path)],
                   check=True, cwd=ROOT, timeout=600, capture_output=True)
    report = json.loads((tmp_path / "kernels.json").read_text())
    assert {row["op"] for row in report["rows"]} == set(OPS)
    assert report["interpreted"] is True and "Triton interpreter" in " ".join(report["notes"])
    for row in report["rows"]:
        if row["impl"] == "recurrent" and row["call"].endswith("exact replay"):  # it keeps no replay buffers
            assert "replay must be None" in row["note"], row
            continue
        if row["impl"].startswith("bf16_dot"):  # bf16 weights only: the launch shapes' fp32 ones refused by name
            assert ("takes fp32 x and bias and a bf16 weight" in row["note"]  # the linear layers
                    or "takes fp32 x and bf16 experts" in row["note"]), row  # the experts
            continue
        assert row["time_us"] > 0 and row["bytes"] > 0 and row["bound_us"] > 0, row
        if row["impl"] == "triton":
            assert row["timer"] == "interpreter", row
        else:
            assert row["max_diff"] < 1e-3, row
    assert "| decode_attention " in (tmp_path / "kernels.md").read_text()
