"""SlotManager bookkeeping over a SlotCache: slot allocation order (least recently used first),
state zeroing and prefix resumption when a slot is taken, what a freed slot holds, and the
bookkeeping errors."""

from __future__ import annotations

import pytest
import torch

from pocketllm.cache import AttentionCacheSpec, LayerCacheSpec, RecurrentCacheSpec, SlotCache, SlotCacheError
from pocketllm.scheduler.policy import PrefillPolicy
from pocketllm.scheduler.slots import SlotManager

LAYERS = [AttentionCacheSpec(num_kv_heads=2, head_dim=8),
          RecurrentCacheSpec(conv_dim=6, conv_width=4, num_heads=3, key_dim=5, value_dim=7)]


def _manager(num_slots: int, layers: list[LayerCacheSpec] = LAYERS, device: str = "cpu") -> SlotManager:
    return SlotManager(SlotCache(num_slots, 8, layers, torch.float32, device=device), PrefillPolicy())


def _held(slots: SlotManager) -> list[list[int]]:
    return [slots.held_tokens(slot) for slot in range(slots.cache.num_slots)]


def test_a_new_manager_has_every_slot_free_holding_nothing():
    slots = _manager(3)
    assert slots.num_free == 3 and slots.free_slots == [0, 1, 2]
    assert _held(slots) == [[], [], []]


def test_allocate_takes_the_least_recently_used_slot_and_zeroes_only_its_states():
    """Never-used slots go first in index order, then freed slots in the order they were freed (what
    a slot holds lasts as long as possible for prefix reuse); taking a slot zeroes its conv and
    recurrent state (not other slots', not K/V) and forgets its remembered tokens."""
    slots = _manager(3)
    cache = slots.cache
    assert [slots.allocate() for _ in range(3)] == [0, 1, 2]
    assert slots.num_free == 0
    with pytest.raises(SlotCacheError, match="all 3 cache slots are in use"):
        slots.allocate()
    for state in (cache.conv[1], cache.recurrent[1], cache.k[0]):
        state.fill_(1.0)
    slots.free(2, [7, 8])
    slots.free(0, [4, 5, 6])
    assert slots.num_free == 2 and _held(slots) == [[4, 5, 6], [], [7, 8]]
    assert slots.free_slots == [2, 0]
    assert slots.allocate() == 2
    assert _held(slots) == [[4, 5, 6], [], []]
    assert not cache.conv[1][2].any() and not cache.recurrent[1][2].any()
    assert bool((cache.conv[1][:2] == 1).all()) and bool((cache.recurrent[1][:2] == 1).all())
    assert bool((cache.k[0] == 1).all())  # K/V are overwritten position by position, never cleared
    assert slots.allocate() == 0 and slots.num_free == 0


def test_allocate_a_given_slot_keeping_a_prefix_resumes_its_state_copy():
    """allocate(slot, keep) resets the slot keeping its prefix (SlotCache.reset: K/V stay, the
    recurrent states become their copy at `keep`); a keep without a copy, or a slot that is not
    free, is refused, and a refused keep leaves the slot free with what it holds."""
    slots = _manager(2)
    cache = slots.cache
    slot = slots.allocate()
    cache.recurrent[1][slot].fill_(2.0)
    cache.save_prefix_state(slot, 4)
    cache.k[0][slot].fill_(5.0)
    cache.recurrent[1][slot].fill_(3.0)  # the tenant moves on; its copy at 4 stays
    with pytest.raises(SlotCacheError, match="slot 0 is not free"):
        slots.allocate(slot)
    slots.free(slot, [1] * 8)
    with pytest.raises(SlotCacheError, match="no state copy at position 3"):
        slots.allocate(slot, keep=3)
    assert slots.num_free == 2 and slots.held_tokens(slot) == [1] * 8
    assert slots.allocate(slot, keep=4) == slot
    assert bool((cache.recurrent[1][slot] == 2).all()) and bool((cache.k[0][slot] == 5).all())
    assert slots.held_tokens(slot) == [] and slots.free_slots == [1]


def test_free_rejects_slots_not_in_use():
    slots = _manager(2, LAYERS[:1])
    slot = slots.allocate()
    for bad in (1, -1, 2):  # free already, negative, out of range
        with pytest.raises(SlotCacheError, match=rf"slot {bad} is not allocated \(slots 0..1\)"):
            slots.free(bad, [])
    slots.free(slot, [1])
    with pytest.raises(SlotCacheError, match="slot 0 is not allocated"):
        slots.free(slot, [1])
    assert slots.num_free == 2 and slots.held_tokens(0) == [1]


def test_held_tokens_are_a_copy():
    """Changing the caller's list afterwards does not change what the slot holds, nor does
    changing the list held_tokens returned."""
    slots = _manager(1, LAYERS[:1])
    tokens = [1, 2, 3]
    slots.free(slots.allocate(), tokens)
    tokens.append(4)
    assert slots.held_tokens(0) == [1, 2, 3]
    slots.held_tokens(0).append(5)
    assert slots.held_tokens(0) == [1, 2, 3]


def test_allocate_on_another_device():
    """On the meta device (standing in for a GPU) taking a slot zeroes its states there too."""
    assert _manager(2, device="meta").allocate() == 0
