"""lm-evaluation-harness's `local-completions` requests, as it posts them to /v1/completions
(token-id prompts in batches), and its arithmetic on the answers: the log-likelihoods and greedy
checks equal the in-process scoring call's, and generate_until's text the in-process generation
cut at the first stop string."""

from __future__ import annotations

import httpx

from pocketllm import SamplingParams

from .conftest import MODEL

# (context, continuation) token pairs, scored in one batch as the harness does.
PAIRS = [([1, 2, 3, 4, 5], [6, 7]), ([100, 101], [102, 103, 104]), ([9] * 20, [9]), ([33, 44], [55])]


def _loglikelihood_payload(prompts: list[list[int]]) -> dict:
    return {"model": MODEL, "prompt": prompts, "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
            "echo": True}


def test_loglikelihood_equals_in_process_scoring(base_url, serial):
    prompts = [ctx + cont for ctx, cont in PAIRS]
    out = httpx.post(f"{base_url}/v1/completions", json=_loglikelihood_payload(prompts), timeout=60).json()
    for choice, (ctx, cont) in zip(out["choices"], PAIRS):
        # The harness's parse_logprobs: the continuation's logprobs, the one generated token dropped.
        token_logprobs = choice["logprobs"]["token_logprobs"][len(ctx):-1]
        tops = choice["logprobs"]["top_logprobs"][len(ctx):-1]
        harness_sum = sum(token_logprobs)
        harness_greedy = all(lp == max(top.values()) for lp, top in zip(token_logprobs, tops))
        scored = serial.generate(ctx + cont, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))
        want = scored.prompt_logprobs[len(ctx):]
        assert token_logprobs == want and harness_sum == sum(want)
        greedy = all(top[0][0] == token for top, token in zip(scored.prompt_top_logprobs[len(ctx):], cont))
        assert harness_greedy == greedy


def test_generate_until_equals_in_process_generation(base_url, serial):
    prompts = [[72, 101, 108, 108, 111], [1, 2, 3], [65, 66, 67, 10]]
    wants = [serial.generate(p, SamplingParams(max_tokens=32, temperature=0, seed=1234)) for p in prompts]
    stops = ["\n\n", wants[0].text[4:6], "<|endoftext|>"]
    payload = {"model": MODEL, "prompt": prompts, "max_tokens": 32, "temperature": 0, "stop": stops, "seed": 1234}
    out = httpx.post(f"{base_url}/v1/completions", json=payload, timeout=60).json()
    for choice, want in zip(out["choices"], wants):
        cut = min((i for i in (want.text.find(s) for s in stops) if i >= 0), default=len(want.text))
        assert choice["text"] == want.text[:cut]
