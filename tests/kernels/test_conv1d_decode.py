"""conv1d_decode (pocketllm/kernels/conv1d_decode.py): one step of the causal conv1d + SiLU per
sequence, shifting its slot's state of K - 1 inputs.

- the torch backend's op against an oracle written from the published model definition
  (transformers' causal_conv1d_update): `F.conv1d` with groups = channels over [prior state,
  inputs] in float64, then SiLU; the new state is the last K - 1 columns of that window;
- the kernel under test (by default the Triton one) against the reference, slots out of order and
  a zero state among them: outputs within tolerance, states bitwise (fp32 and fp16 on DEVICE; bf16
  at model sizes in the `gpu` test), and its batch invariance, bitwise.
Decode continuing a prefill bitwise as the prefill of the same tokens: test_conv1d_prefill.py.
"""

from __future__ import annotations

import pytest
import torch
from kernel_cases import DTYPES, GPU_CHANNELS
from kernel_cases import as_long as _as_long
from kernel_cases import conv_inputs as _conv_inputs
from kernel_cases import conv_oracle as _conv_oracle
from kernel_cases import conv_oracle_inputs as _conv_oracle_inputs
from kernel_cases import randn_on as _randn
from kernel_impls import DEVICE, implementation
from kernel_tolerances import assert_close

from pocketllm.kernels import torch_ops
from pocketllm.kernels.conv1d_decode import conv1d_decode_ref

OPS = torch_ops()
conv1d_decode_impl = implementation("conv1d_decode")


# -- the torch backend's op against the convolution --------------------------------------------


@pytest.mark.usefixtures("single_torch_thread")  # many tiny ops: threads only add spin-waiting
@pytest.mark.parametrize("kernel", [2, 4])
def test_conv1d_decode_matches_convolution(kernel: int):
    """Decode alone, from nonzero states of slots out of order: one convolution step each."""
    x, weight, states = _conv_oracle_inputs(3, 10, kernel, 4, torch.float32, seed=20 + kernel)
    slots = [3, 0, 2]
    before = states.clone()
    out = OPS.conv1d_decode(x, weight, states, _as_long(slots))
    for b, slot in enumerate(slots):
        expected, final = _conv_oracle(x[b:b + 1], weight, before[slot])
        assert_close(out[b:b + 1], expected, torch.float32)
        assert torch.equal(states[slot].double(), final)
    assert torch.equal(states[1], before[1])


# -- the kernel against the reference, batch invariance ----------------------------------------


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


# -- CUDA, bf16, model sizes -------------------------------------------------------------------


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
