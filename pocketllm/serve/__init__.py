"""pocketllm serve: an OpenAI-compatible HTTP server over one AsyncLLM (the `[serve]` extra).

`build_app(engine)` is the FastAPI app; `pocketllm serve --model DIR` runs it on uvicorn.
fastapi is imported when the app is, so the command line works without the extra.
"""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "build_app":
        from .app import build_app

        return build_app
    raise AttributeError(name)
