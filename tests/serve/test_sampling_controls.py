"""The logits controls through both routes, sent as the `openai` client sends them (OpenAI's
fields as arguments, vLLM's in `extra_body`): every token and logprob `==` the serial engine's with
the same SamplingParams; bad words as text, tokenized as vLLM does; stop strings wait for min_tokens."""

from __future__ import annotations

import pytest

from pocketllm import SamplingParams

from .conftest import MODEL, ids_of

AS_IDS = {"return_tokens_as_token_ids": True}
# (OpenAI's fields, vLLM's extra fields, the SamplingParams they make)
CASES = [
    ({"presence_penalty": 0.8, "frequency_penalty": 0.5}, {}, dict(presence_penalty=0.8, frequency_penalty=0.5)),
    ({"logit_bias": {"5": 3.0, "77": -100}}, {"repetition_penalty": 1.5},
     dict(logit_bias={5: 3.0, 77: -100.0}, repetition_penalty=1.5)),
    ({"temperature": 0.9, "seed": 3}, {"min_p": 0.3, "top_k": 20}, dict(temperature=0.9, seed=3, min_p=0.3, top_k=20)),
    ({"temperature": 1.0, "seed": 8}, {"min_tokens": 3, "allowed_token_ids": [97, 98, 99, 100, 255],
                                       "bad_words": ["ab", "ca"]},
     dict(temperature=1.0, seed=8, min_tokens=3, allowed_token_ids=(97, 98, 99, 100, 255),
          bad_words_token_ids=((97, 98), (99, 97)))),
]
IDS = ["penalties", "bias_repetition", "min_p", "masks"]


@pytest.mark.parametrize(("openai_fields", "extra", "fields"), CASES, ids=IDS)
def test_completions_with_controls_equal_the_engine(client, serial, openai_fields, extra, fields):
    prompt = [5, 6, 7, 5, 6, 7, 97]
    response = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, logprobs=2,
                                         **{"temperature": 0.0, **openai_fields}, extra_body={**AS_IDS, **extra})
    want = serial.generate(prompt, SamplingParams(max_tokens=10, logprobs=2, **{"temperature": 0.0, **fields}))
    choice = response.choices[0]
    assert ids_of(choice.logprobs.tokens) == want.token_ids and choice.logprobs.token_logprobs == want.logprobs
    assert choice.text == want.text and choice.finish_reason == want.finish_reason


@pytest.mark.parametrize(("openai_fields", "extra", "fields"), CASES, ids=IDS)
def test_chat_with_controls_equals_llm_chat(client, serial, openai_fields, extra, fields):
    messages = [{"role": "user", "content": "abcabc"}]
    response = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, logprobs=True,
                                              **{"temperature": 0.0, **openai_fields}, extra_body={**AS_IDS, **extra})
    want = serial.chat(messages, SamplingParams(max_tokens=8, **{"temperature": 0.0, **fields}))
    choice = response.choices[0]
    assert ids_of([c.token for c in choice.logprobs.content]) == want.token_ids
    assert [c.logprob for c in choice.logprobs.content] == want.logprobs and choice.message.content == want.text


def test_the_controls_change_the_answer(client):
    """They are applied, not accepted and dropped: +100 on a token makes greedy decoding pick it."""
    plain = client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=3, temperature=0)
    biased = client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=3, temperature=0,
                                       logit_bias={"120": 100})
    assert biased.choices[0].text == "xxx" != plain.choices[0].text


def test_stop_strings_wait_for_min_tokens(client, serial):
    """As vLLM: before min_tokens tokens no stop string ends a choice; from then on one that ends in
    the new text does (the text cut before it)."""
    prompt = [72, 101, 108, 108, 111]  # "Hello": the tiny checkpoint then repeats one character
    want = serial.generate(prompt, SamplingParams(max_tokens=12, temperature=0))
    stop = want.text[0]
    early = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stop=[stop])
    assert early.choices[0].text == "" and early.choices[0].finish_reason == "stop"
    held = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stop=[stop],
                                     extra_body={"min_tokens": 4})
    before = serial.tokenizer.decode(want.token_ids[:3])
    assert held.choices[0].text == want.text[:want.text.index(stop, len(before))]
    assert held.choices[0].finish_reason == "stop" and held.usage.completion_tokens == 4
