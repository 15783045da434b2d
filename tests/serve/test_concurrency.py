"""50 concurrent clients, some leaving mid-stream or mid-request: every request ends in one
terminal state, no slot leaks, and the clients that stayed get their serial runs' bits."""

from __future__ import annotations

import asyncio
import itertools
import json

import httpx

from pocketllm import SamplingParams

from .conftest import MAX_BATCH, MODEL, ids_of, wait_idle

CLIENTS = 50


def _request(i: int) -> dict:
    sampling = {"temperature": 0} if i % 2 else {"temperature": 0.8, "seed": i, "top_k": 50}
    return {"model": MODEL, "prompt": [1 + i % 7, 2 + i % 11, 3 + i], "max_tokens": 24, "logprobs": 1,
            "ignore_eos": True, "return_tokens_as_token_ids": True, **sampling}


async def _streaming_client(http: httpx.AsyncClient, i: int, leave_after: int | None) -> tuple[list, list] | None:
    """The tokens and logprobs streamed to client i; None if it left after `leave_after` chunks."""
    tokens: list[int] = []
    logprobs: list[float] = []
    async with http.stream("POST", "/v1/completions", json={**_request(i), "stream": True}) as response:
        assert response.status_code == 200
        chunks = 0
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunks += 1
            if leave_after is not None and chunks > leave_after:
                return None  # leaving the block closes the connection mid-stream
            lp = json.loads(line[6:])["choices"][0]["logprobs"]
            if lp:
                tokens += ids_of(lp["tokens"])
                logprobs += lp["token_logprobs"]
    return tokens, logprobs


async def _impatient_client(http: httpx.AsyncClient, i: int) -> None:
    """A non-streaming client that gives up while its request runs."""
    task = asyncio.ensure_future(http.post("/v1/completions", json={**_request(i), "max_tokens": 200}))
    await asyncio.sleep(0.05)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def _clients(base_url: str) -> list:
    limits = httpx.Limits(max_connections=CLIENTS, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=limits) as http:
        jobs = []
        for i in range(CLIENTS):
            if i % 10 == 9:
                jobs.append(_impatient_client(http, i))
            else:
                jobs.append(_streaming_client(http, i, 2 + i % 5 if i % 3 == 0 else None))
        return await asyncio.gather(*jobs)


def test_concurrent_clients_with_disconnects(engine, base_url, serial, monkeypatch):
    wait_idle(engine)
    submitted = itertools.count()
    submit = engine.scheduler.submit_request

    def counted(*args, **kwargs):
        request_id = submit(*args, **kwargs)
        next(submitted)
        return request_id

    monkeypatch.setattr(engine.scheduler, "submit_request", counted)
    before = engine.scheduler.get_stats()
    outcomes = asyncio.run(_clients(base_url))
    wait_idle(engine)
    after = engine.scheduler.get_stats()
    ended = {k: getattr(after, k) - getattr(before, k) for k in ("finished", "cancelled", "errored")}
    # An impatient client may leave before its request was submitted: then the engine never saw it.
    engine_requests = next(submitted)
    assert CLIENTS - CLIENTS // 10 <= engine_requests <= CLIENTS
    assert ended["finished"] + ended["cancelled"] == engine_requests and ended["errored"] == 0, ended
    assert ended["cancelled"] >= sum(1 for i in range(CLIENTS) if i % 3 == 0 and i % 10 != 9)
    assert engine.llm.slots.num_free == MAX_BATCH and after.uncollected == 0
    survivors = [(i, out) for i, out in enumerate(outcomes) if out is not None]
    assert len(survivors) == sum(1 for i in range(CLIENTS) if i % 3 and i % 10 != 9)
    for i, (tokens, logprobs) in survivors:
        body = _request(i)
        want = serial.generate(body["prompt"], SamplingParams(
            max_tokens=24, logprobs=1, ignore_eos=True, temperature=body["temperature"], seed=body.get("seed"),
            top_k=body.get("top_k", 0)))
        assert tokens == want.token_ids and logprobs == want.logprobs, i
