"""What the model commands share: the flags for loading a model and for generating, their values
checked before anything loads, loading with a progress bar on stderr, and the one-line summary of a
run's figures."""

from __future__ import annotations

import argparse
import io
import json
import sys
import time
from pathlib import Path
from typing import TextIO

import torch

from moerun.moe.backends import BACKENDS
from moerun.quant.formats import COMPUTE_DTYPES
from moerun.sampling import SamplingParams, check_sampling
from moerun.settings import settings as _settings

INTERRUPTED = 130  # exit code: 128 + SIGINT, what a shell reports for a command stopped by Ctrl-C
ACTIVATION_MODES = {"auto": None, "int8": True, "exact": False}  # --activations -> int8_activations
# SamplingParams field -> its flag
SAMPLING_FLAGS = {
    "temperature": "--temperature",
    "top_k": "--top-k",
    "top_p": "--top-p",
    "min_p": "--min-p",
    "repetition_penalty": "--repeat-penalty",
    "presence_penalty": "--presence-penalty",
    "frequency_penalty": "--frequency-penalty",
    "seed": "--seed",
}


class HelpFormatter(argparse.HelpFormatter):
    """argparse's help with each flag's default appended, where it has one worth showing."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        shown = action.option_strings and not (default is None or default is False or default == [])
        shown = shown and default != argparse.SUPPRESS
        if shown and "%(default)" not in text and "default" not in text:
            text += " (default: %(default)s)"
        return text


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags that say which model to load and how."""
    parser.add_argument(
        "-m", "--model", required=True, help="HF checkpoint directory, .gguf file or cached hub id"
    )
    parser.add_argument("--dtype", choices=sorted(COMPUTE_DTYPES), default="bf16", help="compute dtype")
    parser.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available)")
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
    add_threads_argument(parser)
    parser.add_argument(
        "--no-warmup",
        action="store_true",
        help="skip the warm-up step after loading (kernels compiled on first use would then be timed)",
    )
    add_memory_argument(parser)
    parser.add_argument(
        "--expert-cache-gb",
        type=float,
        default=None,
        help="stream experts through a cache of this many GB instead of holding them all "
        "(default: chosen from the memory moerun may use)",
    )
    parser.add_argument(
        "--prefetch-k", type=int, default=None, help="with --expert-cache-gb: experts to prefetch"
    )
    parser.add_argument(
        "--expert-parallel",
        action="store_true",
        help="hold only this rank's share of the experts (on by itself under torchrun with WORLD_SIZE > 1)",
    )
    parser.add_argument(
        "--host-cache-gb",
        type=float,
        default=0.0,
        help="with --expert-cache-gb: keep this many GB of recently read experts in host RAM",
    )


def add_memory_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--memory-gb",
        type=float,
        default=None,
        help="memory the process may use in all (on CUDA: of the GPU); the model stays resident if it fits, "
        "else its experts are streamed through a cache of what is left (default: the memory cgroup's "
        "limit or MemAvailable; on CUDA the free GPU memory)",
    )


def check_memory_argument(args: argparse.Namespace) -> None:
    if args.memory_gb is not None and not args.memory_gb > 0:
        raise ValueError(f"--memory-gb must be > 0, got {args.memory_gb}.")
    if args.memory_gb is not None and getattr(args, "expert_cache_gb", None) is not None:
        raise ValueError(
            "give --memory-gb or --expert-cache-gb, not both: --memory-gb chooses the expert cache."
        )


def add_threads_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-t", "--threads", type=int, default=None, help="CPU threads (default: torch's, one per core)"
    )


def add_generation_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags that say how to generate: length, context, sampling, stop strings."""
    parser.add_argument(
        "-n",
        "--max-tokens",
        type=int,
        default=256,
        help="new tokens at most; -1: until EOS or the context ends",
    )
    add_ctx_size_argument(parser)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy; > 0: sample")
    parser.add_argument(
        "--top-k", type=int, default=0, help="with --temperature: sample from the k likeliest (0: off)"
    )
    parser.add_argument(
        "--top-p", type=float, default=1.0, help="with --temperature: nucleus sampling (1: off)"
    )
    parser.add_argument(
        "--min-p",
        type=float,
        default=0.0,
        help="with --temperature: drop tokens below min-p x the likeliest's (0: off)",
    )
    parser.add_argument(
        "--repeat-penalty", type=float, default=1.0, help="> 1 discourages tokens already seen (1: off)"
    )
    parser.add_argument(
        "--presence-penalty", type=float, default=0.0, help="subtracted from tokens already output (0: off)"
    )
    parser.add_argument(
        "--frequency-penalty",
        type=float,
        default=0.0,
        help="subtracted once per time a token was already output (0: off)",
    )
    parser.add_argument("--seed", type=int, default=None, help="with --temperature: same seed, same text")
    parser.add_argument("--stop", action="append", default=[], help="stop before this text (repeatable)")
    parser.add_argument("--system", default=None, help="a system message for the chat template")


def add_ctx_size_argument(
    parser: argparse.ArgumentParser,
    default: int | None = None,
    what: str = "positions per sequence, prompt included",
) -> None:
    """-c/--ctx-size, for every command that has it. `default` None: the model's context; a number:
    that many positions, or the model's context where it is shorter. A value given is checked
    against the model's context once the model is loaded (`context_size`), never cut to it."""
    shown = "the model's context" if default is None else f"{default}, or the model's context if shorter"
    parser.add_argument("-c", "--ctx-size", type=int, default=None, help=f"{what} (default: {shown})")
    parser.set_defaults(ctx_size_default=default)


def context_size(args: argparse.Namespace, model) -> int:
    """--ctx-size for `model`: its value checked against the model's context (a ValueError naming
    both numbers), or the command's default where none was given."""
    longest, given, default = model.config.max_positions, args.ctx_size, args.ctx_size_default
    if given is None:
        return longest if default is None else min(default, longest)
    if not 1 <= given <= longest:
        raise ValueError(
            f"--ctx-size must be between 1 and this model's context of {longest} positions, got {given}."
        )
    return given


def read_text(path: str, flag: str = "--file") -> str:
    """The UTF-8 text of the file a flag names (- for stdin)."""
    if path == "-":
        return sys.stdin.read()
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except UnicodeDecodeError:
        raise ValueError(f"{flag} {path}: not UTF-8 text.") from None


def json_schema_format(path: str) -> dict:
    """--json-schema FILE -> the OpenAI `response_format` asking for JSON valid under it."""
    text = read_text(path, "--json-schema")
    try:
        schema = json.loads(text)
    except ValueError as e:
        raise ValueError(f"--json-schema {path}: not JSON ({e}).") from None
    if not isinstance(schema, dict):
        raise ValueError(f"--json-schema {path}: a JSON schema is an object.")
    return {"type": "json_schema", "json_schema": {"name": Path(path).stem, "schema": schema}}


def resolve_device(name: str | None) -> str:
    """--device -> a device torch can use here, or a ValueError saying why not."""
    if name is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        device = None
    if device is None or device.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {name}: moerun runs on cpu or cuda (cuda:N for one GPU of several).")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: no CUDA GPU is available to this torch build; use --device cpu.")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"--device {name}: there are {torch.cuda.device_count()} CUDA devices here.")
    return name


def check_model_arguments(args: argparse.Namespace) -> None:
    """The loading flags' values, checked before anything loads (a ValueError naming the flag)."""
    args.device = resolve_device(args.device)
    check_threads(args)
    if args.expert_cache_gb is not None and not args.expert_cache_gb > 0:
        raise ValueError(f"--expert-cache-gb must be > 0, got {args.expert_cache_gb}.")
    check_memory_argument(args)
    if args.prefetch_k is not None and args.prefetch_k < 0:
        raise ValueError(f"--prefetch-k must be >= 0, got {args.prefetch_k}.")
    if not args.host_cache_gb >= 0:
        raise ValueError(f"--host-cache-gb must be >= 0, got {args.host_cache_gb}.")
    # the part of --ctx-size's check that needs no model, so a big one is not loaded to learn it
    if getattr(args, "ctx_size", None) is not None and args.ctx_size < 1:
        raise ValueError(f"--ctx-size must be >= 1, got {args.ctx_size}.")


def check_threads(args: argparse.Namespace) -> None:
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}.")


def use_threads(args: argparse.Namespace) -> None:
    if args.threads is not None:
        torch.set_num_threads(args.threads)


def generation_options(args: argparse.Namespace, err: TextIO) -> dict:
    """The generation flags as model.generate's keyword options, checked before anything loads
    (a ValueError naming the flag); flags greedy decoding does not use are named on `err`. The
    context is not among them: it needs the model (`context_size`)."""
    if args.max_tokens < -1:
        raise ValueError(f"--max-tokens must be >= 0, or -1 for no limit, got {args.max_tokens}.")
    sampling = {field: getattr(args, flag[2:].replace("-", "_")) for field, flag in SAMPLING_FLAGS.items()}
    check_sampling(sampling, SAMPLING_FLAGS)
    if unused := SamplingParams(**sampling).unused():
        flags = ", ".join(SAMPLING_FLAGS[name] for name in unused)
        err.write(
            f"moerun {args.command}: {flags} {'applies' if len(unused) == 1 else 'apply'} only when "
            "sampling; add --temperature (> 0) to sample.\n"
        )
    return dict(sampling, stop=args.stop, max_new_tokens=args.max_tokens)


def expert_parallel(args: argparse.Namespace) -> bool:
    """--expert-parallel, or started under torchrun with more than one process."""
    return bool(getattr(args, "expert_parallel", False)) or _settings().world_size > 1


def serve_experts_for_rank_0(args: argparse.Namespace) -> int | None:
    """Expert parallelism, every rank but 0: load this rank's share of the experts and compute them
    for rank 0's forward passes until rank 0's command ends -> 0 then. None on rank 0, or without
    expert parallelism: the command runs there (rank 0 alone prints, serves, measures)."""
    if not expert_parallel(args) or _settings().rank == 0:
        return None
    load_with_progress(args).serve_experts()
    return 0


def load_with_progress(args: argparse.Namespace, err: TextIO | None = None):
    """moerun.load with the loading flags, a progress bar on `err` when it is a terminal (one line
    when it is a file or pipe)."""
    import moerun

    err = err or sys.stderr
    other_rank = expert_parallel(args) and _settings().rank != 0
    if other_rank:  # rank 0 alone reports
        err = io.StringIO()
    check_model_arguments(args)
    use_threads(args)
    start = time.perf_counter()
    terminal = err.isatty()

    def progress(done: int, total: int) -> None:
        width = 30
        filled = width * (done + 1) // total
        err.write(f"\rloading {args.model} [{'#' * filled}{' ' * (width - filled)}] layer {done + 1}/{total}")
        err.flush()

    model = moerun.load(
        args.model,
        device=args.device,
        dtype=COMPUTE_DTYPES[args.dtype],
        backend=args.backend,
        expert_cache_gb=args.expert_cache_gb,
        prefetch_k=args.prefetch_k,
        host_cache_gb=args.host_cache_gb,
        progress=progress if terminal else None,
        int8_activations=ACTIVATION_MODES[args.activations],
        expert_parallel=expert_parallel(args),
        memory_gb=args.memory_gb,
    )
    erase = "\r" if terminal else ""
    err.write(
        f"{erase}loaded {args.model} in {time.perf_counter() - start:.1f} s{' ' * 40 if terminal else ''}\n"
    )
    if not args.no_warmup and not other_rank:  # rank 0's warm-up passes warm the others too
        start = time.perf_counter()
        model.warm_up()  # kernels that compile on first use do it here, not in the timed run
        if (seconds := time.perf_counter() - start) >= 0.5:
            err.write(f"warmed up in {seconds:.1f} s\n")
    return model


def _ways(reads: dict | None) -> str:
    """How the expert reads went: " by 12 O_DIRECT and 0 pread reads"."""
    if not reads:
        return ""
    return f" by {reads['direct']} O_DIRECT and {reads['pread']} pread reads"


def summary(stats: dict) -> str:
    parts = [f"prompt {stats.get('prompt_tokens', 0)} tokens"]
    if stats.get("reused_tokens"):
        parts[-1] += f", {stats['reused_tokens']} reused"
    if "prefill_tok_s" in stats:
        parts[-1] += f" ({stats['prefill_tok_s']:.1f} tok/s prefill)"
    parts.append(f"generated {stats.get('new_tokens', 0)} tokens")
    if "decode_tok_s" in stats:
        parts[-1] += f" ({stats['decode_tok_s']:.1f} tok/s decode)"
    if ep := stats.get("expert_parallel"):
        parts.append(
            f"expert parallel: {ep['placement']}; {ep['steps']} steps, {ep['exchanges']} {ep['collective']} "
            f"exchanges of expert rows ({ep['sent_bytes'] / 2**20:.1f} MiB sent, "
            f"{ep.get('received_bytes', 0) / 2**20:.1f} MiB received, {ep['exchange_ms']:.0f} ms) "
            f"beside {ep['expert_ms']:.0f} ms on its own experts"
        )
        if ep.get("rss_mb") is not None:
            parts[-1] += f", {ep['rss_mb']:.0f} MiB resident"
    if stats.get("finish_reason") == "context":
        parts.append(f"stopped: the context of {stats['context']} positions is full")
    if offload := stats.get("offload"):
        t = offload["total"]
        requests = t["hits"] + t["misses"]
        parts.append(
            f"experts: {offload['slots']} slots ({offload['cache_bytes'] / 2**30:.2f} GiB), "
            f"hit rate {t['hits'] / max(requests, 1):.0%} ({t['misses']} misses, "
            f"{t['bytes_read'] / 2**20:.0f} MiB read{_ways(offload.get('reads'))}), "
            f"route {t['route_ms']:.0f} ms, "
            f"fetch {t['fetch_ms']:.0f} ms, compute {t['compute_ms']:.0f} ms, "
            f"prefetch {t['prefetch_used']}/{t['prefetch_issued']} used"
        )
    return ", ".join(parts)
