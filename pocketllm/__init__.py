"""pocketllm: a small research inference engine for Qwen-family models.

A request's tokens and logprobs are bitwise the same whatever else is in flight.
"""

from .config import EngineArgs, ModelConfig
from .llm import LLM, Capabilities
from .models import write_checkpoint
from .outputs import GenerationResult
from .sampling import SamplingParams

__all__ = ["LLM", "Capabilities", "EngineArgs", "GenerationResult", "ModelConfig", "SamplingParams",
           "write_checkpoint"]
__version__ = "0.1.0"
