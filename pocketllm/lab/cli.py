"""`pocketllm lab`: check, bench and compile an op's implementations (see docs/kernel_lab.md)."""

from __future__ import annotations

import argparse
from typing import Any

import torch

from ..config import DTYPES, check_device
from ..kernels.registry import IMPLEMENTATIONS, OP_NAMES
from . import compile as lab_compile
from . import timing as lab_timing

CHECK_DESCRIPTION = ("Check an implementation of an op: against the op's reference on its case grid, batch and "
                     "slot invariance, split invariance (prefill ops), the engine's invariance property with the "
                     "implementation installed, and greedy parity against transformers. Exit status 1 on any "
                     "failure; the table names the failed case and by how much.")


def _dtype_list(text: str) -> tuple[torch.dtype, ...]:
    names = [name.strip() for name in text.split(",")]
    unknown = [name for name in names if name not in DTYPES]
    if unknown:
        raise argparse.ArgumentTypeError(f"--dtypes takes a comma-separated list of {sorted(DTYPES)}, got {unknown}")
    return tuple(DTYPES[name] for name in names)  # type: ignore[index]


def _add_check(sub: Any) -> None:
    parser = sub.add_parser("check", help="the full verdict for an implementation of an op",
                            description=CHECK_DESCRIPTION)
    parser.add_argument("op", choices=OP_NAMES, metavar="OP", help=f"one of {', '.join(OP_NAMES)}")
    parser.add_argument("--impl", default=None,
                        help="a registered implementation name, or package.module:function "
                             "(default: the op's triton kernel, else its reference)")
    parser.add_argument("--vs", action="append", default=[], metavar="IMPL",
                        help="also compare against this implementation (repeatable), e.g. --vs triton")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtypes", type=_dtype_list, default=None,
                        help="comma-separated, e.g. float32,float16 (default: float32,float16, and bfloat16 on CUDA)")
    parser.add_argument("--examples", type=int, default=10,
                        help="Hypothesis examples of the engine invariance property per preset (0: skip it)")
    parser.add_argument("--no-parity", action="store_true", help="skip greedy parity against transformers")
    parser.set_defaults(func=_run_check)


def _run_check(args: argparse.Namespace) -> int:
    from .check import check

    impl = args.impl or ("triton" if "triton" in IMPLEMENTATIONS[args.op] else "ref")
    if args.examples < 0:
        raise ValueError(f"--examples must be >= 0, got {args.examples}")
    check_device(args.device, "--device")
    verdict = check(args.op, impl, args.vs, args.device, args.dtypes, args.examples, not args.no_parity)
    print(verdict.table())
    return 0 if verdict.ok else 1


def add_parser(subparsers: Any) -> None:
    """`lab` and its subcommands, on the project command line's subparsers."""
    lab = subparsers.add_parser("lab", help="kernel lab: check, bench and compile op implementations")
    sub = lab.add_subparsers(dest="lab_command", required=True, metavar="{check,bench,compile}")
    _add_check(sub)
    lab_timing.add_parser(sub)
    lab_compile.add_parser(sub)
