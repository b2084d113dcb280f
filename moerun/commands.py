"""`moerun generate` and `moerun chat`: text in, streamed text out, with the run's figures at the end.

Both load the model with a progress bar on stderr; the text goes to stdout and everything else to
stderr, so the output can be piped. In `chat`, Ctrl-C stops the reply being written (the part
already written stays in the conversation) and Ctrl-D or /exit ends the session."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Callable
from typing import TextIO

import torch

DTYPES = {"bf16": torch.bfloat16, "f16": torch.float16, "fp32": torch.float32}


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="HF checkpoint directory, .gguf file or cached hub id")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument(
        "--backend",
        choices=["auto", "torch", "triton"],
        default="auto",
        help="expert kernels: auto picks triton on CUDA, torch elsewhere",
    )
    parser.add_argument("--max-tokens", type=int, default=256, help="new tokens at most (default 256)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--min-p", type=float, default=0.0)
    parser.add_argument("--repeat-penalty", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None, help="same seed, same text")
    parser.add_argument("--stop", action="append", default=[], help="stop before this text (repeatable)")
    parser.add_argument("--system", default=None, help="a system message for the chat template")
    parser.add_argument(
        "--expert-cache-gb",
        type=float,
        default=None,
        help="stream experts through a cache of this many GB instead of holding them all",
    )
    parser.add_argument(
        "--prefetch-k", type=int, default=None, help="with --expert-cache-gb: experts to prefetch"
    )
    parser.add_argument(
        "--host-cache-gb",
        type=float,
        default=0.0,
        help="with --expert-cache-gb: keep this many GB of recently read experts in host RAM",
    )


def _sampling(args: argparse.Namespace) -> dict:
    return dict(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repetition_penalty=args.repeat_penalty,
        seed=args.seed,
        stop=args.stop,
    )


def load_with_progress(args: argparse.Namespace, err: TextIO | None = None):
    import moerun

    err = err or sys.stderr
    start = time.perf_counter()

    def progress(done: int, total: int) -> None:
        width = 30
        filled = width * (done + 1) // total
        err.write(f"\rloading {args.model} [{'#' * filled}{' ' * (width - filled)}] layer {done + 1}/{total}")
        err.flush()

    model = moerun.load(
        args.model,
        device=args.device or ("cuda" if torch.cuda.is_available() else "cpu"),
        dtype=DTYPES[args.dtype],
        backend=args.backend,
        expert_cache_gb=getattr(args, "expert_cache_gb", None),
        prefetch_k=getattr(args, "prefetch_k", None),
        host_cache_gb=getattr(args, "host_cache_gb", 0.0),
        progress=progress,
    )
    err.write(f"\rloaded {args.model} in {time.perf_counter() - start:.1f} s{' ' * 40}\n")
    return model


def summary(stats: dict) -> str:
    parts = [f"prompt {stats.get('prompt_tokens', 0)} tokens"]
    if stats.get("reused_tokens"):
        parts[-1] += f", {stats['reused_tokens']} reused"
    if "prefill_tok_s" in stats:
        parts[-1] += f" ({stats['prefill_tok_s']:.1f} tok/s prefill)"
    parts.append(f"generated {stats.get('new_tokens', 0)} tokens")
    if "decode_tok_s" in stats:
        parts[-1] += f" ({stats['decode_tok_s']:.1f} tok/s decode)"
    if offload := stats.get("offload"):
        t = offload["total"]
        requests = t["hits"] + t["misses"]
        parts.append(
            f"experts: {offload['slots']} slots ({offload['cache_bytes'] / 2**30:.2f} GiB), "
            f"hit rate {t['hits'] / max(requests, 1):.0%} ({t['misses']} misses, "
            f"{t['bytes_read'] / 2**20:.0f} MiB read), route {t['route_ms']:.0f} ms, "
            f"fetch {t['fetch_ms']:.0f} ms, compute {t['compute_ms']:.0f} ms, "
            f"prefetch {t['prefetch_used']}/{t['prefetch_issued']} used"
        )
    return ", ".join(parts)


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
    for token in model.generate(prompt, max_new_tokens=args.max_tokens, **_sampling(args)):
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
                prompt, max_new_tokens=args.max_tokens, reuse_prefix=True, **_sampling(args)
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
