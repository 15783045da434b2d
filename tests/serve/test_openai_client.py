"""The real `openai` client against the server: completions (text and token-id prompts, n, seeds,
logprobs, echo), chat, streaming; every token and logprob `==` the serial engine's."""

from __future__ import annotations

import httpx
import pytest

from pocketllm import SamplingParams

from .conftest import MAX_BATCH, MAX_SEQ_LEN, MODEL, ids_of

AS_IDS = {"return_tokens_as_token_ids": True}
PROMPTS = [[1, 2, 3, 4], [200, 17, 99], [5] * 40]


def _top_values(top: dict[str, float], as_ids: bool = True) -> dict[int, float]:
    return {int(k.removeprefix("token_id:")): v for k, v in top.items()}


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=0.9, top_k=40, top_p=0.9, seed=11)])
def test_completions_equal_the_engine(client, serial, sampling):
    extra = {**AS_IDS, "top_k": sampling.get("top_k", 0)}
    args = {k: v for k, v in sampling.items() if k != "top_k"}
    response = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=12, logprobs=3, extra_body=extra,
                                         **args)
    assert [c.index for c in response.choices] == [0, 1, 2]
    for prompt, choice in zip(PROMPTS, response.choices):
        want = serial.generate(prompt, SamplingParams(max_tokens=12, logprobs=3, **sampling))
        assert ids_of(choice.logprobs.tokens) == want.token_ids
        assert choice.logprobs.token_logprobs == want.logprobs
        for top, want_top, token, lp in zip(choice.logprobs.top_logprobs, want.top_logprobs, want.token_ids,
                                            want.logprobs):
            assert _top_values(top) == {**dict(want_top), token: lp}
        assert choice.text == want.text and choice.finish_reason == want.finish_reason
    assert response.usage.prompt_tokens == sum(map(len, PROMPTS))
    assert response.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in response.choices)


def test_text_prompt_and_seeded_n(client, serial):
    response = client.completions.create(model=MODEL, prompt="Hello there", max_tokens=10, temperature=1.0, seed=7,
                                         n=3, logprobs=0, extra_body=AS_IDS)
    prompt = serial.tokenizer.encode("Hello there", add_special_tokens=False).ids
    for i, choice in enumerate(response.choices):
        want = serial.generate(prompt, SamplingParams(max_tokens=10, temperature=1.0, seed=7 + i))
        assert ids_of(choice.logprobs.tokens) == want.token_ids and choice.logprobs.token_logprobs == want.logprobs
        assert choice.text == want.text


def test_echo_scores_the_prompt(client, serial):
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0, logprobs=2,
                                         echo=True, extra_body=AS_IDS)
    lp = response.choices[0].logprobs
    want = serial.generate(prompt, SamplingParams(max_tokens=1, temperature=0, logprobs=2, prompt_logprobs=2))
    assert ids_of(lp.tokens) == prompt + want.token_ids
    assert lp.token_logprobs == want.prompt_logprobs + want.logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for top, want_top, token, token_lp in zip(lp.top_logprobs[1:len(prompt)], want.prompt_top_logprobs[1:],
                                              prompt[1:], want.prompt_logprobs[1:]):
        assert _top_values(top) == {**dict(want_top), token: token_lp}
    assert response.choices[0].text == serial.tokenizer.decode(prompt) + want.text


def test_streamed_completion_equals_the_engine(client, serial):
    stream = client.completions.create(model=MODEL, prompt=[7, 8, 9], max_tokens=20, temperature=0.7, seed=3,
                                       logprobs=1, stream=True, stream_options={"include_usage": True},
                                       extra_body=AS_IDS)
    chunks = list(stream)
    want = serial.generate([7, 8, 9], SamplingParams(max_tokens=20, temperature=0.7, seed=3, logprobs=1))
    choices = [c.choices[0] for c in chunks if c.choices]
    assert "".join(c.text for c in choices) == want.text
    assert [t for c in choices if c.logprobs for t in ids_of(c.logprobs.tokens)] == want.token_ids
    assert [x for c in choices if c.logprobs for x in c.logprobs.token_logprobs] == want.logprobs
    assert choices[-1].finish_reason == want.finish_reason
    assert chunks[-1].usage.completion_tokens == len(want.token_ids)


def test_stop_strings_cut_the_text(client, serial):
    prompt = [72, 101, 108, 108, 111]  # "Hello": the tiny checkpoint then repeats "o"
    want = serial.generate(prompt, SamplingParams(max_tokens=12, temperature=0))
    stop = want.text[3:5]
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stop=[stop])
    assert response.choices[0].text == want.text[:want.text.index(stop)]
    assert response.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stop=stop,
                                         stream=True)
    assert "".join(c.choices[0].text for c in streamed) == response.choices[0].text


def test_chat_equals_llm_chat(client, serial):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    response = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=9, temperature=0.8, seed=5,
                                              logprobs=True, top_logprobs=2, extra_body=AS_IDS)
    want = serial.chat(messages, SamplingParams(max_tokens=9, temperature=0.8, seed=5, logprobs=2))
    choice = response.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == want.text
    assert ids_of([c.token for c in choice.logprobs.content]) == want.token_ids
    assert [c.logprob for c in choice.logprobs.content] == want.logprobs
    assert [[(int(t.token[9:]), t.logprob) for t in c.top_logprobs] for c in choice.logprobs.content] == \
        [[tuple(x) for x in top] for top in want.top_logprobs]
    assert response.usage.prompt_tokens == len(want.prompt_tokens)
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=9, temperature=0.8, seed=5,
                                            stream=True)
    chunks = [c.choices[0] for c in stream]
    assert chunks[0].delta.role == "assistant"
    assert "".join(c.delta.content or "" for c in chunks) == want.text
    assert chunks[-1].finish_reason == want.finish_reason


def test_chat_default_max_tokens_fills_the_context(client, serial):
    messages = [{"role": "user", "content": "x" * 20}]
    response = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                              extra_body={"ignore_eos": True})
    prompt = serial.chat_prompt(messages)
    assert response.usage.completion_tokens == MAX_SEQ_LEN - len(prompt)


def test_models_health_tokenize_metrics(client, base_url, serial):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{base_url}/health").status_code == 200
    tokens = httpx.post(f"{base_url}/tokenize", json={"prompt": "héllo"}).json()
    assert tokens["tokens"] == serial.tokenizer.encode("héllo", add_special_tokens=False).ids
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == MAX_SEQ_LEN
    chat = httpx.post(f"{base_url}/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["tokens"] == serial.chat_prompt([{"role": "user", "content": "Hi"}])
    assert httpx.post(f"{base_url}/detokenize", json={"tokens": tokens["tokens"]}).json() == {"prompt": "héllo"}
    scrape = httpx.get(f"{base_url}/metrics")
    stats = httpx.get(f"{base_url}/metrics", params={"format": "json"}).json()
    assert stats["finished"] >= 1 and scrape.headers["content-type"].startswith("text/plain; version=")
    from prometheus_client.parser import text_string_to_metric_families

    families = {f.name: f for f in text_string_to_metric_families(scrape.text)}
    generated, free = families["pocketllm_generated_tokens"], families["pocketllm_free_slots"]
    assert generated.type == "counter" and generated.samples[0].name == "pocketllm_generated_tokens_total"
    assert free.type == "gauge" and free.documentation == "cache slots free"
    assert generated.samples[0].value >= stats["finished"] and free.samples[0].value <= MAX_BATCH
    assert all(f.documentation for f in families.values()) and len(families) == len(stats)


def test_echo_scores_survive_a_stop_string(client, serial):
    """A stop string cancels the engine's request; its prompt logprobs still come back."""
    prompt = [72, 101, 108, 108, 111]
    want = serial.generate(prompt, SamplingParams(max_tokens=12, temperature=0, prompt_logprobs=1))
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, logprobs=1,
                                         echo=True, stop=[want.text[:2]], extra_body=AS_IDS)
    choice = response.choices[0]
    assert choice.finish_reason == "stop" and choice.text == serial.tokenizer.decode(prompt)
    assert choice.logprobs.token_logprobs[:len(prompt)] == want.prompt_logprobs
