"""The multi-token-prediction layer that Qwen3.5 checkpoints ship beside the model (`mtp.*`, which
transformers skips on load): a draft head for speculative decoding.

For the token t_j at position j and the model's final-normed hidden state h_{j-1} of the position
before it, `fc(cat[norm_e(embed(t_j)), norm_h(h_{j-1})])` goes through one full-attention decoder
layer of the model's own kind (its K/V in a cache of its own, at position j), then `norm` and the
model's lm_head: logits for token j + 1. Further drafts feed the layer's own normed output in
place of the model's hidden state. The embedding and lm_head are the model's.

`mtp_weights` writes the same tensors into a random checkpoint (`write_checkpoint(mtp=True)`),
under the published names, so that the engine's tests load them.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from ..cache import SlotCache
from ..config import ModelConfig
from ..config_fields import CheckpointError
from .batch import ForwardBatch
from .layers import DecoderBlock, DecoderModel, Shapes, body_ops
from .loader import checkpoint_files, load_weights
from .registry import family_of

PREFIX = "mtp."
LAYER = PREFIX + "layers.0."


def _model_layer(cfg: ModelConfig) -> str:
    """The prefix of the model's first full-attention layer, whose tensors the MTP layer's mirror."""
    index = cfg.layer_types.index("full_attention")
    prefix = "model.language_model." if "ConditionalGeneration" in cfg.architecture else "model."
    return f"{prefix}layers.{index}."


def mtp_shapes(cfg: ModelConfig) -> Shapes:
    """Names and shapes of the MTP tensors a checkpoint of `cfg` ships (one layer)."""
    hidden, model_layer = cfg.hidden_size, _model_layer(cfg)
    shapes: Shapes = {PREFIX + "fc.weight": (hidden, 2 * hidden), PREFIX + "pre_fc_norm_embedding.weight": (hidden,),
                      PREFIX + "pre_fc_norm_hidden.weight": (hidden,), PREFIX + "norm.weight": (hidden,)}
    for name, shape in family_of(cfg).expected_weights(cfg).items():
        if name.startswith(model_layer):
            shapes[LAYER + name[len(model_layer):]] = shape
    return shapes


def mtp_weights(cfg: ModelConfig, generator: torch.Generator, init_std: float = 0.02) -> dict[str, torch.Tensor]:
    """Random MTP tensors for a checkpoint of `cfg`, initialised as the family initialises its own."""
    family, weights = family_of(cfg), {}
    for name, shape in mtp_shapes(cfg).items():
        noise = torch.randn(shape, generator=generator)
        own = family.init_weight(name, noise, generator)
        weights[name] = own if own is not None else (1.0 + 0.1 * noise if len(shape) == 1 and "norm" in name
                                                    else init_std * noise)
    return weights


def has_mtp(path: str | Path) -> bool:
    """Whether the checkpoint at `path` ships MTP tensors."""
    for file in checkpoint_files(Path(path)):
        with safe_open(str(file), framework="pt") as handle:
            if any(name.startswith(PREFIX + "fc.") for name in handle.keys()):  # noqa: SIM118 (not a dict)
                return True
    return False


class MtpLayer:
    """The MTP layer of `model` (a Qwen3.5 model), read from the checkpoint at `path`."""

    def __init__(self, path: str | Path, model: DecoderModel) -> None:
        cfg = model.cfg
        if "full_attention" not in cfg.layer_types or not has_mtp(path):
            raise CheckpointError(f"{path}: the checkpoint has no multi-token-prediction tensors ({PREFIX}fc.weight "
                                  f"and the rest); speculative method 'mtp' needs them")
        shapes = mtp_shapes(cfg)
        weights = load_weights(path, shapes, model.dtype, model.embed.device, skip=lambda name: name not in shapes)
        self.model, self.ops, self.eps = model, model.ops, cfg.rms_norm_eps
        self.fc = weights[PREFIX + "fc.weight"]
        self.norm_embedding = model.norm_weight(weights[PREFIX + "pre_fc_norm_embedding.weight"])
        self.norm_hidden = model.norm_weight(weights[PREFIX + "pre_fc_norm_hidden.weight"])
        self.norm = model.norm_weight(weights[PREFIX + "norm.weight"])
        self.block: DecoderBlock = model.build_block(weights, LAYER, "full_attention")

    def cache_specs(self) -> list:
        return [self.block.mixer.cache_spec]

    def forward(self, batch: ForwardBatch, cache: SlotCache, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(fp32 logits of `batch.logit_rows`, the layer's normed output of every row), the token
        rows of `batch` paired with `hidden`, the hidden state of the position before each."""
        ops, eps = body_ops(self.ops, batch), self.eps
        embedded = ops.rms_norm(self.model.ops.embedding(batch.input_ids, self.model.embed).to(self.model.dtype),
                                self.norm_embedding, eps)
        x = ops.linear(torch.cat([embedded, ops.rms_norm(hidden, self.norm_hidden, eps)], dim=-1), self.fc)
        normed = ops.rms_norm(self.block.forward(ops, x, batch, cache, 0, eps), self.norm, eps)
        logits = ops.linear(normed.index_select(0, batch.logit_rows), self.model.lm_head).float()
        return logits, normed
