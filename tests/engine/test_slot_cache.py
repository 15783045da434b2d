"""SlotCache on its own: tensor layout per layer kind, state zeroing on reset (a new tenant never
sees the previous one's recurrent state), resuming and copying prefixes, and the state-copy errors.
The bookkeeping of free slots is the SlotManager's (tests/scheduler/test_slot_manager.py)."""

from __future__ import annotations

import pytest
import torch

from pocketllm.cache import AttentionCacheSpec, RecurrentCacheSpec, SlotCache, SlotCacheError

LAYERS = [AttentionCacheSpec(num_kv_heads=2, head_dim=8),
          RecurrentCacheSpec(conv_dim=6, conv_width=4, num_heads=3, key_dim=5, value_dim=7)]


def test_layout_per_layer_kind():
    """Attention layers get K/V [slots, max_seq_len, Hkv, D] in the cache dtype and no recurrent
    state; Gated DeltaNet layers get a conv state [slots, conv_dim, width - 1] in the cache dtype
    and an fp32 recurrent state [slots, H, Dk, Dv], and no K/V. All start at zero, on the CPU."""
    cache = SlotCache(3, 16, LAYERS, torch.float16)
    assert (cache.num_slots, cache.max_seq_len) == (3, 16)
    k, v = cache.k[0], cache.v[0]
    assert k.shape == v.shape == (3, 16, 2, 8) and k.dtype == v.dtype == torch.float16
    assert cache.conv[0] is None and cache.recurrent[0] is None
    assert cache.k[1] is None and cache.v[1] is None
    assert cache.conv[1].shape == (3, 6, 3) and cache.conv[1].dtype == torch.float16
    assert cache.recurrent[1].shape == (3, 3, 5, 7) and cache.recurrent[1].dtype == torch.float32
    for t in (k, v, cache.conv[1], cache.recurrent[1]):
        assert t.device.type == "cpu" and not t.any()


def test_reset_zeroes_only_that_slots_states():
    """Resetting a slot for a new tenant zeroes its conv and recurrent state (not other slots', not
    K/V: those are overwritten position by position, never cleared)."""
    cache = SlotCache(3, 8, LAYERS, torch.float32)
    for state in (cache.conv[1], cache.recurrent[1], cache.k[0]):
        state.fill_(1.0)
    cache.reset(2)
    assert not cache.conv[1][2].any() and not cache.recurrent[1][2].any()
    assert bool((cache.conv[1][:2] == 1).all()) and bool((cache.recurrent[1][:2] == 1).all())
    assert bool((cache.k[0] == 1).all())


def test_reset_keeping_a_prefix_resumes_its_state_copy():
    """reset(slot, keep): K/V stay, the recurrent states become their copy at `keep`, copies past
    `keep` are dropped; a keep without a copy is refused."""
    cache = SlotCache(2, 8, LAYERS, torch.float32)
    slot = 0
    cache.recurrent[1][slot].fill_(2.0)
    cache.save_prefix_state(slot, 4)
    cache.recurrent[1][slot].fill_(3.0)
    cache.save_prefix_state(slot, 8)
    cache.k[0][slot].fill_(5.0)
    assert cache.prefix_state_nbytes == 2 * cache.prefix_state_bytes
    with pytest.raises(SlotCacheError, match="no state copy at position 3"):
        cache.reset(slot, keep=3)
    cache.reset(slot, keep=4)
    assert bool((cache.recurrent[1][slot] == 2).all()) and bool((cache.k[0][slot] == 5).all())
    assert sorted(cache.prefix_states[slot]) == [4]


def test_copy_prefix_copies_rows_and_states_bit_for_bit():
    cache = SlotCache(2, 8, LAYERS, torch.float32)
    source, target = 0, 1
    cache.k[0][source].normal_()
    cache.v[0][source].normal_()
    cache.conv[1][source].normal_()
    cache.recurrent[1][source].normal_()
    cache.save_prefix_state(source, 4)
    state = cache.recurrent[1][source].clone()
    cache.recurrent[1][source].zero_()  # the source moves on; its copy at 4 stays
    cache.copy_prefix(source, target, 4)
    assert torch.equal(cache.k[0][target, :4], cache.k[0][source, :4])
    assert torch.equal(cache.v[0][target, :4], cache.v[0][source, :4])
    assert not cache.k[0][target, 4:].any()
    assert torch.equal(cache.recurrent[1][target], state)
    assert sorted(cache.prefix_states[target]) == [4]
    assert cache.prefix_state_nbytes == cache.prefix_state_bytes  # the copy is shared, not duplicated
    with pytest.raises(SlotCacheError, match="no state copy at position 8"):
        cache.copy_prefix(source, target, 8)


def test_a_slot_keeps_one_end_copy_with_its_replay_rows_off_the_chunk_grid():
    """save_prefix_state(end=True): where a tenant ended. Off the chunk grid (64) the copy holds the
    replay buffers too, and a slot's new end copy replaces its last one (snapshot copies stay), so
    the copies' memory has a bound; resume_point finds the furthest copy within a prefix, and a copy
    into another slot takes the end copy with it."""
    cache = SlotCache(2, 256, LAYERS, torch.float32, replay=True)
    slot = 0
    cache.save_prefix_state(slot, 64)
    cache.recurrent[1][slot].fill_(2.0)
    cache.replay[1][slot].fill_(4.0)
    cache.save_prefix_state(slot, 70, end=True)
    cache.save_prefix_state(slot, 128, end=True)  # on the chunk grid: no replay rows
    assert sorted(cache.prefix_states[slot]) == [64, 128] and len(cache.prefix_states[slot][128]) == 2
    cache.save_prefix_state(slot, 64, end=True)  # a snapshot position: nothing new, nothing replaced
    assert sorted(cache.prefix_states[slot]) == [64, 128] and cache.end_copy[slot] == 128
    cache.save_prefix_state(slot, 90, end=True)
    assert sorted(cache.prefix_states[slot]) == [64, 90] and cache.end_copy[slot] == 90
    assert len(cache.prefix_states[slot][90]) == 3 and len(cache.prefix_states[slot][64]) == 2
    assert [cache.resume_point(slot, n) for n in (63, 64, 89, 90, 200)] == [0, 64, 64, 90, 90]
    cache.recurrent[1][slot].zero_()
    cache.replay[1][slot].zero_()
    cache.copy_prefix(slot, 1, 90)
    assert bool((cache.recurrent[1][1] == 2).all()) and bool((cache.replay[1][1] == 4).all())
    assert cache.end_copy[1] == 90 and sorted(cache.prefix_states[1]) == [64, 90]
    cache.reset(1, keep=64)
    assert cache.end_copy[1] is None and sorted(cache.prefix_states[1]) == [64]


def test_every_tensor_is_on_the_requested_device():
    """On another device (the meta device stands in for a GPU here) every slot tensor lives there."""
    cache = SlotCache(2, 4, LAYERS, torch.float32, device="meta")
    for t in (cache.k[0], cache.v[0], cache.conv[1], cache.recurrent[1]):
        assert t.device.type == "meta"
    cache.reset(0)  # zeroing works there too


def test_recurrent_state_is_fp32_whatever_the_default_dtype():
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        cache = SlotCache(1, 4, LAYERS, torch.bfloat16)
    finally:
        torch.set_default_dtype(previous)
    assert cache.recurrent[1].dtype == torch.float32
    assert cache.k[0].dtype == cache.conv[1].dtype == torch.bfloat16
