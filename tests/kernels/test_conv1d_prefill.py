"""conv1d_prefill (pocketllm/kernels/conv1d_prefill.py): the causal depthwise conv1d + SiLU of
Gated DeltaNet over packed prompts, each continuing its slot's state of K - 1 inputs.

- the torch backend's op against an oracle written from the published model definition
  (transformers' causal_conv1d_update): `F.conv1d` with groups = channels over [prior state,
  inputs] in float64, then SiLU; the new state is the last K - 1 columns of that window (then decoded on);
- the kernel under test (by default the Triton one) against the reference: it sums the K taps
  exactly as the reference does (fp32, same order, no FMA), so its states match bitwise and its
  outputs differ only through the SiLU's exp (fp32 and fp16 on DEVICE; bf16 at model sizes in the
  `gpu` tests), sequences of lengths 0..65, shorter than the window included;
- its invariance, bitwise: a sequence alone equals its batch rows; a prompt cut anywhere (at
  random points, and at absolute positions after a slot that already holds a window, each piece
  sharing its call with another sequence; reference and kernel) equals one piece; decode
  continues the prefill as the prefill of the same tokens would.
"""

from __future__ import annotations

import pytest
import torch
from helpers import budget
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_cases import CONV_SLOTS as SLOTS
from kernel_cases import DTYPES, GPU_CHANNELS, OTHER_LEN
from kernel_cases import as_long as _as_long
from kernel_cases import assert_split_invariant as _assert_split_invariant
from kernel_cases import conv_cu as _cu
from kernel_cases import conv_inputs as _conv_inputs
from kernel_cases import conv_oracle as _conv_oracle
from kernel_cases import conv_oracle_inputs as _conv_oracle_inputs
from kernel_cases import cu_seqlens as _cu_seqlens
from kernel_cases import device_long as _long
from kernel_cases import split_run as _split_run
from kernel_impls import DEVICE, implementation
from kernel_tolerances import assert_close

from pocketllm.kernels import torch_ops
from pocketllm.kernels.conv1d_prefill import conv1d_prefill_ref, conv1d_prefill_triton

OPS = torch_ops()
conv1d_prefill_impl = implementation("conv1d_prefill")
conv1d_decode_impl = implementation("conv1d_decode")


# -- the torch backend's op against the convolution --------------------------------------------


# One prefill call: (slot, length); lengths 1 and 2 are shorter than K - 1 = 3, so part of the old state
# stays in the new one; slot 2 starts from zeros (a new request).
CONV_SEQS = [(4, 17), (2, 1), (0, 2), (5, 65), (1, 3), (3, 5)]


@pytest.mark.usefixtures("single_torch_thread")  # many tiny ops: threads only add spin-waiting
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kernel", [2, 3, 4])
def test_conv1d_prefill_then_decode_matches_convolution(kernel: int, dtype: torch.dtype):
    """Six packed sequences continue their slots' states, then decode three tokens each: every
    output and each slot's final state (bitwise: it holds inputs) equal the direct convolution of
    the whole [prior state, prompt, decoded tokens] window; the unused slot 6 is untouched."""
    lengths, slots, steps, channels = [n for _, n in CONV_SEQS], [s for s, _ in CONV_SEQS], 3, 12
    x, weight, states = _conv_oracle_inputs(sum(lengths) + steps * len(slots), channels, kernel, 7, dtype, seed=kernel)
    states[2] = 0
    before = states.clone()
    prompt, decoded = x[:sum(lengths)], x[sum(lengths):].reshape(steps, len(slots), channels)
    out = OPS.conv1d_prefill(prompt, weight, states, _as_long(slots), _cu_seqlens(lengths))
    step_outs = [OPS.conv1d_decode(decoded[step], weight, states, _as_long(slots)) for step in range(steps)]
    assert out.shape == prompt.shape and out.dtype == dtype
    cu = _cu_seqlens(lengths).tolist()
    for i, slot in enumerate(slots):
        inputs = torch.cat([prompt[cu[i]:cu[i + 1]], decoded[:, i]])
        expected, final = _conv_oracle(inputs, weight, before[slot])
        assert_close(torch.cat([out[cu[i]:cu[i + 1]], torch.stack([o[i] for o in step_outs])]), expected, dtype)
        assert torch.equal(states[slot].double(), final)
    assert torch.equal(states[6], before[6])


# -- the kernel against the reference ----------------------------------------------------------


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


def test_conv_rejects_unsupported_width():
    """K = 5 (beyond the unrolled state columns) is refused rather than computed wrongly."""
    x, weight, states = _conv_inputs(3, 8, 5, torch.float32, seed=1)
    with pytest.raises(ValueError):
        conv1d_prefill_triton(x, weight, states, torch.tensor([1], device=DEVICE), _cu([3]))


# -- invariance (bitwise) ----------------------------------------------------------------------


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


CONV_SPLITS = [  # (start, new tokens, absolute cuts): the conv has no grid, so any cut
    (64, 140, [192]),
    (128, 80, [129, 130, 192]),  # pieces of one token, shorter than the window
    (10, 190, [64, 65, 128, 192]),
]


def _conv_call(fn):
    def call(inputs, state, slots, starts, lengths):
        (x,) = inputs
        weight = (torch.linspace(-1.0, 1.0, 8 * 4).reshape(8, 4) + 0.1).to(DEVICE)
        return fn(x, weight, state, _long(slots), torch.cumsum(_long([0] + lengths), 0))
    return call


@pytest.mark.parametrize("fn", [conv1d_prefill_ref, conv1d_prefill_impl], ids=["ref", "triton"])
@pytest.mark.parametrize("start,length,cuts", CONV_SPLITS)
def test_conv1d_prefill_split_invariance(fn, start, length, cuts):
    """Any cut after a slot that already holds a window of inputs: bitwise outputs and state."""
    gen = torch.Generator().manual_seed(start)
    x = torch.randn(length + OTHER_LEN, 8, generator=gen).to(DEVICE)
    state = torch.randn(3, 8, 3, generator=gen).to(DEVICE)  # K - 1 = 3 remembered inputs per slot
    _assert_split_invariant(_split_run(_conv_call(fn), (x,), state, start, cuts))


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


# -- CUDA, bf16, model sizes -------------------------------------------------------------------


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
