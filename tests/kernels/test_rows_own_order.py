"""The row-wise ops' `own_order` implementations (pocketllm/kernels/cpu/rows.cpp), the torch backend's
where its C++ kernels build:

- rms_norm: within the tolerance of the reference, and bit for bit the documented order (the sum of
  squares in 16 lanes with one fused multiply-add per element, the fixed tree, then the scale),
  emulated in float64; rows of q/k views read in place;
- rms_norm_gated: rms_norm's row times torch's scalar SiLU of the gate, gates read in place;
- silu_and_mul, rope_write_kv and conv1d_decode: bit for bit the reference (torch's scalar SiLU;
  RoPE's and the conv taps' products and sums each rounded on its own), the K/V and conv states
  written where the reference writes them, partial rotary, kernel widths 2 to 4;
- every row the same alone and in any batch, at 1 and 2 threads; other dtypes run the reference; a
  position outside the cache is refused, not written.
"""

from __future__ import annotations

import pytest
import torch
from kernel_cases import threads as threads  # the fixture

from pocketllm.kernels.conv1d_decode import conv1d_decode_own_order, conv1d_decode_ref
from pocketllm.kernels.cpu.extension import load_extension
from pocketllm.kernels.registry import IMPLEMENTATIONS
from pocketllm.kernels.rms_norm import rms_norm_own_order, rms_norm_ref
from pocketllm.kernels.rms_norm_gated import rms_norm_gated_own_order, rms_norm_gated_ref
from pocketllm.kernels.rope import rope_table
from pocketllm.kernels.rope_write_kv import rope_write_kv_own_order, rope_write_kv_ref
from pocketllm.kernels.silu_and_mul import silu_and_mul_own_order, silu_and_mul_ref

if load_extension() is None:
    pytest.skip("the C++ CPU kernels cannot be built here (no compiler or ninja)", allow_module_level=True)


def _randn(*shape: int, seed: int = 0, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def _documented_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """rows.cpp's order, emulated: each fused multiply-add an exact float64 product and sum rounded
    once to fp32, the tree, then 1 / sqrt(s / H + eps) and w * (x * inv), each step in float64
    rounded to fp32 (correctly rounded, as IEEE fp32 arithmetic is; torch's own CPU division and
    square root of small tensors need not be)."""
    rows, h = x.shape
    padded = -(-h // 16) * 16
    xp = torch.nn.functional.pad(x, (0, padded - h)).double()
    lanes = torch.zeros(rows, 16)
    for k0 in range(0, padded, 16):
        lanes = (xp[:, k0:k0 + 16] * xp[:, k0:k0 + 16] + lanes.double()).float()
    for half in (8, 4, 2, 1):
        lanes = lanes[:, :half] + lanes[:, half:2 * half]
    def fp32(t: torch.Tensor) -> torch.Tensor:
        return t.float().double()

    mean = fp32(lanes[:, :1].double() / h)
    inv = fp32(1.0 / fp32(fp32(mean + torch.tensor(eps, dtype=torch.float32).double()).sqrt()))
    return (w.double() * fp32(x.double() * inv)).float()


@pytest.mark.parametrize("h", [1, 15, 16, 17, 100, 1024])
def test_rms_norm_is_its_documented_order_and_close_to_the_reference(h):
    x, w = _randn(9, h, seed=h, scale=3.0), _randn(h, seed=h + 1)
    got = rms_norm_own_order(x, w, 1e-6)
    assert torch.equal(got, _documented_rms_norm(x, w, 1e-6))
    torch.testing.assert_close(got, rms_norm_ref(x, w, 1e-6), atol=1e-5, rtol=1e-5)


def test_rms_norm_reads_head_views_in_place_and_keeps_each_row():
    """The q/k norm: [T, heads, D] views of a fused projection's output, rows far apart."""
    qkv = _randn(6, 8 * 64 + 2 * 2 * 64, seed=3)
    q = qkv[:, :8 * 64].reshape(6, 8, 64)
    w = _randn(64, seed=4)
    got = rms_norm_own_order(q, w, 1e-6)
    assert got.is_contiguous() and torch.equal(got, rms_norm_own_order(q.contiguous(), w, 1e-6))
    assert torch.equal(got.reshape(48, 64), _documented_rms_norm(q.reshape(48, 64), w, 1e-6))


@pytest.mark.parametrize("op,fn,width", [("rms_norm", lambda x: rms_norm_own_order(x, torch.ones(x.shape[1]), 1e-6),
                                          1024),
                                         ("silu_and_mul", silu_and_mul_own_order, 2 * 3072)])
def test_a_row_is_the_same_alone_and_in_any_batch_at_any_thread_count(op, fn, width, threads):
    x = _randn(70, width, seed=5, scale=4.0)  # enough rows that the work is split across threads
    torch.set_num_threads(threads)
    batch = fn(x)
    torch.set_num_threads(1)
    alone = torch.cat([fn(x[i:i + 1]) for i in range(x.shape[0])])
    assert torch.equal(batch, alone), op
    assert torch.equal(fn(x.roll(5, 0)), batch.roll(5, 0)), op


@pytest.mark.parametrize("width", [2, 48, 2 * 1100, 2 * 3072])
def test_silu_and_mul_is_the_reference_bit_for_bit(width):
    x = _randn(7, width, seed=width, scale=6.0)
    x[0, :4] = torch.tensor([0.0, -0.0, 88.0, -104.0])[: min(4, width // 2)]
    assert torch.equal(silu_and_mul_own_order(x), silu_and_mul_ref(x))


def test_rms_norm_gated_is_rms_norm_times_silu_of_the_gate():
    out = _randn(5, 4, 128, seed=7)
    z = _randn(5, 4 * 128 + 9, seed=8, scale=3.0)[:, :4 * 128].reshape(5, 4, 128)  # a view of a projection
    w = _randn(128, seed=9)
    got = rms_norm_gated_own_order(out, z, w, 1e-6)
    assert torch.equal(got, rms_norm_own_order(out, w, 1e-6) * silu_and_mul_ref(torch.cat([z, torch.ones_like(z)], -1)))
    torch.testing.assert_close(got, rms_norm_gated_ref(out, z, w, 1e-6), atol=1e-5, rtol=1e-5)
    assert torch.equal(rms_norm_gated_own_order(out[2:3], z[2:3], w, 1e-6), got[2:3])


@pytest.mark.parametrize("taps", [2, 3, 4])
def test_conv1d_decode_is_the_reference_bit_for_bit(taps):
    x = _randn(4, 300 + 5, seed=taps, scale=2.0)[:, :300]  # rows of a wider projection, read in place
    weight = _randn(300, taps, seed=taps + 1)
    states = [_randn(6, 300, taps - 1, seed=taps + 2) for _ in range(2)]
    states[1] = states[0].clone()
    slots = torch.tensor([3, 0, 5, 1])
    got = conv1d_decode_own_order(x, weight, states[0], slots)
    assert torch.equal(got, conv1d_decode_ref(x, weight, states[1], slots))
    assert torch.equal(states[0], states[1])
    with pytest.raises(IndexError, match="slot 6 outside the conv states"):
        conv1d_decode_own_order(x[:1], weight, states[0], torch.tensor([6]))


def _qkv(tokens: int, hq: int, hkv: int, d: int, seed: int):
    qkv = _randn(tokens, (hq + 2 * hkv) * d, seed=seed)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    return q.reshape(tokens, hq, d), k.reshape(tokens, hkv, d), v.reshape(tokens, hkv, d)


@pytest.mark.parametrize("rotary", [64, 32, 16])
def test_rope_write_kv_is_the_reference_bit_for_bit(rotary):
    q, k, v = _qkv(6, 4, 2, 64, seed=rotary)
    cos, sin = rope_table(rotary, 90, 1e6)
    positions, slots = torch.tensor([0, 5, 89, 6, 7, 1]), torch.tensor([0, 2, 2, 1, 1, 0])
    caches = [[torch.zeros(3, 90, 2, 64) for _ in range(2)] for _ in range(2)]
    got = rope_write_kv_own_order(q, k, v, positions, cos, sin, *caches[0], slots)
    want = rope_write_kv_ref(q, k, v, positions, cos, sin, *caches[1], slots)
    assert torch.equal(got, want)
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])


def test_a_position_outside_the_cache_is_refused():
    q, k, v = _qkv(2, 2, 1, 16, seed=1)
    cos, sin = rope_table(16, 8, 1e6)
    k_cache, v_cache = torch.zeros(1, 8, 1, 16), torch.zeros(1, 8, 1, 16)
    with pytest.raises(IndexError, match="position 8 or slot 0 outside the cache"):
        rope_write_kv_own_order(q, k, v, torch.tensor([1, 8]), cos, sin, k_cache, v_cache, torch.tensor([0, 0]))
    assert not k_cache.any() and not v_cache.any()


def test_other_dtypes_run_the_reference_and_the_ops_are_registered():
    x = _randn(3, 40, seed=2).half()
    assert torch.equal(rms_norm_own_order(x, torch.ones(40).half(), 1e-6), rms_norm_ref(x, torch.ones(40).half(), 1e-6))
    assert torch.equal(silu_and_mul_own_order(x), silu_and_mul_ref(x))
    assert IMPLEMENTATIONS["rms_norm"]["own_order"] is rms_norm_own_order
    assert IMPLEMENTATIONS["silu_and_mul"]["own_order"] is silu_and_mul_own_order
    assert IMPLEMENTATIONS["rope_write_kv"]["own_order"] is rope_write_kv_own_order
    assert IMPLEMENTATIONS["rms_norm_gated"]["own_order"] is rms_norm_gated_own_order
    assert IMPLEMENTATIONS["conv1d_decode"]["own_order"] is conv1d_decode_own_order
