"""A checkpoint directory is untrusted input: index entries that leave the directory, corrupt
safetensors files, integer/bool/non-finite tensors and malformed JSON files are each a
CheckpointError (a ValueError) naming the file and the fault, never another exception or a hang."""

from __future__ import annotations

import json
import os
import shutil
import struct
import threading
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from pocketllm import LLM, EngineArgs, SamplingParams, write_checkpoint
from pocketllm.models import CheckpointError, config_from_dict, load_weights, read_config
from pocketllm.models.qwen3 import expected_weights
from pocketllm.tokenizer import load_tokenizer

INDEX = "model.safetensors.index.json"
EMBED = "model.embed_tokens.weight"


pytestmark = pytest.mark.usefixtures("single_torch_thread")


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("untrusted_single"), "tiny", seed=21)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("untrusted_sharded"), "tiny", seed=21, max_shard_bytes=60_000)


def _copy(src: Path, dst: Path) -> Path:
    return Path(shutil.copytree(src, dst, dirs_exist_ok=True))


def _engine(path: Path) -> LLM:
    return LLM(EngineArgs(model=str(path), max_seq_len=32, backend_options={"max_batch_size": 1}))


def bounded(fn, timeout_s: float = 60.0):
    """fn() on a helper thread: its result, or the exception it raised; a hang fails the test."""
    outcome: list = []

    def target():
        try:
            outcome.append(("ok", fn()))
        except BaseException as exc:  # noqa: BLE001  (the test inspects whatever came out)
            outcome.append(("raised", exc))

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout_s)
    assert outcome, f"no result after {timeout_s}s: a hang"
    return outcome[0]


def assert_loads_or_checkpoint_error(fn, path: Path, file_name: str) -> None:
    """fn() returns, or raises a CheckpointError naming `file_name` or, when the damage made the
    file valid but inconsistent with the rest (say, a layer count), the checkpoint directory."""
    kind, value = bounded(fn)
    if kind == "raised":
        assert isinstance(value, CheckpointError), f"{type(value).__name__}: {value}"
        assert file_name in str(value) or str(path) in str(value), str(value)


# -- the shard index names files inside the directory ---------------------------------------------------------


@pytest.mark.parametrize("entry", ["/etc/passwd", "../outside.safetensors", "sub/../../outside.safetensors",
                                   "..\\outside.safetensors", "C:\\weights.safetensors", ""])
def test_index_entries_outside_the_directory_are_refused(sharded, tmp_path, entry):
    """An entry that is absolute or climbs out is refused naming the index and the entry, before
    any file is opened (the file outside exists and is a valid checkpoint)."""
    path = _copy(sharded, tmp_path / "model")
    shutil.copy(next(path.glob("model-*.safetensors")), tmp_path / "outside.safetensors")
    index = json.loads((path / INDEX).read_text())
    index["weight_map"][EMBED] = entry
    (path / INDEX).write_text(json.dumps(index))
    with pytest.raises(CheckpointError) as info:
        _engine(path)
    assert INDEX in str(info.value) and repr(entry) in str(info.value)


def test_symlinked_shards_load(sharded, tmp_path):
    """Shards that are symlinks into another directory (the Hugging Face cache layout) load, and
    give the same output as the regular files."""
    blobs = _copy(sharded, tmp_path / "blobs")
    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    for file in blobs.iterdir():
        os.symlink(file, snapshot / file.name)
    prompt, params = [1, 2, 3], SamplingParams(max_tokens=3, temperature=0.0)
    assert _engine(snapshot).generate(prompt, params).token_ids == _engine(sharded).generate(prompt, params).token_ids


# -- corrupt safetensors files ---------------------------------------------------------------------------------


def _header_len(data: bytes) -> int:
    return struct.unpack("<Q", data[:8])[0]


def _corruptions(data: bytes) -> dict[str, bytes]:
    n = _header_len(data)
    header = json.loads(data[8:8 + n])
    lying = dict(header)
    name = next(k for k in header if k != "__metadata__")
    lying[name] = {**header[name], "data_offsets": [0, len(data) * 4]}
    lying_bytes = json.dumps(lying).encode()
    return {
        "empty": b"",
        "truncated-in-length": data[:5],
        "truncated-in-header": data[:8 + n // 2],
        "truncated-in-data": data[:len(data) - 100],
        "length-too-large": struct.pack("<Q", len(data) * 10) + data[8:],
        "length-2^63": struct.pack("<Q", 2**63) + data[8:],
        "length-too-small": struct.pack("<Q", n // 2) + data[8:],
        "header-not-json": data[:8] + b"\x00garbage!" * (n // 9) + b" " * (n % 9) + data[8 + n:],
        "header-a-list": struct.pack("<Q", 2) + b"[]" + data[8 + n:],
        "offsets-lie": struct.pack("<Q", len(lying_bytes)) + lying_bytes + data[8 + n:],
    }


@pytest.mark.parametrize("kind", ["empty", "truncated-in-length", "truncated-in-header", "truncated-in-data",
                                  "length-too-large", "length-2^63", "length-too-small", "header-not-json",
                                  "header-a-list", "offsets-lie"])
def test_corrupt_safetensors_is_a_checkpoint_error_naming_the_file(single, tmp_path, kind):
    path = _copy(single, tmp_path / "model")
    file = path / "model.safetensors"
    file.write_bytes(_corruptions(file.read_bytes())[kind])
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        _engine(path)


@settings(max_examples=max(1, settings().max_examples // 2))
@given(data=st.data())
def test_fuzz_safetensors_header_bytes(single, tmp_path_factory, data):
    """Random bytes overwritten in the length field or the JSON header: the file loads, or the
    loader raises CheckpointError naming it; no other exception, no hang."""
    original = (single / "model.safetensors").read_bytes()
    end = 8 + _header_len(original)
    positions = data.draw(st.lists(st.integers(0, end - 1), min_size=1, max_size=8), label="positions")
    corrupted = bytearray(original)
    for pos in positions:
        corrupted[pos] = data.draw(st.integers(0, 255), label=f"byte@{pos}")
    if data.draw(st.booleans(), label="truncate"):
        corrupted = corrupted[:data.draw(st.integers(0, len(corrupted)), label="length")]
    path = _copy(single, tmp_path_factory.mktemp("fuzz_st"))
    (path / "model.safetensors").write_bytes(bytes(corrupted))
    cfg = read_config(path)
    assert_loads_or_checkpoint_error(
        lambda: load_weights(path, expected_weights(cfg), torch.float32, "cpu"), path, "model.safetensors")


# -- JSON files: config, generation config, index, tokenizer -------------------------------------------------


@settings(max_examples=max(1, settings().max_examples // 2))
@given(data=st.data(), name=st.sampled_from(["config.json", "generation_config.json", INDEX, "tokenizer.json"]))
def test_fuzz_json_file_bytes(sharded, tmp_path_factory, data, name):
    """Random byte edits (or truncation) of a JSON file of the checkpoint: the engine loads, or
    raises CheckpointError naming that file; no other exception, no hang."""
    original = (sharded / name).read_bytes()
    corrupted = bytearray(original)
    if data.draw(st.booleans(), label="truncate"):
        corrupted = corrupted[:data.draw(st.integers(0, len(corrupted) - 1), label="length")]
    else:
        for _ in range(data.draw(st.integers(1, 6), label="edits")):
            pos = data.draw(st.integers(0, len(corrupted) - 1), label="position")
            corrupted[pos] = data.draw(st.sampled_from(list(b'{}[]",:0123456789-.eE \x00\xff') + list(range(256))),
                                       label="byte")
    path = _copy(sharded, tmp_path_factory.mktemp("fuzz_json"))
    (path / name).write_bytes(bytes(corrupted))
    if name == "tokenizer.json":
        assert_loads_or_checkpoint_error(lambda: load_tokenizer(path), path, name)
    else:
        assert_loads_or_checkpoint_error(lambda: _engine(path), path, name)


@pytest.mark.parametrize("name", ["config.json", "generation_config.json", INDEX, "tokenizer.json"])
@pytest.mark.parametrize("content", ["[1, 2]", "\"text\"", "null", "{", "\xff\xfe", "[" * 100_000 + "]" * 100_000])
def test_json_file_that_is_not_an_object_names_the_file(sharded, tmp_path, name, content):
    path = _copy(sharded, tmp_path / "model")
    (path / name).write_bytes(content.encode("latin-1"))
    load = (lambda: load_tokenizer(path)) if name == "tokenizer.json" else (lambda: _engine(path))
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        load()


BASE = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 100, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8}

BAD_FIELDS = [
    ("vocab_size", 0, "must be an integer >= 1"), ("hidden_size", -64, "must be an integer >= 1"),
    ("intermediate_size", "96", "must be a JSON integer"), ("num_hidden_layers", 2.0, "must be a JSON integer"),
    ("num_attention_heads", True, "must be a JSON integer"), ("num_key_value_heads", 3, "not a multiple"),
    ("head_dim", 0, "must be an integer >= 1"), ("rms_norm_eps", 0, "must be a finite number > 0"),
    ("rms_norm_eps", -1e-6, "must be a finite number > 0"), ("rms_norm_eps", float("nan"), "must be a finite number"),
    ("rope_theta", 0.0, "must be a finite number > 0"), ("rope_theta", 10**400, "must be a finite number"),
    ("rope_theta", float("inf"), "must be a finite number > 0"), ("max_position_embeddings", 0, "integer >= 1"),
    ("tie_word_embeddings", "false", "boolean"), ("attention_bias", 1, "boolean"),
    ("eos_token_id", "2", "eos_token_id"), ("eos_token_id", [1, -2], "eos_token_id"),
    ("eos_token_id", 100, "outside the vocabulary"), ("architectures", "Qwen3ForCausalLM", "must be a JSON array"),
    ("rope_parameters", [1], "must be a JSON object"), ("layer_types", ["full_attention"], "layer_types"),
    ("use_sliding_window", "yes", "boolean"), ("partial_rotary_factor", 1.5, "rotary width"),
    ("num_hidden_layers", 10**12, "at most"), ("layer_types", [["full_attention"], {}], "layer_types"),
]


@pytest.mark.parametrize("field,value,message", BAD_FIELDS, ids=[f"{f}={v!r}"[:40] for f, v, _ in BAD_FIELDS])
def test_config_field_of_wrong_type_or_impossible_value_names_file_and_field(tmp_path, field, value, message):
    (tmp_path / "config.json").write_text(json.dumps({**BASE, field: value}))
    with pytest.raises(CheckpointError) as info:
        read_config(tmp_path)
    text = str(info.value)
    assert "config.json" in text and field in text and message in text, text


def test_generation_config_errors_name_that_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(BASE))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1.5]}))
    with pytest.raises(CheckpointError, match=r"generation_config\.json: field 'eos_token_id'"):
        read_config(tmp_path)


def test_hybrid_linear_heads_must_divide():
    raw = {**BASE, "architectures": ["Qwen3_5ForCausalLM"], "num_hidden_layers": 4, "linear_num_key_heads": 3,
           "linear_num_value_heads": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8}
    with pytest.raises(CheckpointError, match="linear_num_value_heads=4 is not a multiple of linear_num_key_heads=3"):
        config_from_dict(raw)


# -- tensor dtypes and values -----------------------------------------------------------------------------------


def _rewrite(path: Path, name: str, tensor: torch.Tensor) -> None:
    tensors = load_file(str(path / "model.safetensors"))
    tensors[name] = tensor
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.bool, torch.float8_e4m3fn])
def test_non_float_tensors_are_refused_naming_tensor_and_dtype(single, tmp_path, dtype):
    path = _copy(single, tmp_path / "model")
    shape = load_file(str(path / "model.safetensors"))[EMBED].shape
    _rewrite(path, EMBED, torch.zeros(shape).to(dtype))
    with pytest.raises(CheckpointError, match=rf"model\.safetensors: tensor '{EMBED}' has dtype \w+; only floating"):
        _engine(path)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_weights_are_refused_naming_the_tensor(single, tmp_path, value):
    path = _copy(single, tmp_path / "model")
    weight = load_file(str(path / "model.safetensors"))[EMBED].clone()
    weight[3, 5] = value
    _rewrite(path, EMBED, weight)
    with pytest.raises(CheckpointError, match=rf"tensor '{EMBED}' holds NaN or infinite values"):
        _engine(path)


def test_fp64_weights_load_converted_and_overflow_is_refused(single, tmp_path):
    """fp64 weights are accepted and converted to the engine dtype (the same tensors as the fp32
    originals); an fp64 value too large for the engine dtype becomes inf and is refused."""
    path = _copy(single, tmp_path / "model")
    original = load_file(str(path / "model.safetensors"))
    save_file({k: v.double() for k, v in original.items()}, str(path / "model.safetensors"))
    llm = _engine(path)
    assert torch.equal(llm.model.embed, original[EMBED])
    weight = original[EMBED].double()
    weight[0, 0] = 1e300
    _rewrite(path, EMBED, weight)
    with pytest.raises(CheckpointError, match=rf"tensor '{EMBED}' holds NaN or infinite values.*F64"):
        _engine(path)
