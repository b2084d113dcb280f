"""`moerun generate`: a prompt in, the model's text streamed to stdout, the run's figures on stderr
(or one JSON record with --json), so the output can be piped."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TextIO

from moerun.cli.common import add_model_arguments, load_with_progress, sampling_options, summary


def add_parser(commands) -> None:
    generate = commands.add_parser("generate", help="generate text from a prompt, streamed to stdout")
    add_model_arguments(generate)
    generate.add_argument("--prompt", required=True)
    generate.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    generate.add_argument("--json", action="store_true", help="print one JSON record at the end instead")
    generate.set_defaults(run=run_generate)


def _prompt_ids(model, args: argparse.Namespace, text: str) -> list[int] | str:
    if not args.chat:
        return text
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
        {"role": "user", "content": text}
    ]
    if model.tokenizer is None:
        raise ValueError(f"{args.model} has no tokenizer, so --chat cannot render a chat prompt.")
    return model.tokenizer.encode_chat(messages)


def run_generate(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    out, err = out or sys.stdout, err or sys.stderr
    model = load_with_progress(args, err)
    prompt = _prompt_ids(model, args, args.prompt)
    texts, ids = [], []
    for token in model.generate(prompt, max_new_tokens=args.max_tokens, **sampling_options(args)):
        ids.append(token.id)
        texts.append(token.text)
        if not args.json:
            out.write(token.text)
            out.flush()
    stats = model.stats()
    if args.json:
        out.write(json.dumps({"text": "".join(texts), "ids": ids, "stats": stats}) + "\n")
    else:
        out.write("\n")
        err.write(summary(stats) + "\n")
    return 0
