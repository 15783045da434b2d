"""`pocketllm lab compile`: compile every Triton kernel for NVIDIA GPUs ahead of time, without one.

A kernel that passes its tests under the CPU interpreter can still spill registers to local memory,
or ask for more shared memory or registers than a GPU has; none of it shows until it runs on one.
Triton's compiler and its bundled ptxas and cuobjdump run on the CPU, so this module compiles each
kernel for sm_80 and sm_90 at the launch configurations the engine really uses and reads the
resources of the resulting cubin.

The configurations are not written by hand: the launchers of the Triton op table are called with
the calls of `launches.py` (CPU tensors laid out as the models lay them out: the Qwen3-0.6B and
Qwen3.5-0.8B presets, decode and prefill steps, and an attention sweep over head dims and GQA
ratios; `lab bench` times the same calls) while `JITFunction.run`
is replaced by a recorder that launches nothing. Triton's own binder then specialises each
recorded launch for the target (argument types, divisibility by 16, integers equal to 1,
`do_not_specialize`), as a launch on that GPU would, and each distinct specialisation is compiled
once per target.

Compiling needs Triton out of interpreter mode, which a process that imported pocketllm on a
machine without CUDA is in (see kernels/_triton.py); there `compile_kernels` runs this module in a
subprocess with TRITON_INTERPRET=0. Written against Triton 3.9's `JITFunction.run`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

from ..kernels import get_ops
from ..kernels._triton import HAS_TRITON, INTERPRETED, recording_launches
from .launches import ATTENTION_OPS, OPS, invoke, model_steps, op_calls, sweep_steps
from .table import markdown_table

# -- targets and their limits ----------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """An NVIDIA GPU architecture and the limits that differ between those supported here."""

    name: str
    capability: int
    max_shared: int  # bytes of shared memory per block, with the opt-in
    shared_per_sm: int  # bytes of shared memory per SM


TARGETS = {t.name: t for t in (Target("sm_80", 80, 166912, 167936), Target("sm_90", 90, 232448, 233472))}
MAX_REGISTERS_PER_THREAD = 255
REGISTERS_PER_BLOCK = 65536  # also the register file of one SM on both targets
REGISTER_GRANULE = 8  # a thread's registers are allocated in multiples of 8 (256 per warp)
WARP_SIZE = 32
MAX_WARPS_PER_SM = 64
MAX_BLOCKS_PER_SM = 32
RESERVED_SHARED_PER_BLOCK = 1024  # the runtime keeps 1 KB of each block's shared memory from sm_80 on


@dataclass(frozen=True)
class KernelReport:
    """One specialisation of one kernel, compiled for one target."""

    op: str
    kernel: str
    shape: str  # the first launch that needs this specialisation (+ how many others share it)
    target: str
    regs: int | None  # registers per thread; None where the compile failed
    stack: int | None  # bytes of local memory per thread (stack frame, where spills go)
    shared: int | None  # bytes of shared memory per block, static and dynamic
    num_warps: int
    ok: bool
    reason: str  # why it fails ("" when it fits); notes allowed spills


@dataclass(frozen=True)
class Usage:
    """What a compiled kernel needs: registers and local-memory bytes per thread, shared bytes per block."""

    regs: int
    stack: int
    shared: int


_FUNCTION = re.compile(r"Function (\S+):\s*\n\s*(.*)")
_FIELD = re.compile(r"(\w+):(\d+)")


def parse_resource_usage(dump: str, function: str) -> Usage:
    """`function`'s line of `cuobjdump --dump-resource-usage` ("REG:14 STACK:0 SHARED:0 LOCAL:0 ..."):
    registers, local memory (STACK + LOCAL) and static shared memory."""
    for name, fields in _FUNCTION.findall(dump):
        if name == function:
            values = {key: int(value) for key, value in _FIELD.findall(fields)}
            return Usage(values["REG"], values["STACK"] + values["LOCAL"], values["SHARED"])
    raise ValueError(f"cuobjdump reports no function {function!r}:\n{dump}")


def check_fit(usage: Usage, num_warps: int, target: Target, allow_spills: bool = False) -> tuple[bool, str]:
    """(fits, reason): over-limit shared memory or registers fail to launch, spills cost local-memory
    traffic; with `allow_spills` a spill is only noted."""
    failures: list[str] = []
    if usage.shared > target.max_shared:
        failures.append(f"shared memory {usage.shared} B > {target.max_shared} B")
    if usage.regs > MAX_REGISTERS_PER_THREAD:
        failures.append(f"{usage.regs} registers per thread > {MAX_REGISTERS_PER_THREAD}")
    threads = num_warps * WARP_SIZE
    allocated = -(-usage.regs // REGISTER_GRANULE) * REGISTER_GRANULE * threads
    if allocated > REGISTERS_PER_BLOCK:
        failures.append(f"{usage.regs} registers x {threads} threads > {REGISTERS_PER_BLOCK}")
    notes: list[str] = []
    if usage.stack:
        spill = f"spills: {usage.stack} B of local memory per thread"
        (notes if allow_spills else failures).append(spill + (" (allowed)" if allow_spills else ""))
    return not failures, "; ".join(failures + notes)


def occupancy(regs: int, shared: int, num_warps: int, target: Target) -> tuple[int, float]:
    """(blocks resident per SM, share of the SM's warp slots they fill) as registers, shared memory
    and warps allow: how much latency the SM can hide by switching warps, before any measurement."""
    by_registers = REGISTERS_PER_BLOCK // (-(-regs // REGISTER_GRANULE) * REGISTER_GRANULE * num_warps * WARP_SIZE)
    by_shared = target.shared_per_sm // (shared + RESERVED_SHARED_PER_BLOCK)
    blocks = min(by_registers, by_shared, MAX_WARPS_PER_SM // num_warps, MAX_BLOCKS_PER_SM)
    return blocks, blocks * num_warps / MAX_WARPS_PER_SM


# -- capture ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Launch:
    """One recorded kernel launch: kwargs hold the constexprs and the launch options (num_warps, ...)."""

    op: str
    shape: str
    kernel: Any  # a triton JITFunction
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


@contextmanager
def capture() -> Iterator[list[tuple[Any, tuple[Any, ...], dict[str, Any]]]]:
    """Kernel launches inside the block are recorded as (kernel, args, kwargs), not run."""
    from triton.runtime.jit import JITFunction

    if INTERPRETED:
        raise RuntimeError("launches can only be captured with TRITON_INTERPRET=0 (kernels are interpreted)")
    recorded: list[tuple[Any, tuple[Any, ...], dict[str, Any]]] = []

    def record(kernel: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:  # as JITFunction.run
        recorded.append((kernel, args, kwargs))

    with recording_launches(), mock.patch.object(JITFunction, "run", record):
        yield recorded


def capture_launches(ops: Sequence[str]) -> list[Launch]:
    """Every launch the op table's launchers of `ops` make at the models' steps (and, for attention,
    the sweep), in step order."""
    tables = [get_ops("triton"), get_ops("triton", exact_positions=False)]  # they differ in decode attention
    launches = []
    for step in model_steps() + sweep_steps():
        for op in ops:
            if step.name.startswith("sweep") and op not in ATTENTION_OPS:
                continue
            launchers = {id(fn): fn for fn in (getattr(table, op) for table in tables)}.values()
            for call in op_calls(op, step):
                args = call.args()
                for launcher in launchers:
                    with capture() as recorded:
                        invoke(launcher, call, args)
                    launches += [Launch(op, call.label, kernel, args, kwargs) for kernel, args, kwargs in recorded]
    return launches


# -- compile ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Specialization:
    key: str  # Triton's cache key of the launch: one compile per distinct key
    source: Any  # triton.compiler.ASTSource
    options: Any  # the backend's options (CUDAOptions)


def _gpu_target(target: Target) -> Any:
    from triton.backends.compiler import GPUTarget

    return GPUTarget("cuda", target.capability, WARP_SIZE)


def specialize(launch: Launch, target: Target) -> Specialization:
    """What a launch on `target` would compile, built as `JITFunction.run` builds it but with the
    target's backend in place of the current device's."""
    from triton import knobs
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import compute_cache_key, create_function_from_signature

    kernel = launch.kernel
    backend = make_backend(_gpu_target(target))
    kwargs = dict(launch.kwargs)
    kwargs["debug"] = kwargs.get("debug", kernel.debug) or knobs.runtime.debug
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    kwargs["fpsan_homomorphic_casts"] = knobs.compilation.fpsan_homomorphic_casts
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound_args, specialization, options = binder(*launch.args, **kwargs)
    key = compute_cache_key({}, specialization, options)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound_args, specialization, options)
    return Specialization(key, ASTSource(kernel, signature, constexprs, attrs), options)


def _cuobjdump(cubin: bytes) -> str:
    from triton import knobs

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        return subprocess.run([knobs.nvidia.cuobjdump.path, "--dump-resource-usage", str(path)],
                              capture_output=True, text=True, check=True).stdout


def compile_specialization(spec: Specialization, target: Target) -> Usage:
    """Compiles for `target` and reads the cubin's resources. Shared memory is the static amount plus
    Triton's dynamic allocation: the driver allows at most the opt-in limit minus the static amount
    as dynamic shared memory (sm_90 cubins hold 1 KB of static shared memory even where the kernel
    declares none)."""
    import triton

    compiled = triton.compile(spec.source, target=_gpu_target(target), options=spec.options.__dict__)
    usage = parse_resource_usage(_cuobjdump(compiled.asm["cubin"]), compiled.metadata.name)
    return dataclasses.replace(usage, shared=usage.shared + compiled.metadata.shared)


def _report(launches: list[Launch], spec: Specialization, target: Target, allow_spills: bool) -> KernelReport:
    first = launches[0]
    shape = first.shape + (f" (+{len(launches) - 1})" if len(launches) > 1 else "")
    num_warps = spec.options.num_warps
    common = dict(op=first.op, kernel=first.kernel.__name__, shape=shape, target=target.name, num_warps=num_warps)
    try:
        usage = compile_specialization(spec, target)
    except Exception as exc:  # a compile error is a result to report, whatever raised it
        message = str(exc).strip().splitlines()
        return KernelReport(**common, regs=None, stack=None, shared=None, ok=False,
                            reason=f"compile error: {type(exc).__name__}: {message[0] if message else ''}")
    ok, reason = check_fit(usage, num_warps, target, allow_spills)
    return KernelReport(**common, regs=usage.regs, stack=usage.stack, shared=usage.shared, ok=ok, reason=reason)


def compile_launches(launches: list[Launch], target: Target, allow_spills: bool = False,
                     progress: bool = False) -> list[KernelReport]:
    """One report per distinct specialisation of `launches` on `target`, in first-launch order."""
    groups: dict[tuple[int, str], tuple[Specialization, list[Launch]]] = {}
    for launch in launches:
        spec = specialize(launch, target)
        groups.setdefault((id(launch.kernel), spec.key), (spec, []))[1].append(launch)
    reports = []
    for spec, members in groups.values():
        start = time.perf_counter()
        reports.append(_report(members, spec, target, allow_spills))
        if progress:
            print(f"{_progress_line(reports[-1])} ({time.perf_counter() - start:.1f} s)", file=sys.stderr, flush=True)
    return reports


def _check_names(kind: str, names: Sequence[str], allowed: Sequence[str]) -> list[str]:
    unknown = [name for name in names if name not in allowed]
    if unknown:
        raise ValueError(f"unknown {kind} {', '.join(map(repr, unknown))}; choose from {', '.join(allowed)}")
    return list(names)


def compile_kernels(targets: list[str], ops: list[str] | None = None, allow_spills: bool = False,
                    progress: bool = False) -> list[KernelReport]:
    """Compiles every kernel of `ops` (default: all of OPS) at its real launch configurations for each
    of `targets` (names in TARGETS); `progress` prints a line per kernel to stderr."""
    targets = _check_names("target", targets, list(TARGETS))
    ops = _check_names("op", OPS if ops is None else ops, OPS)
    if not HAS_TRITON:
        raise RuntimeError("triton is not installed: there is no compiler to run")
    if INTERPRETED:
        return _compile_in_subprocess(targets, ops, allow_spills, progress)
    launches = capture_launches(ops)
    return [report for name in targets for report in compile_launches(launches, TARGETS[name], allow_spills, progress)]


def _compile_in_subprocess(targets: list[str], ops: list[str], allow_spills: bool,
                           progress: bool) -> list[KernelReport]:
    """`compile_kernels` in a fresh interpreter with TRITON_INTERPRET=0, importing this pocketllm.
    TRITON_DEFAULT_FP_FUSION=1 is Triton's default, set only to silence its warning about it."""
    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "TRITON_INTERPRET": "0",
           "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    command = [sys.executable, "-m", "pocketllm.lab.compile", "--json", "--target", ",".join(targets), *ops]
    command += (["--allow-spills"] if allow_spills else []) + ([] if progress else ["--quiet"])
    done = subprocess.run(command, env=env, stdout=subprocess.PIPE, stderr=None if progress else subprocess.PIPE,
                          text=True)
    try:
        rows = json.loads(done.stdout)
    except json.JSONDecodeError:
        raise RuntimeError(f"the compile subprocess failed (exit {done.returncode}): "
                           f"{(done.stderr or '(see its output above)')[-2000:]}") from None
    return [KernelReport(**row) for row in rows]


# -- output and command line --------------------------------------------------------------------

_COLUMNS = ("target", "op", "kernel", "shape", "warps", "regs", "stack B", "shared B", "blocks/SM (occupancy)",
            "result")


def _cells(report: KernelReport) -> tuple[str, ...]:
    def number(value: int | None) -> str:
        return "-" if value is None else str(value)

    result = ("ok" if report.ok else "FAIL") + (f": {report.reason}" if report.reason else "")
    resident = "-"
    if report.regs is not None and report.shared is not None and report.target in TARGETS:
        blocks, share = occupancy(report.regs, report.shared, report.num_warps, TARGETS[report.target])
        resident = f"{blocks} ({share:.0%})"
    return (report.target, report.op, report.kernel, report.shape, str(report.num_warps), number(report.regs),
            number(report.stack), number(report.shared), resident, result)


def format_table(reports: Sequence[KernelReport]) -> str:
    """A Markdown table, one row per kernel specialisation and target, columns padded to line up."""
    return markdown_table(_COLUMNS, [_cells(report) for report in reports])


def _progress_line(report: KernelReport) -> str:
    return f"{report.target} {report.op} {report.kernel} [{report.shape}]: {_cells(report)[-1]}"


def _target_list(text: str) -> list[str]:
    try:
        return _check_names("target", [name.strip() for name in text.split(",")], list(TARGETS))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("ops", nargs="*", metavar="OP", help=f"ops to compile (default: all): {', '.join(OPS)}")
    parser.add_argument("--target", type=_target_list, default=list(TARGETS),
                        help=f"comma-separated GPU targets (default: {','.join(TARGETS)})")
    parser.add_argument("--allow-spills", action="store_true",
                        help="report spilling kernels without failing (limits that stop a launch still fail)")
    parser.add_argument("--json", action="store_true", help="print the reports as JSON instead of a table")
    parser.add_argument("--quiet", action="store_true", help="no progress line per kernel on stderr")


DESCRIPTION = ("Compile every Triton kernel at its real launch configurations for NVIDIA GPU targets, on the CPU, "
               "and report registers, spills and shared memory per kernel. Exit status 1 when a kernel fails to "
               "compile, spills, or exceeds the target's shared memory or registers.")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Adds `compile` to a command line's subparsers (`pocketllm lab compile`); it runs `run`."""
    parser = subparsers.add_parser("compile", help="compile the Triton kernels for GPU targets and report "
                                                   "their resources", description=DESCRIPTION)
    _add_arguments(parser)
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """The command: the table (or JSON) on stdout; 0 when every kernel fits, else 1."""
    start = time.perf_counter()
    reports = compile_kernels(args.target, args.ops or None, args.allow_spills, progress=not args.quiet)
    failing = sum(not report.ok for report in reports)
    if args.json:
        print(json.dumps([dataclasses.asdict(report) for report in reports]))
    else:
        print(format_table(reports))
        print(f"\n{len(reports)} kernel specialisations compiled for {', '.join(args.target)} in "
              f"{time.perf_counter() - start:.0f} s; {failing} failing")
    return 1 if failing else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pocketllm.lab.compile", description=DESCRIPTION)
    _add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        _check_names("op", args.ops, OPS)
    except ValueError as exc:
        parser.error(str(exc))
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
