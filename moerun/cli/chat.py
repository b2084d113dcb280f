"""`moerun chat`: a conversation in the model's own chat template. Ctrl-C stops the reply being
written (the part already written stays in the conversation); Ctrl-D or /exit ends the session;
/reset starts over. When the conversation outgrows the context, the oldest turns are dropped (and
the user told) so it keeps going. Each turn prefills only what is new (generate's reuse_prefix)."""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable
from typing import TextIO

from moerun.cli.common import (
    add_generation_arguments,
    add_model_arguments,
    context_size,
    generation_options,
    load_with_progress,
    serve_experts_for_rank_0,
    summary,
)
from moerun.cli.thinking import ReplyWriter, add_chat_arguments, template_variables

COMMANDS = {
    "/help": "this list",
    "/reset": "forget the conversation (the system message stays); also /clear",
    "/exit": "end the session; also /quit or Ctrl-D",
}


def add_parser(commands) -> None:
    chat = commands.add_parser("chat", help="a conversation with the model's own chat template")
    add_model_arguments(chat)
    add_generation_arguments(chat)
    add_chat_arguments(chat)
    chat.set_defaults(run=chat_command)


def run_chat(
    model,
    args: argparse.Namespace,
    read: Callable[[str], str] = input,
    out: TextIO | None = None,
    err: TextIO | None = None,
) -> int:
    """The conversation loop; `read(prompt)` returns a line, raising EOFError at the end."""
    out, err = out or sys.stdout, err or sys.stderr
    if model.tokenizer is None:
        raise ValueError(f"{args.model} has no tokenizer, so it cannot chat; use `moerun generate` with ids.")
    variables = template_variables(args)
    model.tokenizer.render_chat([{"role": "user", "content": ""}])  # no template: say so now, not later
    context = context_size(args, model)
    options = dict(generation_options(args, err), ctx_size=context)
    # positions kept free for a reply when old turns are dropped
    room = max(1, min(context // 2, context if options["max_new_tokens"] < 0 else options["max_new_tokens"]))
    system = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(system)
    err.write("moerun chat: Ctrl-C stops a reply, Ctrl-D or /exit quits, /help lists the commands.\n")
    while True:
        try:
            line = read("> ")
        except EOFError:
            out.write("\n")
            return 0
        except KeyboardInterrupt:
            out.write("\n")
            continue
        command = line.strip()
        if command in ("/exit", "/quit"):
            return 0
        if command == "/help":
            err.write("".join(f"  {name:8} {what}\n" for name, what in COMMANDS.items()))
            continue
        if command in ("/reset", "/clear"):
            messages = list(system)
            err.write("[the conversation is reset]\n")
            continue
        if not command:
            continue
        messages.append({"role": "user", "content": line})
        prompt = _fit(model, messages, len(system), context - room, err, variables)
        if prompt is None:
            messages.pop()
            continue
        text, ids = prompt
        reply = ReplyWriter(model, text, out, hide=args.hide_reasoning)
        try:
            # each turn repeats the conversation: only what is new since the last turn is prefilled
            for token in model.generate(ids, reuse_prefix=True, **options):
                reply.push([token])
        except KeyboardInterrupt:
            err.write("\n[stopped]")
        reply.finish()
        out.write("\n")
        answer = {"role": "assistant", "content": reply.content}
        messages.append({**answer, "reasoning_content": reply.reasoning} if reply.reasoning else answer)
        stats = model.stats()
        err.write(f"({summary(stats)})\n")


def _fit(
    model, messages: list[dict], kept: int, limit: int, err: TextIO, variables: dict
) -> tuple[str, list[int]] | None:
    """The conversation's prompt (text, ids), its oldest turns after the first `kept` messages
    dropped (in place) until its ids are at most `limit`; None (said on `err`) when the last message
    alone is too long. `variables`: the chat template's (--chat-template-kwargs)."""

    def render() -> tuple[str, list[int]]:
        text = model.tokenizer.render_chat(messages, **variables)
        return text, model.tokenizer.encode(text, add_special_tokens=False)

    text, prompt = render()
    dropped = 0
    while len(prompt) > limit and len(messages) > kept + 1:
        del messages[kept]  # the oldest message; a user turn with its reply
        if len(messages) > kept + 1 and messages[kept]["role"] == "assistant":
            del messages[kept]
        dropped += 1
        text, prompt = render()
    if len(prompt) > limit:
        err.write(f"[that message is {len(prompt)} tokens with the template, more than the context allows]\n")
        return None
    if dropped:
        err.write(f"[the context is full: the oldest {dropped} turn{'s' if dropped > 1 else ''} dropped]\n")
    return text, prompt


def chat_command(args: argparse.Namespace) -> int:
    generation_options(args, sys.stderr)  # the flags' values, checked before the model loads
    template_variables(args)
    if (status := serve_experts_for_rank_0(args)) is not None:
        return status
    with contextlib.suppress(ImportError):  # not on every platform
        import readline  # noqa: F401  line editing and history for input()
    return run_chat(load_with_progress(args), args)
