"""The `pocketllm` command line: demo, make-checkpoint, generate, and its error messages."""

from __future__ import annotations

import json
import sys

import pytest

from pocketllm import LLM, EngineArgs, SamplingParams
from pocketllm.cli import main


def test_demo_writes_embedded_checkpoint_once(tmp_path, monkeypatch, capsys):
    """demo writes the tiny checkpoint into the cache dir on first run and reuses it after."""
    monkeypatch.setenv("POCKETLLM_CACHE", str(tmp_path))
    assert main(["demo"]) == 0
    config = tmp_path / "tiny-seed0" / "config.json"
    first_write = config.stat().st_mtime_ns
    out = capsys.readouterr().out
    assert "tokens/s" in out and "batched == serial, bitwise (tokens and logprobs): 8/8 requests" in out
    assert main(["demo"]) == 0
    assert config.stat().st_mtime_ns == first_write


def test_make_checkpoint_then_generate_matches_api(tmp_path, capsys):
    """generate prints the same greedy tokens the Python API returns for that checkpoint."""
    path = tmp_path / "ckpt"
    assert main(["make-checkpoint", "--preset", "tiny", "--seed", "4", str(path)]) == 0
    assert json.loads((path / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
    capsys.readouterr()
    assert main(["generate", "--model", str(path), "--prompt-tokens", "1,2,3", "--max-tokens", "5",
                 "--temperature", "0", "--max-seq-len", "64"]) == 0
    printed = [int(t) for t in capsys.readouterr().out.strip().split(",")]
    expected = LLM(EngineArgs(model=str(path), max_seq_len=64)).generate(
        prompt_tokens=[1, 2, 3], sampling_params=SamplingParams(max_tokens=5, temperature=0.0))
    assert printed == expected.token_ids


@pytest.mark.parametrize("args, message", [
    (["--prompt-tokens", "1,2,999"], "outside the vocabulary"),
    (["--prompt-tokens", "1", "--temperature", "-1"], "temperature must be"),
    (["--prompt-tokens", "1", "--max-tokens", "0"], "max_tokens must be"),
])
def test_generate_bad_input_exits_2_with_message(tiny_checkpoint, capsys, args, message):
    """Bad arguments exit with status 2 and a message naming the field."""
    assert main(["generate", "--model", str(tiny_checkpoint), "--max-seq-len", "64", *args]) == 2
    assert message in capsys.readouterr().err


def test_prompt_tokens_must_be_ints(tiny_checkpoint, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--model", str(tiny_checkpoint), "--prompt-tokens", "a,b"])
    assert exit_info.value.code == 2
    assert "comma-separated ints" in capsys.readouterr().err


def test_help_lists_every_subcommand_and_bench_has_its_own(capsys):
    """`pocketllm --help` names the four subcommands; `pocketllm bench --help` is the benchmark's."""
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert all(name in out for name in ("demo", "generate", "make-checkpoint", "bench"))
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "--help"])
    assert exit_info.value.code == 0
    assert "--quick" in capsys.readouterr().out


def test_demo_runs_without_the_tokenizers_package(tmp_path, monkeypatch, capsys):
    """The README's first command installs no extras: the demo falls back to UTF-8 bytes."""
    monkeypatch.setenv("POCKETLLM_CACHE", str(tmp_path))
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    assert main(["demo"]) == 0
    assert "8/8 requests" in capsys.readouterr().out
