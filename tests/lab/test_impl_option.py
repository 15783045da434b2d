"""`pytest --impl OP=SPEC`: the kernel suite runs, unchanged, on a variant defined outside the
package; a broken variant makes the op's kernel tests fail and a correct one passes them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SILU_TESTS = ["tests/kernels/test_silu_and_mul.py", "-k", "silu_and_mul and not gpu"]


def _pytest(*args: str) -> subprocess.CompletedProcess:
    path = os.pathsep.join([str(ROOT / "tests" / "lab"), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("variant, passes", [("lab_variants:silu_and_mul_split", True),
                                             ("lab_variants:silu_and_mul_up_gate_swapped", False)])
def test_the_kernel_suite_runs_on_the_variant(variant, passes):
    run = _pytest(*SILU_TESTS, "--impl", f"silu_and_mul={variant}")
    summary = run.stdout.strip().splitlines()[-1]
    assert (run.returncode == 0) == passes, run.stdout[-2000:] + run.stderr[-2000:]
    assert ("failed" in summary) != passes, summary


def test_a_bad_impl_option_is_a_usage_error():
    run = _pytest(*SILU_TESTS, "--impl", "silu_and_mul=lab_variants:decode_attention_wrong_signature")
    assert run.returncode == 4  # pytest's usage error
    assert "missing parameter 'gate_up'" in run.stderr or "parameter 0 is 'q'" in run.stderr, run.stderr[-2000:]
