"""The examples of docs/testing.md and the README's property-test example run as written: each code
block that starts with a `# test_<name>.py` line is written to that file and run by pytest, with the
plugin loaded from the install, on the `dev` profile."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from pocketllm.kernels.cpu.extension import DIR_ENV, build_dir

pytest_plugins = ["pytester"]
# pytester points HOME elsewhere: the runs it starts use the C++ kernels already built for this one.
EXTENSIONS = str(build_dir().parent)


@pytest.fixture(autouse=True)
def _built_kernels(monkeypatch):
    monkeypatch.setenv(DIR_ENV, EXTENSIONS)

REPO = Path(__file__).resolve().parents[2]
BLOCK = re.compile(r"```python\n# (test_\w+\.py)\n(.*?)```", re.S)


def _examples(document: str) -> dict[str, str]:
    return {name: code for name, code in BLOCK.findall((REPO / document).read_text())}


@pytest.mark.parametrize("document,count", [("docs/testing.md", 3), ("README.md", 1)])
def test_the_examples_run_as_written(pytester, document, count):
    examples = _examples(document)
    assert len(examples) == count, sorted(examples)
    for name, code in examples.items():
        pytester.makepyfile(**{name.removesuffix(".py"): code})
    tests = sum(len(re.findall(r"^def test_", code, re.M)) for code in examples.values())
    result = pytester.runpytest_subprocess("--pocketllm-profile", "dev", "-q", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=tests)
