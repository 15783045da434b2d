"""Split invariance, bitwise, of every prefill op that claims it, reference and kernel alike.

A sequence that already holds tokens in its slot (start 64, 128, or off the grid) is prefilled in
one call, then again in pieces cut at absolute positions (192, ...), each piece continuing from
the state the previous one left and sharing its call with an unrelated sequence. The outputs and
the final slot state must be torch.equal.

- Gated DeltaNet prefill (`gated_delta_prefill_ref`, `gated_delta_prefill_triton`): chunks aligned
  to absolute positions, so cuts at multiples of CHUNK_SIZE. With a start that is itself off the
  grid, a chunk grid aligned to the piece start differs from the absolute one; the negative control
  shows this test catches such a grid (at start 0 the two coincide, which is why it is not used).
- Causal conv1d prefill (ref and kernel): any cut, pieces shorter than the conv window included.
- Prefill attention, kernel: any cut. The reference claims only batch invariance (its matmuls
  are shaped by the piece), not split invariance, so it is not tested here.
The Triton kernels run under the interpreter on tiny head sizes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_impls import DEVICE, implementation

from pocketllm.kernels._gated_delta import CHUNK_SIZE
from pocketllm.kernels.conv1d_prefill import conv1d_prefill_ref
from pocketllm.kernels.gated_delta_prefill import gated_delta_prefill_ref

gated_delta_prefill_impl = implementation("gated_delta_prefill")
conv1d_prefill_impl = implementation("conv1d_prefill")
prefill_attention_impl = implementation("prefill_attention")

SLOT, OTHER_SLOT, OTHER_LEN = 1, 2, 5


def _long(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=DEVICE)


def _split_run(call, inputs: tuple[torch.Tensor, ...], state: torch.Tensor, start: int, cuts: list[int]):
    """(whole output, whole state, pieces output, pieces state): `call(inputs, state, slots, starts,
    lengths)` once for positions start.. and once per piece between the absolute `cuts`, each piece
    after an unrelated sequence of OTHER_LEN tokens (the last OTHER_LEN rows of `inputs`)."""
    length = inputs[0].shape[0] - OTHER_LEN
    prompt = tuple(x[:length] for x in inputs)
    other = tuple(x[length:] for x in inputs)
    whole_state = state.clone()
    whole = call(prompt, whole_state, [SLOT], [start], [length])
    bounds = [start] + [c for c in cuts if start < c < start + length] + [start + length]
    assert len(bounds) > 2, "no cut inside the prompt"
    piece_state = state.clone()
    pieces = []
    for lo, hi in zip(bounds, bounds[1:]):
        batch = tuple(torch.cat([a, b[lo - start:hi - start]]) for a, b in zip(other, prompt))
        out = call(batch, piece_state, [OTHER_SLOT, SLOT], [7, lo], [OTHER_LEN, hi - lo])
        pieces.append(out[OTHER_LEN:])
    return whole, whole_state[SLOT], torch.cat(pieces), piece_state[SLOT]


def _assert_split_invariant(result) -> None:
    whole, whole_state, pieces, piece_state = result
    assert torch.equal(pieces, whole)
    assert torch.equal(piece_state, whole_state)


# -- Gated DeltaNet ------------------------------------------------------------------------------------

GDN_SPLITS = [  # (start: tokens already in the slot, new tokens, absolute cuts)
    (64, 150, [192]),
    (128, 100, [192]),
    (10, 200, [64, 128, 192]),
    (100, 130, [128, 192]),
]


def _gdn_inputs(tokens: int, seed: int):
    """q/k [T, 1, 16], v [T, 2, 8] (two value heads per key head), g log-decays, beta; a nonzero
    initial state for 3 slots, as if the slot held earlier tokens."""
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(tokens, 1, 16, generator=gen), torch.randn(tokens, 1, 16, generator=gen)
    v = torch.randn(tokens, 2, 8, generator=gen)
    g = F.logsigmoid(2.0 + 2.0 * torch.randn(tokens, 2, generator=gen))
    beta = torch.sigmoid(torch.randn(tokens, 2, generator=gen))
    state = 0.3 * torch.randn(3, 2, 16, 8, generator=gen)
    return tuple(x.to(DEVICE) for x in (q, k, v, g, beta)), state.to(DEVICE)


def _gdn_call(fn):
    def call(inputs, state, slots, starts, lengths):
        cu = torch.cumsum(_long([0] + lengths), 0)
        return fn(*inputs, state, _long(slots), _long(starts), cu)
    return call


def _misaligned_ref(q, k, v, g, beta, states, slot_ids, start_positions, cu_seqlens):
    """The reference with its chunk grid aligned to each piece's first token instead of to
    absolute positions (it uses the start only for the grid): the bug the tests must catch."""
    return gated_delta_prefill_ref(q, k, v, g, beta, states, slot_ids, torch.zeros_like(start_positions), cu_seqlens)


GDN_CASES = [(gated_delta_prefill_ref, split) for split in GDN_SPLITS] + [  # the interpreter is slow: two
    (gated_delta_prefill_impl, split) for split in (GDN_SPLITS[0], GDN_SPLITS[3])]


@pytest.mark.parametrize("fn,split", GDN_CASES, ids=[f"{fn.__name__.split('_')[-1]}-{split[0]}" for fn, split in GDN_CASES])
def test_gated_delta_prefill_split_invariance(fn, split):
    """Cuts at absolute chunk boundaries after a non-zero start: bitwise one-piece outputs and state."""
    start, length, cuts = split
    inputs, state = _gdn_inputs(length + OTHER_LEN, seed=start + length)
    _assert_split_invariant(_split_run(_gdn_call(fn), inputs, state, start, cuts))


@pytest.mark.parametrize("start,length,cuts", [(10, 200, [64, 128, 192]), (100, 130, [128, 192])])
def test_gated_delta_negative_control_piece_aligned_grid_is_caught(start, length, cuts):
    """A chunk grid aligned to the piece start changes the results of a split off-grid prompt."""
    inputs, state = _gdn_inputs(length + OTHER_LEN, seed=start + length)
    whole, whole_state, pieces, piece_state = _split_run(_gdn_call(_misaligned_ref), inputs, state, start, cuts)
    assert not (torch.equal(pieces, whole) and torch.equal(piece_state, whole_state))


def test_gated_delta_chunk_size_is_the_grid_of_the_cuts():
    """The cuts above are chunk boundaries: the claim covers exactly these."""
    assert CHUNK_SIZE == 64
    assert all(c % CHUNK_SIZE == 0 for _, _, cuts in GDN_SPLITS for c in cuts)


# -- causal conv1d ------------------------------------------------------------------------------------------

CONV_SPLITS = [  # (start, new tokens, absolute cuts): the conv has no grid, so any cut
    (64, 140, [192]),
    (128, 80, [129, 130, 192]),  # pieces of one token, shorter than the window
    (10, 190, [64, 65, 128, 192]),
]


def _conv_call(fn):
    def call(inputs, state, slots, starts, lengths):
        (x,) = inputs
        weight = (torch.linspace(-1.0, 1.0, 8 * 4).reshape(8, 4) + 0.1).to(DEVICE)
        return fn(x, weight, state, _long(slots), torch.cumsum(_long([0] + lengths), 0))
    return call


@pytest.mark.parametrize("fn", [conv1d_prefill_ref, conv1d_prefill_impl], ids=["ref", "triton"])
@pytest.mark.parametrize("start,length,cuts", CONV_SPLITS)
def test_conv1d_prefill_split_invariance(fn, start, length, cuts):
    """Any cut after a slot that already holds a window of inputs: bitwise outputs and state."""
    gen = torch.Generator().manual_seed(start)
    x = torch.randn(length + OTHER_LEN, 8, generator=gen).to(DEVICE)
    state = torch.randn(3, 8, 3, generator=gen).to(DEVICE)  # K - 1 = 3 remembered inputs per slot
    _assert_split_invariant(_split_run(_conv_call(fn), (x,), state, start, cuts))


# -- prefill attention (kernel) -----------------------------------------------------------------------------------

ATTENTION_SPLITS = [  # (start, new tokens, absolute cuts)
    (64, 150, [192]),
    (128, 100, [192]),
    (37, 90, [64, 65]),
]


@pytest.mark.parametrize("start,length,cuts", ATTENTION_SPLITS)
def test_prefill_attention_kernel_split_invariance(start, length, cuts):
    """K/V of every position are in the slot (written before attention reads them); the queries of
    positions start.. in one call equal, bitwise, the same queries in pieces."""
    gen = torch.Generator().manual_seed(start + length)
    max_len = start + length + 8
    k_cache, v_cache = torch.randn(3, max_len, 1, 16, generator=gen), torch.randn(3, max_len, 1, 16, generator=gen)
    k_cache, v_cache = k_cache.to(DEVICE), v_cache.to(DEVICE)
    q = torch.randn(length + OTHER_LEN, 2, 16, generator=gen).to(DEVICE)

    def call(inputs, _state, slots, starts, lengths):
        (queries,) = inputs
        return prefill_attention_impl(queries, k_cache, v_cache, _long(slots), _long(starts),
                                      torch.cumsum(_long([0] + lengths), 0), 0.25)

    whole, _, pieces, _ = _split_run(call, (q,), torch.zeros(3, 1), start, cuts)
    assert torch.equal(pieces, whole)
