"""Tool calls: what a request offers (`ToolRequest`: the functions, `tool_choice` and
`parallel_tool_calls`, checked), the syntaxes models write their calls in, each read back into
`ToolCall`s, and the JSON schema a valid call must match (`tool_call_schema`, for constrained decoding).

The syntaxes, as vLLM's tool parsers and llama.cpp's common/chat.cpp read them:
- `TaggedCalls` (Qwen2.5, Qwen3, Hermes, GLM-4.5): `<tool_call>...</tool_call>` around JSON
  `{"name": ..., "arguments": {...}}`, GLM-4.5's `name` then `<arg_key>k</arg_key><arg_value>v</arg_value>`
  pairs, or Qwen3-Coder's `<function=name><parameter=k>v</parameter></function>`.
- `MistralCalls`: `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]` (Mistral v0.3, Mixtral-8x22B)
  and `[TOOL_CALLS]name[ARGS]{...}` (newer tokenizers; `[CALL_ID]id` may come before `[ARGS]`).
- `DeepSeekCalls`: `<｜tool▁calls▁begin｜>` then per call `<｜tool▁call▁begin｜>function<｜tool▁sep｜>name`
  and the arguments in a json code fence (V3, R1), or `<｜tool▁call▁begin｜>name<｜tool▁sep｜>{...}`
  (V3.1), each closed by `<｜tool▁call▁end｜>`, then `<｜tool▁calls▁end｜>`.
gpt-oss writes its calls as harmony messages to `functions.NAME` (`moerun.text.harmony`).

A syntax reads one region of the reply at a time, from one of its opening markers: `region(text,
final, tools)` says how long the region is and the calls in it, or None for calls that do not parse
(the region's text is then the reply's content, as it came).
"""

from __future__ import annotations

import json
import re
import secrets
import string
from collections.abc import Mapping
from dataclasses import dataclass

MAX_TOOLS = 128
NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
CHOICES = ("none", "auto", "required")


class ToolRequestError(ValueError):
    """A request's `tools`, `tool_choice` or `parallel_tool_calls` is malformed; `param` names the field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: an id for the client to answer with, the function's name, and its
    arguments as a JSON object's text."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class ToolRequest:
    """The functions a request offers (OpenAI's `tools` entries, each {"type": "function",
    "function": {"name", "description"?, "parameters"?}}), `choice` ("none", "auto", "required" or the
    one function's name that must be called) and whether several calls may come in one reply."""

    tools: tuple[dict, ...]
    choice: str = "auto"
    parallel: bool = True

    @classmethod
    def make(cls, tools, tool_choice=None, parallel_tool_calls=None) -> ToolRequest | None:
        """The checked request, or None when it offers no tools; ToolRequestError names what is wrong."""
        if tools is not None and not isinstance(tools, list):
            raise ToolRequestError("'tools' must be a list of function tools.", "tools")
        tools = tools or []
        if len(tools) > MAX_TOOLS:
            raise ToolRequestError(f"'tools' lists {len(tools)} tools, more than {MAX_TOOLS}.", "tools")
        checked, names = [], set()
        for i, tool in enumerate(tools):
            checked.append(_checked_tool(tool, i))
            name = checked[-1]["function"]["name"]
            if name in names:
                raise ToolRequestError(f"'tools' names the function '{name}' twice.", "tools")
            names.add(name)
        if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
            raise ToolRequestError("'parallel_tool_calls' must be true or false.", "parallel_tool_calls")
        choice = _checked_choice(tool_choice, names)
        if not checked:
            return None
        return cls(tuple(checked), choice, parallel_tool_calls is not False)

    @property
    def parameters(self) -> dict[str, dict]:
        """Each function's name -> its parameters' JSON schema ({} when it has none)."""
        return {t["function"]["name"]: t["function"].get("parameters") or {} for t in self.tools}

    @property
    def parsed(self) -> bool:
        """Whether the reply is read for calls (not under tool_choice "none")."""
        return self.choice != "none"


def _checked_tool(tool, i: int) -> dict:
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise ToolRequestError(f'{where} must be an object with "type": "function".', "tools")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise ToolRequestError(f"{where}.function must be an object with a 'name'.", "tools")
    name = function.get("name")
    if not isinstance(name, str) or not NAME.match(name):
        raise ToolRequestError(
            f"{where}.function.name must be 1 to 64 letters, digits, '_', '-' or '.', got {_short(name)}.",
            "tools",
        )
    if not isinstance(function.get("description", ""), str | None):
        raise ToolRequestError(f"{where}.function.description must be a string.", "tools")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise ToolRequestError(f"{where}.function.parameters must be a JSON schema object.", "tools")
    if parameters is not None and parameters.get("type", "object") != "object":
        raise ToolRequestError(f'{where}.function.parameters must have "type": "object".', "tools")
    if not isinstance(function.get("strict", False), bool | None):
        raise ToolRequestError(f"{where}.function.strict must be true or false.", "tools")
    return {"type": "function", "function": {k: v for k, v in function.items() if v is not None}}


def _checked_choice(choice, names: set[str]) -> str:
    if choice is None:
        return "auto" if names else "none"
    if isinstance(choice, str):
        if choice not in CHOICES:
            raise ToolRequestError(
                '\'tool_choice\' must be "none", "auto", "required" or a named function, '
                f"got {_short(choice)}.",
                "tool_choice",
            )
        if choice == "required" and not names:
            raise ToolRequestError("'tool_choice' \"required\" needs 'tools' to choose from.", "tool_choice")
        return choice
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str) or choice.get("type", "function") != "function":
        raise ToolRequestError(
            '\'tool_choice\' naming a function must be {"type": "function", "function": {"name": ...}}.',
            "tool_choice",
        )
    if name not in names:
        raise ToolRequestError(f"'tool_choice' names '{name}', which is not among 'tools'.", "tool_choice")
    return name


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def tool_call_schema(request: ToolRequest | None) -> dict | None:
    """The JSON schema one call must match under tool_choice "required" or a named function:
    {"name": that function's name, "arguments": its parameters}, any of the allowed functions; None
    when the choice is the model's ("auto") or no call may come ("none"). The text a family writes
    around the arguments is `moerun.text.chat_tools.tool_call_tags`."""
    if request is None or request.choice in ("auto", "none"):
        return None
    options = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, "arguments": parameters or {"type": "object"}},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for name, parameters in request.parameters.items()
        if request.choice in ("required", name)
    ]
    return options[0] if len(options) == 1 else {"anyOf": options}


def new_call_id(style: str = "openai") -> str:
    """A fresh call id: OpenAI's "call_" and 24 characters, or the 9 letters and digits Mistral's
    chat templates insist on."""
    if style == "mistral":
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
    return "call_" + secrets.token_hex(12)


def arguments_text(arguments) -> str | None:
    """A call's arguments as a JSON object's text (a dict, or a string holding one); None if neither."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return json.dumps(arguments, ensure_ascii=False)


def _typed(value: str, schema) -> object:
    """A non-JSON syntax's argument value: kept as text where the schema says string, else read as
    JSON when it is (numbers, booleans, objects), else text."""
    text = value.strip()
    if isinstance(schema, Mapping) and schema.get("type") == "string":
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text


def _decode_prefix(text: str) -> tuple[object, int] | None:
    """The JSON value that begins `text` (after whitespace) and where it ends, or None."""
    start = len(text) - len(text.lstrip())
    try:
        value, end = json.JSONDecoder().raw_decode(text, start)
    except ValueError:
        return None
    return value, end


Calls = list[tuple[str, str]]  # (name, arguments' JSON text)
Region = tuple[int, Calls | None] | None


class ToolSyntax:
    """How one family writes its calls. `opens`: the markers a call region starts with."""

    name = ""
    opens: tuple[str, ...] = ()
    markers: tuple[str, ...] = ()  # every marker it writes (some vocabularies make them special tokens)
    id_style = "openai"

    def region(self, text: str, final: bool, tools: Mapping[str, dict]) -> Region:
        """`text` begins with one of `opens` -> (the region's length, its calls or None when they do
        not parse), or None while the region may go on (never when `final`: the reply has ended)."""
        raise NotImplementedError


class TaggedCalls(ToolSyntax):
    name = "tagged"
    opens = ("<tool_call>",)
    close = "</tool_call>"
    markers = (*opens, close, "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")

    def region(self, text, final, tools):
        end = text.find(self.close)
        if end < 0 and not final:
            return None
        inner = text[len(self.opens[0]) : end if end >= 0 else len(text)]
        size = end + len(self.close) if end >= 0 else len(text)
        call = self._json(inner) or self._xml_function(inner, tools) or self._arg_pairs(inner, tools)
        return size, [call] if call else None

    @staticmethod
    def _json(inner: str) -> tuple[str, str] | None:
        try:
            value = json.loads(inner)
        except ValueError:
            return None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None
        arguments = arguments_text(value.get("arguments", value.get("parameters", {})))
        return (value["name"], arguments) if arguments is not None else None

    @staticmethod
    def _xml_function(inner: str, tools) -> tuple[str, str] | None:
        """Qwen3-Coder: <function=name><parameter=key>value</parameter>...</function>"""
        match = re.fullmatch(r"\s*<function=([^>\s]+)>(.*?)(?:</function>)?\s*", inner, re.DOTALL)
        if not match:
            return None
        name, body = match.groups()
        schema = tools.get(name, {}).get("properties", {})
        arguments = {}
        for key, value in re.findall(r"<parameter=([^>\s]+)>(.*?)</parameter>", body, re.DOTALL):
            arguments[key] = _typed(value.strip("\n"), schema.get(key))
        if re.sub(r"<parameter=[^>\s]+>.*?</parameter>", "", body, flags=re.DOTALL).strip():
            return None  # text outside the parameters
        return name, json.dumps(arguments, ensure_ascii=False)

    @staticmethod
    def _arg_pairs(inner: str, tools) -> tuple[str, str] | None:
        """GLM-4.5: name\n<arg_key>k</arg_key>\n<arg_value>v</arg_value>..."""
        head, _, rest = inner.partition("<arg_key>")
        name = head.strip()
        if not NAME.match(name):
            return None
        rest = "<arg_key>" + rest if rest else ""
        pairs = re.findall(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", rest, re.DOTALL)
        if re.sub(r"<arg_key>.*?</arg_key>\s*<arg_value>.*?</arg_value>", "", rest, flags=re.DOTALL).strip():
            return None
        schema = tools.get(name, {}).get("properties", {})
        arguments = {key.strip(): _typed(value, schema.get(key.strip())) for key, value in pairs}
        return name, json.dumps(arguments, ensure_ascii=False)


class MistralCalls(ToolSyntax):
    name = "mistral"
    opens = ("[TOOL_CALLS]",)
    markers = (*opens, "[ARGS]", "[CALL_ID]")
    id_style = "mistral"

    def region(self, text, final, tools):
        body = text[len(self.opens[0]) :]
        skip = len(self.opens[0])
        # JSON ends with a bracket: until one comes, or the reply ends, there is nothing to decode
        complete = final or text.rstrip().endswith(("}", "]"))
        if body.lstrip().startswith("["):  # [TOOL_CALLS] [{"name": ..., "arguments": ...}, ...]
            decoded = _decode_prefix(body) if complete else None
            if decoded is None:
                return (len(text), None) if final else None
            value, end = decoded
            calls = [self._entry(v) for v in value] if isinstance(value, list) and value else [None]
            return skip + end, None if None in calls else calls
        # [TOOL_CALLS]name[ARGS]{...}, or name[CALL_ID]id[ARGS]{...}
        head, marker, rest = body.partition("[ARGS]")
        following = body.find(self.opens[0])
        if following >= 0 and (not marker or following < len(head)):  # the next call began first
            return skip + following, None
        decoded = _decode_prefix(rest) if marker and complete else None
        if decoded is None:
            return (len(text), None) if final else None
        name = head.partition("[CALL_ID]")[0].strip()
        value, end = decoded
        arguments = arguments_text(value)
        size = skip + len(head) + len(marker) + end
        return size, [(name, arguments)] if NAME.match(name) and arguments is not None else None

    @staticmethod
    def _entry(value) -> tuple[str, str] | None:
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None
        arguments = arguments_text(value.get("arguments", {}))
        return (value["name"], arguments) if arguments is not None else None


class DeepSeekCalls(ToolSyntax):
    name = "deepseek"
    begin, end = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    call_begin, call_end, sep = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
    opens = (begin, call_begin, end)
    markers = (*opens, call_end, sep)

    def region(self, text, final, tools):
        if text.startswith(self.begin) or text.startswith(self.end):  # the list's brackets: no call
            return len(self.begin if text.startswith(self.begin) else self.end), []
        close = text.find(self.call_end)
        if close < 0 and not final:
            return None
        inner = text[len(self.call_begin) : close if close >= 0 else len(text)]
        size = close + len(self.call_end) if close >= 0 else len(text)
        kind, marker, rest = inner.partition(self.sep)
        if not marker:
            return size, None
        fence = re.fullmatch(r"(.*?)\n```(?:json)?\n(.*?)\n```\s*", rest, re.DOTALL)
        if fence:  # V3, R1: function<｜tool▁sep｜>name\n```json\n{...}\n```
            name, arguments = fence.group(1).strip(), arguments_text(fence.group(2))
        else:  # V3.1: name<｜tool▁sep｜>{...}
            name, arguments = kind.strip(), arguments_text(rest)
        return size, [(name, arguments)] if NAME.match(name) and arguments is not None else None


SYNTAXES = {s.name: s for s in (TaggedCalls(), MistralCalls(), DeepSeekCalls())}
