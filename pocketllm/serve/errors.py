"""OpenAI-style error bodies, and the mapping from what pocketllm raises to HTTP statuses.

Bad input is the client's mistake, so it is a 400 whose message names the field, whatever layer
noticed it (pydantic, SamplingParams, the prompt check); the server keeps serving.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import fields
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from ..chat import ChatTemplateError
from ..sampling import SamplingParams
from ..scheduler.batch_scheduler import QueueFullError
from .protocol import UnsupportedParameter

logger = logging.getLogger(__name__)
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               405: "invalid_request_error",
               429: "rate_limit_error", 500: "internal_error", 503: "service_unavailable"}
UNION_TAG = re.compile(r"(str|int|float|bool|none|list\[.*|dict\[.*|function-.*)$")
SAMPLING_FIELDS = frozenset(f.name for f in fields(SamplingParams))


class APIError(Exception):
    """An error answered as {"error": {"message", "type", "param", "code"}} with `status`."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


class EngineFailure(RuntimeError):
    """The engine failed on a request (its result says "error"): a 500, or an error event in a
    stream whose status line has gone out; the engine logged why."""


def error_body(status: int, message: str, param: str | None = None) -> dict[str, dict[str, object]]:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "error"), "param": param, "code": status}}


def error_response(status: int, message: str, param: str | None = None,
                   headers: Mapping[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


def sse_error(status: int, message: str, param: str | None = None) -> str:
    """An error as one server-sent event, for a stream whose status line has gone out."""
    return f"data: {json.dumps(error_body(status, message, param))}\n\n"


@contextlib.contextmanager
def bad_request(param: str, renames: dict[str, str] | None = None, where: str | None = None) -> Iterator[None]:
    """ValueError/TypeError inside -> a 400 naming the SamplingParams field its message starts
    with, as the request calls it (`renames`, the message too), else `param`, the message then
    prefixed with `where` (which of several prompts) or `param`."""
    try:
        yield
    except (ValueError, TypeError) as exc:
        text, renames = str(exc), renames or {}
        match = re.match(r"[A-Za-z_]+", text)
        first = match.group(0) if match else ""
        if first in renames:
            named, text = renames[first], renames[first] + text[len(first):]
        else:
            named = first if first in SAMPLING_FIELDS else param
        label = where if named == param and where is not None else named
        message = text if re.match(rf"{re.escape(label)}(?![\w\[])", text) else f"{label}: {text}"
        raise APIError(400, message, named) from exc


def _field_path(loc: tuple[object, ...]) -> tuple[list[str], bool]:
    """A pydantic error location as the field's path (without the "body" prefix), and whether it
    ended at a union member: pydantic names the member it tried, and the field ends before it."""
    path: list[str] = []
    for part in loc[1:]:
        if UNION_TAG.match(str(part)):
            return path, True
        path.append(str(part))
    return path, False


def _union_members(errors: Sequence[Any], path: list[str]) -> list[str]:
    """The union members pydantic tried for the field at `path`: the types it accepts."""
    members: list[str] = []
    for error in errors:
        loc = [str(part) for part in error.get("loc", ())[1:]]
        if loc[:len(path)] == path and len(loc) > len(path) and loc[len(path)] not in members:
            members.append(loc[len(path)])
    return members


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """The first pydantic error as (message, field path); for a union field, the types it takes."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    loc, union = _field_path(tuple(first.get("loc", ())))
    if first.get("type") == "json_invalid":
        return f"the body is not valid JSON: {first.get('msg')}", None
    if first.get("type") == "extra_forbidden" and loc:
        return f"{loc[-1]} is not a parameter pocketllm knows (unknown parameters are refused)", ".".join(loc)
    if not loc:
        return f"the body must be a JSON object, sent as Content-Type: application/json ({first.get('msg')})", None
    field = ".".join(loc)
    if union:
        return f"{field} must be one of {', '.join(_union_members(errors, loc))}", field
    return f"{field}: {first.get('msg')}", field


def install_handlers(app: FastAPI) -> None:
    """Every error the endpoints raise becomes an OpenAI-style body; bad input is never a 500."""

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, field = _validation_message(exc)
        return error_response(400, message, field)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:  # no such path, or method
        return error_response(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                              headers=exc.headers)

    @app.exception_handler(APIError)
    async def _api(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, exc.param)

    @app.exception_handler(UnsupportedParameter)
    async def _unsupported(_: Request, exc: UnsupportedParameter) -> JSONResponse:
        return error_response(400, str(exc), exc.param)

    @app.exception_handler(ChatTemplateError)
    async def _template(_: Request, exc: ChatTemplateError) -> JSONResponse:
        return error_response(400, str(exc), "messages")

    @app.exception_handler(QueueFullError)
    async def _full(_: Request, exc: QueueFullError) -> JSONResponse:
        return error_response(429, f"the server is at capacity: {exc}")

    @app.exception_handler(EngineFailure)  # a 500 answered here keeps the connection (Exception's would not)
    async def _engine(_: Request, exc: EngineFailure) -> JSONResponse:
        return error_response(500, str(exc))

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error")
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}")
