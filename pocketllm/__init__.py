"""pocketllm: a small research inference engine for Qwen-family models.

A request's tokens and logprobs are bitwise the same whatever else is in flight.
"""

from .async_llm import AsyncLLM
from .config import EngineArgs, ModelConfig
from .llm import LLM, Capabilities
from .models import write_checkpoint
from .outputs import GenerationResult
from .sampling import SamplingParams
from .scheduler.batch_scheduler import QueueFullError, SwapSpaceError
from .scheduler.stream import TokenDelta
from .structured_outputs import StructuredOutputsParams
from .version import __version__

__all__ = ["LLM", "AsyncLLM", "Capabilities", "EngineArgs", "GenerationResult", "ModelConfig", "QueueFullError",
           "SamplingParams", "StructuredOutputsParams", "SwapSpaceError", "TokenDelta", "__version__",
           "write_checkpoint"]
