"""The C++ attention (`own_order` of prefill_attention and decode_attention, `kernels/cpu/attention.cpp`):
the torch backend's attention with exact positions.

- against the reference (`prefill_attention_ref`) within tolerance, GQA 1/2/4, head dims off the
  16-lane grid;
- bitwise: every prefill row equals the same row decoded, a piece cut anywhere equals one piece,
  sequences alone equal them batched (rows of other slots and pieces next to them), 1 and 2 threads;
- the fallback (fp16 here, or no compiler) keeps the same pairing: prefill rows one at a time as the
  fused decode computes them.
"""

from __future__ import annotations

import pytest
import torch
from kernel_tolerances import assert_close

from pocketllm.kernels.cpu.extension import load_extension
from pocketllm.kernels.decode_attention import decode_attention_own_order
from pocketllm.kernels.prefill_attention import prefill_attention_own_order, prefill_attention_ref

pytestmark = pytest.mark.skipif(load_extension() is None, reason="pocketllm's C++ CPU kernels cannot be built here")
LAYOUTS = [(4, 4, 16), (4, 2, 24), (8, 2, 40)]  # query heads, K/V heads, head dim


def _long(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def _cache(layout, slots: int = 3, length: int = 96, dtype=torch.float32, seed: int = 0):
    heads, kv_heads, dim = layout
    gen = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(slots, length, kv_heads, dim, generator=gen).to(dtype) for _ in range(2))
    return k, v, (dim ** -0.5)


def _prefill(q, k, v, scale, slots, starts, lengths, fn=prefill_attention_own_order):
    cu = torch.cumsum(_long([0] + lengths), 0)
    return fn(q, k, v, _long(slots), _long(starts), cu, scale)


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_own_order_matches_the_reference(layout):
    k, v, scale = _cache(layout)
    q = torch.randn(30, layout[0], layout[2])
    args = (q, k, v, scale, [2, 0], [5, 60], [19, 11])
    assert_close(_prefill(*args), _prefill(*args, fn=prefill_attention_ref))


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_prefill_rows_are_decode_rows_and_cuts_do_not_matter(layout):
    k, v, scale = _cache(layout, seed=1)
    q = torch.randn(70, layout[0], layout[2])
    whole = _prefill(q, k, v, scale, [1], [3], [70])
    decoded = torch.cat([decode_attention_own_order(q[i:i + 1], k, v, _long([1]), _long([3 + i + 1]), scale)
                         for i in range(70)])
    assert torch.equal(decoded, whole)
    cuts = [0, 1, 8, 9, 17, 40, 70]  # across the kernel's 8-row blocks
    pieces = torch.cat([_prefill(q[lo:hi], k, v, scale, [1], [3 + lo], [hi - lo]) for lo, hi in zip(cuts, cuts[1:])])
    assert torch.equal(pieces, whole)


def test_own_order_is_batch_and_thread_invariant(single_torch_thread):
    layout = LAYOUTS[2]
    k, v, scale = _cache(layout, seed=2)
    lengths, slots, starts = [9, 1, 30], [2, 0, 2], [0, 50, 40]
    q = torch.randn(sum(lengths), layout[0], layout[2])
    batched = {}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        batched[threads] = _prefill(q, k, v, scale, slots, starts, lengths)
    assert torch.equal(batched[1], batched[2])
    lo = 0
    for slot, start, n in zip(slots, starts, lengths):
        assert torch.equal(_prefill(q[lo:lo + n], k, v, scale, [slot], [start], [n]), batched[2][lo:lo + n])
        lo += n


def test_rows_of_other_slots_at_the_next_positions_keep_their_own_keys(single_torch_thread):
    """The kernel groups consecutive rows of one slot into blocks that read each key once; rows of
    different slots whose positions follow each other (decode rows, a piece followed by another
    slot's piece) must not join a block: each row's bits are the row computed alone."""
    attention_rows = load_extension().attention_rows
    layout = LAYOUTS[1]
    k, v, scale = _cache(layout, slots=4, seed=4)
    slots = [0, 1, 2, 1, 3, 3, 3, 0, 2]
    positions = [5, 6, 7, 8, 9, 10, 11, 12, 13]  # each row at its predecessor's position + 1
    q = torch.randn(len(slots), layout[0], layout[2])
    together = attention_rows(q, k, v, _long(slots), _long(positions), scale)
    for i, (slot, position) in enumerate(zip(slots, positions)):
        alone = attention_rows(q[i:i + 1].contiguous(), k, v, _long([slot]), _long([position]), scale)
        assert torch.equal(together[i:i + 1], alone), (i, slot, position)


def test_the_fallback_pairs_prefill_rows_with_decode_rows():
    """fp16 is not the kernel's: both ops fall back, prefill row by row as the fused decode."""
    layout = LAYOUTS[1]
    k, v, scale = _cache(layout, dtype=torch.float16, seed=3)
    q = torch.randn(12, layout[0], layout[2]).half()
    whole = _prefill(q, k, v, scale, [0], [4], [12])
    decoded = torch.cat([decode_attention_own_order(q[i:i + 1], k, v, _long([0]), _long([4 + i + 1]), scale)
                         for i in range(12)])
    assert torch.equal(decoded, whole)
