"""The Triton gated delta rule kernels (pocketllm/kernels/gated_delta_prefill.py, gated_delta_decode.py) against their torch
references, and their invariance contract, checked bitwise: a sequence's outputs and final state do
not depend on the batch around it, nor (prefill) on a prompt being cut at a multiple of CHUNK_SIZE.

CPU runs use the Triton interpreter (fp32, fp16; tiny head counts and dims to stay fast); the `gpu`
tests repeat the comparisons in bf16 at Qwen3.5 sizes (Hk 16, Hv 32, Dk = Dv = 128).
"""

import pytest
import torch
import torch.nn.functional as F
from helpers import budget
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_impls import DEVICE, implementation
from kernel_tolerances import assert_close

from pocketllm.kernels._gated_delta import CHUNK_SIZE
from pocketllm.kernels.gated_delta_decode import gated_delta_decode_ref
from pocketllm.kernels.gated_delta_prefill import gated_delta_prefill_ref

gated_delta_prefill_impl = implementation("gated_delta_prefill")
gated_delta_decode_impl = implementation("gated_delta_decode")

# Sequence lengths / start positions of one prefill call: lengths 1..130, starts off the chunk grid.
LENGTHS = [1, 2, 17, 63, 64, 65, 130]
STARTS = [0, 5, 70, 64, 3, 100, 33]
# (Hk, Hv, Dk, Dv): GQA ratios 1 and 2, odd Dk 24, Dv 48 (two prefill Dv blocks, the last partial).
HEADS = [(2, 2, 32, 32), (1, 2, 16, 24), (1, 1, 24, 48)]


def _inputs(tokens: int, key_heads: int, v_heads: int, dim_k: int, dim_v: int, dtype: torch.dtype, seed: int,
            device: str = DEVICE) -> tuple[torch.Tensor, ...]:
    """q/k/v as strided views of one fused [T, ...] projection (as the model makes them), g in
    (-inf, 0] with many decays near 1, beta in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    qk = key_heads * dim_k
    fused = torch.randn(tokens, 2 * qk + v_heads * dim_v, generator=gen).to(device=device, dtype=dtype)
    q, k, v = fused.split([qk, qk, v_heads * dim_v], dim=-1)
    g = F.logsigmoid(2.0 + 2.0 * torch.randn(tokens, v_heads, generator=gen)).to(device)
    beta = torch.sigmoid(torch.randn(tokens, v_heads, generator=gen)).to(device)
    return (q.reshape(tokens, key_heads, dim_k), k.reshape(tokens, key_heads, dim_k),
            v.reshape(tokens, v_heads, dim_v), g, beta)


def _states(num_slots: int, v_heads: int, dim_k: int, dim_v: int, seed: int, device: str = DEVICE) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (0.3 * torch.randn(num_slots, v_heads, dim_k, dim_v, generator=gen)).to(device)


def _as_long(values: list[int], device: str) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)


def _prefill(fn, inputs, states: torch.Tensor, slots: list[int], starts: list[int], lengths: list[int]):
    """Run a prefill launcher on a copy of `states`; returns (out, new states)."""
    device = states.device
    states = states.clone()
    cu = _as_long([0] + lengths, device).cumsum(0)
    out = fn(*inputs, states, _as_long(slots, device), _as_long(starts, device), cu)
    return out, states


def _rows(inputs, lo: int, hi: int):
    return tuple(x[lo:hi] for x in inputs)


def _check_prefill_matches(heads, dtype, lengths, starts, device=DEVICE, seed=0):
    """Kernel vs reference on one multi-sequence call (sequence i in slot B - i, slot 0 untouched)."""
    key_heads, v_heads, dim_k, dim_v = heads
    inputs = _inputs(sum(lengths), key_heads, v_heads, dim_k, dim_v, dtype, seed, device)
    states = _states(len(lengths) + 1, v_heads, dim_k, dim_v, seed + 1, device)
    slots = [len(lengths) - i for i in range(len(lengths))]
    out, new_states = _prefill(gated_delta_prefill_impl, inputs, states, slots, starts, lengths)
    ref, ref_states = _prefill(gated_delta_prefill_ref, inputs, states, slots, starts, lengths)
    assert out.dtype == dtype
    assert_close(out, ref)
    assert_close(new_states, ref_states, dtype)
    assert torch.equal(new_states[0], states[0])


@pytest.mark.parametrize("heads,dtype", [(h, torch.float32) for h in HEADS] + [(HEADS[1], torch.float16)])
def test_prefill_matches_reference(heads, dtype):
    """Outputs and final states equal the reference's within tolerance for sequences of lengths
    1..130 at starts off the chunk grid, nonzero initial states, GQA and odd head dims; slots
    outside the call are untouched."""
    _check_prefill_matches(heads, dtype, LENGTHS, STARTS)


def _check_prefill_batch_invariance(heads, dtype, lengths, starts, device=DEVICE, seed=0):
    """Each sequence alone (in its own slot) gives bitwise its outputs and state from the batch."""
    key_heads, v_heads, dim_k, dim_v = heads
    inputs = _inputs(sum(lengths), key_heads, v_heads, dim_k, dim_v, dtype, seed, device)
    states = _states(len(lengths) + 1, v_heads, dim_k, dim_v, seed + 1, device)
    slots = [i + 1 for i in range(len(lengths))]
    out, batch_states = _prefill(gated_delta_prefill_impl, inputs, states, slots, starts, lengths)
    lo = 0
    for slot, start, length in zip(slots, starts, lengths):
        alone, alone_states = _prefill(gated_delta_prefill_impl, _rows(inputs, lo, lo + length), states, [slot],
                                       [start], [length])
        assert torch.equal(alone, out[lo:lo + length])
        assert torch.equal(alone_states[slot], batch_states[slot])
        lo += length


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prefill_batch_invariance(dtype):
    """A sequence's prefill outputs and final state are bitwise the same alone and in a batch."""
    _check_prefill_batch_invariance(HEADS[1], dtype, [17, 65, 40], [3, 64, 100])


def _check_split_invariance(heads, dtype, start, length, cuts, device=DEVICE, seed=0):
    """A prompt prefilled in pieces cut at absolute positions `cuts` (multiples of CHUNK_SIZE), one call
    per piece with another sequence in the batch, gives bitwise the one-call outputs and final state."""
    key_heads, v_heads, dim_k, dim_v = heads
    inputs = _inputs(length + 5, key_heads, v_heads, dim_k, dim_v, dtype, seed, device)
    prompt, other = _rows(inputs, 0, length), _rows(inputs, length, length + 5)
    states = _states(3, v_heads, dim_k, dim_v, seed + 1, device)
    whole, whole_states = _prefill(gated_delta_prefill_impl, prompt, states, [1], [start], [length])
    bounds = [start] + [c for c in cuts if start < c < start + length] + [start + length]
    pieces = []
    for lo, hi in zip(bounds, bounds[1:]):
        piece = _rows(prompt, lo - start, hi - start)
        batch = tuple(torch.cat([a, b]) for a, b in zip(other, piece))  # the piece after another sequence
        out, states = _prefill(gated_delta_prefill_impl, batch, states, [2, 1], [7, lo], [5, hi - lo])
        pieces.append(out[5:])
    assert len(pieces) > 1
    assert torch.equal(torch.cat(pieces), whole)
    assert torch.equal(states[1], whole_states[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prefill_split_at_chunk_boundaries(dtype):
    """A prompt cut at absolute positions 64 and 128 gives bitwise the outputs and state of one piece."""
    _check_split_invariance(HEADS[1], dtype, start=10, length=150, cuts=[64, 128])


@settings(deadline=None, max_examples=budget(0.2))
@given(start=st.integers(0, 150), length=st.integers(2, 140), cut_chunks=st.sets(st.integers(1, 4), min_size=1))
def test_prefill_split_invariance_property(start, length, cut_chunks):
    """For any start and any cuts at chunk boundaries inside the prompt, the split prefill is
    bitwise the one-piece prefill."""
    cuts = sorted(c * CHUNK_SIZE for c in cut_chunks)
    if not any(start < c < start + length for c in cuts):
        cuts.append((start // CHUNK_SIZE + 1) * CHUNK_SIZE)
        length = max(length, cuts[-1] - start + 1)
    _check_split_invariance((1, 1, 16, 16), torch.float32, start, length, cuts, seed=start + length)


def _decode_case(batch, heads, dtype, seed, device=DEVICE):
    key_heads, v_heads, dim_k, dim_v = heads
    inputs = _inputs(batch, key_heads, v_heads, dim_k, dim_v, dtype, seed, device)
    return inputs, _states(batch + 2, v_heads, dim_k, dim_v, seed + 1, device)


def _decode(fn, inputs, states: torch.Tensor, slots: list[int]):
    states = states.clone()
    return fn(*inputs, states, _as_long(slots, states.device)), states


# Decode heads add Dv 80: two decode Dv blocks, the last partial.
DECODE_HEADS = HEADS + [(2, 4, 24, 80)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads", DECODE_HEADS)
def test_decode_matches_reference(heads, dtype):
    """One decode step's outputs and states equal the reference's (slots out of batch order, one slot untouched)."""
    inputs, states = _decode_case(3, heads, dtype, seed=sum(heads))
    slots = [4, 1, 3]
    out, new_states = _decode(gated_delta_decode_impl, inputs, states, slots)
    ref, ref_states = _decode(gated_delta_decode_ref, inputs, states, slots)
    assert out.dtype == dtype
    assert_close(out, ref)
    assert_close(new_states, ref_states, dtype)
    assert torch.equal(new_states[0], states[0]) and torch.equal(new_states[2], states[2])


def _check_decode_batch_invariance(heads, dtype, device=DEVICE):
    inputs, states = _decode_case(4, heads, dtype, seed=5, device=device)
    slots = [3, 1, 5, 2]
    out, batch_states = _decode(gated_delta_decode_impl, inputs, states, slots)
    for i, slot in enumerate(slots):
        alone, alone_states = _decode(gated_delta_decode_impl, _rows(inputs, i, i + 1), states, [slot])
        assert torch.equal(alone[0], out[i])
        assert torch.equal(alone_states[slot], batch_states[slot])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_batch_invariance(dtype):
    """A sequence's decode output and new state are bitwise the same alone and in a batch."""
    _check_decode_batch_invariance(DECODE_HEADS[-1], dtype)


def _check_decode_after_prefill(heads, dtype, lengths, starts, steps, device=DEVICE):
    """Prefill then `steps` decode steps with the kernels track the references within tolerance."""
    key_heads, v_heads, dim_k, dim_v = heads
    batch = len(lengths)
    inputs = _inputs(sum(lengths), key_heads, v_heads, dim_k, dim_v, dtype, 11, device)
    states = _states(batch + 1, v_heads, dim_k, dim_v, 12, device)
    slots = [i + 1 for i in range(batch)]
    _, states_k = _prefill(gated_delta_prefill_impl, inputs, states, slots, starts, lengths)
    _, states_r = _prefill(gated_delta_prefill_ref, inputs, states, slots, starts, lengths)
    for step in range(steps):
        token = _inputs(batch, key_heads, v_heads, dim_k, dim_v, dtype, 100 + step, device)
        out_k, states_k = _decode(gated_delta_decode_impl, token, states_k, slots)
        out_r, states_r = _decode(gated_delta_decode_ref, token, states_r, slots)
        assert_close(out_k, out_r)
    assert_close(states_k, states_r, dtype)


def test_decode_after_prefill_matches_reference():
    """Decoding from kernel-prefilled states continues the reference's prefill + decode within tolerance."""
    _check_decode_after_prefill(HEADS[0], torch.float32, [65, 9], [0, 60], steps=3)


# -- GPU: bf16 at Qwen3.5 sizes ---------------------------------------------------------------------

QWEN35_HEADS = (16, 32, 128, 128)


@pytest.mark.gpu
def test_gpu_prefill_matches_reference():
    """bf16 prefill of sequences up to 4096 tokens equals the reference within tolerance."""
    _check_prefill_matches(QWEN35_HEADS, torch.bfloat16, [1, 700, 4096, 130], [0, 37, 64, 1000], device="cuda")


@pytest.mark.gpu
def test_gpu_prefill_invariance():
    """bf16 prefill is bitwise batch invariant and invariant to cuts at chunk boundaries."""
    _check_prefill_batch_invariance(QWEN35_HEADS, torch.bfloat16, [1, 700, 2048, 65], [0, 37, 64, 1000],
                                    device="cuda")
    _check_split_invariance(QWEN35_HEADS, torch.bfloat16, start=30, length=4000, cuts=[64, 1024, 2048 + 128],
                            device="cuda")


@pytest.mark.gpu
def test_gpu_decode():
    """bf16 decode matches the reference after a long prefill and is bitwise batch invariant."""
    _check_decode_after_prefill(QWEN35_HEADS, torch.bfloat16, [3000, 100, 1], [0, 64, 9], steps=4, device="cuda")
    _check_decode_batch_invariance(QWEN35_HEADS, torch.bfloat16, device="cuda")
