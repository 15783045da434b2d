"""`pocketllm serve` refuses what it cannot serve on as every bad invocation is refused: one line on
stderr naming the option, status 2, no traceback, and before the model loads."""

from __future__ import annotations

import socket
from typing import Any

import pytest

from pocketllm.cli import main


@pytest.fixture
def no_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    """Setting up the engine fails the test: these invocations must be refused before it."""

    def refused(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the engine was set up before the invocation was checked")

    monkeypatch.setattr("pocketllm.async_llm.AsyncLLM", refused)
    monkeypatch.setattr("pocketllm.serve.cli._set_threads", refused)


def _one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("pocketllm serve: error: ") and "Traceback" not in err, err
    return err


@pytest.mark.parametrize(("args", "words"), [
    (["--port", "70000"], ["--port", "1..65535", "70000"]),
    (["--port", "0"], ["--port", "1..65535"]),
    (["--port", "-5"], ["--port", "1..65535"]),
    (["--port", "http"], ["--port", "1..65535", "http"]),
    (["--graceful-timeout", "-1"], ["--graceful-timeout", ">= 0"]),
    (["--graceful-timeout", "inf"], ["--graceful-timeout", ">= 0"]),
    (["--allowed-origins", "*"], ["--allowed-origins", "JSON list of origins", "'*'"]),
    (["--allowed-origins", '["*", 3]'], ["--allowed-origins", "JSON list of origins"]),
    (["--speculative-config", "ngram"], ["--speculative-config", "JSON object", "'ngram'"]),
])
def test_a_bad_option_is_one_line_and_status_2(serve_checkpoint, no_engine, capsys, args, words):
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--model", str(serve_checkpoint), *args])
    assert exit_.value.code == 2
    err = _one_line_error(capsys)
    assert all(word in err for word in words), err


@pytest.mark.parametrize(("config", "words"), [
    ('{"method": "ngram"}', ["speculative['num_speculative_tokens'] is required"]),
    ('{"method": "ngram", "num_speculative_tokens": 99}', ["speculative['num_speculative_tokens']", "[1, 32]", "99"]),
])
def test_a_bad_speculative_config_is_one_line_and_status_2(serve_checkpoint, no_engine, capsys, config, words):
    assert main(["serve", "--model", str(serve_checkpoint), "--speculative-config", config]) == 2
    err = _one_line_error(capsys)
    assert all(word in err for word in words), err


def test_a_port_in_use_is_one_line_and_status_2(serve_checkpoint, no_engine, capsys):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--model", str(serve_checkpoint), "--port", str(port)]) == 2
    err = _one_line_error(capsys)
    assert f"--port {port}" in err and "in use" in err, err


def test_a_host_not_of_this_machine_is_one_line_and_status_2(serve_checkpoint, no_engine, capsys):
    host = "203.0.113.7"  # TEST-NET-3: never an address of this machine
    assert main(["serve", "--model", str(serve_checkpoint), "--host", host, "--port", "8000"]) == 2
    assert f"--host {host}" in _one_line_error(capsys)


def test_the_engine_options_reach_the_engine_arguments(serve_checkpoint):
    """vLLM's spellings: --tensor-parallel-size, --pipeline-parallel-size and --enable-expert-parallel
    (off unless given)."""
    from pocketllm.cli import build_parser
    from pocketllm.serve.cli import engine_args

    args = build_parser().parse_args(["serve", "--model", str(serve_checkpoint), "--tensor-parallel-size", "2",
                                      "--enable-expert-parallel", "--pipeline-parallel-size", "3"])
    config = engine_args(args)
    assert (config.tensor_parallel_size, config.enable_expert_parallel, config.pipeline_parallel_size) == (2, True, 3)
    default = engine_args(build_parser().parse_args(["serve", "--model", str(serve_checkpoint)]))
    assert not default.enable_expert_parallel
