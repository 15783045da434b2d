"""`pocketllm bench --tensor-parallel --quick`: every configuration on the tiny MoE preset; the report
says the tree's rows (one process, TP=2, EP=2) give one process's bits and counts what rank 0 sent."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pocketllm.bench import main


@pytest.mark.slow
def test_tensor_parallel_quick_writes_report(tmp_path: Path) -> None:
    assert main(["--tensor-parallel", "--quick", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "tensor_parallel.json").read_text())
    configs = report["models"][0]["configs"]
    assert set(configs) == {"TP=1, no tree", "TP=1, tree", "TP=2, tree", "TP=2, plain all-reduce", "EP=2, tree",
                            "EP=2, plain all-reduce"}
    assert all(row["same_as_tree"] for name, row in configs.items() if name.endswith(", tree"))
    assert configs["TP=1, tree"]["bytes_per_decode_step"] == 0
    assert configs["EP=2, tree"]["bytes_per_decode_step"] < configs["TP=2, tree"]["bytes_per_decode_step"]
    assert "| qwen3-moe-tiny | EP=2, tree |" in (tmp_path / "tensor_parallel.md").read_text()
