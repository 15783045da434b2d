"""`pocketllm bench --scheduling --quick`: the three workloads run on and off and the report says what
each did (no timing is asserted: timings belong to the benchmark's report)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from pocketllm.bench.command import main


@pytest.mark.slow
def test_scheduling_quick_writes_report(tmp_path: Path) -> None:
    assert main(["--scheduling", "--quick", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "scheduling.json").read_text())
    size = report["size"]
    assert [m["preset"] for m in report["models"]] == ["tiny", "qwen3.5-tiny"]
    for model in report["models"]:
        off, on = model["shared_prefixes"]
        assert (off["prefix_reuse"], on["prefix_reuse"]) == (False, True)
        assert off["prefix_hits"] == off["prefix_tokens_reused"] == 0
        # Every question after the first on each system prompt finds it (retained or copied).
        later = size["systems"] * (size["questions"] - 1)
        assert on["prefix_hits"] >= later and on["prefix_tokens_reused"] >= later * size["system_len"]
        assert on["prefill_tokens_run"] < off["prefill_tokens_run"]
        for run in (off, on):
            assert run["requests"] == size["systems"] * size["questions"] and run["tokens_per_s"] > 0
        unchunked, chunked = model["long_prompt"]
        assert (unchunked["chunked"], chunked["chunked"]) == (False, True)
        for run in (unchunked, chunked):
            assert 0 < run["itl_p50_s"] <= run["itl_p99_s"] <= run["itl_max_s"] and run["long_ttft_s"] > 0
        cold, warm = model["multi_turn"]  # the runner checked that their answers agree
        assert (cold["prefix_reuse"], warm["prefix_reuse"]) == (False, True) and cold["prefix_tokens_reused"] == 0
        assert warm["prefill_tokens_run"] + warm["prefix_tokens_reused"] == cold["prefill_tokens_run"]
        assert warm["exact_positions"] is True  # both families, since Gated DeltaNet layers are exact too
        # Turns 2..4 reuse the previous prompt and answer (all but its last token, never fed) to the
        # token on both families: the hybrid from the states its slot kept where the last turn ended.
        turn = size["user_len"] + size["new_tokens"]
        previous = [size["system_len"] + size["user_len"] + t * turn for t in range(size["turns"] - 1)]
        answered = [p + size["new_tokens"] - 1 for p in previous]
        assert warm["prefix_tokens_reused"] == size["conversations"] * sum(answered)
    text = (tmp_path / "scheduling.md").read_text()
    assert "| qwen3.5-tiny | on (64 tokens) |" in text and "| tiny | on |" in text
    assert (tmp_path / "scheduling.png").is_file() == (importlib.util.find_spec("matplotlib") is not None)
