"""Linear layers: y = x @ W^T (+ b).

`linear_ref` is the plain reference. `linear_row_invariant` (decode rows, and the lm_head) and
`prefill_linear_row_invariant` (the token rows of a prefill) are what the torch backend runs. CPU
BLAS picks its GEMM algorithm (blocking, micro-kernel, thread split) from the call's shape, so a
row's bits can change with how many other rows share the call, at row counts that differ between
CPUs and BLAS libraries. No threshold measured on one CPU holds on another, so the torch backend
does not rely on any: it cuts the rows into tiles of a fixed number of rows (the last one
zero-padded) and makes one GEMM call per tile. Every call has the same shape, strides and
alignment whatever the batch, so the BLAS takes the same path for every tile. What is left to the BLAS is that a row's
result does not depend on its position inside a tile; `kernels/probe.py` checks exactly that on
the model's own weights when an engine starts, and the tests re-measure it.
`linear_triton` is the Triton kernel, row invariant by construction (fixed tiles, no split-K).
`linear_fixed_order` is the C++ CPU kernel (`kernels/cpu/`), which owns its reduction order: a
row's bits are a function of its values, W, b and K alone, by construction, with no BLAS involved.
"""

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from ._cases import ROWS, randn, rows
from ._linear_triton import TRITON_MAX_SHARDS, linear_triton, linear_triton_shards
from ._tree import REDUCTION_SHARDS, tree_sum
from .cpu.extension import load_extension, unavailable_reason
from .spec import Call, Cost, Layout, OpSpec, Step, size

# Rows per GEMM call of the torch backend, one constant per kind of row, so a row's tile shape
# depends only on whether it is decoded or prefilled, never on the batch. Decode tiles are small
# because a decode call is bound by reading W, so a few rows cost about what one does; prefill
# tiles are large enough that a long prompt's many calls stay close to one big call.
DECODE_ROW_TILE = 4
PREFILL_ROW_TILE = 64
# Alignment of the staged input's rows and of loaded weights, in bytes: every tile and every weight
# starts on the same alignment (the probe checks the weights).
ALIGN_BYTES = 64


class Linear(Protocol):
    """x [M, K], weight [N, K], bias [N] or None -> [M, N]. The same signature serves `prefill_linear`."""

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor: ...


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """[M, K] x [N, K] -> [M, N]."""
    return F.linear(x, weight, bias)


def _staged_rows(x: torch.Tensor, num_tiles: int, row_tile: int) -> torch.Tensor:
    """x copied into a zeroed [num_tiles * row_tile, K] view whose rows start on a 64-byte
    boundary, so that every tile handed to the BLAS has the same alignment and strides."""
    rows, k = x.shape
    per_row = max(1, ALIGN_BYTES // x.element_size())
    padded_k = -(-k // per_row) * per_row
    staged = x.new_zeros(num_tiles * row_tile, padded_k)[:, :k]
    staged[:rows] = x
    return staged


def linear_row_invariant(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                         row_tile: int = DECODE_ROW_TILE) -> torch.Tensor:
    """[M, K] x [N, K] (+ [N]) -> [M, N], one fixed-shape GEMM (W @ tile^T) per `row_tile` rows.

    A row's bits depend on its values, W, b and `row_tile` only: never on M, nor on which tile it
    lands in. W @ x^T rather than x @ W^T: MKL's GEMM is faster in that orientation at decode sizes.
    """
    rows = x.shape[0]
    num_tiles = max(1, -(-rows // row_tile))
    staged = _staged_rows(x, num_tiles, row_tile)
    # Each tile's product lands in its own contiguous [N, row_tile] slab: one copy (the transpose
    # back to rows) follows, not a concatenation as well.
    slabs = x.new_empty(num_tiles, weight.shape[0], row_tile)
    for i in range(num_tiles):
        torch.matmul(weight, staged[i * row_tile:(i + 1) * row_tile].T, out=slabs[i])
    # Contiguous whatever the tile count (one tile's transpose is only a view), so the ops after
    # see one layout.
    out = slabs.transpose(1, 2).reshape(num_tiles * row_tile, -1)[:rows].contiguous()
    return out if bias is None else out + bias


def _fp32_row_product() -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """[1, K] x [N, K] -> [1, N] in fp32 on the CPU by the fastest matrix-vector product this torch
    has: oneDNN's linear (it streams W faster than MKL's GEMV), else F.linear. (oneDNN has no fp16
    product on CPUs without AVX-512 FP16, so other dtypes take F.linear.)"""
    dnn = getattr(torch.ops.mkldnn, "_linear_pointwise", None) if torch.backends.mkldnn.is_available() else None
    if dnn is None:
        return F.linear
    return lambda row, weight: dnn(row, weight, None, "none", [], "")


FP32_ROW_PRODUCT = _fp32_row_product()
# A weight over this size (the lm_head) is multiplied in blocks of BLOCK_ROWS rows, so that each
# block stays in the last-level cache while every row of the batch reads it. Both depend on the
# weight only, so a row's calls are the same in any batch.
MAX_UNBLOCKED_BYTES = 32 * 2**20
BLOCK_ROWS = 4096


def linear_per_row(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """[M, K] x [N, K] (+ [N]) -> [M, N], one matrix-vector call per row (and per block of W).

    The other decode strategy beside linear_row_invariant: every row is its own call of one shape,
    on a 64-byte aligned copy of the row, so a row's bits depend on its values, W and b only, with
    nothing left to the library but computing the same call the same way. It is the fastest
    product for one row (W is streamed once, at the matrix-vector rate); a batch of B rows reads
    W from memory once and from the cache B - 1 times, which soon costs more than 4-row tiles.
    """
    rows, n = x.shape[0], weight.shape[0]
    product = FP32_ROW_PRODUCT if weight.dtype == torch.float32 and weight.device.type == "cpu" else F.linear
    staged = _staged_rows(x, rows, 1)
    out = x.new_empty(rows, n)
    block_rows = BLOCK_ROWS if weight.numel() * weight.element_size() > MAX_UNBLOCKED_BYTES else max(n, 1)
    for start in range(0, n, block_rows):
        block = weight[start:start + block_rows]
        for i in range(rows):
            out[i:i + 1, start:start + block.shape[0]] = product(staged[i:i + 1], block)
    return out if bias is None else out + bias


# The dtypes `linear_fixed_order` takes. The kernel reads fp32 or bf16 weights (bf16 widened to fp32
# as it loads them: exactly, so a bf16 W gives the bits of W.float()) with fp32 rows. Rows in bf16 or
# fp16 are widened to fp32 first and the result rounded once to their dtype, so the order stays the
# kernel's; an fp16 W (the lab's fp16 cases) is widened to an fp32 copy per call.
FIXED_ORDER_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def linear_fixed_order(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """[M, K] x [N, K] (+ [N]) -> [M, N] by the C++ kernel of `kernels/cpu/linear.cpp`, in its one
    documented reduction order (16 lanes over K, a fixed tree, then the bias): row invariant, thread
    count and alignment invariant by construction. x and the bias are fp32, fp16 or bf16; the weight
    is of x's dtype, or bf16 under fp32 rows (bf16 weights: half the bytes a decode step reads). Raises
    RuntimeError when the kernel cannot be built here; the op never falls back to another product on
    its own. Runs the best variant this CPU has (AVX-512 or AVX2)."""
    return _fixed_order(x, weight, bias, "")


def linear_fixed_order_avx2(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`linear_fixed_order` on its AVX2 variant on any CPU that has AVX2: the same order, so the same
    bits, as the AVX-512 one; the benchmark and the tests run it beside the default on AVX-512 CPUs."""
    return _fixed_order(x, weight, bias, "avx2")


def _fixed_order(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, variant: str) -> torch.Tensor:
    module = load_extension()
    if module is None:
        raise RuntimeError(f"linear 'fixed_order' needs pocketllm's C++ CPU kernels: {unavailable_reason()}")
    bf16_weight = x.dtype == torch.float32 and weight.dtype == torch.bfloat16
    if x.dtype not in FIXED_ORDER_DTYPES or (weight.dtype != x.dtype and not bf16_weight) or \
            (bias is not None and bias.dtype != x.dtype):
        raise ValueError(f"linear 'fixed_order' takes fp32 (or fp16/bf16) x and bias and a weight of x's dtype "
                         f"(or bf16 under fp32 x), got {x.dtype}, {weight.dtype}, "
                         f"{None if bias is None else bias.dtype}")
    if x.dtype == torch.float32:
        return module.linear(x, weight, bias, variant)
    out = module.linear(x.float(), _kernel_weight(weight), None if bias is None else bias.float(), variant)
    return out.to(x.dtype)


def _kernel_weight(weight: torch.Tensor) -> torch.Tensor:
    """A weight under fp16 or bf16 rows as the kernel takes it: bf16 as it is (widened exactly as it is
    loaded), fp16 as an fp32 copy."""
    return weight if weight.dtype == torch.bfloat16 else weight.float()


def linear_bf16_dot(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 rows [M, K] x a bf16 weight [N, K] (+ an fp32 bias) -> fp32 [M, N] on bf16 dot products
    (`kernels/cpu/linear.cpp`'s `linear_bf16_dot`): x rounded to bf16 as `x.to(torch.bfloat16)`
    rounds it, each pair of elements one VDPBF16PS step (its products exact, its sums rounded once,
    denormals flushed) in the fixed lane order and tree of `linear_fixed_order`. The instruction where
    the CPU has AVX512-BF16, its software form with the same bits on any AVX2 CPU, the same sequence for
    every row count (an odd K: one zero element more). Raises RuntimeError when the kernel cannot be
    built here."""
    return _bf16_dot(x, weight, bias, "")


def linear_bf16_dot_avx2(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`linear_bf16_dot` in its software form (AVX2 FMAs), on any CPU: the instruction's bits."""
    return _bf16_dot(x, weight, bias, "avx2")


def _bf16_dot(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, variant: str) -> torch.Tensor:
    module = load_extension()
    if module is None:
        raise RuntimeError(f"linear 'bf16_dot' needs pocketllm's C++ CPU kernels: {unavailable_reason()}")
    if x.dtype != torch.float32 or weight.dtype != torch.bfloat16 or (bias is not None and bias.dtype != x.dtype):
        raise ValueError(f"linear 'bf16_dot' takes fp32 x and bias and a bf16 weight, got {x.dtype}, {weight.dtype}, "
                         f"{None if bias is None else bias.dtype}")
    return module.linear_bf16_dot(x, weight, bias, variant)


def in_shards(linear: Callable[..., torch.Tensor], x: torch.Tensor, shards: Sequence[torch.Tensor]) -> torch.Tensor:
    """x @ W^T for W given as its K slices `shards` (a power of two of them, of equal width): each
    slice's product by `linear`, summed in the fixed tree (`_tree.tree_sum`). The order of a
    row-parallel product at every tensor-parallel size (`parallel/tree.py`). The C++ fixed-order
    kernel and the Triton kernel sum their shards themselves, in one call and in the same order
    (`native_shards`); any other implementation runs one call per shard."""
    if len(shards) == 1:
        return linear(x, shards[0])
    native = native_shards(linear, x.dtype, len(shards))
    if native is not None:
        return native(x, shards)
    width = shards[0].shape[1]
    return tree_sum([linear(x[:, i * width:(i + 1) * width].contiguous(), shard) for i, shard in enumerate(shards)])


Sharded = Callable[[torch.Tensor, Sequence[torch.Tensor]], torch.Tensor]


def native_shards(linear: Callable[..., torch.Tensor], dtype: torch.dtype,
                  count: int = REDUCTION_SHARDS) -> Sharded | None:
    """The one-call form of `linear` over `count` K shards of a matrix for rows of `dtype` (bit for
    bit what `in_shards` gives with one call per shard), or None where there is none: the C++ kernels
    (where they build here) take the rows they take one matrix with (the fixed-order kernel fp32, fp16
    and bf16, the bf16 dot products fp32), the Triton kernel any dtype and up to 8 shards."""
    if linear is linear_triton:
        return linear_triton_shards if count <= TRITON_MAX_SHARDS else None
    native = _CPU_SHARDS.get(linear)
    return native[0] if native is not None and dtype in native[1] and load_extension() is not None else None


def _native_shards(variant: str, dot: bool = False) -> Sharded:
    def run(x: torch.Tensor, shards: Sequence[torch.Tensor]) -> torch.Tensor:
        module = load_extension()
        assert module is not None  # native_shards checked
        if dot:
            return module.linear_bf16_dot_shards(x, list(shards), variant)
        if x.dtype == torch.float32:
            return module.linear_shards(x, list(shards), variant)
        # Rows of fp16 or bf16: widened as `_fixed_order` widens them, and each shard's product and each
        # level's sum rounded to their dtype in the kernel, as one call per shard and `tree_sum` round them.
        wide = [_kernel_weight(shard) for shard in shards]
        return module.linear_shards(x.float(), wide, variant, str(x.dtype).removeprefix("torch.")).to(x.dtype)
    return run


# The C++ linear implementations whose kernel sums K shards itself, and the dtypes of rows it takes.
_CPU_SHARDS: dict[Callable[..., torch.Tensor], tuple[Sharded, tuple[torch.dtype, ...]]] = {
    linear_fixed_order: (_native_shards(""), FIXED_ORDER_DTYPES),
    linear_fixed_order_avx2: (_native_shards("avx2"), FIXED_ORDER_DTYPES),
    linear_bf16_dot: (_native_shards("", dot=True), (torch.float32,)),
    linear_bf16_dot_avx2: (_native_shards("avx2", dot=True), (torch.float32,))}
# The linear implementations whose bits do not depend on where a weight starts (the C++ kernels load
# unaligned throughout), so their weights may be views at any offset, such as the shards above.
ALIGNMENT_FREE = frozenset(_CPU_SHARDS)


# -- declaration -------------------------------------------------------------------------------------


# The matrices whose input features tensor parallelism splits (`models/row_parallel.py`), by the
# names the model families give them (the shared expert's too): their products are summed in the tree.
ROW_PARALLEL = ("o_proj", "down", "out_proj")


def body_calls(step: Step) -> list[Call]:
    """The token rows through each matrix of a layer (decode rows here, prefill rows in `prefill_linear`)."""
    def matrix(features_in: int, features_out: int) -> Callable[[], tuple[Any, ...]]:
        return lambda: (step.tensor(step.tokens, features_in), step.tensor(features_out, features_in))

    def shards(name: str, features_in: int) -> int:
        tree = name.split()[-1] in ROW_PARALLEL and features_in % REDUCTION_SHARDS == 0
        return REDUCTION_SHARDS if tree else 1

    return [Call(f"{step.name}: {name}", matrix(i, o), shards(name, i)) for name, i, o in step.matrices()]


def _launches(step: Step) -> list[Call]:
    """Decode rows go through `linear`, and the lm_head rows of every step."""
    cfg = step.cfg
    lm_head = Call(f"{step.name}: lm_head", lambda: (step.tensor(step.sequences, cfg.hidden_size),
                                                     step.tensor(cfg.vocab_size, cfg.hidden_size)))
    return (body_calls(step) if step.batch.is_decode else []) + [lm_head]


def cost(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> Cost:
    """[M, K] x [N, K]: reads x, W (once) and the bias, writes [M, N]; 2·M·N·K FLOPs."""
    (m, k), n = x.shape, weight.shape[0]
    return Cost(size(x, weight, bias) + m * n * x.element_size(), 2 * m * n * k)


CASES = Layout(
    rows("x", "k"), None,
    lambda gen, dims, dtype: {"weight": randn(gen, dims["n"], dims["k"], dtype=dtype, scale=dims["k"] ** -0.5),
                              "bias": randn(gen, dims["n"], dtype=dtype) if dims["bias"] else None},
    [({"k": k, "n": n, "bias": bias}, members) for k, n, bias in ((24, 40, False), (67, 33, True))
     for members in ROWS + [[(1, 0)] * 9]])
OP = OpSpec("linear", Linear, {"ref": linear_ref, "row_invariant": linear_row_invariant, "per_row": linear_per_row,
                               "fixed_order": linear_fixed_order, "fixed_order_avx2": linear_fixed_order_avx2,
                               "bf16_dot": linear_bf16_dot, "bf16_dot_avx2": linear_bf16_dot_avx2,
                               "triton": linear_triton},
            order=60, cases=CASES, launches=_launches, cost=cost)
