"""Engine and model configuration.

`EngineArgs` is what a user passes to `LLM`; `ModelConfig` is parsed from a Hugging Face
`config.json` (plus `generation_config.json` for EOS ids) and is all the model code reads.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from .config_fields import REQUIRED, CheckpointError, Fields, check_device, short
from .kernels import backends
from .kernels.registry import ImplSpec, check_overrides
from .options import Options, parse_backend_options
from .speculative import SpeculativeConfig, speculative_config

# An untrusted config.json's layer count is bounded before anything is built per layer.
MAX_LAYERS = 4096

# A backend is a name in the registry `kernels.backends.BACKENDS`; a registry, not a Literal, so
# that a backend is added in one file (EngineArgs checks the name at run time).
Backend = str
DTypeName = Literal["float32", "bfloat16", "float16"]
BACKENDS: tuple[Backend, ...] = tuple(backends.BACKENDS)
DTYPES: dict[DTypeName, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16,
                                        "float16": torch.float16}
# dtype -> the weight dtypes it runs with, itself included: what the fixed-order kernel multiplies.
MIXED_WEIGHT_DTYPES: dict[str, tuple[DTypeName, ...]] = {"float32": ("float32", "bfloat16")}
BF16_PRODUCTS = ("dot", "widen")  # how bf16 weights under fp32 rows are multiplied (`bf16_product`)


@dataclass
class EngineArgs:
    """How to build an engine: which checkpoint, backend, dtype, device and cache size.

    `backend_options` (a flat dict, None for all defaults; see `pocketllm.options`) is checked and
    parsed once into `options`, which is what the engine reads; afterwards `backend_options` holds
    every key with its value, defaults filled in.

    `op_overrides` runs ops on other implementations than the backend's: op name -> a registered
    implementation name ("ref", "triton", ...), an import path "package.module:function", or a
    callable, each checked against the op's signature here (see `pocketllm.kernels.registry`).

    `tensor_parallel_size` > 1 shards the model over that many processes (this one and workers it
    starts; on CUDA one GPU each, from `device` on); `pipeline_parallel_size` > 1 gives each process
    a block of consecutive layers instead; see `pocketllm.parallel`.

    `weight_dtype` (None: `dtype`) is the dtype the weight matrices are kept in (every tensor of two or
    more dimensions but the Gated DeltaNet convolutions: the linear layers, the experts, the embedding
    and lm_head). "bfloat16" under dtype "float32" halves the bytes a decode step reads while rows stay
    fp32 and accumulate in fp32 in the C++ kernel's fixed order, so it needs the torch backend's
    fixed-order kernels (exact positions on, a C++ compiler here). `bf16_product` says how the linear
    layers multiply those weights: "dot" (the default) rounds each row to bf16 and multiplies on the
    CPU's bf16 dot-product instruction (its software form, with the same bits, on CPUs without it);
    "widen" widens each weight to fp32 exactly and keeps the rows fp32, so the engine computes bit for
    bit what an fp32 engine computes on the checkpoint's matrices rounded to bf16. Both keep every
    invariance promise; the experts of MoE layers follow `bf16_product` as the linear layers do.

    `enable_expert_parallel` (vLLM's name): above one rank a mixture of experts' ranks hold whole
    experts, a block each, rather than a block of every expert's features; the same bits either way
    with the reduction tree (see `pocketllm.models.experts`). No effect on dense models.

    `speculative` (None: off): vLLM's `speculative_config` dict, checked into `speculative_config`
    (`pocketllm.speculative`): drafts verified so that the output is bitwise the output without them."""

    model: str
    backend: Backend = backends.DEFAULT_BACKEND
    dtype: DTypeName = "float32"
    device: str = "cpu"
    max_seq_len: int = 4096
    backend_options: dict[str, Any] | None = None
    op_overrides: dict[str, ImplSpec] | None = None
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    enable_expert_parallel: bool = False
    weight_dtype: DTypeName | None = None
    bf16_product: str = "dot"
    speculative: dict[str, Any] | None = None
    options: Options = field(init=False, repr=False)
    speculative_config: SpeculativeConfig | None = field(init=False, repr=False)

    def __post_init__(self) -> None:
        _check_engine_fields(self)
        if self.op_overrides is not None:
            check_overrides(self.op_overrides)
        self.options = parse_backend_options(self.backend_options)
        self.backend_options = self.options.as_dict()
        self.speculative_config = speculative_config(self.speculative)
        self.speculative = None if self.speculative_config is None else self.speculative_config.as_dict()

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def torch_weight_dtype(self) -> torch.dtype:
        return DTYPES[self.weight_dtype or self.dtype]

    @property
    def max_batch_size(self) -> int:
        return self.options.engine.max_batch_size


def _check_engine_fields(args: EngineArgs) -> None:
    """model, backend, dtype, device and max_seq_len: TypeError/ValueError naming the field and
    what it accepts. `model` becomes a str."""
    if not isinstance(args.model, (str, Path)):
        raise TypeError(f"model must be a path to a checkpoint directory, got {type(args.model).__name__}")
    args.model = str(args.model)
    for name, allowed in (("backend", BACKENDS), ("dtype", tuple(DTYPES))):
        value = getattr(args, name)
        if not isinstance(value, str) or value not in allowed:
            raise ValueError(f"{name} must be one of {allowed}, got {short(value)}")
    weight_dtypes = MIXED_WEIGHT_DTYPES.get(args.dtype, (args.dtype,))
    if args.weight_dtype is not None and args.weight_dtype not in weight_dtypes:
        raise ValueError(f"weight_dtype must be None or one of {weight_dtypes} with dtype {args.dtype!r}, got "
                         f"{short(args.weight_dtype)}")
    if args.bf16_product not in BF16_PRODUCTS:
        raise ValueError(f"bf16_product must be one of {BF16_PRODUCTS}, got {short(args.bf16_product)}")
    if isinstance(args.max_seq_len, bool) or not isinstance(args.max_seq_len, int) or args.max_seq_len < 2:
        raise ValueError(f"max_seq_len must be an int >= 2, got {short(args.max_seq_len)}")
    check_device(args.device)
    for name in ("tensor_parallel_size", "pipeline_parallel_size"):
        size = getattr(args, name)
        if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= 64:
            raise ValueError(f"{name} must be an int in [1, 64], got {short(size)}")
    if not isinstance(args.enable_expert_parallel, bool):
        raise ValueError(f"enable_expert_parallel must be True or False, got {short(args.enable_expert_parallel)}")


@dataclass(frozen=True)
class ConfigDefaults:
    """What a model family's config.json may leave out, as the family's own code assumes it
    (each family's record in `models.registry` has one; an unknown architecture gets these)."""

    head_dim: int | None = 128  # None: hidden_size // num_attention_heads (as for a null head_dim)
    partial_rotary_factor: float = 1.0
    # Hybrid families: every full_attention_interval-th layer is full attention, the others linear
    # attention, when config.json has no layer_types. None: every layer is full attention.
    full_attention_interval: int | None = None
    # Mixture-of-experts families: num_experts, num_experts_per_tok and moe_intermediate_size are
    # required; `norm_topk_prob` when config.json does not say; `shared_expert`: every sparse layer
    # has a gated shared expert (shared_expert_intermediate_size required); `dense_mlp`: some layer
    # may be a dense SwiGLU (intermediate_size required). A family without (Qwen3.5-MoE, whose
    # transformers config has no mlp_only_layers, decoder_sparse_step nor norm_topk_prob) ignores those.
    moe: bool = False
    norm_topk_prob: bool = False
    shared_expert: bool = False
    dense_mlp: bool = True

    def layer_types(self, layers: int, interval: int) -> list[str]:
        if self.full_attention_interval is None:
            return ["full_attention"] * layers
        return ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(layers)]


# (architecture, source) -> its family's defaults; a CheckpointError naming the supported ones for an
# unknown architecture. The model registry passes its own (`models.read_config`): this module knows
# no family.
DefaultsOf = Callable[[str, str], ConfigDefaults]


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
    # Mixture-of-experts models (Qwen3-MoE, Qwen3.5-MoE); num_experts 0: every layer dense.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    shared_expert_intermediate_size: int = 0  # 0: no shared expert

    def sparse_layer(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is the mixture of experts (else the dense SwiGLU), as
        transformers decides it: not in mlp_only_layers, and every decoder_sparse_step-th layer."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @property
    def num_query_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_dir(cls, path: str | Path, defaults_of: DefaultsOf) -> ModelConfig:
        """Parse `path`/config.json (and generation_config.json when present), a family's omitted fields
        from `defaults_of`. A file that is not a JSON object, or a field of the wrong type or an
        impossible value, is a CheckpointError naming the file and the field."""
        path = Path(path)
        config_file = path / "config.json"
        if not config_file.is_file():
            raise FileNotFoundError(f"{config_file}: no config.json in the model directory")
        raw = read_json_object(config_file)
        generation_file = path / "generation_config.json"
        generation = read_json_object(generation_file) if generation_file.is_file() else {}
        return cls.from_dict(raw, defaults_of, generation, source=str(config_file),
                             generation_source=str(generation_file))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], defaults_of: DefaultsOf, generation: dict[str, Any] | None = None,
                  source: str = "config.json", generation_source: str = "generation_config.json") -> ModelConfig:
        architecture, fields = _language_model_fields(raw, source)
        if fields.get("use_sliding_window", bool, False):
            raise CheckpointError(f"{source}: use_sliding_window=true is not supported")
        fields.get("rope_parameters", dict, None)  # an object, when present (the keys in it: config_fields.ALIASES)
        rope_type = fields.get("rope_type", str, "default")
        if rope_type != "default":
            raise CheckpointError(f"{source}: rope_type {rope_type!r} is not supported (only 'default')")
        rope_theta = fields.positive_float("rope_theta", 10000.0)
        heads = fields.positive_int("num_attention_heads")
        kv_heads = fields.positive_int("num_key_value_heads", None) or heads
        if heads % kv_heads:
            raise CheckpointError(f"{source}: num_attention_heads={heads} is not a multiple of "
                                  f"num_key_value_heads={kv_heads}")
        defaults = defaults_of(architecture, source)
        layer_types = _layer_types(fields, defaults, source)
        layers = len(layer_types)
        hidden = fields.positive_int("hidden_size")
        head_dim = fields.positive_int("head_dim", defaults.head_dim, null=None)
        partial = fields.positive_float("partial_rotary_factor", defaults.partial_rotary_factor)
        cfg = cls(
            architecture=architecture,
            vocab_size=fields.positive_int("vocab_size"),
            hidden_size=hidden,
            intermediate_size=fields.positive_int("intermediate_size", REQUIRED if defaults.dense_mlp else 0,
                                                  minimum=1 if defaults.dense_mlp else 0),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim if head_dim is not None else hidden // heads,  # null: hidden_size / heads
            rms_norm_eps=fields.positive_float("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            max_position_embeddings=fields.positive_int("max_position_embeddings", 32768),
            tie_word_embeddings=fields.get("tie_word_embeddings", bool, False),
            attention_bias=fields.get("attention_bias", bool, False),
            eos_token_ids=_eos_ids(Fields(generation or {}, generation_source), fields),
            layer_types=layer_types,
            partial_rotary_factor=partial,
            linear_num_key_heads=fields.positive_int("linear_num_key_heads", 0, minimum=0),
            linear_num_value_heads=fields.positive_int("linear_num_value_heads", 0, minimum=0),
            linear_key_head_dim=fields.positive_int("linear_key_head_dim", 0, minimum=0),
            linear_value_head_dim=fields.positive_int("linear_value_head_dim", 0, minimum=0),
            linear_conv_kernel_dim=fields.positive_int("linear_conv_kernel_dim", 4),
            **_moe_fields(fields, defaults, layers),
        )
        _check_consistent(cfg, source)
        return cfg


def _language_model_fields(raw: dict[str, Any], source: str) -> tuple[str, Fields]:
    """The architecture name, and the fields of the language model: config.json's own, or in the
    multimodal layout its nested text_config (with the top level's tie and EOS fields)."""
    fields = Fields(raw, source)
    architectures = fields.get("architectures", list, [])
    if architectures and not isinstance(architectures[0], str):
        fields.fail("architectures", "must be a list of architecture names (str)", architectures)
    architecture = architectures[0] if architectures else fields.get("model_type", str, "<missing>")
    text = fields.get("text_config", dict, None)
    if text is not None:
        fields = Fields({**text,
                          "tie_word_embeddings": raw.get("tie_word_embeddings", text.get("tie_word_embeddings")),
                          "eos_token_id": text.get("eos_token_id", raw.get("eos_token_id"))},
                         f"{source} (text_config)")
    return architecture, fields


def _moe_fields(fields: Fields, defaults: ConfigDefaults, layers: int) -> dict[str, Any]:
    """The mixture-of-experts fields of a MoE family's config (required where the family has them);
    none for a dense family."""
    if not defaults.moe:
        return {}
    experts = fields.positive_int("num_experts")
    top_k = fields.positive_int("num_experts_per_tok")
    if top_k > experts:
        fields.fail("num_experts_per_tok", f"must be at most num_experts={experts}", top_k)
    # A family without dense layers (Qwen3.5-MoE): every layer sparse, `norm_topk_prob` its own.
    mlp_only = fields.get("mlp_only_layers", list, []) if defaults.dense_mlp else []
    if not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i < layers for i in mlp_only):
        fields.fail("mlp_only_layers", f"must list layer indices in [0, {layers})", mlp_only)
    shared = fields.positive_int("shared_expert_intermediate_size", REQUIRED if defaults.shared_expert else 0,
                                 minimum=1 if defaults.shared_expert else 0)
    return {"num_experts": experts, "num_experts_per_tok": top_k,
            "moe_intermediate_size": fields.positive_int("moe_intermediate_size"),
            "norm_topk_prob": (fields.get("norm_topk_prob", bool, defaults.norm_topk_prob) if defaults.dense_mlp
                               else defaults.norm_topk_prob),
            "decoder_sparse_step": fields.positive_int("decoder_sparse_step", 1) if defaults.dense_mlp else 1,
            "mlp_only_layers": tuple(sorted(set(mlp_only))), "shared_expert_intermediate_size": shared}


def _layer_types(fields: Fields, defaults: ConfigDefaults, source: str) -> tuple[str, ...]:
    """Each layer's kind: config.json's layer_types, else as the family's defaults lay them out."""
    layers = fields.positive_int("num_hidden_layers")
    if layers > MAX_LAYERS:
        fields.fail("num_hidden_layers", f"must be at most {MAX_LAYERS}", layers)
    interval = fields.positive_int("full_attention_interval", defaults.full_attention_interval or 1)
    layer_types = tuple(fields.get("layer_types", list, None) or defaults.layer_types(layers, interval))
    known = ("full_attention", "linear_attention")
    if len(layer_types) != layers or not all(kind in known for kind in layer_types):
        raise CheckpointError(f"{source}: layer_types must list 'full_attention'/'linear_attention' for each of "
                              f"the {layers} layers, got {short(list(layer_types))}")
    return layer_types


def read_json_object(path: Path) -> dict[str, Any]:
    """The JSON object in `path`; CheckpointError naming the file when it is unreadable text,
    not JSON, or JSON but not an object."""
    try:
        value = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})") from None
    except (ValueError, RecursionError) as exc:  # an integer too long to convert, nesting too deep
        raise CheckpointError(f"{path}: not valid JSON ({type(exc).__name__}: {exc})") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: must hold a JSON object, got a JSON {type(value).__name__}")
    return value


def _check_consistent(cfg: ModelConfig, source: str) -> None:
    """Relations between fields that the model needs."""
    if cfg.head_dim < 1:
        raise CheckpointError(f"{source}: head_dim (null: hidden_size / num_attention_heads) must be >= 1, "
                              f"got {cfg.head_dim}")
    if not 0 < cfg.partial_rotary_factor <= 1 or cfg.rotary_dim % 2 or cfg.rotary_dim == 0:
        raise CheckpointError(f"{source}: partial_rotary_factor={cfg.partial_rotary_factor} with head_dim="
                              f"{cfg.head_dim} must give an even rotary width in [2, head_dim]")
    if "linear_attention" in cfg.layer_types:
        dims = {"linear_num_key_heads": cfg.linear_num_key_heads, "linear_num_value_heads": cfg.linear_num_value_heads,
                "linear_key_head_dim": cfg.linear_key_head_dim, "linear_value_head_dim": cfg.linear_value_head_dim}
        for key, value in dims.items():
            if value < 1:
                raise CheckpointError(f"{source}: field {key!r} must be an integer >= 1 for linear_attention "
                                      f"layers, got {value}")
        if cfg.linear_num_value_heads % cfg.linear_num_key_heads:
            raise CheckpointError(f"{source}: linear_num_value_heads={cfg.linear_num_value_heads} is not a "
                                  f"multiple of linear_num_key_heads={cfg.linear_num_key_heads}")
    for eos in cfg.eos_token_ids:
        if eos >= cfg.vocab_size:
            raise CheckpointError(f"{source}: eos_token_id {eos} is outside the vocabulary [0, {cfg.vocab_size})")


def _eos_ids(generation: Fields, config: Fields) -> tuple[int, ...]:
    """EOS ids from generation_config.json, falling back to config.json; int or list in either."""
    ids: list[int] = []
    for fields in (generation, config):
        value = fields.raw.get("eos_token_id")
        if value is None:
            continue
        for token in value if isinstance(value, list) else [value]:
            if isinstance(token, bool) or not isinstance(token, int) or token < 0:
                fields.fail("eos_token_id", "must be an integer >= 0 or a list of them", value)
            if token not in ids:
                ids.append(token)
    return tuple(ids)
