"""bench/soak.py as a module: the soak test runs it small, and its seed-keyed sampler fault serves
the fault-isolation tests too."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

PATH = Path(__file__).resolve().parents[2] / "bench" / "soak.py"


def load():
    name = "pocketllm_bench_soak"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, PATH)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]
