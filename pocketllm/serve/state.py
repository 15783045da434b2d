"""What every endpoint needs from the engine: the served model's name, token strings, limits."""

from __future__ import annotations

import asyncio
import math
import re
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..async_llm import AsyncLLM
from ..config import read_json_object
from ..fingerprint import bits_fingerprint
from ..grammar import GrammarError
from ..outputs import TopLogprobs
from ..sampling import SamplingParams
from ..scheduler.request import validate_prompt
from ..structured_outputs import StructuredOutputsParams
from ..structured_outputs import structured_outputs as checked_structured_outputs
from ..tokenizer import TOKENIZER_CONFIG_FILE, token_bytes
from .errors import APIError, bad_request
from .protocol import SamplingFields
from .runs import ChoiceSpec, InFlight

# SamplingParams fields the request names otherwise.
CONTROL_RENAMES = {"bad_words_token_ids": "bad_words"}
# JSON has no -inf; like vLLM, a logprob of -inf is reported as this.
MIN_LOGPROB = -9999.0
MAX_SEED = 2**64


def logprob(value: float | None) -> float | None:
    return None if value is None else (MIN_LOGPROB if value == -math.inf else value)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


@dataclass
class ServerState:
    """The engine behind the app and how the app names and shows its tokens."""

    engine: AsyncLLM
    model_name: str
    created: int = field(default_factory=lambda: int(time.time()))
    inflight: InFlight = field(init=False)
    fingerprint: str = field(init=False)  # every response's system_fingerprint (pocketllm.fingerprint)

    def __post_init__(self) -> None:
        self.inflight = InFlight(self.engine)
        self.fingerprint = bits_fingerprint(self.engine.llm)  # the checkpoint's files hashed once, here

    @property
    def max_seq_len(self) -> int:
        return self.engine.llm.args.max_seq_len

    def check_model(self, name: str | None) -> None:
        """404 for a model this server does not serve (None: the served one, as vLLM allows)."""
        if name is not None and name != self.model_name:
            raise APIError(404, f"The model `{name}` does not exist; this server serves `{self.model_name}`", "model")

    def check_request(self, req: SamplingFields) -> list[str]:
        """The checks every generation request starts with; its stop strings."""
        self.check_model(req.model)
        req.check_refused()
        if req.stream_options is not None and not req.stream:
            raise APIError(400, "stream_options is only allowed with stream=true", "stream_options")
        with bad_request("stop"):
            return req.stop_strings()

    def check_prompts(self, prompts: Sequence[list[int]], params: SamplingParams, prompt_field: str,
                      tokens_field: str | None) -> None:
        """Each prompt as the engine checks it, before anything is submitted, so that the error names
        what to change: `tokens_field` (the max-tokens field the client sent) when the prompt fits
        the context but not with that many tokens after it, else the prompt (which one of several)."""
        vocab_size = self.engine.llm.model_config.vocab_size
        for i, prompt in enumerate(prompts):
            where = prompt_field if len(prompts) == 1 else f"{prompt_field}[{i}]"
            room = self.max_seq_len - len(prompt)
            if tokens_field is not None and 0 < room < params.max_tokens:
                raise APIError(400, f"{tokens_field} must be at most {room} here ({where} has {len(prompt)} tokens, "
                                    f"max_seq_len is {self.max_seq_len}), got {params.max_tokens}", tokens_field)
            with bad_request(prompt_field, CONTROL_RENAMES, where=where):
                validate_prompt(prompt, params, vocab_size, self.max_seq_len)

    async def check_structured(self, params: SamplingParams, field: str | None) -> None:
        """The request's structured output compiled (off the event loop: a first compile builds the
        tokenizer's tables) before anything is submitted; a 400 naming `field` when it does not compile,
        or when xgrammar is not installed."""
        spec = params.structured_outputs
        if spec is None or field is None:
            return
        try:
            await asyncio.to_thread(self.engine.llm.grammars.compile, spec)
        except GrammarError as exc:
            label = _label(field, exc.kind)
            raise APIError(400, str(exc) if label == f"structured_outputs.{exc.kind}" else f"{label}: {exc.reason}",
                           field) from None
        except (ValueError, ImportError) as exc:
            raise APIError(400, f"{field}: {exc}", field) from None

    def bad_words(self, words: list[str] | None) -> tuple[tuple[int, ...], ...]:
        """`bad_words` as token id sequences, as vLLM tokenizes them: each word (leading spaces
        stripped) alone, and after a space too where that gives a different first token and as many
        tokens (the word inside a text); a 400 naming `bad_words` without a tokenizer or for a blank word."""
        if not words:
            return ()
        tokenizer = self.engine.llm.tokenizer
        if tokenizer is None:
            raise APIError(400, "bad_words needs the model's tokenizer (tokenizer.json); this model has none",
                           "bad_words")
        sequences: list[tuple[int, ...]] = []
        for word in words:
            alone = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False).ids)
            if not word.strip() or not alone:
                raise APIError(400, f"bad_words must not contain a blank string, got {word!r}", "bad_words")
            spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False).ids)
            sequences.append(alone)
            if spaced[0] != alone[0] and len(spaced) == len(alone):
                sequences.append(spaced)
        return tuple(sequences)

    def tokenizer_info(self) -> dict[str, Any]:
        """vLLM's /tokenizer_info: the checkpoint's tokenizer_config.json (file paths left out), its
        `tokenizer_class` and the chat template the server renders with."""
        llm = self.engine.llm
        if llm.tokenizer is None:
            raise APIError(404, "this model has no tokenizer (tokenizer.json)", None)
        path = Path(llm.args.model) / TOKENIZER_CONFIG_FILE
        saved = read_json_object(path) if path.is_file() else {}
        config = {key: value for key, value in saved.items() if not key.endswith("_file")}
        config.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
        if llm.chat_template is not None:
            config["chat_template"] = llm.chat_template
        return config

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        tokenizer = self.engine.llm.tokenizer
        if tokenizer is None:
            return ""
        return str(tokenizer.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def encode(self, text: str, where: str = "prompt") -> list[int]:
        """A text prompt's token ids; `where` names it in errors (prompt[i] of several)."""
        if not text:
            raise APIError(400, f"{where} must not be an empty string", "prompt")
        with bad_request("prompt", where=where):
            return list(self.engine.llm.prepare(None, text))

    def token_bytes(self, token_id: int) -> bytes:
        """The token's own bytes (tokenizer.token_bytes), or its shown text's without a tokenizer."""
        tokenizer = self.engine.llm.tokenizer
        return f"token_id:{token_id}".encode() if tokenizer is None else token_bytes(tokenizer, token_id)

    def token_str(self, token_id: int, as_ids: bool) -> str:
        """A token as logprobs show it: its own text, special tokens included (or "token_id:N")."""
        if as_ids or self.engine.llm.tokenizer is None:
            return f"token_id:{token_id}"
        return self.decode([token_id], skip_special_tokens=False)

    def top_dict(self, top: TopLogprobs | None, chosen: int, chosen_lp: float | None,
                 as_ids: bool) -> dict[str, float | None]:
        """{token: logprob} of a position's alternatives and its chosen token, as completions show them."""
        out: dict[str, float | None] = {self.token_str(t, as_ids): logprob(lp) for t, lp in top or []}
        out.setdefault(self.token_str(chosen, as_ids), logprob(chosen_lp))
        return out


def _label(field: str, kind: str) -> str:
    """What an error about a structured output's `kind` calls it in the request's `field`."""
    if field == "response_format":
        return "response_format.json_schema.schema" if kind == "json" else field
    return f"structured_outputs.{kind}" if field == "structured_outputs" else field


def structured_outputs(req: SamplingFields) -> tuple[StructuredOutputsParams | None, str | None]:
    """The request's structured-output constraint and the field that asked for it (None, None: none);
    a 400 naming the field for a bad one, or for two fields that both ask."""
    with bad_request("response_format"):
        asked = req.constraints()
    if not asked:
        return None, None
    if len(asked) > 1:
        first, second = list(asked)[:2]
        raise APIError(400, f"{first} and {second} both ask for structured output; set one of them", second)
    field, spec = next(iter(asked.items()))
    try:
        return checked_structured_outputs(spec), field
    except (ValueError, TypeError) as exc:
        text = str(exc)
        kind = next((k for k in spec if text.startswith(f"structured_outputs.{k}")), None)
        if field != "structured_outputs" and kind is not None:
            text = _label(field, kind) + text[len(f"structured_outputs.{kind}"):]
        raise APIError(400, text, field) from None


def sampling_params(req: SamplingFields, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None,
                    renames: dict[str, str], bad_words: tuple[tuple[int, ...], ...] = (),
                    structured: StructuredOutputsParams | None = None) -> SamplingParams:
    """The request's SamplingParams (`bad_words`: its bad words as token ids, ServerState.bad_words;
    `structured`: its structured output, `structured_outputs`); a bad value is a 400 naming the
    request's field."""
    top_k = 0 if req.top_k == -1 else req.top_k  # vLLM's "off"
    seed = req.seed
    if seed is not None and -(2**63) <= seed < 0:  # OpenAI's seed is an int64: a negative one is its bit pattern
        seed += MAX_SEED
    bias = None
    if req.logit_bias is not None:
        keys = [key for key in req.logit_bias if not re.fullmatch(r"-?[0-9]+", key.strip())]
        if keys:
            raise APIError(400, f"logit_bias keys must be token ids (integer strings), got {keys[0]!r}", "logit_bias")
        bias = {int(key): value for key, value in req.logit_bias.items()}
    with bad_request("sampling", {**CONTROL_RENAMES, **renames}):
        return SamplingParams(max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=top_k,
                              seed=seed, stop_token_ids=tuple(req.stop_token_ids or ()), ignore_eos=req.ignore_eos,
                              logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                              presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                              repetition_penalty=req.repetition_penalty, logit_bias=bias, min_p=req.min_p,
                              min_tokens=req.min_tokens,
                              allowed_token_ids=None if req.allowed_token_ids is None else tuple(req.allowed_token_ids),
                              bad_words_token_ids=bad_words, structured_outputs=structured)


def choice_specs(prompts: Sequence[list[int]], req: SamplingFields, params: Sequence[SamplingParams],
                 stops: Sequence[str]) -> list[ChoiceSpec]:
    """n choices per prompt, indexed prompt-major as OpenAI numbers them; choice i of a seeded
    request samples with seed + i, so each is reproducible alone and they differ."""
    specs = []
    for p, (prompt, base) in enumerate(zip(prompts, params)):
        for i in range(req.n):
            seeded = base if base.seed is None or i == 0 else replace(base, seed=(base.seed + i) % MAX_SEED)
            specs.append(ChoiceSpec(p * req.n + i, p, prompt, seeded, tuple(stops)))
    return specs


def usage(prompts: Sequence[list[int]], completion_tokens: int) -> dict[str, int]:
    prompt_tokens = sum(len(p) for p in prompts)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
