"""The reference sampler's noise is the documented formula, bit for bit, and it runs wherever its
inputs live.

uniform_noise is compared with tests/sampling_oracle.py, which computes the documented hash in
Python integers: a change of the offset or scale of the uniform, of the mixer or of the key
schedule changes some entries even where the statistics of the noise would not notice.
"""

from __future__ import annotations

import torch
from kernel_impls import DEVICE, implementation
from sampling_oracle import MASK32, MAX_UNIFORM, POSITION_SALT, draw, mix, uniforms

from pocketllm.kernels.sample import allowed_mask, sample_ref, uniform_noise

sample_impl = implementation("sample")

# Seeds with either 32-bit half zero or all ones, positions at 0 and at the int32 edge.
CASES = [(0, 0), (1, 7), (2**32, 3), (2**63 + 5, 2**31 - 1), (2**64 - 1, 123456), (0xDEADBEEF12345678, 2**31)]


def _as_int64(seed: int) -> int:
    return seed - 2**64 if seed >= 2**63 else seed


def test_uniform_noise_is_the_documented_formula():
    vocab = 4099
    seeds = torch.tensor([_as_int64(s) for s, _ in CASES])
    positions = torch.tensor([p for _, p in CASES])
    noise = uniform_noise(seeds, positions, vocab)
    for row, (seed, position) in zip(noise, CASES):
        assert row.tolist() == [float(torch.tensor(u, dtype=torch.float32)) for u in uniforms(seed, position, vocab)]


def _unmix(y: int) -> int:
    """The inverse of the documented mixer (xorshifts and odd multipliers are invertible mod 2^32)."""
    y ^= y >> 16
    y = (y * pow(0x846CA68B, -1, 2**32)) & MASK32
    y ^= (y >> 15) ^ (y >> 30)
    y = (y * pow(0x7FEB352D, -1, 2**32)) & MASK32
    return y ^ (y >> 16)


def _seed_whose_entry_0_draws(bits: int) -> int:
    """A seed (high half 0) whose noise at position 0, entry 0 has hash `bits`: mix(0) = 0, so the
    entry's hash is mix(key) and key = mix(seed_lo ^ mix(mix(0 ^ SALT)))."""
    return _unmix(_unmix(bits)) ^ mix(mix(POSITION_SALT))


def test_noise_at_the_largest_draw_stays_below_one():
    """The hash whose top 24 bits are all ones gives the largest uniform, 1 - 2^-24 after fp32
    rounding (never 1.0, whose Gumbel noise is infinite): a token filtered out is then still never
    drawn, and an allowed one wins only by its finite score, on the reference and the kernel."""
    seed = _seed_whose_entry_0_draws(MASK32)
    assert uniforms(seed, 0, 1)[0] == MAX_UNIFORM
    noise = uniform_noise(torch.tensor([seed]), torch.tensor([0]), 2)
    assert float(noise[0, 0]) == MAX_UNIFORM < 1.0
    logits = torch.tensor([[0.0, 5.0]], device=DEVICE)
    for sampler in (sample_ref, sample_impl):
        for top_k in (1, 0):
            params = (torch.tensor([1.0], device=DEVICE), torch.tensor([top_k], device=DEVICE),
                      torch.tensor([1.0], device=DEVICE), torch.tensor([seed], device=DEVICE),
                      torch.tensor([0], device=DEVICE))
            token = int(sampler(logits, *params)[0][0])
            expected = 1 if top_k == 1 else draw([0.0, 5.0], 1.0, 0, 1.0, seed, 0).token
            assert token == expected, (sampler.__name__, top_k)
    assert draw([0.0, 5.0], 1.0, 0, 1.0, seed, 0).token == 0  # the extreme draw does win when allowed


def test_reference_runs_on_the_inputs_device():
    """No tensor is made on a fixed device: on the meta device (standing in for a GPU) the noise and
    the allowed mask come out there, shaped [B, V]."""
    seeds, positions = torch.tensor([1, 2], device="meta"), torch.tensor([3, 4], device="meta")
    noise = uniform_noise(seeds, positions, 50)
    assert noise.device.type == "meta" and noise.shape == (2, 50) and noise.dtype == torch.float32
    mask = allowed_mask(torch.empty(2, 50, device="meta"), torch.tensor([0, 5], device="meta"),
                        torch.tensor([1.0, 0.5], device="meta"))
    assert mask.device.type == "meta" and mask.shape == (2, 50) and mask.dtype == torch.bool
