"""`system_fingerprint`: on every response and streamed chunk of both routes; two servers on the
same checkpoint bytes and options have the same one and answer a seeded sampled request with the
same bits; another checkpoint or an option that changes the bits changes it. The checkpoint's
digest is SHA-256 over its files, read in 1 MiB blocks."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import shutil

import httpx
import pytest

from pocketllm import LLM, AsyncLLM, write_checkpoint
from pocketllm.fingerprint import BLOCK_BYTES, bits_fingerprint, bits_settings, checkpoint_digest

from .conftest import MODEL, engine_args, running_server

FINGERPRINT = re.compile(r"fp_[0-9a-f]{10}")
MESSAGES = [{"role": "user", "content": "Hi"}]
SAMPLED = {"model": MODEL, "prompt": [3, 1, 4, 1, 5], "max_tokens": 12, "temperature": 0.8, "top_k": 40,
           "seed": 11, "logprobs": 2, "ignore_eos": True, "return_tokens_as_token_ids": True}


def _events(http: httpx.Client, path: str, body: dict) -> list[dict]:
    with http.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_every_response_and_chunk_has_the_servers_fingerprint(base_url, serial):
    want = bits_fingerprint(serial)  # the serial engine on the same checkpoint: the same bits
    assert FINGERPRINT.fullmatch(want)
    usage = {"stream_options": {"include_usage": True}}
    with httpx.Client(base_url=base_url, timeout=60) as http:
        for path, body in [("/v1/completions", {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 3, "n": 2}),
                           ("/v1/chat/completions", {"model": MODEL, "messages": MESSAGES, "max_tokens": 3})]:
            whole = http.post(path, json=body)
            assert whole.status_code == 200 and whole.json()["system_fingerprint"] == want
            chunks = _events(http, path, {**body, **usage})
            assert len(chunks) >= 3 and chunks[-1]["usage"] is not None
            assert [chunk["system_fingerprint"] for chunk in chunks] == [want] * len(chunks)


def _sampled(url: str) -> tuple[str, list, list]:
    answer = httpx.post(f"{url}/v1/completions", json=SAMPLED, timeout=60).json()
    logprobs = answer["choices"][0]["logprobs"]
    return answer["system_fingerprint"], logprobs["tokens"], logprobs["token_logprobs"]


def test_two_servers_on_the_same_bytes_agree_on_the_fingerprint_and_the_bits(base_url, serve_checkpoint, tmp_path):
    """A copy of the checkpoint elsewhere, another batch size: the same fingerprint and bits."""
    copy = shutil.copytree(serve_checkpoint, tmp_path / "copy")
    other = AsyncLLM(engine_args(copy, max_batch_size=2))
    try:
        with running_server(other, name=MODEL) as url:
            theirs = _sampled(url)
    finally:
        other.close()
    ours = _sampled(base_url)
    assert FINGERPRINT.fullmatch(ours[0]) and len(ours[1]) == 12
    assert theirs == ours


@pytest.fixture(scope="module")
def reference(serve_checkpoint):
    """The serial engine's fingerprint on the serve checkpoint with the default options, and its settings."""
    with LLM(engine_args(serve_checkpoint)) as llm:
        return bits_fingerprint(llm), bits_settings(llm)


def test_the_tensor_parallel_size_is_left_out_where_the_tree_gives_every_size_the_same_bits(reference):
    _, settings = reference
    assert settings["tree_reduction"] and "tensor_parallel_size" not in settings
    assert "enable_expert_parallel" not in settings
    assert settings["exact_positions"] and settings["ops"]["linear"] == "fixed_order"
    assert settings["instruction_sets"]["linear_variant"] in ("avx512", "avx2")


@pytest.mark.parametrize(("seed", "weight_dtype", "options"), [
    (1, None, {}), (0, "bfloat16", {}), (0, None, {"exact_positions": False}), (0, None, {"tree_reduction": False}),
], ids=["another-checkpoint", "bf16-weights", "exact-positions-off", "tree-off"])
def test_another_checkpoint_or_option_gives_another_fingerprint(reference, serve_checkpoint, tmp_path, seed,
                                                                weight_dtype, options):
    """Another checkpoint (the preset from another seed), or an option that changes the bits."""
    path = write_checkpoint(tmp_path / "other", "tiny", seed=seed) if seed else serve_checkpoint
    with LLM(dataclasses.replace(engine_args(path, **options), weight_dtype=weight_dtype)) as llm:
        theirs, settings = bits_fingerprint(llm), bits_settings(llm)
    assert FINGERPRINT.fullmatch(theirs) and theirs != reference[0]
    if options == {"tree_reduction": False}:  # without the tree, the size and the experts' layout decide the sums
        assert settings["tensor_parallel_size"] == 1 and settings["enable_expert_parallel"] is False
    if options == {"exact_positions": False}:  # where prompts are cut decides the bits then
        assert settings["prompt_cuts"] == [512, 512]


def test_the_checkpoint_digest_is_sha256_over_the_files_in_1_mib_blocks(tmp_path):
    """Files across block boundaries hash as their bytes do at once; a copy hashes the same, one
    changed byte does not; files the engine does not read change nothing."""
    path = tmp_path / "ckpt"
    path.mkdir()
    files = {"config.json": b'{"model_type": "qwen3"}', "model.safetensors": bytes(range(256)) * (BLOCK_BYTES // 100)}
    for name, data in files.items():
        (path / name).write_bytes(data)
    want = hashlib.sha256()
    for name, data in files.items():
        want.update(f"{name}\0{len(data)}\0".encode() + data)
    assert checkpoint_digest(path) == want.hexdigest()
    (path / "README.md").write_text("not read by the engine")
    assert checkpoint_digest(shutil.copytree(path, tmp_path / "copy")) == want.hexdigest()
    data = bytearray(files["model.safetensors"])
    data[BLOCK_BYTES + 7] ^= 1
    (path / "model.safetensors").write_bytes(bytes(data))
    assert checkpoint_digest(path) != want.hexdigest()
