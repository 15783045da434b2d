"""Throughput and latency benchmark (`pocketllm bench`, `bench/throughput.py`).

Why it exists: to show, with measured numbers, what continuous batching buys over the serial
path and over `transformers` generate, and whether the seed's goals are met on this machine.

Three seeded workloads (fixed, uniform random and heavy-tailed lengths) run on a random-weight
checkpoint written into a temporary directory (nothing is downloaded): serially, then batched at
each max_batch_size with every request submitted at once; `transformers` generate on the same
checkpoint runs them one at a time and in static, left-padded batches. Every request is greedy
and generates exactly its planned number of tokens (ignore_eos; min_new_tokens in transformers).

All requests of a run arrive together, so TTFT counts from that moment (queueing included);
TPOT = (total time - TTFT) / (tokens - 1) per request, averaged. A static batch hands its results
back when its longest request is done, so that is every request's total time there, and only the
tokens each request asked for count towards tokens/s. Each run is measured once after a warm-up.

Writes throughput.json and throughput.md into --out, and with matplotlib (`pocketllm[plot]`)
throughput_vs_concurrency.png, ttft_distribution.png and slot_timeline.png; the transformers
baseline needs `pocketllm[baseline]`. What is missing is skipped, said, and recorded in the report.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import sys
import tempfile
from pathlib import Path
from typing import Any

from ..command_line import OneLineParser, run_command
from ..config import check_device
from ..models import PRESETS, read_config, write_checkpoint
from ..sampling import MAX_SEED
from ..scheduler import SlotEvent
from .baseline import load_transformers
from .peer import PYTHON_VARIABLE, peer_python, unavailable
from .report import load_average, machine_info, seed_table, vs_transformers, write_report
from .runners import MAX_SEQ_LEN, TIMELINE_BATCH, run_all
from .workloads import SCALES, make_workloads


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="pocketllm bench", description=__doc__,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None,
                        help=f"checkpoint preset (default {SCALES['full'].preset}; "
                             f"{SCALES['quick'].preset} with --quick); with --real-shapes, the one model measured "
                             f"instead of Qwen3-0.6B and Qwen3.5-0.8B (e.g. qwen3-30b-a3b-2l)")
    parser.add_argument("--out", type=Path, default=Path("bench/results"), help="output directory")
    parser.add_argument("--quick", action="store_true",
                        help="tiny preset, 8 requests per workload, max_batch_size 1, 2, 4: under a minute")
    parser.add_argument("--seed", type=int, default=0,
                        help="seeds the checkpoint weights and the workloads: an int in [0, 2**64 - 1]")
    parser.add_argument("--real-shapes", action="store_true",
                        help="the real-shape benchmark instead: Qwen3-0.6B and Qwen3.5-0.8B shapes against "
                             "transformers (see pocketllm.bench.real_shapes; tiny presets with --quick)")
    parser.add_argument("--scheduling", action="store_true",
                        help="the scheduling benchmark instead: prefix reuse and chunked prefill, each on and off, "
                             "at Qwen3-0.6B and Qwen3.5-0.8B shapes (see pocketllm.bench.scheduling; tiny presets "
                             "with --quick)")
    parser.add_argument("--serving", action="store_true",
                        help="the serving benchmark instead: concurrent clients against `pocketllm serve` on "
                             "loopback vs the in-process AsyncLLM (see pocketllm.bench.serving; tiny preset)")
    parser.add_argument("--speculative", action="store_true",
                        help="the speculative decoding benchmark instead: each method against none, lookup-friendly "
                             "and random workloads, batch 1 and 8, at Qwen3-0.6B and Qwen3.5-0.8B shapes (see "
                             "pocketllm.bench.speculative; tiny presets with --quick)")
    parser.add_argument("--tensor-parallel", action="store_true",
                        help="the tensor-parallel benchmark instead: one process and two ranks, with and without the "
                             "reduction tree, experts split by features and whole, tokens/s and bytes per decode "
                             "step, on the MoE small presets (see pocketllm.bench.tensor_parallel; tiny with --quick)")
    parser.add_argument("--clients", type=int, default=8, help="concurrent clients (and slots) of --serving")
    parser.add_argument("--device", default="cpu", help="device of the --scheduling runs")
    parser.add_argument("--no-transformers", action="store_true", help="skip the transformers baselines")
    parser.add_argument("--peer", choices=["vllm"], default=None,
                        help="with --real-shapes: vLLM's CPU build beside pocketllm, in its own environment "
                             "(see pocketllm.bench.peer)")
    parser.add_argument("--peer-python", default=None,
                        help=f"the Python of vLLM's environment (default ${PYTHON_VARIABLE})")
    return parser


def missing_extras(no_transformers: bool) -> dict[str, str]:
    """What this install cannot do -> why, said before the run and recorded in the report."""
    skipped = {}
    if importlib.util.find_spec("matplotlib") is None:
        skipped["plots"] = "matplotlib is not installed: pip install 'pocketllm[plot]'"
    if no_transformers:
        skipped["transformers_baseline"] = "--no-transformers"
    elif importlib.util.find_spec("transformers") is None:
        skipped["transformers_baseline"] = "transformers is not installed: pip install 'pocketllm[baseline]'"
    return skipped


def check_arguments(args: argparse.Namespace) -> None:
    """ValueError (OSError for --out) naming the option, before a run of minutes rather than
    after it: the seed is one torch's and numpy's generators both take, the device is here, and
    files can be written into --out (created if missing)."""
    if not 0 <= args.seed <= MAX_SEED:
        raise ValueError(f"--seed must be an int in [0, 2**64 - 1], got {args.seed}")
    check_device(args.device, "--device")
    if not 1 <= args.clients <= 1024:
        raise ValueError(f"--clients must be an int in [1, 1024], got {args.clients}")
    if args.peer is not None and not args.real_shapes:
        raise ValueError("--peer runs beside the real-shape benchmark: add --real-shapes")
    try:
        args.out.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=args.out).close()
    except OSError as exc:
        raise OSError(f"--out {str(args.out)!r} is not a directory this process can write into: "
                      f"{exc.strerror or exc}") from exc


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and write what this install can: 0 also when plots or the baseline are
    skipped; a user error is one line on stderr and 2, Ctrl-C one line and 130 (`command_line.run_command`)."""
    args = build_parser().parse_args(argv)
    return run_command("bench", lambda: _run(args))


def _run_another(args: argparse.Namespace, skipped: dict[str, str]) -> bool:
    """Run the benchmark an option asks for instead of the throughput one; False when none does."""
    if args.scheduling:
        from .scheduling import run as run_scheduling

        print(run_scheduling(args.out, args.quick, args.seed, args.device, "plots" not in skipped))
        return True
    if args.speculative:
        from .speculative import run as run_speculative

        print(run_speculative(args.out, args.quick, args.seed, (args.preset,) if args.preset else None))
        return True
    if args.tensor_parallel:
        from .tensor_parallel import run as run_tensor_parallel

        print(run_tensor_parallel(args.out, args.quick, (args.preset,) if args.preset else None))
        return True
    if args.serving:
        from .serving import run as run_serving

        print(run_serving(args.out, args.quick, args.seed, args.preset, args.clients))
        return True
    if args.real_shapes:
        from .real_shapes import run

        python = peer_python(args.peer_python) if args.peer else None
        peer_missing = unavailable(python) if args.peer else None
        if peer_missing is not None:
            print(f"pocketllm bench: skipping the vLLM peer: {peer_missing}", file=sys.stderr)
        print(run(args.out, args.quick, args.seed, "transformers_baseline" not in skipped, "plots" not in skipped,
                  python if peer_missing is None else None, (args.preset,) if args.preset else None))
        return True
    return False


def _run(args: argparse.Namespace) -> int:
    check_arguments(args)
    skipped = missing_extras(args.no_transformers)
    for part, why in skipped.items():
        print(f"pocketllm bench: skipping {part.replace('_', ' ')}: {why}", file=sys.stderr)
    if _run_another(args, skipped):
        return 0
    scale = SCALES["quick" if args.quick else "full"]
    preset = args.preset or scale.preset
    machine = machine_info()
    timeline: list[SlotEvent] = []
    with tempfile.TemporaryDirectory() as tmp:
        path = write_checkpoint(Path(tmp) / preset, preset, seed=args.seed)
        workloads = make_workloads(scale.requests, read_config(path).vocab_size, args.seed)
        hf_model = None if "transformers_baseline" in skipped else load_transformers(path)
        latency, runs = run_all(path, scale, workloads, hf_model, timeline)
    machine["load_average_1min_at_end"] = load_average()
    config = {"preset": preset, "seed": args.seed, "quick": args.quick, "concurrencies": list(scale.concurrencies),
              "requests_per_workload": scale.requests, "latency_repeats": scale.latency_repeats,
              "max_seq_len": MAX_SEQ_LEN, "transformers_baselines": hf_model is not None,
              "timeline": {"workload": "random", "max_batch_size": TIMELINE_BATCH, "events": len(timeline)}}
    report: dict[str, Any] = {
        "machine": machine, "config": config, "skipped": skipped,
        "workloads": {w.name: w.summary() for w in workloads}, "latency": latency,
        "seed_table": seed_table(latency, runs),
        "vs_transformers": vs_transformers(runs, workloads, scale.concurrencies),
        "runs": [dataclasses.asdict(r) for r in runs]}
    print(write_report(args.out, report, workloads, runs))
    if "plots" not in skipped:
        from .plots import write_plots

        write_plots(args.out, workloads, runs, timeline)
    return 0
