"""uvicorn's server with pocketllm's graceful shutdown: what still runs when the graceful timeout
ends is aborted in the engine, so that each request ends in its terminal state, a stream with its
final chunk (finish_reason "abort") and [DONE], instead of being cut by uvicorn's cancellation.

    server = GracefulServer(build_app(engine), "127.0.0.1", 8000, graceful_timeout=30)
    server.run()                       # SIGINT/SIGTERM: stop accepting, wait, abort, close
"""

from __future__ import annotations

import asyncio
import math
import socket

import uvicorn
from fastapi import FastAPI

from .state import ServerState

# After the abort, how long the aborted requests get to send their last chunk (one engine step, then
# the write) before uvicorn cancels what is left: a client that stopped reading, say.
ABORT_GRACE_S = 5.0


class GracefulServer(uvicorn.Server):
    """A uvicorn server over an app of `build_app`: on shutdown it stops accepting, gives the requests
    in flight `graceful_timeout` seconds, then aborts them (see the module) and the app closes."""

    def __init__(self, app: FastAPI, host: str, port: int, graceful_timeout: float, log_level: str = "info") -> None:
        state: ServerState = app.state.pocketllm
        # uvicorn's own timeout is the last resort, for what the abort did not end.
        config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                                timeout_graceful_shutdown=math.ceil(graceful_timeout + ABORT_GRACE_S))
        super().__init__(config)
        self.graceful_timeout, self.abort = graceful_timeout, state.inflight.abort

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's shutdown, with what still runs after `graceful_timeout` seconds aborted."""
        timer = asyncio.get_running_loop().call_later(self.graceful_timeout, self.abort)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()
