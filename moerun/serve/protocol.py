"""OpenAI's API shapes: a request body checked field by field into a moerun.batching.Request, and
the response objects (whole, and streamed chunk by chunk) built from the tokens that come back.

Fields the API defines and moerun does not do (`echo`, `suffix`, the old `functions`, ...) are
refused with a 400 naming them; fields it does not know are ignored, as OpenAI's own server does.
`response_format` goes to Request.make, which compiles its grammar (moerun.text.grammar): a format it
cannot enforce is a 400 naming what.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass

from moerun.batching import Request, Token
from moerun.text.grammar import GrammarError
from moerun.text.tool_calls import ToolRequest, ToolRequestError

# OpenAI's finish reasons; moerun's "context" (the context filled) is OpenAI's "length"
FINISH = {"stop": "stop", "length": "length", "context": "length"}
MAX_STOPS = 16
MAX_STOP_CHARS = 4096  # the stop strings' characters together
MAX_TOP_LOGPROBS = 20
MAX_CHOICES = 16  # `n`; a server also refuses more than it runs at once (`parallel`)


class APIError(Exception):
    """An error the client caused or must hear of, as OpenAI shapes it."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    @property
    def type(self) -> str:
        return {
            400: "invalid_request_error",
            401: "authentication_error",
            404: "not_found_error",
            413: "invalid_request_error",
            415: "invalid_request_error",
            503: "server_error",
        }.get(self.status, "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param, "invalid_value" if param else None)


class Body:
    """A JSON object's fields, each read with its type and range checked (a 400 naming it)."""

    def __init__(self, data):
        if not isinstance(data, dict):
            raise bad("The request body must be a JSON object.")
        self.data = data

    def has(self, name: str) -> bool:
        return self.data.get(name) is not None

    def number(self, name: str, default: float, low: float, high: float) -> float:
        value = self.data.get(name)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
            raise bad(f"'{name}' must be a number in [{low}, {high}], got {_short(value)}.", name)
        return float(value)

    def integer(self, name: str, default: int | None, low: int, high: int) -> int | None:
        value = self.data.get(name)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise bad(f"'{name}' must be an integer in [{low}, {high}], got {_short(value)}.", name)
        return value

    def flag(self, name: str, default: bool = False) -> bool:
        value = self.data.get(name)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise bad(f"'{name}' must be true or false, got {_short(value)}.", name)
        return value

    def text(self, name: str, default: str | None = None) -> str | None:
        value = self.data.get(name)
        if value is None:
            return default
        if not isinstance(value, str):
            raise bad(f"'{name}' must be a string, got {_short(value)}.", name)
        return value


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


@dataclass(frozen=True)
class Options:
    """What a completion request asks for besides its prompt."""

    stream: bool
    include_usage: bool
    logprobs: int  # alternatives per token; 0 with `want_logprobs` still reports the token's own
    want_logprobs: bool


def generation_options(body: Body, chat: bool, context: int) -> tuple[dict, Options]:
    """The sampling, length and stop fields -> (keyword arguments of Request.make, Options)."""
    n = body.integer("n", 1, 1, MAX_CHOICES)
    for unsupported in ("functions", "function_call", "suffix", "best_of"):
        if body.has(unsupported):
            use = " (give 'tools' instead)" if unsupported.startswith("function") else ""
            raise bad(f"'{unsupported}' is not supported by this server{use}.", unsupported)
    if not chat:
        for chat_only in ("tools", "tool_choice"):
            if body.has(chat_only):
                raise bad(f"'{chat_only}' is a field of /v1/chat/completions.", chat_only)
    if body.flag("echo"):
        raise bad("'echo' is not supported by this server.", "echo")
    limit_name = "max_completion_tokens" if body.has("max_completion_tokens") else "max_tokens"
    max_tokens = body.integer(limit_name, None if chat else 16, 0, context)
    stop = body.data.get("stop")
    if stop is None:
        stops = []
    elif isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and len(stop) <= MAX_STOPS and all(isinstance(s, str) for s in stop):
        stops = list(stop)
    else:
        raise bad(f"'stop' must be a string or a list of at most {MAX_STOPS} strings.", "stop")
    stops = [s for s in stops if s]
    if sum(map(len, stops)) > MAX_STOP_CHARS:
        raise bad(f"The 'stop' strings must hold at most {MAX_STOP_CHARS} characters together.", "stop")
    top_k = body.integer("top_k", 0, -1, 1 << 20)
    seed = body.integer("seed", None, -(1 << 63), (1 << 63) - 1)
    sampling = dict(
        temperature=body.number("temperature", 1.0, 0.0, 2.0),
        top_p=body.number("top_p", 1.0, 0.0, 1.0) or 1.0,
        top_k=0 if top_k == -1 else top_k,
        min_p=body.number("min_p", 0.0, 0.0, 1.0),
        presence_penalty=body.number("presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=body.number("frequency_penalty", 0.0, -2.0, 2.0),
        repetition_penalty=body.number("repetition_penalty", 1.0, 1e-3, 100.0),
        seed=seed,
    )
    if chat:
        want = body.flag("logprobs")
        top = body.integer("top_logprobs", 0, 0, MAX_TOP_LOGPROBS)
        if top and not want:
            raise bad("'top_logprobs' needs 'logprobs': true.", "top_logprobs")
    else:
        top = body.integer("logprobs", None, 0, 5)
        want = top is not None
        top = top or 0
    stream = body.flag("stream")
    stream_options = body.data.get("stream_options")
    if stream_options is not None and not isinstance(stream_options, dict):
        raise bad("'stream_options' must be an object.", "stream_options")
    include_usage = bool(stream_options and stream_options.get("include_usage") is True)
    kwargs = dict(sampling, max_new_tokens=max_tokens, stop=stops, logprobs=max(top, 1) if want else 0, n=n)
    if body.has("response_format"):
        kwargs["response_format"] = body.data["response_format"]
    return kwargs, Options(stream, include_usage, top, want)


def chat_messages(body: Body) -> list[dict]:
    """'messages' -> the list the chat template takes: text content, an assistant's earlier
    `tool_calls` and its reasoning, a `tool` message's `tool_call_id` and `name`."""
    messages = body.data.get("messages")
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty list of {role, content} objects.", "messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise bad(f"messages[{i}] must be an object with a string 'role'.", "messages")
        content = message.get("content")
        if isinstance(content, list):  # content parts: text only
            texts = []
            for part in content:
                if (
                    not isinstance(part, dict)
                    or part.get("type") != "text"
                    or not isinstance(part.get("text"), str)
                ):
                    raise bad(f"messages[{i}].content: only text parts are supported.", "messages")
                texts.append(part["text"])
            content = "".join(texts)
        elif content is not None and not isinstance(content, str):
            raise bad(f"messages[{i}].content must be a string or a list of text parts.", "messages")
        calls = _tool_calls(message, i)
        entry = {"role": message["role"], "content": None if calls and not content else content or ""}
        if calls:
            entry["tool_calls"] = calls
        for name in ("tool_call_id", "name"):
            value = message.get(name)
            if value is not None and not isinstance(value, str):
                raise bad(f"messages[{i}].{name} must be a string.", "messages")
            if value is not None:
                entry[name] = value
        if isinstance(message.get("reasoning_content"), str):  # an earlier turn's thinking
            entry["reasoning_content"] = message["reasoning_content"]
        out.append(entry)
    return out


def _tool_calls(message: dict, i: int) -> list[dict] | None:
    """An assistant message's `tool_calls`, checked: [{id, type, function: {name, arguments}}]."""
    calls = message.get("tool_calls")
    if calls is None or calls == []:
        return None
    if message["role"] != "assistant" or not isinstance(calls, list):
        raise bad(f"messages[{i}].tool_calls must be a list, on an assistant message.", "messages")
    checked = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        where = f"messages[{i}].tool_calls[{j}]"
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise bad(f"{where} must be {{id, type, function: {{name, arguments}}}}.", "messages")
        arguments = function.get("arguments", "{}")
        if not isinstance(arguments, str | dict):
            raise bad(f"{where}.function.arguments must be a JSON object's text.", "messages")
        call_id = call.get("id")
        if call_id is not None and not isinstance(call_id, str):
            raise bad(f"{where}.id must be a string.", "messages")
        checked.append(
            {
                "id": call_id or f"call_{i}_{j}",
                "type": "function",
                "function": {"name": function["name"], "arguments": arguments},
            }
        )
    return checked


def chat_tools(body: Body) -> ToolRequest | None:
    """'tools', 'tool_choice' and 'parallel_tool_calls', checked (None when no tools are offered)."""
    data = body.data
    try:
        return ToolRequest.make(data.get("tools"), data.get("tool_choice"), data.get("parallel_tool_calls"))
    except ToolRequestError as e:
        raise bad(str(e), e.param) from None


# Names the chat template's own arguments take; 'chat_template_kwargs' may not set them.
TEMPLATE_ARGUMENTS = ("messages", "tools", "documents", "add_generation_prompt")
REASONING_EFFORTS = ("minimal", "low", "medium", "high")


def template_variables(body: Body) -> dict:
    """'chat_template_kwargs' (e.g. {"enable_thinking": false}) and 'reasoning_effort' (which
    gpt-oss's template reads), as the chat template's variables."""
    kwargs = body.data.get("chat_template_kwargs")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict):
        raise bad("'chat_template_kwargs' must be an object of template variables.", "chat_template_kwargs")
    for name in kwargs:
        if name in TEMPLATE_ARGUMENTS or not name.isidentifier():
            raise bad(
                f"'chat_template_kwargs' cannot set {_short(name)}: give the template's own arguments "
                "as request fields, and other variables as identifiers.",
                "chat_template_kwargs",
            )
    effort = body.text("reasoning_effort")
    if effort is not None and effort not in REASONING_EFFORTS:
        raise bad(f"'reasoning_effort' must be one of {', '.join(REASONING_EFFORTS)}.", "reasoning_effort")
    return {**({"reasoning_effort": effort} if effort else {}), **kwargs}


def completion_prompt(body: Body) -> str | list[int]:
    prompt = body.data.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return prompt
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(i, int) and not isinstance(i, bool) for i in prompt)
    ):
        return prompt
    raise bad(
        "'prompt' must be a non-empty string or a list of token ids (one prompt per request).", "prompt"
    )


def make_request(model, prompt, kwargs: dict, ctx_size: int) -> Request:
    """Request.make with its refusals as 400s (a prompt longer than the context names both lengths)."""
    try:
        return Request.make(model, prompt, ctx_size=ctx_size, **kwargs)
    except GrammarError as e:
        raise bad(str(e), "response_format") from None
    except (ValueError, TypeError) as e:
        raise bad(str(e), "messages" if isinstance(prompt, list) else "prompt") from None


# --- responses ---


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(stats: list[Mapping]) -> dict:
    """Usage of a request from each choice's figures: the prompt, read once, and every choice's tokens."""
    prompt, new = stats[0]["prompt_tokens"], sum(s["new_tokens"] for s in stats)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": new,
        "total_tokens": prompt + new,
        "prompt_tokens_details": {"cached_tokens": stats[0].get("reused_tokens", 0)},
    }


def token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False) if tokenizer else str(token_id)


def chat_logprobs(tokenizer, tokens: list[Token], top: int) -> dict:
    def entry(token_id: int, logprob: float) -> dict:
        text = token_text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    return {
        "content": [
            {
                **entry(t.id, t.logprob),
                "top_logprobs": [entry(i, lp) for i, lp in t.top_logprobs[:top]],
            }
            for t in tokens
        ]
    }


def completion_logprobs(tokenizer, tokens: list[Token], top: int, offset: int = 0) -> dict:
    texts = [token_text(tokenizer, t.id) for t in tokens]
    offsets, at = [], offset
    for t in tokens:
        offsets.append(at)
        at += len(t.text)
    return {
        "tokens": texts,
        "token_logprobs": [t.logprob for t in tokens],
        "top_logprobs": [
            {token_text(tokenizer, i): lp for i, lp in t.top_logprobs[:top]} if top else None for t in tokens
        ],
        "text_offset": offsets,
    }


def envelope(kind: str, response_id: str, model_name: str, choices: list, **extra) -> dict:
    return {
        "id": response_id,
        "object": kind,
        "created": int(time.time()),
        "model": model_name,
        "choices": choices,
        **extra,
    }
