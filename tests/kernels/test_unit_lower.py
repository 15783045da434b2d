"""pocketllm/kernels/_unit_lower.py: the Triton helpers of the chunked gated delta rule.

- `unit_lower_inverse` against the float64 inverse of I + L, for L of the kind a chunk's UT
  transform has (strictly lower, (beta k k^T) * decay with unit-norm keys, so |L| <= 1) and for an L
  whose inverse grows to thousands; L = 0 gives I exactly;
- `rows_product` against the float64 product;
- both on the same bits for the same chunk wherever it sits among others (fixed-shape arithmetic).
"""

from __future__ import annotations

import pytest
import torch
from kernel_impls import DEVICE

from pocketllm.kernels._triton import tl, triton
from pocketllm.kernels._unit_lower import rows_product, unit_lower_inverse

CHUNK = 64
WIDTH = 16


@triton.jit
def _invert_kernel(lower_ptr, out_ptr, CHUNK: tl.constexpr):
    r = tl.arange(0, CHUNK)
    tile = tl.program_id(0) * CHUNK * CHUNK + r[:, None] * CHUNK + r[None, :]
    tl.store(out_ptr + tile, unit_lower_inverse(tl.load(lower_ptr + tile), CHUNK))


@triton.jit
def _product_kernel(a_ptr, b_ptr, out_ptr, CHUNK: tl.constexpr, WIDTH: tl.constexpr):
    r, w = tl.arange(0, CHUNK), tl.arange(0, WIDTH)
    a = tl.load(a_ptr + r[:, None] * CHUNK + r[None, :])
    b = tl.load(b_ptr + r[:, None] * WIDTH + w[None, :])
    tl.store(out_ptr + r[:, None] * WIDTH + w[None, :], rows_product(a, b, CHUNK, WIDTH))


def _invert(lower: torch.Tensor) -> torch.Tensor:
    """lower [n, CHUNK, CHUNK] fp32 -> the kernel's (I + lower)^-1 per chunk."""
    lower = lower.to(DEVICE).contiguous()
    out = torch.empty_like(lower)
    _invert_kernel[(lower.shape[0],)](lower, out, CHUNK=CHUNK)
    return out.cpu()


def _chunk_lower(gen: torch.Generator) -> torch.Tensor:
    """Strictly lower (beta k k^T) * exp(cum_i - cum_j), keys of unit norm, as the UT transform has."""
    k = torch.nn.functional.normalize(torch.randn(CHUNK, 32, generator=gen, dtype=torch.float64), dim=-1)
    beta = torch.rand(CHUNK, generator=gen, dtype=torch.float64)
    cum = (-torch.rand(CHUNK, generator=gen, dtype=torch.float64) * 0.3).cumsum(0)
    decay = (cum[:, None] - cum[None, :]).clamp(max=0).exp()
    return ((beta[:, None] * (k @ k.T)) * decay).tril(-1)


def _assert_inverse(lower: torch.Tensor, got: torch.Tensor, rtol: float) -> None:
    want = torch.linalg.inv(torch.eye(CHUNK, dtype=torch.float64) + lower.double())
    scale = want.abs().max()
    err = (got.double() - want).abs().max()
    assert err <= rtol * scale, f"max error {err:.3e} against entries up to {scale:.3e}"


@pytest.mark.usefixtures("single_torch_thread")
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_inverse_of_a_chunks_transform(seed: int):
    gen = torch.Generator().manual_seed(seed)
    lower = torch.stack([_chunk_lower(gen) for _ in range(2)])
    got = _invert(lower.float())
    for i in range(2):
        _assert_inverse(lower[i].float(), got[i], rtol=1e-5)
        assert torch.equal(got[i].triu(1), torch.zeros(CHUNK, CHUNK)), "the inverse is lower triangular"
        assert torch.equal(got[i].diagonal(), torch.ones(CHUNK)), "its diagonal is exactly 1"


@pytest.mark.usefixtures("single_torch_thread")
def test_the_inverse_with_large_entries():
    """Entries of L near -0.2 everywhere below the diagonal: (I + L)^-1 grows to about 1e4 at its
    corner (0.2 * 1.2^62), and every block row of the blocked solve feeds the next."""
    gen = torch.Generator().manual_seed(3)
    lower = -(0.18 + 0.02 * torch.rand(CHUNK, CHUNK, generator=gen)).tril(-1)
    got = _invert(lower[None])[0]
    assert got.abs().max() > 1e3
    _assert_inverse(lower, got, rtol=1e-5)


@pytest.mark.usefixtures("single_torch_thread")
def test_no_coupling_gives_the_identity_exactly():
    assert torch.equal(_invert(torch.zeros(1, CHUNK, CHUNK))[0], torch.eye(CHUNK))


@pytest.mark.usefixtures("single_torch_thread")
def test_a_chunk_gets_the_same_bits_among_others():
    gen = torch.Generator().manual_seed(4)
    chunks = torch.stack([_chunk_lower(gen) for _ in range(3)]).float()
    together = _invert(chunks)
    for i in range(3):
        assert torch.equal(_invert(chunks[i:i + 1])[0], together[i])


@pytest.mark.usefixtures("single_torch_thread")
def test_rows_product_is_the_product():
    gen = torch.Generator().manual_seed(5)
    a, b = torch.randn(CHUNK, CHUNK, generator=gen), torch.randn(CHUNK, WIDTH, generator=gen)
    out = torch.empty(CHUNK, WIDTH, device=DEVICE)
    _product_kernel[(1,)](a.to(DEVICE), b.to(DEVICE), out, CHUNK=CHUNK, WIDTH=WIDTH)
    torch.testing.assert_close(out.cpu().double(), a.double() @ b.double(), rtol=1e-5, atol=1e-5)
