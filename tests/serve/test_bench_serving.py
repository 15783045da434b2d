"""`pocketllm bench --serving --quick`: both sides run, the same tokens, the report written."""

from __future__ import annotations

import json

import pytest

from pocketllm.bench.command import main


@pytest.mark.slow
def test_serving_benchmark_quick(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("POCKETLLM_CACHE", str(tmp_path / "cache"))
    assert main(["--serving", "--quick", "--clients", "2", "--out", str(tmp_path / "out")]) == 0
    report = json.loads((tmp_path / "out" / "serving.json").read_text())
    assert [s["name"] for s in report["sides"]] == ["in-process", "http"]
    assert report["same_tokens"] == report["config"]["requests"] == 4
    assert "HTTP / in-process tokens/s" in capsys.readouterr().out
