"""`pocketllm serve --model DIR`: the OpenAI-compatible server on uvicorn.

SIGINT/SIGTERM shut it down gracefully: uvicorn stops accepting, in-flight requests get
`--graceful-timeout` seconds to finish, then are aborted (a stream ends with its final chunk and
[DONE]; see server.py); the app's shutdown closes the engine last, so every request ends in its
terminal state and every slot is freed.
"""

from __future__ import annotations

import argparse
import errno
import json
import logging
import math
import os
import socket
import sys
from typing import Any

from ..config import DTYPES, EngineArgs

API_KEY_VARIABLE = "POCKETLLM_API_KEY"


def _option(text: str) -> tuple[str, Any]:
    """KEY=VALUE with VALUE parsed as JSON where it is JSON (true, 8, null), else kept as a string."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--option must be KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def _port(text: str) -> int:
    """A TCP port a server can listen on."""
    try:
        port = int(text)
    except ValueError:
        port = 0
    if not 1 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be an int in 1..65535, got {text!r}")
    return port


def _seconds(text: str) -> float:
    """A finite number of seconds >= 0."""
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not 0 <= seconds < math.inf:
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text!r}")
    return seconds


def _json_object(text: str) -> dict[str, Any]:
    """A JSON object, as vLLM's --speculative-config takes it."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f'must be a JSON object such as \'{{"method": "ngram", '
                                         f'"num_speculative_tokens": 4}}\', got {text!r}')
    return value


def _origins(text: str) -> list[str]:
    """A JSON list of origins."""
    try:
        origins = json.loads(text)
    except json.JSONDecodeError:
        origins = None
    if not isinstance(origins, list) or not all(isinstance(o, str) and o for o in origins):
        raise argparse.ArgumentTypeError(f'must be a JSON list of origins such as \'["*"]\', got {text!r}')
    return origins


def check_address(host: str, port: int) -> None:
    """Before the model loads, what would keep the server from listening on host:port (a host that
    does not resolve or is not this machine's, a port in use): OSError naming --host / --port. The
    probe binds as asyncio's server does (SO_REUSEADDR, IPv6 only on IPv6, an address of a family
    the machine lacks skipped), so a port only in TIME_WAIT passes."""
    try:
        addresses = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise OSError(f"--host {host!r} does not resolve ({exc.strerror})") from None
    bound = False
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                probe.bind(address)
                bound = True
            except OSError as exc:
                if exc.errno != errno.EADDRNOTAVAIL:
                    raise OSError(f"cannot listen on --host {host} --port {port}: {exc.strerror}") from None
    if not bound:
        raise OSError(f"cannot listen on --host {host}: it is not an address of this machine")


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The engine options `serve` and the serving benchmark take."""
    parser.add_argument("--backend", choices=["torch", "triton"], default="torch")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--max-seq-len", type=int, default=4096)
    parser.add_argument("--max-batch-size", type=int, default=8, help="cache slots: requests running at once")
    parser.add_argument("--max-waiting", type=int, default=0,
                        help="waiting requests beyond which a request is answered 429 (0: no bound)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="shard the model over this many processes")
    parser.add_argument("--pipeline-parallel-size", type=int, default=1,
                          help="give each of this many processes a block of consecutive layers")
    parser.add_argument("--enable-expert-parallel", action="store_true",
                        help="mixture-of-experts models: each process holds whole experts (the same bits either way)")
    parser.add_argument("--speculative-config", type=_json_object, default=None, metavar="JSON",
                        help='speculative decoding, vLLM\'s keys: \'{"method": "ngram", "num_speculative_tokens": 4}\' '
                             "(the output stays bitwise the output without it)")
    parser.add_argument("--option", type=_option, action="append", default=[], metavar="KEY=VALUE",
                        help="any other backend_options entry, e.g. --option prefill_chunk_size=256")


def engine_args(args: argparse.Namespace) -> EngineArgs:
    options = {"max_batch_size": args.max_batch_size, "max_waiting": args.max_waiting, **dict(args.option)}
    return EngineArgs(model=args.model, backend=args.backend, dtype=args.dtype, device=args.device,
                      max_seq_len=args.max_seq_len, backend_options=options,
                      tensor_parallel_size=args.tensor_parallel_size,
                      pipeline_parallel_size=args.pipeline_parallel_size,
                      enable_expert_parallel=args.enable_expert_parallel, speculative=args.speculative_config)


def _set_threads(threads: int | None) -> None:
    """The engine's torch threads; by default one core is left to the event loop, whose per-token
    work otherwise waits behind OpenMP threads spinning between the engine's parallel regions."""
    import torch

    if threads is None:
        threads = max(1, (os.cpu_count() or 1) - 1)
    if threads < 1:
        raise ValueError(f"--threads must be an int >= 1, got {threads}")
    torch.set_num_threads(threads)


def add_parser(sub: Any) -> None:
    serve = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (pip install -e '.[serve]')")
    serve.add_argument("--model", required=True, help="Hugging Face model directory (config.json + safetensors)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=_port, default=8000, help="1..65535")
    serve.add_argument("--served-model-name", default=None, help="the name clients pass as `model` (default: --model)")
    serve.add_argument("--threads", type=int, default=None,
                       help="torch CPU threads for the engine (default: all cores but one, which the event loop "
                            "keeps: with every core in OpenMP, HTTP streaming ran 6-8x slower on 2 cores)")
    serve.add_argument("--graceful-timeout", type=_seconds, default=30.0,
                       help="seconds in-flight requests get to finish on SIGINT/SIGTERM before they are aborted "
                            "(finish_reason \"abort\")")
    serve.add_argument("--api-key", default=os.environ.get(API_KEY_VARIABLE),
                       help=f"clients must send 'Authorization: Bearer KEY' on the /v1 routes (default "
                            f"${API_KEY_VARIABLE}; none: open)")
    serve.add_argument("--allowed-origins", type=_origins, default=[], metavar="JSON",
                       help='origins browsers may call from, a JSON list as vLLM takes it: \'["*"]\' or '
                            '\'["http://localhost:3000"]\' (default: none)')
    add_engine_arguments(serve)
    serve.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        from .app import build_app
        from .server import GracefulServer
    except ImportError as exc:
        raise ImportError(f"pocketllm serve needs the serve extra: pip install -e '.[serve]' ({exc})") from exc
    from ..async_llm import AsyncLLM

    logging.basicConfig(level=logging.INFO, format="%(levelname)s:     %(message)s")  # uvicorn's look
    config = engine_args(args)  # checked, with the address, before the model loads, which can take minutes
    check_address(args.host, args.port)
    _set_threads(args.threads)
    engine = AsyncLLM(config)
    try:
        app = build_app(engine, args.served_model_name, owns_engine=True,  # closed at the app's shutdown
                        api_key=args.api_key or None, allowed_origins=args.allowed_origins)
        server = GracefulServer(app, args.host, args.port, args.graceful_timeout)
        print(f"pocketllm serve: {args.model} on http://{args.host}:{args.port}/v1 (system_fingerprint "
              f"{app.state.pocketllm.fingerprint})", file=sys.stderr, flush=True)
        # After the graceful shutdown uvicorn re-raises the signal: SIGINT ends the command with
        # status 130 (KeyboardInterrupt), SIGTERM with the signal's default.
        server.run()
    finally:
        engine.close()  # at once if the app's shutdown closed it
    return 0
