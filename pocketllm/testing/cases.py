"""The case grid of every op, and how a call of an op splits into its members.

A call of any op is a batch of *members* (a row, a decoded token, or a prompt sequence), each with
its own per-token inputs (`tokens`: tensors of `n` rows), its own slot contents (a KV cache
region, a conv or recurrent state) and a start position, plus inputs every member shares
(weights, rope tables, eps). `pack` lays members out exactly as the engine does (tokens
concatenated, each member in its own slot, cu_seqlens / slot_ids / positions derived) and names
every argument after the op's signature, so any implementation is called as the model calls it.
`unpack` gives each member's outputs back (its rows of the result and its slots afterwards),
which is what the lab compares: against the reference, alone against in a batch, and in one
piece against two pieces cut at an aligned position. Each op's grid (`spec.Layout`) is declared
in its module, beside its implementations.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..kernels.grid import POSITION_GRID
from ..kernels.registry import SPECS, parameters


@dataclass
class Member:
    """One row / token / sequence of a call: n tokens at positions start .. start + n - 1."""

    start: int
    tokens: dict[str, torch.Tensor]
    slots: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def n(self) -> int:
        return next(iter(self.tokens.values())).shape[0]


@dataclass(frozen=True)
class Case:
    """One point of an op's grid: shared inputs and members, and the label a report shows."""

    op: str
    label: str
    dtype: torch.dtype
    shared: dict[str, Any]
    members: list[Member]
    splittable: bool = False  # a prefill op whose sequences may be cut at aligned positions


def op_cases(op: str, dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.float16), seed: int = 0) -> list[Case]:
    """The grid of `op` (its declaration's `cases`): each dims × member layout × dtype, members made
    from their own seeds."""
    layout = SPECS[op].cases
    cases = []
    for index, (dims, specs) in enumerate(layout.grid):
        for dtype in dtypes:
            gen = torch.Generator().manual_seed(seed * 1000 + index)
            members = [Member(start, layout.tokens(gen, n, dims, dtype),
                              layout.slots(gen, start, n, dims, dtype) if layout.slots else {})
                       for n, start in specs]
            label = " ".join(f"{k}={v}" for k, v in dims.items()) + f" members={[n for n, _ in specs]}" + \
                f" starts={[s for _, s in specs]} {str(dtype).removeprefix('torch.')}"
            cases.append(Case(op, label, dtype, layout.shared(gen, dims, dtype), members, layout.splittable))
    return cases


@dataclass
class Packed:
    """A call's arguments, by the op's parameter names, and where each member's outputs are."""

    args: dict[str, Any]
    token_ranges: list[tuple[int, int]]
    member_slots: list[int]
    slot_names: list[str]


def pack(case: Case, members: list[Member], slot_order: list[int], device: torch.device | str) -> Packed:
    """Members laid out as the engine lays out a batch; member i lives in slot slot_order[i]
    (slots not used by any member hold zeros). No members: an empty batch of the case's shapes."""
    template = members[0] if members else case.members[0]
    bounds = [0]
    for m in members:
        bounds.append(bounds[-1] + m.n)
    args: dict[str, Any] = {}
    for name, like in template.tokens.items():
        args[name] = torch.cat([like[:0]] + [m.tokens[name] for m in members]).to(device)
    num_slots = max(slot_order, default=0) + 1
    for name, content in template.slots.items():
        cache = torch.zeros(num_slots, *content.shape, dtype=content.dtype)
        for m, slot in zip(members, slot_order):
            cache[slot] = m.slots[name]
        args[name] = cache.to(device)

    def column(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    args["slot_ids"] = column(slot_order[:len(members)])
    args["start_positions"] = column([m.start for m in members])
    args["seq_lens"] = column([m.start + m.n for m in members])
    args["cu_seqlens"] = column(bounds)
    args["positions"] = column([m.start + i for m in members for i in range(m.n)])
    args["token_slots"] = column([slot for m, slot in zip(members, slot_order) for _ in range(m.n)])
    for name, value in case.shared.items():
        args[name] = value.to(device) if isinstance(value, torch.Tensor) else value
    return Packed(args, list(zip(bounds, bounds[1:])), slot_order[:len(members)], list(template.slots))


def call(op: str, impl: Callable[..., Any], packed: Packed) -> Any:
    """impl(...) with the arguments in the op's signature order, as the model passes them."""
    return impl(*(packed.args[p.name] for p in parameters(op) if p.name in packed.args))


def results(result: Any) -> list[Any]:
    """What an op returned, as a list: ops return one tensor, or a tuple (the sampler)."""
    return list(result) if isinstance(result, tuple) else [result]


def unpack(result: Any, packed: Packed) -> list[dict[str, torch.Tensor]]:
    """Each member's outputs: its rows of every returned tensor, and its slots after the call."""
    returned = results(result)
    outputs = []
    for (lo, hi), slot in zip(packed.token_ranges, packed.member_slots):
        out = {f"out{i}" if len(returned) > 1 else "out": r[lo:hi] for i, r in enumerate(returned)}
        out.update({name: packed.args[name][slot] for name in packed.slot_names})
        outputs.append(out)
    return outputs


def run_members(case: Case, impl: Callable[..., Any], members: list[Member], slot_order: list[int],
                device: torch.device | str) -> list[dict[str, torch.Tensor]]:
    """Call `impl` on `members` (member i in slot slot_order[i]); each member's outputs."""
    packed = pack(case, members, slot_order, device)
    return unpack(call(case.op, impl, packed), packed)


def run(case: Case, impl: Callable[..., Any], order: list[int] | None = None, slot_order: list[int] | None = None,
        device: torch.device | str = "cpu") -> list[dict[str, torch.Tensor]]:
    """Call `impl` on the case's members (all, or those in `order`, in that order), each in the
    slot slot_order gives it (default: reversed, so slot 0 is never the first member's)."""
    order = list(range(len(case.members))) if order is None else order
    slot_order = list(range(len(order)))[::-1] if slot_order is None else slot_order
    return run_members(case, impl, [case.members[i] for i in order], slot_order, device)


def split_member(member: Member) -> tuple[Member, Member] | None:
    """The member cut at its first absolute multiple of POSITION_GRID strictly inside it (None if none):
    the second piece starts where the first ends; its slots are filled in from the first's run."""
    cut = (member.start // POSITION_GRID + 1) * POSITION_GRID - member.start
    if cut >= member.n:
        return None
    first = Member(member.start, {k: v[:cut] for k, v in member.tokens.items()}, member.slots)
    second = Member(member.start + cut, {k: v[cut:] for k, v in member.tokens.items()}, {})
    return first, second
