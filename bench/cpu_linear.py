"""The CPU linear products at Qwen3-0.6B's shapes: the C++ `fixed_order` kernel (its own reduction
order; its AVX2 variant beside it on an AVX-512 CPU, and with bf16 weights) against MKL through
`linear_row_invariant` (4- and 64-row tiles, the torch backend's products without its C++ kernels)
and plain F.linear (one call, no invariance), median ms per call; and the kernel summing 8 K shards
in the fixed tree (a row-parallel matrix's order at every tensor-parallel size) in one call.

    python bench/cpu_linear.py [--threads 2] [--rows 1 4 8 64 128 512] [--budget 0.5] [--shapes 1 3]
Each cell: one warm-up call of each, then rounds of one call of each (interleaved, each first in
turn, so that other load on the machine falls on all of them alike) until `--budget` seconds (3 to 30 rounds), median.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from pocketllm.kernels.cpu.extension import load_extension
from pocketllm.kernels.linear import in_shards, linear_fixed_order, linear_fixed_order_avx2, linear_row_invariant
from pocketllm.machine import cpu_name

# (K, N): q/k/v fused, o_proj, gate_up fused, down_proj, lm_head.
SHAPES = [(1024, 4096), (2048, 1024), (1024, 6144), (3072, 1024), (1024, 151936)]
# name -> fn(x, fp32 weight, bf16 weight, the fp32 weight as its 8 K shards)
IMPLS: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]], torch.Tensor]] = {
    "fixed_order": lambda x, w, _, __: linear_fixed_order(x, w),
    "fixed_order 8 shards": lambda x, _, __, shards: in_shards(linear_fixed_order, x, shards),
    "fixed_order_avx2": lambda x, w, _, __: linear_fixed_order_avx2(x, w),
    "fixed_order bf16 W": lambda x, _, w16, __: linear_fixed_order(x, w16),
    # bf16 rows (an engine in bf16; x rounded per call, in both): the tree rounds each shard and level to bf16
    "fixed_order bf16 rows": lambda x, _, w16, __: linear_fixed_order(x.bfloat16(), w16),
    "fixed_order 8 shards, bf16 rows": lambda x, _, w16, shards: in_shards(
        linear_fixed_order, x.bfloat16(), list(w16.split(w16.shape[1] // len(shards), dim=1))),
    "mkl_tile4": lambda x, w, _, __: linear_row_invariant(x, w, None, 4),
    "mkl_tile64": lambda x, w, _, __: linear_row_invariant(x, w, None, 64),
    "F.linear": lambda x, w, _, __: F.linear(x, w),
}
MKL = ("mkl_tile4", "mkl_tile64", "F.linear")


def median_ms(fns: dict[str, Callable[[], object]], budget: float) -> dict[str, float]:
    """Median wall time of each fn() in ms, after one warm-up call, the calls interleaved."""
    first = 0.0
    for fn in fns.values():
        start = time.perf_counter()
        fn()
        first += time.perf_counter() - start
    times: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for round_ in range(max(3, min(30, int(budget / max(first, 1e-6))))):
        for name in names[round_ % len(names):] + names[:round_ % len(names)]:  # each goes first in turn
            start = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - start)
    return {name: 1e3 * statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 64, 128, 512])
    parser.add_argument("--budget", type=float, default=1.0, help="seconds of calls per cell")
    parser.add_argument("--shapes", type=int, nargs="+", default=list(range(len(SHAPES))),
                        help=f"indices into {SHAPES} (1 and 3: the row-parallel o_proj and down_proj)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    module = load_extension()
    impls = dict(IMPLS)
    if module is None or module.best_variant() != "avx512":
        del impls["fixed_order_avx2"]  # it is the default variant, or nothing runs
    print(f"# {cpu_name()}, {args.threads} threads, torch {torch.__version__}, fixed-order variant "
          f"{None if module is None else module.best_variant()}, packed tiles "
          f"{None if module is None else 'two lanes at once' if module.lane_pairing() else 'one lane at a time'}",
          flush=True)
    header = "| K | N | rows | " + " | ".join(impls) + " | fixed / best MKL |"
    table = [header, "|" + "---|" * (header.count("|") - 1)]
    for k, n in (SHAPES[i] for i in args.shapes):
        weight = torch.randn(n, k) * k ** -0.5
        weight_bf16 = weight.bfloat16()
        shards = list(weight.split(k // 8, dim=1))  # a row-parallel matrix's at TP=1: its column slices, views
        for rows in args.rows:
            x = torch.randn(rows, k)
            calls: dict[str, Callable[[], object]] = {name: partial(fn, x, weight, weight_bf16, shards)
                                                      for name, fn in impls.items()}
            cells = median_ms(calls, args.budget)
            best = min(cells[name] for name in MKL)
            line = (f"| {k} | {n} | {rows} | " + " | ".join(f"{v:.3f}" for v in cells.values())
                    + f" | {cells['fixed_order'] / best:.2f} |")
            print(line, flush=True)
            table.append(line)
    print("\n".join(table))


if __name__ == "__main__":
    main()
