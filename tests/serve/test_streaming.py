"""Streams: `echo` with `logprobs` streamed (the echoed prompt with its logprobs first, then the
tokens) adds up to the unstreamed response exactly, max_tokens=0 scoring too; a stream's status and
headers go out before any token is computed (the engine held in its forward, every slot taken);
input known to be bad before generation is still a plain 400 JSON body, not a stream."""

from __future__ import annotations

import contextlib
import json
import threading
from typing import Any

import httpx
import pytest

from pocketllm import SamplingParams

from .conftest import MAX_BATCH, MODEL, ids_of, wait_idle


def _stream(http: httpx.Client, body: dict) -> list[dict]:
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def _joined(chunks: list[dict]) -> tuple[list[dict], list[dict]]:
    """The streamed choices joined as the unstreamed response shows them, and each choice's first chunk."""
    choices: dict[int, dict] = {}
    firsts: dict[int, dict] = {}
    for chunk in chunks:
        for part in chunk["choices"]:
            firsts.setdefault(part["index"], part)
            joined = choices.setdefault(part["index"], {"index": part["index"], "text": "", "logprobs": None,
                                                        "finish_reason": None})
            joined["text"] += part["text"]
            joined["finish_reason"] = part["finish_reason"] or joined["finish_reason"]
            if part["logprobs"] is not None:
                lp = joined["logprobs"] = joined["logprobs"] or {key: [] for key in part["logprobs"]}
                for key, values in part["logprobs"].items():
                    lp[key] += values
    return [choices[i] for i in sorted(choices)], [firsts[i] for i in sorted(firsts)]


ECHO_CASES = [
    {"prompt": "The quick brown fox", "max_tokens": 8, "logprobs": 2, "temperature": 0.8, "seed": 5, "n": 2},
    {"prompt": [[5, 6, 7, 8], [9, 10]], "max_tokens": 6, "logprobs": 2, "temperature": 0,
     "return_tokens_as_token_ids": True},
    {"prompt": "Score me", "max_tokens": 0, "logprobs": 2},  # HELM's scoring shape
    {"prompt": [4, 5, 6], "max_tokens": 0},
    {"prompt": "abc", "max_tokens": 4, "temperature": 0},  # echo without logprobs
]


@pytest.mark.parametrize("case", ECHO_CASES, ids=["text-n2", "ids-2-prompts", "max-tokens-0", "max-tokens-0-no-lp",
                                                  "no-logprobs"])
def test_streamed_echo_adds_up_to_the_unstreamed_response(base_url, case):
    body = {"model": MODEL, "echo": True, "ignore_eos": True, **case}
    usage = {"stream_options": {"include_usage": True}}
    with httpx.Client(base_url=base_url, timeout=60) as http:
        whole = http.post("/v1/completions", json=body).json()
        chunks = _stream(http, {**body, **usage})
    joined, firsts = _joined(chunks[:-1])
    assert joined == whole["choices"]
    assert chunks[-1]["usage"] == whole["usage"]
    prompts = case["prompt"] if isinstance(case["prompt"], list) and isinstance(case["prompt"][0], list) else None
    for i, (first, choice) in enumerate(zip(firsts, whole["choices"])):  # each choice's echo comes first, alone
        assert first["text"] and choice["text"].startswith(first["text"])
        if isinstance(case["prompt"], str):
            assert first["text"] == case["prompt"]
        if case.get("logprobs") is not None:
            prompt_len = len(prompts[i]) if prompts else whole["usage"]["prompt_tokens"]
            assert len(first["logprobs"]["tokens"]) == prompt_len and first["logprobs"]["text_offset"][0] == 0
            assert first["logprobs"]["token_logprobs"][0] is None and first["logprobs"]["top_logprobs"][0] is None
    if case["max_tokens"] == 0:
        assert whole["usage"]["completion_tokens"] == 0 and len(chunks) == len(whole["choices"]) + 1


def test_streamed_echo_logprobs_are_the_engines_scores(base_url, serial):
    prompt = [7, 3, 9, 1, 4]
    body = {"model": MODEL, "prompt": prompt, "echo": True, "logprobs": 1, "max_tokens": 3, "temperature": 0,
            "ignore_eos": True, "return_tokens_as_token_ids": True}
    with httpx.Client(base_url=base_url, timeout=60) as http:
        chunks = _stream(http, body)
    (choice,), _ = _joined(chunks)
    want = serial.generate(prompt, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, logprobs=1,
                                                  prompt_logprobs=1))
    assert ids_of(choice["logprobs"]["tokens"]) == prompt + want.token_ids
    assert choice["logprobs"]["token_logprobs"] == want.prompt_logprobs + want.logprobs


@contextlib.contextmanager
def _held_forward(engine: Any, monkeypatch: pytest.MonkeyPatch):
    """The engine's forwards wait until the block is left (60 s at most): no token is computed."""
    gate, run = threading.Event(), engine.llm.runner.run

    def held(seqs):
        gate.wait(60)
        return run(seqs)

    monkeypatch.setattr(engine.llm.runner, "run", held)
    try:
        yield
    finally:
        gate.set()


def test_a_streams_headers_come_before_its_first_token(engine, base_url, serial, monkeypatch):
    """Every slot taken and one more request queued, with the engine held in its forward: each
    stream's status and headers arrive anyway; once let go, each stream's tokens are the serial
    engine's."""
    wait_idle(engine)
    bodies = [{"model": MODEL, "prompt": [2, 3, i], "max_tokens": 5, "temperature": 0.9, "seed": i, "logprobs": 0,
               "ignore_eos": True, "return_tokens_as_token_ids": True, "stream": True} for i in range(MAX_BATCH + 1)]
    limits = httpx.Limits(max_connections=MAX_BATCH + 2)
    before = engine.scheduler.get_stats().generated_tokens
    with httpx.Client(base_url=base_url, timeout=20, limits=limits) as http, contextlib.ExitStack() as streams:
        with _held_forward(engine, monkeypatch):
            responses = [streams.enter_context(http.stream("POST", "/v1/completions", json=b)) for b in bodies]
            stats = engine.scheduler.get_stats()
            assert all(r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
                       for r in responses)
            assert stats.generated_tokens == before and stats.running + stats.waiting == MAX_BATCH + 1, stats
        lines = [[line[6:] for line in r.iter_lines() if line.startswith("data: ")] for r in responses]
    for body, events in zip(bodies, lines):
        assert events[-1] == "[DONE]"
        tokens = [t for e in events[:-1] for t in ids_of(json.loads(e)["choices"][0]["logprobs"]["tokens"])]
        want = serial.generate(body["prompt"], SamplingParams(max_tokens=5, temperature=0.9, seed=body["seed"],
                                                              ignore_eos=True))
        assert tokens == want.token_ids
    wait_idle(engine)


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": [1, 2], "temperature": -1}),
    ("/v1/completions", {"prompt": [1, 999999]}),  # refused by the engine's prompt check at submission
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0}),
])
def test_bad_input_to_a_stream_is_a_plain_400(base_url, path, body):
    with httpx.Client(base_url=base_url, timeout=30) as http:
        response = http.post(path, json={"model": MODEL, "stream": True, **body})
    assert response.status_code == 400 and response.headers["content-type"] == "application/json"
    assert response.json()["error"]["type"] == "invalid_request_error"
