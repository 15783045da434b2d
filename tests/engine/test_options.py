"""backend_options is parsed once into typed, frozen engine and backend options."""

from __future__ import annotations

import dataclasses
import re

import pytest

from pocketllm import EngineArgs
from pocketllm.options import BackendOptions, EngineOptions, Options, parse_backend_options


def test_none_and_empty_mean_defaults():
    assert parse_backend_options(None) == parse_backend_options({}) == Options()
    args = EngineArgs(model="x", backend_options=None)
    assert args.options == Options(EngineOptions(), BackendOptions())
    assert args.backend_options == {"enable_batching": False, "max_batch_size": 8, "background_thread": True,
                                    "record_timeline": False, "max_num_batched_tokens": 2048,
                                    "prefill_chunk_size": 512, "max_waiting": 0, "max_swap_bytes": 0,
                                    "preemption_mode": "swap", "enable_prefix_reuse": True,
                                    "state_snapshot_interval": 512, "fine_snapshot_until": 512, "batch_invariant": True,
                                    "invariance_probe": True, "decode_per_row": False, "tree_reduction": None,
                                    "exact_positions": None}


def test_keys_go_to_their_group_and_the_options_are_frozen():
    options = EngineArgs(model="x", backend_options={"max_batch_size": 3, "batch_invariant": False}).options
    assert options.engine == EngineOptions(max_batch_size=3)
    assert options.backend == BackendOptions(batch_invariant=False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.engine.max_batch_size = 4  # type: ignore[misc]


def test_unknown_key_lists_every_known_one():
    known = sorted(f.name for group in (EngineOptions, BackendOptions) for f in dataclasses.fields(group))
    with pytest.raises(ValueError, match=r"unknown backend_options \['slots'\]; allowed: ") as info:
        parse_backend_options({"slots": 2})
    assert str(known) in str(info.value)


def test_not_a_dict_is_refused():
    with pytest.raises(TypeError, match="backend_options must be a dict, got list"):
        parse_backend_options([("max_batch_size", 2)])  # type: ignore[arg-type]


@pytest.mark.parametrize("name,value", [("prefill_chunk_size", 100), ("prefill_chunk_size", -64),
                                        ("state_snapshot_interval", 65), ("max_num_batched_tokens", 0)])
def test_chunk_and_interval_are_multiples_of_64(name, value):
    with pytest.raises(ValueError, match=rf"backend_options\['{name}'\] must be an int in \[.*got {value}"):
        EngineArgs(model="x", backend_options={name: value})


@pytest.mark.parametrize("value", ["lru", "Swap", "", None, 1, True])
def test_preemption_mode_is_swap_or_recompute(value):
    assert parse_backend_options({"preemption_mode": "recompute"}).engine.preemption_mode == "recompute"
    with pytest.raises(ValueError, match=rf"backend_options\['preemption_mode'\] must be one of 'swap', 'recompute', "
                                         rf"got {re.escape(repr(value))}"):
        EngineArgs(model="x", backend_options={"preemption_mode": value})
