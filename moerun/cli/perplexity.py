"""`moerun perplexity`: a model's perplexity over a text file (moerun.perplexity), with progress on
stderr and the result on stdout (or one JSON record). By default it counts as llama.cpp's
`llama-perplexity` does (side-by-side chunks of --ctx-size, the second half of each scored, BOS first
where the tokenizer adds one): the same number on the same file; `--stride N` counts in sliding
windows instead (transformers' guide)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TextIO

from moerun.cli.common import (
    add_ctx_size_argument,
    add_model_arguments,
    context_size,
    load_with_progress,
    read_text,
    serve_experts_for_rank_0,
)


def add_parser(commands) -> None:
    command = commands.add_parser("perplexity", help="a model's perplexity over a text file")
    add_model_arguments(command)
    command.add_argument("-f", "--file", required=True, help="the text to score (- for stdin)")
    add_ctx_size_argument(command, 512, "tokens per chunk or window")
    command.add_argument(
        "--stride",
        type=int,
        default=None,
        help="score in sliding windows this many tokens apart, as transformers' guide does (default: "
        "llama-perplexity's chunks, the second half of each scored)",
    )
    command.add_argument(
        "--chunks", type=int, default=None, help="score only the first N chunks (llama-perplexity's --chunks)"
    )
    command.add_argument("--json", action="store_true", help="print one JSON object")
    command.set_defaults(run=run)


def run(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    from moerun.perplexity import perplexity

    out, err = out or sys.stdout, err or sys.stderr
    if args.stride is not None and not 0 < args.stride <= (args.ctx_size or args.stride):
        raise ValueError(f"--stride must be in [1, --ctx-size], got {args.stride}.")
    if args.chunks is not None and (args.chunks < 1 or args.stride is not None):
        raise ValueError(f"--chunks must be >= 1 and without --stride, got {args.chunks}.")
    if (status := serve_experts_for_rank_0(args)) is not None:  # rank 0 alone reads the text
        return status
    text = read_text(args.file)
    model = load_with_progress(args, err)
    if model.tokenizer is None:
        raise ValueError(f"{args.model} has no tokenizer, so it cannot score a text file.")
    ctx_size = context_size(args, model)
    if args.stride is not None and args.stride > ctx_size:
        raise ValueError(f"--stride must be in [1, --ctx-size={ctx_size}], got {args.stride}.")

    def progress(done: int, total: int, so_far: float) -> None:
        if not args.json:
            err.write(f"[{done}/{total}] perplexity so far {so_far:.4f}\n")
            err.flush()

    tokenizer = model.tokenizer
    adds_bos = tokenizer.bos_id is not None and tokenizer.encode("")[:1] == [tokenizer.bos_id]
    bos = tokenizer.bos_id if adds_bos else None  # llama.cpp: each chunk begins with BOS if add_bos
    ids = tokenizer.encode(text)
    result = perplexity(model, ids, ctx_size, args.stride, progress, bos=bos, max_chunks=args.chunks)
    if args.json:
        out.write(json.dumps(result) + "\n")
    elif result["method"] == "chunks":
        out.write(
            f"perplexity {result['perplexity']:.4f} over {result['tokens']} tokens "
            f"({result['windows']} chunk{'s' * (result['windows'] != 1)} of {result['ctx_size']}, "
            "the second half of each scored, "
            f"as llama-perplexity; {result['tok_s']:.1f} tok/s)\n"
        )
    else:
        out.write(
            f"perplexity {result['perplexity']:.4f} over {result['tokens']} tokens "
            f"({result['windows']} windows of {result['ctx_size']}, stride {result['stride']}; "
            f"{result['tok_s']:.1f} tok/s)\n"
        )
    return 0
