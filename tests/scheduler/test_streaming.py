"""Streaming: tokens reach the user as they are sampled, none lost, in order; the deltas of a stream
(iterator or on_token callback) concatenate to the final result, also with four threads streaming
at once and with streams left early (which cancels their requests). Text deltas concatenate to the
final text, holding back bytes of a character that a token left incomplete."""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys
import threading

from pocketllm import LLM, AsyncLLM, EngineArgs, GenerationResult, SamplingParams, TokenDelta
from pocketllm.scheduler.stream import TextDeltas


def _engine(path, **options) -> LLM:
    return LLM(EngineArgs(model=str(path), max_seq_len=128,
                          backend_options={"enable_batching": True, "max_batch_size": 4, **options}))


def _params(rng: random.Random) -> SamplingParams:
    return SamplingParams(max_tokens=rng.randint(1, 24), temperature=rng.choice([0.0, 1.0]), seed=rng.randrange(2**32))


def _collect(stream) -> tuple[list[TokenDelta], GenerationResult]:
    items = list(stream)
    *deltas, result = items
    assert isinstance(result, GenerationResult) and all(isinstance(d, TokenDelta) for d in deltas)
    return deltas, result


def test_stream_deltas_are_the_result_in_order(tiny_checkpoint):
    rng = random.Random(0)
    with _engine(tiny_checkpoint, background_thread=False) as llm:
        serial = LLM(EngineArgs(model=str(tiny_checkpoint), max_seq_len=128))
        for _ in range(5):
            prompt, params = [rng.randrange(256) for _ in range(rng.randint(1, 30))], _params(rng)
            deltas, result = _collect(llm.stream(prompt, params))
            assert [d.index for d in deltas] == list(range(len(result.token_ids)))
            assert [d.token_id for d in deltas] == result.token_ids and [d.logprob for d in deltas] == result.logprobs
            assert [d.last for d in deltas] == [False] * (len(deltas) - 1) + [True]
            assert "".join(d.text for d in deltas) == result.text  # the tiny checkpoint has a tokenizer
            expected = serial.generate(prompt_tokens=prompt, sampling_params=params)
            assert (result.token_ids, result.logprobs) == (expected.token_ids, expected.logprobs)
        assert not llm.scheduler.has_work


def test_four_threads_streaming_with_cancellation_mid_stream(tiny_checkpoint):
    """Four threads each stream requests through the background thread; some leave early. Every
    stream's deltas are its result (or, left early, a prefix of the uninterrupted output), and every
    request ends in one terminal state with its slot freed."""
    serial = LLM(EngineArgs(model=str(tiny_checkpoint), max_seq_len=128))
    failures: list[str] = []
    with _engine(tiny_checkpoint, background_thread=True) as llm:

        def worker(seed: int) -> None:
            rng = random.Random(seed)
            for _ in range(6):
                prompt = [rng.randrange(256) for _ in range(rng.randint(1, 20))]
                params = SamplingParams(max_tokens=rng.randint(2, 16), temperature=0.9, seed=rng.randrange(2**32),
                                        ignore_eos=True)
                expected = serial_output(prompt, params)
                leave_after = rng.choice([None, 0, 1, 3])
                seen = []
                for item in llm.stream(prompt, params):
                    if isinstance(item, GenerationResult):
                        if item.token_ids != seen or item.token_ids != expected:
                            failures.append(f"{seed}: {item.token_ids} vs deltas {seen} vs serial {expected}")
                        break
                    seen.append(item.token_id)
                    if leave_after is not None and len(seen) > leave_after:
                        break  # leaving the loop cancels the request
                if seen != expected[:len(seen)]:
                    failures.append(f"{seed}: deltas {seen} are not a prefix of {expected}")

        lock = threading.Lock()

        def serial_output(prompt, params):
            with lock:
                return serial.generate(prompt_tokens=prompt, sampling_params=params).token_ids

        threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads)
        assert failures == []
        stats = llm.scheduler.get_stats()
        assert stats.finished + stats.cancelled == 24 and stats.errored == 0
        assert llm.slots.num_free == 4 and not llm.scheduler.has_work


def _top_k_requests(rng: random.Random, n: int) -> list[tuple[list[int], SamplingParams]]:
    """n prompts, each asking for the top k alternatives (k from 0 to 5) or for none."""
    return [([rng.randrange(256) for _ in range(rng.randint(1, 20))],
             SamplingParams(max_tokens=rng.randint(1, 10), temperature=rng.choice([0.0, 1.0]), seed=i,
                            logprobs=rng.choice([None, 0, 1, 5]))) for i in range(n)]


def _assert_deltas_carry_the_top_k(deltas: list[TokenDelta], result: GenerationResult, expected: GenerationResult):
    """The deltas' logprobs and top k are the result's, which are the serial engine's."""
    assert [d.logprob for d in deltas] == result.logprobs == expected.logprobs
    tops = [d.top_logprobs for d in deltas]
    assert tops == (result.top_logprobs if result.top_logprobs is not None else [None] * len(deltas))
    assert result.top_logprobs == expected.top_logprobs


def test_deltas_carry_the_top_logprobs_of_the_result(tiny_checkpoint):
    """With logprobs=k a streaming client sees what the result holds: each delta's top k is the
    result's entry for its token (None without logprobs), through stream() one request at a time,
    on_token callbacks of requests batched together, and concurrent AsyncLLM streams."""
    requests = _top_k_requests(random.Random(5), 6)
    serial = LLM(EngineArgs(model=str(tiny_checkpoint), max_seq_len=128))
    expected = [serial.generate(prompt_tokens=prompt, sampling_params=params) for prompt, params in requests]
    with _engine(tiny_checkpoint, background_thread=False) as llm:
        for (prompt, params), cold in zip(requests, expected):
            _assert_deltas_carry_the_top_k(*_collect(llm.stream(prompt, params)), cold)
        got: dict[int, list[TokenDelta]] = {}
        s = llm.scheduler
        ids = [s.submit_request(prompt, params, on_token=lambda d: got.setdefault(d.request_id, []).append(d))
               for prompt, params in requests]
        while s.has_work:
            s.step()
        for rid, cold in zip(ids, expected):
            _assert_deltas_carry_the_top_k(got[rid], s.poll_result(rid), cold)

    async def main() -> list[list]:
        async with AsyncLLM(EngineArgs(model=str(tiny_checkpoint), max_seq_len=128,
                                       backend_options={"max_batch_size": 4})) as engine:

            async def items(prompt: list[int], params: SamplingParams) -> list:
                return [item async for item in engine.stream(prompt, params)]

            return await asyncio.gather(*(items(prompt, params) for prompt, params in requests))

    for (*deltas, result), cold in zip(asyncio.run(main()), expected):
        _assert_deltas_carry_the_top_k(deltas, result, cold)


def test_on_token_callback_gets_every_token_in_order(tiny_checkpoint):
    rng = random.Random(3)
    got: dict[int, list[TokenDelta]] = {}
    with _engine(tiny_checkpoint, background_thread=False) as llm:
        s = llm.scheduler
        ids = [s.submit_request([rng.randrange(256) for _ in range(9)], _params(rng),
                                on_token=lambda d: got.setdefault(d.request_id, []).append(d)) for _ in range(6)]
        while s.has_work:
            s.step()
        for rid in ids:
            result = s.poll_result(rid)
            assert [d.token_id for d in got[rid]] == result.token_ids
            assert [d.index for d in got[rid]] == list(range(len(result.token_ids)))
            assert got[rid][-1].last
            assert "".join(d.text for d in got[rid]) == result.text  # the scheduler detokenizes too


def test_scheduler_stream_by_request_id_carries_text(tiny_checkpoint):
    with _engine(tiny_checkpoint, background_thread=False) as llm:
        rid = llm.scheduler.submit_request([5, 6, 7], SamplingParams(max_tokens=12, temperature=1.0, seed=4))
        deltas, result = _collect(llm.scheduler.stream(rid))
        assert "".join(d.text for d in deltas) == result.text
        assert result.text == llm.tokenizer.decode(result.token_ids, skip_special_tokens=True)


def test_text_deltas_hold_incomplete_characters():
    """A character split across byte tokens comes out whole, once complete; pieces concatenate."""
    data = "aé€😀b".encode()
    texts = TextDeltas(lambda ids: bytes(ids).decode("utf-8", errors="replace"))
    pieces = [texts.add(b) for b in data]
    assert "".join(pieces) == "aé€😀b"
    assert pieces[1] == "" and pieces[2] == "é" and pieces[-1] == "b"
    cut = TextDeltas(lambda ids: bytes(ids).decode("utf-8", errors="replace"))
    assert cut.add(0xE2) == "" and cut.flush() == "\ufffd"


def test_cli_generate_stream_prints_tokens(tiny_checkpoint):
    out = subprocess.run([sys.executable, "-m", "pocketllm.cli", "generate", "--model", str(tiny_checkpoint),
                          "--prompt-tokens", "1,2,3", "--max-tokens", "5", "--temperature", "0", "--stream",
                          "--max-seq-len", "64"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    plain = subprocess.run([sys.executable, "-m", "pocketllm.cli", "generate", "--model", str(tiny_checkpoint),
                            "--prompt-tokens", "1,2,3", "--max-tokens", "5", "--temperature", "0",
                            "--max-seq-len", "64"], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == plain.stdout.strip() and len(out.stdout.strip().split(",")) == 5
