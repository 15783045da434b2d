"""Prefix reuse and the token budget, checked directly rather than through the bits alone: a
conversation reuses only what was prefilled without exact positions (never positions written by
decode steps; with them it reuses those too: tests/engine/test_exact_positions.py), reuse
starts on the grid for attention-only models too, chained keys tell identical blocks at
different depths apart, the least recently used free slot is the one given away, and no step
feeds more than max_num_batched_tokens, decode rows included."""

from __future__ import annotations

import pytest

from pocketllm import LLM, EngineArgs, SamplingParams
from pocketllm.scheduler.prefix_index import PrefixIndex

from .harness import RunRecorder, drain

GRID = 64


def _engine(path, **options) -> LLM:
    return LLM(EngineArgs(model=str(path), max_seq_len=512, backend_options={
        "enable_batching": True, "background_thread": False, "max_batch_size": 2, "prefill_chunk_size": GRID,
        "state_snapshot_interval": GRID, **options}))


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("variant", ["tiny", "qwen3.5"])
def test_a_conversation_reuses_only_what_was_prefilled(checkpoint_dir, variant):
    """Without exact positions, turn 2 extends turn 1's prompt and answer. Its first 140 tokens are in
    turn 1's slot, but only the prompt's 100 were prefilled: reuse stops at 64 (the grid below 100),
    not 128."""
    path = checkpoint_dir(variant)
    llm = _engine(path, exact_positions=False)
    prompt = [(5 * i + 1) % 200 for i in range(100)]
    first = llm.generate(prompt, _greedy(40))
    second_prompt = prompt + first.token_ids + [7] * 30
    second = llm.generate(second_prompt, _greedy(4))
    stats = llm.scheduler.get_stats()
    assert (stats.prefix_hits, stats.prefix_tokens_reused) == (1, 64)
    cold = LLM(EngineArgs(model=str(path), max_seq_len=512, backend_options={
        "prefill_chunk_size": GRID, "state_snapshot_interval": GRID, "exact_positions": False})).generate(
        second_prompt, _greedy(4))
    assert (second.token_ids, second.logprobs) == (cold.token_ids, cold.logprobs)
    llm.close()


@pytest.mark.parametrize("shared_len,reused,starts", [(100, 0, [0, 64, 128]), (150, 128, [128])])
def test_reuse_is_on_the_snapshot_grid_for_an_attention_only_model(tiny_checkpoint, monkeypatch,
                                                                   shared_len, reused, starts):
    """Without exact positions the reuse grid is the snapshot interval (128) when it is set, not the
    chunk size (64): a prompt sharing 100 tokens with a slot reuses nothing, one sharing 150 reuses
    128, and the rest runs the pieces of a cold run. An attention-only model would not fail on a
    wrong grid; its cuts would move."""
    llm = _engine(tiny_checkpoint, state_snapshot_interval=2 * GRID, exact_positions=False)
    shared = [(3 * i + 2) % 200 for i in range(shared_len)]
    llm.generate(shared + [1] * 20, _greedy(2))
    recorder = RunRecorder(llm, monkeypatch)
    llm.generate(shared + [2] * (150 - shared_len) + [3] * 20, _greedy(2))
    assert [start for part in recorder.prefills() for _, start, _ in part] == starts
    assert llm.scheduler.get_stats().prefix_tokens_reused == reused


def test_with_default_options_a_chats_next_turn_reuses_the_last_one_to_the_token(tiny_checkpoint):
    """Default options (exact positions where the C++ kernels build): turn 2 extends turn 1's
    100-token prompt and 20-token answer; it reuses every position turn 1's slot holds (119: the
    answer's last token was never fed), off every grid, decoded positions included, and equals its
    cold run. A third prompt that leaves turn 1's after 50 tokens reuses exactly 50."""
    llm = LLM(EngineArgs(model=str(tiny_checkpoint), max_seq_len=512,
                         backend_options={"enable_batching": True, "background_thread": False}))
    assert llm.capabilities.exact_positions
    prompt = [(5 * i + 1) % 200 for i in range(100)]
    first = llm.generate(prompt, _greedy(20))
    follow = prompt + first.token_ids + [7] * 9
    second = llm.generate(follow, SamplingParams(max_tokens=6, temperature=0.8, seed=3, logprobs=2))
    assert llm.scheduler.get_stats().prefix_tokens_reused == 119
    cold = LLM(EngineArgs(model=str(tiny_checkpoint), max_seq_len=512)).generate(
        follow, SamplingParams(max_tokens=6, temperature=0.8, seed=3, logprobs=2))
    assert (second.token_ids, second.logprobs, second.top_logprobs) == \
        (cold.token_ids, cold.logprobs, cold.top_logprobs)
    llm.generate(prompt[:50] + [9] * 30, _greedy(2))
    assert llm.scheduler.get_stats().prefix_tokens_reused == 119 + 50
    llm.close()


def test_a_match_is_extended_past_whole_blocks_to_the_token():
    index = PrefixIndex(num_slots=2, grid=16)
    held = list(range(40))
    index.extend(0, held, 40)
    assert index.match(held[:37] + [99], 37) == {0: 32}  # whole blocks only
    assert index.common_prefix(0, held[:37] + [99], 37) == 37
    assert index.common_prefix(0, held[:20] + [99] * 20, 39) == 20
    assert index.common_prefix(0, held, 30) == 30  # the limit holds
    index.truncate(0, 18)
    assert index.common_prefix(0, held, 39) == 18


def test_chained_keys_tell_identical_blocks_at_different_depths_apart():
    a, x, z = [1] * GRID, [2] * GRID, [3] * GRID
    index = PrefixIndex(num_slots=2, grid=GRID)
    index.extend(0, a + x, 2 * GRID)  # slot 0 holds A X: its X is at depth 1
    index.extend(1, x, GRID)  # slot 1 holds X at depth 0
    assert index.match(x + x, 2 * GRID) == {1: GRID}  # slot 0's second block is not X at depth 1 of X X
    assert index.match(z + x, 2 * GRID) == {}
    assert index.match(a + x + z, 3 * GRID) == {0: 2 * GRID}
    index.truncate(0, GRID)
    assert index.match(a + x, 2 * GRID) == {0: GRID}


def test_the_least_recently_used_free_slot_is_given_away(tiny_checkpoint):
    """A and B end in that order, each in its own slot; an unrelated prompt takes A's slot (the
    least recently used), so A's prefix is gone and B's is still reused."""
    llm = _engine(tiny_checkpoint)
    s = llm.scheduler
    prompt_a, prompt_b = [4] * 80, [6] * 80
    ids = [s.submit_request(prompt_a, _greedy(1)), s.submit_request(prompt_b, _greedy(3))]
    drain(s)
    for rid in ids:
        s.poll_result(rid)
    llm.generate([9] * 10, _greedy(1))
    assert s.get_stats().prefix_hits == 0
    llm.generate(prompt_b + [1], _greedy(1))
    assert s.get_stats().prefix_hits == 1  # B's slot kept its prefix
    llm.generate(prompt_a + [1], _greedy(1))
    assert s.get_stats().prefix_hits == 1  # A's slot was given away
    llm.close()


def test_no_step_feeds_more_than_the_budget(tiny_checkpoint, monkeypatch):
    """Two requests decode while prompts of 80 tokens (pieces of 64 and 16) arrive: a step could
    take 2 decode rows, one prompt's last 16 and the next one's first 64 (82 tokens) if the budget
    (70) let it. Every forward stays within max_num_batched_tokens."""
    budget = 70
    llm = _engine(tiny_checkpoint, max_batch_size=4, max_num_batched_tokens=budget)
    recorder = RunRecorder(llm, monkeypatch)
    s = llm.scheduler
    for i in range(2):
        s.submit_request([i + 1, i + 2], _greedy(30))
    s.step()
    for i in range(3):
        s.submit_request([(i * 7 + j) % 200 for j in range(80)], _greedy(3))
    drain(s)
    fed = [sum(len(tokens) for _, _, tokens in seqs) for _, seqs in recorder.calls]
    assert max(fed) <= budget
    assert any(any(kinds) and not all(kinds) for kinds in recorder.kinds)  # decode rows beside prefill pieces


def test_with_exact_positions_a_new_prompt_is_cut_at_the_budget_only_when_nothing_else_prefills(
        tiny_checkpoint, monkeypatch):
    """Exact positions allow a piece to end where the step's budget does. A prompt already prefilling
    is cut there; a new prompt too when nothing else prefills in the step (or it could wait for ever on
    a budget below its chunk), but not beside another prompt's piece: then it waits for a step where
    its first piece fits whole, so a burst of prompts that share a system prompt finds it in a slot.
    Here: budget 100, chunks of 64, two 150-token prompts sharing their first 128 tokens."""
    llm = _engine(tiny_checkpoint, exact_positions=True, max_num_batched_tokens=100, prefill_chunk_size=64,
                  state_snapshot_interval=64)
    shared = [(3 * i + 1) % 200 for i in range(128)]
    recorder = RunRecorder(llm, monkeypatch)
    first, second = llm.generate([shared + [5] * 22, shared + [9] * 22], _greedy(1))
    pieces = [[(slot, start, len(tokens)) for slot, start, tokens in part] for part in recorder.prefills()]
    slot_a = pieces[0][0][0]
    assert pieces[:2] == [[(slot_a, 0, 64)], [(slot_a, 64, 64)]]  # the second prompt waits beside the first
    assert llm.scheduler.get_stats().prefix_tokens_reused == 128  # ...and then finds the shared 128 tokens
    alone = _engine(tiny_checkpoint, exact_positions=True, max_num_batched_tokens=40, prefill_chunk_size=64,
                    state_snapshot_interval=64)
    recorder = RunRecorder(alone, monkeypatch)
    alone.generate([shared], _greedy(1))
    assert [len(part[0][2]) for part in recorder.prefills()][:2] == [40, 24]  # alone: cut at the budget
