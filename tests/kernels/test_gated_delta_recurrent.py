"""The recurrent gated delta rule (`recurrent` of gated_delta_prefill and gated_delta_decode, the C++
kernel `pocketllm/kernels/cpu/gated_delta.cpp`): the torch backend's Gated DeltaNet with exact
positions.

- against the float64 recurrence written from the published model definition (`delta_rule_oracle`);
- bitwise: a prompt cut anywhere (down to one-token pieces) gives the one-piece outputs and state,
  and decoding token by token gives the prefill's; a sequence alone equals it in a batch; 1 and 2
  threads agree;
- negative control: a decode step that rounds one ulp away (planted) is caught by the same check.
"""

from __future__ import annotations

import pytest
import torch
from helpers import budget
from hypothesis import given, settings
from hypothesis import strategies as st
from kernel_cases import GDN_HEADS, delta_rule_oracle, gdn_oracle_inputs, gdn_oracle_states
from kernel_tolerances import assert_close

from pocketllm.kernels.cpu.extension import load_extension
from pocketllm.kernels.gated_delta_decode import gated_delta_decode_recurrent
from pocketllm.kernels.gated_delta_prefill import gated_delta_prefill_recurrent

pytestmark = pytest.mark.skipif(load_extension() is None, reason="pocketllm's C++ CPU kernels cannot be built here")
NUDGE = 1.0 + 2.0**-20  # as tests/planted.py: moves every nonzero normal fp32 value


def _long(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def _prefill(inputs, states, slots, starts, lengths):
    cu = torch.cumsum(_long([0] + list(lengths)), 0)
    return gated_delta_prefill_recurrent(*inputs, states, _long(slots), _long(starts), cu)


def _pieces(inputs, states, slot: int, bounds: list[int], decode=gated_delta_decode_recurrent):
    """The sequence through slot `slot` in pieces between `bounds`; a one-token piece as a decode step."""
    outs = []
    for lo, hi in zip(bounds, bounds[1:]):
        piece = tuple(x[lo:hi] for x in inputs)
        if hi - lo == 1:
            outs.append(decode(*piece, states, _long([slot])))
        else:
            outs.append(_prefill(piece, states, [slot], [lo], [hi - lo]))
    return torch.cat(outs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("heads", GDN_HEADS, ids=str)
def test_recurrent_matches_the_recurrence(heads, dtype):
    q, k, v, g, beta = gdn_oracle_inputs(70, heads, dtype, seed=sum(heads))
    states = gdn_oracle_states(3, heads, seed=1)
    before = states.clone()
    out = _prefill((q, k, v, g, beta), states, [2], [5], [70])
    expected, final = delta_rule_oracle(q, k, v, g, beta, before[2])
    assert out.dtype == dtype
    assert_close(out, expected, dtype)
    assert_close(states[2], final, torch.float32)
    assert torch.equal(states[:2], before[:2])


cuts = st.integers(2, 90).flatmap(lambda n: st.tuples(
    st.just(n), st.lists(st.integers(1, n - 1), max_size=8, unique=True).map(sorted)))


@settings(deadline=None, max_examples=budget(0.3))
@given(case=cuts)
def test_recurrent_is_cut_invariant(case):
    """Any cuts, one-token pieces through the decode op: the one-piece outputs and state."""
    n, bounds = case
    inputs = gdn_oracle_inputs(n, GDN_HEADS[0], torch.float32, seed=n)
    whole_states, cut_states = gdn_oracle_states(2, GDN_HEADS[0], seed=2), gdn_oracle_states(2, GDN_HEADS[0], seed=2)
    whole = _prefill(inputs, whole_states, [1], [0], [n])
    assert torch.equal(_pieces(inputs, cut_states, 1, [0, *bounds, n]), whole)
    assert torch.equal(cut_states, whole_states)


def test_decoding_every_token_is_prefilling():
    inputs = gdn_oracle_inputs(40, GDN_HEADS[1], torch.float32, seed=3)
    prefill_states, decode_states = (gdn_oracle_states(1, GDN_HEADS[1], seed=4) for _ in range(2))
    prefilled = _prefill(inputs, prefill_states, [0], [0], [40])
    assert torch.equal(_pieces(inputs, decode_states, 0, list(range(41))), prefilled)
    assert torch.equal(decode_states, prefill_states)


def test_recurrent_is_batch_and_thread_invariant(single_torch_thread):
    """Three sequences in one call, in other slots, at 1 and at 2 threads: each equals itself alone."""
    lengths = [17, 1, 66]
    inputs = gdn_oracle_inputs(sum(lengths), GDN_HEADS[0], torch.float32, seed=5)
    states = gdn_oracle_states(4, GDN_HEADS[0], seed=6)
    batched = {}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        copy = states.clone()
        batched[threads] = (_prefill(inputs, copy, [3, 0, 2], [4, 9, 0], lengths), copy)
    assert torch.equal(batched[1][0], batched[2][0]) and torch.equal(batched[1][1], batched[2][1])
    lo = 0
    for slot, start, n in zip([3, 0, 2], [4, 9, 0], lengths):
        alone_states = states.clone()
        alone = _prefill(tuple(x[lo:lo + n] for x in inputs), alone_states, [slot], [start], [n])
        assert torch.equal(alone, batched[2][0][lo:lo + n])
        assert torch.equal(alone_states[slot], batched[2][1][slot])
        lo += n


def test_negative_control_a_decode_step_one_ulp_away_is_caught():
    def nudged(*args):
        return gated_delta_decode_recurrent(*args) * NUDGE

    inputs = gdn_oracle_inputs(12, GDN_HEADS[0], torch.float32, seed=7)
    whole = _prefill(inputs, gdn_oracle_states(2, GDN_HEADS[0], seed=8), [1], [0], [12])
    cut = _pieces(inputs, gdn_oracle_states(2, GDN_HEADS[0], seed=8), 1, [0, 5, 6, 12], decode=nudged)
    assert not torch.equal(cut, whole)
    assert torch.equal(cut[:5], whole[:5])  # the prefix before the nudged step is untouched


def test_recurrent_refuses_replay_buffers():
    inputs = gdn_oracle_inputs(2, GDN_HEADS[0], torch.float32, seed=9)
    with pytest.raises(ValueError, match="replay must be None"):
        gated_delta_prefill_recurrent(*inputs, gdn_oracle_states(1, GDN_HEADS[0], seed=1), _long([0]), _long([0]),
                                      _long([0, 2]), replay=torch.zeros(1, 64, 8))
