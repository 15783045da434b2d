"""What exact positions cost on the torch backend, at real model shapes, beside transformers.

pocketllm's default (exact positions off on the torch backend) against `exact_positions=True`
(every linear row through the fixed-order C++ kernel, attention rows through the C++ attention
kernel), and transformers, in one run on the same random-weight checkpoints in the exact shapes of
Qwen3-0.6B and Qwen3.5-0.8B: batch-1 decode, continuous batching 8 (the seeded `random` workload)
and a 512-token prefill, as `pocketllm bench --real-shapes` measures them
(`pocketllm.bench.real_shapes`). Qwen3.5's Gated DeltaNet layers run the C++ recurrent kernel in
both configurations (exact along the sequence either way).

    python bench/exact_positions_cost.py [--out bench/results] [--quick]
Writes exact_positions_cost.json and exact_positions_cost.md; prints progress as it goes.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict
from pathlib import Path

from pocketllm.bench.real_shapes import SIZES, markdown, measure_model, read_bandwidth, verdicts
from pocketllm.bench.report import load_average, machine_info, save_report

CONFIGS = {"pocketllm": {}, "pocketllm (exact positions)": {"exact_positions": True}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    parser.add_argument("--quick", action="store_true", help="the tiny presets: a smoke test")
    args = parser.parse_args()
    size = SIZES["quick" if args.quick else "full"]
    machine = machine_info()
    bandwidth = read_bandwidth(0.25 if args.quick else 1.0)
    models = []
    for preset in size.presets:
        print(f"{preset}: transformers", flush=True)
        model = measure_model(preset, size, 0, with_transformers=True, configs=CONFIGS)
        model["verdicts"] = verdicts(model, bandwidth)
        models.append(model)
    machine["load_average_1min_at_end"] = load_average()
    report = {"machine": machine, "read_bandwidth_gb_s": bandwidth / 1e9, "size": asdict(size), "seed": 0,
              "models": models}
    text = markdown(report).replace("# pocketllm at real model shapes", "# What exact positions cost")
    save_report(args.out, "exact_positions_cost", report, text)
    print(text)


if __name__ == "__main__":
    main()
