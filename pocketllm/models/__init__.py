"""Model definitions, the checkpoint loader and the random-checkpoint writer."""

from .batch import ForwardBatch
from .family import Family
from .loader import CheckpointError, load_weights
from .presets import PRESETS, cached_checkpoint, write_checkpoint
from .protocol import Model
from .registry import ARCHITECTURES, FAMILIES, build_model, config_from_dict, family_of, read_config

__all__ = ["ARCHITECTURES", "CheckpointError", "FAMILIES", "Family", "ForwardBatch", "Model", "PRESETS", "build_model",
           "cached_checkpoint", "config_from_dict", "family_of", "load_weights", "read_config", "write_checkpoint"]
