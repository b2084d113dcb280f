"""How `moerun chat` and `moerun generate --chat` show a reply: a thinking model's reasoning apart
from its answer, read as the server reads it (moerun.text.reply: `<think>` for Qwen3, DeepSeek-R1
and GLM-4.5, the analysis channel for gpt-oss), between a "Thinking..." line and a "...done
thinking." line as Ollama shows it, or left out (`--hide-reasoning`). The flags that reach the chat
template (`--chat-template-kwargs`, e.g. '{"enable_thinking": false}') are read here too."""

from __future__ import annotations

import argparse
import json
from typing import TextIO

from moerun.text.reply import ReplyDelta, ReplyFormat

THINKING, DONE = "Thinking...\n", "\n...done thinking.\n\n"


def add_chat_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--chat-template-kwargs",
        metavar="JSON",
        default=None,
        help="variables for the chat template, as a JSON object, e.g. '{\"enable_thinking\": false}'",
    )
    parser.add_argument(
        "--hide-reasoning",
        action="store_true",
        help="a thinking model's reasoning is not shown (by default it is, before the answer)",
    )


def template_variables(args: argparse.Namespace) -> dict:
    """--chat-template-kwargs as a dict (checked: a JSON object)."""
    if args.chat_template_kwargs is None:
        return {}
    try:
        variables = json.loads(args.chat_template_kwargs)
    except ValueError as e:
        raise ValueError(f"--chat-template-kwargs is not JSON ({e}).") from None
    if not isinstance(variables, dict):
        raise ValueError("--chat-template-kwargs must be a JSON object, e.g. '{\"enable_thinking\": false}'.")
    return variables


class ReplyWriter:
    """One reply's tokens in; its answer written to `out` as it comes, its reasoning too unless
    `hide`. `reasoning` and `content` hold the whole of each once `finish()` has run."""

    def __init__(self, model, prompt: str, out: TextIO | None, hide: bool = False):
        fmt = ReplyFormat.of(model.tokenizer, model.config.model_type)
        self.parser = fmt.parser(prompt) if fmt.thinking or fmt.harmony else None
        self.out, self.hide = out, hide
        self.reasoning, self.content = "", ""
        self._thinking = False  # a "Thinking..." line is open

    def push(self, tokens: list) -> None:
        if self.parser is None:
            self._show(ReplyDelta(content="".join(t.text for t in tokens)))
        else:
            self._show(self.parser.push_tokens(tokens))

    def finish(self) -> None:
        if self.parser is not None:
            self._show(self.parser.finish())
        if self._thinking:  # the reply ended (or was stopped) while still reasoning
            self._write(DONE)
            self._thinking = False

    def _show(self, delta: ReplyDelta) -> None:
        self.reasoning += delta.reasoning
        self.content += delta.content
        if delta.reasoning and not self.hide:
            if not self._thinking:
                self._write(THINKING)
                self._thinking = True
            self._write(delta.reasoning)
        if delta.content:
            if self._thinking:
                self._write(DONE)
                self._thinking = False
            self._write(delta.content)

    def _write(self, text: str) -> None:
        if self.out is not None and text:
            self.out.write(text)
            self.out.flush()
