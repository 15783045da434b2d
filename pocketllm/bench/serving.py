"""Serving benchmark (`pocketllm bench --serving`): what the HTTP layer costs.

The same workload runs twice on the same checkpoint and engine options: through `pocketllm serve`
(a separate process on 127.0.0.1, so the clients do not share its interpreter) with `clients`
concurrent streaming clients, and on an in-process AsyncLLM with as many concurrent streams.
Each request is a token-id prompt (16..64 tokens), greedy, `new_tokens` tokens (ignore_eos).
Both sides run the engine on all cores but one, as `pocketllm serve` does by default (the event
loop keeps one). Reported per side: TTFT p50/p99 (from the request's start, queueing included), wall time and
generated tokens/s over it; and whether every request's tokens were the same on both sides.
Writes serving.json and serving.md into --out. Needs the serve extra (fastapi, uvicorn, httpx).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..async_llm import AsyncLLM
from ..config import EngineArgs
from ..models import cached_checkpoint
from ..outputs import GenerationResult
from ..sampling import SamplingParams
from ..scheduler.stats import percentile
from .report import load_average, machine_info, save_report

MAX_SEQ_LEN = 512
Request = tuple[list[int], int]  # prompt, tokens to generate


@dataclass
class Side:
    name: str
    wall_s: float
    tokens: int
    ttft_p50_s: float
    ttft_p99_s: float

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s


def workload(count: int, new_tokens: int, vocab_size: int, seed: int) -> list[Request]:
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, vocab_size, int(rng.integers(16, 65))).tolist(), new_tokens) for _ in range(count)]


async def _measure(name: str, requests: list[Request], clients: int,
                   one: Callable[[Request], Awaitable[tuple[float, list[int]]]]) -> tuple[Side, list[list[int]]]:
    """Run `requests` with at most `clients` at a time; TTFTs and tokens, with progress on stderr."""
    gate = asyncio.Semaphore(clients)
    done = 0

    async def limited(request: Request) -> tuple[float, list[int]]:
        nonlocal done
        async with gate:
            start = time.perf_counter()
            ttft, tokens = await one(request)
            done += 1
            print(f"\rserving: {name} {done}/{len(requests)} requests", end="", file=sys.stderr, flush=True)
            return ttft - start, tokens

    start = time.perf_counter()
    results = await asyncio.gather(*(limited(r) for r in requests))
    wall = time.perf_counter() - start
    print(file=sys.stderr)
    ttfts = [t for t, _ in results]
    side = Side(name, wall, sum(len(tokens) for _, tokens in results), percentile(ttfts, 50), percentile(ttfts, 99))
    return side, [tokens for _, tokens in results]


async def _over_http(url: str, requests: list[Request], clients: int) -> tuple[Side, list[list[int]]]:
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=600, limits=httpx.Limits(max_connections=clients)) as http:
        async def one(request: Request) -> tuple[float, list[int]]:
            prompt, new_tokens = request
            body = {"prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
                    "logprobs": 0, "return_tokens_as_token_ids": True}
            first, tokens = 0.0, []
            async with http.stream("POST", "/v1/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        first = first or time.perf_counter()
                        logprobs = json.loads(line[6:])["choices"][0]["logprobs"] or {"tokens": []}
                        tokens += [int(t.removeprefix("token_id:")) for t in logprobs["tokens"]]
            return first, tokens

        return await _measure("http", requests, clients, one)


async def _in_process(engine: AsyncLLM, requests: list[Request], clients: int) -> tuple[Side, list[list[int]]]:
    async def one(request: Request) -> tuple[float, list[int]]:
        prompt, new_tokens = request
        first, tokens = 0.0, []
        async for item in engine.stream(prompt, SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)):
            if not isinstance(item, GenerationResult):
                first = first or time.perf_counter()
                tokens.append(item.token_id)
        return first, tokens

    return await _measure("in-process", requests, clients, one)


@contextlib.contextmanager
def _server(path: Path, batch: int, threads: int) -> Iterator[str]:
    """`pocketllm serve` on a free loopback port, until it answers /health; stopped on leaving."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "pocketllm.cli", "serve", "--model", str(path), "--port", str(port),
               "--max-seq-len", str(MAX_SEQ_LEN), "--max-batch-size", str(batch), "--threads", str(threads)]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        import httpx

        deadline = time.monotonic() + 120
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"pocketllm serve exited with status {process.returncode}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError("pocketllm serve did not answer /health within 120 s")
            time.sleep(0.2)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(60)


def run(out: Path, quick: bool, seed: int, preset: str | None, clients: int) -> str:
    """Both sides on one workload; returns the Markdown table (also written to serving.md)."""
    preset = preset or "tiny"
    count, new_tokens = (2 * clients, 8) if quick else (4 * clients, 32)
    path = cached_checkpoint(preset, seed)
    threads = max(1, (os.cpu_count() or 1) - 1)  # as `pocketllm serve` runs: a core left to the event loop
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    engine = AsyncLLM(EngineArgs(model=str(path), max_seq_len=MAX_SEQ_LEN,
                                 backend_options={"max_batch_size": clients}))
    requests = workload(count, new_tokens, engine.llm.model_config.vocab_size, seed)
    machine = machine_info()
    try:
        asyncio.run(_in_process(engine, requests[:clients], clients))  # warm-up
        local, local_tokens = asyncio.run(_in_process(engine, requests, clients))
    finally:
        engine.close()
        torch.set_num_threads(previous_threads)
    with _server(path, clients, threads) as url:
        asyncio.run(_over_http(url, requests[:clients], clients))  # warm-up
        http, http_tokens = asyncio.run(_over_http(url, requests, clients))
    machine["load_average_1min_at_end"] = load_average()
    same = sum(a == b for a, b in zip(local_tokens, http_tokens))
    report: dict[str, Any] = {"machine": machine, "config": {"preset": preset, "clients": clients, "requests": count,
                                                             "new_tokens": new_tokens, "seed": seed,
                                                             "torch_threads": threads},
                              "sides": [{**asdict(s), "tokens_per_s": s.tokens_per_s} for s in (local, http)],
                              "same_tokens": same}
    lines = [f"Serving benchmark: preset {preset}, {count} requests x {new_tokens} tokens, {clients} clients, "
             f"{clients} slots, {threads} torch threads ({machine['processor']}, "
             f"load {machine['load_average_1min_at_start']})", "",
             "| side | TTFT p50 | TTFT p99 | wall | tokens/s |", "|---|---|---|---|---|"]
    lines += [f"| {s.name} | {1000 * s.ttft_p50_s:.1f} ms | {1000 * s.ttft_p99_s:.1f} ms | {s.wall_s:.2f} s | "
              f"{s.tokens_per_s:.1f} |" for s in (local, http)]
    lines += ["", f"HTTP / in-process tokens/s: {http.tokens_per_s / local.tokens_per_s:.2f}x; "
                  f"requests with the same tokens on both sides: {same}/{count}"]
    text = "\n".join(lines) + "\n"
    save_report(out, "serving", report, text)
    return text
