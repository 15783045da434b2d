"""How outputs are compared: within the tolerance of ONE table, or bit for bit."""

from __future__ import annotations

import torch

# Implementation-vs-reference tolerances, per dtype of the case (atol, rtol). Integer outputs
# (sampled tokens) must be equal.
TOLERANCES: dict[torch.dtype, dict[str, float]] = {
    torch.float32: dict(atol=1e-4, rtol=1e-4),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
}


def close_error(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> str | None:
    """None when `actual` is within TOLERANCES[dtype] of `expected` everywhere (NaN where the
    expected is NaN); else what differs and by how much."""
    if actual.shape != expected.shape:
        return f"shape {list(actual.shape)} != {list(expected.shape)}"
    if not expected.is_floating_point():
        if torch.equal(actual.to(expected.device), expected):
            return None
        bad = (actual.to(expected.device) != expected).nonzero()
        return f"{len(bad)} of {expected.numel()} values differ (first at {bad[0].tolist()})"
    tol = TOLERANCES[dtype]
    a, e = actual.detach().float().cpu(), expected.detach().float().cpu()
    nan_a, nan_e = a.isnan(), e.isnan()
    if not torch.equal(nan_a, nan_e):
        where = (nan_a != nan_e).nonzero()[0].tolist()
        return f"NaN pattern differs ({int((nan_a != nan_e).sum())} values, first at {where})"
    diff = (a - e).abs().masked_fill(nan_e, 0.0)
    limit = tol["atol"] + tol["rtol"] * e.abs().masked_fill(nan_e, 0.0)
    if bool((diff <= limit).all()):
        return None
    worst = int((diff - limit).argmax())
    index = list(torch.unravel_index(torch.tensor(worst), diff.shape)) if diff.dim() else []
    return (f"max |diff| {float(diff.max()):.3g} (atol {tol['atol']:g}, rtol {tol['rtol']:g}); "
            f"{int((diff > limit).sum())} of {diff.numel()} values out of tolerance, worst at "
            f"{[int(i) for i in index]}: {float(a.flatten()[worst]):.6g} vs {float(e.flatten()[worst]):.6g}")


def bits_error(actual: torch.Tensor, expected: torch.Tensor) -> str | None:
    """None when the two tensors hold the same bits (NaN included); else how many values differ, the
    first one's index and both values with their bit patterns."""
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        return f"{actual.dtype}{list(actual.shape)} != {expected.dtype}{list(expected.shape)}"
    a, e = actual.detach().contiguous().cpu(), expected.detach().contiguous().cpu()
    if a.numel() == 0:
        return None
    width = a.element_size()
    differ = (a.reshape(-1).view(torch.uint8).view(-1, width) != e.reshape(-1).view(torch.uint8).view(-1, width)).any(1)
    if not bool(differ.any()):
        return None
    flat = int(differ.nonzero()[0])
    index = [int(i) for i in torch.unravel_index(torch.tensor(flat), a.shape)]
    return (f"{int(differ.sum())} of {a.numel()} values differ in their bits; the first at {index}: "
            f"{a.reshape(-1)[flat].item()!r} ({_bits(a, flat)}) vs {e.reshape(-1)[flat].item()!r} ({_bits(e, flat)})")


def _bits(t: torch.Tensor, flat: int) -> str:
    """Element `flat` of a contiguous tensor as its bit pattern in hex (little-endian bytes reversed)."""
    return "0x" + bytes(t.reshape(-1)[flat:flat + 1].view(torch.uint8).flip(0).tolist()).hex()
