"""Running the application: `serve` (the command's foreground server, the model loading in the
background while /health says 503) and `start` (a server on a free loopback port in a thread, for
tests and `moerun bench --serve`).

Shutting down (SIGTERM, Ctrl-C, `close()`): the server stops listening at once and lets the running
requests finish for `drain_s` seconds; then every request still running or waiting ends with the
error "The server is shutting down." (a stream: one error chunk, then `data: [DONE]`; a whole
response: a 503), and the server exits. A second Ctrl-C exits at once (uvicorn's own)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from moerun.serve.app import ServerState, build_app
from moerun.serve.scheduler import Scheduler

OFF_LOOP_THREADS = 2  # threads that parse, render and tokenise off the event loop


def _uvicorn():
    try:
        import uvicorn
    except ImportError:
        raise ValueError(
            "moerun serve needs its extra: pip install 'moerun[serve]' (starlette and uvicorn)."
        ) from None
    return uvicorn


@dataclass(frozen=True)
class ServeSettings:
    """How `serve` runs: where it listens, the sequences decoded together (`parallel`) and those that
    may wait for a slot (`queue_size`), the API key asked of clients (None: none), and the seconds
    running requests may take to finish once told to shut down (`drain_s`)."""

    host: str = "127.0.0.1"
    port: int = 8000
    parallel: int = 4
    queue_size: int = 64
    api_key: str | None = None
    drain_s: float = 10.0


def _server(uvicorn, app, state: ServerState, drain_s: float, **config):
    """A uvicorn server whose shutdown gives the running requests `drain_s` seconds, then ends them
    through the scheduler (uvicorn's own graceful timeout, a little later, only backs this up: it
    cancels a request's task, which cuts its connection without a word). The work the routes move off
    the event loop (`asyncio.to_thread`) runs on OFF_LOOP_THREADS threads, so a burst of requests
    leaves that many behind, not asyncio's default of up to 32."""

    class DrainingServer(uvicorn.Server):
        async def startup(self, sockets=None) -> None:
            pool = concurrent.futures.ThreadPoolExecutor(OFF_LOOP_THREADS, "moerun-off-loop")
            asyncio.get_running_loop().set_default_executor(pool)  # asyncio.run shuts it down at the end
            await super().startup(sockets)

        async def shutdown(self, sockets=None) -> None:
            def end_requests() -> None:
                if state.scheduler is not None:
                    state.scheduler.stop()

            timer = asyncio.get_running_loop().call_later(drain_s, end_requests)
            try:
                await super().shutdown(sockets)
            finally:
                timer.cancel()

    backstop = math.ceil(drain_s) + 5
    return DrainingServer(
        uvicorn.Config(app, log_level="warning", lifespan="off", timeout_graceful_shutdown=backstop, **config)
    )


def serve(
    load: Callable[[], object],
    context: Callable[[object], int],
    model_name: str,
    settings: ServeSettings,
    log: Callable[[str], None] = print,
) -> None:
    """Serve until interrupted. `load()` builds the model in a thread, so the server answers /health
    with 503 meanwhile (and says why on every request if it fails); `context(model)` gives the
    positions per sequence, or a ValueError that refuses the model: the server stops and it is
    raised here."""
    uvicorn = _uvicorn()
    state = ServerState(model_name, api_key=settings.api_key)
    refused: list[ValueError] = []

    def load_in_background() -> None:
        try:
            model = load()
        except Exception as e:  # the server stays up and says why on every request
            state.load_error = str(e)
            log(f"moerun serve: {e}")
            return
        try:
            state.context = context(model)
        except ValueError as e:  # settings the model cannot run: no server at all
            refused.append(e)
            server.should_exit = True
            return
        state.scheduler = Scheduler(model, parallel=settings.parallel, queue_size=settings.queue_size)
        state.model = model
        ep = getattr(model, "expert_parallel", None)
        where = f"; expert parallel, {ep.placement(model.config.moe.num_experts)}" if ep is not None else ""
        log(
            f"moerun serve: {model_name} ready on http://{settings.host}:{settings.port}/v1 "
            f"({settings.parallel} sequences at once{where})"
        )

    app = build_app(state)
    server = _server(uvicorn, app, state, settings.drain_s, host=settings.host, port=settings.port)
    threading.Thread(target=load_in_background, name="moerun-load", daemon=True).start()
    try:
        server.run()
    finally:
        if state.scheduler is not None:
            state.scheduler.close()
    if refused:
        raise refused[0]


class RunningServer:
    """A server in a thread of this process: `url` (…/v1), `state`, `close()`."""

    def __init__(self, server, thread: threading.Thread, state: ServerState, port: int):
        self._server, self._thread, self.state, self.port = server, thread, state, port
        self.base = f"http://127.0.0.1:{port}"
        self.url = self.base + "/v1"

    def close(self) -> None:
        """Stop as SIGTERM stops `serve`: running requests get `drain_s` seconds, then an error."""
        self._server.should_exit = True
        self._thread.join(timeout=30)
        if self.state.scheduler is not None:
            self.state.scheduler.close()


def start(
    model,
    model_name: str = "moerun",
    parallel: int = 4,
    queue_size: int = 64,
    api_key: str | None = None,
    ctx_size: int | None = None,
    drain_s: float = 10.0,
) -> RunningServer:
    """Serve `model` on a free loopback port in a daemon thread; returns once it accepts connections.
    `ctx_size`: positions per sequence (None: the model's context; more is refused); `drain_s`: the
    seconds `close()` lets running requests finish before they end with an error."""
    uvicorn = _uvicorn()
    longest = model.config.max_positions
    if ctx_size is not None and not 1 <= ctx_size <= longest:
        raise ValueError(
            f"ctx_size must be between 1 and this model's context of {longest} positions, got {ctx_size}."
        )
    state = ServerState(model_name, api_key=api_key, context=ctx_size or longest)
    state.scheduler = Scheduler(model, parallel=parallel, queue_size=queue_size)
    state.model = model
    server = _server(uvicorn, build_app(state), state, drain_s, host="127.0.0.1", port=0)
    thread = threading.Thread(target=server.run, name="moerun-http", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not (server.started and server.servers):
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("The test server did not start.")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    return RunningServer(server, thread, state, port)
