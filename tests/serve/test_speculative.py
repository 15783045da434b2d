"""A speculating server (`pocketllm serve --speculative-config '{...}'`): its answers `==` the serial
engine's without speculation, and /metrics counts the drafts."""

from __future__ import annotations

import httpx
import openai

from pocketllm import AsyncLLM, EngineArgs, SamplingParams

from .conftest import MAX_SEQ_LEN, MODEL, ids_of, running_server

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
PROMPTS = [[7, 8, 9] * 6, [5] * 30, [40, 41, 42, 43] * 4]


def test_a_speculating_server_answers_what_the_plain_engine_computes(serve_checkpoint, serial):
    engine = AsyncLLM(EngineArgs(model=str(serve_checkpoint), max_seq_len=MAX_SEQ_LEN, speculative=NGRAM))
    try:
        with running_server(engine) as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
            for sampling in (dict(temperature=0.0), dict(temperature=0.9, seed=5)):
                response = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=24, logprobs=2,
                                                     extra_body={"return_tokens_as_token_ids": True}, **sampling)
                for prompt, choice in zip(PROMPTS, response.choices):
                    want = serial.generate(prompt, SamplingParams(max_tokens=24, logprobs=2, **sampling))
                    assert ids_of(choice.logprobs.tokens) == want.token_ids
                    assert choice.logprobs.token_logprobs == want.logprobs
            stats = httpx.get(f"{url}/metrics", params={"format": "json"}).json()
            scrape = httpx.get(f"{url}/metrics").text
    finally:
        engine.close()
    assert 0 < stats["spec_accepted_tokens"] <= stats["spec_draft_tokens"]
    assert stats["spec_mean_accepted_length"] == 1 + stats["spec_accepted_tokens"] / stats["spec_verifies"]
    assert f"pocketllm_spec_accepted_tokens_total {float(stats['spec_accepted_tokens'])}" in scrape
    assert "# TYPE pocketllm_spec_mean_accepted_length gauge" in scrape
