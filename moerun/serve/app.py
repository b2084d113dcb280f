"""The HTTP side of `moerun serve`: a Starlette application speaking OpenAI's API over the
scheduler (moerun.serve.scheduler). Each completion request is checked (moerun.serve.protocol),
submitted, and answered whole or streamed as server-sent events (`data: {chunk}` lines, then
`data: [DONE]`); a client that goes away mid-request has its job cancelled, which frees its slot
before the next step. Errors come in OpenAI's JSON shape with their status; nothing a client sends
takes the server down.

Bodies are JSON sent as such: a POST without `Content-Type: application/json` (or another `+json`
type) gets a 415, as FastAPI's strict default does, so a web page cannot make a browser post to a
server on loopback without the CORS preflight this server never answers. Text is tokenised off the
event loop (a long prompt delays no other request), after a bound on its characters: a prompt longer
than the context times the longest token of the vocabulary cannot fit and is refused untokenised."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from moerun.serve import prompts, protocol
from moerun.serve.choices import ChatChoice, text_choice, text_chunk
from moerun.serve.metrics import metrics_text
from moerun.serve.protocol import APIError, Body, bad
from moerun.serve.scheduler import SHUTTING_DOWN, Job, QueueFull, Scheduler
from moerun.text.reply import ReplyFormat

MAX_BODY = 4 << 20  # bytes of a request body
POLL_S = 0.25  # how often a whole-response request checks that its client is still there


@dataclass
class ServerState:
    """What the routes share: the model, its positions per sequence and its scheduler once loaded
    (None while loading)."""

    model_name: str
    api_key: str | None = None
    context: int | None = None
    model: object | None = None
    scheduler: Scheduler | None = None
    load_error: str | None = None
    started: float = field(default_factory=time.time)
    chars_per_token: int | None = None  # the most characters one token covers (0: no bound known)


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


def build_app(state: ServerState) -> Starlette:
    """The Starlette application: each route a method of `Routes`, every error one JSON body."""
    api = Routes(state)
    routes = [
        Route("/v1/chat/completions", guarded(api.chat_completions), methods=["POST"]),
        Route("/v1/completions", guarded(api.text_completions), methods=["POST"]),
        Route("/v1/models", guarded(api.models), methods=["GET"]),
        Route("/health", guarded(api.health), methods=["GET"]),
        Route("/metrics", guarded(api.metrics), methods=["GET"]),
        Route("/tokenize", guarded(api.tokenize), methods=["POST"]),
        Route("/detokenize", guarded(api.detokenize), methods=["POST"]),
    ]
    return Starlette(routes=routes, exception_handlers={HTTPException: not_found})


def guarded(handler):
    """`handler` with its APIError as OpenAI's JSON, and a bug of ours as one 500 (the server stays up)."""

    async def endpoint(request: HTTPRequest) -> Response:
        try:
            return await handler(request)
        except APIError as e:
            return error_response(e)
        except Exception as e:  # a bug of ours: one JSON error, the server stays up
            return error_response(APIError(500, f"Internal error: {type(e).__name__}: {str(e)[:200]}"))

    return endpoint


async def not_found(request: HTTPRequest, exc: HTTPException) -> Response:
    if exc.status_code == 405:
        return error_response(APIError(405, f"{request.method} is not allowed on {request.url.path}."))
    return error_response(APIError(404, f"No route {request.method} {request.url.path}.", None, "not_found"))


async def read_body(request: HTTPRequest) -> Body:
    """The request's JSON body, refused when not sent as JSON (415), past MAX_BODY bytes (413), or
    when it is not JSON or holds a lone UTF-16 surrogate, which is not text (400)."""
    kind = request.headers.get("content-type", "")
    media = kind.split(";")[0].strip().lower()
    if media != "application/json" and not (media.startswith("application/") and media.endswith("+json")):
        got = f"'{kind[:60]}'" if kind else "none"
        raise APIError(415, f"Send the body as JSON, with 'Content-Type: application/json' (got {got}).")
    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > MAX_BODY:
        raise APIError(413, f"The request body is larger than {MAX_BODY} bytes.")
    chunks, total = [], 0
    async for chunk in request.stream():
        total += len(chunk)
        if total > MAX_BODY:
            raise APIError(413, f"The request body is larger than {MAX_BODY} bytes.")
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:  # a long body in a thread: parsing megabytes would hold up the other requests
        data = json.loads(raw) if len(raw) < 1 << 16 else await asyncio.to_thread(json.loads, raw)
    except (ValueError, RecursionError) as e:  # bad JSON or UTF-8, too deep, too many digits
        raise bad(f"The request body is not valid JSON: {str(e)[:120]}") from None
    body = Body(data)
    if _SURROGATE_ESCAPE.search(raw) and (path := _lone_surrogate(data)) is not None:
        name = path[0] + "".join(f"[{key}]" if isinstance(key, int) else f".{key}" for key in path[1:])
        raise bad(f"'{name}' holds a lone UTF-16 surrogate, which is not text: send valid Unicode.", path[0])
    return body


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # how JSON writes one (a pair is two)
_SURROGATE = re.compile("[\\ud800-\\udfff]")


def _lone_surrogate(data) -> tuple | None:
    """The path (top-level field first) to a string or key of `data` that holds a lone surrogate
    (json.loads joins a valid pair into one character), or None."""
    stack = [(data, ())]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            if _SURROGATE.search(value):
                return path
        elif isinstance(value, dict | list):
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in items:
                if isinstance(key, str) and _SURROGATE.search(key):
                    return (*path, key.encode("utf-8", "backslashreplace").decode())
                if isinstance(item, str | dict | list):
                    stack.append((item, (*path, key)))
    return None


class Routes:
    """The routes over one ServerState, a method each, and the checks they share: the API key, a
    loaded model, the model's name."""

    def __init__(self, state: ServerState):
        self.state = state
        self._format: tuple[object, ReplyFormat] | None = None  # (model, its reply format)

    # --- the checks ---

    def check_key(self, request: HTTPRequest) -> None:
        if self.state.api_key is None:
            return
        if request.headers.get("authorization", "") != f"Bearer {self.state.api_key}":
            raise APIError(
                401,
                "Missing or incorrect API key (send 'Authorization: Bearer KEY').",
                None,
                "invalid_api_key",
            )

    def ready(self) -> tuple[object, Scheduler]:
        state = self.state
        if state.model is None or state.scheduler is None:
            message = (
                f"The model failed to load: {state.load_error}"
                if state.load_error
                else "The model is loading."
            )
            raise APIError(503, message, None, "model_not_ready")
        return state.model, state.scheduler

    def reply_format(self, model) -> ReplyFormat:
        """How `model` writes a chat reply (its reasoning, its tool calls), found once; a chat needs
        a tokenizer."""
        if model.tokenizer is None:
            raise bad("This model has no tokenizer, so it cannot chat.", "messages")
        if self._format is None or self._format[0] is not model:
            self._format = (model, ReplyFormat.of(model.tokenizer, model.config.model_type))
        return self._format[1]

    def chars_per_token(self, model) -> int:
        """The most characters one token of `model`'s vocabulary covers, found once; 0 if no bound
        holds (a vocabulary that joins a run of unknown characters into one token)."""
        if self.state.chars_per_token is None:
            self.state.chars_per_token = prompts.chars_per_token(model.tokenizer)
        return self.state.chars_per_token

    def check_model_name(self, body: Body) -> None:
        name, served = body.text("model"), self.state.model_name
        if name is not None and name != served:
            raise APIError(
                404,
                f"The model '{name}' does not exist; this server serves '{served}'.",
                "model",
                "model_not_found",
            )

    # --- completions ---

    async def chat_completions(self, request: HTTPRequest) -> Response:
        return await self.completions(request, chat=True)

    async def text_completions(self, request: HTTPRequest) -> Response:
        return await self.completions(request, chat=False)

    async def completions(self, request: HTTPRequest, chat: bool) -> Response:
        """A completion submitted to the scheduler, answered whole or streamed."""
        self.check_key(request)
        body = await read_body(request)
        model, scheduler = self.ready()
        self.check_model_name(body)
        context = self.state.context
        kwargs, options = protocol.generation_options(body, chat, context)

        def make():  # rendering and tokenising: in a thread, so other requests go on meanwhile
            most = context * self.chars_per_token(model) or None
            if chat:
                prompt, parser, forced = prompts.chat_prompt(model, body, self.reply_format(model), most)
            else:
                prompt, parser, forced = prompts.text_prompt(model, body, most), None, None
            if forced is not None:  # tool_choice asks for a call: the grammar of one
                if kwargs.get("response_format", {"type": "text"}) != {"type": "text"}:
                    message = "'response_format' and a tool_choice that asks for a call both shape the reply."
                    raise bad(message + " Give one.", "response_format")
                return protocol.make_request(
                    model, prompt, {**kwargs, "response_format": forced}, context
                ), parser
            return protocol.make_request(model, prompt, kwargs, context), parser

        job_request, parser = await asyncio.to_thread(make)
        n = job_request.n
        if n > scheduler.parallel:
            message = f"'n' must be at most {scheduler.parallel}, the sequences this server runs at once."
            raise bad(message, "n")
        # a chat's choices, each read by a parser of its own
        replies = [ChatChoice(parser(), model.tokenizer, options, i) for i in range(n)] if chat else None
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def sink(event) -> None:
            loop.call_soon_threadsafe(events.put_nowait, event)

        try:
            job = scheduler.submit(job_request, sink)
        except QueueFull as e:
            if str(e) == SHUTTING_DOWN:
                raise APIError(503, SHUTTING_DOWN, None, "shutting_down") from None
            raise APIError(503, f"The server is busy: {e} Retry later.", None, "queue_full") from None
        response_id = protocol.new_id("chatcmpl" if chat else "cmpl")
        if options.stream:
            return StreamingResponse(
                self._stream(model.tokenizer, scheduler, job, events, replies, options, response_id),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            )
        tokens, stats = await _collect(request, scheduler, job, events)
        if replies is not None:
            choices = [reply.whole(tokens[i], stats[i]) for i, reply in enumerate(replies)]
        else:
            choices = [text_choice(model.tokenizer, tokens[i], s, options, i) for i, s in enumerate(stats)]
        kind = "chat.completion" if chat else "text_completion"
        return JSONResponse(
            protocol.envelope(kind, response_id, self.state.model_name, choices, usage=protocol.usage(stats))
        )

    async def _stream(
        self, tokenizer, scheduler, job, events, replies: list[ChatChoice] | None, options, response_id
    ) -> AsyncIterator[str]:
        """The job's events as server-sent events: a chunk per batch of a choice's tokens (its
        `index`; a chat's tool calls in chunks of their own), each choice's finish reason (and usage
        when asked), then [DONE]; the job is cancelled if the client goes away first. `replies`: a
        chat's choices, None for a completion."""
        chat = replies is not None
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choice: dict, **extra) -> str:
            choices = [choice] if choice else []
            data = protocol.envelope(kind, response_id, self.state.model_name, choices, **extra)
            return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"

        offsets = [0] * job.request.n  # characters streamed, per choice
        try:
            for reply in replies or ():
                yield chunk(reply.first_chunk())
            while True:
                event, payload = await events.get()
                if event == "tokens":
                    i, tokens = payload
                    if chat:
                        for choice in replies[i].chunks(tokens):
                            yield chunk(choice)
                    else:
                        yield chunk(text_chunk(tokenizer, tokens, options, offsets[i], i))
                        offsets[i] += sum(len(t.text) for t in tokens)
                elif event == "done":
                    for i, stats in enumerate(payload):
                        if chat:
                            for choice in replies[i].last_chunks(stats):
                                yield chunk(choice)
                        else:
                            finish = protocol.FINISH.get(stats["finish_reason"], "stop")
                            yield chunk({"index": i, "text": "", "logprobs": None, "finish_reason": finish})
                    if options.include_usage:
                        yield chunk({}, usage=protocol.usage(payload))
                    break
                else:
                    yield f"data: {json.dumps(_job_error(payload).body())}\n\n"
                    break
            yield "data: [DONE]\n\n"
        finally:  # the client went away (the generator is closed) or the answer is complete
            scheduler.cancel(job)

    # --- the rest ---

    async def models(self, request: HTTPRequest) -> Response:
        self.check_key(request)
        state = self.state
        card = {
            "id": state.model_name,
            "object": "model",
            "created": int(state.started),
            "owned_by": "moerun",
        }
        if state.model is not None:
            card["max_model_len"] = state.context
        return JSONResponse({"object": "list", "data": [card]})

    async def health(self, request: HTTPRequest) -> Response:
        self.ready()
        return JSONResponse({"status": "ok"})

    async def metrics(self, request: HTTPRequest) -> Response:
        return PlainTextResponse(metrics_text(self.state), media_type="text/plain; version=0.0.4")

    async def _text_request(self, request: HTTPRequest) -> tuple[Body, object]:
        """/tokenize and /detokenize: the key, the body, a loaded model with a tokenizer."""
        self.check_key(request)
        body = await read_body(request)
        model, _ = self.ready()
        if model.tokenizer is None:
            raise bad("This model has no tokenizer.")
        return body, model

    async def tokenize(self, request: HTTPRequest) -> Response:
        body, model = await self._text_request(request)
        text = body.text("content") if body.has("content") else body.text("prompt")
        if text is None:
            raise bad("Give the text as 'content' (or 'prompt').", "content")
        special = body.flag("add_special", True)
        ids = await asyncio.to_thread(model.tokenizer.encode, text, add_special_tokens=special)
        answer = {"tokens": ids, "count": len(ids), "max_model_len": self.state.context}
        return await asyncio.to_thread(JSONResponse, answer)  # up to a million ids to write

    async def detokenize(self, request: HTTPRequest) -> Response:
        body, model = await self._text_request(request)
        ids = body.data.get("tokens")
        vocab = model.config.vocab_size

        def answer() -> Response:  # in a thread: up to a million ids to check and decode
            if not isinstance(ids, list) or not all(
                isinstance(i, int) and not isinstance(i, bool) and 0 <= i < vocab for i in ids
            ):
                raise bad(f"'tokens' must be a list of token ids in [0, {vocab}).", "tokens")
            # decode_batch is tokenizer.decode's text, and lets the event loop run while it works
            text = model.tokenizer.backend.decode_batch([ids], skip_special_tokens=True)[0]
            return JSONResponse({"content": text})

        return await asyncio.to_thread(answer)


async def _collect(request: HTTPRequest, scheduler: Scheduler, job: Job, events: asyncio.Queue):
    """A whole response's (tokens of each choice, stats of each choice); the job is cancelled if the
    client goes away (a 499)."""
    tokens = [[] for _ in range(job.request.n)]
    try:
        while True:
            try:
                kind, payload = await asyncio.wait_for(events.get(), POLL_S)
            except TimeoutError:
                if await request.is_disconnected():
                    scheduler.cancel(job)
                    raise APIError(499, "The client went away.") from None
                continue
            if kind == "tokens":
                tokens[payload[0]] += payload[1]
            elif kind == "done":
                return tokens, payload
            else:
                raise _job_error(payload)
    except asyncio.CancelledError:
        scheduler.cancel(job)
        raise


def _job_error(message) -> APIError:
    """A job's error event: a 503 when the server is shutting down, else a 500."""
    if message == SHUTTING_DOWN:
        return APIError(503, SHUTTING_DOWN, None, "shutting_down")
    return APIError(500, str(message))
