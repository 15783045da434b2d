"""Stop strings and usage, streamed and not: with several stop strings matching, the text is cut at
the earliest match whatever their order in the list; a streamed response's usage chunk reports what
the same request answers unstreamed, and both count the tokens the response carries."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from pocketllm import SamplingParams

from .conftest import MODEL

MESSAGES = [{"role": "user", "content": "Say something."}]


def _overlapping_stops(text: str) -> tuple[int, str, str] | None:
    """(i, text[i:i+3], text[i+1:i+3]) for the first i where both are printable ASCII seen there
    first: they complete on the same token, the longer one starting one character earlier."""
    for i in range(len(text) - 2):
        long, short = text[i:i + 3], text[i + 1:i + 3]
        if long.isascii() and long.isprintable() and text.find(long) == i and text.find(short) == i + 1:
            return i, long, short
    return None


def _reply(base_url: str, path: str, body: dict[str, Any]) -> tuple[str, str | None]:
    """The first choice's text and finish reason, read from the stream when `body` streams."""
    if not body.get("stream"):
        choice = httpx.post(f"{base_url}{path}", json=body, timeout=60).json()["choices"][0]
        return (choice["message"]["content"] if "message" in choice else choice["text"]), choice["finish_reason"]
    text, finish = "", None
    with httpx.stream("POST", f"{base_url}{path}", json=body, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:])["choices"]:
                    text += (choice["delta"].get("content") or "") if "delta" in choice else choice["text"]
                    finish = choice["finish_reason"] or finish
    return text, finish


def _case(serial: Any, path: str) -> tuple[dict[str, Any], str, int, str, str]:
    """A seeded request whose serial text has two overlapping stop strings: the request, the serial
    text, where the earlier string starts and the two strings."""
    for seed in range(20):
        sampling = {"max_tokens": 40, "temperature": 1.0, "seed": seed}
        if path.endswith("chat/completions"):
            text = serial.chat(MESSAGES, SamplingParams(**sampling)).text
            body = {"model": MODEL, "messages": MESSAGES, **sampling}
        else:
            text = serial.generate([7, 8, 9], SamplingParams(**sampling)).text
            body = {"model": MODEL, "prompt": [7, 8, 9], **sampling}
        found = _overlapping_stops(text)
        if found is not None:
            return (body, text, *found)
    raise AssertionError("no seed gave a text with two overlapping printable stop strings")


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_the_earliest_stop_string_wins_whatever_its_place_in_the_list(base_url, serial, path, stream):
    """Two stop strings completed by the same token: the text is cut before the one starting first,
    listed first, last or after one that never matches (OpenAI's and vLLM's semantics)."""
    body, serial_text, cut, long, short = _case(serial, path)
    for stops in ([long, short], [short, long], ["\x00never", short, long]):
        text, finish = _reply(base_url, path, {**body, "stop": stops, "stream": stream})
        assert (text, finish) == (serial_text[:cut], "stop"), stops


def _streamed_usage(base_url: str, path: str, body: dict[str, Any]) -> tuple[dict[str, int], int]:
    """The usage chunk of the streamed response, and the tokens its chunks carried (by their logprobs)."""
    usages, tokens = [], 0
    payload = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{base_url}{path}", json=payload, timeout=60) as response:
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usages.append(chunk["usage"])
            for choice in chunk["choices"]:
                lp = choice["logprobs"] or {}
                tokens += len(lp.get("content") or lp.get("tokens") or [])
    assert len(usages) == 1
    return usages[0], tokens


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_streamed_usage_equals_the_unstreamed_one(base_url, serial, path):
    """n=2 and a stop string that cuts the first choice short: the choices' counts differ."""
    body, _, _, long, _ = _case(serial, path)
    body = {**body, "n": 2, "stop": [long]}
    if path.endswith("chat/completions"):
        prompt_tokens = len(serial.chat_prompt(MESSAGES))
        body["logprobs"] = True
    else:
        body["prompt"] = [body["prompt"], [1, 2, 3, 4, 5]]
        prompt_tokens = sum(map(len, body["prompt"]))
        body["logprobs"] = 0
    whole = httpx.post(f"{base_url}{path}", json=body, timeout=60).json()
    counted = sum(len(c["logprobs"].get("content") or c["logprobs"].get("tokens")) for c in whole["choices"])
    assert whole["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": counted,
                              "total_tokens": prompt_tokens + counted}
    assert whole["choices"][0]["finish_reason"] == "stop"
    usage, streamed_tokens = _streamed_usage(base_url, path, body)
    assert usage == whole["usage"] and streamed_tokens == counted
