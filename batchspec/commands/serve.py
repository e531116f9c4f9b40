"""`batchspec serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over the continuous engine."""

from __future__ import annotations

import argparse
import socket
from pathlib import Path

from ..config import BatchspecError, SpecConfig
from ..serve.app import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_N
from .common import (
    add_decoding_arguments,
    add_model_arguments,
    config_from_args,
    finite_float,
    load_models,
    model_config,
    positive_int,
)

LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    g.add_argument("--port", type=int, default=8000, help="TCP port")
    g.add_argument("--served-model-name", help="the model name clients send (default: the target's folder or file "
                   "name, or 'bundled')")
    g.add_argument("--api-key", help="require `Authorization: Bearer API_KEY` on /v1 routes (default: open; an "
                   "empty key is refused)")
    g.add_argument("--max-body-bytes", type=positive_int, default=DEFAULT_MAX_BODY_BYTES,
                   help="larger request bodies are answered 413 without being read")
    g.add_argument("--body-timeout", type=finite_float, default=30.0,
                   help="seconds a client has to send a request's body; slower ones get 408 and are disconnected")
    g.add_argument("--timeout-keep-alive", type=positive_int, default=5,
                   help="seconds an idle keep-alive connection stays open (uvicorn's)")
    g.add_argument("--docs", action="store_true", help="serve FastAPI's /docs, /redoc and /openapi.json (behind "
                   "--api-key when one is given)")
    g.add_argument("--max-model-len", type=positive_int, help="tokens per request, prompt + output; the K/V buffer "
                   "holds this many (plus a round of drafts) for every row (default: min(model context, 2048))")
    g.add_argument("--max-waiting", type=positive_int, default=256,
                   help="requests that may wait for a row; more are answered 429")
    g.add_argument("--max-n", type=positive_int, default=DEFAULT_MAX_N,
                   help="choices (`n`) one request may ask for; more are answered 400. Each choice is its own "
                   "request in the engine, with its own prefill")
    g.add_argument("--log-level", choices=LOG_LEVELS, default="info", help="uvicorn's log level")
    add_model_arguments(p)
    add_decoding_arguments(p, prefix_cache_gb=None)  # None: on where the method and model allow it


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from ..serve import ServeOptions, create_app

    spec = config_from_args(SpecConfig, args)
    config = model_config(args)
    options = ServeOptions(args.served_model_name or _model_name(config.target), args.max_model_len, args.max_waiting,
                           args.api_key, args.max_body_bytes, args.body_timeout, args.docs,
                           args.max_n)  # checked: no model yet
    listener = _listen(args.host, args.port)  # before the (slow) model loading: a taken port fails at once
    with listener:
        models = load_models(args, need_draft=spec.speculative)
        app = create_app(models, config, spec, options)
        server = uvicorn.Server(uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=5,
                                               timeout_keep_alive=args.timeout_keep_alive))
        server.run(sockets=[listener])
    return 0


def _model_name(target: str | None) -> str:
    """A folder's name, a .gguf file's stem, or "bundled" for the bundled pair."""
    if target is None:
        return "bundled"
    path = Path(target)
    return path.stem if path.suffix.lower() == ".gguf" else path.name


def _listen(host: str, port: int) -> socket.socket:
    """Bind the listening socket before the models load, so a taken port costs nothing."""
    if not 0 <= port <= 65535:
        raise BatchspecError(f"--port must be in 0..65535, got {port}")
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as err:
        raise BatchspecError(f"cannot listen on {host}:{port}: {err.strerror}") from None
    family, kind, proto, _, address = infos[0]
    listener = socket.socket(family, kind, proto)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind(address)
    except OSError as err:
        listener.close()
        raise BatchspecError(f"cannot listen on {host}:{port}: {err.strerror}") from None
    return listener
