"""`pocketllm bench --speculative --quick`: every method on both workloads and batches, the report says
what each did, and every row's output is bitwise the output without speculation (no timing is
asserted: timings belong to the benchmark's report)."""

from __future__ import annotations

import json
from pathlib import Path

from pocketllm.bench.command import main
from pocketllm.bench.speculative import SIZES


def test_speculative_quick_writes_report(tmp_path: Path) -> None:
    assert main(["--speculative", "--quick", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "speculative.json").read_text())
    assert [m["preset"] for m in report["models"]] == list(SIZES["quick"].presets)
    for model in report["models"]:
        rows = model["rows"]
        assert len(rows) == 5 * 2 * len(SIZES["quick"].batches)
        assert all(r["bits_equal"] for r in rows)
        for r in rows:
            assert 0 <= r["spec_accepted_tokens"] <= r["spec_draft_tokens"] and r["tokens_per_s"] > 0
        none = [r for r in rows if r["method"] == "none"]
        assert all(r["spec_draft_tokens"] == 0 and r["vs_none"] == 1.0 for r in none)
        oracle = [r for r in rows if r["method"] == "oracle k=8"]
        assert all(r["spec_accepted_tokens"] == r["spec_draft_tokens"] > 0 for r in oracle)
    assert "| oracle k=8 |" in (tmp_path / "speculative.md").read_text()
