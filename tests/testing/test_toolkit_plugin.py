"""The pytest plugin of pocketllm.testing, exercised as a user meets it: a small external test file run
by pytest (pytester, in a subprocess) with the plugin loaded from its entry point."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pocketllm.kernels.cpu.extension import DIR_ENV, build_dir

pytest_plugins = ["pytester"]
# pytester points HOME elsewhere: the runs it starts use the C++ kernels already built for this one.
EXTENSIONS = str(build_dir().parent)


@pytest.fixture(autouse=True)
def _built_kernels(monkeypatch):
    monkeypatch.setenv(DIR_ENV, EXTENSIONS)


EXTERNAL = '''
from hypothesis import given, settings
from pocketllm.testing import assert_batch_invariant, budget, strategies


def test_the_profile_sets_the_budget():
    assert settings().max_examples == 10 and budget(0.5) == 5


def test_the_impl_option_registers_the_variant(pocketllm_impl):
    from pocketllm.kernels.linear import linear_fixed_order

    assert pocketllm_impl("linear") is linear_fixed_order
    assert pocketllm_impl("rms_norm") is None


def test_checkpoints_are_written_once(pocketllm_checkpoint):
    assert pocketllm_checkpoint("tiny") == pocketllm_checkpoint("tiny") != pocketllm_checkpoint("tiny", seed=1)


def test_a_serial_engine(pocketllm_serial_engine):
    llm = pocketllm_serial_engine("tiny", max_seq_len=64)
    assert llm is pocketllm_serial_engine("tiny", max_seq_len=64)
    assert len(llm.generate([1, 2, 3]).token_ids) >= 1


@settings(max_examples=budget(0.3))
@given(workload=strategies.workloads(256, max_prompt=20, max_jobs=4, max_tokens=4))
def test_my_variant_keeps_the_contract(pocketllm_engines, pocketllm_impl, workload):
    engines = pocketllm_engines("tiny", engine_args={"op_overrides": {"linear": pocketllm_impl("linear")}})
    assert_batch_invariant(engines, workload)
'''


def test_an_external_test_file_runs_on_the_plugin(pytester):
    pytester.makepyfile(test_external=EXTERNAL)
    result = pytester.runpytest_subprocess("--impl", "linear=fixed_order", "--pocketllm-profile", "dev", "-q",
                                           "-p", "no:cacheprovider")
    result.assert_outcomes(passed=5)


def test_a_bad_impl_or_profile_is_a_usage_error(pytester):
    pytester.makepyfile(test_external="def test_nothing():\n    pass\n")
    bad_impl = pytester.runpytest_subprocess("--impl", "linear=nosuchmodule:fn")
    assert bad_impl.ret == 4 and "--impl linear=nosuchmodule:fn" in bad_impl.stderr.str()
    bad_profile = pytester.runpytest_subprocess("--pocketllm-profile", "fast")
    assert bad_profile.ret == 4 and "invalid choice: 'fast'" in bad_profile.stderr.str()


def test_loading_the_plugin_imports_nothing_of_pocketllm():
    """It loads in every pytest run of the environment: no torch, no Triton interpreter setting."""
    code = ("import sys, pytest_pocketllm; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('pocketllm', 'torch', 'triton')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
