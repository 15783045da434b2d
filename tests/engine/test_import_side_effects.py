"""Importing pocketllm changes no process-wide state beyond the one it documents: on a machine
without CUDA, `TRITON_INTERPRET=1` (Triton reads it when `triton` is imported, see
pocketllm/kernels/_triton.py). No torch flag changes, and the optional extras are not imported."""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = """
import os, sys
import torch
before = (torch.get_num_threads(), torch.get_default_dtype(), torch.are_deterministic_algorithms_enabled())
import pocketllm
import pocketllm.bench
assert (torch.get_num_threads(), torch.get_default_dtype(), torch.are_deterministic_algorithms_enabled()) == before
assert "matplotlib" not in sys.modules and "transformers" not in sys.modules
print(os.environ.get("TRITON_INTERPRET"), torch.cuda.is_available())
"""


def test_import_changes_only_the_documented_state():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    interpret, cuda = done.stdout.split()
    assert interpret == ("None" if cuda == "True" else "1")
