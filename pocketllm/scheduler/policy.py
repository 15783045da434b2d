"""PrefillPolicy: where prompts are cut into pieces, how many tokens a step may run, which prefix
of a prompt may be reused.

Every cut is a request-local position fixed by the prompt and these constants, never by the step's
token budget or by what else runs: a prompt runs the same pieces cold or warm, alone or batched,
so its arithmetic (and its bits) are the same. A reused prefix ends on a cut, so the rest of the
prompt runs exactly the pieces of a cold run.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

from ..kernels.grid import POSITION_GRID
from ..options import PREEMPTION_MODES, EngineOptions


@dataclass(frozen=True)
class PrefillPolicy:
    """`chunk_size`: a prompt is cut at multiples of it (0: not cut). `snapshot_interval`: cuts
    too, and the positions prefixes are reused from; hybrid models keep their recurrent states
    there (0: reuse at chunk boundaries; a hybrid model then reuses nothing). With both 0 nothing
    is reused (a warm prompt could not run the pieces of its cold run), unless exact positions make
    every cut exact (`reusable(..., any_position=True)`). `max_num_batched_tokens`:
    tokens one step runs, decode rows included. `fine_snapshot_until`: with exact positions, hybrid
    models also keep their states every POSITION_GRID positions up to it, inside pieces (`keeps`)."""

    # Defaults: the engine's options (their meaning and range are documented there).
    max_num_batched_tokens: int = EngineOptions.max_num_batched_tokens
    chunk_size: int = EngineOptions.prefill_chunk_size
    snapshot_interval: int = EngineOptions.state_snapshot_interval
    prefix_reuse: bool = EngineOptions.enable_prefix_reuse
    fine_snapshot_until: int = EngineOptions.fine_snapshot_until

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "chunk_size", "snapshot_interval", "fine_snapshot_until"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
        if not isinstance(self.prefix_reuse, bool):
            raise TypeError(f"prefix_reuse must be a bool, got {type(self.prefix_reuse).__name__}")
        for name in ("chunk_size", "snapshot_interval", "fine_snapshot_until"):
            value = getattr(self, name)
            if value < 0 or value % POSITION_GRID:
                raise ValueError(f"{name} must be 0 or a positive multiple of {POSITION_GRID}, got {value}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")

    def piece_end(self, done: int, prompt_len: int) -> int:
        """End of the piece that starts after `done` prefilled tokens: the next cut, or the prompt's end."""
        end = prompt_len
        for step in (self.chunk_size, self.snapshot_interval):
            if step:
                end = min(end, (done // step + 1) * step)
        return end

    def piece_len(self, done: int, prompt_len: int) -> int:
        """Tokens of the piece that starts after `done` prefilled tokens."""
        return self.piece_end(done, prompt_len) - done

    def max_piece(self, max_seq_len: int) -> int:
        """The longest piece a prompt of up to `max_seq_len` tokens can run."""
        steps = [s for s in (self.chunk_size, self.snapshot_interval) if s]
        return min(steps + [max_seq_len])

    def fine_position(self, position: int) -> bool:
        """Whether a hybrid model with exact positions keeps its states at `position` besides the
        snapshot grid: every POSITION_GRID positions up to `fine_snapshot_until`."""
        return 0 < position <= self.fine_snapshot_until and position % POSITION_GRID == 0

    def keeps(self, start: int, end: int) -> tuple[int, ...]:
        """The fine positions strictly inside the piece [start, end): where its recurrent ops stop
        to keep the states (the piece's end is kept after it, `SlotManager.prefilled`)."""
        first = (start // POSITION_GRID + 1) * POSITION_GRID
        return tuple(p for p in range(first, end, POSITION_GRID) if self.fine_position(p))

    def keeps_states_at(self, position: int, fine: bool) -> bool:
        """Whether a hybrid model's slot keeps its states where it holds `position` positions: the
        snapshot grid, and with `fine` (exact positions) the fine positions."""
        interval = self.snapshot_interval
        return bool(interval and position % interval == 0) or (fine and self.fine_position(position))

    def kept_positions(self, last: int, fine: bool) -> int:
        """How many positions up to `last` a hybrid model's slot keeps its states at."""
        return sum(self.keeps_states_at(p, fine) for p in range(POSITION_GRID, last + 1, POSITION_GRID))

    @property
    def reuse_grid(self) -> int:
        """Reused prefixes are multiples of this, always a cut: the snapshot interval, else the
        chunk size (0: no reuse)."""
        return self.snapshot_interval or self.chunk_size

    def reusable(self, shared: int, prompt_len: int, any_position: bool = False) -> int:
        """How much of a prompt may come from a slot that holds its first `shared` tokens: rounded
        down to the reuse grid (any length with `any_position`: where exact positions make every
        cut exact; a hybrid model's slot then resumes from its furthest kept state within it), and
        at least one token left to prefill (it yields the first logits)."""
        if not self.prefix_reuse or not (self.reuse_grid or any_position):
            return 0
        most = min(shared, prompt_len - 1)
        return most if any_position else most // self.reuse_grid * self.reuse_grid


def check_policy(policy: PrefillPolicy, max_batch_size: int, max_seq_len: int, keeps_states: bool,
                 cuts_at_budget: bool = False) -> None:
    """ValueError unless the scheduler can run on `policy`, wherever the policy was built (the
    engine's options or `configure()`): every step can decode every running request and run one
    whole piece, or with `cuts_at_budget` one prompt token (otherwise a prompt could wait for ever),
    and a model with recurrent states (`keeps_states`) reuses prefixes only where it keeps their
    states, the snapshot positions."""
    if cuts_at_budget:
        if policy.max_num_batched_tokens < max_batch_size:
            raise ValueError(f"max_num_batched_tokens must be >= {max_batch_size} (one decode token for each slot of "
                             f"max_batch_size={max_batch_size}, or a prompt token beside the others), got "
                             f"{policy.max_num_batched_tokens}")
    else:
        piece = policy.max_piece(max_seq_len)
        need = piece + max_batch_size - 1
        if policy.max_num_batched_tokens < need:
            raise ValueError(
                f"max_num_batched_tokens must be >= {need} (the longest prefill piece, {piece} tokens, plus one "
                f"decode token for each other slot of max_batch_size={max_batch_size}), got "
                f"{policy.max_num_batched_tokens}; raise it or lower prefill_chunk_size")
    if keeps_states and policy.prefix_reuse and policy.reuse_grid and not policy.snapshot_interval:
        raise ValueError("prefix_reuse on a model with recurrent states needs snapshot_interval > 0 (the positions "
                         "its states are kept at), got snapshot_interval=0; set prefix_reuse=False or an interval")


def check_preemption_mode(mode: object, exact_positions: bool) -> None:
    """ValueError unless `mode` is a preemption mode the engine can run exactly: recompute re-prefills
    generated tokens, which gives them the bits their decode steps gave only with exact positions."""
    if mode not in PREEMPTION_MODES:
        raise ValueError(f"preemption_mode must be one of {', '.join(map(repr, PREEMPTION_MODES))}, got {mode!r}")
    if mode == "recompute" and not exact_positions:
        raise ValueError("preemption_mode='recompute' needs exact positions (backend_options['exact_positions']=True "
                         "on a model where llm.capabilities.exact_positions holds): without them a re-prefilled token "
                         "rounds differently from its decode step; use preemption_mode='swap'")
