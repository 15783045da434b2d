"""Shutting down: `pocketllm serve` answers, then shuts down on SIGTERM and SIGINT with its engine
closed; a server told to stop under an open stream lets it finish, and frees the slot."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from pocketllm import AsyncLLM

from .conftest import MODEL, engine_args, running_server


def test_stopping_the_server_lets_open_streams_finish(serve_checkpoint):
    engine = AsyncLLM(engine_args(serve_checkpoint, max_batch_size=2))
    body = {"model": MODEL, "prompt": [1, 2], "max_tokens": 60, "ignore_eos": True, "stream": True}
    lines: list[str] = []
    started = threading.Event()

    def read(url: str) -> None:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                lines.append(line)
                started.set()

    try:
        with running_server(engine) as url:
            reader = threading.Thread(target=read, args=(url,))
            reader.start()
            assert started.wait(30)
        reader.join(30)  # the server stopped once the stream was done
    finally:
        engine.close()
    assert "data: [DONE]" in lines
    stats = engine.scheduler.get_stats()
    assert (stats.finished, stats.cancelled, stats.running) == (1, 0, 0) and engine.llm.slots.num_free == 2


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
