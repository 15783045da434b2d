"""Request lifecycle in the batch scheduler, driven step by step (no background thread):
ids, waiting -> running -> finished, FCFS admission, slot accounting, batched prefill/decode,
and the "length"/"stop" finish reasons."""

from __future__ import annotations

import random

import pytest

from pocketllm import LLM, EngineArgs, SamplingParams, write_checkpoint
from pocketllm.scheduler import RequestStatus


def greedy(max_tokens: int, **kw) -> SamplingParams:
    """Greedy, EOS ignored: the request always ends by "length" after exactly max_tokens tokens."""
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def status(scheduler, request_id: int) -> RequestStatus:
    """A not-yet-collected request's status (no public accessor exists; read the request table)."""
    return scheduler._requests[request_id].status


def counts(scheduler) -> tuple[int, int]:
    stats = scheduler.get_stats()
    return stats.waiting, stats.running


def test_submit_returns_distinct_increasing_ids(make_llm):
    """Ids from submit_request are distinct and strictly increasing, also across a collected batch."""
    s = make_llm(max_batch_size=2).scheduler
    ids = [s.submit_request([1 + i], greedy(1)) for i in range(5)]
    assert ids == sorted(set(ids)) and len(ids) == 5
    more = [s.submit_request([7], greedy(1)) for _ in range(3)]
    assert more == sorted(set(more)) and more[0] > ids[-1]


def test_waiting_running_finished_step_by_step(make_llm, drain):
    """max_batch_size 2, three requests: two run, the third waits and is admitted only once a
    slot frees; stats, statuses, results and free slots match the expected schedule at every step."""
    llm = make_llm(max_batch_size=2)
    s = llm.scheduler
    r0 = s.submit_request([1, 2], greedy(2))
    r1 = s.submit_request([3, 4, 5], greedy(4))
    r2 = s.submit_request([6], greedy(3))
    assert counts(s) == (3, 0)
    assert [status(s, r) for r in (r0, r1, r2)] == [RequestStatus.WAITING] * 3
    assert llm.slots.num_free == 2

    s.step()  # admit r0, r1; prefill both (1 token each)
    assert counts(s) == (1, 2)
    assert [status(s, r) for r in (r0, r1, r2)] == [RequestStatus.RUNNING, RequestStatus.RUNNING,
                                                    RequestStatus.WAITING]
    assert llm.slots.num_free == 0
    assert all(s.poll_result(r) is None for r in (r0, r1, r2))

    s.step()  # decode r0 (2nd token: done, slot freed), r1; r2 still waits: admission is at step start
    assert counts(s) == (1, 1)
    assert status(s, r0) is RequestStatus.FINISHED and status(s, r2) is RequestStatus.WAITING
    assert llm.slots.num_free == 1
    res0 = s.poll_result(r0)
    assert res0.finish_reason == "length" and len(res0.token_ids) == 2

    s.step()  # admit r2 into the freed slot
    assert counts(s) == (0, 2)
    assert status(s, r2) is RequestStatus.RUNNING
    assert llm.slots.num_free == 0

    s.step()  # r1 reaches 4 tokens
    assert counts(s) == (0, 1)
    s.step()  # r2 reaches 3 tokens
    assert counts(s) == (0, 0)
    assert not s.has_work
    assert llm.slots.num_free == 2
    res1, res2 = s.poll_result(r1), s.poll_result(r2)
    assert (len(res1.token_ids), len(res2.token_ids)) == (4, 3)
    assert res1.finish_reason == res2.finish_reason == "length"
    assert drain(s) == 0
    stats = s.get_stats()
    assert (stats.finished, stats.steps) == (3, 5)


def test_fcfs_admission_order(make_llm, recorder, drain):
    """Waiting requests are admitted first-come first-served, also when slots free out of order;
    a cancelled waiting request is skipped without disturbing the order of the rest."""
    llm = make_llm(max_batch_size=2)
    s = llm.scheduler
    rec = recorder(llm)
    rng = random.Random(0)
    prompts = [[10 + i] * (1 + i % 3) for i in range(7)]
    ids = [s.submit_request(p, greedy(rng.randint(1, 5))) for p in prompts]
    assert s.cancel_request(ids[4])
    drain(s)
    admitted = [tokens for seqs in rec.prefills() for _, _, tokens in seqs]
    assert admitted == [p for i, p in enumerate(prompts) if i != 4]


def test_at_most_max_batch_size_running(make_llm, recorder, drain):
    """Never more than max_batch_size requests run: per step stats, per forward batch, distinct
    slots; running + free slots always equals max_batch_size; all slots are free at the end."""
    n = 3
    llm = make_llm(max_batch_size=n)
    s = llm.scheduler
    rec = recorder(llm)
    rng = random.Random(1)
    ids = [s.submit_request([rng.randrange(255) for _ in range(rng.randint(1, 8))], greedy(rng.randint(1, 6)))
           for _ in range(10)]
    while s.has_work:
        s.step()
        stats = s.get_stats()
        assert stats.running <= n
        assert stats.running + llm.slots.num_free == n
    for _, seqs in rec.calls:
        slots = [slot for slot, _, _ in seqs]
        assert len(seqs) <= n and len(set(slots)) == len(slots) and set(slots) <= set(range(n))
    assert llm.slots.num_free == n
    assert all(s.poll_result(i).finish_reason == "length" for i in ids)
    assert drain(s) == 0


def test_one_forward_per_step_decode_rows_and_prefill_pieces(make_llm, recorder):
    """Requests admitted in the same step are prefilled in ONE forward (mixed prompt lengths, full
    prompts from position 0); a request admitted later is prefilled in the same forward as the
    decode rows of the running requests (a mixed step); every step is one forward."""
    llm = make_llm(max_batch_size=4)
    s = llm.scheduler
    rec = recorder(llm)
    prompts = [[1, 2], [3, 4, 5, 6, 7], [8, 9, 10]]
    ids = [s.submit_request(p, greedy(3)) for p in prompts]

    s.step()
    assert len(rec.calls) == 1 and rec.kinds[0] == [False] * 3
    assert [(start, tokens) for _, start, tokens in rec.calls[0][1]] == [(0, p) for p in prompts]
    stats = s.get_stats()
    assert (stats.prefill_batches, stats.decode_batches, stats.mixed_steps) == (1, 0, 0)

    late_prompt = [11, 12, 13, 14]
    late = s.submit_request(late_prompt, greedy(2))
    s.step()
    assert len(rec.calls) == 2 and rec.kinds[1] == [True] * 3 + [False]
    dec_seqs, pre_seqs = rec.calls[1][1][:3], rec.calls[1][1][3:]
    assert [(st, t) for _, st, t in pre_seqs] == [(0, late_prompt)]
    assert [start for _, start, _ in dec_seqs] == [len(p) for p in prompts]
    assert all(len(tokens) == 1 for _, _, tokens in dec_seqs)
    stats = s.get_stats()
    assert (stats.prefill_batches, stats.decode_batches, stats.mixed_steps) == (2, 1, 1)
    assert stats.prefill_chunks == 4

    s.step()  # the three first requests reach 3 tokens, `late` reaches 2: one decode of 4 sequences
    assert len(rec.calls) == 3
    is_decode, seqs = rec.calls[2]
    assert is_decode and len(seqs) == 4
    assert [start for _, start, _ in seqs] == [len(p) + 1 for p in prompts] + [len(late_prompt)]
    assert not s.has_work
    results = [s.poll_result(i) for i in ids]
    # The decode inputs fed back each request's own previously sampled token.
    for (_, _, fed1), (_, _, fed2), result in zip(dec_seqs, rec.calls[2][1], results):
        assert fed1 == [result.token_ids[0]] and fed2 == [result.token_ids[1]]
    assert s.poll_result(late).token_ids[0] == rec.calls[2][1][3][2][0]


def test_max_tokens_one_finishes_at_prefill_never_decoded(make_llm, recorder):
    """max_tokens=1 requests finish in the prefill step (slot freed at once) and are never part of
    a decode forward; alone, they cause no decode forward at all."""
    llm = make_llm(max_batch_size=3)
    s = llm.scheduler
    rec = recorder(llm)
    one_a = s.submit_request([5, 6, 7], greedy(1))
    one_b = s.submit_request([8], greedy(1))
    longer = s.submit_request([9, 10], greedy(3))
    s.step()
    for rid in (one_a, one_b):
        result = s.poll_result(rid)
        assert result.finish_reason == "length" and len(result.token_ids) == 1
    assert llm.slots.num_free == 2
    assert s.get_stats().running == 1
    while s.has_work:
        s.step()
    assert [len(seqs) for seqs in rec.decodes()] == [1, 1]
    assert s.poll_result(longer).finish_reason == "length"

    llm2 = make_llm(max_batch_size=2)
    rec2 = recorder(llm2)
    s2 = llm2.scheduler
    rid = s2.submit_request([1, 2, 3], greedy(1))
    s2.step()
    assert s2.poll_result(rid).finish_reason == "length"
    assert not s2.has_work
    assert rec2.decodes() == [] and s2.get_stats().decode_batches == 0


def test_finish_reason_length(make_llm, drain):
    """A request that hits no stop token ends with "length" after exactly max_tokens tokens."""
    s = make_llm().scheduler
    ids = {n: s.submit_request([4, 5, 6], greedy(n)) for n in (1, 2, 7)}
    drain(s)
    for n, rid in ids.items():
        result = s.poll_result(rid)
        assert result.finish_reason == "length" and len(result.token_ids) == n and len(result.logprobs) == n
        assert result.error is None


def first_new_token_index(tokens: list[int], min_index: int = 2) -> int:
    """The first index >= min_index whose token does not occur earlier in `tokens`."""
    for k in range(min_index, len(tokens)):
        if tokens[k] not in tokens[:k]:
            return k
    raise AssertionError(f"no fresh token in {tokens}")


def test_finish_reason_stop_on_stop_token(make_llm, drain):
    """A stop token taken from an earlier seeded run is really hit: the rerun ends "stop" right at
    it (included in token_ids), with exactly the tokens of the earlier run up to there."""
    s = make_llm().scheduler
    params = dict(temperature=1.0, seed=1234, ignore_eos=True)
    rid = s.submit_request([1, 2, 3], SamplingParams(max_tokens=16, **params))
    drain(s)
    reference = s.poll_result(rid)
    assert reference.finish_reason == "length"
    k = first_new_token_index(reference.token_ids)
    stop = reference.token_ids[k]

    rid = s.submit_request([1, 2, 3], SamplingParams(max_tokens=16, stop_token_ids=(stop,), **params))
    drain(s)
    result = s.poll_result(rid)
    assert result.finish_reason == "stop"
    assert result.token_ids == reference.token_ids[:k + 1]
    assert s.slots.num_free == s.cache.num_slots


def test_finish_reason_stop_on_eos_unless_ignore_eos(tmp_path):
    """The checkpoint's EOS id ends a request with "stop" unless ignore_eos is set. Two checkpoints
    with the same weights (same seed) differ only in EOS, which is a token the first one samples."""
    def engine(path):
        return LLM(EngineArgs(model=str(path), max_seq_len=64,
                              backend_options={"enable_batching": True, "max_batch_size": 2,
                                               "background_thread": False}))

    def run(llm, params):
        rid = llm.scheduler.submit_request([7, 8, 9], params)
        while llm.scheduler.has_work:
            llm.scheduler.step()
        return llm.scheduler.poll_result(rid)

    sampled = dict(max_tokens=16, temperature=1.0, seed=99)
    with engine(write_checkpoint(tmp_path / "a", "tiny", seed=5)) as llm:
        reference = run(llm, SamplingParams(ignore_eos=True, **sampled))
    assert reference.finish_reason == "length"
    k = first_new_token_index(reference.token_ids)
    eos = reference.token_ids[k]
    with engine(write_checkpoint(tmp_path / "b", "tiny", seed=5, eos_token_id=eos)) as llm:
        stopped = run(llm, SamplingParams(**sampled))
        ignored = run(llm, SamplingParams(ignore_eos=True, **sampled))
    assert stopped.finish_reason == "stop" and stopped.token_ids == reference.token_ids[:k + 1]
    assert ignored.finish_reason == "length" and ignored.token_ids == reference.token_ids


def test_prompt_plus_max_tokens_equal_to_max_seq_len_runs_to_completion(make_llm, drain):
    """The largest accepted request (prompt + max_tokens == max_seq_len) runs to "length"."""
    llm = make_llm(max_batch_size=2, max_seq_len=64)
    s = llm.scheduler
    rid = s.submit_request([3] * 56, greedy(8))
    other = s.submit_request([4] * 63, greedy(1))
    drain(s)
    assert s.poll_result(rid).finish_reason == "length"
    assert len(s.poll_result(other).token_ids) == 1
    assert llm.slots.num_free == 2


@pytest.mark.parametrize("max_batch_size", [1, 3])
def test_results_do_not_depend_on_batching(make_llm, drain, max_batch_size):
    """Seeded requests give the same tokens and logprobs whether they ran alone or were batched
    with others admitted at different steps (the scheduler feeds correct positions/slots)."""
    rng = random.Random(7)
    work = [([rng.randrange(255) for _ in range(rng.randint(1, 8))],
             SamplingParams(max_tokens=rng.randint(1, 6), temperature=rng.choice([0.0, 0.8]), seed=i,
                            ignore_eos=True)) for i in range(6)]
    alone = make_llm(max_batch_size=1).scheduler
    expected = []
    for prompt, params in work:
        rid = alone.submit_request(prompt, params)
        drain(alone)
        result = alone.poll_result(rid)
        expected.append((result.token_ids, result.logprobs))

    s = make_llm(max_batch_size=max_batch_size).scheduler
    ids = []
    for prompt, params in work:  # staggered arrivals: one new request per step
        ids.append(s.submit_request(prompt, params))
        s.step()
    drain(s)
    got = [(r.token_ids, r.logprobs) for r in map(s.poll_result, ids)]
    assert got == expected
