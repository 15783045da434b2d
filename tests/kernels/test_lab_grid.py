"""Every registered implementation of every op through the lab's op-level checks, on the op's
case grid: against the reference within the one tolerance table, and (for the implementations an
invariant engine runs, and any `--impl` under test) each member bitwise the same alone and in any
batch, and prefill pieces bitwise the same as one piece. Interpreted Triton kernels run in fp32 on
every other case (the interpreter is slow; each op's tests/kernels/test_<op>.py covers them further).
The products of bf16 weights run on the fp32 grid rounded to bf16 values (`BF16_WEIGHTS`), the
experts against a reference that rounds every product's rows to bf16 as the dot products do."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from kernel_impls import DEVICE, UNDER_TEST

from pocketllm.kernels import backend_impls
from pocketllm.kernels.moe import combine, experts_by_group
from pocketllm.kernels.registry import IMPLEMENTATIONS, OP_NAMES
from pocketllm.lab.check import check_kernel, default_dtypes
from pocketllm.testing.cases import Case, op_cases

# (op, implementation) pairs the engine runs when it promises invariance, plus the one under test.
INVARIANT = {(op, name) for backend, flags in (("torch", (True, False, True)), ("torch", (True, True, False)),
                                              ("torch", (True, False, False)), ("triton", (True, False, True)),
                                              ("triton", (True, False, False)))
             for op, name in backend_impls(backend, *flags).items()} | {(op, UNDER_TEST) for op in OP_NAMES}
PAIRS = [(op, name) for op in OP_NAMES for name in IMPLEMENTATIONS[op]]
# Batch invariant by construction (one call per sequence) but not split invariant by construction:
# torch's fused attention blocks by the piece's shape, so whether two pieces round as one is the
# CPU's and torch's choice. The engine does not promise it (the cuts are part of its configuration),
# so these are not held to the split check.
NOT_SPLIT_INVARIANT = {("prefill_attention", "fused")}
# Products of bf16 weights under fp32 rows only (`weight_dtype="bfloat16"`): checked on the fp32 grid with
# every value rounded to bf16's (kept in fp32, so the product's own rounding of x changes nothing and
# the reference multiplies the same numbers), the weight handed over in bf16.
BF16_WEIGHTS = {"bf16_dot", "bf16_dot_avx2"}


def _bf16_valued(case: Case) -> Case:
    def rounded(values: dict) -> dict:
        return {k: v.bfloat16().float() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                for k, v in values.items()}
    return dataclasses.replace(case, shared=rounded(case.shared),
                               members=[dataclasses.replace(m, tokens=rounded(m.tokens)) for m in case.members])


def _with_bf16_weight(op: str, fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`fn` with its weights handed over in bf16: the linear's matrix, the experts' two."""
    def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return fn(x, weight.bfloat16(), bias)

    def moe(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w_gate_up: torch.Tensor,
            w_down: torch.Tensor) -> torch.Tensor:
        return fn(x, topk_ids, topk_weights, w_gate_up.bfloat16(), w_down.bfloat16())
    return moe if op == "moe" else linear


def _experts_on_bf16_rows(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                          w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """The experts' reference with every product's rows rounded to bf16, as the dot products take
    them: the SiLU-and-multiply's output is a product's rows too, so bf16 values in do not keep it exact."""
    def product(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.linear(rows.bfloat16().float(), weight.float())
    return combine(experts_by_group(x, topk_ids, w_gate_up, w_down, product), topk_weights, x.dtype)


# Triton kernels that launch under the interpreter here; the costliest grids (5-15 s each on a 2-core
# CPU) run under `slow`, the cheaper ones in the default suite.
INTERPRETED = ("triton", "split_kv", UNDER_TEST)
SLOW = {("gated_delta_prefill", "triton"), ("prefill_attention", "triton"), ("moe", "triton"), ("sample", "triton"),
        ("decode_attention", "triton"), ("decode_attention", "split_kv")} if DEVICE == "cpu" else set()


@pytest.mark.parametrize("op, impl", [pytest.param(op, name, marks=[pytest.mark.slow] * ((op, name) in SLOW))
                                      for op, name in PAIRS], ids=[f"{op}-{name}" for op, name in PAIRS])
def test_implementation_passes_the_op_checks(op, impl):
    interpreted = DEVICE == "cpu" and impl in INTERPRETED and op != "embedding"
    cases = op_cases(op, (torch.float32,))[::2] if interpreted else op_cases(op, default_dtypes(DEVICE))
    if (op, impl) in NOT_SPLIT_INVARIANT:
        cases = [dataclasses.replace(case, splittable=False) for case in cases]
    spec: str | Callable[..., torch.Tensor] = impl
    if impl in BF16_WEIGHTS:
        cases = [_bf16_valued(case) for case in cases if case.dtype == torch.float32]
        spec = _with_bf16_weight(op, IMPLEMENTATIONS[op][impl])
    invariance = (op, impl) in INVARIANT or impl in BF16_WEIGHTS  # the engine's bf16 weights run them
    ref = _experts_on_bf16_rows if impl in BF16_WEIGHTS and op == "moe" else "ref"
    verdict = check_kernel(op, spec, device=DEVICE, cases=cases, invariance=invariance, ref=ref)
    assert verdict.ok, verdict.table()


def test_the_grids_cover_the_promised_shapes():
    """Each op's grid has a one-member case, a case of several members, and (prefill ops) a
    sequence that crosses an aligned position, where the split check cuts it."""
    for op in OP_NAMES:
        cases = op_cases(op, (torch.float32,))
        assert any(len(c.members) == 1 for c in cases), op
        assert any(len(c.members) >= 3 for c in cases), op
        if cases[0].splittable:
            assert any(m.start + m.n > 64 > m.start for c in cases for m in c.members), op
