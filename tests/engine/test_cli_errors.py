"""The CLI never shows a traceback for a user error: one line on stderr and exit status 2, for
bad values, missing CUDA, unwritable paths, corrupt checkpoints and absurd sizes alike; and
make-checkpoint refuses a non-empty directory unless --force, which leaves no stale file."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from pocketllm import write_checkpoint
from pocketllm.cli import main


def run_cli(capsys, *argv: str) -> tuple[int, str]:
    """main(argv) in-process: (exit status, stderr). An exception escaping main is a traceback."""
    try:
        status = main(list(argv))
    except SystemExit as exit_info:  # argparse's usage errors
        status = exit_info.code
    return status, capsys.readouterr().err


def assert_one_line_error(status: int, err: str, *parts: str) -> None:
    assert status == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "error" in lines[0] and "Traceback" not in err, err
    for part in parts:
        assert part in lines[0], lines[0]


@pytest.fixture
def corrupt_checkpoint(tiny_checkpoint, tmp_path):
    path = shutil.copytree(tiny_checkpoint, tmp_path / "corrupt")
    data = (path / "model.safetensors").read_bytes()
    (path / "model.safetensors").write_bytes(data[: len(data) // 2])
    return path


GENERATE = ["generate", "--prompt-tokens", "1,2", "--max-seq-len", "64"]


def test_corrupt_checkpoint(capsys, corrupt_checkpoint):
    assert_one_line_error(*run_cli(capsys, *GENERATE, "--model", str(corrupt_checkpoint)), "model.safetensors")


def test_corrupt_config(capsys, tiny_checkpoint, tmp_path):
    path = shutil.copytree(tiny_checkpoint, tmp_path / "c")
    (path / "config.json").write_text('{"vocab_size": -1,')
    assert_one_line_error(*run_cli(capsys, *GENERATE, "--model", str(path)), "config.json")


def test_missing_model_directory(capsys, tmp_path):
    assert_one_line_error(*run_cli(capsys, *GENERATE, "--model", str(tmp_path / "nowhere")), "config.json")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_missing_cuda(capsys, tiny_checkpoint):
    assert_one_line_error(*run_cli(capsys, *GENERATE, "--model", str(tiny_checkpoint), "--device", "cuda"), "cuda")


def test_absurd_max_seq_len(capsys, tiny_checkpoint):
    status, err = run_cli(capsys, "generate", "--prompt-tokens", "1", "--max-seq-len", str(10**12),
                          "--model", str(tiny_checkpoint))
    assert_one_line_error(status, err, "max_seq_len=1000000000000", "available")


@pytest.mark.parametrize("value", ["1,,2", ",1", "1,", "", "1, ,2", "1,x"])
def test_prompt_tokens_with_empty_or_bad_items(capsys, tiny_checkpoint, value):
    status, err = run_cli(capsys, "generate", "--model", str(tiny_checkpoint), "--prompt-tokens", value)
    assert_one_line_error(status, err, "--prompt-tokens must be comma-separated ints")


def test_unknown_option_is_one_line(capsys):
    assert_one_line_error(*run_cli(capsys, "generate", "--no-such-option"), "--help")


@pytest.mark.parametrize("extra", [["--temperature", "nan"], ["--temperature", "1e400"], ["--top-k", "-3"],
                                   ["--max-tokens", str(10**30)], ["--seed", "-5"]])
def test_out_of_range_values(capsys, tiny_checkpoint, extra):
    assert_one_line_error(*run_cli(capsys, *GENERATE, "--model", str(tiny_checkpoint), *extra))


def test_unwritable_checkpoint_directory(capsys, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    assert_one_line_error(*run_cli(capsys, "make-checkpoint", str(blocker / "ckpt")))
    assert_one_line_error(*run_cli(capsys, "make-checkpoint", str(blocker)), "not a directory")


def test_make_checkpoint_refuses_a_non_empty_directory_without_force(capsys, tmp_path):
    target = tmp_path / "ckpt"
    target.mkdir()
    (target / "notes.txt").write_text("mine")
    assert_one_line_error(*run_cli(capsys, "make-checkpoint", str(target)), "--force")
    assert sorted(p.name for p in target.iterdir()) == ["notes.txt"]


def test_make_checkpoint_force_leaves_no_stale_checkpoint_file(capsys, tmp_path):
    """A sharded checkpoint overwritten with --force by a single-file one: the old index and shards
    are gone (the index would otherwise win over the new weights), the new weights are those of a
    fresh write, and files that are not checkpoint files stay."""
    target = write_checkpoint(tmp_path / "ckpt", "tiny", seed=1, max_shard_bytes=40_000)
    (target / "notes.txt").write_text("mine")
    status, err = run_cli(capsys, "make-checkpoint", "--force", "--seed", "2", str(target))
    assert status == 0, err
    fresh = write_checkpoint(tmp_path / "fresh", "tiny", seed=2)
    assert sorted(p.name for p in target.iterdir()) == sorted([p.name for p in fresh.iterdir()] + ["notes.txt"])
    ours, theirs = load_file(str(target / "model.safetensors")), load_file(str(fresh / "model.safetensors"))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert json.loads((target / "config.json").read_text()) == json.loads((fresh / "config.json").read_text())


@pytest.fixture
def no_model_built(monkeypatch):
    """The benchmark's first step (writing its checkpoint) fails the test: a user error must be
    refused before any model is built."""
    def refuse(*args, **kwargs):
        raise AssertionError("the benchmark built a model before refusing its arguments")

    monkeypatch.setattr("pocketllm.bench.command.write_checkpoint", refuse)


BENCH = ["bench", "--quick", "--no-transformers"]


def test_bench_refuses_an_unwritable_out_before_running(capsys, tmp_path, no_model_built):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    assert_one_line_error(*run_cli(capsys, *BENCH, "--out", str(blocker / "results")), "--out", str(blocker))


@pytest.mark.parametrize("seed", ["-1", str(2**64)])
def test_bench_refuses_a_seed_out_of_range(capsys, tmp_path, no_model_built, seed):
    status, err = run_cli(capsys, *BENCH, "--out", str(tmp_path), "--seed", seed)
    assert_one_line_error(status, err, "--seed must be an int in [0, 2**64 - 1]", seed)


@pytest.mark.parametrize("device, message", [
    ("cdua", "--device must be 'cpu' or 'cuda[:index]', got 'cdua'"),
    pytest.param("cuda", "--device 'cuda' is not available: torch finds no CUDA device here",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")),
])
def test_bench_refuses_a_device_it_cannot_use(capsys, tmp_path, no_model_built, device, message):
    assert_one_line_error(*run_cli(capsys, *BENCH, "--out", str(tmp_path), "--device", device), message)


def test_bench_interrupted_is_one_line(capsys, tmp_path, monkeypatch):
    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("pocketllm.bench.command.write_checkpoint", interrupt)
    try:
        status, err = run_cli(capsys, *BENCH, "--out", str(tmp_path))
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C escaped the command as a traceback")
    assert status == 130, err
    assert err.strip().splitlines()[-1] == "pocketllm bench: interrupted" and "Traceback" not in err, err
