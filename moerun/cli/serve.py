"""`moerun serve`: the OpenAI API over HTTP (moerun.serve), on loopback unless told otherwise."""

from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path

from moerun.cli.common import (
    add_ctx_size_argument,
    add_model_arguments,
    check_model_arguments,
    context_size,
    load_with_progress,
    serve_experts_for_rank_0,
)


def add_parser(commands) -> None:
    serve = commands.add_parser("serve", help="serve the OpenAI API (chat/completions, completions, models)")
    add_model_arguments(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    serve.add_argument("--port", type=int, default=8000, help="TCP port")
    serve.add_argument(
        "-np", "--parallel", type=int, default=4, help="sequences decoded together (continuous batching)"
    )
    serve.add_argument(
        "--queue-size", type=int, default=64, help="requests that may wait for a slot; more get 503"
    )
    serve.add_argument(
        "--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 and /tokenize"
    )
    add_ctx_size_argument(serve, 4096)
    serve.add_argument(
        "--alias", default=None, help="the model's name in the API (default: the path's last part)"
    )
    serve.add_argument(
        "--drain-timeout",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="on SIGTERM or Ctrl-C, how long running requests may take to finish before they end "
        "with an error",
    )
    serve.set_defaults(run=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    for flag, value, low in (
        ("--parallel", args.parallel, 1),
        ("--queue-size", args.queue_size, 0),
    ):
        if value < low:
            raise ValueError(f"{flag} must be >= {low}, got {value}.")
    if not 0 <= args.drain_timeout < float("inf"):
        raise ValueError(f"--drain-timeout must be a number of seconds >= 0, got {args.drain_timeout}.")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}.")
    check_model_arguments(args)
    if (status := serve_experts_for_rank_0(args)) is not None:  # rank 0 alone listens
        return status
    from moerun.serve.server import ServeSettings, _uvicorn, serve

    _uvicorn()  # the extra is there before anything loads
    name = args.alias or Path(args.model.rstrip("/")).name

    def load():
        return load_with_progress(args, io.StringIO() if not sys.stderr.isatty() else sys.stderr)

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    log(
        f"moerun serve: loading {args.model}; http://{args.host}:{args.port} answers /health with 503 "
        "until it is ready"
    )
    settings = ServeSettings(
        host=args.host,
        port=args.port,
        parallel=args.parallel,
        queue_size=args.queue_size,
        api_key=args.api_key,
        drain_s=args.drain_timeout,
    )
    serve(load, lambda model: context_size(args, model), name, settings, log)
    return 0
