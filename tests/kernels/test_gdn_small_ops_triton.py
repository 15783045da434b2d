"""The Triton causal conv1d (prefill and decode) and gated RMSNorm kernels of the Gated DeltaNet
layers against their torch references, and their invariance contract, checked bitwise: a
token's output does not depend on the batch around it, on where its prompt was split, or on
whether it was prefilled or decoded.

The conv kernels sum the K taps exactly as the reference does (fp32, same order, no FMA), so
their conv states match bitwise and their outputs differ from the reference only through the
SiLU's exp; they are compared within the dtype's tolerance. CPU runs use the Triton interpreter
(fp32, fp16; small shapes); the `gpu` tests repeat the comparisons in bf16 at model sizes.
"""

import pytest
import torch
from helpers import budget
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_impls import DEVICE, implementation
from kernel_tolerances import assert_close

from pocketllm.kernels.conv1d_decode import conv1d_decode_ref
from pocketllm.kernels.conv1d_prefill import conv1d_prefill_ref, conv1d_prefill_triton
from pocketllm.kernels.rms_norm_gated import rms_norm_gated_ref

conv1d_prefill_impl = implementation("conv1d_prefill")
conv1d_decode_impl = implementation("conv1d_decode")
rms_norm_gated_impl = implementation("rms_norm_gated")

# The fp32/fp16 tests run on DEVICE: CPU tensors under the interpreter, CUDA ones with a GPU.
DTYPES = (torch.float32, torch.float16)
SLOTS = 8


def _randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32, device: str = DEVICE,
           scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=gen)).to(device=device, dtype=dtype)


def _cu(lens: list[int], device: str = DEVICE) -> torch.Tensor:
    return torch.tensor([0] + lens, device=device).cumsum(0)


def _conv_inputs(tokens: int, channels: int, kernel: int, dtype: torch.dtype, seed: int, device: str = DEVICE,
                 slots: int = SLOTS):
    """x [T, C] as a column slice of a wider projection (row stride != C, as the model's fused
    projections give it), weight [C, K] and random conv states (continued sequences) with slot 0
    zeroed (a new request)."""
    x = _randn(tokens, channels + 9, seed=seed, dtype=dtype, device=device)[:, 3:3 + channels]
    weight = _randn(channels, kernel, seed=seed + 1, dtype=dtype, device=device, scale=0.5)
    states = _randn(slots, channels, kernel - 1, seed=seed + 2, dtype=dtype, device=device)
    states[0] = 0
    return x, weight, states


def _prefill_both(x, weight, states, slots, cu):
    """(output, states after) of the kernel and of the reference, each on its own state copy."""
    kernel_states, ref_states = states.clone(), states.clone()
    out = conv1d_prefill_impl(x, weight, kernel_states, slots, cu)
    ref = conv1d_prefill_ref(x, weight, ref_states, slots, cu)
    return (out, kernel_states), (ref, ref_states)


def _check_prefill(lens: list[int], slot_list: list[int], channels: int, kernel: int, dtype: torch.dtype,
                   seed: int, device: str = DEVICE, slot_count: int = SLOTS) -> None:
    """Kernel vs reference: outputs within tolerance, new states bitwise (they are copies of
    inputs), the states of slots not in the batch untouched."""
    x, weight, states = _conv_inputs(sum(lens), channels, kernel, dtype, seed, device, slot_count)
    slots = torch.tensor(slot_list, device=device)
    (out, kernel_states), (ref, ref_states) = _prefill_both(x, weight, states, slots, _cu(lens, device))
    assert out.shape == x.shape and out.dtype == dtype and out.is_contiguous()
    assert_close(out, ref)
    assert torch.equal(kernel_states, ref_states)
    others = [s for s in range(states.shape[0]) if s not in slot_list]
    assert torch.equal(kernel_states[others], states[others])


# -- conv1d: against the reference -------------------------------------------------------------------

# Lengths 1, 2, 3 (shorter than or equal to K - 1: old state entries shift), 0 (an empty sequence),
# 5, 17, 65 (several token tiles; tiles straddle sequences); slots out of order, slot 0 zero-state.
PREFILL_LENS = [1, 2, 3, 0, 5, 17, 65]
PREFILL_SLOTS = [3, 0, 7, 1, 5, 2, 6]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("channels", (37, 96))
@pytest.mark.parametrize("kernel", (2, 3, 4))
def test_conv_prefill_matches_reference(kernel: int, channels: int, dtype: torch.dtype):
    """Seven sequences of lengths 0..65 in one call, each continuing its slot's state: outputs
    match the reference, every slot's new state is bitwise the reference's (including sequences
    shorter than K - 1), other slots are untouched."""
    _check_prefill(PREFILL_LENS, PREFILL_SLOTS, channels, kernel, dtype, seed=kernel * 100 + channels)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kernel", (2, 3, 4))
def test_conv_decode_matches_reference(kernel: int, dtype: torch.dtype):
    """Five rows over distinct slots (one zero-state): outputs match the reference, the states
    shift bitwise as the reference's, other slots are untouched."""
    x, weight, states = _conv_inputs(5, 37, kernel, dtype, seed=kernel)
    slots = torch.tensor([6, 0, 2, 7, 4], device=DEVICE)
    kernel_states, ref_states = states.clone(), states.clone()
    out = conv1d_decode_impl(x, weight, kernel_states, slots)
    ref = conv1d_decode_ref(x, weight, ref_states, slots)
    assert out.shape == x.shape and out.dtype == dtype
    assert_close(out, ref)
    assert torch.equal(kernel_states, ref_states)
    assert torch.equal(kernel_states[[1, 3, 5]], states[[1, 3, 5]])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_conv_decode_row_alone_equals_row_in_batch(dtype: torch.dtype):
    """Each row decoded alone gives bitwise its output in a batch of 5 and the same slot state."""
    x, weight, states = _conv_inputs(5, 37, 4, dtype, seed=9)
    slots = torch.tensor([6, 0, 2, 7, 4], device=DEVICE)
    batch_states, alone_states = states.clone(), states.clone()
    batch = conv1d_decode_impl(x, weight, batch_states, slots)
    for i in range(5):
        alone = conv1d_decode_impl(x[i:i + 1], weight, alone_states, slots[i:i + 1])
        assert torch.equal(alone[0], batch[i]), i
    assert torch.equal(alone_states, batch_states)


def test_conv_rejects_unsupported_width():
    """K = 5 (beyond the unrolled state columns) is refused rather than computed wrongly."""
    x, weight, states = _conv_inputs(3, 8, 5, torch.float32, seed=1)
    with pytest.raises(ValueError):
        conv1d_prefill_triton(x, weight, states, torch.tensor([1], device=DEVICE), _cu([3]))


# -- conv1d: invariance (bitwise) --------------------------------------------------------------------


def _check_alone_equals_batch(lens: list[int], slot_list: list[int], channels: int, dtype: torch.dtype,
                              seed: int, device: str = DEVICE) -> None:
    """Each sequence prefilled alone gives bitwise its rows of the batched output and the same
    new state."""
    x, weight, states = _conv_inputs(sum(lens), channels, 4, dtype, seed, device)
    cu = _cu(lens, device)
    batch_states = states.clone()
    batch = conv1d_prefill_impl(x, weight, batch_states, torch.tensor(slot_list, device=device), cu)
    alone_states = states.clone()
    for i, slot in enumerate(slot_list):
        lo, hi = int(cu[i]), int(cu[i + 1])
        alone = conv1d_prefill_impl(x[lo:hi], weight, alone_states, torch.tensor([slot], device=device),
                                    _cu([hi - lo], device))
        assert torch.equal(alone, batch[lo:hi]), i
    assert torch.equal(alone_states, batch_states)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_conv_sequence_alone_equals_sequence_in_batch(dtype: torch.dtype):
    """Batch of lengths 1..65 (K = 4, C = 37): every sequence alone is bitwise its batch rows."""
    _check_alone_equals_batch(PREFILL_LENS, PREFILL_SLOTS, 37, dtype, seed=11)


@st.composite
def _split_case(draw):
    kernel = draw(st.integers(2, 4))
    length = draw(st.integers(2, 40))
    cuts = sorted(draw(st.sets(st.integers(1, length - 1), min_size=1, max_size=3)))
    other = draw(st.integers(0, 6))  # a second sequence batched with each piece (0: alone)
    return kernel, length, cuts, other


@settings(deadline=None, max_examples=budget(0.3))
@given(_split_case())
def test_conv_prefill_split_invariance(case):
    """A prompt prefilled in one call equals, bitwise, the same prompt cut into pieces at
    arbitrary points, each piece continuing from the slot state the previous left (and batched
    with an unrelated sequence in another slot): the same outputs and the same final state."""
    kernel, length, cuts, other = case
    x, weight, states = _conv_inputs(length + other, 37, kernel, torch.float32, seed=length * 10 + kernel)
    prompt, extra = x[:length], x[length:]
    whole_states = states.clone()
    whole = conv1d_prefill_impl(prompt, weight, whole_states, torch.tensor([2], device=DEVICE),
                                _cu([length]))
    piece_states = states.clone()
    pieces = []
    for lo, hi in zip([0] + cuts, cuts + [length]):
        batch_x = torch.cat([extra, prompt[lo:hi]])
        out = conv1d_prefill_impl(batch_x, weight, piece_states, torch.tensor([5, 2], device=DEVICE),
                                  _cu([other, hi - lo]))
        pieces.append(out[other:])
    assert torch.equal(torch.cat(pieces), whole)
    assert torch.equal(piece_states[2], whole_states[2])


def _check_decode_continues_prefill(lens: list[int], slot_list: list[int], channels: int, dtype: torch.dtype,
                                    steps: int, seed: int, device: str = DEVICE) -> None:
    """Prefill a batch, then decode `steps` tokens per sequence: each decoded output equals,
    bitwise, the same tokens prefilled as one-token sequences from the same state, and the final
    outputs and states equal one prefill of the prompts extended by the decoded tokens."""
    batch, kernel = len(lens), 4
    x, weight, states = _conv_inputs(sum(lens) + steps * batch, channels, kernel, dtype, seed, device)
    prompts, new = x[:sum(lens)], x[sum(lens):].reshape(steps, batch, channels)
    slots = torch.tensor(slot_list, device=device)
    cu = _cu(lens, device)
    decode_states = states.clone()
    conv1d_prefill_impl(prompts, weight, decode_states, slots, cu)
    decoded = []
    for step in range(steps):
        prefill_states = decode_states.clone()
        as_prefill = conv1d_prefill_impl(new[step], weight, prefill_states, slots, _cu([1] * batch, device))
        out = conv1d_decode_impl(new[step], weight, decode_states, slots)
        assert torch.equal(out, as_prefill) and torch.equal(decode_states, prefill_states), step
        decoded.append(out)
    # One prefill of each prompt followed by its decoded tokens.
    extended = torch.cat([torch.cat([prompts[int(cu[i]):int(cu[i + 1])], new[:, i]]) for i in range(batch)])
    full_states = states.clone()
    full = conv1d_prefill_impl(extended, weight, full_states, slots, _cu([n + steps for n in lens], device))
    for i in range(batch):
        end = int(cu[i + 1]) + (i + 1) * steps
        assert torch.equal(full[end - steps:end], torch.stack([d[i] for d in decoded])), i
    assert torch.equal(full_states, decode_states)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_conv_decode_continues_prefill(dtype: torch.dtype):
    """Prompts of lengths 1, 2, 5, 17 then 3 decode steps: decode is bitwise the prefill of the
    same tokens, step by step and as one extended prefill."""
    _check_decode_continues_prefill([1, 2, 5, 17], [4, 0, 6, 1], 37, dtype, steps=3, seed=21)


# -- gated RMSNorm -----------------------------------------------------------------------------------


def _gated_inputs(rows: int, heads: int, hidden: int, dtype: torch.dtype, seed: int, device: str = DEVICE):
    """x [rows, heads, H] contiguous and gate as a [rows, heads, H] view of a column slice of a
    wider projection (as the model's fused z projection gives it)."""
    x = _randn(rows, heads, hidden, seed=seed, dtype=dtype, device=device, scale=3.0)
    wide = _randn(rows, 2 * heads * hidden, seed=seed + 1, dtype=dtype, device=device, scale=2.0)
    gate = wide[:, heads * hidden:].reshape(rows, heads, hidden)
    return x, gate


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", (1, 37, 128))
def test_rms_norm_gated_matches_reference(hidden: int, dtype: torch.dtype):
    """x [17, 3, H] with a strided gate: the kernel matches the reference in x's dtype, with a
    weight of x's dtype and with an fp32 weight (the norm then stays in fp32 before the gate)."""
    x, gate = _gated_inputs(17, 3, hidden, dtype, seed=hidden)
    assert not gate.is_contiguous()
    for weight_dtype in (dtype, torch.float32):
        weight = _randn(hidden, seed=hidden + 2, dtype=weight_dtype)
        out = rms_norm_gated_impl(x, gate, weight, 1e-6)
        assert out.shape == x.shape and out.dtype == dtype
        assert_close(out, rms_norm_gated_ref(x, gate, weight, 1e-6))


def test_rms_norm_gated_any_leading_shape():
    """1-d rows and 4-d inputs with permuted leading dims keep their shape and match the reference."""
    weight = _randn(16, seed=5)
    for shape, perm in (((16,), (0,)), ((2, 3, 5, 16), (0, 2, 1, 3))):
        x = _randn(*shape, seed=6).permute(perm)
        gate = _randn(*shape, seed=7).permute(perm)
        out = rms_norm_gated_impl(x, gate, weight, 1e-5)
        assert out.shape == x.shape
        assert_close(out, rms_norm_gated_ref(x, gate, weight, 1e-5))


def _check_gated_rows_invariant(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor,
                                prefixes: tuple[int, ...]) -> None:
    """Any prefix of rows, and a single row, gives bitwise the same rows as the full batch."""
    full = rms_norm_gated_impl(x, gate, weight, 1e-6)
    for m in prefixes:
        assert torch.equal(rms_norm_gated_impl(x[:m], gate[:m], weight, 1e-6), full[:m]), m
    last = x.shape[0] - 1
    assert torch.equal(rms_norm_gated_impl(x[last:], gate[last:], weight, 1e-6), full[last:])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_gated_row_invariant(dtype: torch.dtype):
    """Prefixes of 1, 2, 7, 16 of 33 rows, and the last row alone, are bitwise the full batch's."""
    x, gate = _gated_inputs(33, 2, 100, dtype, seed=8)
    _check_gated_rows_invariant(x, gate, _randn(100, seed=9, dtype=dtype), (1, 2, 7, 16))


# -- CUDA, bf16, model sizes -------------------------------------------------------------------------

GPU_CHANNELS = 8192


@pytest.mark.gpu
@pytest.mark.parametrize("lens", ([4096], [1, 7, 1000, 3088], [1] * 64))
def test_gpu_conv_prefill_matches_reference(lens: list[int]):
    """bf16, C = 8192, K = 4: one 4096-token prompt, a mixed batch up to 4096 tokens and 64
    one-token sequences: outputs within tolerance, states bitwise, other slots untouched."""
    slot_list = [(5 * i + 3) % 128 for i in range(len(lens))]
    _check_prefill(lens, slot_list, GPU_CHANNELS, 4, torch.bfloat16, seed=len(lens), device="cuda", slot_count=128)


@pytest.mark.gpu
def test_gpu_conv_invariance():
    """bf16, C = 8192: sequences alone equal the batch bitwise; decode continues prefill bitwise;
    a 4096-token prompt split at 1000 and 3001 equals the whole."""
    _check_alone_equals_batch([1, 7, 1000, 3088], [3, 0, 6, 1], GPU_CHANNELS, torch.bfloat16, seed=31,
                              device="cuda")
    _check_decode_continues_prefill([1, 5, 300, 2000], [4, 0, 6, 1], GPU_CHANNELS, torch.bfloat16, steps=4,
                                    seed=32, device="cuda")
    x, weight, states = _conv_inputs(4096, GPU_CHANNELS, 4, torch.bfloat16, seed=33, device="cuda")
    slot = torch.tensor([2], device="cuda")
    whole_states, piece_states = states.clone(), states.clone()
    whole = conv1d_prefill_impl(x, weight, whole_states, slot, _cu([4096], "cuda"))
    pieces = [conv1d_prefill_impl(x[lo:hi], weight, piece_states, slot, _cu([hi - lo], "cuda"))
              for lo, hi in ((0, 1000), (1000, 3001), (3001, 4096))]
    assert torch.equal(torch.cat(pieces), whole) and torch.equal(piece_states, whole_states)


@pytest.mark.gpu
def test_gpu_conv_decode_matches_reference():
    """bf16, C = 8192, B = 64 over distinct slots: outputs within tolerance, states bitwise."""
    x = _randn(64, GPU_CHANNELS, seed=41, dtype=torch.bfloat16, device="cuda")
    weight = _randn(GPU_CHANNELS, 4, seed=42, dtype=torch.bfloat16, device="cuda", scale=0.5)
    states = _randn(128, GPU_CHANNELS, 3, seed=43, dtype=torch.bfloat16, device="cuda")
    slots = torch.randperm(128, generator=torch.Generator().manual_seed(44))[:64].cuda()
    kernel_states, ref_states = states.clone(), states.clone()
    assert_close(conv1d_decode_impl(x, weight, kernel_states, slots),
                 conv1d_decode_ref(x, weight, ref_states, slots))
    assert torch.equal(kernel_states, ref_states)


@pytest.mark.gpu
def test_gpu_rms_norm_gated():
    """bf16 [4096, 32, 128] with a strided gate: matches the reference (bf16 and fp32 weights) and
    prefixes of the rows are bitwise the full batch's."""
    x, gate = _gated_inputs(4096, 32, 128, torch.bfloat16, seed=51, device="cuda")
    for weight_dtype in (torch.bfloat16, torch.float32):
        weight = _randn(128, seed=52, dtype=weight_dtype, device="cuda")
        assert_close(rms_norm_gated_impl(x, gate, weight, 1e-6), rms_norm_gated_ref(x, gate, weight, 1e-6))
    _check_gated_rows_invariant(x, gate, weight, (1, 7, 64, 4000))
