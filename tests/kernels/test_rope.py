"""The rotary embedding (pocketllm/kernels/rope.py: `rope_table`, `apply_rope_ref`, what
rope_write_kv's reference rotates with) against the rotation written out independently in float64:
as a complex rotation of the pairs (i, i + D/2), and per dimension pair (the rotate-half layout:
dims i and i + R/2 of the first R rotate together by position * theta^(-2i/R)), full and partial
(R < D: the other dims pass through unchanged); and the property that defines it, scores that
depend only on the relative position."""

from __future__ import annotations

import hashlib
import math
import subprocess
import sys

import mpmath
import pytest
import torch
from kernel_cases import FORMULA_TOL as TOL
from kernel_cases import angles as _angles
from kernel_cases import gen as _gen
from kernel_cases import randn as _randn
from kernel_cases import rope_reference as _rope_reference

from pocketllm.kernels.rope import apply_rope_ref, rope_table

# -- against the complex rotation --------------------------------------------------------------


@pytest.mark.parametrize("head_dim", [16, 24, 32])
@pytest.mark.parametrize("theta", [10000.0, 1000000.0])
def test_rope_table_matches_formula(head_dim, theta):
    """cos/sin tables are cos/sin(pos * theta^(-2i/D)), the D/2 frequencies repeated for both halves."""
    cos, sin = rope_table(head_dim, 600, theta)
    assert cos.shape == sin.shape == (600, head_dim) and cos.dtype == sin.dtype == torch.float32
    angles = _angles(head_dim, torch.arange(600), theta)
    full = torch.cat([angles, angles], dim=-1)
    torch.testing.assert_close(cos.double(), full.cos(), **TOL["rope_table"][torch.float32])
    torch.testing.assert_close(sin.double(), full.sin(), **TOL["rope_table"][torch.float32])
    assert torch.equal(cos[0], torch.ones(head_dim)) and torch.equal(sin[0], torch.zeros(head_dim))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("head_dim", [16, 24, 32])
@pytest.mark.parametrize("num_tokens", [1, 2, 17, 65])
def test_apply_rope_matches_complex_rotation(dtype, head_dim, num_tokens):
    """apply_rope_ref rotates pairs (i, i + D/2) by each token's own position, positions in any order."""
    theta = 10000.0
    cos, sin = rope_table(head_dim, 512, theta)
    x = _randn(num_tokens, 3, head_dim, seed=head_dim + num_tokens, dtype=dtype)
    positions = torch.randint(0, 512, (num_tokens,), generator=_gen(num_tokens))
    out = apply_rope_ref(x, positions, cos, sin)
    assert out.dtype == dtype and out.shape == x.shape
    torch.testing.assert_close(out.double(), _rope_reference(x, positions, theta), **TOL["rope"][dtype])


def test_rope_scores_depend_only_on_relative_position():
    """<rope(q, m), rope(k, n)> depends only on m - n: the defining property of rotary embeddings."""
    cos, sin = rope_table(32, 400, 10000.0)
    q, k = _randn(1, 1, 32, seed=5), _randn(1, 1, 32, seed=6)

    def score(m: int, n: int) -> float:
        qm = apply_rope_ref(q, torch.tensor([m]), cos, sin)
        kn = apply_rope_ref(k, torch.tensor([n]), cos, sin)
        return float((qm.double() * kn.double()).sum())

    base = score(7, 3)
    for shift in (1, 50, 300):
        assert score(7 + shift, 3 + shift) == pytest.approx(base, abs=2e-4)
    assert abs(score(7, 3) - score(3, 7)) > 1e-3  # and it does depend on the sign of the offset


# -- against the rotation per dimension pair, full and partial ---------------------------------


def _expected(x: torch.Tensor, positions: list[int], rotary: int, theta: float) -> torch.Tensor:
    out = x.double().clone()
    half = rotary // 2
    for t, position in enumerate(positions):
        for i in range(half):
            angle = position * theta ** (-2.0 * i / rotary)
            a, b = x[t, :, i].double(), x[t, :, i + half].double()
            out[t, :, i] = a * math.cos(angle) - b * math.sin(angle)
            out[t, :, i + half] = b * math.cos(angle) + a * math.sin(angle)
    return out


def test_rope_table_values():
    """cos/sin [P, R] fp32: entry (p, j) is the cos/sin of p * theta^(-2 (j mod R/2) / R)."""
    cos, sin = rope_table(8, 50, 10_000.0)
    assert cos.shape == sin.shape == (50, 8) and cos.dtype == sin.dtype == torch.float32
    angles = torch.tensor([[p * 10_000.0 ** (-2.0 * (j % 4) / 8) for j in range(8)] for p in range(50)],
                          dtype=torch.float64)
    torch.testing.assert_close(cos.double(), angles.cos(), atol=2e-5, rtol=0)
    torch.testing.assert_close(sin.double(), angles.sin(), atol=2e-5, rtol=0)


def test_rope_table_on_the_requested_device():
    cos, sin = rope_table(8, 50, 10_000.0, device="meta")
    assert cos.device.type == sin.device.type == "meta" and cos.shape == (50, 8)


@pytest.mark.parametrize("rotary", [16, 6])
def test_apply_rope_full_and_partial(rotary):
    """D = 16 with R = 16 (full) or R = 6 (partial, the table narrower than the head and much
    shorter than it is long); positions out of order and repeated."""
    gen = torch.Generator().manual_seed(rotary)
    x = torch.randn(5, 3, 16, generator=gen)
    positions = [7, 0, 31, 7, 2]
    cos, sin = rope_table(rotary, 40, 1_000_000.0)
    out = apply_rope_ref(x, torch.tensor(positions), cos, sin)
    assert out.shape == x.shape and out.dtype == x.dtype
    torch.testing.assert_close(out.double(), _expected(x, positions, rotary, 1_000_000.0), atol=1e-5, rtol=0)
    assert torch.equal(out[..., rotary:], x[..., rotary:])


def _rounded(value: mpmath.mpf) -> float:
    """`value` rounded to fp32 (through its correctly rounded double)."""
    return torch.tensor(float(value), dtype=torch.float64).float().item()


def test_rope_table_entries_are_the_correctly_rounded_cos_and_sin_of_transformers_angles():
    """Entry (p, j): cos/sin of the fp32 angle fp32(p) * fp32 inverse frequency (transformers'
    angle), correct to the last bit (an mpmath oracle at 40 digits): no vector library's rounding."""
    cos, sin = rope_table(32, 224, 1_000_000.0)
    inv_freq = 1.0 / (1_000_000.0 ** (torch.arange(0, 32, 2).float() / 32))
    angles = torch.arange(224, dtype=torch.float32)[:, None] * inv_freq[None, :]
    mpmath.mp.dps = 40
    for p in range(0, 224, 7):
        for j in range(16):
            a = mpmath.mpf(angles[p, j].item())
            assert cos[p, j].item() == cos[p, j + 16].item() == _rounded(mpmath.cos(a)), (p, j)
            assert sin[p, j].item() == sin[p, j + 16].item() == _rounded(mpmath.sin(a)), (p, j)


def test_rope_table_bits_do_not_depend_on_threads_process_or_length():
    """The same table on 1 and 2 threads, in a new interpreter, and as the first rows of a longer
    table. The table torch's `angles.cos()` built now and then had other bits (on this Intel Xeon:
    in one process on 2 threads against 1, in 2 of 16 spawned processes): a tensor-parallel worker
    then rotated keys past position ~100 differently from rank 0 (the TP property's 1-4 ulp
    counterexample). That old table fails the oracle test above on every run."""
    tables = []
    for threads in (1, 2):
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            tables.append(rope_table(128, 512, 1_000_000.0))
        finally:
            torch.set_num_threads(previous)
    longer = rope_table(128, 2048, 1_000_000.0)
    code = ("import hashlib, torch; from pocketllm.kernels.rope import rope_table; "
            "c, s = rope_table(128, 512, 1_000_000.0); "
            "print(hashlib.sha256(c.numpy().tobytes() + s.numpy().tobytes()).hexdigest())")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    ours = hashlib.sha256(tables[0][0].numpy().tobytes() + tables[0][1].numpy().tobytes()).hexdigest()
    assert all(torch.equal(a, b) for a, b in zip(tables[0], tables[1]))
    assert all(torch.equal(a, b[:512]) for a, b in zip(tables[0], longer))
    assert other.stdout.strip() == ours
