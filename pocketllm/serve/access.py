"""Who may call the server: an API key on the OpenAI routes, and the origins a browser may call
from (CORS), as vLLM's `--api-key` and `--allowed-origins` set them."""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable, Sequence

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from starlette.responses import Response

from .errors import error_response

# The routes the key guards: OpenAI's, as vLLM guards them (health, metrics and tokenization stay open).
GUARDED_PREFIX = "/v1"


def require_api_key(app: FastAPI, key: str) -> None:
    """Every /v1 request must carry `Authorization: Bearer <key>`; otherwise a 401 in OpenAI's shape.
    CORS preflights (OPTIONS) pass: a browser sends them without credentials."""
    expected = f"Bearer {key}".encode()

    @app.middleware("http")
    async def check_key(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        if request.url.path.startswith(GUARDED_PREFIX) and request.method != "OPTIONS":
            sent = request.headers.get("authorization", "").encode()
            if not secrets.compare_digest(sent, expected):
                return error_response(401, "Unauthorized: send the server's API key as 'Authorization: Bearer "
                                           "<key>'", None, headers={"WWW-Authenticate": "Bearer"})
        return await call_next(request)


def allow_origins(app: FastAPI, origins: Sequence[str]) -> None:
    """Browsers may call the server from `origins` (["*"]: any), every method and header."""
    app.add_middleware(CORSMiddleware, allow_origins=list(origins), allow_credentials=True, allow_methods=["*"],
                       allow_headers=["*"])
