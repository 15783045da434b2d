"""Every op's Triton kernel against the op's other implementations, at the real-shape calls the
models make (`pocketllm.lab.launches`, the shapes `lab compile` compiles), with each call's roofline.

A thin script over `pocketllm.lab.timing` (`pocketllm lab bench OP --impl triton`), whose docstring
says how the rows are measured. On a CUDA device: bf16, triton.testing.do_bench, achieved GB/s and
TFLOP/s against the device's peaks. `--smoke` runs the tiny presets' shapes in fp32 (on CPU under
the Triton interpreter: a CI check that the benchmark's code paths work; its timings mean nothing).
Writes kernels.json and kernels.md to --out (default: $OUT, else bench/results/).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from pocketllm.lab.launches import OPS
from pocketllm.lab.timing import bench


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--op", action="append", choices=OPS, metavar="NAME",
                        help=f"only this op (repeatable; default: every op): {', '.join(OPS)}")
    parser.add_argument("--smoke", action="store_true", help="the tiny presets' shapes (seconds under the interpreter)")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or Path(__file__).parent / "results"))
    args = parser.parse_args(argv)

    report = bench(args.op or OPS, "triton", quick=args.smoke)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kernels.json").write_text(json.dumps(report.to_json(), indent=2) + "\n")
    (args.out / "kernels.md").write_text(report.markdown() + "\n")
    print(report.markdown())
    return 0


if __name__ == "__main__":
    sys.exit(main())
