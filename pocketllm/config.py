"""Engine and model configuration.

`EngineArgs` is what a user passes to `LLM`; `ModelConfig` is parsed from a Hugging Face
`config.json` (plus `generation_config.json` for EOS ids) and is all the model code reads.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

import torch

from .options import Options, parse_backend_options

Backend = Literal["torch", "triton"]
DTypeName = Literal["float32", "bfloat16", "float16"]
BACKENDS: tuple[Backend, ...] = get_args(Backend)
DTYPES: dict[DTypeName, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                                        "float16": torch.float16}


@dataclass
class EngineArgs:
    """How to build an engine: which checkpoint, backend, dtype, device and cache size.

    `backend_options` (a flat dict, None for all defaults; see `pocketllm.options`) is checked and
    parsed once into `options`, which is what the engine reads; afterwards `backend_options` holds
    every key with its value, defaults filled in.
    """

    model: str
    backend: Backend = "torch"
    dtype: DTypeName = "float32"
    device: str = "cpu"
    max_seq_len: int = 4096
    backend_options: dict[str, Any] | None = None
    options: Options = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.model, (str, Path)):
            raise TypeError(f"model must be a path to a checkpoint directory, got {type(self.model).__name__}")
        self.model = str(self.model)
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {self.dtype!r}")
        if isinstance(self.max_seq_len, bool) or not isinstance(self.max_seq_len, int) or self.max_seq_len < 2:
            raise ValueError(f"max_seq_len must be an int >= 2, got {self.max_seq_len!r}")
        self.options = parse_backend_options(self.backend_options)
        self.backend_options = self.options.as_dict()

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def max_batch_size(self) -> int:
        return self.options.engine.max_batch_size


@dataclass(frozen=True)
class ModelConfig:
    """The architecture hyper-parameters pocketllm needs, read from a Hugging Face config.json."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    eos_token_ids: tuple[int, ...]
    # Hybrid models (Qwen3.5): which layers are "linear_attention" (Gated DeltaNet) and their sizes.
    layer_types: tuple[str, ...] = ()
    partial_rotary_factor: float = 1.0
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 4

    @property
    def num_query_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        config_file = path / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"{config_file}: no config.json in the model directory")
        raw = json.loads(config_file.read_text())
        generation_file = path / "generation_config.json"
        generation = json.loads(generation_file.read_text()) if generation_file.is_file() else {}
        return cls.from_dict(raw, generation, source=str(config_file))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], generation: dict[str, Any] | None = None,
                  source: str = "config.json") -> "ModelConfig":
        architectures = raw.get("architectures") or []
        architecture = architectures[0] if architectures else raw.get("model_type", "<missing>")
        if isinstance(raw.get("text_config"), dict):  # multimodal layout: the language model's fields are nested
            text = raw["text_config"]
            raw = {**text, "tie_word_embeddings": raw.get("tie_word_embeddings", text.get("tie_word_embeddings")),
                   "eos_token_id": text.get("eos_token_id", raw.get("eos_token_id"))}

        def need(key: str) -> Any:
            if key not in raw:
                raise ValueError(f"{source}: missing required field {key!r}")
            return raw[key]

        if raw.get("use_sliding_window"):
            raise ValueError(f"{source}: use_sliding_window=true is not supported")
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"{source}: rope_type {rope_type!r} is not supported (only 'default')")
        rope_theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
        heads = need("num_attention_heads")
        kv_heads = raw.get("num_key_value_heads") or heads
        if heads % kv_heads:
            raise ValueError(f"{source}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv_heads}")
        hybrid = architecture.startswith("Qwen3_5")
        layers = need("num_hidden_layers")
        layer_types = tuple(raw.get("layer_types") or (
            ["linear_attention" if (i + 1) % raw.get("full_attention_interval", 4) else "full_attention"
             for i in range(layers)] if hybrid else ["full_attention"] * layers))
        if len(layer_types) != layers or set(layer_types) - {"full_attention", "linear_attention"}:
            raise ValueError(f"{source}: layer_types must list 'full_attention'/'linear_attention' for each of "
                             f"the {layers} layers, got {list(layer_types)}")
        return cls(
            architecture=architecture,
            vocab_size=need("vocab_size"),
            hidden_size=need("hidden_size"),
            intermediate_size=need("intermediate_size"),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=_head_dim(raw, heads, default=256 if hybrid else 128),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            max_position_embeddings=int(raw.get("max_position_embeddings", 32768)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", False)),
            eos_token_ids=_eos_ids(raw, generation or {}),
            layer_types=layer_types,
            partial_rotary_factor=float(rope.get("partial_rotary_factor", raw.get("partial_rotary_factor",
                                                                                 0.25 if hybrid else 1.0))),
            linear_num_key_heads=int(raw.get("linear_num_key_heads", 0)),
            linear_num_value_heads=int(raw.get("linear_num_value_heads", 0)),
            linear_key_head_dim=int(raw.get("linear_key_head_dim", 0)),
            linear_value_head_dim=int(raw.get("linear_value_head_dim", 0)),
            linear_conv_kernel_dim=int(raw.get("linear_conv_kernel_dim", 4)),
        )


def _head_dim(raw: dict[str, Any], heads: int, default: int) -> int:
    """The config class's default (Qwen3: 128, Qwen3.5: 256) when the field is absent;
    hidden_size / heads when it is null."""
    if "head_dim" not in raw:
        return default
    return raw["head_dim"] or raw["hidden_size"] // heads


def _eos_ids(raw: dict[str, Any], generation: dict[str, Any]) -> tuple[int, ...]:
    """EOS ids from generation_config.json, falling back to config.json; int or list in either."""
    ids: list[int] = []
    for source in (generation, raw):
        value = source.get("eos_token_id")
        if value is None:
            continue
        for token in value if isinstance(value, list) else [value]:
            if token not in ids:
                ids.append(int(token))
    return tuple(ids)
