"""The FastAPI app over one AsyncLLM: OpenAI's endpoints and vLLM's extra ones.

    engine = AsyncLLM(EngineArgs(model=path))
    app = build_app(engine)            # serve with uvicorn; the caller closes the engine after
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, Response
from fastapi.staticfiles import StaticFiles

from ..async_llm import AsyncLLM
from ..version import __version__
from .access import allow_origins, require_api_key
from .chat import chat_prompt, create_chat_completion
from .completions import create_completion
from .errors import APIError, install_handlers
from .metrics import metrics_registry, metrics_response
from .protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from .state import ServerState

logger = logging.getLogger(__name__)
# The web page at `/`: static files, no build step; they hold no data, so no key guards them.
STATIC_DIR = Path(__file__).parent / "static"


def build_app(engine: AsyncLLM, model_name: str | None = None, owns_engine: bool = False, api_key: str | None = None,
              allowed_origins: Sequence[str] = ()) -> FastAPI:
    """The app serving `engine` as `model_name` (default: the model directory as given, as vLLM
    names it). `owns_engine`: the app's shutdown closes the engine (unfinished requests end
    "cancelled", slots freed) before the server process ends; otherwise the caller closes it.
    `api_key`: required on the /v1 routes; `allowed_origins`: where browsers may call from (access.py)."""
    state = ServerState(engine, model_name or engine.llm.args.model)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        if owns_engine:
            await asyncio.to_thread(engine.close)
            logger.info("pocketllm: engine stopped, %d slots free", engine.llm.slots.num_free)

    app = FastAPI(title="pocketllm", version=__version__, lifespan=lifespan)
    app.state.pocketllm = state
    install_handlers(app)
    if api_key is not None:
        require_api_key(app, api_key)
    if allowed_origins:
        allow_origins(app, allowed_origins)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "pocketllm",
                "root": engine.llm.args.model, "parent": None, "max_model_len": state.max_seq_len}
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Response:
        return await create_completion(state, req, request)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, request: Request) -> Response:
        return await create_chat_completion(state, req, request)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> dict[str, Any]:
        return _tokenize(state, req)

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> dict[str, Any]:
        return _detokenize(state, req)

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict[str, Any]:
        return state.tokenizer_info()

    registry = metrics_registry(state)

    @app.get("/metrics")
    async def metrics(format: str = "prometheus") -> Response:
        return metrics_response(state, registry, format)

    return _with_web_page(app)


def _with_web_page(app: FastAPI) -> FastAPI:
    """`app` with the web page at `/` and its files under /static (static/: no build step)."""
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")

    @app.get("/", include_in_schema=False)
    async def web_page() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html")

    return app


def _detokenize(state: ServerState, req: DetokenizeRequest) -> dict[str, Any]:
    state.check_model(req.model)
    vocab = state.engine.llm.model_config.vocab_size
    bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(400, f"tokens: {bad} is outside the vocabulary [0, {vocab})", "tokens")
    return {"prompt": state.decode(req.tokens)}


def _tokenize(state: ServerState, req: TokenizeRequest) -> dict[str, Any]:
    """vLLM's /tokenize: a prompt, or messages through the chat template; one of them."""
    state.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "pass one of prompt or messages", "prompt")
    llm = state.engine.llm
    if req.messages is not None:
        tokens = chat_prompt(state, req.messages, req.add_generation_prompt, req.chat_template_kwargs)
    elif llm.tokenizer is None:
        raise APIError(400, "this model has no tokenizer.json: text cannot be tokenized", "prompt")
    else:
        tokens = llm.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens).ids
    return {"count": len(tokens), "max_model_len": state.max_seq_len, "tokens": tokens, "token_strs": None}
