"""Request shapes clients send that change no output, or only what they say: lm-eval's
`GET /tokenizer_info`, HELM's scoring with `echo` and `max_tokens=0`, neutral OpenAI fields
(`response_format` text, `parallel_tool_calls` without tools, `store`, `metadata`,
`reasoning_effort`), an int64 seed below zero, and `chat_template_kwargs` (Qwen3's
`enable_thinking`) rendered into the prompt. Each answer is compared with the same request
without the field, or with the in-process engine, `==` on every logprob."""

from __future__ import annotations

import httpx

from pocketllm import SamplingParams

from .conftest import MODEL

MESSAGES = [{"role": "user", "content": "hello"}]
THINKING = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and not "
            "enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}")


def _post(base_url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{base_url}{path}", json={"model": MODEL, **body}, timeout=60)


def test_tokenizer_info_is_the_tokenizer_config_with_the_chat_template(base_url, engine):
    info = httpx.get(f"{base_url}/tokenizer_info", timeout=30).json()
    assert info["tokenizer_class"] == "PreTrainedTokenizerFast" and info["eos_token"] == "<|endoftext|>"
    assert info["chat_template"] == engine.llm.chat_template
    assert not [key for key in info if key.endswith("_file")]


def test_echo_with_max_tokens_0_scores_the_prompt_and_generates_nothing(base_url, serial):
    prompt = [5, 6, 7, 8, 9]
    out = _post(base_url, "/v1/completions", {"prompt": prompt, "echo": True, "max_tokens": 0, "logprobs": 1}).json()
    (choice,) = out["choices"]
    scored = serial.generate(prompt, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1))
    assert choice["logprobs"]["token_logprobs"] == scored.prompt_logprobs  # the first is None
    assert len(choice["logprobs"]["tokens"]) == len(prompt) and choice["finish_reason"] == "length"
    assert out["usage"] == {"prompt_tokens": 5, "completion_tokens": 0, "total_tokens": 5}
    assert _post(base_url, "/v1/completions", {"prompt": prompt, "max_tokens": 0}).status_code == 400  # no echo


def test_neutral_fields_change_nothing(base_url):
    chat = {"messages": MESSAGES, "max_tokens": 4, "temperature": 0.9, "seed": 3, "logprobs": True}
    plain = _post(base_url, "/v1/chat/completions", chat).json()["choices"]
    neutral = {"response_format": {"type": "text"}, "parallel_tool_calls": False, "store": True,
               "metadata": {"run": "a"}, "reasoning_effort": "low", "user": "u"}
    assert _post(base_url, "/v1/chat/completions", {**chat, **neutral}).json()["choices"] == plain
    refused = _post(base_url, "/v1/chat/completions", {**chat, "tool_choice": "required"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "tool_choice"


def test_a_negative_seed_is_its_int64_bit_pattern(base_url):
    body = {"prompt": [1, 2, 3], "max_tokens": 6, "temperature": 1.0, "logprobs": 0}
    below = _post(base_url, "/v1/completions", {**body, "seed": -1}).json()["choices"]
    assert below == _post(base_url, "/v1/completions", {**body, "seed": 2**64 - 1}).json()["choices"]
    too_low = _post(base_url, "/v1/completions", {**body, "seed": -(2**63) - 1})
    assert too_low.status_code == 400 and too_low.json()["error"]["param"] == "seed"


def test_chat_template_kwargs_are_the_templates_variables(base_url, engine, monkeypatch):
    monkeypatch.setattr(engine.llm, "chat_template", THINKING)
    tokenizer = engine.llm.tokenizer

    def tokens(**extra) -> list[int]:
        return _post(base_url, "/tokenize", {"messages": MESSAGES, **extra}).json()["tokens"]

    off = "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert tokens(chat_template_kwargs={"enable_thinking": False}) == tokenizer.encode(off).ids
    assert tokens() == tokens(chat_template_kwargs={"enable_thinking": True}) == \
        tokenizer.encode(off.removesuffix("<think>\n\n</think>\n\n")).ids
    chat = {"messages": MESSAGES, "max_tokens": 1, "chat_template_kwargs": {"enable_thinking": False}}
    usage = _post(base_url, "/v1/chat/completions", chat).json()["usage"]
    assert usage["prompt_tokens"] == len(tokenizer.encode(off).ids)
    bad = _post(base_url, "/v1/chat/completions", {**chat, "chat_template_kwargs": {"messages": []}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template_kwargs"


def test_chat_logprob_bytes_are_each_tokens_own(base_url, serial):
    """`bytes` of each chat logprob token are that token's bytes, so a token inside a multibyte
    character gives its byte, not U+FFFD's three: joined, a reply's bytes decode to the reply's
    text, and the alternatives' bytes are their tokens' too. A random-weight model over a byte-level
    vocabulary emits such partial characters; the sampled sequence is checked to have some."""
    body = {"messages": MESSAGES, "max_tokens": 48, "temperature": 1.0, "seed": 11, "logprobs": True,
            "top_logprobs": 2}
    out = _post(base_url, "/v1/chat/completions", body).json()["choices"][0]
    content = out["logprobs"]["content"]
    joined = b"".join(bytes(entry["bytes"]) for entry in content)
    ids = [int(t["token"].removeprefix("token_id:")) for t in _post(
        base_url, "/v1/chat/completions", {**body, "return_tokens_as_token_ids": True}).json()["choices"][0]
        ["logprobs"]["content"]]
    assert joined.decode("utf-8", errors="replace") == serial.tokenizer.decode(ids, skip_special_tokens=False)
    assert any(entry["token"] == "\ufffd" and len(entry["bytes"]) == 1 for entry in content)
    for entry in content:
        for alt in entry["top_logprobs"]:
            assert len(alt["bytes"]) >= 1 and (alt["token"] == "\ufffd" or bytes(alt["bytes"]).decode() == alt["token"])
