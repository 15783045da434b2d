"""The scripts in bench/ run with bench/ first on sys.path, so a script named like an installed module
hides that module from every library that imports it: transformers imports the `kernels` package
where it is installed, and got a benchmark script of that name instead (`bench/throughput.py` failed)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _hidden(name: str) -> bool:
    spec = importlib.util.find_spec(name)
    return spec is not None and (spec.origin is None or Path(spec.origin).parent != BENCH)


def test_no_bench_script_hides_an_installed_module():
    scripts = sorted(path.stem for path in BENCH.glob("*.py"))
    assert "throughput" in scripts
    assert [name for name in scripts if _hidden(name)] == []


def test_negative_control_a_script_named_like_an_installed_module_is_seen():
    assert _hidden("json") and _hidden("torch")
