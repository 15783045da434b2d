"""`pocketllm lab check`: a variant defined outside the package gets its verdict with no edit to
pocketllm/, and broken variants fail with the name of the check they fail and by how much."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pocketllm.cli import main
from pocketllm.lab.check import check, check_kernel
from pocketllm.testing.cases import op_cases, split_member

FP32 = (torch.float32,)
ROOT = Path(__file__).resolve().parents[2]


def test_a_correct_variant_passes_every_check():
    verdict = check("silu_and_mul", "lab_variants:silu_and_mul_split", vs=["triton"], dtypes=FP32, examples=3,
                    presets=("tiny",))
    checks = [name for name, _, _ in verdict.summary()]
    assert verdict.ok, verdict.table()
    assert checks == ["empty batch", "reference", "vs triton", "batch invariance", "engine invariance property",
                      "greedy parity vs transformers"]


def test_the_engine_checks_run_on_every_model_family_that_calls_the_op():
    from pocketllm.lab.check import engine_presets

    assert engine_presets("silu_and_mul") == ("tiny", "qwen3.5-tiny")
    assert engine_presets("gated_delta_decode") == ("qwen3.5-tiny",)


def test_one_key_short_fails_the_reference_check_with_the_size_of_the_error():
    verdict = check_kernel("decode_attention", "lab_variants:decode_attention_one_key_short", dtypes=FP32)
    failed = {f.check for f in verdict.findings if not f.ok}
    assert failed == {"reference"}
    assert "max |diff|" in verdict.table() and "FAIL" in verdict.table()


def test_a_batch_dependent_tile_fails_batch_invariance_only():
    verdict = check_kernel("linear", "lab_variants:linear_batch_tiled", dtypes=FP32)
    failed = {f.check for f in verdict.findings if not f.ok}
    assert failed == {"batch invariance"}
    assert "differ in their bits" in verdict.table()


def test_split_invariance_catches_a_prefill_that_depends_on_the_piece():
    """A prefill attention whose first row of each piece rounds differently (a defect planted by
    construction, so on every machine) fails the split check and nothing else; the Triton kernel,
    split invariant by construction (key blocks aligned to absolute positions), passes it."""
    planted = check_kernel("prefill_attention", "lab_variants:prefill_attention_piece_dependent", dtypes=FP32)
    failed = [f for f in planted.findings if not f.ok]
    assert {f.check for f in failed} == {"split invariance"}, planted.table()
    assert all("differ in their bits" in f.detail for f in failed)
    # The kernel on the case with the most cuts (the interpreter is slow; the kernel's own split
    # tests cover the rest of the grid).
    case = max(op_cases("prefill_attention", FP32), key=lambda c: sum(split_member(m) is not None for m in c.members))
    kernel = check_kernel("prefill_attention", "triton", cases=[case])
    split = [f for f in kernel.findings if f.check == "split invariance"]
    assert split and all(f.ok for f in split), kernel.table()


def test_cli_exit_status_and_table(capsys):
    code = main(["lab", "check", "decode_attention", "--impl", "lab_variants:decode_attention_one_key_short",
                 "--examples", "0", "--no-parity", "--dtypes", "float32"])
    out = capsys.readouterr().out
    assert code == 1
    assert "| reference |" in out and "failed:" in out and "reference [" in out
    code = main(["lab", "check", "silu_and_mul", "--impl", "lab_variants:silu_and_mul_split", "--examples", "0",
                 "--no-parity", "--dtypes", "float32"])
    assert code == 0, capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["decode_attention", "--impl", "lab_variants:decode_attention_wrong_signature"], "missing parameter 'scale'"),
    (["decode_attention", "--impl", "lab_variants:nothing_here"], "has no attribute 'nothing_here'"),
    (["decode_attention", "--impl", "no_such"], "must be one of ('ref', 'fused', 'triton', 'split_kv', 'own_order')"),
    (["decode_attention", "--examples", "-1"], "--examples must be >= 0"),
])
def test_cli_errors_name_the_problem(argv, message, capsys):
    assert main(["lab", "check", *argv, "--no-parity"]) == 2
    assert message in capsys.readouterr().err


def test_cli_rejects_an_unknown_op(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["lab", "check", "flash_attention"])
    assert exc.value.code == 2
    assert "invalid choice: 'flash_attention'" in capsys.readouterr().err


QUICK_CLI = ["--examples", "1", "--no-parity", "--dtypes", "float32"]


def _lab_check(capsys, impl: str, *argv: str) -> tuple[int, str, str]:
    """`pocketllm lab check silu_and_mul --impl IMPL` in-process: (exit status, stdout, stderr).
    A SystemExit or KeyboardInterrupt escaping main is what a shell would see as an exit status
    with no verdict; it is returned as one (0 and 130), so the test says what went wrong."""
    try:
        code = main(["lab", "check", "silu_and_mul", "--impl", impl, *QUICK_CLI, *argv])
    except SystemExit as exc:
        code = exc.code
    except KeyboardInterrupt:
        code = -130  # escaped as a traceback
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_an_implementation_that_raises_fails_each_check_with_its_exception(capsys):
    """The op-level checks, the engine property (whose engines call the op at start-up, in the
    invariance probe) and greedy parity each record the exception as their failure."""
    verdict = check("silu_and_mul", "lab_variants:silu_and_mul_raises", dtypes=FP32, examples=1, presets=("tiny",))
    assert [name for name, _, _ in verdict.summary()] == [
        "empty batch", "reference", "batch invariance", "engine invariance property", "greedy parity vs transformers"]
    assert all(not f.ok and f.detail == "raised TypeError: silu_and_mul_raises takes no tensors"
               for f in verdict.findings), verdict.table()
    code, out, err = _lab_check(capsys, "lab_variants:silu_and_mul_raises")
    assert code == 1 and "FAIL" in out and "| engine invariance property | 0 |" in out, out + err
    assert "Traceback" not in err


def test_an_implementation_that_exits_fails_instead_of_passing(capsys):
    """SystemExit(0) from the implementation under test is its failure, not the command's exit 0."""
    code, out, err = _lab_check(capsys, "lab_variants:silu_and_mul_exits")
    assert code == 1, out + err
    assert "FAIL" in out and "raised SystemExit: 0" in out and "| engine invariance property | 0 |" in out, out


def test_ctrl_c_in_the_implementation_interrupts_with_one_line(capsys):
    code, out, err = _lab_check(capsys, "lab_variants:silu_and_mul_interrupted")
    assert code == 130, out + err
    assert err.strip().splitlines() == ["pocketllm lab: interrupted"], err


@pytest.mark.slow  # a subprocess through the whole lab grid: 10-20 s on 2 cores
def test_a_nan_implementation_gets_its_verdict_without_a_flood_of_logs():
    """Every engine step of a NaN variant fails: the engine's per-step logs (each with a traceback)
    and start-up warnings stay out of the lab's output, and the verdict names the first error."""
    path = os.pathsep.join(str(p) for p in (ROOT, ROOT / "tests", ROOT / "tests" / "lab"))
    argv = ["lab", "check", "silu_and_mul", "--impl", "lab_variants:silu_and_mul_nan", *QUICK_CLI]
    run = subprocess.run([sys.executable, "-m", "pocketllm.cli", *argv], cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": path}, capture_output=True, text=True, timeout=600)
    assert run.returncode == 1, run.stdout + run.stderr[-3000:]
    assert len(run.stderr.splitlines()) <= 3, run.stderr[-3000:]
    assert "| engine invariance property | 0 | 2 |" in run.stdout, run.stdout
    assert "non-finite logits" in run.stdout, run.stdout


def test_greedy_parity_names_the_error_that_ended_the_run():
    verdict = check("silu_and_mul", "lab_variants:silu_and_mul_nan", dtypes=FP32, examples=0, presets=("tiny",))
    parity = [f for f in verdict.findings if f.check == "greedy parity vs transformers"]
    assert len(parity) == 1 and not parity[0].ok
    assert parity[0].detail.startswith("prompt of 1 tokens: the run ended error: NonFiniteOutputError: "), parity[0]


@pytest.mark.parametrize("device, message", [
    ("cdua", "--device must be 'cpu' or 'cuda[:index]', got 'cdua'"),
    pytest.param("cuda", "--device 'cuda' is not available: torch finds no CUDA device here; use 'cpu'",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")),
])
def test_a_bad_device_is_one_line(device, message, capsys):
    code, out, err = _lab_check(capsys, "ref", "--device", device)
    assert code == 2 and out == "", out + err
    assert err.strip().splitlines() == [f"pocketllm lab: error: {message}"], err


def test_an_impl_module_that_fails_to_import_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "lab_broken_module.py").write_text("def silu_and_mul(gate_up:\n")
    try:
        code, out, err = _lab_check(capsys, "lab_broken_module:silu_and_mul")
    finally:
        sys.modules.pop("lab_broken_module", None)
    assert code == 2 and out == "", out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "pocketllm lab: error: cannot import 'lab_broken_module:silu_and_mul': SyntaxError: "), err
