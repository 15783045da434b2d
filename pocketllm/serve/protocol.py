"""Request bodies of the OpenAI-compatible endpoints, as pydantic models.

Types are checked strictly (a "5" is not an int) and unknown fields are refused: a parameter the
engine does not implement must never be dropped silently. Parameters OpenAI or vLLM define that
pocketllm does not implement are accepted only at their neutral value (REFUSED;
`parallel_tool_calls` at either value without tools); fields that change no output (`store`,
`metadata`, `reasoning_effort`, `user`) are accepted and kept nowhere. Ranges are left to
SamplingParams, whose errors name the field too. Structured output is asked for by
`response_format` (OpenAI's), or by vLLM's `guided_json`, `guided_regex`, `guided_choice`,
`guided_grammar` or `structured_outputs` (`SamplingFields.constraints`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# field -> the value that means "off": anything else is refused with a 400 naming the field.
REFUSED: dict[str, Any] = {
    "best_of": None, "suffix": None, "use_beam_search": False,
    "length_penalty": 1.0, "tools": None, "tool_choice": None, "functions": None, "function_call": None}
# vLLM's guided_* fields -> the StructuredOutputsParams field each sets.
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


class UnsupportedParameter(ValueError):
    """A known OpenAI/vLLM parameter at a value pocketllm does not implement."""

    def __init__(self, name: str, value: Any) -> None:
        super().__init__(f"{name} is not supported by pocketllm (got {value!r}); see docs/serving.md's list of "
                         f"refused parameters")
        self.param = name


class StrictModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(StrictModel):
    include_usage: bool = False


class JsonSchemaFormat(StrictModel):
    """OpenAI's `response_format.json_schema`; `strict` is taken at either value: the output always
    follows the schema, with no property it does not name."""

    name: str
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SamplingFields(StrictModel):
    """What completions and chat share: the sampling parameters and the refused ones."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # vLLM's extra field; -1 also means "off" there
    seed: int | None = None
    n: int = Field(1, ge=1, le=128)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # vLLM's extra field
    ignore_eos: bool = False  # vLLM's extra field
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # metadata only, as the three below
    store: bool | None = None
    metadata: dict[str, str] | None = None
    reasoning_effort: str | None = None
    return_tokens_as_token_ids: bool = False  # vLLM's extra field: tokens as "token_id:N"
    # The logits controls (SamplingParams checks their ranges): OpenAI's, then vLLM's extra fields.
    logit_bias: dict[str, float] | None = None  # token id (a string, as JSON keys are) -> bias
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None  # text, tokenized as vLLM does (ServerState.bad_words)
    # Refused unless at their neutral value (REFUSED).
    best_of: int | None = None
    use_beam_search: bool = False
    length_penalty: float = 1.0
    # Structured output (SamplingParams.structured_outputs): one of these at most.
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None  # StructuredOutputsParams' fields

    def check_refused(self) -> None:
        """UnsupportedParameter for the first refused parameter set away from its neutral value."""
        for name, neutral in REFUSED.items():
            value = getattr(self, name, neutral)
            if name == "best_of" and value == self.n:  # best_of == n is plain sampling
                continue
            if value != neutral:
                raise UnsupportedParameter(name, value)

    def constraints(self) -> dict[str, dict[str, Any]]:
        """field -> the StructuredOutputsParams fields it asks for, for each field that asks for
        structured output (`response_format` {"type": "text"} asks for none: text is what is generated)."""
        found: dict[str, dict[str, Any]] = {}
        response_format = self.response_format
        if response_format is not None and response_format.type == "json_object":
            found["response_format"] = {"json_object": True}
        elif response_format is not None and response_format.type == "json_schema":
            if response_format.json_schema is None:
                raise ValueError('response_format of type "json_schema" needs its json_schema '
                                 '({"name": ..., "schema": {...}})')
            found["response_format"] = {"json": response_format.json_schema.schema_}
        for name, kind in GUIDED.items():
            if getattr(self, name) is not None:
                found[name] = {kind: getattr(self, name)}
        if self.structured_outputs is not None:
            found["structured_outputs"] = dict(self.structured_outputs)
        return found

    def stop_strings(self) -> list[str]:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not s for s in stop):
            raise ValueError("stop must not contain an empty string")
        return stop


Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(SamplingFields):
    prompt: Prompt
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id...: checked by pocketllm.chat
    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True  # vLLM's extra field
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    parallel_tool_calls: bool | None = None  # with no tools (refused) either value changes nothing
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's extra field: variables of the chat template


class TokenizeRequest(StrictModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = False
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: list[int]


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The messages as the plain dicts pocketllm.chat checks and renders."""
    return [m.model_dump(exclude_none=True) for m in messages]

