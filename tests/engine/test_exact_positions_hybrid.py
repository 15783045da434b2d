"""Exact positions on the Qwen3.5 hybrids: a position's logprobs are bitwise the same decoded,
prefilled in a piece cut anywhere, or scored, so generated logprobs equal the scores of the same
sequence. The Gated DeltaNet layers keep it in one of two ways: the torch backend runs the rule
token by token in its C++ kernel for prefill and decode alike (`recurrent`); the chunked forms (the
triton kernel, and the torch reference where no compiler is found) keep exact replay (the state at
the last chunk boundary plus the inputs since, every piece and decode step recomputing its chunk).
The torch checks run both (`REPLAY` overrides the ops to the chunked reference).

Both checkpoint layouts, the torch backend at a tiny and a realistic width, and the
triton backend (interpreted here, under `slow`) at a tiny one; the sequences cross the 64-position
chunk boundary on the torch backend. Negative controls: the chunked form without its replay buffers (a decode step
through the recurrent form, a cut piece continuing its chunk's partial state), and a recurrent
decode step one ulp away, make the same checks fail.
"""

from __future__ import annotations

import pytest
import torch
from helpers import budget
from hypothesis import given, settings
from hypothesis import strategies as st
from test_exact_positions import SCORE, _engine, _mismatch, _workload

from pocketllm import LLM, SamplingParams, write_checkpoint
from pocketllm.cache import SlotCache
from pocketllm.kernels.gated_delta_decode import gated_delta_decode_recurrent

# The torch backend's two exact Gated DeltaNet paths: its default (C++, token by token) and the
# chunked reference with replay buffers (its path without a compiler).
REPLAY = {"gated_delta_prefill": "ref", "gated_delta_decode": "ref"}
GDN_PATHS = pytest.mark.parametrize("gdn", [None, REPLAY], ids=["recurrent", "replay"])
# The replay path's second run of a check, under `slow`: slower on the CPU, and not its default.
GDN_PATHS_REPLAY_SLOW = pytest.mark.parametrize("gdn", [None, pytest.param(REPLAY, marks=pytest.mark.slow)],
                                                ids=["recurrent", "replay"])


@pytest.fixture(scope="module")
def wide_hybrid(tmp_path_factory):
    """The `qwen3.5-small` width (hidden 512, vocab 32000, 8 value heads of 64) in three Gated
    DeltaNet layers and one gated attention layer."""
    return write_checkpoint(tmp_path_factory.mktemp("wide_hybrid"), "qwen3.5-small", seed=6, num_hidden_layers=4)


def _fresh_slots(llm: LLM) -> LLM:
    """Reset a slot before a sequence that starts at position 0 runs in it, as admission does: the
    checks run the runner directly, and a recurrent state must not carry over between them."""
    run = llm.runner.run

    def run_fresh(seqs):
        for seq in seqs:
            if seq.start == 0:
                llm.cache.reset(seq.slot)
        return run(seqs)

    llm.runner.run = run_fresh
    return llm


_ENGINES: dict = {}


def _cached_engine(path, backend: str, overrides: dict | None = None) -> LLM:
    key = (str(path), backend, str(overrides))
    if key not in _ENGINES:
        _ENGINES[key] = _fresh_slots(_engine(path, backend, overrides=overrides))
    return _ENGINES[key]


sequences = st.integers(2, 90).flatmap(lambda n: st.tuples(
    st.lists(st.integers(0, 255), min_size=n, max_size=n),
    st.lists(st.integers(1, n - 1), max_size=4, unique=True).map(sorted)))


@GDN_PATHS_REPLAY_SLOW
@settings(max_examples=budget(0.1), deadline=None)
@given(case=sequences)
def test_hybrid_positions_are_exact_on_the_torch_backend(checkpoint_dir, gdn, case):
    tokens, cuts = case
    assert _mismatch(_cached_engine(checkpoint_dir("qwen3.5"), "torch", gdn), tokens, cuts) is None


@pytest.mark.slow
@settings(max_examples=budget(0.2), deadline=None)
@given(case=sequences)
def test_hybrid_positions_are_exact_on_the_torch_backend_at_a_realistic_width(wide_hybrid, case):
    tokens, cuts = case
    assert _mismatch(_cached_engine(wide_hybrid, "torch"), tokens, cuts) is None


@GDN_PATHS
@pytest.mark.parametrize("variant", ["qwen3.5", "qwen3.5_mm_untied"])
def test_hybrid_positions_are_exact_in_both_layouts(checkpoint_dir, variant, gdn):
    """Cuts off the chunk grid, a sequence crossing position 64, every position decoded too."""
    llm = _cached_engine(checkpoint_dir(variant), "torch", gdn)
    assert (llm.cache.replay[0] is not None) == (gdn is not None)
    tokens = [(13 * i + 5) % 256 for i in range(75)]
    assert _mismatch(llm, tokens, [3, 40, 66]) is None


@pytest.mark.slow
@settings(max_examples=budget(0.05), deadline=None)
@given(case=st.integers(2, 8).flatmap(lambda n: st.tuples(
    st.lists(st.integers(0, 255), min_size=n, max_size=n),
    st.lists(st.integers(1, n - 1), max_size=2, unique=True).map(sorted))))
def test_hybrid_positions_are_exact_on_the_triton_backend(checkpoint_dir, case):
    tokens, cuts = case
    assert _mismatch(_cached_engine(checkpoint_dir("qwen3.5"), "triton"), tokens, cuts) is None


def test_hybrid_generation_scores_as_it_generated(checkpoint_dir):
    """Generate (batched, prompts crossing the chunk boundary, the replay path), then score prompt +
    output: the generated positions' logprobs and top alternatives are the scores, `==`."""
    llm = _engine(checkpoint_dir("qwen3.5"), batched=True, overrides=REPLAY)
    prompts = [[(7 * i + j) % 256 for i in range(n)] for j, n in enumerate((60, 5, 70))]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3)
    generated = llm.generate(prompts, [params] * len(prompts))
    scored = llm.generate([p + g.token_ids for p, g in zip(prompts, generated)], [SCORE] * len(prompts))
    for prompt, g, s in zip(prompts, generated, scored):
        n = len(prompt)
        assert s.prompt_logprobs[n:] == g.logprobs
        assert [top[:3] for top in s.prompt_top_logprobs[n:]] == g.top_logprobs


def _nudged_decode(*args):
    return gated_delta_decode_recurrent(*args) * (1.0 + 2.0**-20)  # tests/planted.py's NUDGE


def test_negative_control_a_recurrent_decode_step_one_ulp_away_is_caught(checkpoint_dir):
    llm = _fresh_slots(_engine(checkpoint_dir("qwen3.5"), "torch", overrides={"gated_delta_decode": _nudged_decode}))
    mismatch = _mismatch(llm, [(13 * i + 5) % 256 for i in range(20)], [7])
    assert mismatch is not None and "decoded" in mismatch


def test_negative_control_hybrid_without_replay_is_caught(checkpoint_dir):
    """The chunked form without replay buffers: the decode step (its recurrent op) and a cut inside
    a chunk round differently, and the check sees it."""
    llm = _fresh_slots(_engine(checkpoint_dir("qwen3.5"), "torch", overrides=REPLAY))
    for i, replay in enumerate(llm.cache.replay):
        if replay is not None:
            llm.cache.replay[i] = None
    tokens = [(13 * i + 5) % 256 for i in range(20)]
    assert _mismatch(llm, tokens, [7]) is not None


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=2)


def _outputs(result) -> tuple:
    return result.token_ids, result.logprobs, result.top_logprobs


@GDN_PATHS
def test_the_next_turn_reuses_the_previous_answer_on_a_hybrid(checkpoint_dir, gdn):
    """Default options. Turn 2 extends turn 1's prompt (50 tokens) and answer (40): it resumes from
    the states kept where turn 1 ended (89 positions: the answer's last token was never fed; off
    every grid, with the replay rows on the chunked path) and equals its cold run. A prompt that
    leaves turn 1 after 70 tokens resumes from the copy a decode step kept at the fine position 64;
    with fine_snapshot_until=0 it finds none within them (the snapshot grid is 512)."""
    path = checkpoint_dir("qwen3.5")
    prompt = [(5 * i + 1) % 200 for i in range(50)]
    llm = _engine(path, batched=True, max_batch_size=2, overrides=gdn, exact=None)
    assert llm.capabilities.exact_positions
    first = llm.generate(prompt, _greedy(40))
    second_prompt = prompt + first.token_ids + [7] * 3
    second = llm.generate(second_prompt, _greedy(5))
    stats = llm.scheduler.get_stats
    assert stats().prefix_tokens_reused == 89
    cold = _engine(path, overrides=gdn)
    assert _outputs(second) == _outputs(cold.generate(second_prompt, _greedy(5)))
    branch = second_prompt[:70] + [9] * 4
    assert _outputs(llm.generate(branch, _greedy(3))) == _outputs(cold.generate(branch, _greedy(3)))
    assert stats().prefix_tokens_reused == 89 + 64
    coarse = _engine(path, batched=True, max_batch_size=2, overrides=gdn, exact=None, fine_snapshot_until=0)
    coarse.generate(prompt, _greedy(40))
    coarse.generate(branch, _greedy(3))
    assert coarse.scheduler.get_stats().prefix_tokens_reused == 0


def _slot_states(llm: LLM, slot: int) -> list:
    return [s[slot].clone() for s in llm.cache._states()]


@GDN_PATHS
def test_a_piece_keeps_its_states_every_64_positions_without_a_cut(checkpoint_dir, gdn):
    """A 200-token prompt prefilled in one piece (cut at 512 only) keeps its Gated DeltaNet states at
    64, 128 and 192, each bitwise the state of a slot that holds exactly that prefix (the pieces of
    the recurrent ops were split there, nothing else); a prompt sharing 150 of its tokens resumes
    from 128 and equals its cold run."""
    path = checkpoint_dir("qwen3.5")
    prompt = [(7 * i + 2) % 200 for i in range(200)]
    llm = _engine(path, batched=True, max_batch_size=2, overrides=gdn, exact=None)
    llm.generate(prompt, _greedy(1))
    slot = next(s for s in range(2) if llm.slots.held_tokens(s)[:200] == prompt)
    assert {64, 128, 192} <= set(llm.cache.prefix_states[slot])
    assert llm.scheduler.get_stats().prefill_chunks == 1
    reference = _engine(path, batched=True, max_batch_size=1, overrides=gdn, exact=None, enable_prefix_reuse=False)
    for position in (64, 128, 192):
        reference.generate(prompt[:position], _greedy(1))  # its slot then holds `position` prompt positions
        kept = llm.cache.prefix_states[slot][position]
        assert all(torch.equal(a, b) for a, b in zip(kept, _slot_states(reference, 0)[:len(kept)]))
    shared = prompt[:150] + [3] * 20
    before = llm.scheduler.get_stats().prefix_tokens_reused
    cold = _engine(path, overrides=gdn)
    assert _outputs(llm.generate(shared, _greedy(4))) == _outputs(cold.generate(shared, _greedy(4)))
    assert llm.scheduler.get_stats().prefix_tokens_reused - before == 128


def test_negative_control_a_state_kept_under_the_wrong_position_is_caught(checkpoint_dir, monkeypatch):
    """Planted: the states a piece keeps on the way are filed 64 positions later than where they
    were taken, so the prompt sharing 150 tokens resumes at 128 from the state at 64."""
    keep_state = SlotCache.keep_state
    monkeypatch.setattr(SlotCache, "keep_state", lambda cache, slot, position, layer, kind:
                        keep_state(cache, slot, position + 64, layer, kind))
    commit = SlotCache.commit_kept
    monkeypatch.setattr(SlotCache, "commit_kept", lambda cache, slot, positions:
                        commit(cache, slot, [p + 64 for p in positions]))
    path = checkpoint_dir("qwen3.5")
    prompt = [(7 * i + 2) % 200 for i in range(200)]
    llm = _engine(path, batched=True, max_batch_size=2, exact=None)
    llm.generate(prompt, _greedy(1))
    shared = prompt[:150] + [3] * 20
    assert _outputs(llm.generate(shared, _greedy(4))) != _outputs(_engine(path).generate(shared, _greedy(4)))


def _two_follow_ups(path, gdn) -> tuple[list, LLM]:
    """Turn 1 (30 + 40 tokens), then two follow-ups of it arriving together: the first takes turn 1's
    slot, the second copies its 69 positions and kept states while that slot is busy. Returns the
    follow-ups' results (each beside its prompt) and the engine."""
    prompt = [(7 * i + 3) % 200 for i in range(30)]
    llm = _engine(path, batched=True, max_batch_size=3, overrides=gdn, exact=None)
    first = llm.generate(prompt, _greedy(40))
    follow_ups = [prompt + first.token_ids + [m] * 4 for m in (11, 12)]
    return list(zip(follow_ups, llm.generate(follow_ups, [_greedy(4)] * 2))), llm


@GDN_PATHS
def test_a_busy_slots_kept_end_state_is_copied_into_another_slot(checkpoint_dir, gdn):
    path = checkpoint_dir("qwen3.5")
    results, llm = _two_follow_ups(path, gdn)
    assert llm.scheduler.get_stats().prefix_tokens_reused == 2 * 69
    cold = _engine(path, overrides=gdn)
    for prompt, result in results:
        assert _outputs(result) == _outputs(cold.generate(prompt, _greedy(4)))


def test_negative_control_an_end_state_kept_without_its_replay_rows_is_caught(checkpoint_dir, monkeypatch):
    """Planted: the copy kept off the chunk grid leaves out the replay buffers, so the slot the
    second follow-up copies into replays zeros for positions 64..68 of their chunk."""
    def save_without_replay(cache, slot, position, end=False):
        if cache.has_states and not (end and position in cache.prefix_states[slot]):
            cache.prefix_states[slot][position] = [s[slot].clone() for s in cache._states()]

    monkeypatch.setattr(SlotCache, "save_prefix_state", save_without_replay)
    path = checkpoint_dir("qwen3.5")
    results, _ = _two_follow_ups(path, REPLAY)
    cold = _engine(path, overrides=REPLAY)
    assert [_outputs(r) == _outputs(cold.generate(p, _greedy(4))) for p, r in results] == [True, False]


@pytest.mark.parametrize("mode", ["swap", "recompute"])
def test_hybrid_preemption_and_budget_cuts_keep_generation_equal_to_scoring(checkpoint_dir, mode):
    """Batched in 2 slots with prompts cut where a 40-token budget runs out and the running requests
    preempted twice mid-generation (swap: their states and replay buffers to host memory;
    recompute: prompt and generated tokens prefilled again, from a kept prefix where one is):
    generated logprobs and top 3 equal the scores of prompt + output, and each request equals its
    cold serial run."""
    path = checkpoint_dir("qwen3.5")
    prompts, params = _workload(256)
    llm = _engine(path, batched=True, max_batch_size=2, max_num_batched_tokens=40, prefill_chunk_size=64,
                  state_snapshot_interval=64, preemption_mode=mode)
    s = llm.scheduler
    ids = [s.submit_request(p, sp) for p, sp in zip(prompts, params)]
    for step in range(400):
        if step in (5, 30):
            for i in ids:
                s.preempt(i)
        if not s.step():
            break
    results = [s.poll_result(i, None) for i in ids]
    assert s.get_stats().preemptions >= 2
    cold = _engine(path)
    for prompt, sp, r in zip(prompts, params, results):
        alone = cold.generate(prompt, sp)
        assert (r.token_ids, r.logprobs, r.top_logprobs) == (alone.token_ids, alone.logprobs, alone.top_logprobs)
    scored = llm.generate([p + r.token_ids for p, r in zip(prompts, results)], [SCORE] * len(prompts))
    for prompt, r, sc in zip(prompts, results, scored):
        assert r.logprobs == sc.prompt_logprobs[len(prompt):]
