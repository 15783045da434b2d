"""POST /v1/completions: prompts as text or token ids, logprobs, echo (prompt scoring), streaming.

Echo with logprobs is how evaluation harnesses score text (lm-evaluation-harness sums
`token_logprobs`), so those numbers are the engine's own bits: the prompt's come from
SamplingParams.prompt_logprobs, the first prompt token's is null, as in vLLM. Streamed, a choice's
echoed prompt is its first chunk, with the prompt's logprobs (they come with the first token),
then its tokens: the chunks add up to the response the same request gets unstreamed.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from ..outputs import TopLogprobs
from ..scheduler.stream import TokenDelta
from .errors import APIError, EngineFailure, bad_request, sse_error
from .protocol import CompletionRequest
from .runs import ChoiceRun, ClientDisconnected, merged, until_disconnect
from .state import ServerState, choice_specs, logprob, new_id, sampling_params, structured_outputs, usage

Entry = tuple[int, float | None, TopLogprobs | None]  # token, its logprob, the position's alternatives


def _prompts(state: ServerState, prompt: str | list[Any]) -> tuple[list[list[int]], list[str | None]]:
    """The prompts as token ids, with their text where they came as text."""
    if isinstance(prompt, str):
        return [state.encode(prompt)], [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", "prompt")
    if isinstance(prompt[0], str):
        names = [f"prompt[{i}]" for i in range(len(prompt))] if len(prompt) > 1 else ["prompt"]
        return [state.encode(text, name) for text, name in zip(prompt, names)], list(prompt)
    if isinstance(prompt[0], int):
        return [list(prompt)], [None]
    return [list(p) for p in prompt], [None] * len(prompt)


class LogprobsWriter:
    """One choice's `logprobs` object, chunk by chunk: text offsets run on across chunks."""

    def __init__(self, state: ServerState, as_ids: bool) -> None:
        self.state, self.as_ids, self.offset = state, as_ids, 0

    def write(self, entries: Sequence[Entry], first_is_prompt_start: bool = False) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for i, (token, lp, top) in enumerate(entries):
            text = self.state.token_str(token, self.as_ids)
            start_of_prompt = first_is_prompt_start and i == 0
            out["tokens"].append(text)
            out["token_logprobs"].append(logprob(lp))
            out["top_logprobs"].append(None if start_of_prompt else self.state.top_dict(top, token, lp, self.as_ids))
            out["text_offset"].append(self.offset)
            self.offset += len(text)
        return out


def _prompt_entries(run: ChoiceRun) -> list[Entry]:
    """The prompt's tokens with their logprobs, as they came with its first token (or its result)."""
    assert run.prompt_scores is not None  # echo with logprobs asked for them
    logprobs, tops = run.prompt_scores
    return list(zip(run.spec.prompt, logprobs, tops or [None] * len(logprobs)))


def _delta_entries(deltas: Sequence[TokenDelta]) -> list[Entry]:
    return [(d.token_id, d.logprob, d.top_logprobs) for d in deltas]


async def create_completion(state: ServerState, req: CompletionRequest, request: Request) -> Response:
    """The completion response, or its server-sent events with `stream`."""
    stops = state.check_request(req)
    # echo with max_tokens=0 (HELM's and vLLM's scoring shape): the prompt and its logprobs, nothing
    # generated; the engine samples one token, which the response leaves out.
    prompt_only = req.echo and req.max_tokens == 0
    prompts, texts = _prompts(state, req.prompt)
    scoring = req.echo and req.logprobs is not None
    max_tokens = 1 if prompt_only else 16 if req.max_tokens is None else req.max_tokens
    structured, structured_field = structured_outputs(req)
    params = sampling_params(req, max_tokens, req.logprobs, req.logprobs if scoring else None,
                             {"prompt_logprobs": "logprobs"}, state.bad_words(req.bad_words), structured)
    state.check_prompts(prompts, params, "prompt", None if req.max_tokens is None else "max_tokens")
    await state.check_structured(params, structured_field)
    specs = choice_specs(prompts, req, [params] * len(prompts), stops)
    echoes = [text if text is not None else state.decode(p) for p, text in zip(prompts, texts)] if req.echo else None
    try:
        with bad_request("prompt"):
            runs = await state.inflight.start(request, specs, read_first=not req.stream)
        if req.stream:
            events = _events(state, req, runs, prompts, echoes, prompt_only)
            return StreamingResponse(events, media_type="text/event-stream")
        return await until_disconnect(request, _complete(state, req, runs, prompts, echoes, prompt_only))
    except ClientDisconnected:
        return Response(status_code=499)


def _body(state: ServerState, cid: str, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {"id": cid, "object": "text_completion", "created": state.created, "model": state.model_name,
            "system_fingerprint": state.fingerprint, "choices": choices, **extra}


async def _complete(state: ServerState, req: CompletionRequest, runs: list[ChoiceRun], prompts: list[list[int]],
                    echoes: list[str] | None, prompt_only: bool) -> Response:
    """The response body; with `prompt_only` (echo, max_tokens=0) without the sampled token."""
    texts = {run.spec.index: "" for run in runs}
    async for piece in merged(runs):
        texts[piece.index] += "" if prompt_only else piece.text
    choices = []
    for run in runs:
        spec = run.spec
        echo = echoes[spec.prompt_index] if echoes is not None else ""
        lp = None
        if req.logprobs is not None:
            writer = LogprobsWriter(state, req.return_tokens_as_token_ids)
            entries = (_prompt_entries(run) if req.echo else []) + ([] if prompt_only else _delta_entries(run.deltas))
            lp = writer.write(entries, first_is_prompt_start=req.echo)
        choices.append({"index": spec.index, "text": echo + texts[spec.index], "logprobs": lp,
                        "finish_reason": "length" if prompt_only else run.finish})
    generated = 0 if prompt_only else sum(len(r.deltas) for r in runs)
    body = _body(state, new_id("cmpl"), choices, usage=usage(prompts, generated))
    return Response(json.dumps(body), media_type="application/json")


async def _events(state: ServerState, req: CompletionRequest, runs: list[ChoiceRun], prompts: list[list[int]],
                  echoes: list[str] | None, prompt_only: bool) -> AsyncIterator[str]:
    """Server-sent events: a choice's echoed prompt first (with echo), one chunk per piece, the usage
    chunk if asked for, then [DONE]. The chunks of a choice add up to its unstreamed text and logprobs."""
    cid = new_id("cmpl")
    writers = {run.spec.index: LogprobsWriter(state, req.return_tokens_as_token_ids) for run in runs}

    def chunk(index: int, text: str, lp: Any, finish: str | None) -> str:
        choice = {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}
        return f"data: {json.dumps(_body(state, cid, [choice]))}\n\n"

    def echo(run: ChoiceRun) -> str:
        """The choice's echoed prompt, with its logprobs when asked for (the first token's null)."""
        index = run.spec.index
        lp = None if req.logprobs is None else writers[index].write(_prompt_entries(run), first_is_prompt_start=True)
        return chunk(index, echoes[run.spec.prompt_index] if echoes is not None else "", lp,
                     "length" if prompt_only else None)

    # The prompt's logprobs come with its first token: an echo that shows them waits for it.
    waiting = {run.spec.index: run for run in runs} if echoes is not None else {}
    if echoes is not None and req.logprobs is None and not prompt_only:
        for run in runs:
            yield echo(waiting.pop(run.spec.index))
    try:
        async for piece in merged(runs):
            if piece.index in waiting:
                yield echo(waiting.pop(piece.index))
            if prompt_only:
                continue
            lp = None if req.logprobs is None else writers[piece.index].write(_delta_entries(piece.deltas))
            yield chunk(piece.index, piece.text, lp, piece.finish)
    except EngineFailure as exc:  # the engine failed on a request: the status line has gone out
        yield sse_error(500, str(exc))
    if req.stream_options is not None and req.stream_options.include_usage:
        generated = 0 if prompt_only else sum(len(r.deltas) for r in runs)
        yield f"data: {json.dumps(_body(state, cid, [], usage=usage(prompts, generated)))}\n\n"
    yield "data: [DONE]\n\n"
