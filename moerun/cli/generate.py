"""`moerun generate`: a prompt in, the model's text streamed to stdout, the run's figures on stderr
(or one JSON record with --json), so the output can be piped. Ctrl-C stops it: the figures so far
are printed and the exit code is 130, as for any interrupted command."""

from __future__ import annotations

import argparse
import io
import json
import sys
from typing import TextIO

import moerun
from moerun.cli.common import (
    INTERRUPTED,
    add_generation_arguments,
    add_model_arguments,
    context_size,
    generation_options,
    json_schema_format,
    load_with_progress,
    read_text,
    serve_experts_for_rank_0,
    summary,
)
from moerun.cli.thinking import ReplyWriter, add_chat_arguments, template_variables


def add_parser(commands) -> None:
    generate = commands.add_parser("generate", help="generate text from a prompt, streamed to stdout")
    add_model_arguments(generate)
    source = generate.add_mutually_exclusive_group(required=True)
    source.add_argument("-p", "--prompt", help="the prompt text")
    source.add_argument("-f", "--file", help="read the prompt text from this file (- for stdin)")
    source.add_argument(
        "--prompt-ids", help="the prompt as comma-separated token ids, e.g. 1,2,3 (no tokenizer needed)"
    )
    source.add_argument(
        "--prompts-file",
        metavar="FILE",
        help="one prompt per line (- for stdin), run as one batch; each completion printed when all are done",
    )
    generate.add_argument(
        "--parallel",
        type=int,
        default=8,
        metavar="N",
        help="with --prompts-file: at most N sequences decode together, the next joining as one finishes",
    )
    add_generation_arguments(generate)
    constraint = generate.add_mutually_exclusive_group()
    constraint.add_argument(
        "--json-schema",
        metavar="FILE",
        help="the output must be JSON valid under the JSON schema in FILE (needs moerun[structured])",
    )
    constraint.add_argument(
        "--grammar",
        metavar="FILE",
        help="the output must match the grammar in FILE: llama.cpp's GBNF (root ::= ...) or "
        "llguidance's Lark (start: ...) (needs moerun[structured])",
    )
    generate.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    add_chat_arguments(generate)
    generate.add_argument(
        "--logprobs",
        type=int,
        default=0,
        metavar="N",
        help="with --json: each token's log-probability and the N likeliest alternatives",
    )
    generate.add_argument("--json", action="store_true", help="print one JSON record at the end instead")
    generate.set_defaults(run=run_generate)


def read_prompt(args: argparse.Namespace) -> str | list[int]:
    """--prompt, --file (- for stdin) or --prompt-ids -> the prompt text or ids."""
    if args.prompt_ids is not None:
        try:
            ids = [int(part) for part in args.prompt_ids.split(",")]
        except ValueError:
            raise ValueError(
                f"--prompt-ids takes comma-separated integers, e.g. 1,2,3, not {args.prompt_ids!r}."
            ) from None
        if not ids or min(ids) < 0:
            raise ValueError(f"--prompt-ids takes token ids >= 0, not {args.prompt_ids!r}.")
        return ids
    return args.prompt if args.file is None else read_text(args.file)


def _check_arguments(args: argparse.Namespace, err: TextIO) -> dict:
    options = generation_options(args, err)
    if args.logprobs < 0:
        raise ValueError(f"--logprobs must be >= 0, got {args.logprobs}.")
    if args.logprobs and not args.json:
        raise ValueError("--logprobs are reported in the --json record; add --json.")
    if args.system is not None and not args.chat:
        raise ValueError("--system is a message for the chat template; add --chat.")
    if (args.chat_template_kwargs is not None or args.hide_reasoning) and not args.chat:
        raise ValueError("--chat-template-kwargs and --hide-reasoning are for a chat; add --chat.")
    template_variables(args)
    if args.chat and args.prompt_ids is not None:
        raise ValueError("--chat renders a text prompt, --prompt-ids are already tokens; give one.")
    if args.parallel < 1:
        raise ValueError(f"--parallel must be >= 1, got {args.parallel}.")
    return dict(options, logprobs=args.logprobs, response_format=response_format(args))


def response_format(args: argparse.Namespace):
    """--json-schema FILE or --grammar FILE -> model.generate's `response_format` (None: neither)."""
    if args.json_schema is not None:
        return json_schema_format(args.json_schema)
    if args.grammar is not None:
        return moerun.Grammar.text(read_text(args.grammar, "--grammar"), f"--grammar {args.grammar}")
    return None


def _prompt_for_model(
    model, args: argparse.Namespace, prompt: str | list[int]
) -> tuple[list[int] | str, str | None]:
    """-> (what model.generate takes, the chat prompt's text where --chat renders one)"""
    if model.tokenizer is None and isinstance(prompt, str):
        raise ValueError(
            f"{args.model} has no tokenizer, so give the prompt as token ids (--prompt-ids 1,2,3)."
        )
    if not args.chat:
        return prompt, None
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
        {"role": "user", "content": prompt}
    ]
    text = model.tokenizer.render_chat(messages, **template_variables(args))
    return model.tokenizer.encode(text, add_special_tokens=False), text


def _reply(model, args: argparse.Namespace, chat_text: str | None, out: TextIO | None) -> ReplyWriter | None:
    """A chat reply's writer (its reasoning apart from its answer), or None: not a chat."""
    return ReplyWriter(model, chat_text, out, hide=args.hide_reasoning) if chat_text is not None else None


def read_prompts(path: str) -> list[str]:
    """--prompts-file: its non-empty lines, each one prompt."""
    prompts = [line for line in read_text(path, "--prompts-file").splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"--prompts-file {path}: no prompts (one per line).")
    return prompts


def run_generate(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    out, err = out or sys.stdout, err or sys.stderr
    options = _check_arguments(args, err)
    if (status := serve_experts_for_rank_0(args)) is not None:
        return status
    if args.prompts_file is not None:
        return _run_batch(args, read_prompts(args.prompts_file), options, out, err)
    prompt = read_prompt(args)
    model = load_with_progress(args, err)
    options["ctx_size"] = context_size(args, model)
    ids, chat_text = _prompt_for_model(model, args, prompt)
    reply = _reply(model, args, chat_text, None if args.json else out)
    tokens = model.generate(ids, **options)
    generated = []
    try:
        for token in tokens:
            generated.append(token)
            if reply is not None:
                reply.push([token])
            elif not args.json:
                out.write(token.text)
                out.flush()
        code = 0
    except KeyboardInterrupt:
        tokens.close()
        code = INTERRUPTED
    if reply is not None:
        reply.finish()
    stats = model.stats()
    if code == INTERRUPTED:
        stats["finish_reason"] = "interrupted"
    if args.json:
        out.write(json.dumps(_record(model, generated, stats, args.logprobs, reply)) + "\n")
    else:
        out.write("\n")
        err.write(("[stopped] " if code == INTERRUPTED else "") + summary(stats) + "\n")
    return code


def _run_batch(args: argparse.Namespace, prompts: list[str], options: dict, out: TextIO, err: TextIO) -> int:
    """--prompts-file: every prompt in one batch; each completion after a header line (or one JSON
    record per prompt, in order, with --json); the batch's figures on stderr."""
    model = load_with_progress(args, err)
    options["ctx_size"] = context_size(args, model)
    inputs = [_prompt_for_model(model, args, p) for p in prompts]
    outputs = model.generate([ids for ids, _ in inputs], parallel=args.parallel, **options)
    stats = model.stats()
    for i, (tokens, own) in enumerate(zip(outputs, stats["sequences"], strict=True)):
        shown = io.StringIO()
        reply = _reply(model, args, inputs[i][1], shown)
        if reply is not None:
            reply.push(tokens)
            reply.finish()
        if args.json:
            out.write(json.dumps({"index": i, **_record(model, tokens, own, args.logprobs, reply)}) + "\n")
        else:
            out.write(f"=== prompt {i + 1}/{len(prompts)} ({own['finish_reason']}) ===\n")
            out.write((shown.getvalue() if reply is not None else "".join(t.text for t in tokens)) + "\n")
    err.write(
        f"batch of {len(prompts)} prompts ({args.parallel} at once): {stats['prompt_tokens']} prompt tokens, "
        f"generated {stats['new_tokens']} tokens in {stats['steps']} steps, "
        f"{stats['seconds']:.2f} s ({stats['tok_s']:.1f} tok/s)\n"
    )
    return 0


def _record(model, tokens: list, stats: dict, logprobs: int, reply: ReplyWriter | None = None) -> dict:
    """The --json record; a chat reply's answer (`content`) and reasoning (`reasoning_content`, where
    the model thought) apart as well, as the server's message has them."""
    record = {
        "text": "".join(t.text for t in tokens),
        "ids": [t.id for t in tokens],
        "finish_reason": stats["finish_reason"],
        "stats": stats,
    }
    if reply is not None:
        record["content"] = reply.content
        if reply.reasoning:
            record["reasoning_content"] = reply.reasoning
    if logprobs:
        name = model.tokenizer.id_to_token if model.tokenizer else str
        record["logprobs"] = [
            {
                "id": t.id,
                "token": name(t.id),
                "logprob": t.logprob,
                "top_logprobs": [{"id": i, "token": name(i), "logprob": lp} for i, lp in t.top_logprobs],
            }
            for t in tokens
        ]
    return record
