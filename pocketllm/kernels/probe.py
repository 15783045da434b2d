"""Start-up check that an op table's row-wise ops are batch invariant on this machine.

The torch backend's invariance rests on one assumption about the BLAS and the CPU kernels under
it: with the call shapes fixed (see `linear.py`), a row's result depends only on that row, not on
where it sits in the batch. That held on the CPUs it was measured on; this probe re-checks it
where the engine runs, on the model's own weight matrices and widths (measured on 2 cores: about
20-80 ms for the tiny preset, 0.1-1 s for the 40M-parameter presets).

Each check computes a batch of rows, then the first row alone and the batch rolled so that every
row moves to another position (and, for the linear layers, another tile), and compares bit for bit.
With exact positions on a Gated DeltaNet model, the probe also cuts a sequence into pieces (one-token
ones too) and compares: exact replay assumes that a chunk's row depends only on the rows before it at
the fixed chunk shape (the batched matmuls and triangular solves under the chunked reference).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ._gated_delta import CHUNK_SIZE, replay_width
from .linear import ALIGN_BYTES, ALIGNMENT_FREE
from .pointwise import elementwise_invariant

# Rows per probe batch: several row tiles (4 rows at decode, 64 at prefill) with a ragged last one;
# the roll moves each row to another position inside its tile.
PROBE_ROWS = 35
PROBE_PREFILL_ROWS = 135
ROLL = 7
# Sampling sorts whole vocabulary rows: fewer rows keep the probe cheap at 150k-entry vocabularies.
PROBE_SAMPLE_ROWS = 9


# Exact replay's probe: a sequence past one chunk boundary, cut after its first token, before and
# after a one-token piece (a decode step), and inside the second chunk.
PROBE_REPLAY_TOKENS = CHUNK_SIZE + 6
PROBE_REPLAY_CUTS = (1, 40, 41, CHUNK_SIZE + 2)


@dataclass(frozen=True)
class GatedDeltaProbe:
    """A Gated DeltaNet layer's prefill op and head layout, and whether the op runs with replay
    buffers, for the cut check."""

    op: Callable[..., torch.Tensor]
    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    replay: bool = True


@dataclass(frozen=True)
class ProbeReport:
    """What the probe compared and what differed; `ok` is True when nothing did."""

    ok: bool
    checks: tuple[str, ...]
    failures: tuple[str, ...]
    threads: int
    seconds: float

    def summary(self) -> str:
        verdict = "batch invariant" if self.ok else "NOT batch invariant"
        text = (f"{verdict} on this machine: {len(self.checks)} row checks ({', '.join(self.checks)}) "
                f"at {self.threads} threads in {self.seconds * 1e3:.0f} ms")
        return text if self.ok else text + "; failed: " + "; ".join(self.failures)


def _rows_alike(name: str, fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> list[str]:
    """fn applied to x, to x's first row alone and to x rolled: every row must keep its bits."""
    full = fn(x)
    failures = []
    if not torch.equal(fn(x[:1]), full[:1]):
        failures.append(f"{name}: a row alone differs from the same row in a batch of {x.shape[0]}")
    if not torch.equal(fn(x.roll(ROLL, 0)), full.roll(ROLL, 0)):
        failures.append(f"{name}: rows change when moved to other positions of a batch of {x.shape[0]}")
    return failures


def _columns_alike(name: str, fn: Callable, weight: torch.Tensor, x: torch.Tensor) -> list[str]:
    """A block of W's output features computed alone (a tensor-parallel rank's share) must give the
    columns the whole product gives."""
    half = weight.shape[0] // 2
    if half and not torch.equal(fn(x, weight[:half].contiguous()), fn(x, weight)[:, :half]):
        return [f"{name}: a block of {half} output columns differs from the same columns of all {weight.shape[0]}"]
    return []


def _distinct_shapes(weights: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The first weight of each shape: the BLAS path depends on the shape, not the values."""
    first: dict[tuple[int, ...], torch.Tensor] = {}
    for w in weights:
        first.setdefault(tuple(w.shape), w)
    return list(first.values())


def _misaligned(name: str, weights: Sequence[torch.Tensor], shape: torch.Size) -> list[str]:
    """Every weight of this shape must start on a 64-byte boundary: BLAS kernels may treat
    differently aligned copies of the same matrix differently, and two engines on one checkpoint
    (serial and batched) must compute alike."""
    if any(w.data_ptr() % ALIGN_BYTES for w in weights if w.shape == shape):
        return [f"{name}: a weight does not start on a {ALIGN_BYTES}-byte boundary"]
    return []


def _apply_linear(linear: Callable, weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return linear(x, weight)


def _sampler_rows_alike(sample: Callable, vocab_size: int, generator: torch.Generator,
                        device: torch.device) -> list[str]:
    """The sampler's tokens and logprobs per row, alone and rolled, greedy and sampled rows mixed."""
    rows = PROBE_SAMPLE_ROWS
    logits = (torch.randn(rows, vocab_size, generator=generator) * 4).to(device)
    columns = [torch.tensor(v, device=device) for v in (
        [0.0, 0.7, 1.0, 1.3, 0.0, 0.9, 1.0, 0.5, 2.0],  # temperature
        [0, 0, 40, 0, 5, 0, 100, 1, 0],  # top_k
        [1.0, 0.9, 1.0, 0.5, 1.0, 0.95, 0.8, 1.0, 1.0],  # top_p
        [11, 12, 13, 14, 15, 16, 17, 18, 19],  # seeds
        [3, 30, 300, 3000, 5, 50, 500, 5000, 1],  # positions
    )]

    def run(order: torch.Tensor) -> torch.Tensor:
        tokens, logprobs = sample(logits[order], *(c[order] for c in columns))
        return torch.stack([tokens.double(), logprobs.double()], dim=1)

    return _rows_alike("sample", run, torch.arange(rows, device=device))


def _prefill_rows_are_decode_rows(name: str, linear: Callable, prefill_linear: Callable, weight: torch.Tensor,
                                  x: torch.Tensor) -> list[str]:
    """Exact positions: a row prefilled has the bits of the same row decoded."""
    if torch.equal(prefill_linear(x, weight), linear(x, weight)):
        return []
    return [f"{name}: prefill rows differ from the same rows decoded"]


def _replay_cut_invariant(probe: GatedDeltaProbe, generator: torch.Generator, device: torch.device,
                          dtype: torch.dtype) -> list[str]:
    """A sequence's outputs in pieces are bitwise its outputs in one piece (with replay buffers
    where the op keeps them)."""
    n, hk, hv, dk, dv = PROBE_REPLAY_TOKENS, probe.key_heads, probe.value_heads, probe.key_dim, probe.value_dim
    q, k, v = (torch.randn(n, heads, dim, generator=generator).to(device=device, dtype=dtype)
               for heads, dim in ((hk, dk), (hk, dk), (hv, dv)))
    g = (-0.5 * torch.rand(n, hv, generator=generator)).to(device)
    beta = torch.rand(n, hv, generator=generator).to(device)

    def run(bounds: Sequence[int]) -> torch.Tensor:
        states = torch.zeros(1, hv, dk, dv, device=device)
        replay = torch.zeros(1, CHUNK_SIZE, replay_width(hk, dk, hv, dv), device=device) if probe.replay else None
        index = functools.partial(torch.tensor, dtype=torch.int64, device=device)
        return torch.cat([probe.op(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], states, index([0]),
                                   index([lo]), index([0, hi - lo]), replay) for lo, hi in zip(bounds, bounds[1:])])

    if torch.equal(run([0, n]), run([0, *PROBE_REPLAY_CUTS, n])):
        return []
    return ["gated_delta_prefill: a sequence cut into pieces differs from the same sequence in one piece"]


def probe_row_invariance(linear: Callable, prefill_linear: Callable, rms_norm: Callable, silu_and_mul: Callable,
                         sample: Callable, body_weights: Sequence[torch.Tensor], lm_head: torch.Tensor,
                         hidden_size: int, vocab_size: int, dtype: torch.dtype, seed: int = 0,
                         exact_positions: bool = False, gated_delta: GatedDeltaProbe | None = None,
                         columns: bool = False) -> ProbeReport:
    """Check the row-wise ops on the model's own weights and widths: `linear` on every distinct
    shape (decode rows and the lm_head), `prefill_linear` on the body's (prefill token rows), and
    with `exact_positions` that the two give a row the same bits, and that `gated_delta`'s exact
    replay is cut invariant; with `columns` (tensor parallelism) that a block of output columns
    computed alone keeps its bits; the inputs are random rows of `dtype` (the weights may be kept
    narrower), drawn from `seed`."""
    started = time.perf_counter()
    generator = torch.Generator().manual_seed(seed)
    device = lm_head.device

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)

    checks: list[str] = []
    failures: list[str] = []
    with torch.inference_mode():
        for name, fn, weights, rows in (("linear", linear, [*body_weights, lm_head], PROBE_ROWS),
                                        ("prefill_linear", prefill_linear, body_weights, PROBE_PREFILL_ROWS)):
            for w in _distinct_shapes(weights):
                n, k = w.shape
                checks.append(f"{name} {k}->{n}")
                if fn not in ALIGNMENT_FREE:
                    failures += _misaligned(checks[-1], weights, w.shape)
                x = randn(rows, k)
                failures += _rows_alike(checks[-1], functools.partial(_apply_linear, fn, w), x)
                if exact_positions and fn is prefill_linear:
                    failures += _prefill_rows_are_decode_rows(checks[-1], linear, prefill_linear, w, x)
                if columns:
                    failures += _columns_alike(checks[-1], fn, w, x)
        norm_weight = randn(hidden_size)
        checks.append(f"rms_norm {hidden_size}")
        failures += _rows_alike(checks[-1], lambda x: rms_norm(x, norm_weight, 1e-6), randn(PROBE_ROWS, hidden_size))
        checks.append("silu_and_mul")
        failures += _rows_alike(checks[-1], silu_and_mul, randn(PROBE_ROWS, 2 * hidden_size))
        for fn in (torch.sigmoid, torch.nn.functional.softplus):
            checks.append(fn.__name__)
            failures += _rows_alike(checks[-1], functools.partial(elementwise_invariant, fn),
                                    randn(PROBE_ROWS, hidden_size).float())
        checks.append(f"sample {vocab_size}")
        failures += _sampler_rows_alike(sample, vocab_size, generator, device)
        if exact_positions and gated_delta is not None:
            checks.append("gated_delta_prefill cuts")
            failures += _replay_cut_invariant(gated_delta, generator, device, dtype)
    return ProbeReport(not failures, tuple(checks), tuple(failures), torch.get_num_threads(),
                       time.perf_counter() - started)
