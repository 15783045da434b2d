"""gated_delta_prefill with a replay buffer (exact replay, `pocketllm/kernels/_gated_delta.py`): a
prompt cut anywhere, down to one-token pieces (what a decode step runs in the exact-positions
mode), gives bitwise the outputs of one piece, and after the last piece the same state and
replay buffer; the reference and the Triton kernel each, every piece sharing its call with
another sequence.

- without cuts, a replayed prefill runs exactly the plain chunked prefill (same outputs, and the
  same state once the chunk is complete), so its accuracy is the plain op's (tested against the
  recurrence in test_gated_delta_prefill.py);
- the kernel agrees with the reference within tolerance;
- negative controls: a replay buffer that forgets (zeroed between pieces) or a plain prefill
  continuing a partial chunk (the state moved past an unfinished chunk) are caught.
"""

from __future__ import annotations

import pytest
import torch
from helpers import budget
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_cases import gdn_inputs, gdn_states
from kernel_impls import DEVICE, implementation
from kernel_tolerances import assert_close

from pocketllm.kernels._gated_delta import CHUNK_SIZE, replay_width
from pocketllm.kernels.gated_delta_prefill import gated_delta_prefill_ref

HEADS = (1, 2, 16, 8)  # key heads, value heads (two per key head), Dk, Dv
SLOT, OTHER_SLOT, OTHER_LEN = 1, 2, 3
gated_delta_prefill_impl = implementation("gated_delta_prefill")


def _long(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=DEVICE)


def _buffers(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Nonzero states for 3 slots (as if slot SLOT held a prefix ending on the chunk grid), and
    replay buffers full of NaN: a row read before it is written poisons the result."""
    key_heads, v_heads, dim_k, dim_v = HEADS
    states = gdn_states(3, v_heads, dim_k, dim_v, seed)
    replay = torch.full((3, CHUNK_SIZE, replay_width(key_heads, dim_k, v_heads, dim_v)), float("nan"), device=DEVICE)
    return states, replay


def _run(fn, inputs, start: int, bounds: list[int], seed: int, forget: bool = False):
    """The prompt `inputs` at positions start.. in pieces between `bounds` (relative), each after
    OTHER_LEN tokens of another sequence in the same call: (outputs, state, replay rows of SLOT)."""
    states, replay = _buffers(seed)
    other = gdn_inputs(OTHER_LEN, *HEADS, torch.float32, seed + 1)
    outs = []
    for lo, hi in zip(bounds, bounds[1:]):
        batch = tuple(torch.cat([a, b[lo:hi]]) for a, b in zip(other, inputs))
        cu = _long([0, OTHER_LEN, OTHER_LEN + hi - lo])
        out = fn(*batch, states, _long([OTHER_SLOT, SLOT]), _long([CHUNK_SIZE, start + lo]), cu, replay)
        outs.append(out[OTHER_LEN:])
        if forget:
            replay[SLOT].zero_()
    held = (start + bounds[-1]) % CHUNK_SIZE
    return torch.cat(outs), states[SLOT], replay[SLOT, :held]


def _assert_cut_invariant(fn, start: int, length: int, cuts: list[int], seed: int) -> None:
    inputs = gdn_inputs(length, *HEADS, torch.float32, seed)
    whole = _run(fn, inputs, start, [0, length], seed)
    pieces = _run(fn, inputs, start, [0, *cuts, length], seed)
    for name, a, b in zip(("outputs", "state", "replay rows"), whole, pieces):
        assert torch.equal(a, b), f"{name} differ with cuts {cuts}"


cases = st.tuples(st.sampled_from([0, CHUNK_SIZE]), st.integers(2, 140)).flatmap(
    lambda sl: st.tuples(st.just(sl[0]), st.just(sl[1]),
                         st.lists(st.integers(1, sl[1] - 1), max_size=6, unique=True).map(sorted)))


@pytest.mark.usefixtures("single_torch_thread")  # many tiny ops: threads only add spin-waiting
@settings(deadline=None, max_examples=budget(0.3))
@given(case=cases)
def test_reference_replay_is_cut_invariant(case):
    """Any cuts, one-token pieces included, give the one-piece outputs, state and replay rows."""
    start, length, cuts = case
    _assert_cut_invariant(gated_delta_prefill_ref, start, length, cuts, seed=length)


@pytest.mark.usefixtures("single_torch_thread")
def test_reference_decoding_every_token_is_prefilling():
    """Every token a one-token piece (a decode step in the exact mode), across a chunk boundary."""
    _assert_cut_invariant(gated_delta_prefill_ref, CHUNK_SIZE, 80, list(range(1, 80)), seed=3)


# The interpreter runs a whole chunk per piece: a few pieces; across the chunk boundary under slow on the CPU.
_SLOW_ON_CPU = [] if torch.cuda.is_available() else [pytest.mark.slow]
KERNEL_CASES = [(0, 9, [1, 2, 3, 7]), pytest.param(CHUNK_SIZE, 70, [1, 62, 63, 64, 65], marks=_SLOW_ON_CPU)]


@pytest.mark.parametrize("start,length,cuts", KERNEL_CASES)
def test_kernel_replay_is_cut_invariant_and_matches_reference(start, length, cuts):
    _assert_cut_invariant(gated_delta_prefill_impl, start, length, cuts, seed=length)
    inputs = gdn_inputs(length, *HEADS, torch.float32, seed=length)
    bounds = [0, cuts[0], length]
    for kernel, ref in zip(_run(gated_delta_prefill_impl, inputs, start, bounds, seed=length),
                           _run(gated_delta_prefill_ref, inputs, start, bounds, seed=length)):
        assert_close(kernel, ref)


@pytest.mark.usefixtures("single_torch_thread")
@pytest.mark.parametrize("length", [40, CHUNK_SIZE, 100])
def test_one_replayed_piece_is_the_plain_prefill(length):
    """From a chunk boundary, one replayed piece computes exactly the plain op's chunks: the same
    outputs; the same state where the last chunk is complete, else the state before it."""
    inputs = gdn_inputs(length, *HEADS, torch.float32, seed=length)
    replayed, state, _ = _run(gated_delta_prefill_ref, inputs, CHUNK_SIZE, [0, length], seed=5)
    states, _ = _buffers(seed=5)
    plain = gated_delta_prefill_ref(*inputs, states, _long([SLOT]), _long([CHUNK_SIZE]), _long([0, length]))
    assert torch.equal(replayed, plain)
    if length % CHUNK_SIZE == 0:
        assert torch.equal(state, states[SLOT])
    else:
        complete = length // CHUNK_SIZE * CHUNK_SIZE
        states, _ = _buffers(seed=5)
        if complete:
            gated_delta_prefill_ref(*(x[:complete] for x in inputs), states, _long([SLOT]), _long([CHUNK_SIZE]),
                                    _long([0, complete]))
        assert torch.equal(state, states[SLOT])


@pytest.mark.usefixtures("single_torch_thread")
def test_negative_control_a_forgetful_replay_buffer_is_caught():
    inputs = gdn_inputs(20, *HEADS, torch.float32, seed=2)
    whole = _run(gated_delta_prefill_ref, inputs, 0, [0, 20], seed=2)
    forgetful = _run(gated_delta_prefill_ref, inputs, 0, [0, 7, 20], seed=2, forget=True)
    assert not torch.equal(whole[0], forgetful[0])


@pytest.mark.usefixtures("single_torch_thread")
def test_negative_control_continuing_a_partial_chunk_is_caught():
    """The plain op (no replay) continues an unfinished chunk from its partial state: cut off the
    chunk grid, its pieces differ from one piece; the replayed ones above do not."""
    inputs = gdn_inputs(20, *HEADS, torch.float32, seed=2)

    def plain(*args):
        return gated_delta_prefill_ref(*args[:-1])

    whole = _run(plain, inputs, 0, [0, 20], seed=2)
    pieces = _run(plain, inputs, 0, [0, 7, 20], seed=2)
    assert not torch.equal(whole[0], pieces[0])
