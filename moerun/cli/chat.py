"""`moerun chat`: a conversation in the model's own chat template. Ctrl-C stops the reply being
written (the part already written stays in the conversation); Ctrl-D or /exit ends the session. Each
turn prefills only what is new (generate's reuse_prefix)."""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable
from typing import TextIO

from moerun.cli.common import add_model_arguments, load_with_progress, sampling_options, summary


def add_parser(commands) -> None:
    chat = commands.add_parser("chat", help="a conversation with the model's own chat template")
    add_model_arguments(chat)
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
    model.tokenizer.render_chat([{"role": "user", "content": ""}])  # no template: say so now, not later
    messages = [{"role": "system", "content": args.system}] if args.system else []
    err.write("moerun chat: Ctrl-C stops a reply, Ctrl-D or /exit quits.\n")
    while True:
        try:
            line = read("> ")
        except EOFError:
            out.write("\n")
            return 0
        except KeyboardInterrupt:
            out.write("\n")
            continue
        if line.strip() in ("/exit", "/quit"):
            return 0
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        reply = []
        try:
            prompt = model.tokenizer.encode_chat(messages)
            # each turn repeats the conversation: only what is new since the last turn is prefilled
            for token in model.generate(
                prompt, max_new_tokens=args.max_tokens, reuse_prefix=True, **sampling_options(args)
            ):
                reply.append(token.text)
                out.write(token.text)
                out.flush()
        except KeyboardInterrupt:
            err.write("\n[stopped]")
        out.write("\n")
        messages.append({"role": "assistant", "content": "".join(reply)})
        err.write(f"({summary(model.stats())})\n")


def chat_command(args: argparse.Namespace) -> int:
    with contextlib.suppress(ImportError):  # not on every platform
        import readline  # noqa: F401  line editing and history for input()
    return run_chat(load_with_progress(args), args)
