"""Tools and tool calls through a chat template. OpenAI's clients send a call's arguments as a JSON
string and a calling message's content as null; templates differ in what they read. Transformers'
convention (and Qwen2.5's, GLM-4.5's, Mistral's, gpt-oss's templates) is arguments as an object, which
a string would be double-encoded or refused by; DeepSeek's templates join the arguments to text and
need a string, and test the content for none. As llama.cpp's server does, moerun asks the template
itself, once per template: it renders a call each way and keeps the first way that writes the call's
arguments as they are (`TemplateTools`).

Mistral's templates refuse a call id that is not 9 letters and digits; where a template refuses the
ids OpenAI's clients use, each id (on a call and on the `tool` message answering it) is replaced by 9
characters of its hash, the same on both sides.

A template that ignores `tools` (DeepSeek-V3's and R1's) is given them in the system message, with the
template's own rendering of a call as the example of the syntax, as llama.cpp's template polyfills do.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from functools import lru_cache

from moerun.text.chat_template import ChatTemplateError, prepare_messages, render_prepared
from moerun.text.tool_calls import ToolRequest

PROBE_NAME, PROBE_ARG = "function_name", "argument_name"
PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": PROBE_NAME,
        "description": "What the function does.",
        "parameters": {
            "type": "object",
            "properties": {PROBE_ARG: {"type": "string"}},
            "required": [PROBE_ARG],
        },
    },
}
PROBE_ID = "call00001"  # Mistral's templates take 9 letters and digits
LONG_ID = "call_0123456789abcdef01234567"  # and refuse OpenAI's
ARGUMENT_FORMS = ("object", "string")
CONTENT_FORMS = ("missing", "none", "empty")  # a calling message's content: left out, none or ""


@dataclass(frozen=True)
class TemplateTools:
    """What a template does with tools: whether it writes the `tools` list, in which form it takes
    a call's arguments and a calling message's empty content, and how a call looks in its output."""

    renders_tools: bool
    arguments: str = "object"
    content: str = "missing"
    short_ids: bool = False
    example: str | None = None


def render_conversation(
    template: str,
    messages: list[dict],
    add_generation_prompt: bool = True,
    tools: list[dict] | None = None,
    source: str = "the chat template",
    **variables,
) -> str:
    """`render_chat` with the tools and the calls in `messages` given in the forms the template
    takes (`TemplateTools`); `variables` as `render_chat`'s `extra`."""
    chat = prepare_messages(messages)
    uses_tools = bool(tools) or any(m.get("tool_calls") for m in chat)
    if uses_tools:
        tokens = tuple(sorted((k, v) for k, v in variables.items() if k.endswith("_token") and v))
        caps = template_tools(template, tokens)
        chat = [_adapted(m, i, caps) for i, m in enumerate(chat)]
        if caps.short_ids:
            chat = [_with_short_ids(m) for m in chat]
        if tools and not caps.renders_tools:
            chat = _with_tools_in_system(chat, tools, caps.example)
            tools = None
    return render_prepared(template, chat, add_generation_prompt, tools or None, None, source, variables)


@lru_cache(maxsize=16)
def template_tools(template: str, tokens: tuple[tuple[str, str], ...] = ()) -> TemplateTools:
    """The template's `TemplateTools`, found by rendering a probe conversation (`tokens`: the
    special tokens' variables)."""
    variables = dict(tokens)

    def render(chat, tools, add_generation_prompt) -> str | None:
        try:
            return render_prepared(template, chat, add_generation_prompt, tools, None, "probe", variables)
        except ChatTemplateError:
            return None

    listed = render([{"role": "user", "content": "Hello"}], [PROBE_TOOL], True)
    renders_tools = listed is not None and PROBE_NAME in listed
    user = {"role": "user", "content": "Hello"}
    for arguments in ARGUMENT_FORMS:
        for content in CONTENT_FORMS:
            text = render(_round_trip(arguments, content, PROBE_ID), [PROBE_TOOL], True)
            if text is not None and _writes_arguments(text):
                short_ids = render(_round_trip(arguments, content, LONG_ID), [PROBE_TOOL], True) is None
                prompt = render([user], [PROBE_TOOL], True) or ""
                turn = render(_round_trip(arguments, content, PROBE_ID)[:2], [PROBE_TOOL], False) or ""
                example = _example(prompt, turn, variables)
                return TemplateTools(renders_tools, arguments, content, short_ids, example)
    # a template that writes no calls: earlier calls are left out, as an empty text turn
    return TemplateTools(renders_tools, "string", "empty")


def _round_trip(arguments: str, content: str, call_id: str) -> list[dict]:
    """A question, a call (arguments and empty content in the given forms) and its answer."""
    user = {"role": "user", "content": "Hello"}
    answer = {"role": "tool", "tool_call_id": call_id, "name": PROBE_NAME, "content": "42"}
    return [user, _calling_message(arguments, content, call_id), answer]


def _calling_message(arguments: str, content: str, call_id: str) -> dict:
    value = {PROBE_ARG: "argument value"}
    call = {
        "id": call_id,
        "type": "function",
        "function": {"name": PROBE_NAME, "arguments": value if arguments == "object" else json.dumps(value)},
    }
    message = {"role": "assistant", "tool_calls": [call]}
    if content != "missing":
        message["content"] = None if content == "none" else ""
    return message


def _writes_arguments(text: str) -> bool:
    """The probe call's arguments are in `text` as written, not encoded a second time."""
    return PROBE_NAME in text and "argument value" in text and f'\\"{PROBE_ARG}' not in text


def _example(prompt: str, turn: str, variables: dict) -> str | None:
    """What the template adds for a calling turn: the part of `turn` past what it shares with the
    prompt for a reply, without the end-of-turn token."""
    n = 0
    while n < min(len(prompt), len(turn)) and prompt[n] == turn[n]:
        n += 1
    if n < len(prompt):  # the prompt for a reply opens differently (`<think>`): back to a marker's end
        n = max(turn.rfind(c, 0, n) + 1 for c in ">]\n")
    example = turn[n:].strip()
    eos = variables.get("eos_token")
    if eos and example.endswith(eos):
        example = example[: -len(eos)].rstrip()
    return example if PROBE_NAME in example else None


def _adapted(message: dict, index: int, caps: TemplateTools) -> dict:
    """A message with its calls' arguments (and, calling, its empty content) in the template's form."""
    calls = message.get("tool_calls")
    if not isinstance(calls, list) or not calls:
        return message
    adapted = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            adapted.append(call)
            continue
        arguments = function.get("arguments", {})
        if caps.arguments == "object" and isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError:
                raise ChatTemplateError(
                    f"messages[{index}].tool_calls[{j}].function.arguments is not valid JSON."
                ) from None
        elif caps.arguments == "string" and not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        adapted.append({**call, "function": {**function, "arguments": arguments}})
    message = {**message, "tool_calls": adapted}
    if not message.get("content"):
        message.pop("content", None)
        if caps.content != "missing":
            message["content"] = None if caps.content == "none" else ""
    return message


def _with_tools_in_system(chat: list[dict], tools: list[dict], example: str | None) -> list[dict]:
    """The tools described in the system message, for a template that does not write them."""
    lines = ["You can call these functions, each described by a JSON schema:"]
    lines += [json.dumps(tool.get("function", tool), ensure_ascii=False) for tool in tools]
    if example:
        lines += ["", "To call a function, write the call in this form:", example]
    text = "\n".join(lines)
    if chat and chat[0].get("role") == "system" and isinstance(chat[0].get("content"), str):
        return [{**chat[0], "content": chat[0]["content"] + "\n\n" + text}, *chat[1:]]
    return [{"role": "system", "content": text}, *chat]


def _short_id(value):
    if not isinstance(value, str) or (len(value) == 9 and value.isalnum()):
        return value
    return hashlib.sha256(value.encode("utf-8", "replace")).hexdigest()[:9]


def _with_short_ids(message: dict) -> dict:
    """A message with its calls' ids (or the id it answers) in 9 letters and digits."""
    if "tool_call_id" in message:
        message = {**message, "tool_call_id": _short_id(message["tool_call_id"])}
    calls = message.get("tool_calls")
    if isinstance(calls, list):
        calls = [{**c, "id": _short_id(c["id"])} if isinstance(c, dict) and "id" in c else c for c in calls]
        message = {**message, "tool_calls": calls}
    return message


@dataclass(frozen=True)
class ArgumentPairs:
    """How a template writes a call's arguments as key/value pairs rather than one JSON object
    (GLM-4.5): per argument `key_open` KEY `between` VALUE `value_close`, a string value bare and
    any other as JSON (as `moerun.text.tool_calls` reads them back)."""

    key_open: str
    between: str
    value_close: str


@dataclass(frozen=True)
class CallForm:
    """One function's call as the template writes it: `before` its arguments, their JSON schema,
    `after` them; `pairs` None where the arguments are one JSON object."""

    before: str
    schema: dict
    after: str
    pairs: ArgumentPairs | None = None


# GLM-4.5's pairs, as its template writes the probe call: the markers moerun.text.tool_calls reads
_PAIRS = re.compile(
    rf"(?s)(.*?)(<arg_key>){PROBE_ARG}(</arg_key>\s*<arg_value>)argument value(</arg_value>\s*)(.*)"
)


def tool_call_tags(
    template: str, special_tokens: dict[str, str], request: ToolRequest
) -> list[CallForm] | None:
    """For constrained decoding (tool_choice "required" or a named function): per function that may
    be called, its CallForm, as the template itself writes a call (its `TemplateTools.example`), so
    a constrained reply is what the model was trained to write and what `moerun.text.reply` reads.
    None when the template writes no call, or writes its arguments in a form other than one JSON
    object or GLM-4.5's key/value pairs. Where the prompt opens the reasoning
    (`moerun.text.reasoning.prompt_opens_thinking`), the reply is read as reasoning until `</think>`,
    so a constrained reply must close it before the call."""
    tokens = tuple(sorted((k, v) for k, v in special_tokens.items() if k.endswith("_token") and v))
    example = template_tools(template, tokens).example
    if example is None:
        return None
    arguments = json.dumps({PROBE_ARG: "argument value"})
    if example.count(arguments) == 1:
        before, after = example.split(arguments)
        pairs = None
    elif (match := _PAIRS.fullmatch(example)) is not None:
        before, after = match[1], match[5]
        pairs = ArgumentPairs(match[2], match[3], match[4])
    else:
        return None
    return [
        CallForm(before.replace(PROBE_NAME, name), parameters or {"type": "object"}, after, pairs)
        for name, parameters in request.parameters.items()
        if request.choice in ("required", "auto", name)
    ]
