"""Checkpoint loading (models/loader.py, models/registry.py), the random-checkpoint writer
(models/presets.py) and ModelConfig parsing of config.json / generation_config.json."""

from __future__ import annotations

import json
import pickle
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from pocketllm import LLM, EngineArgs, ModelConfig, SamplingParams, write_checkpoint
from pocketllm.models import CheckpointError, config_from_dict, load_weights, read_config
from pocketllm.models.qwen3 import expected_weights, skip_weight

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@pytest.fixture(scope="module")
def source_checkpoint(tmp_path_factory) -> Path:
    """A single-file tiny checkpoint that tests copy before damaging."""
    return write_checkpoint(tmp_path_factory.mktemp("loader_src"), "tiny", seed=11)


@pytest.fixture
def checkpoint(source_checkpoint, tmp_path) -> Path:
    """A private copy of the source checkpoint, free to edit."""
    return Path(shutil.copytree(source_checkpoint, tmp_path / "ckpt"))


def _engine(path: Path, **kwargs) -> LLM:
    return LLM(EngineArgs(model=str(path), max_seq_len=64, **kwargs))


def _expected(path: Path) -> dict[str, tuple[int, ...]]:
    return expected_weights(read_config(path))


def _rewrite(path: Path, edit) -> None:
    tensors = load_file(str(path / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


# -- sharded vs single file ----------------------------------------------------------------------------


def test_sharded_and_single_file_load_identical_weights(tmp_path):
    """The same seed written as one file and as several shards loads to the same tensors, which are
    the tensors stored in the single file; the index maps every tensor and totals their bytes."""
    single = write_checkpoint(tmp_path / "single", "tiny", seed=5)
    sharded = write_checkpoint(tmp_path / "sharded", "tiny", seed=5, max_shard_bytes=40_000)
    shards = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert len(shards) > 1 and not (sharded / "model.safetensors").exists()
    assert all(re.fullmatch(rf"model-\d{{5}}-of-{len(shards):05d}\.safetensors", s) for s in shards)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    stored = load_file(str(single / "model.safetensors"))
    assert set(index["weight_map"]) == set(stored) and set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in stored.values())

    a = load_weights(single, _expected(single), torch.float32, "cpu", skip=skip_weight)
    b = load_weights(sharded, _expected(sharded), torch.float32, "cpu", skip=skip_weight)
    assert set(a) == set(b) == set(stored)
    for name in stored:
        assert torch.equal(a[name], stored[name]) and torch.equal(b[name], stored[name]), name

    params = SamplingParams(max_tokens=6, temperature=0.8, seed=3)
    ra, rb = _engine(single).generate([5, 6, 7], params), _engine(sharded).generate([5, 6, 7], params)
    assert ra.token_ids == rb.token_ids and ra.logprobs == rb.logprobs


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_dtype_is_respected(source_checkpoint, dtype):
    """Weights and KV cache are held in the requested dtype, with values equal to the fp32
    checkpoint values converted to it, and generation runs in that dtype."""
    torch_dtype = DTYPES[dtype]
    llm = _engine(source_checkpoint, dtype=dtype)
    stored = load_file(str(source_checkpoint / "model.safetensors"))
    assert llm.model.dtype == torch_dtype
    assert all(t.dtype == torch_dtype for t in llm.cache.k + llm.cache.v)
    attention, mlp = llm.model.blocks[1].mixer, llm.model.blocks[1].mlp
    down, o_proj = torch.cat(mlp.down.weights(), dim=1), torch.cat(attention.o_proj.weights(), dim=1)
    for tensor in (attention.qkv, mlp.gate_up, down, o_proj, attention.q_norm, llm.model.final_norm):
        assert tensor.dtype == torch_dtype
    assert torch.equal(llm.model.embed, stored["model.embed_tokens.weight"].to(torch_dtype))
    assert torch.equal(down, stored["model.layers.1.mlp.down_proj.weight"].to(torch_dtype))
    weights = load_weights(source_checkpoint, _expected(source_checkpoint), torch_dtype, "cpu")
    assert all(t.dtype == torch_dtype for t in weights.values())
    result = llm.generate([1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True, seed=1))
    assert result.finish_reason == "length" and len(result.token_ids) == 4 and result.error is None


def test_bfloat16_checkpoint_loads_exactly_into_float32(checkpoint):
    """A checkpoint stored in bf16 (as most published ones are) loads into fp32 exactly."""
    _rewrite(checkpoint, lambda t: t.update({name: v.to(torch.bfloat16) for name, v in t.items()}))
    stored = load_file(str(checkpoint / "model.safetensors"))
    assert all(v.dtype == torch.bfloat16 for v in stored.values())
    weights = load_weights(checkpoint, _expected(checkpoint), torch.float32, "cpu")
    assert all(torch.equal(weights[name], stored[name].float()) for name in stored)


# -- write_checkpoint ------------------------------------------------------------------------------------


def _file_bytes(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


@pytest.mark.parametrize("max_shard_bytes", [None, 50_000])
def test_write_checkpoint_is_deterministic_in_the_seed(tmp_path, max_shard_bytes):
    """Same preset and seed -> byte-identical files; another seed -> different weights, same config."""
    a = _file_bytes(write_checkpoint(tmp_path / "a", "tiny", seed=7, max_shard_bytes=max_shard_bytes))
    b = _file_bytes(write_checkpoint(tmp_path / "b", "tiny", seed=7, max_shard_bytes=max_shard_bytes))
    c = _file_bytes(write_checkpoint(tmp_path / "c", "tiny", seed=8, max_shard_bytes=max_shard_bytes))
    assert a == b
    assert a.keys() == c.keys()
    weight_files = [name for name in a if name.endswith(".safetensors")]
    assert weight_files and all(a[name] != c[name] for name in weight_files)
    assert a["config.json"] == c["config.json"]


def test_write_checkpoint_applies_overrides_and_rejects_unknown_preset(tmp_path):
    """Overrides land in config.json and shape the tensors; an unknown preset is a ValueError."""
    path = write_checkpoint(tmp_path / "o", "tiny", seed=1, num_hidden_layers=1, vocab_size=100, eos_token_id=99)
    raw = json.loads((path / "config.json").read_text())
    assert raw["num_hidden_layers"] == 1 and raw["vocab_size"] == 100
    assert json.loads((path / "generation_config.json").read_text())["eos_token_id"] == 99
    tensors = load_file(str(path / "model.safetensors"))
    assert tensors["model.embed_tokens.weight"].shape == (100, raw["hidden_size"])
    assert not any(name.startswith("model.layers.1.") for name in tensors)
    with pytest.raises(ValueError, match="preset must be one of"):
        write_checkpoint(tmp_path / "x", "enormous")


# -- errors --------------------------------------------------------------------------------------------------


def test_unknown_architecture_is_refused(checkpoint):
    """An architecture without a model class names config.json and the architecture."""
    raw = json.loads((checkpoint / "config.json").read_text())
    raw["architectures"] = ["LlamaForCausalLM"]
    (checkpoint / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=r"config\.json.*unknown architecture 'LlamaForCausalLM'"):
        _engine(checkpoint)


def test_missing_tensor_is_refused(checkpoint):
    """A checkpoint without one expected tensor names that tensor and the file searched."""
    _rewrite(checkpoint, lambda t: t.pop("model.layers.1.mlp.down_proj.weight"))
    with pytest.raises(CheckpointError) as info:
        _engine(checkpoint)
    assert "missing tensor 'model.layers.1.mlp.down_proj.weight'" in str(info.value)
    assert "model.safetensors" in str(info.value)


def test_wrong_shape_is_refused(checkpoint):
    """A tensor of the wrong shape names the file, the tensor and both shapes."""
    def edit(tensors):
        tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(32, 64)
    _rewrite(checkpoint, edit)
    with pytest.raises(CheckpointError) as info:
        _engine(checkpoint)
    message = str(info.value)
    assert "model.safetensors" in message and "'model.layers.0.self_attn.k_proj.weight'" in message
    assert "[32, 64]" in message and "[64, 64]" in message


def test_unexpected_extra_tensor_is_refused(checkpoint):
    """A tensor the architecture does not have is an error naming it and its file."""
    def edit(tensors):
        tensors["model.layers.0.mlp.extra_proj.weight"] = torch.zeros(4, 4)
    _rewrite(checkpoint, edit)
    unexpected = r"model\.safetensors: unexpected tensor 'model\.layers\.0\.mlp\.extra_proj\.weight'"
    with pytest.raises(CheckpointError, match=unexpected):
        _engine(checkpoint)


def test_untied_lm_head_in_tied_checkpoint_is_refused(checkpoint):
    """With tie_word_embeddings, a stored lm_head.weight is not silently ignored."""
    def edit(tensors):
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    _rewrite(checkpoint, edit)
    with pytest.raises(CheckpointError, match="lm_head.weight"):
        _engine(checkpoint)


def test_rotary_inv_freq_buffers_are_skipped(checkpoint, source_checkpoint):
    """Some checkpoints store rotary inverse frequencies; they are ignored, not an error."""
    def edit(tensors):
        tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(16)
    _rewrite(checkpoint, edit)
    params = SamplingParams(max_tokens=4, temperature=0)
    expected = _engine(source_checkpoint).generate([3, 4], params).token_ids
    assert _engine(checkpoint).generate([3, 4], params).token_ids == expected


def test_pickled_weights_are_refused_without_unpickling(checkpoint, monkeypatch):
    """Only pytorch_model.bin present: a CheckpointError naming it, and nothing is unpickled."""
    torch.save(load_file(str(checkpoint / "model.safetensors")), checkpoint / "pytorch_model.bin")
    (checkpoint / "model.safetensors").unlink()
    calls = []

    def forbidden(name):
        def fail(*args, **kwargs):
            calls.append(name)
            raise AssertionError(f"{name} must never be called")
        return fail

    monkeypatch.setattr(torch, "load", forbidden("torch.load"))
    monkeypatch.setattr(torch.serialization, "load", forbidden("torch.serialization.load"))
    monkeypatch.setattr(pickle, "load", forbidden("pickle.load"))
    monkeypatch.setattr(pickle, "loads", forbidden("pickle.loads"))
    monkeypatch.setattr(pickle, "Unpickler", forbidden("pickle.Unpickler"))
    with pytest.raises(CheckpointError, match=r"pytorch_model\.bin.*safetensors"):
        _engine(checkpoint)
    assert calls == []


def test_missing_config_is_refused(checkpoint):
    """A directory without config.json raises FileNotFoundError naming config.json."""
    (checkpoint / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        _engine(checkpoint)


def test_no_weights_at_all_is_refused(checkpoint):
    """config.json but no weight file: the error names the file names looked for."""
    (checkpoint / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no model\.safetensors or model\.safetensors\.index\.json"):
        _engine(checkpoint)


def test_index_listing_a_missing_shard_is_refused(tmp_path):
    """A sharded index naming a shard file that does not exist names the index and that shard."""
    path = write_checkpoint(tmp_path / "s", "tiny", seed=2, max_shard_bytes=40_000)
    shards = sorted(path.glob("model-*.safetensors"))
    shards[1].unlink()
    with pytest.raises(CheckpointError) as info:
        _engine(path)
    assert "model.safetensors.index.json" in str(info.value) and shards[1].name in str(info.value)


def test_index_without_weight_map_is_refused(tmp_path):
    """An index file lacking its weight_map object is an error naming the index."""
    path = write_checkpoint(tmp_path / "s", "tiny", seed=2, max_shard_bytes=40_000)
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}}))
    with pytest.raises(CheckpointError, match=r"model\.safetensors\.index\.json: no 'weight_map'"):
        _engine(path)


# -- ModelConfig -----------------------------------------------------------------------------------------------

BASE = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 100, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8}


def _config(generation=None, **changes) -> ModelConfig:
    raw = {**BASE, **changes}
    return config_from_dict({k: v for k, v in raw.items() if v is not ...}, generation)


def test_rope_theta_from_rope_parameters_or_top_level():
    """rope_parameters.rope_theta (transformers 5) or a top-level rope_theta (4.x): either alone is
    used, both when they agree; when they disagree the file is refused (transformers 5 would take
    the first, 4.x the second); neither gives the 10000 default."""
    assert _config(rope_theta=123456.0).rope_theta == 123456.0
    assert _config(rope_parameters={"rope_type": "default", "rope_theta": 5e5}).rope_theta == 5e5
    assert _config(rope_parameters={"rope_type": "default", "rope_theta": 5e5}, rope_theta=5e5).rope_theta == 5e5
    with pytest.raises(CheckpointError, match="'rope_parameters.rope_theta'=500000.0 and 'rope_theta'=700000.0"):
        _config(rope_parameters={"rope_type": "default", "rope_theta": 5e5}, rope_theta=7e5)
    assert _config(rope_parameters={"rope_type": "default"}, rope_theta=7e5).rope_theta == 7e5
    assert _config().rope_theta == 10000.0
    with pytest.raises(ValueError, match="rope_type 'yarn'"):
        _config(rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0})


@pytest.mark.parametrize("generation,config_eos,expected", [
    ({"eos_token_id": 7}, [7, 9], (7, 9)),
    ({"eos_token_id": [1, 2]}, 3, (1, 2, 3)),
    ({}, [4, 5], (4, 5)),
    ({"eos_token_id": 6}, ..., (6,)),
    ({}, ..., ()),
])
def test_eos_ids_merge_generation_config_and_config(tmp_path, generation, config_eos, expected):
    """EOS ids come from generation_config.json then config.json, int or list, without repeats."""
    raw = {**BASE}
    if config_eos is not ...:
        raw["eos_token_id"] = config_eos
    (tmp_path / "config.json").write_text(json.dumps(raw))
    if generation:
        (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    assert read_config(tmp_path).eos_token_ids == expected


def test_head_dim_and_kv_heads_defaults():
    """Without head_dim it is 128 (Qwen3Config's default); null means hidden_size / heads; without
    kv heads, MHA."""
    assert _config(head_dim=...).head_dim == 128
    assert _config(head_dim=None).head_dim == 16
    cfg = _config(num_key_value_heads=...)
    assert cfg.num_key_value_heads == 4 and cfg.num_query_groups == 1
    assert _config().num_query_groups == 2


def test_config_errors_name_the_field():
    """Missing fields, indivisible heads and sliding windows are refused with the field named."""
    with pytest.raises(ValueError, match="missing required field 'vocab_size'"):
        _config(vocab_size=...)
    with pytest.raises(ValueError, match="num_attention_heads=4 is not a multiple of num_key_value_heads=3"):
        _config(num_key_value_heads=3)
    with pytest.raises(ValueError, match="use_sliding_window"):
        _config(use_sliding_window=True)


def test_config_matches_transformers_parse(source_checkpoint):
    """On a written checkpoint, pocketllm's ModelConfig agrees with transformers' own parse."""
    from transformers import AutoConfig

    ours = read_config(source_checkpoint)
    theirs = AutoConfig.from_pretrained(source_checkpoint)
    assert ours.architecture == theirs.architectures[0]
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "rms_norm_eps", "tie_word_embeddings", "attention_bias"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert ours.rope_theta == theirs.rope_parameters["rope_theta"]
