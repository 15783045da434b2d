"""`pocketllm lab bench`: an op's implementations timed against each other and against the roofline,
at the op's real-shape calls.

The calls are those of `launches.py` (the shapes `lab compile` compiles), identical ones measured
once. Each call's inputs are random, and every implementation starts from the same inputs (stateful
ops update caches and states in place, so they are restored between implementations); the first
floating-point output of each other implementation is compared with the variant's.

On CUDA each call is timed with `triton.testing.do_bench` (median), and set against the device's
roofline: achieved GB/s and % of peak HBM bandwidth, TFLOP/s and % of peak FLOP/s for calls that are
compute-bound, and the time bound max(bytes / bandwidth, FLOPs / peak) from `launches.call_cost`.

On CPU the times are wall times of one call, never GPU timings, and Triton implementations run
under the Triton interpreter, which takes minutes for one real-shape call. So the rule is: at the
real shapes, implementations that launch Triton kernels are not run (their rows still carry the
roofline: bytes, FLOPs and an H200's time bound); `--quick` runs every implementation on the tiny
presets' shapes (`launches.QUICK`), in seconds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from ..config import check_device
from ..kernels._triton import HAS_TRITON, INTERPRETED, triton
from ..kernels.registry import IMPLEMENTATIONS, ImplSpec, describe, resolve
from ..kernels.spec import Call, Cost
from ..machine import cpu_name
from ..testing.cases import results
from .launches import OPS, QUICK, REAL, call_cost, model_steps, op_calls
from .table import markdown_table


@dataclass(frozen=True)
class Peaks:
    """A GPU's peak HBM bandwidth and dense bf16 tensor-core throughput."""

    name: str
    bandwidth: float  # bytes/s
    flops: float  # FLOP/s


# By fragment of the device name, the most specific first (A100 40 GB before A100, L40S before L4).
DEVICE_PEAKS = (Peaks("H200", 4.8e12, 989e12), Peaks("H100 PCIe", 2.0e12, 756e12), Peaks("H100", 3.35e12, 989e12),
                Peaks("A100-SXM4-40GB", 1.555e12, 312e12), Peaks("A100-PCIE-40GB", 1.555e12, 312e12),
                Peaks("A100", 2.039e12, 312e12), Peaks("L40S", 0.864e12, 362e12), Peaks("L4", 0.3e12, 121e12))
BOUND_DEFAULT = DEVICE_PEAKS[0]  # the bound printed where the device's peaks are unknown (and on CPU)


def device_peaks(name: str) -> Peaks | None:
    """The peaks of the device called `name` (as torch.cuda.get_device_name says), None if unknown."""
    return next((peaks for peaks in DEVICE_PEAKS if peaks.name in name), None)


@dataclass
class BenchRow:
    """One implementation at one call. Times in µs; None where not measured (see `note`)."""

    op: str
    call: str  # the step and part, and how many identical calls it stands for
    shape: str  # the floating-point arguments' shapes
    impl: str
    bytes: int
    flops: int
    bound: str  # "memory" or "compute": which roofline term is larger
    bound_us: float  # max(bytes / bandwidth, FLOPs / peak) on the peaks the report names
    timer: str = "not run"  # or "do_bench", "perf_counter", "interpreter" (interpreted Triton on CPU)
    time_us: float | None = None
    gbps: float | None = None
    pct_bw: float | None = None
    tflops: float | None = None
    pct_flops: float | None = None  # compute-bound calls only
    pct_bound: float | None = None  # bound_us / time_us
    speedup: float | None = None  # other implementations: their time / the variant's
    max_diff: float | None = None  # other implementations: max |variant - this| of the first float output
    note: str = ""


@dataclass
class BenchReport:
    """Rows of every op benchmarked, with what a reader must know to read them."""

    device: str
    peaks: Peaks  # the peaks of the bound (BOUND_DEFAULT where the device's are unknown)
    notes: list[str] = field(default_factory=list)
    rows: list[BenchRow] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"device": self.device, "peaks": dataclasses.asdict(self.peaks), "notes": self.notes,
                "torch": torch.__version__, "triton": getattr(triton, "__version__", None), "interpreted": INTERPRETED,
                "rows": [dataclasses.asdict(row) for row in self.rows]}

    def markdown(self) -> str:
        """The notes, then a table; columns no row has a value in are left out."""
        return "\n".join([f"Device: {self.device}", *self.notes, "", format_table(self.rows)])


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def _on_cuda(device: str) -> bool:
    return torch.device(device).type == "cuda"


def _device(device: str) -> tuple[str, Peaks | None]:
    """(name, peaks) of `device`: a GPU's name and peaks if known, or the CPU's name and None."""
    if _on_cuda(device):
        name = torch.cuda.get_device_name(device)
        return name, device_peaks(name)
    return f"{device} ({cpu_name()})", None


def _uses_triton(op: str, fn: Callable[..., Any]) -> bool:
    """Whether `fn` launches Triton kernels, as far as can be told without running it: the
    registered "triton" implementation, or a function from outside pocketllm whose module defines a
    Triton kernel (a variant from a notebook or a file)."""
    if fn is IMPLEMENTATIONS[op].get("triton"):
        return True
    module = sys.modules.get(getattr(fn, "__module__", None) or "")
    if not HAS_TRITON or module is None or module.__name__.startswith("pocketllm."):
        return False
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import KernelInterface

    return any(isinstance(value, (KernelInterface, InterpretedFunction)) for value in vars(module).values())


def _implementations(op: str, impl: ImplSpec, vs: Sequence[ImplSpec] | None) -> list[tuple[str, Callable[..., Any]]]:
    """(label, function) of the variant first, then the others (default: every other registered one)."""
    if op not in OPS:
        raise ValueError(f"unknown op {op!r}; choose from {', '.join(OPS)}")
    chosen = [(impl, resolve(op, impl))]
    others = [name for name, fn in IMPLEMENTATIONS[op].items() if fn is not chosen[0][1]] if vs is None else vs
    for spec in others:
        fn = resolve(op, spec)
        if all(fn is not seen for _, seen in chosen):
            chosen.append((spec, fn))
    return [(describe(spec), fn) for spec, fn in chosen]


def _key(args: Sequence[Any]) -> tuple[Any, ...]:
    """What makes two calls the same: layouts of the tensors, values of the index tensors, scalars."""
    return tuple((a.dtype, tuple(a.shape), a.stride(), a.storage_offset(),
                  None if a.is_floating_point() else tuple(a.flatten().tolist()))
                 if isinstance(a, torch.Tensor) else a for a in args)


def _shape(args: Sequence[Any]) -> str:
    return ", ".join("x".join(map(str, a.shape)) for a in args
                     if isinstance(a, torch.Tensor) and a.is_floating_point())


@dataclass
class _Planned:
    label: str
    shape: str
    cost: Cost
    call: Call  # the same call with random inputs
    copies: int = 1


def _plan(op: str, quick: bool, device: str) -> list[_Planned]:
    """The op's distinct calls at the shapes, in step order: described from uninitialised tensors,
    run from the twin step with random ones."""
    shapes = QUICK if quick else REAL
    planned: dict[tuple[Any, ...], _Planned] = {}
    for empty, filled in zip(model_steps(shapes, device), model_steps(shapes, device, seed=0)):
        for call, twin in zip(op_calls(op, empty), op_calls(op, filled)):
            args = call.args()
            key = _key(args)
            if key in planned:
                planned[key].copies += 1
            else:
                planned[key] = _Planned(call.label, _shape(args), call_cost(op, args), twin)
    return list(planned.values())


def _first_float(out: Any) -> torch.Tensor | None:
    return next((o for o in results(out) if isinstance(o, torch.Tensor) and o.is_floating_point()), None)


def _run(fn: Callable[[], object], device: str, restore: Callable[[], None]) -> tuple[object, float]:
    """(output, µs) of `fn` from the restored inputs. CUDA: a warm-up call (compiling the kernels)
    gives the output, then do_bench's median. CPU: that one call's wall time (the interpreter does
    not compile; a second call would double a slow run)."""
    restore()
    if not _on_cuda(device):
        start = time.perf_counter()
        output = fn()
        return output, 1e6 * (time.perf_counter() - start)
    output = fn()
    restore()
    return output, 1000 * float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def _row(op: str, planned: _Planned, impl: str, peaks: Peaks) -> BenchRow:
    """A row with the call's roofline on `peaks`, not yet timed."""
    memory_s, compute_s = planned.cost.bytes / peaks.bandwidth, planned.cost.flops / peaks.flops
    label = planned.label + (f" (+{planned.copies - 1})" if planned.copies > 1 else "")
    return BenchRow(op, label, planned.shape, impl, planned.cost.bytes, planned.cost.flops,
                    "compute" if compute_s > memory_s else "memory", 1e6 * max(memory_s, compute_s))


def _measure(row: BenchRow, time_us: float, timer: str, peaks: Peaks | None) -> None:
    """Records the time; GPU times also give achieved rates, and % of the peaks where they are known."""
    row.time_us, row.timer = time_us, timer
    if timer != "do_bench":
        return
    seconds = time_us / 1e6
    row.gbps, row.tflops = row.bytes / seconds / 1e9, row.flops / seconds / 1e12
    if peaks is not None:
        row.pct_bw = 100 * row.bytes / seconds / peaks.bandwidth
        row.pct_flops = 100 * row.flops / seconds / peaks.flops if row.bound == "compute" else None
        row.pct_bound = 100 * row.bound_us / time_us


def _bench_call(op: str, planned: _Planned, impls: list[tuple[str, Callable[..., Any]]], device: str, quick: bool,
                peaks: Peaks | None) -> list[BenchRow]:
    """Rows of every implementation at one call, each run from the same inputs; the others' outputs
    are compared with the variant's."""
    args = planned.call.args()
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    pristine = [t.clone() for t in tensors]

    def restore() -> None:
        for t, saved in zip(tensors, pristine):
            t.copy_(saved)

    rows, outputs = [], []
    for label, fn in impls:
        row = _row(op, planned, label, peaks or BOUND_DEFAULT)
        interpreted = not _on_cuda(device) and INTERPRETED and _uses_triton(op, fn)
        timer = "do_bench" if _on_cuda(device) else "interpreter" if interpreted else "perf_counter"
        output = None
        if interpreted and not quick:
            row.note = "interpreted Triton: minutes a call at real shapes (use --quick)"
        else:
            try:
                result, time_us = _run(partial(fn, *args), device, restore)
                output = _first_float(result)
                _measure(row, time_us, timer, peaks)
            except Exception as exc:  # a failing implementation is a result to report
                row.note = f"error: {type(exc).__name__}: {exc}".splitlines()[0][:200]
        rows.append(row)
        outputs.append(output)
    variant, variant_out = rows[0], outputs[0]
    for row, out in zip(rows[1:], outputs[1:]):
        if variant.time_us and row.time_us:
            row.speedup = row.time_us / variant.time_us
        if variant_out is not None and out is not None and out.shape == variant_out.shape:
            row.max_diff = float((variant_out.float() - out.float()).abs().max()) if out.numel() else 0.0
    return rows


def bench_op(op: str, impl: ImplSpec = "triton", vs: Sequence[ImplSpec] | None = None, device: str | None = None,
             quick: bool = False) -> list[BenchRow]:
    """`impl` of `op` against `vs` (default: every other registered implementation) at each distinct
    real-shape call (`quick`: the tiny presets' shapes), on `device` (default: CUDA if present). Rows:
    per call, the variant first. ValueError names the allowed ops and implementations."""
    impls = _implementations(op, impl, vs)
    device = device or default_device()
    peaks = _device(device)[1]
    return [row for planned in _plan(op, quick, device)
            for row in _bench_call(op, planned, impls, device, quick, peaks)]


def check(ops: Sequence[str], impl: ImplSpec, vs: Sequence[ImplSpec] | None, device: str | None = None) -> None:
    """ValueError (or the TypeError of `registry.resolve`) unless every op and implementation is
    known and the device is there: before anything runs."""
    for op in ops:
        _implementations(op, impl, vs)
    if device is not None:
        check_device(device, "--device")


def bench(ops: Sequence[str], impl: ImplSpec = "triton", vs: Sequence[ImplSpec] | None = None,
          device: str | None = None, quick: bool = False) -> BenchReport:
    """`bench_op` for each of `ops`, with the notes that say how to read the rows."""
    check(ops, impl, vs, device)
    device = device or default_device()
    name, peaks = _device(device)
    cuda = _on_cuda(device)
    bound = peaks or BOUND_DEFAULT
    notes = [f"Roofline bound: max(bytes / {bound.bandwidth / 1e12:g} TB/s, FLOPs / {bound.flops / 1e12:g} TFLOP/s "
             f"bf16) of {'this device' if peaks else 'an ' + bound.name}."]
    if cuda:
        notes.append("Times: triton.testing.do_bench, median." + ("" if peaks else
                     f" Peaks of {name!r} unknown: no % of peak (add it to DEVICE_PEAKS)."))
    else:
        notes.append("CPU: times are the wall time of one call, not GPU timings. Triton "
                     "implementations run under the Triton interpreter (numpy emulating each program)"
                     + (", at the tiny presets' shapes (--quick)." if quick else
                        "; at the real shapes they are not run (minutes a call): --quick runs them at tiny shapes."))
    report = BenchReport(name, bound, notes)
    for op in ops:
        report.rows += bench_op(op, impl, vs, device, quick)
    return report


# -- output and command line --------------------------------------------------------------------

_COLUMNS: tuple[tuple[str, Callable[[BenchRow], Any]], ...] = (
    ("op", lambda r: r.op), ("call", lambda r: r.call), ("shape", lambda r: r.shape), ("impl", lambda r: r.impl),
    ("timer", lambda r: r.timer), ("µs", lambda r: r.time_us), ("GB/s", lambda r: r.gbps),
    ("% BW", lambda r: r.pct_bw), ("TFLOP/s", lambda r: r.tflops), ("% FLOP/s", lambda r: r.pct_flops),
    ("MB", lambda r: r.bytes / 1e6), ("GFLOP", lambda r: r.flops / 1e9), ("bound", lambda r: r.bound),
    ("bound µs", lambda r: r.bound_us), ("% of bound", lambda r: r.pct_bound),
    ("variant speedup", lambda r: r.speedup), ("max diff", lambda r: r.max_diff), ("note", lambda r: r.note))


def _cell(value: Any) -> str:
    if value is None or value == "":
        return "-"
    if isinstance(value, str):
        return value
    if value == 0 or abs(value) >= 100:
        return f"{value:.0f}"
    return f"{value:.3g}" if abs(value) >= 1 else f"{value:.2g}"


def format_table(rows: Sequence[BenchRow]) -> str:
    """A Markdown table of `rows`, columns padded to line up; "variant speedup" is how many times
    faster the variant (the first row of each call) runs than that row's implementation."""
    columns = [(name, [_cell(get(row)) for row in rows]) for name, get in _COLUMNS]
    columns = [(name, cells) for name, cells in columns if any(cell != "-" for cell in cells)]
    return markdown_table([name for name, _ in columns], [[cells[i] for _, cells in columns] for i in range(len(rows))])


DESCRIPTION = ("Time an op's implementation against the others at the op's real-shape calls (those `lab compile` "
               "compiles), with each call's roofline: bytes, FLOPs and the time bound. On CPU, Triton "
               "implementations run only with --quick (tiny shapes, under the interpreter).")


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("ops", nargs="+", metavar="OP", choices=OPS, help=f"ops to benchmark: {', '.join(OPS)}")
    parser.add_argument("--impl", default="triton",
                        help="the variant: a registered name, 'module:function' (default: triton)")
    parser.add_argument("--vs", action="append", metavar="SPEC",
                        help="an implementation to compare with (repeatable; default: every other registered one)")
    parser.add_argument("--quick", action="store_true",
                        help="the tiny presets' shapes in fp32: seconds, even under the Triton interpreter")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda if present)")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the report as JSON to PATH")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Adds `bench` to a command line's subparsers (`pocketllm lab bench`); it runs `run`."""
    parser = subparsers.add_parser("bench", help="time an op's implementations at real shapes, with the roofline",
                                   description=DESCRIPTION)
    _add_arguments(parser)
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """The command: the report as Markdown on stdout (and JSON to --json); 2 for an unknown op or
    implementation, naming the allowed ones."""
    try:
        check(args.ops, args.impl, args.vs, args.device)
    except (ValueError, ImportError, TypeError) as exc:
        print(f"pocketllm lab bench: error: {exc}", file=sys.stderr)
        return 2
    report = bench(args.ops, args.impl, args.vs, args.device, args.quick)
    print(report.markdown())
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report.to_json(), indent=2) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pocketllm.lab.timing", description=DESCRIPTION)
    _add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
