"""Speculation with a draft model (`speculative={"model": DIR, "num_speculative_tokens": k}`): a
smaller checkpoint with the target's vocabulary drafts greedily in slots of its own, and the output
is bitwise the output without it. The property runs it against plain cold serial runs with
preemption by swap and by recompute (a draft slot written for another request since is prefilled
again), on an attention-only target and on Qwen3.5; the draft being the target itself makes greedy
drafts hit, so the accepting path runs as much as the rejecting one."""

from __future__ import annotations

import pytest
from helpers import budget
from hypothesis import given, settings

from pocketllm import LLM, EngineArgs, SamplingParams
from pocketllm.testing import Engines, assert_batch_invariant
from pocketllm.testing.strategies import speculation_workloads

VOCAB = 256
MAX_SEQ_LEN = 160


def _draft(path) -> dict:
    return {"model": str(path), "num_speculative_tokens": 3}


@pytest.fixture(scope="module", params=[("tiny", "untied_gqa4_bias", "swap"), ("tiny", "tiny", "recompute"),
                                        ("qwen3.5", "tiny", "swap")], ids="-".join)
def engines(request, checkpoint_dir):
    target, draft, mode = request.param
    engines = Engines(checkpoint_dir(target), max_seq_len=MAX_SEQ_LEN,
                      batched_args={"speculative": _draft(checkpoint_dir(draft))}, preemption_mode=mode)
    yield engines
    engines.close()


@pytest.mark.slow
@settings(max_examples=budget(0.5))
@given(workload=speculation_workloads(VOCAB, max_prompt=100, max_jobs=5, max_tokens=16))
def test_draft_model_speculation_equals_plain_cold_serial_bitwise(engines, workload):
    assert_batch_invariant(engines, workload)


def test_drafts_of_the_target_itself_are_accepted_when_greedy(checkpoint_dir):
    """The target as its own draft: greedy drafts are its own greedy tokens, so every draft is accepted
    (the draft slots track the requests' tokens across steps), serial and batched alike."""
    path = checkpoint_dir("tiny")
    prompts = [[5, 9, 2, 7], [100, 3], [42] * 5]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=1)
    with LLM(EngineArgs(model=str(path), max_seq_len=MAX_SEQ_LEN)) as plain:
        expected = [(r.token_ids, r.logprobs, r.top_logprobs) for r in plain.generate(prompts, params)]
    for batched in (False, True):
        with LLM(EngineArgs(model=str(path), max_seq_len=MAX_SEQ_LEN, speculative=_draft(path),
                            backend_options={"enable_batching": batched, "background_thread": False})) as llm:
            assert [(r.token_ids, r.logprobs, r.top_logprobs) for r in llm.generate(prompts, params)] == expected
            if batched:
                stats = llm.scheduler.get_stats()
                assert stats.spec_accepted_tokens == stats.spec_draft_tokens > 0
                assert stats.spec_mean_accepted_length > 3.5  # 3 drafts and the token after (fewer near max_tokens)


def test_a_draft_model_the_engine_cannot_use_is_refused(checkpoint_dir, tmp_path):
    from pocketllm import write_checkpoint

    target = str(checkpoint_dir("tiny"))
    other_vocab = write_checkpoint(tmp_path / "v", "tiny", seed=3, vocab_size=300)
    with pytest.raises(ValueError, match="has vocab_size 300, the target model 256"):
        LLM(EngineArgs(model=target, max_seq_len=64, speculative=_draft(other_vocab)))
    with pytest.raises(ValueError, match="has Gated DeltaNet layers"):
        LLM(EngineArgs(model=target, max_seq_len=64, speculative=_draft(checkpoint_dir("qwen3.5"))))
