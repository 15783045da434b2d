"""moe (pocketllm/kernels/moe.py): route (softmax, top-k with ties by the lower expert index) and
the experts' SwiGLU contributions summed in rank order.

- `route` against its definition: equal probabilities rank by expert index, transformers' top-k and
  renormalisation on tie-free logits, every row's routing independent of the others;
- the reference against a float64 oracle from the definition (experts no token chose, tokens all on
  one expert, every expert chosen), and its sum bitwise in rank order, not in expert order;
- the implementation under test (by default the Triton grouped GEMM) and the torch backend's
  implementations against the reference on odd shapes (fp32 and fp16), and row / batch invariance:
  every prefix of the rows and every permutation of them give each row the same bits;
- `moe_fixed_order`'s one C++ call for every expert (fp32 rows, fp32 or bf16 experts) bitwise the same
  kernel called once per expert (`experts_by_group` over `linear_fixed_order`), and its argument
  errors naming what is wrong;
- `moe_bf16_dot` (bf16 experts on bf16 dot products) bitwise the dot-product linear per expert;
- a down matrix in S input-feature shards ([E, S, H, I/S], the tensor- and expert-parallel layout):
  each pair's output is its shards' products summed in the fixed tree, built here by hand, on every
  implementation.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_cases import DTYPES
from kernel_cases import randn_on as _randn
from kernel_impls import DEVICE, implementation
from kernel_tolerances import assert_close

from pocketllm.kernels.cpu.extension import load_extension
from pocketllm.kernels.linear import linear_bf16_dot, linear_fixed_order, linear_row_invariant, linear_triton
from pocketllm.kernels.moe import (
    combine,
    experts_by_group,
    moe_bf16_dot,
    moe_fixed_order,
    moe_ref,
    moe_row_invariant,
    moe_triton,
)
from pocketllm.kernels.moe_routing import route
from pocketllm.kernels.silu_and_mul import silu_and_mul_ref

moe_impl = implementation("moe")
TORCH_IMPLS = [moe_row_invariant] + ([moe_fixed_order] if load_extension() is not None else [])


def weights(experts: int, hidden: int, inter: int, seed: int, dtype=torch.float32, device: str = DEVICE):
    return (_randn(experts, 2 * inter, hidden, seed=seed, dtype=dtype, device=device, scale=hidden ** -0.5),
            _randn(experts, hidden, inter, seed=seed + 1, dtype=dtype, device=device, scale=inter ** -0.5))


def oracle(x, ids, w, w_gate_up, w_down) -> torch.Tensor:
    """The definition, token by token in float64."""
    inter = w_down.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            gate_up = w_gate_up[ids[t, k]].double().cpu() @ x[t].double().cpu()
            hidden = F.silu(gate_up[:inter]) * gate_up[inter:]
            out[t] += float(w[t, k]) * (w_down[ids[t, k]].double().cpu() @ hidden)
    return out


# -- routing --------------------------------------------------------------------------------------


def test_route_breaks_ties_by_the_lower_expert_index():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0], [2.0, 2.0, 2.0, 2.0, 2.0], [0.0, 1.0, 0.0, 1.0, 5.0]])
    ids, w = route(logits, 3, normalize=False)
    assert ids.tolist() == [[1, 2, 4], [0, 1, 2], [4, 1, 3]]
    assert torch.equal(w[0], w[0, :1].expand(3)) and w.dtype == torch.float32
    assert torch.allclose(w[1], torch.full((3,), 0.2))


def test_route_matches_transformers_on_tie_free_logits():
    """Softmax in fp32, top-k, and (norm_topk_prob) division by the top-k sum, as transformers'
    Qwen3MoeTopKRouter computes them."""
    logits = torch.randn(37, 12, generator=torch.Generator().manual_seed(0))
    for normalize in (False, True):
        ids, w = route(logits, 4, normalize)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top, top_ids = torch.topk(probs, 4, dim=-1)
        if normalize:
            top = top / top.sum(dim=-1, keepdim=True)
        assert torch.equal(ids, top_ids)
        torch.testing.assert_close(w, top, atol=1e-7, rtol=1e-6)


def test_route_is_row_invariant():
    logits = torch.randn(70, 16, generator=torch.Generator().manual_seed(1))
    ids, w = route(logits, 8, True)
    for rows in (1, 3, 17, 69):
        sub_ids, sub_w = route(logits[:rows], 8, True)
        assert torch.equal(sub_ids, ids[:rows]) and torch.equal(sub_w, w[:rows])
    perm = torch.randperm(70, generator=torch.Generator().manual_seed(2))
    p_ids, p_w = route(logits[perm], 8, True)
    assert torch.equal(p_ids, ids[perm]) and torch.equal(p_w, w[perm])


# -- the reference against its definition ----------------------------------------------------------


@pytest.mark.parametrize("experts,top_k,ids", [
    (8, 2, None),  # random routing: several experts with no token
    (4, 1, [[2]] * 6),  # every token on one expert, the others empty
    (5, 5, None),  # every expert chosen by every token
])
def test_reference_matches_the_definition(experts, top_k, ids):
    tokens, hidden, inter = 6, 24, 20
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(3))
    logits = torch.randn(tokens, experts, generator=torch.Generator().manual_seed(4))
    topk_ids, topk_w = route(logits, top_k, True)
    if ids is not None:
        topk_ids = torch.tensor(ids)
    w_gate_up, w_down = weights(experts, hidden, inter, seed=5, device="cpu")
    out = moe_ref(x, topk_ids, topk_w, w_gate_up, w_down)
    torch.testing.assert_close(out.double(), oracle(x, topk_ids, topk_w, w_gate_up, w_down), atol=1e-5, rtol=1e-5)


def test_contributions_are_summed_in_rank_order():
    """y_0 w_0 + y_1 w_1 + y_2 w_2 left to right in fp32: values where the order shows (1 + 2^-24
    is lost added to 1 first, kept added to its twin first)."""
    tiny = 2.0 ** -24
    y = torch.tensor([[[1.0], [tiny], [tiny]]])
    w = torch.ones(1, 3)
    assert combine(y, w, torch.float32).item() == 1.0  # (1 + tiny) + tiny: each tiny rounds away
    assert combine(y.flip(1), w, torch.float32).item() == 1.0 + 2 * tiny  # (tiny + tiny) + 1


# -- implementations against the reference, invariance --------------------------------------------


def _case(tokens: int, experts: int, top_k: int, hidden: int, inter: int, dtype, seed: int, ties: bool = False):
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randint(0, 2, (tokens, experts), generator=gen).float() if ties
              else torch.randn(tokens, experts, generator=gen))
    ids, w = route(logits, top_k, normalize=seed % 2 == 0)
    x = _randn(tokens, hidden, seed=seed, dtype=dtype)
    return (x, ids.to(x.device), w.to(x.device), *weights(experts, hidden, inter, seed + 1, dtype))


PACKED_ROWS = 16  # linear.cpp's PANEL_MIN_ROWS: from this many rows an expert's product runs the packed tiles
SHAPES = [(1, 4, 1, 24, 16), (11, 8, 2, 40, 24), (19, 16, 8, 33, 17), (5, 3, 3, 20, 12)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens,experts,top_k,hidden,inter", SHAPES)
def test_kernel_matches_reference(tokens, experts, top_k, hidden, inter, dtype):
    args = _case(tokens, experts, top_k, hidden, inter, dtype, seed=tokens + experts)
    out = moe_impl(*args)
    assert out.shape == (tokens, hidden) and out.dtype == dtype
    assert_close(out, moe_ref(*(a.cpu() for a in args)))


@pytest.mark.parametrize("impl", TORCH_IMPLS, ids=lambda f: f.__name__)
def test_torch_backend_implementations_match_reference(impl):
    args = _case(23, 8, 2, 40, 24, torch.float32, seed=7, ties=True)
    assert_close(impl(*(a.cpu() for a in args)), moe_ref(*(a.cpu() for a in args)))


@pytest.mark.parametrize("impl", [moe_impl] + TORCH_IMPLS, ids=lambda f: getattr(f, "__name__", "under_test"))
def test_rows_are_invariant_to_their_batch(impl):
    """A row's bits are the same in any prefix of the batch and in any order of its rows: how many
    rows chose its experts, and in which order they were grouped, never shows."""
    device = DEVICE if impl is moe_impl else "cpu"
    x, ids, w, w_gate_up, w_down = (a.to(device) for a in _case(21, 6, 3, 24, 20, torch.float32, seed=9, ties=True))
    full = impl(x, ids, w, w_gate_up, w_down)
    for rows in (1, 2, 7, 20):
        assert torch.equal(impl(x[:rows], ids[:rows], w[:rows], w_gate_up, w_down), full[:rows]), rows
    perm = torch.randperm(21, generator=torch.Generator().manual_seed(10)).to(device)
    assert torch.equal(impl(x[perm], ids[perm], w[perm], w_gate_up, w_down), full[perm])
    assert impl(x[:0], ids[:0], w[:0], w_gate_up, w_down).shape == (0, 24)


@pytest.mark.skipif(load_extension() is None, reason="pocketllm's C++ CPU kernels cannot be built here")
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("tokens, experts, top_k, hidden, inter", [(1, 4, 2, 40, 24), (23, 8, 2, 40, 24),
                                                                   (19, 16, 1, 33, 17), (40, 6, 6, 24, 40)])
def test_one_call_for_every_expert_is_the_kernel_called_per_expert(weight_dtype, tokens, experts, top_k, hidden,
                                                                   inter):
    """fp32 rows take the one-call path (kernels/cpu/moe.cpp); it must be the per-expert calls' bits:
    rows of 16 and more (the kernel's packed tiles) and fewer, experts no token chose, every expert
    chosen."""
    x, ids, w, w_gate_up, w_down = _case(tokens, experts, top_k, hidden, inter, torch.float32, seed=tokens, ties=False)
    w_gate_up, w_down = w_gate_up.to(weight_dtype), w_down.to(weight_dtype)
    per_expert = combine(experts_by_group(x, ids, w_gate_up, w_down, linear_fixed_order), w, x.dtype)
    assert torch.equal(moe_fixed_order(x, ids, w, w_gate_up, w_down), per_expert)


def _in_shards(w_down: torch.Tensor, shards: int, view: bool = False) -> torch.Tensor:
    """[E, H, I] -> [E, S, H, I/S]: the input features in S shards, copied shard by shard or (`view`)
    as column slices of each expert's matrix, the layout the model keeps."""
    experts, hidden, inter = w_down.shape
    sharded = w_down.view(experts, hidden, shards, inter // shards).transpose(1, 2)
    return sharded if view else sharded.contiguous()


def _tree_by_hand(x, ids, w, w_gate_up, w_down, shards: int, product) -> torch.Tensor:
    """The sharded definition, pair by pair: gate/up by `product`, the down product of each shard
    by `product`, the shards summed (0+1), (2+3), ..., then pairs of those; combined in rank order."""
    width = w_down.shape[2] // shards
    pairs = torch.empty(ids.shape[0], ids.shape[1], x.shape[1], dtype=x.dtype, device=x.device)
    for t in range(ids.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            gate_up = product(x[t:t + 1], w_gate_up[e])
            hidden = silu_and_mul_ref(gate_up)
            parts = [product(hidden[:, s * width:(s + 1) * width].contiguous(),
                             w_down[e][:, s * width:(s + 1) * width].contiguous()) for s in range(shards)]
            while len(parts) > 1:
                parts = [parts[i] + parts[i + 1] for i in range(0, len(parts), 2)]
            pairs[t, k] = parts[0][0]
    return combine(pairs, w, x.dtype)


@pytest.mark.parametrize("shards", [2, 8])
def test_a_sharded_down_matrix_is_its_shards_summed_in_the_tree(shards):
    """On [E, S, H, I/S] the torch backend's row-invariant implementation is the tree built by hand
    over its own product, bit for bit, and the reference is within rounding of the float64
    definition (the unsharded matrix's)."""
    x, ids, w, w_gate_up, w_down = (a.cpu() for a in _case(9, 6, 3, 40, 24, torch.float32, seed=4))
    sharded = _in_shards(w_down, shards)
    by_hand = _tree_by_hand(x, ids, w, w_gate_up, w_down, shards, linear_row_invariant)
    assert torch.equal(moe_row_invariant(x, ids, w, w_gate_up, sharded), by_hand)
    torch.testing.assert_close(moe_ref(x, ids, w, w_gate_up, sharded).double(), oracle(x, ids, w, w_gate_up, w_down),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("shards", [2, 8])
def test_the_triton_kernel_sums_a_sharded_down_matrix_as_the_tree_by_hand(dtype, shards):
    """The Triton kernel's shards in one launch (the tree in registers): bitwise the tree built by
    hand over the Triton linear kernel, each shard's product rounded to the dtype; the shards copied
    or read in place as column slices. Positive rows and gate weights put every gate above 20, where
    the kernel's SiLU (g / (1 + e^-g)) and torch's (g * sigmoid(g)) are both g exactly, so the by-hand
    SwiGLU cannot differ from the kernel's in how it rounds."""
    x, ids, w, w_gate_up, w_down = _case(9, 6, 3, 40, 24, dtype, seed=5)
    x = x.abs() + 1
    w_gate_up[:, :24] = w_gate_up[:, :24].abs() + 1
    by_hand = _tree_by_hand(x, ids, w, w_gate_up, w_down, shards, linear_triton)
    assert torch.equal(moe_triton(x, ids, w, w_gate_up, _in_shards(w_down, shards)), by_hand)
    assert torch.equal(moe_triton(x, ids, w, w_gate_up, _in_shards(w_down, shards, view=True)), by_hand)


@pytest.mark.parametrize("impl", [moe_impl] + TORCH_IMPLS, ids=lambda f: getattr(f, "__name__", "under_test"))
def test_every_implementation_takes_a_sharded_down_matrix(impl):
    """Each implementation on 8 shards (odd width 5): within tolerance of the reference, each row's
    bits the same in any prefix of the batch."""
    device = DEVICE if impl is moe_impl else "cpu"
    x, ids, w, w_gate_up, w_down = (a.to(device) for a in _case(17, 6, 2, 24, 40, torch.float32, seed=12, ties=True))
    sharded = _in_shards(w_down, 8)
    full = impl(x, ids, w, w_gate_up, sharded)
    assert_close(full, moe_ref(*(a.cpu() for a in (x, ids, w, w_gate_up, sharded))))
    for rows in (1, 5):
        assert torch.equal(impl(x[:rows], ids[:rows], w[:rows], w_gate_up, sharded), full[:rows]), rows


@pytest.mark.skipif(load_extension() is None, reason="pocketllm's C++ CPU kernels cannot be built here")
@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("tokens", [3, 21, 72])
def test_the_one_call_path_sums_a_sharded_down_matrix_as_the_tree_by_hand(weight_dtype, tokens):
    """The C++ call on 8 shards: the fixed-order kernel per shard, summed in the tree in Python
    (a wrapper, so that nothing takes the kernel's own shard sum), bit for bit; experts of rows below
    and (72 tokens) above the kernel's packed tiles, whose shard products are summed apart."""
    x, ids, w, w_gate_up, w_down = (a.cpu() for a in _case(tokens, 8, 2, 40, 48, torch.float32, seed=tokens))
    assert (torch.bincount(ids.flatten()).max() >= PACKED_ROWS) == (tokens == 72)
    w_gate_up, w_down = w_gate_up.to(weight_dtype), w_down.to(weight_dtype)
    by_hand = _tree_by_hand(x, ids, w, w_gate_up, w_down, 8, lambda rows, weight: linear_fixed_order(rows, weight))
    assert torch.equal(moe_fixed_order(x, ids, w, w_gate_up, _in_shards(w_down, 8)), by_hand)
    assert torch.equal(moe_fixed_order(x, ids, w, w_gate_up, _in_shards(w_down, 8, view=True)), by_hand)


@pytest.mark.skipif(load_extension() is None, reason="pocketllm's C++ CPU kernels cannot be built here")
@pytest.mark.parametrize("shards", [1, 8])
@pytest.mark.parametrize("tokens", [1, 5, 23, 72])
def test_bf16_dot_experts_are_the_dot_product_per_expert(tokens, shards):
    """`moe_bf16_dot`'s one C++ call: bitwise the bf16 dot-product linear called per expert (and per
    shard, summed in the tree), rows below and above the kernel's packed tiles; each row's bits the
    same in any prefix of the batch; within bf16's rounding of the fp32 reference."""
    x, ids, w, w_gate_up, w_down = (a.cpu() for a in _case(tokens, 8, 2, 40, 48, torch.float32, seed=tokens))
    w_gate_up, w_down = w_gate_up.bfloat16(), w_down.bfloat16()
    down = w_down if shards == 1 else _in_shards(w_down, shards)
    out = moe_bf16_dot(x, ids, w, w_gate_up, down)
    by_hand = _tree_by_hand(x, ids, w, w_gate_up, w_down, shards, lambda rows, weight: linear_bf16_dot(rows, weight))
    assert torch.equal(out, by_hand)
    if shards > 1:
        assert torch.equal(moe_bf16_dot(x, ids, w, w_gate_up, _in_shards(w_down, shards, view=True)), by_hand)
    assert torch.equal(moe_bf16_dot(x[:1], ids[:1], w[:1], w_gate_up, down), out[:1])
    torch.testing.assert_close(out, moe_ref(x, ids, w, w_gate_up.float(), w_down.float()), atol=2e-2, rtol=2e-2)
    with pytest.raises(ValueError, match="moe 'bf16_dot' takes fp32 x and bf16 experts"):
        moe_bf16_dot(x, ids, w, w_gate_up.float(), w_down.float())


@pytest.mark.skipif(load_extension() is None, reason="pocketllm's C++ CPU kernels cannot be built here")
def test_the_one_call_path_names_what_is_wrong():
    x, ids, _, w_gate_up, w_down = _case(3, 4, 2, 24, 16, torch.float32, seed=1, ties=False)
    moe_experts = load_extension().moe_experts
    with pytest.raises(ValueError, match=r"topk_ids holds 4, outside \[0, 4\)"):
        moe_experts(x, torch.full_like(ids, 4), w_gate_up, w_down)
    with pytest.raises(ValueError, match="both fp32 or both bf16"):
        moe_experts(x, ids, w_gate_up, w_down.bfloat16())
    with pytest.raises(ValueError, match=r"w_gate_up must be \[E, 2I, H\]"):
        moe_experts(x, ids, w_gate_up, w_down[:, :, :-1])


@pytest.mark.gpu
def test_gpu_moe_bf16():
    """bf16 at a real MoE layer's width (hidden 2048, 64 experts of 768, top 8): within tolerance
    of the reference and row invariant."""
    x, ids, w, w_gate_up, w_down = _case(300, 64, 8, 2048, 768, torch.bfloat16, seed=11)
    full = moe_impl(x, ids, w, w_gate_up, w_down)
    assert_close(full, moe_ref(x, ids, w, w_gate_up, w_down))
    for rows in (1, 7, 64):
        assert torch.equal(moe_impl(x[:rows], ids[:rows], w[:rows], w_gate_up, w_down), full[:rows])
