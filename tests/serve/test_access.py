"""`--api-key` and `--allowed-origins` (vLLM's flags): the /v1 routes answer a request without the
key, or with another, 401 in OpenAI's shape, and with it as they do on an open server; health,
metrics and tokenization stay open; a browser's preflight from an allowed origin is answered with
that origin, one from elsewhere is not."""

from __future__ import annotations

import httpx
import pytest

from .conftest import MODEL, openai, running_server

KEY = "sk-test-123"
ORIGIN = "http://notebook.example:8888"


@pytest.fixture(scope="module")
def guarded(engine):
    with running_server(engine, api_key=KEY, allowed_origins=[ORIGIN]) as url:
        yield url


def test_the_v1_routes_need_the_key(guarded, base_url):
    for headers in ({}, {"Authorization": "Bearer sk-other"}, {"Authorization": KEY}):
        denied = httpx.get(f"{guarded}/v1/models", headers=headers, timeout=30)
        assert denied.status_code == 401 and denied.json()["error"]["type"] == "authentication_error"
        assert denied.headers["www-authenticate"] == "Bearer"
    assert httpx.get(f"{guarded}/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).status_code == 200
    for open_route in ("/health", "/metrics", "/tokenizer_info"):
        assert httpx.get(f"{guarded}{open_route}", timeout=30).status_code == 200
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "seed": 1}
    keyed = openai.OpenAI(base_url=f"{guarded}/v1", api_key=KEY, max_retries=0, timeout=60)
    unguarded = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60)
    assert keyed.chat.completions.create(**body).choices[0].message.content == \
        unguarded.chat.completions.create(**body).choices[0].message.content
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{guarded}/v1", api_key="sk-other", max_retries=0).models.list()


def test_a_preflight_from_an_allowed_origin_is_answered(guarded):
    def preflight(origin: str) -> httpx.Response:
        return httpx.options(f"{guarded}/v1/completions", timeout=30, headers={
            "Origin": origin, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type"})

    allowed = preflight(ORIGIN)
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == ORIGIN
    assert "access-control-allow-origin" not in preflight("http://elsewhere.example").headers
    answer = httpx.get(f"{guarded}/v1/models", headers={"Origin": ORIGIN, "Authorization": f"Bearer {KEY}"}, timeout=30)
    assert answer.headers["access-control-allow-origin"] == ORIGIN
