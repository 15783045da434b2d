"""Mixture of experts: each token through the SwiGLU of its top-k experts, the contributions
weighted and summed (Qwen3-MoE, Qwen3.5-MoE).

    moe(x [T, H], topk_ids [T, K] int64, topk_weights [T, K] fp32,
        w_gate_up [E, 2I, H] (gate rows first, then up), w_down [E, H, I] or [E, S, H, I/S]) -> [T, H]

The routing that makes (topk_ids, topk_weights) from router logits is `moe_routing.route`.

What a token's output is, whatever else is in the call (every implementation): its rank-k
contribution is y_k = down_e(silu(gate_e(x)) * up_e(x)) with e = topk_ids[t, k], the products and
the activation rounded to x's dtype as a dense SwiGLU's are; out = sum over k = 0, 1, ..., K - 1 IN
RANK ORDER of y_k * topk_weights[t, k], in fp32 starting from the k = 0 term, rounded once to x's
dtype. The order is the token's own (its ranking), never the order in which tokens happen to be
grouped by expert, so a token's bits depend only on that token. A down matrix given as S shards of
its input features ([E, S, H, I/S], S a power of two) is multiplied as `linear.in_shards` multiplies
a row-parallel matrix: each shard's product, the S products summed in the fixed tree
(`parallel/tree.py`), which is how a tensor- or expert-parallel engine's ranks keep the bits of one
process (`models/experts.py`).

- `moe_ref`: the reference: tokens grouped by expert, one plain F.linear per expert.
- `moe_row_invariant` (the torch backend): the same grouping, each expert's product in the dense
  linear's fixed DECODE_ROW_TILE-row GEMM calls (`linear.linear_row_invariant`), for decode and
  prefill rows alike, so a row's bits depend on the row, never on how many rows chose its expert.
- `moe_fixed_order` (the torch backend with exact positions, where the C++ kernels build): each
  expert's product by the fixed-order C++ kernel of `linear.linear_fixed_order`; for fp32 rows every
  expert in one C++ call (`kernels/cpu/moe.cpp`: the grouping, the products and the SiLU-and-multiply
  with no Python per expert), the same bits.
- `moe_bf16_dot` (bf16 experts with `bf16_product="dot"`): `moe_fixed_order`'s one call with every
  product on bf16 dot products, as `linear.linear_bf16_dot` multiplies (rows rounded to bf16).
- `moe_triton`: a grouped GEMM, as vLLM's and SGLang's fused MoE, made invariant: (token, rank)
  pairs sorted by expert (stable), each expert's pairs padded to whole BLOCK_M row blocks; one
  kernel computes gate and up of a block (fixed tiles, K in fixed BLOCK_K steps, no split-K) and
  the SiLU-and-mul, one the down product into the pair's own row (no atomics), one sums each
  token's K rows in rank order. A pair's row never mixes with the other rows of its block.
"""

from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from ._cases import randn
from ._linear_triton import TILES, k_block
from ._moe_triton import COMBINE_BLOCK, DOWN_WARPS, align_pairs, moe_combine_kernel, moe_down_kernel, moe_gate_up_kernel
from ._tree import REDUCTION_SHARDS
from ._triton import kernel_device_ok, launch_device_type, triton
from .cpu.extension import load_extension, unavailable_reason
from .linear import in_shards, linear_fixed_order, linear_row_invariant
from .moe_routing import route
from .silu_and_mul import silu_and_mul_ref
from .spec import Call, Cost, Layout, OpSpec, Step, size


class Moe(Protocol):
    """x [T, H], topk_ids [T, K] (int64), topk_weights [T, K] (fp32), w_gate_up [E, 2I, H],
    w_down [E, H, I] or [E, S, H, I/S] -> [T, H] in x's dtype; contributions summed in rank order."""

    def __call__(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                 w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor: ...


def combine(contributions: torch.Tensor, topk_weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[T, K, H] expert outputs and [T, K] weights -> [T, H]: sum over k = 0..K-1 in rank order of
    y_k * w_k, in fp32 from the k = 0 term, rounded once to `dtype`."""
    weights = topk_weights.float()
    acc = contributions[:, 0].float() * weights[:, :1]
    for k in range(1, contributions.shape[1]):
        acc = acc + contributions[:, k].float() * weights[:, k:k + 1]
    return acc.to(dtype)


Product = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # rows [M, K] x W [N, K] -> [M, N]


def experts_by_group(x: torch.Tensor, topk_ids: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                     product: Product) -> torch.Tensor:
    """[T, K, H]: each (token, rank) pair's expert output, the pairs grouped by expert and each
    expert's rows multiplied by `product` (which must give a row the same bits in any group); a
    sharded down matrix through `in_shards`."""
    tokens, top_k = topk_ids.shape
    out = x.new_zeros(tokens * top_k, x.shape[1])
    if tokens == 0:
        return out.view(tokens, top_k, x.shape[1])
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=w_gate_up.shape[0]).tolist()
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        pairs = order[start:start + count]
        start += count
        hidden = silu_and_mul_ref(product(x.index_select(0, pairs // top_k), w_gate_up[expert]))
        out[pairs] = (in_shards(product, hidden, w_down[expert].unbind(0)) if w_down.dim() == 4
                      else product(hidden, w_down[expert]))
    return out.view(tokens, top_k, x.shape[1])


def _check(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w_gate_up: torch.Tensor,
           w_down: torch.Tensor) -> None:
    experts, inter2, hidden = w_gate_up.shape
    shards = w_down.shape[1] if w_down.dim() == 4 else 1
    down = (experts, shards, hidden, inter2 // 2 // shards) if w_down.dim() == 4 else (experts, hidden, inter2 // 2)
    if (x.dim() != 2 or x.shape[1] != hidden or inter2 % 2 or inter2 // 2 % shards or shards & (shards - 1)
            or tuple(w_down.shape) != down
            or topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0]):
        raise ValueError(f"moe takes x [T, H], topk_ids and topk_weights [T, K], w_gate_up [E, 2I, H], "
                         f"w_down [E, H, I] or [E, S, H, I/S] (S a power of two); got {tuple(x.shape)}, "
                         f"{tuple(topk_ids.shape)}, {tuple(topk_weights.shape)}, {tuple(w_gate_up.shape)}, "
                         f"{tuple(w_down.shape)}")


def moe_ref(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w_gate_up: torch.Tensor,
            w_down: torch.Tensor) -> torch.Tensor:
    """The reference: tokens grouped by expert, F.linear per expert, summed in rank order."""
    _check(x, topk_ids, topk_weights, w_gate_up, w_down)
    return combine(experts_by_group(x, topk_ids, w_gate_up, w_down, F.linear), topk_weights, x.dtype)


def moe_row_invariant(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w_gate_up: torch.Tensor,
                      w_down: torch.Tensor) -> torch.Tensor:
    """The reference's arithmetic with each expert's rows in fixed-shape GEMM calls (the dense
    linear's DECODE_ROW_TILE-row tiles): a row's bits never depend on how many rows share its expert."""
    _check(x, topk_ids, topk_weights, w_gate_up, w_down)
    return combine(experts_by_group(x, topk_ids, w_gate_up, w_down, linear_row_invariant), topk_weights, x.dtype)


def moe_fixed_order(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w_gate_up: torch.Tensor,
                    w_down: torch.Tensor) -> torch.Tensor:
    """Each expert's product by the C++ fixed-order kernel (RuntimeError where it cannot be built): fp32
    rows on the CPU in one call for all experts, other dtypes one call of the kernel per expert."""
    _check(x, topk_ids, topk_weights, w_gate_up, w_down)
    if x.dtype == torch.float32 and x.device.type == "cpu" and w_gate_up.dtype == w_down.dtype \
            and w_down.dtype in (torch.float32, torch.bfloat16) and load_extension() is not None:
        return _one_call(x, topk_ids, topk_weights, w_gate_up, w_down, dot=False)
    return combine(experts_by_group(x, topk_ids, w_gate_up, w_down, linear_fixed_order), topk_weights, x.dtype)


def moe_bf16_dot(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w_gate_up: torch.Tensor,
                 w_down: torch.Tensor) -> torch.Tensor:
    """bf16 experts under fp32 rows (`bf16_product="dot"`): `moe_fixed_order`'s one call with every
    product as `linear.linear_bf16_dot` computes it (its rows rounded to bf16: the tokens, then the
    SiLU-and-multiply's output). RuntimeError where the C++ kernels cannot be built here."""
    _check(x, topk_ids, topk_weights, w_gate_up, w_down)
    if x.dtype != torch.float32 or w_gate_up.dtype != torch.bfloat16 or w_down.dtype != torch.bfloat16:
        raise ValueError(f"moe 'bf16_dot' takes fp32 x and bf16 experts, got {x.dtype}, {w_gate_up.dtype}, "
                         f"{w_down.dtype}")
    return _one_call(x, topk_ids, topk_weights, w_gate_up, w_down, dot=True)


def _one_call(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w_gate_up: torch.Tensor,
              w_down: torch.Tensor, dot: bool) -> torch.Tensor:
    """Every expert in one C++ call (`kernels/cpu/moe.cpp`), combined in rank order."""
    module = load_extension()
    if module is None:
        raise RuntimeError(f"moe's one C++ call needs pocketllm's C++ CPU kernels: {unavailable_reason()}")
    tokens, top_k = topk_ids.shape
    experts = module.moe_experts(x, topk_ids.long(), w_gate_up, w_down, dot)
    return combine(experts.view(tokens, top_k, x.shape[1]), topk_weights, x.dtype)


# -- Triton ------------------------------------------------------------------------------------------


def moe_triton(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w_gate_up: torch.Tensor,
               w_down: torch.Tensor) -> torch.Tensor:
    """[T, H] in x's dtype: the grouped GEMM (see the module docstring), tile sizes constants per
    device kind (`linear.TILES`), never derived from T or from how many pairs an expert got."""
    kernel_device_ok(x)
    _check(x, topk_ids, topk_weights, w_gate_up, w_down)
    tokens, hidden = x.shape
    experts, inter = w_gate_up.shape[0], w_gate_up.shape[1] // 2
    top_k = topk_ids.shape[1]
    out = torch.empty_like(x)
    if tokens == 0:
        return out
    x = x.contiguous()
    # (the kernels take W's strides: a down matrix's shards as column slices are read in place)
    w_gate_up, w_down = w_gate_up.contiguous(), w_down if w_down.stride(-1) == 1 else w_down.contiguous()
    device_type = launch_device_type(x)
    block_m, block_n, block_k = TILES[device_type]
    host_dot = device_type == "cpu"
    pair_ids, block_expert = align_pairs(topk_ids.to(torch.int64), experts, block_m)
    num_blocks, pairs = block_expert.numel(), tokens * top_k
    h = torch.empty((num_blocks * block_m, inter), dtype=x.dtype, device=x.device)
    moe_gate_up_kernel[(num_blocks, triton.cdiv(inter, block_n))](
        x, w_gate_up, h, pair_ids, block_expert, pairs, top_k, hidden, inter,
        x.stride(0), w_gate_up.stride(0), w_gate_up.stride(1), h.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, HOST_DOT=host_dot)
    # A sharded down matrix [E, S, H, I/S]: its shards in one launch, summed in the tree (8 warps: the
    # tree's three levels fit the registers), a whole one as one shard.
    shards, stride_ws = (w_down.shape[1], w_down.stride(1)) if w_down.dim() == 4 else (1, 0)
    down = w_down.select(1, 0) if w_down.dim() == 4 else w_down
    width = inter // shards
    y = torch.empty((pairs, hidden), dtype=x.dtype, device=x.device)
    moe_down_kernel[(num_blocks, triton.cdiv(hidden, block_n))](
        h, down, y, pair_ids, block_expert, pairs, hidden, width,
        h.stride(0), down.stride(0), stride_ws, down.stride(1), y.stride(0), SHARDS=shards,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=k_block(device_type, width), HOST_DOT=host_dot,
        num_warps=DOWN_WARPS)
    weights = topk_weights.float().contiguous()
    # No fused multiply-add: each product rounded before it is added, as `combine` (and so the ranks
    # of a tensor-parallel engine, models/experts.py) computes it.
    moe_combine_kernel[(tokens, triton.cdiv(hidden, COMBINE_BLOCK))](y, weights, out, hidden, TOP_K=top_k,
                                                                      BLOCK=COMBINE_BLOCK, enable_fp_fusion=False)
    return out


# -- declaration -------------------------------------------------------------------------------------

# The lab's launch shapes: the step's hidden size through a layer of 64 experts of width 512, top 8
# (a real MoE layer's routing fan-out at a size whose weights the lab can allocate).
LAUNCH_EXPERTS, LAUNCH_TOP_K, LAUNCH_INTER = 64, 8, 512


def _launches(step: Step) -> list[Call]:
    hidden, tokens = step.cfg.hidden_size, step.tokens

    def args() -> tuple[Any, ...]:
        # Pair p = t * K + k picks expert 7p mod E: K distinct experts per token, spread evenly.
        ids = torch.arange(tokens * LAUNCH_TOP_K, device=step.device).reshape(tokens, LAUNCH_TOP_K) * 7 % LAUNCH_EXPERTS
        weights = torch.full((tokens, LAUNCH_TOP_K), 1.0 / LAUNCH_TOP_K, device=step.device)
        return (step.tensor(tokens, hidden), ids, weights, step.tensor(LAUNCH_EXPERTS, 2 * LAUNCH_INTER, hidden),
                step.tensor(LAUNCH_EXPERTS, hidden, LAUNCH_INTER))

    def sharded() -> tuple[Any, ...]:  # the down matrices as the model keeps them under the tree
        *rest, down = args()
        return (*rest, down.view(LAUNCH_EXPERTS, hidden, REDUCTION_SHARDS, -1).transpose(1, 2))

    return [Call(f"{step.name}: experts", args), Call(f"{step.name}: experts, the tree's shards", sharded)]


def _cost(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, w_gate_up: torch.Tensor,
          w_down: torch.Tensor) -> Cost:
    """Reads x, the routing and the weights of the experts some token chose; writes [T, H];
    2 * 3 * H * I FLOPs per (token, rank) pair."""
    experts, inter2, hidden = w_gate_up.shape
    chosen = int(torch.unique(topk_ids).numel()) if topk_ids.numel() else 0
    weights = chosen * (inter2 * hidden + hidden * inter2 // 2) * w_gate_up.element_size()
    return Cost(size(x, topk_ids, topk_weights) + weights + x.numel() * x.element_size(),
                2 * topk_ids.numel() * hidden * (inter2 + inter2 // 2))


def _tokens(gen: torch.Generator, n: int, dims: dict, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """x, and its routing from random logits; with `ties`, logits of three values only (many
    equal probabilities, ranked by expert index)."""
    experts = dims["experts"]
    logits = (torch.randint(0, 3, (n, experts), generator=gen).float() if dims["ties"]
              else torch.randn(n, experts, generator=gen))
    ids, weights = route(logits, dims["top_k"], dims["normalize"])
    return {"x": randn(gen, n, dims["hidden"], dtype=dtype), "topk_ids": ids, "topk_weights": weights}


def _shared(gen: torch.Generator, dims: dict, dtype: torch.dtype) -> dict[str, Any]:
    experts, hidden, inter, shards = dims["experts"], dims["hidden"], dims["inter"], dims["shards"]
    down = randn(gen, experts, hidden, inter, dtype=dtype, scale=inter ** -0.5)
    if shards > 1:  # W's input features in S shards: [E, S, H, I/S]
        down = down.view(experts, hidden, shards, inter // shards).transpose(1, 2).contiguous()
    return {"w_gate_up": randn(gen, experts, 2 * inter, hidden, dtype=dtype, scale=hidden ** -0.5), "w_down": down}


# Expert counts 1..16, top-k 1..8 (k = E: every expert chosen), odd widths, down matrices in 1, 2 or
# 8 shards (odd shard widths); rows alone, in groups and nine single rows (tokens sharing an expert;
# with 16 experts and top 1, experts no token chose).
_MEMBERS = [[(1, 0)], [(1, 0), (3, 0), (2, 0)], [(1, 0)] * 9]
CASES = Layout(_tokens, None, _shared, [
    ({"experts": e, "top_k": k, "hidden": h, "inter": i, "normalize": norm, "ties": ties, "shards": shards}, members)
    for e, k, h, i, norm, ties, shards in ((1, 1, 24, 16, False, False, 1), (8, 2, 40, 24, True, False, 8),
                                           (16, 1, 33, 17, False, True, 1), (6, 6, 24, 40, True, True, 2),
                                           (12, 8, 20, 12, False, False, 1), (4, 2, 36, 56, False, False, 8))
    for members in _MEMBERS])

OP = OpSpec("moe", Moe, {"ref": moe_ref, "row_invariant": moe_row_invariant, "fixed_order": moe_fixed_order,
                         "bf16_dot": moe_bf16_dot, "triton": moe_triton},
            order=55, cases=CASES, launches=_launches, cost=_cost)
