"""What `generate` and `chat` share: the model and sampling options, loading with a progress bar on
stderr, and the one-line summary of a run's figures."""

from __future__ import annotations

import argparse
import sys
import time
from typing import TextIO

import torch

from moerun.moe.backends import BACKENDS
from moerun.quant.formats import COMPUTE_DTYPES

ACTIVATION_MODES = {"auto": None, "int8": True, "exact": False}  # --activations -> int8_activations


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="HF checkpoint directory, .gguf file or cached hub id")
    parser.add_argument("--dtype", choices=sorted(COMPUTE_DTYPES), default="bf16")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    parser.add_argument(
        "--backend",
        choices=BACKENDS,
        default="auto",
        help="kernels: auto picks triton on CUDA, cpu (native kernels) on a CPU where they run, else torch",
    )
    parser.add_argument(
        "--activations",
        choices=sorted(ACTIVATION_MODES),
        default="auto",
        help="int8: activations quantised per block for integer dot products, as llama.cpp does; exact: "
        "fp32 activations (within 1e-4 of the reference); auto: int8 for bf16/f16, exact for fp32",
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


def sampling_options(args: argparse.Namespace) -> dict:
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
        dtype=COMPUTE_DTYPES[args.dtype],
        backend=args.backend,
        expert_cache_gb=getattr(args, "expert_cache_gb", None),
        prefetch_k=getattr(args, "prefetch_k", None),
        host_cache_gb=getattr(args, "host_cache_gb", 0.0),
        progress=progress,
        int8_activations=ACTIVATION_MODES[getattr(args, "activations", "auto")],
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
