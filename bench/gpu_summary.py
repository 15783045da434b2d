"""One summary of a GPU check (bench/gpu_check.sh): each step's exit status and headline numbers in
summary.json and summary.md, so a run is read in one place; the detailed files stay beside them.

Reads from --out what the steps wrote: device.txt, gpu_tests.txt, kernels.json, compile.json and
e2e.json; a file a failed or timed-out step left missing or unreadable is reported as such.
`--rc NAME=STATUS` (repeatable) gives each step's exit status, 124 for a timeout.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any


def _read_json(path: Path) -> Any:
    """The file's JSON, or None when it is missing or cut short."""
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def _last_line(path: Path) -> str | None:
    lines = path.read_text().strip().splitlines() if path.is_file() else []
    return lines[-1] if lines else None


def gather(out: Path, rcs: dict[str, int]) -> dict[str, Any]:
    """The summary of the files in `out` and the steps' exit statuses `rcs`."""
    kernels, compiled, e2e = (_read_json(out / name) for name in ("kernels.json", "compile.json", "e2e.json"))
    return {
        "device": _last_line(out / "device.txt"),
        "steps": {name: {"rc": rc, "ok": rc == 0} for name, rc in rcs.items()},
        "ok": all(rc == 0 for rc in rcs.values()),
        "gpu_tests": _last_line(out / "gpu_tests.txt"),
        "kernels": None if kernels is None else [
            {key: row[key] for key in ("op", "call", "time_us", "pct_bound")}
            for row in kernels["rows"] if row["impl"] == "triton"],
        "compile": None if compiled is None else {
            "kernels": len(compiled), "failing": sum(not row["ok"] for row in compiled),
            "failures": [f"{r['target']} {r['op']} {r['kernel']} [{r['shape']}]: {r['reason']}"
                         for r in compiled if not r["ok"]]},
        "e2e": None if e2e is None else {key: e2e[key] for key in ("backend", "dtype", "device_name", "models")},
    }


def _number(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def markdown(summary: dict[str, Any]) -> str:
    """Steps, then each step's headline numbers; "missing" where a step wrote nothing readable."""
    lines = ["# GPU check", "", f"Device: {summary['device'] or 'unknown'}", "", "| step | rc | result |",
             "|---|---|---|"]
    lines += [f"| {name} | {step['rc']} | {'ok' if step['ok'] else 'FAIL'} |"
              for name, step in summary["steps"].items()]
    lines += ["", f"GPU tests: {summary['gpu_tests'] or 'missing'}", ""]
    compiled = summary["compile"]
    lines += ["AOT compile: missing" if compiled is None
              else f"AOT compile: {compiled['kernels']} kernel specialisations, {compiled['failing']} failing"]
    lines += [f"- {failure}" for failure in (compiled or {}).get("failures", [])] + ["", "## End to end", ""]
    e2e = summary["e2e"]
    if e2e is None:
        lines.append("missing")
    else:
        lines += [f"{e2e['backend']} backend, {e2e['dtype']}, {e2e['device_name']}", "",
                  "| preset | prefill tok/s | batch-1 decode tok/s | batched 8 tok/s |", "|---|---|---|---|"]
        lines += [f"| {m['preset']} | {m['prefill_tokens_per_s']:.0f} | {m['decode_1_tokens_per_s']:.1f} | "
                  f"{m['batched_tokens_per_s']:.1f} |" for m in e2e["models"]]
    lines += ["", "## Triton kernels", ""]
    if summary["kernels"] is None:
        lines.append("missing")
    else:
        lines += ["| op | call | µs | % of roofline |", "|---|---|---|---|"]
        lines += [f"| {k['op']} | {k['call']} | {_number(k['time_us'], '.1f')} | {_number(k['pct_bound'], '.0f')} |"
                  for k in summary["kernels"]]
    return "\n".join(lines) + "\n"


def _rc(text: str) -> tuple[str, int]:
    name, _, status = text.partition("=")
    if not name or not status.lstrip("-").isdigit():
        raise argparse.ArgumentTypeError(f"expected NAME=STATUS, got {text!r}")
    return name, int(status)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="the GPU check's results folder")
    parser.add_argument("--rc", type=_rc, action="append", default=[], metavar="NAME=STATUS")
    args = parser.parse_args(argv)
    summary = gather(args.out, dict(args.rc))
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    text = markdown(summary)
    (args.out / "summary.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
