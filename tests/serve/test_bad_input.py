"""Bad input is a 400 (404 for an unknown model) with an OpenAI-style body naming the field,
never a 500, and the server keeps serving; refused parameters are refused, not ignored; a full
queue is a 429."""

from __future__ import annotations

import json
import logging
import threading
import time

import httpx
import pytest

from pocketllm import AsyncLLM

from .conftest import MAX_SEQ_LEN, MODEL, engine_args, running_server, wait_idle

GOOD = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 2}
MESSAGES = [{"role": "user", "content": "x"}]
CASES = [
    ("/v1/completions", {"max_tokens": "5"}, "max_tokens"),
    ("/v1/completions", {"max_tokens": 2.5}, "max_tokens"),
    ("/v1/completions", {"max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"temperature": -1}, "temperature"),
    ("/v1/completions", {"temperature": "hot"}, "temperature"),
    ("/v1/completions", {"top_p": 0}, "top_p"),
    ("/v1/completions", {"top_k": -5}, "top_k"),
    ("/v1/completions", {"seed": -(2**63) - 1}, "seed"),  # below int64 (a negative int64 is its bit pattern)
    ("/v1/completions", {"n": 0}, "n"),
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ("/v1/completions", {"echo": True, "logprobs": 50}, "logprobs"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": [[]]}, "prompt"),
    ("/v1/completions", {"prompt": [1, "a"]}, "prompt"),
    ("/v1/completions", {"prompt": [999999]}, "prompt"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": [1] * MAX_SEQ_LEN}, "prompt"),
    ("/v1/completions", {"stop": [""]}, "stop"),
    ("/v1/completions", {"stop_token_ids": [99999]}, "stop_token_ids"),
    ("/v1/completions", {"best_of": 3}, "best_of"),
    ("/v1/completions", {"logit_bias": {"5": 100.5}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"five": 1.0}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"-1": 1.0}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"999999": 1.0}}, "logit_bias"),
    ("/v1/completions", {"logit_bias": {"5": "up"}}, "logit_bias.5"),
    ("/v1/completions", {"presence_penalty": 2.5}, "presence_penalty"),
    ("/v1/completions", {"frequency_penalty": -3}, "frequency_penalty"),
    ("/v1/completions", {"repetition_penalty": 0}, "repetition_penalty"),
    ("/v1/completions", {"min_p": 1.5}, "min_p"),
    ("/v1/completions", {"min_tokens": 3}, "min_tokens"),  # more than max_tokens (2)
    ("/v1/completions", {"min_tokens": -1}, "min_tokens"),
    ("/v1/completions", {"allowed_token_ids": []}, "allowed_token_ids"),
    ("/v1/completions", {"allowed_token_ids": [1, 999999]}, "allowed_token_ids"),
    ("/v1/completions", {"bad_words": [" "]}, "bad_words"),
    ("/v1/completions", {"bad_words": "word"}, "bad_words"),
    ("/v1/chat/completions", {"messages": MESSAGES, "presence_penalty": -2.01}, "presence_penalty"),
    ("/v1/chat/completions", {"messages": MESSAGES, "logit_bias": {"300": 1}}, "logit_bias"),
    ("/v1/chat/completions", {"messages": MESSAGES, "min_tokens": 5, "max_completion_tokens": 4}, "min_tokens"),
    ("/v1/chat/completions", {"messages": MESSAGES, "bad_words": [""]}, "bad_words"),
    ("/v1/completions", {"suffix": "x"}, "suffix"),
    ("/v1/completions", {"stream": True, "temperature": -1}, "temperature"),  # a stream's bad input: a plain 400
    ("/v1/completions", {"no_such_field": 1}, "no_such_field"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 30},
     "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
     "tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x" * MAX_SEQ_LEN}], "max_tokens": 4},
     "messages"),
    # An error names the field the client sent: max_completion_tokens is chat's max_tokens.
    ("/v1/chat/completions", {"messages": MESSAGES, "max_completion_tokens": -1}, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_completion_tokens": 10**9}, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_completion_tokens": 0, "max_tokens": 5},
     "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 10**9}, "max_tokens"),
    ("/v1/chat/completions", {"messages": MESSAGES, "logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": MESSAGES, "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/completions", {"max_tokens": 10**9}, "max_tokens"),
    ("/v1/completions", {"prompt": [1] * (MAX_SEQ_LEN - 5), "max_tokens": 10}, "max_tokens"),
    ("/v1/completions", {"prompt": [1] * (MAX_SEQ_LEN - 5), "max_tokens": None}, "prompt"),  # 16 by default
    ("/v1/completions", {"prompt": ["a", ""]}, "prompt"),
    ("/v1/completions", {"prompt": [1, 2.5]}, "prompt"),
    ("/v1/completions", {"stream_options": {"include_usage": True}}, "stream_options"),
]


IDS = [f"{i}-{path[4:]}-{param}" for i, (path, _, param) in enumerate(CASES)]


@pytest.mark.parametrize(("path", "change", "param"), CASES, ids=IDS)
def test_bad_input_is_a_400_naming_the_field(base_url, path, change, param):
    body = {**GOOD, **change}
    if path.endswith("chat/completions"):
        body.pop("prompt")
    response = httpx.post(f"{base_url}{path}", json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error" and error["code"] == 400
    assert error["message"].startswith(param.split(".")[0])
    assert httpx.post(f"{base_url}/v1/completions", json=GOOD, timeout=30).status_code == 200


def test_malformed_json_unknown_model_and_bad_tokens(base_url):
    bad_json = httpx.post(f"{base_url}/v1/completions", content=b'{"prompt": [1,', timeout=30,
                          headers={"content-type": "application/json"})
    assert bad_json.status_code == 400 and "JSON" in bad_json.json()["error"]["message"]
    for content, kind in [(b'{"prompt": [1]}', "text/plain"), (b"[1, 2]", "application/json"), (b"", "")]:
        not_an_object = httpx.post(f"{base_url}/v1/completions", content=content, headers={"content-type": kind})
        assert not_an_object.status_code == 400
        assert "the body must be a JSON object" in not_an_object.json()["error"]["message"], not_an_object.text
    unknown = httpx.post(f"{base_url}/v1/completions", json={**GOOD, "model": "gpt-4"}, timeout=30)
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "model"
    detok = httpx.post(f"{base_url}/detokenize", json={"tokens": [1, 10**9]}, timeout=30)
    assert detok.status_code == 400 and detok.json()["error"]["param"] == "tokens"
    assert httpx.post(f"{base_url}/v1/completions", json=GOOD, timeout=30).status_code == 200


@pytest.mark.parametrize(("prompt", "message"), [
    (["a", ""], "prompt[1] must not be an empty string"),
    ([[1, 2], [3, 999999]], "prompt[1]: prompt_tokens[1]=999999 is outside the vocabulary"),
    ([[1, 2], [1] * MAX_SEQ_LEN], "prompt[1]: prompt length"),
    ([1, 2.5], "prompt must be one of str, list[str], list[int], list[list[int]]"),
])
def test_an_error_says_which_prompt_and_what_a_prompt_may_be(base_url, prompt, message):
    error = httpx.post(f"{base_url}/v1/completions", json={**GOOD, "prompt": prompt}, timeout=30).json()["error"]
    assert error["message"].startswith(message) and error["param"] == "prompt", error


def test_a_max_tokens_error_says_how_many_fit(base_url):
    prompt = [1] * (MAX_SEQ_LEN - 5)
    error = httpx.post(f"{base_url}/v1/completions", json={**GOOD, "prompt": prompt, "max_tokens": 10},
                       timeout=30).json()["error"]
    assert error["message"].startswith("max_tokens must be at most 5 ") and error["message"].endswith("got 10")


@pytest.mark.parametrize(("method", "path", "status", "words"), [
    ("GET", "/v1/completions", 405, ["GET /v1/completions", "Method Not Allowed"]),
    ("POST", "/v1/no-such-endpoint", 404, ["POST /v1/no-such-endpoint", "Not Found"]),
    ("GET", "/metrics?format=xml", 400, ["format", "'prometheus'", "'json'", "'xml'"]),
])
def test_a_wrong_path_method_or_format_is_an_openai_error(base_url, method, path, status, words):
    response = httpx.request(method, f"{base_url}{path}", timeout=30)
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    assert all(word in error["message"] for word in words), error
    if status == 405:
        assert response.headers["allow"] == "POST"


def test_an_engine_failure_is_a_clean_500(engine, base_url, monkeypatch, caplog):
    """The engine failing a request is a 500 naming why (an error event, then [DONE], in a stream):
    answered by the app, so no traceback is logged for it and the connection serves on."""
    def fail(seqs):
        raise RuntimeError("injected forward failure")

    uvicorn_log = logging.getLogger("uvicorn")
    uvicorn_log.addHandler(caplog.handler)  # uvicorn's loggers do not propagate to the root
    try:
        with httpx.Client(base_url=base_url, timeout=30) as http:
            with monkeypatch.context() as patch:
                patch.setattr(engine.llm.runner, "run", fail)
                whole = http.post("/v1/completions", json=GOOD)
                streamed = http.post("/v1/completions", json={**GOOD, "stream": True}).text.split("\n\n")
            assert http.post("/v1/completions", json=GOOD).status_code == 200
    finally:
        uvicorn_log.removeHandler(caplog.handler)
    assert whole.status_code == 500
    error = whole.json()["error"]
    assert error["type"] == "internal_error" and "injected forward failure" in error["message"]
    assert json.loads(streamed[0][6:])["error"]["code"] == 500 and streamed[1] == "data: [DONE]"
    assert not [r for r in caplog.records if r.name.startswith("uvicorn") and r.levelno >= logging.ERROR], caplog.text
    wait_idle(engine)


def test_full_queue_is_a_429(serve_checkpoint, monkeypatch):
    """One slot, one waiting place: with the engine held in its forward, a third request is refused."""
    engine = AsyncLLM(engine_args(serve_checkpoint, max_batch_size=1, max_waiting=1))
    gate, run = threading.Event(), engine.llm.runner.run
    monkeypatch.setattr(engine.llm.runner, "run", lambda seqs: gate.wait(30) and run(seqs))
    try:
        with running_server(engine) as url, httpx.Client(base_url=url, timeout=60) as http:
            codes: list[int] = []
            posts = [threading.Thread(target=lambda: codes.append(http.post("/v1/completions", json=GOOD).status_code))
                     for _ in range(2)]
            for count, post in enumerate(posts, 1):  # one runs (held in its forward), then one waits
                post.start()
                while (lambda s: s.running + s.waiting)(engine.scheduler.get_stats()) < count:
                    time.sleep(0.005)
            full = http.post("/v1/completions", json=GOOD)
            assert full.status_code == 429 and full.json()["error"]["type"] == "rate_limit_error"
            gate.set()
            for post in posts:
                post.join()
            assert codes == [200, 200]
    finally:
        gate.set()
        engine.close()
    assert engine.llm.slots.num_free == 1


def test_engine_stays_idle_after_errors(engine, base_url):
    wait_idle(engine)
