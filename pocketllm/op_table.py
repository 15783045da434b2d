"""The op table an engine runs: built in one place from its EngineArgs, so that every tensor-parallel
rank (the engine's process and each worker) runs the same ops."""

from __future__ import annotations

from .config import EngineArgs
from .kernels import IMPLEMENTATIONS, Ops, get_ops
from .kernels.cpu.extension import load_extension

# The ops that multiply the weight matrices, and the implementations that multiply bf16 weights under
# fp32 rows (`weight_dtype`): the C++ kernel's, widening them exactly or on bf16 dot products (`bf16_product`).
WEIGHT_OPS = ("linear", "prefill_linear", "moe")
FIXED_ORDER = ("fixed_order", "fixed_order_avx2")
BF16_DOT = ("bf16_dot", "bf16_dot_avx2")


def op_table(args: EngineArgs) -> Ops:
    """The op table `args` selects: the one place it is built, so every tensor-parallel rank runs
    the same ops as rank 0. Weights narrower than the rows (`weight_dtype`) need the ops that
    multiply them to be the C++ fixed-order kernel (on bf16 dot products with `bf16_product="dot"`, the
    default, unless `op_overrides` names theirs); ValueError naming the field otherwise."""
    options = args.options.backend
    overrides = dict(args.op_overrides or {})
    narrow = args.torch_weight_dtype != args.torch_dtype
    if narrow and args.bf16_product == "dot" and load_extension() is not None:
        for op in WEIGHT_OPS:
            overrides.setdefault(op, "bf16_dot")
    ops = get_ops(args.backend, options.batch_invariant, options.decode_per_row, overrides or None,
                  options.exact_positions)
    if narrow:
        others = [op for op in WEIGHT_OPS
                  if getattr(ops, op) not in (IMPLEMENTATIONS[op].get(name) for name in FIXED_ORDER + BF16_DOT)]
        where = []
        if args.backend != "torch":
            where.append(f"backend={args.backend!r}")
        if args.device != "cpu":
            where.append(f"device={args.device!r}")
        if others:
            where.append(f"{', '.join(others)} on other implementations")
        if where:
            raise ValueError(f"weight_dtype={args.weight_dtype!r} with dtype={args.dtype!r} needs the torch backend's "
                             f"C++ fixed-order kernels on the CPU (exact positions on, a C++ compiler here); this "
                             f"engine runs {'; '.join(where)}")
    return ops
