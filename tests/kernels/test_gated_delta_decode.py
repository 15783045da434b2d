"""gated_delta_decode (pocketllm/kernels/gated_delta_decode.py): one step of the Gated DeltaNet
rule per sequence, from and to its slot's state.

- oracles written from the published model definition (transformers' Qwen3.5 modeling code), not
  from pocketllm's code (`kernel_cases.delta_rule_oracle`): the token-by-token recurrence in
  float64, one value head at a time, for the torch backend's op, over several steps;
- the kernel under test (by default the Triton one) against the reference (slots out of batch
  order, GQA, two Dv blocks the last partial; fp32 and fp16 on DEVICE, bf16 at Qwen3.5 sizes in
  the `gpu` test), decoding from kernel-prefilled states, and its batch invariance, bitwise.
The prefill equal to token-by-token decoding: test_gated_delta_prefill.py.
"""

from __future__ import annotations

import pytest
import torch
from kernel_cases import GDN_HEADS, QWEN35_HEADS
from kernel_cases import GDN_KERNEL_HEADS as HEADS
from kernel_cases import as_long as _as_long
from kernel_cases import delta_rule_oracle as _delta_rule_oracle
from kernel_cases import gdn_inputs as _inputs
from kernel_cases import gdn_oracle_inputs as _gdn_inputs
from kernel_cases import gdn_oracle_states as _gdn_states
from kernel_cases import gdn_prefill as _prefill
from kernel_cases import gdn_states as _states
from kernel_cases import rows as _rows
from kernel_impls import DEVICE, implementation
from kernel_tolerances import assert_close

from pocketllm.kernels import torch_ops
from pocketllm.kernels.gated_delta_decode import gated_delta_decode_ref
from pocketllm.kernels.gated_delta_prefill import gated_delta_prefill_ref

OPS = torch_ops()
gated_delta_prefill_impl = implementation("gated_delta_prefill")
gated_delta_decode_impl = implementation("gated_delta_decode")


# -- the torch backend's op against the recurrence ---------------------------------------------


@pytest.mark.usefixtures("single_torch_thread")  # many tiny ops: threads only add spin-waiting
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_gated_delta_decode_matches_recurrence(dtype: torch.dtype):
    """Four decode steps of three sequences (slots out of order, GQA 2): every step's outputs and
    the slots' states follow the recurrence; the unused slot is untouched."""
    heads, slots, steps = GDN_HEADS[0], [2, 0, 3], 4
    states = _gdn_states(4, heads, seed=2)
    before = states.clone()
    tokens = [_gdn_inputs(len(slots), heads, dtype, seed=10 + step) for step in range(steps)]
    outs = [OPS.gated_delta_decode(*token, states, _as_long(slots)) for token in tokens]
    for b, slot in enumerate(slots):
        q, k, v, g, beta = (torch.stack([token[j][b] for token in tokens]) for j in range(5))
        expected, final = _delta_rule_oracle(q, k, v, g, beta, before[slot])
        assert_close(torch.stack([out[b] for out in outs]), expected, dtype)
        assert_close(states[slot], final, torch.float32)
    assert torch.equal(states[1], before[1])


# -- the kernel against the reference, batch invariance ----------------------------------------


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


# -- GPU: bf16 at Qwen3.5 sizes ----------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_decode():
    """bf16 decode matches the reference after a long prefill and is bitwise batch invariant."""
    _check_decode_after_prefill(QWEN35_HEADS, torch.bfloat16, [3000, 100, 1], [0, 64, 9], steps=4, device="cuda")
    _check_decode_batch_invariance(QWEN35_HEADS, torch.bfloat16, device="cuda")
