"""`pocketllm bench --tensor-parallel` with the workload's knobs (see pocketllm.bench.tensor_parallel).

    python bench/tensor_parallel.py [--preset P ...] [--requests 8] [--prompt 64] [--new 32] [--sizes 1 2]
                                    [--device cpu] [--dtype float32] [--out bench/results]
Writes tensor_parallel.json and tensor_parallel.md; prints each configuration as it finishes.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from pocketllm.bench.tensor_parallel import PRESETS, Workload, run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", nargs="+", default=list(PRESETS["full"]))
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        help="the rows' dtype (EngineArgs.dtype)")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 2], help="the tensor-parallel sizes to run")
    args = parser.parse_args()
    workload = Workload(args.requests, args.prompt, args.new, tuple(args.sizes), args.device, args.dtype)
    print(run(args.out, False, tuple(args.preset), workload))


if __name__ == "__main__":
    main()
