"""Exact speculative decoding: `EngineArgs(speculative={"method": "ngram", ...})` changes the speed
only. A verify piece's rows have the bits of decode steps (exact positions) and a draft is accepted
exactly when it equals the token the request's own sampler draws there, so every request's tokens,
logprobs and alternatives equal the run without speculation, at any temperature, for any draft; on
Qwen3.5 a partly accepted draft takes the Gated DeltaNet states back to its accepted end.

The property runs speculating batched engines (arrivals, cancellations, priorities, forced
preemptions by swap and by recompute, drawn budgets and cuts, prefix reuse) against the cold serial
runs of an engine that does not speculate; the prompts are half repetitive, so drafts are found and
both hit and miss. Negative controls: a verify that accepts every draft, a verify whose rows draw
with the counter of the piece's end, Gated DeltaNet states left where a partly accepted piece
ended, and a decode attention whose rows round differently from prefilled ones (planted.py:
verified rows then lack their decode steps' bits) must each be caught."""

from __future__ import annotations

import pytest
from helpers import budget
from hypothesis import given, settings

import pocketllm.runner as runner_module
from pocketllm import LLM, EngineArgs, SamplingParams
from pocketllm.scheduler.slots import SlotManager
from pocketllm.scheduler.speculation import MAX_BACKOFF, NgramIndex, Speculation
from pocketllm.speculative import SpeculativeConfig, speculative_config
from pocketllm.testing import Engines, Job, Workload, assert_batch_invariant, find_mismatches
from pocketllm.testing.planted import decode_attention_nudged
from pocketllm.testing.strategies import speculation_workloads

VOCAB = 256
MAX_SEQ_LEN = 160
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 4}


def _config(**keys) -> SpeculativeConfig:
    config = speculative_config({**NGRAM, **keys})
    assert config is not None
    return config


# -- the option -------------------------------------------------------------------------------


def test_the_option_takes_vllm_keys_and_fills_in_its_defaults(tiny_checkpoint):
    args = EngineArgs(model=str(tiny_checkpoint), speculative={"method": "ngram", "num_speculative_tokens": 4})
    assert args.speculative_config == SpeculativeConfig("ngram", 4, 5, 5)  # vLLM's lookup defaults
    assert args.speculative == {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 5,
                                "prompt_lookup_max": 5}
    one = speculative_config({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3})
    assert one == SpeculativeConfig("ngram", 2, 3, 3)
    draft = speculative_config({"model": "/ckpt", "num_speculative_tokens": 3})  # vLLM infers the method
    assert draft == SpeculativeConfig("draft_model", 3, model="/ckpt")
    assert draft.as_dict() == {"method": "draft_model", "num_speculative_tokens": 3, "model": "/ckpt"}
    assert EngineArgs(model=str(tiny_checkpoint)).speculative_config is None


@pytest.mark.parametrize(("raw", "error", "words"), [
    ({"method": "ngram"}, ValueError, "['num_speculative_tokens'] is required"),
    ({"method": "ngram", "num_speculative_tokens": 0}, ValueError, "in [1, 32], got 0"),
    ({"method": "ngram", "num_speculative_tokens": True}, ValueError, "in [1, 32], got True"),
    ({"method": "nram", "num_speculative_tokens": 2}, ValueError,
     "must be one of ('ngram', 'draft_model', 'mtp', 'custom'), got 'nram'"),
    ({"method": "eagle", "num_speculative_tokens": 2}, ValueError, "'eagle' is not supported yet"),
    ({"method": "mtp", "num_speculative_tokens": 2, "model": "x"}, ValueError,
     "['model'] do not apply to method 'mtp'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft": 1}, ValueError, "unknown speculative keys ['draft']"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, ValueError, "does not take"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, ValueError, "['model'] must name the draft checkpoint"),
    ({"model": "x", "num_speculative_tokens": 2, "prompt_lookup_max": 3}, ValueError,
     "['prompt_lookup_max'] apply to method 'ngram' only"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}, ValueError,
     "['prompt_lookup_min']=4 must not exceed prompt_lookup_max=2"),
    (["ngram"], TypeError, "must be None or a dict, got list"),
])
def test_a_bad_option_is_refused_naming_the_key_and_what_it_takes(raw, error, words):
    with pytest.raises(error) as info:
        speculative_config(raw)
    assert words in str(info.value)


def test_an_engine_without_exact_positions_refuses_speculation(checkpoint_dir):
    with pytest.raises(ValueError, match="needs exact positions"):
        LLM(EngineArgs(model=str(checkpoint_dir("tiny")), max_seq_len=64, speculative=NGRAM,
                       backend_options={"exact_positions": False}))


# -- proposing ----------------------------------------------------------------------------------


def _proposal(tokens: list[int], count: int = 3, low: int = 1, high: int = 4) -> list[int]:
    index = NgramIndex()
    index.extend(tokens)
    return index.propose(count, low, high)


def test_prompt_lookup_takes_the_longest_match_then_the_latest_with_room():
    assert _proposal([1, 2, 3, 9, 9, 2, 3, 7, 1, 2, 3]) == [9, 9, 2]  # "1 2 3" beats the later "2 3"
    assert _proposal([5, 6, 5, 6, 5, 6], count=2) == [5, 6]  # the latest match followed by 2 tokens
    assert _proposal([7, 1, 2, 7, 9, 7], high=1) == [1, 2, 7]  # the later "7" has 2 tokens after it only
    assert _proposal([5, 5, 5], count=4) == [5]  # a longer match beats more tokens after a shorter one
    assert _proposal([1, 2, 3, 4], low=1) == []  # the last token never occurred before
    assert _proposal([1, 2, 8, 2], low=2) == []  # only a 1-gram matches
    grown = NgramIndex()
    for end in range(1, 8):  # grown token by token as a request generates: the same answers
        grown.extend([4, 1, 4, 2, 4, 1, 4][:end])
    assert grown.propose(2, 2, 3) == _proposal([4, 1, 4, 2, 4, 1, 4], 2, 2, 3) == [2, 4]


def test_drafts_shrink_after_misses_and_pause_when_single_drafts_keep_missing():
    speculation = Speculation(_config(num_speculative_tokens=4))
    tokens = [7, 8] * 8
    assert speculation.propose(tokens, 10) == [7, 8, 7, 8]
    speculation.verified(0, 4, 1)
    assert speculation.propose(tokens, 10) == [7, 8]  # one more than it accepted
    speculation.verified(0, 2, 0)
    assert speculation.propose(tokens, 10) == [7]
    waits = []
    for _ in range(6):  # single drafts that miss: a pause that doubles up to MAX_BACKOFF steps
        speculation.verified(0, 1, 0)
        skipped = 0
        while not speculation.propose(tokens, 10):
            skipped += 1
        waits.append(skipped)
    assert waits == [1, 2, 4, 8, 16, 16] and MAX_BACKOFF == 16
    speculation.verified(0, 1, 1)  # a hit: back to the full width, no pause
    assert speculation.propose(tokens, 10) == [7, 8, 7, 8]
    assert speculation.propose(tokens, 2) == [7, 8]  # never more than asked (budget, max_tokens)
    assert (speculation.drafted, speculation.accepted, speculation.verifies) == (13, 2, 9)


# -- the contract --------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=[("tiny", "swap"), ("tiny", "recompute"), ("qwen3.5", "swap"),
                                        ("qwen3.5", "recompute")], ids="-".join)
def engines(request, checkpoint_dir):
    """Batched engines that speculate, against serial engines that do not; on Qwen3.5 a partly
    accepted draft takes the Gated DeltaNet states back to its accepted end."""
    variant, mode = request.param
    engines = Engines(checkpoint_dir(variant), max_seq_len=MAX_SEQ_LEN, batched_args={"speculative": NGRAM},
                      preemption_mode=mode)
    yield engines
    engines.close()


@settings(max_examples=budget())
@given(workload=speculation_workloads(VOCAB, max_prompt=100, max_jobs=5, max_tokens=20))
def test_speculating_batched_equals_plain_cold_serial_bitwise(engines, workload):
    assert_batch_invariant(engines, workload)


PROMPTS = [[5, 6, 7, 8] * 4 + [5, 6], [1, 2, 3] * 5, [9, 10, 11, 12, 13, 14], [3] * 9, [40, 41] * 6 + [40]]
PARAMS = [SamplingParams(max_tokens=30, temperature=0.0, logprobs=2, ignore_eos=True),
          SamplingParams(max_tokens=24, temperature=0.8, seed=7, top_k=20),
          SamplingParams(max_tokens=20, temperature=1.0, seed=3, repetition_penalty=1.3, logit_bias={6: 3.0}),
          SamplingParams(max_tokens=24, temperature=0.0, min_tokens=10, bad_words_token_ids=[[3, 3, 4]]),
          SamplingParams(max_tokens=24, temperature=0.5, seed=11, presence_penalty=0.5, frequency_penalty=0.3,
                         top_p=0.9, logprobs=1)]


def _outputs(results) -> list:
    return [(r.token_ids, r.logprobs, r.top_logprobs, r.finish_reason) for r in results]


@pytest.mark.parametrize("batched", [False, True])
def test_speculation_changes_nothing_with_logits_controls_serial_and_batched(tiny_checkpoint, batched):
    """Greedy, sampled, penalties, logit bias, min_tokens and bad words: each request's history as
    the controls read it is the one its decode steps would have had, row by row of a verify piece."""
    def engine(speculative) -> LLM:
        return LLM(EngineArgs(model=str(tiny_checkpoint), max_seq_len=MAX_SEQ_LEN, speculative=speculative,
                              backend_options={"enable_batching": batched, "background_thread": False}))

    with engine(None) as plain:
        expected = _outputs(plain.generate(PROMPTS, PARAMS))
    with engine(NGRAM) as speculating:
        results = speculating.generate(PROMPTS, PARAMS)
        assert _outputs(results) == expected
        assert all(0 <= r.spec_accepted_tokens <= r.spec_draft_tokens for r in results)
        assert sum(r.spec_accepted_tokens for r in results) > 0  # per request, serial and batched
        if batched:
            assert sum(r.spec_draft_tokens for r in results) == speculating.scheduler.get_stats().spec_draft_tokens
            stats = speculating.scheduler.get_stats()
            assert stats.spec_accepted_tokens > 0 and stats.spec_draft_tokens > stats.spec_accepted_tokens
            assert stats.spec_mean_accepted_length == 1 + stats.spec_accepted_tokens / stats.spec_verifies
            assert stats.decode_batches < stats.generated_tokens - len(PROMPTS)  # steps were saved


@pytest.mark.slow
@pytest.mark.parametrize(("variant", "args"), [
    ("qwen3-moe", {}),
    ("qwen3.5-moe", {}),
    ("tiny", {"tensor_parallel_size": 2}),
    ("qwen3.5", {"tensor_parallel_size": 2}),
])
def test_speculation_changes_nothing_on_experts_and_across_ranks(checkpoint_dir, variant, args):
    """Mixtures of experts (verified rows route as their decode steps do; Qwen3.5-MoE's states roll
    back), and ranks: a speculating batched engine at tensor_parallel_size 2 against a plain serial
    one at 1, whose workers keep and restore their shards' states as rank 0 does."""
    path = str(checkpoint_dir(variant))
    with LLM(EngineArgs(model=path, max_seq_len=MAX_SEQ_LEN)) as plain:
        expected = _outputs(plain.generate(PROMPTS, PARAMS))
    with LLM(EngineArgs(model=path, max_seq_len=MAX_SEQ_LEN, speculative=NGRAM, **args,
                        backend_options={"enable_batching": True, "background_thread": False})) as speculating:
        assert _outputs(speculating.generate(PROMPTS, PARAMS)) == expected
        assert speculating.scheduler is not None and speculating.scheduler.get_stats().spec_verifies > 0


def test_every_token_of_a_verify_piece_reaches_on_token_in_order(tiny_checkpoint):
    with LLM(EngineArgs(model=str(tiny_checkpoint), max_seq_len=MAX_SEQ_LEN, speculative=NGRAM,
                        backend_options={"enable_batching": True, "background_thread": False})) as llm:
        scheduler = llm.scheduler
        assert scheduler is not None
        deltas: list = []
        ids = [scheduler.submit_request(p, PARAMS[0], on_token=deltas.append) for p in PROMPTS[:2]]
        while scheduler.has_work:
            scheduler.step()
        results = [scheduler.poll_result(i) for i in ids]
        assert scheduler.get_stats().spec_accepted_tokens > 0
    for request_id, result in zip(ids, results):
        mine = [d for d in deltas if d.request_id == request_id]
        assert [d.index for d in mine] == list(range(len(result.token_ids)))
        assert [(d.token_id, d.logprob) for d in mine] == list(zip(result.token_ids, result.logprobs))


def test_verify_pieces_stay_within_the_token_budget(tiny_checkpoint):
    """Eight slots and a budget of 12 tokens: decode rows come first, drafts take what running prompts
    leave, and every step's tokens fit."""
    with LLM(EngineArgs(model=str(tiny_checkpoint), max_seq_len=MAX_SEQ_LEN, speculative=NGRAM,
                        backend_options={"enable_batching": True, "background_thread": False,
                                         "record_timeline": True, "max_num_batched_tokens": 12,
                                         "prefill_chunk_size": 0})) as llm:
        prompts = [[t, t + 1] * 3 for t in range(8)]
        params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        llm.generate(prompts, params)
        scheduler = llm.scheduler
        assert scheduler is not None and scheduler.timeline is not None
        per_step: dict[int, int] = {}
        for event in scheduler.timeline:
            per_step[event.step] = per_step.get(event.step, 0) + event.num_tokens
        assert max(per_step.values()) <= 12
        assert scheduler.get_stats().spec_verifies > 0


# -- negative controls ---------------------------------------------------------------------------

CONTROL = Workload(tuple(Job(tuple(p), SamplingParams(max_tokens=20, temperature=1.0, seed=i))
                         for i, p in enumerate(PROMPTS[:3])), max_batch_size=3)


def test_negative_control_a_verify_that_accepts_every_draft_is_caught(engines, monkeypatch):
    monkeypatch.setattr(runner_module, "_verified", lambda seq, draws: len(seq.drafts) + 1)
    assert find_mismatches(engines, CONTROL)


def test_negative_control_verify_rows_drawing_at_the_pieces_end_are_caught(engines, monkeypatch):
    original = runner_module._Draw

    def at_the_end(seq, row, counter, history):
        return original(seq, row, seq.start + len(seq.token_ids), history)

    monkeypatch.setattr(runner_module, "_Draw", at_the_end)
    assert find_mismatches(engines, CONTROL)


def test_negative_control_states_left_past_a_partly_accepted_draft_are_caught(checkpoint_dir, monkeypatch):
    """Qwen3.5: the Gated DeltaNet states left where the verify piece ended, not at its accepted end."""
    monkeypatch.setattr(SlotManager, "verified", lambda self, request, seq: self.decoded(request))
    with Engines(checkpoint_dir("qwen3.5"), max_seq_len=MAX_SEQ_LEN, batched_args={"speculative": NGRAM}) as hybrid:
        assert find_mismatches(hybrid, CONTROL)


def test_negative_control_decode_rows_that_round_unlike_prefilled_ones_are_caught(tiny_checkpoint):
    with Engines(tiny_checkpoint, max_seq_len=MAX_SEQ_LEN, batched_args={"speculative": NGRAM},
                 engine_args={"op_overrides": {"decode_attention": decode_attention_nudged}}) as nudged:
        assert find_mismatches(nudged, CONTROL)
