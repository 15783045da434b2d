"""Shutting down: `pocketllm serve` answers, then shuts down on SIGTERM and SIGINT with its engine
closed; a server told to stop under an open stream lets it finish, and frees the slot; what still
runs after the graceful timeout ends in its terminal state, a stream with its final chunk and [DONE]."""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import httpx
import pytest

from pocketllm import AsyncLLM

from .conftest import MODEL, engine_args, running_server


class Client(threading.Thread):
    """One request on its own thread: its status and the lines of its body as they came, or what
    the connection raised (a body cut short)."""

    def __init__(self, url: str, path: str, body: dict[str, Any]) -> None:
        super().__init__(daemon=True)
        self.url, self.path, self.body = url, path, body
        self.status = 0
        self.lines: list[str] = []
        self.failure: httpx.HTTPError | None = None
        self.answered = threading.Event()  # a first line came, or the request ended

    def run(self) -> None:
        try:
            with httpx.stream("POST", f"{self.url}{self.path}", json=self.body, timeout=60) as response:
                self.status = response.status_code
                for line in response.iter_lines():
                    self.lines.append(line)
                    self.answered.set()
        except httpx.HTTPError as exc:
            self.failure = exc
        self.answered.set()

    def last_chunk(self) -> dict[str, Any]:
        """The last event before [DONE] of a stream that ended with [DONE]."""
        events = [line for line in self.lines if line.startswith("data: ")]
        assert self.failure is None and events[-1] == "data: [DONE]", (self.failure, self.lines[-3:])
        return json.loads(events[-2][6:])


def test_stopping_the_server_lets_open_streams_finish(serve_checkpoint):
    engine = AsyncLLM(engine_args(serve_checkpoint, max_batch_size=2))
    body = {"model": MODEL, "prompt": [1, 2], "max_tokens": 60, "ignore_eos": True, "stream": True}
    try:
        with running_server(engine) as url:
            client = Client(url, "/v1/completions", body)
            client.start()
            assert client.answered.wait(30)
        client.join(30)  # the server stopped once the stream was done
    finally:
        engine.close()
    assert client.last_chunk()["choices"][0]["finish_reason"] == "length"
    stats = engine.scheduler.get_stats()
    assert (stats.finished, stats.cancelled, stats.running) == (1, 0, 0) and engine.llm.slots.num_free == 2


def _wait_for(engine: AsyncLLM, running: int, waiting: int) -> None:
    deadline = time.monotonic() + 30
    while True:
        stats = engine.scheduler.get_stats()
        if (stats.running, stats.waiting) == (running, waiting):
            return
        assert time.monotonic() < deadline, stats
        time.sleep(0.005)


def test_the_graceful_timeout_ends_every_request_in_its_terminal_state(serve_checkpoint, monkeypatch, caplog):
    """Three requests running (two streams, one not streamed), and a stream and a request not
    streamed queued behind them, all longer than the 0.3 s graceful timeout: the running ones end
    with finish_reason "abort", each stream with its final chunk and [DONE], the queued stream too
    (its status line went out when it was queued); the queued request not streamed is answered
    503; nothing is cut, no error or traceback is logged, every request ends cancelled and every
    slot is free."""
    engine = AsyncLLM(engine_args(serve_checkpoint, max_batch_size=3))
    run = engine.llm.runner.run
    monkeypatch.setattr(engine.llm.runner, "run", lambda seqs: time.sleep(0.05) or run(seqs))  # 200 tokens: 10 s
    long = {"model": MODEL, "max_tokens": 200, "ignore_eos": True}
    chat = {**long, "messages": [{"role": "user", "content": "Hi"}], "stream": True}
    uvicorn_log = logging.getLogger("uvicorn")
    try:
        with running_server(engine, graceful_timeout=0.3) as url:
            uvicorn_log.addHandler(caplog.handler)  # uvicorn's loggers do not propagate to the root
            clients = [Client(url, "/v1/completions", {**long, "prompt": [1, 2], "stream": True}),
                       Client(url, "/v1/chat/completions", chat),
                       Client(url, "/v1/completions", {**long, "prompt": [3, 4]}),
                       Client(url, "/v1/completions", {**long, "prompt": [5, 6], "stream": True}),
                       Client(url, "/v1/completions", {**long, "prompt": [7, 8]})]
            for count, client in enumerate(clients, 1):
                client.start()
                _wait_for(engine, min(count, 3), max(0, count - 3))
            assert all(client.answered.wait(30) for client in clients[:2])
        for client in clients:
            client.join(30)
    finally:
        uvicorn_log.removeHandler(caplog.handler)
        engine.close()
    streamed, chatted, whole, queued_stream, queued = clients
    assert streamed.last_chunk()["choices"][0]["finish_reason"] == "abort"
    assert chatted.last_chunk()["choices"][0]["finish_reason"] == "abort"
    assert whole.status == 200 and json.loads("".join(whole.lines))["choices"][0]["finish_reason"] == "abort"
    assert queued_stream.status == 200 and queued_stream.last_chunk()["choices"][0]["finish_reason"] == "abort"
    assert queued.status == 503 and json.loads("".join(queued.lines))["error"]["type"] == "service_unavailable"
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info], caplog.text
    stats = engine.scheduler.get_stats()
    assert (stats.cancelled, stats.running, stats.waiting) == (5, 0, 0) and engine.llm.slots.num_free == 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("sig", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow)])
def test_serve_command_answers_and_exits_on_a_signal(serve_checkpoint, sig):
    port = _free_port()
    command = [sys.executable, "-m", "pocketllm.cli", "serve", "--model", str(serve_checkpoint), "--port", str(port),
               "--max-seq-len", "256", "--served-model-name", MODEL, "--max-batch-size", "2"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, process.communicate()[0]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                assert time.monotonic() < deadline, "pocketllm serve did not start"
                time.sleep(0.1)
        answer = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=30,
                            json={"model": MODEL, "prompt": "Hi", "max_tokens": 3, "temperature": 0})
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] >= 1
        process.send_signal(sig)
        output, _ = process.communicate(timeout=30)
        # uvicorn re-raises the signal once shut down: SIGINT is the command's Ctrl-C status 130.
        assert process.returncode == (130 if sig == signal.SIGINT else -sig), output
        assert "engine stopped, 2 slots free" in output
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
