"""POST /v1/chat/completions: messages through the checkpoint's chat template (the path LLM.chat
takes), the assistant's reply, logprobs / top_logprobs, streaming."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from ..scheduler.stream import TokenDelta
from .errors import APIError, EngineFailure, bad_request, sse_error
from .protocol import ChatCompletionRequest, ChatMessage, message_dicts
from .runs import ChoiceRun, ClientDisconnected, merged, until_disconnect
from .state import ServerState, choice_specs, logprob, new_id, sampling_params, structured_outputs, usage


def _token(state: ServerState, token: int, lp: float, as_ids: bool) -> dict[str, Any]:
    """A token as chat logprobs show it; `bytes` are its own (a token inside a multibyte character
    included), so a client can join them into the text, as OpenAI's field is for."""
    return {"token": state.token_str(token, as_ids), "logprob": logprob(lp), "bytes": list(state.token_bytes(token))}


def logprobs_content(state: ServerState, deltas: Sequence[TokenDelta], as_ids: bool) -> list[dict[str, Any]]:
    """The chat `logprobs.content` entries of these tokens, each with its top alternatives."""
    return [{**_token(state, d.token_id, d.logprob, as_ids),
             "top_logprobs": [_token(state, t, lp, as_ids) for t, lp in d.top_logprobs or []]} for d in deltas]


def _max_tokens(req: ChatCompletionRequest, prompt_len: int, max_seq_len: int) -> tuple[int, str | None]:
    """What was asked for and the field that asked (max_completion_tokens first: OpenAI's name, which
    replaced max_tokens), else what the context has room for (as vLLM does) and None."""
    for name in ("max_completion_tokens", "max_tokens"):
        asked = getattr(req, name)
        if asked is not None:
            return asked, name
    return max(1, max_seq_len - prompt_len), None


def chat_prompt(state: ServerState, messages: list[ChatMessage], add_generation_prompt: bool,
                template_kwargs: dict[str, Any] | None) -> list[int]:
    """The messages through the chat template, with `chat_template_kwargs` as more of its variables;
    a 400 naming the field at fault."""
    reserved = sorted({"messages", "add_generation_prompt"} & set(template_kwargs or {}))
    if reserved:
        raise APIError(400, f"chat_template_kwargs must not set {', '.join(reserved)} (fields of the request "
                            f"itself)", "chat_template_kwargs")
    try:
        return state.engine.llm.chat_prompt(message_dicts(messages), add_generation_prompt, template_kwargs)
    except (ValueError, TypeError) as exc:  # ChatTemplateError among them
        raise APIError(400, str(exc), "messages") from None


async def create_chat_completion(state: ServerState, req: ChatCompletionRequest, request: Request) -> Response:
    """The reply to `messages`, or its server-sent events with `stream`."""
    stops = state.check_request(req)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", "top_logprobs")
    prompt = chat_prompt(state, req.messages, req.add_generation_prompt, req.chat_template_kwargs)
    top = (req.top_logprobs or 0) if req.logprobs else None
    max_tokens, tokens_field = _max_tokens(req, len(prompt), state.max_seq_len)
    structured, structured_field = structured_outputs(req)
    params = sampling_params(req, max_tokens, top, None,
                             {"logprobs": "top_logprobs", "max_tokens": tokens_field or "max_tokens"},
                             state.bad_words(req.bad_words), structured)
    state.check_prompts([prompt], params, "messages", tokens_field)
    await state.check_structured(params, structured_field)
    specs = choice_specs([prompt], req, [params], stops)
    try:
        with bad_request("messages"):
            runs = await state.inflight.start(request, specs, read_first=not req.stream)
        if req.stream:
            return StreamingResponse(_events(state, req, runs, [prompt]), media_type="text/event-stream")
        return await until_disconnect(request, _complete(state, req, runs, [prompt]))
    except ClientDisconnected:
        return Response(status_code=499)


async def _complete(state: ServerState, req: ChatCompletionRequest, runs: list[ChoiceRun],
                    prompts: list[list[int]]) -> Response:
    texts = {run.spec.index: "" for run in runs}
    async for piece in merged(runs):
        texts[piece.index] += piece.text
    choices = [{"index": run.spec.index, "message": {"role": "assistant", "content": texts[run.spec.index]},
                "logprobs": ({"content": logprobs_content(state, run.deltas, req.return_tokens_as_token_ids)}
                             if req.logprobs else None),
                "finish_reason": run.finish} for run in runs]
    body = {"id": new_id("chatcmpl"), "object": "chat.completion", "created": state.created,
            "model": state.model_name, "system_fingerprint": state.fingerprint, "choices": choices,
            "usage": usage(prompts, sum(len(r.deltas) for r in runs))}
    return Response(json.dumps(body), media_type="application/json")


async def _events(state: ServerState, req: ChatCompletionRequest, runs: list[ChoiceRun],
                  prompts: list[list[int]]) -> AsyncIterator[str]:
    """The role first, then a content delta per piece (the last with its finish reason), usage, [DONE]."""
    cid = new_id("chatcmpl")

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> str:
        body = {"id": cid, "object": "chat.completion.chunk", "created": state.created, "model": state.model_name,
                "system_fingerprint": state.fingerprint, "choices": choices, **extra}
        return f"data: {json.dumps(body)}\n\n"

    for run in runs:
        yield chunk([{"index": run.spec.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None}])
    try:
        async for piece in merged(runs):
            lp = ({"content": logprobs_content(state, piece.deltas, req.return_tokens_as_token_ids)}
                  if req.logprobs else None)
            delta = {"content": piece.text} if piece.text or piece.finish is None else {}
            yield chunk([{"index": piece.index, "delta": delta, "logprobs": lp, "finish_reason": piece.finish}])
    except EngineFailure as exc:  # the engine failed on the request: the status line has gone out
        yield sse_error(500, str(exc))
    if req.stream_options is not None and req.stream_options.include_usage:
        yield chunk([], usage=usage(prompts, sum(len(r.deltas) for r in runs)))
    yield "data: [DONE]\n\n"
