"""SamplingParams.resolved_seed: a given seed is kept (seeded requests replay), a missing one is
drawn fresh from the whole 64-bit range."""

from __future__ import annotations

from pocketllm.sampling import MAX_SEED, SamplingParams


def test_given_seed_is_kept():
    for seed in (0, 7, MAX_SEED):
        assert SamplingParams(seed=seed).resolved_seed() == seed


def test_missing_seed_is_drawn_fresh():
    seeds = {SamplingParams().resolved_seed() for _ in range(64)}
    assert all(0 <= s <= MAX_SEED for s in seeds)
    assert len(seeds) == 64  # distinct: 64 draws from 2^64 values
    assert max(seeds) >= 2**60  # the high bits are drawn too (fails with probability 2^-256)
