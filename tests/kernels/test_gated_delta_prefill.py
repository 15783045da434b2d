"""gated_delta_prefill (pocketllm/kernels/gated_delta_prefill.py): the Gated DeltaNet rule over
packed prompts, each continuing its slot's state, in 64-position chunks aligned to absolute
positions.

- oracles written from the published model definition (transformers' Qwen3.5 modeling code), not
  from pocketllm's code (`kernel_cases.delta_rule_oracle`): the token-by-token recurrence in
  float64, one value head at a time, for the torch backend's op (its chunked UT-transform form
  must agree with it, whatever the chunk alignment), the prefill equal to token-by-token decoding,
  and two closed forms (beta = 0: pure decay; g = 0, beta = 1, q = k: the value overwritten);
- the kernel under test (by default the Triton one) against the reference (sequences of lengths
  1..130 at starts off the chunk grid, GQA, odd head dims; fp32 and fp16 on DEVICE, bf16 at
  Qwen3.5 sizes in the `gpu` tests), and its batch invariance, bitwise;
- split invariance, bitwise, of the reference and the kernel: a prompt cut at multiples of
  CHUNK_SIZE (after a slot that already holds tokens, each piece sharing its call with another
  sequence) gives the one-piece outputs and state. With a start off the grid, a chunk grid aligned
  to the piece start differs from the absolute one; the negative control shows the check catches
  such a grid (at start 0 the two coincide, which is why it is not used).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import budget
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_cases import GDN_HEADS, OTHER_LEN, QWEN35_HEADS
from kernel_cases import GDN_KERNEL_HEADS as HEADS
from kernel_cases import as_long as _as_long
from kernel_cases import assert_split_invariant as _assert_split_invariant
from kernel_cases import cu_seqlens as _cu_seqlens
from kernel_cases import delta_rule_oracle as _delta_rule_oracle
from kernel_cases import device_long as _long
from kernel_cases import gdn_inputs as _inputs
from kernel_cases import gdn_oracle_inputs as _gdn_inputs
from kernel_cases import gdn_oracle_states as _gdn_states
from kernel_cases import gdn_prefill as _prefill
from kernel_cases import gdn_states as _states
from kernel_cases import rows as _rows
from kernel_cases import split_run as _split_run
from kernel_impls import DEVICE, implementation
from kernel_tolerances import assert_close

from pocketllm.kernels import torch_ops
from pocketllm.kernels._gated_delta import CHUNK_SIZE
from pocketllm.kernels.gated_delta_prefill import gated_delta_prefill_ref

OPS = torch_ops()
gated_delta_prefill_impl = implementation("gated_delta_prefill")


# -- the torch backend's op against the recurrence ---------------------------------------------


# One prefill call: (slot, start, length); lengths 1, 63, 64, 65, 130 around the 64-token chunk, starts
# on and off the absolute chunk grid; the start-0 sequence of slot 1 begins from a zero state.
GDN_SEQS = [(3, 5, 130), (1, 0, 63), (5, 64, 64), (2, 100, 1), (4, 1, 65)]


@pytest.mark.usefixtures("single_torch_thread")  # many tiny ops: threads only add spin-waiting
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("heads", GDN_HEADS, ids=str)
def test_gated_delta_prefill_matches_recurrence(heads: tuple[int, int, int, int], dtype: torch.dtype):
    """Five packed sequences: each one's outputs and the final state written to its slot equal
    the token-by-token recurrence from the slot's initial state; other slots are untouched."""
    lengths = [n for _, _, n in GDN_SEQS]
    q, k, v, g, beta = _gdn_inputs(sum(lengths), heads, dtype, seed=sum(heads))
    states = _gdn_states(6, heads, seed=1)
    states[1] = 0.0
    before = states.clone()
    out = OPS.gated_delta_prefill(q, k, v, g, beta, states, _as_long([s for s, _, _ in GDN_SEQS]),
                                  _as_long([st for _, st, _ in GDN_SEQS]), _cu_seqlens(lengths))
    assert out.shape == v.shape and out.dtype == dtype
    cu = _cu_seqlens(lengths).tolist()
    for i, (slot, _, _) in enumerate(GDN_SEQS):
        lo, hi = cu[i], cu[i + 1]
        expected, final = _delta_rule_oracle(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], before[slot])
        assert_close(out[lo:hi], expected, dtype)
        assert_close(states[slot], final, torch.float32)
    assert torch.equal(states[0], before[0])


@pytest.mark.usefixtures("single_torch_thread")  # many tiny ops: threads only add spin-waiting
@pytest.mark.parametrize("start,length", [(0, 130), (37, 65), (64, 1)])
def test_gated_delta_prefill_equals_token_by_token_decode(start: int, length: int):
    """Prefilling a sequence (fp32) gives, within tolerance, the outputs and state of decoding its
    tokens one at a time from the same initial state."""
    heads = GDN_HEADS[0]
    q, k, v, g, beta = _gdn_inputs(length, heads, torch.float32, seed=length)
    prefill_states = _gdn_states(2, heads, seed=3)
    decode_states = prefill_states.clone()
    prefilled = OPS.gated_delta_prefill(q, k, v, g, beta, prefill_states, _as_long([1]), _as_long([start]),
                                        _cu_seqlens([length]))
    decoded = torch.cat([OPS.gated_delta_decode(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1],
                                                decode_states, _as_long([1])) for t in range(length)])
    assert_close(prefilled, decoded)
    assert_close(prefill_states, decode_states)


@pytest.mark.usefixtures("single_torch_thread")  # many tiny ops: threads only add spin-waiting
def test_gated_delta_prefill_limits_of_the_rule():
    """Two closed forms that need no oracle: with beta = 0 the state only decays, so
    o_t = exp(g_1 + ... + g_t) S_0^T q_t and the final state is exp(sum g) S_0; with g = 0, beta = 1
    and q = k the delta rule overwrites the value stored at k, so o_t = v_t / sqrt(Dk)."""
    heads = GDN_HEADS[1]  # one key head per value head: q and k index the value heads directly
    dim_k = heads[2]
    q, k, v, g, beta = _gdn_inputs(130, heads, torch.float32, seed=4, tiny_qk=False)
    states = _gdn_states(1, heads, seed=5)
    initial = states[0].double()
    out = OPS.gated_delta_prefill(q, k, v, g, torch.zeros_like(beta), states, _as_long([0]), _as_long([3]),
                                  _cu_seqlens([130]))
    unit_q = q.double() / q.double().norm(dim=-1, keepdim=True) / dim_k ** 0.5
    expected = torch.einsum("thk,hkv->thv", unit_q, initial) * g.double().cumsum(0).exp()[..., None]
    assert_close(out, expected, torch.float32)
    assert_close(states[0], initial * g.double().sum(0).exp()[:, None, None], torch.float32)
    out = OPS.gated_delta_prefill(k, k, v, torch.zeros_like(g), torch.ones_like(beta), states, _as_long([0]),
                                  _as_long([3]), _cu_seqlens([130]))
    assert_close(out, v.double() / dim_k ** 0.5, torch.float32)


# -- the kernel against the reference, batch invariance ----------------------------------------


# Sequence lengths / start positions of one prefill call: lengths 1..130, starts off the chunk grid.
LENGTHS = [1, 2, 17, 63, 64, 65, 130]
STARTS = [0, 5, 70, 64, 3, 100, 33]


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


# Interpreted on the CPU, two of the fp32 head layouts run under `slow` (the lab grid covers them too).
_SLOW_ON_CPU = [] if torch.cuda.is_available() else [pytest.mark.slow]


@pytest.mark.slow
@pytest.mark.parametrize("heads,dtype", [pytest.param(h, torch.float32, marks=_SLOW_ON_CPU if i in (1, 2) else [])
                                         for i, h in enumerate(HEADS)]
                         + [pytest.param(HEADS[1], torch.float16, marks=_SLOW_ON_CPU)])
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


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.float16, marks=_SLOW_ON_CPU)])
def test_prefill_batch_invariance(dtype):
    """A sequence's prefill outputs and final state are bitwise the same alone and in a batch."""
    _check_prefill_batch_invariance(HEADS[1], dtype, [17, 65, 40], [3, 64, 100])


# -- split invariance at chunk boundaries ------------------------------------------------------


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


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.float16, marks=_SLOW_ON_CPU)])
def test_prefill_split_at_chunk_boundaries(dtype):
    """A prompt cut at absolute positions 64 and 128 gives bitwise the outputs and state of one piece."""
    _check_split_invariance(HEADS[1], dtype, start=10, length=150, cuts=[64, 128])


@pytest.mark.slow
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


GDN_SPLITS = [  # (start: tokens already in the slot, new tokens, absolute cuts)
    (64, 150, [192]),
    (128, 100, [192]),
    (10, 200, [64, 128, 192]),
    (100, 130, [128, 192]),
]


def _split_gdn_inputs(tokens: int, seed: int):
    """q/k [T, 1, 16], v [T, 2, 8] (two value heads per key head), g log-decays, beta; a nonzero
    initial state for 3 slots, as if the slot held earlier tokens."""
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(tokens, 1, 16, generator=gen), torch.randn(tokens, 1, 16, generator=gen)
    v = torch.randn(tokens, 2, 8, generator=gen)
    g = F.logsigmoid(2.0 + 2.0 * torch.randn(tokens, 2, generator=gen))
    beta = torch.sigmoid(torch.randn(tokens, 2, generator=gen))
    state = 0.3 * torch.randn(3, 2, 16, 8, generator=gen)
    return tuple(x.to(DEVICE) for x in (q, k, v, g, beta)), state.to(DEVICE)


def _gdn_call(fn):
    def call(inputs, state, slots, starts, lengths):
        cu = torch.cumsum(_long([0] + lengths), 0)
        return fn(*inputs, state, _long(slots), _long(starts), cu)
    return call


def _misaligned_ref(q, k, v, g, beta, states, slot_ids, start_positions, cu_seqlens):
    """The reference with its chunk grid aligned to each piece's first token instead of to
    absolute positions (it uses the start only for the grid): the bug the tests must catch."""
    return gated_delta_prefill_ref(q, k, v, g, beta, states, slot_ids, torch.zeros_like(start_positions), cu_seqlens)


GDN_CASES = [(gated_delta_prefill_ref, split) for split in GDN_SPLITS] + [  # the interpreter is slow: two
    (gated_delta_prefill_impl, split) for split in (GDN_SPLITS[0], GDN_SPLITS[3])]


@pytest.mark.parametrize("fn,split", GDN_CASES,
                         ids=[f"{fn.__name__.split('_')[-1]}-{split[0]}" for fn, split in GDN_CASES])
def test_gated_delta_prefill_split_invariance(fn, split):
    """Cuts at absolute chunk boundaries after a non-zero start: bitwise one-piece outputs and state."""
    start, length, cuts = split
    inputs, state = _split_gdn_inputs(length + OTHER_LEN, seed=start + length)
    _assert_split_invariant(_split_run(_gdn_call(fn), inputs, state, start, cuts))


@pytest.mark.parametrize("start,length,cuts", [(10, 200, [64, 128, 192]), (100, 130, [128, 192])])
def test_gated_delta_negative_control_piece_aligned_grid_is_caught(start, length, cuts):
    """A chunk grid aligned to the piece start changes the results of a split off-grid prompt."""
    inputs, state = _split_gdn_inputs(length + OTHER_LEN, seed=start + length)
    whole, whole_state, pieces, piece_state = _split_run(_gdn_call(_misaligned_ref), inputs, state, start, cuts)
    assert not (torch.equal(pieces, whole) and torch.equal(piece_state, whole_state))


def test_gated_delta_chunk_size_is_the_grid_of_the_cuts():
    """The cuts above are chunk boundaries: the claim covers exactly these."""
    assert CHUNK_SIZE == 64
    assert all(c % CHUNK_SIZE == 0 for _, _, cuts in GDN_SPLITS for c in cuts)


# -- GPU: bf16 at Qwen3.5 sizes ----------------------------------------------------------------


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
