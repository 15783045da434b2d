"""Slot timeline: which slot prefilled or decoded which request at each step, and when.

The picture that explains a scheduler. Recorded when `backend_options={"record_timeline": True}`;
`plot_timeline` draws it (matplotlib, an optional dependency, imported only when plotting).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from ..runner import SequenceInput
    from .request import Request

Phase = Literal["prefill", "decode"]


@dataclass(frozen=True)
class SlotEvent:
    step: int
    phase: Phase
    slot: int
    request_id: int
    num_tokens: int  # tokens this request fed through the forward
    start_s: float  # seconds since the scheduler started
    end_s: float


@dataclass(frozen=True)
class Span:
    """One forward a request took part in, what it fed and when: a `SlotEvent` to be."""

    request: Request
    seq: SequenceInput
    start: float
    end: float

    def event(self, step: int, started: float) -> SlotEvent:
        """The timeline's record of it, in seconds since `started`."""
        decodes = self.seq.decode or bool(self.seq.drafts)  # a verify piece decodes
        return SlotEvent(step, "decode" if decodes else "prefill", self.seq.slot, self.request.request_id,
                         len(self.seq.token_ids), self.start - started, self.end - started)


def plot_timeline(events: list[SlotEvent], path: str | Path | None = None, title: str = "slot timeline"):
    """One row per slot, one bar per forward a request took part in (prefill dark, decode light),
    labelled by request id at its prefill. Returns the matplotlib figure; saves it when `path` is given."""
    import matplotlib.pyplot as plt  # the process's backend as it is: a notebook keeps its own

    slots = sorted({e.slot for e in events})
    fig, ax = plt.subplots(figsize=(10, 0.5 + 0.45 * max(len(slots), 1)))
    palette = plt.get_cmap("tab20")
    for e in events:
        color = palette(e.request_id % 20)
        ax.barh(e.slot, e.end_s - e.start_s, left=e.start_s, color=color,
                alpha=1.0 if e.phase == "prefill" else 0.45, edgecolor="black" if e.phase == "prefill" else "none",
                linewidth=0.5)
        if e.phase == "prefill":
            ax.text(e.start_s, e.slot, str(e.request_id), va="center", ha="left", fontsize=7)
    ax.set_yticks(slots)
    ax.set_yticklabels([f"slot {s}" for s in slots])
    ax.invert_yaxis()
    ax.set_xlabel("seconds (dark: prefill, light: decode; numbers: request ids)")
    ax.set_title(title)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=120)
    return fig
