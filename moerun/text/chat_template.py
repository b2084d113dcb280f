"""Chat templates: a model's Jinja template turning a list of messages into its prompt text, rendered
as transformers renders it (`utils/chat_template_utils.py`: `_compile_jinja_template`,
`render_jinja_template`), so a prompt built here is the one the model was trained to read.

Templates come with checkpoints and are untrusted code: they run in Jinja's immutable sandbox, with
what transformers gives them and nothing more: `raise_exception(message)`, `strftime_now(format)`,
a `tojson` filter that keeps non-ASCII text as it is, `dict` and `namespace` that refuse
underscore-prefixed names, the loop controls `break`/`continue`, and a `{% generation %}` block that
renders its body.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Where a message's reasoning may arrive; templates read the first name, gpt-oss's reads `thinking`.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class ChatTemplateError(ValueError):
    """A model has no chat template, or its template refused the conversation."""


def render_chat(
    template: str,
    messages: list[dict],
    add_generation_prompt: bool = True,
    *,
    tools: list[dict] | None = None,
    documents: list[dict] | None = None,
    source: str = "the chat template",
    **extra,
) -> str:
    """The prompt text `template` makes of `messages` (dicts with "role" and "content"), ending with
    the start of the assistant's turn if `add_generation_prompt`. `extra` reaches the template as
    variables, the special tokens among them (`bos_token`, `eos_token`, any `*_token`) as text, any
    left out when None, as transformers' `apply_chat_template` passes them.

    Tokenize the result without adding special tokens again (`Tokenizer.encode(text,
    add_special_tokens=False)`): templates write BOS themselves. Raises ChatTemplateError, naming
    `source`, when the template does not parse or raises."""
    return render_prepared(
        template, prepare_messages(messages), add_generation_prompt, tools, documents, source, extra
    )


def prepare_messages(messages: list[dict]) -> list[dict]:
    """`messages` as a template sees them (transformers' `_normalize_chat_messages` and
    `_alias_reasoning_fields`): plain JSON types, None fields left out (templates test for missing
    keys), an earlier turn's reasoning under each name templates read."""
    if not messages:
        raise ChatTemplateError("there are no messages to put through the chat template.")
    chat = []
    for message in _plain(messages):
        if not isinstance(message, dict):
            raise ChatTemplateError(
                f"a chat message must be a dict with 'role' and 'content', not {message!r}."
            )
        message = {key: value for key, value in message.items() if value is not None}
        reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        chat.append(message)
    return chat


def render_prepared(
    template: str,
    chat: list[dict],
    add_generation_prompt: bool,
    tools: list[dict] | None,
    documents: list[dict] | None,
    source: str,
    extra: dict,
) -> str:
    """`render_chat` on messages already through `prepare_messages` (a None left in one reaches
    the template as none)."""
    variables = _plain({key: value for key, value in extra.items() if value is not None})
    try:
        compiled = _compile(template)
        return compiled.render(
            messages=chat,
            tools=_plain(tools),
            documents=_plain(documents),
            add_generation_prompt=add_generation_prompt,
            **variables,
        )
    except jinja2.TemplateSyntaxError as e:
        raise ChatTemplateError(f"{source} is not valid Jinja (line {e.lineno}): {e.message}") from e
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"{source} refused this conversation: {e}") from e
    except (TypeError, ValueError, LookupError, AttributeError, ArithmeticError, RecursionError) as e:
        # a template's own operation on what it was given (str + dict, a missing index, ...)
        raise ChatTemplateError(f"{source} failed on this conversation: {type(e).__name__}: {e}") from e


def no_template_error(source: str) -> ChatTemplateError:
    """The error for a model that has no chat template; `source` names where one was looked for."""
    return ChatTemplateError(
        f"{source} has no chat template, so chat prompts cannot be built for this model. Use a plain "
        "text prompt (`moerun generate --prompt ...`), or use a model whose tokenizer_config.json, "
        "chat_template.jinja or GGUF metadata (tokenizer.chat_template) has one."
    )


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks the assistant's text for training masks; for
    rendering a prompt it is its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


class _Dict:
    """`dict(...)` in a template, without attribute access to the builtin type."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _Namespace(jinja2.utils.Namespace):
    """`namespace(...)` that refuses underscore-prefixed names, which lead to interpreter internals."""

    def __init__(*args, **kwargs):  # the signature Jinja's Namespace uses, so namespace(self=...) works
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes on a namespace ({name!r})."
            )


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own filter escapes HTML characters; transformers' keeps text as it is.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format):
    return datetime.now().strftime(format)


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals.update(
        raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_Dict(), namespace=_Namespace
    )
    return env.from_string(template)


def _plain(value):
    """`value` rebuilt from plain JSON types (a fresh copy); anything else becomes a placeholder naming
    its type, so a template never reaches an object's methods."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if hasattr(value, "item") and callable(value.item) and getattr(value, "shape", None) == ():
        return _plain(value.item())  # a numpy or torch scalar
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return f"<{type(value).__name__}>"
