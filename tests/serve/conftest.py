"""A pocketllm server on 127.0.0.1 and a free port (uvicorn on a thread), over an AsyncLLM on the
tiny preset, beside a serial engine on the same checkpoint: what the server answers is compared
with what the serial engine computes, `==` on every logprob."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")

from pocketllm import LLM, AsyncLLM, EngineArgs, write_checkpoint  # noqa: E402
from pocketllm.serve import build_app  # noqa: E402
from pocketllm.serve.server import GracefulServer  # noqa: E402

MAX_SEQ_LEN = 256
MAX_BATCH = 4
MODEL = "tiny"


@contextlib.contextmanager
def running_server(engine: AsyncLLM, name: str = MODEL, graceful_timeout: float = 5,
                   **app_options: Any) -> Iterator[str]:
    """The server's base URL while it runs, as `pocketllm serve` runs it (`app_options`: more of
    build_app's); stopped on leaving (what still runs after `graceful_timeout` seconds is aborted)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    app = build_app(engine, name, **app_options)
    server = GracefulServer(app, "127.0.0.1", port, graceful_timeout, log_level="warning")
    thread = threading.Thread(target=server.run, name="pocketllm-test-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


def engine_args(path: Any, **options: Any) -> EngineArgs:
    return EngineArgs(model=str(path), max_seq_len=MAX_SEQ_LEN, backend_options=options or None)


@pytest.fixture(scope="session")
def serve_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return write_checkpoint(tmp_path_factory.mktemp("serve") / "tiny", "tiny", seed=0)


@pytest.fixture(scope="session")
def serial(serve_checkpoint: Any) -> Iterator[LLM]:
    """The reference: the serial engine on the same checkpoint."""
    with LLM(engine_args(serve_checkpoint)) as llm:
        yield llm


@pytest.fixture(scope="session")
def engine(serve_checkpoint: Any) -> Iterator[AsyncLLM]:
    engine = AsyncLLM(engine_args(serve_checkpoint, max_batch_size=MAX_BATCH))
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def base_url(engine: AsyncLLM) -> Iterator[str]:
    with running_server(engine) as url:
        yield url


@pytest.fixture
def client(base_url: str) -> Any:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def wait_idle(engine: AsyncLLM, timeout_s: float = 30) -> None:
    """Until nothing runs or waits and every slot is free (requests end on the engine thread)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = engine.scheduler.get_stats()
        if not stats.running and not stats.waiting and engine.llm.slots.num_free == MAX_BATCH:
            return
        assert time.monotonic() < deadline, f"the engine did not go idle: {stats}"
        time.sleep(0.01)


def ids_of(tokens: list[str]) -> list[int]:
    """Token ids back from `return_tokens_as_token_ids` strings ("token_id:N")."""
    return [int(t.removeprefix("token_id:")) for t in tokens]
