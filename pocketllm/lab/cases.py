"""The case grid of every op, and how a call of an op splits into its members.

A call of any op is a batch of *members* (a row, a decoded token, or a prompt sequence), each with
its own per-token inputs (`tokens`: tensors of `n` rows), its own slot contents (a KV cache
region, a conv or recurrent state) and a start position, plus inputs every member shares
(weights, rope tables, eps). `pack` lays members out exactly as the engine does (tokens
concatenated, each member in its own slot, cu_seqlens / slot_ids / positions derived) and names
every argument after the op's signature, so any implementation is called as the model calls it.
`unpack` gives each member's outputs back (its rows of the result and its slots afterwards),
which is what the lab compares: against the reference, alone against in a batch, and in one
piece against two pieces cut at an aligned position.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..kernels.registry import parameters
from ..kernels.rope import rope_table

ALIGN = 64  # prefill pieces are cut at multiples of this absolute position (GDN chunk, attention block)


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


@dataclass(frozen=True)
class Layout:
    """How an op's members are made: per-token inputs, per-slot contents, shared inputs."""

    tokens: Callable[[torch.Generator, int, dict, torch.dtype], dict[str, torch.Tensor]]
    slots: Callable[[torch.Generator, int, int, dict, torch.dtype], dict[str, torch.Tensor]] | None
    shared: Callable[[torch.Generator, dict, torch.dtype], dict[str, Any]]
    grid: list[tuple[dict, list[tuple[int, int]]]]  # (dims, [(n, start) per member])
    splittable: bool = False


def _randn(gen: torch.Generator, *shape: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def _kv_slot(gen: torch.Generator, start: int, n: int, dims: dict, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """K/V of positions [0, start + n) in a slot, NaN past them: a kernel reading beyond fails loudly."""
    shape = (dims["max_len"], dims["kv_heads"], dims["head_dim"])
    k, v = _randn(gen, *shape, dtype=dtype), _randn(gen, *shape, dtype=dtype)
    k[start + n:], v[start + n:] = float("nan"), float("nan")
    return {"k_cache": k, "v_cache": v}


HEADS = [{"heads": 4, "kv_heads": 4, "head_dim": 16}, {"heads": 4, "kv_heads": 2, "head_dim": 24},
         {"heads": 8, "kv_heads": 2, "head_dim": 40}, {"heads": 8, "kv_heads": 1, "head_dim": 8}]
ROWS = [[(1, 0)], [(1, 0), (3, 0), (2, 0)], [(2, 0)] * 5]  # one row; rows in groups; five members
GDN = [{"k_heads": 1, "v_heads": 2, "dk": 16, "dv": 8}, {"k_heads": 2, "v_heads": 2, "dk": 8, "dv": 24}]


def _attention_shared(gen: torch.Generator, dims: dict, dtype: torch.dtype) -> dict[str, Any]:
    return {"scale": dims["head_dim"] ** -0.5}


def _gdn_tokens(gen: torch.Generator, n: int, dims: dict, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    hk, hv = dims["k_heads"], dims["v_heads"]
    return {"q": _randn(gen, n, hk, dims["dk"], dtype=dtype), "k": _randn(gen, n, hk, dims["dk"], dtype=dtype),
            "v": _randn(gen, n, hv, dims["dv"], dtype=dtype),
            "g": -torch.rand(n, hv, generator=gen) * 0.5, "beta": torch.rand(n, hv, generator=gen)}


def _gdn_slot(gen: torch.Generator, start: int, n: int, dims: dict, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    state = torch.randn(dims["v_heads"], dims["dk"], dims["dv"], generator=gen) * 0.1 if start else \
        torch.zeros(dims["v_heads"], dims["dk"], dims["dv"])
    return {"states": state}


def _conv_slot(gen: torch.Generator, start: int, n: int, dims: dict, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    return {"conv_states": _randn(gen, dims["channels"], dims["width"] - 1, dtype=dtype)}


def _sample_tokens(gen: torch.Generator, n: int, dims: dict, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    choice = torch.randint(0, 4, (n,), generator=gen)
    return {"logits": _randn(gen, n, dims["vocab"], dtype=dtype, scale=3.0),
            "temperature": torch.tensor([0.0, 0.7, 1.0, 1.3])[choice],
            "top_k": torch.tensor([0, 5, 0, 50])[choice], "top_p": torch.tensor([1.0, 1.0, 0.8, 0.95])[choice],
            "seeds": torch.randint(0, 2**62, (n,), generator=gen), "positions": torch.randint(0, 4096, (n,),
                                                                                               generator=gen)}


def _rows(name: str, width: str, scale: float = 1.0) -> Callable[..., dict[str, torch.Tensor]]:
    return lambda gen, n, dims, dtype: {name: _randn(gen, n, dims[width], dtype=dtype, scale=scale)}


def _decode_grid(lengths: list[int]) -> list[tuple[int, int]]:
    return [(1, length - 1) for length in lengths]


LAYOUTS: dict[str, Layout] = {
    "embedding": Layout(
        lambda gen, n, dims, dtype: {"token_ids": torch.randint(0, dims["vocab"], (n,), generator=gen)}, None,
        lambda gen, dims, dtype: {"table": _randn(gen, dims["vocab"], dims["hidden"], dtype=dtype)},
        [({"vocab": 50, "hidden": 24}, rows) for rows in ROWS]),
    "rms_norm": Layout(
        _rows("x", "hidden"), None,
        lambda gen, dims, dtype: {"weight": _randn(gen, dims["hidden"], dtype=dtype), "eps": 1e-6},
        [({"hidden": h}, rows) for h in (1, 24, 100) for rows in ROWS]),
    "rms_norm_gated": Layout(
        lambda gen, n, dims, dtype: {"x": _randn(gen, n, dims["hidden"], dtype=dtype),
                                     "gate": _randn(gen, n, dims["hidden"], dtype=dtype)}, None,
        lambda gen, dims, dtype: {"weight": _randn(gen, dims["hidden"], dtype=dtype), "eps": 1e-6},
        [({"hidden": h}, rows) for h in (8, 24, 100) for rows in ROWS]),
    "silu_and_mul": Layout(
        _rows("gate_up", "width2"), None, lambda gen, dims, dtype: {},
        [({"width2": w}, rows) for w in (2, 48, 2 * 1100) for rows in ROWS]),
    "linear": Layout(
        _rows("x", "k"), None,
        lambda gen, dims, dtype: {"weight": _randn(gen, dims["n"], dims["k"], dtype=dtype, scale=dims["k"] ** -0.5),
                                  "bias": _randn(gen, dims["n"], dtype=dtype) if dims["bias"] else None},
        [({"k": k, "n": n, "bias": bias}, rows) for k, n, bias in ((24, 40, False), (67, 33, True))
         for rows in ROWS + [[(1, 0)] * 9]]),
    "sample": Layout(
        _sample_tokens, None, lambda gen, dims, dtype: {},
        [({"vocab": v}, rows) for v in (7, 300) for rows in ROWS]),
    "rope_write_kv": Layout(
        lambda gen, n, dims, dtype: {"q": _randn(gen, n, dims["heads"], dims["head_dim"], dtype=dtype),
                                     "k": _randn(gen, n, dims["kv_heads"], dims["head_dim"], dtype=dtype),
                                     "v": _randn(gen, n, dims["kv_heads"], dims["head_dim"], dtype=dtype)},
        lambda gen, start, n, dims, dtype: {
            "k_cache": torch.zeros(dims["max_len"], dims["kv_heads"], dims["head_dim"], dtype=dtype),
            "v_cache": torch.zeros(dims["max_len"], dims["kv_heads"], dims["head_dim"], dtype=dtype)},
        lambda gen, dims, dtype: dict(zip(("cos", "sin"), rope_table(dims["head_dim"], dims["max_len"], 1e6))),
        [({**heads, "max_len": 80}, seqs) for heads in HEADS for seqs in ([(1, 0)], [(5, 0), (8, 60), (3, 70)])],
        splittable=True),
    "prefill_attention": Layout(
        lambda gen, n, dims, dtype: {"q": _randn(gen, n, dims["heads"], dims["head_dim"], dtype=dtype)},
        _kv_slot, _attention_shared,
        [({**heads, "max_len": 160}, seqs) for heads in HEADS
         for seqs in ([(1, 0)], [(5, 0), (70, 0), (1, 9)], [(3, 64), (66, 64), (130, 0)])], splittable=True),
    "decode_attention": Layout(
        lambda gen, n, dims, dtype: {"q": _randn(gen, n, dims["heads"], dims["head_dim"], dtype=dtype)},
        _kv_slot, _attention_shared,
        [({**heads, "max_len": 300}, _decode_grid(lengths)) for heads in HEADS
         for lengths in ([1], [1, 64, 65, 257], [300, 2, 129])]),
    "conv1d_prefill": Layout(
        _rows("x", "channels"), _conv_slot,
        lambda gen, dims, dtype: {"weight": _randn(gen, dims["channels"], dims["width"], dtype=dtype)},
        [({"channels": c, "width": w}, seqs) for c, w in ((8, 4), (130, 3), (20, 2))
         for seqs in ([(1, 0)], [(5, 0), (70, 3), (2, 0)])], splittable=True),
    "conv1d_decode": Layout(
        _rows("x", "channels"), _conv_slot,
        lambda gen, dims, dtype: {"weight": _randn(gen, dims["channels"], dims["width"], dtype=dtype)},
        [({"channels": c, "width": w}, _decode_grid(lengths)) for c, w in ((8, 4), (300, 3))
         for lengths in ([1], [5, 1, 9, 2])]),
    "gated_delta_prefill": Layout(
        _gdn_tokens, _gdn_slot, lambda gen, dims, dtype: {},
        [(dims, seqs) for dims in GDN for seqs in ([(1, 0)], [(5, 0), (70, 3), (1, 64)], [(130, 0), (63, 1)])],
        splittable=True),
    "gated_delta_decode": Layout(
        _gdn_tokens, _gdn_slot, lambda gen, dims, dtype: {},
        [(dims, _decode_grid(lengths)) for dims in GDN for lengths in ([1], [3, 1, 70, 2])]),
}
LAYOUTS["prefill_linear"] = LAYOUTS["linear"]


def op_cases(op: str, dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.float16), seed: int = 0) -> list[Case]:
    """The grid of `op`: each dims × member layout × dtype, members made from their own seeds."""
    layout = LAYOUTS[op]
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
    """The member cut at its first absolute multiple of ALIGN strictly inside it (None if none):
    the second piece starts where the first ends; its slots are filled in from the first's run."""
    cut = (member.start // ALIGN + 1) * ALIGN - member.start
    if cut >= member.n:
        return None
    first = Member(member.start, {k: v[:cut] for k, v in member.tokens.items()}, member.slots)
    second = Member(member.start + cut, {k: v[cut:] for k, v in member.tokens.items()}, {})
    return first, second
