"""Model definitions, the checkpoint loader and the random-checkpoint writer."""

from .batch import ForwardBatch
from .loader import CheckpointError, load_weights
from .presets import PRESETS, cached_checkpoint, write_checkpoint
from .protocol import Model
from .registry import ARCHITECTURES, build_model

__all__ = ["ARCHITECTURES", "CheckpointError", "ForwardBatch", "Model", "PRESETS", "build_model", "cached_checkpoint",
           "load_weights", "write_checkpoint"]
