"""`moerun bench`: one MoE layer with a real model's shapes against transformers' block (the
default), a whole generated model (--model), a checkpoint (--model PATH, with --peer llama.cpp on a
GGUF file; with --memory-limit-gb each engine alone under that memory limit), expert streaming
(--offload), batched generation (--model --batch), the HTTP server (--serve) or expert parallelism
(--model --expert-parallel); a table or --json. MODES says which flags pick which benchmark."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import replace

from moerun.benchmarks import BenchSettings
from moerun.cli.common import (
    add_memory_argument,
    add_threads_argument,
    check_memory_argument,
    check_threads,
    expert_parallel,
    json_schema_format,
    resolve_device,
    use_threads,
)
from moerun.moe.backends import BACKENDS
from moerun.quant.formats import COMPUTE_DTYPES


def add_parser(commands) -> None:
    bench = commands.add_parser("bench", help="benchmark one MoE layer with a real model's shapes")
    _add_measurement_flags(bench)
    _add_layer_flags(bench)
    _add_model_flags(bench)
    _add_memory_limit_flags(bench)
    bench.add_argument("--json", action="store_true", help="print one JSON object")
    bench.set_defaults(run=run)


def _add_measurement_flags(bench: argparse.ArgumentParser) -> None:
    """What every mode measures with (and the layer mode's --shape)."""
    from moerun.benchmarks.layer import SHAPES

    bench.add_argument("--shape", choices=sorted(SHAPES), default="olmoe", help="whose layer shapes to use")
    bench.add_argument("--dtype", choices=sorted(COMPUTE_DTYPES), default="bf16", help="compute dtype")
    bench.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    bench.add_argument("--backend", choices=BACKENDS, default="auto", help="auto: triton on CUDA")
    bench.add_argument(
        "--prefill-tokens", type=int, help="prefill prompt length (default 512; --model PATH: 256)"
    )
    bench.add_argument("--decode-steps", type=int, default=32, help="decode steps timed")
    add_threads_argument(bench)


def _add_layer_flags(bench: argparse.ArgumentParser) -> None:
    """The layer mode's: its peer, and the formats to quantise its experts to."""
    bench.add_argument(
        "--peer-impl",
        choices=["grouped_mm", "eager"],
        default="grouped_mm",
        help="transformers' experts implementation to compare with (its default: grouped_mm)",
    )
    bench.add_argument("--format", help="quantise every expert projection to FMT (e.g. q4_k, q8_0, mxfp4)")
    bench.add_argument("--formats", help="per projection, e.g. gate_up=q2_k,down=q3_k")
    bench.add_argument(
        "--dequant-cache-gb",
        type=float,
        default=0.0,
        help="with --format: keep up to this many GB of dequantised experts for prefill (default: off)",
    )
    bench.add_argument("--no-peer", action="store_true", help="skip transformers' block")


def _add_model_flags(bench: argparse.ArgumentParser) -> None:
    """The flags that pick the other modes (a checkpoint, a generated model, offload, batch, serve,
    expert parallelism) and their settings."""
    bench.add_argument(
        "-m",
        "--model",
        nargs="?",
        const="",
        default=None,
        metavar="PATH",
        help="a checkpoint (.gguf file or HF directory) moerun loads; without PATH, a whole generated "
        "OLMoE-shaped model against transformers' model (needs transformers)",
    )
    bench.add_argument(
        "--peer",
        choices=["llama.cpp"],
        help="with --model FILE.gguf: llama.cpp on the same file in the same run (needs llama-cpp-python). "
        "Where the CPU reports AMX but the VM does not enable it, llama.cpp's AMX path dies with a "
        'general protection fault on quantised files: build it without AMX, CMAKE_ARGS="-DGGML_NATIVE=OFF '
        "-DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX2=ON -DGGML_FMA=ON "
        '-DGGML_F16C=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" pip install '
        "llama-cpp-python",
    )
    bench.add_argument("--repeats", type=int, default=3, help="with --model: repetitions of each measurement")
    add_memory_argument(bench)
    bench.add_argument(
        "--offload",
        action="store_true",
        help="expert streaming on a generated OLMoE-shaped checkpoint: cache sizes, prefetch, resident",
    )
    bench.add_argument(
        "--layers", type=int, help="with --model: decoder layers (default 4); with --offload: default 2"
    )
    bench.add_argument(
        "--predictable",
        action="store_true",
        help="with --offload: routing the next layer's router predicts exactly (prefetch's best case)",
    )
    bench.add_argument(
        "--generated",
        choices=["olmoe", "deepseek-v2-lite"],
        default="olmoe",
        help="with --model (no PATH): whose shapes the generated model has",
    )
    bench.add_argument(
        "--batch",
        metavar="SIZES",
        help="with --model (generated): batched generation at these batch sizes, e.g. 1,4,8, against "
        "transformers' batched generate",
    )
    bench.add_argument(
        "--serve",
        metavar="CLIENTS",
        nargs="?",
        const="1,4,8",
        default=None,
        help="the HTTP server under this many concurrent streaming clients (default 1,4,8) on the "
        "generated OLMoE-shaped model",
    )
    bench.add_argument(
        "--json-schema",
        metavar="FILE",
        help="with --serve: each number of clients again with every request under this JSON schema "
        "(needs moerun[structured]); the table gives the grammar's share of the step time",
    )
    bench.add_argument(
        "--expert-parallel",
        action="store_true",
        help="under torchrun: the model's experts spread over the ranks (on by itself when WORLD_SIZE > 1); "
        "--model without a PATH: the generated model expert-parallel against one process",
    )


def _add_memory_limit_flags(bench: argparse.ArgumentParser) -> None:
    """The --memory-limit-gb mode's: the limit, llama.cpp's repacking, moerun's expert store."""
    bench.add_argument(
        "--memory-limit-gb",
        type=float,
        metavar="N",
        help="with --model FILE.gguf: each engine alone in a child memory cgroup of N GiB (moerun; with "
        "--peer llama.cpp, llama.cpp too), decoding varied tokens: tok/s, the expert store's hit rate, "
        "bytes read per token against the disk's sequential read, peak memory",
    )
    bench.add_argument(
        "--peer-repack",
        choices=["both", "on", "off"],
        default="both",
        help="with --memory-limit-gb: llama.cpp with its weight repacking on (its default), off (its "
        "--no-repack: weights used from its map of the file) or both",
    )
    bench.add_argument(
        "--expert-cache-gb",
        type=float,
        help="with --memory-limit-gb: moerun's expert cache (default: its choice)",
    )
    bench.add_argument("--host-cache-gb", type=float, help="with --memory-limit-gb: moerun's host tier")
    bench.add_argument("--prefetch-k", type=int, help="with --memory-limit-gb: moerun's prefetch")
    bench.add_argument(
        "--run-timeout-s",
        type=float,
        default=3600.0,
        help="with --memory-limit-gb: stop a run after this many seconds (its figures so far are kept)",
    )


# Each mode: (args, settings) -> (its figures, or None on a rank that does not report; the function
# that writes them as a table). Each imports its benchmark when it runs.
Figures = tuple[dict | None, Callable[[dict], str]]


def _checkpoint(args: argparse.Namespace, settings: BenchSettings) -> Figures:
    from moerun.benchmarks.checkpoint import format_checkpoint_table, run_checkpoint_bench

    results = run_checkpoint_bench(
        settings=settings,
        path=args.model,
        prefill_tokens=args.prefill_tokens or 256,
        peer=args.peer,
        expert_parallel=expert_parallel(args),
        memory_gb=args.memory_gb,
    )
    return results, format_checkpoint_table  # rank 0 alone measures and reports


def _memory_limit(args: argparse.Namespace, settings: BenchSettings) -> Figures:
    from moerun.benchmarks.checkpoint import check_peer_run
    from moerun.benchmarks.memory_limit import format_memory_limit_table, run_memory_limit_bench

    if not args.model or not str(args.model).endswith(".gguf"):
        raise ValueError("--memory-limit-gb runs on a GGUF file: give --model FILE.gguf.")
    if args.memory_limit_gb <= 0:
        raise ValueError(f"--memory-limit-gb must be > 0, not {args.memory_limit_gb:g}.")
    if expert_parallel(args):
        raise ValueError("--memory-limit-gb runs one process per engine: leave --expert-parallel out.")
    if args.peer is not None:
        check_peer_run(args.peer, settings.device or "cpu", args.model)
    options = {
        "expert_cache_gb": args.expert_cache_gb,
        "host_cache_gb": args.host_cache_gb,
        "prefetch_k": args.prefetch_k,
    }
    results = run_memory_limit_bench(
        settings=settings,
        path=args.model,
        memory_limit_gb=args.memory_limit_gb,
        prefill_tokens=args.prefill_tokens or 256,
        peer=args.peer,
        peer_repack=args.peer_repack,
        moerun_options={key: value for key, value in options.items() if value is not None},
        timeout_s=args.run_timeout_s,
    )
    return results, format_memory_limit_table


def _offload(args: argparse.Namespace, settings: BenchSettings) -> Figures:
    from moerun.benchmarks.offload import format_offload_table, run_offload_bench

    results = run_offload_bench(settings=settings, layers=args.layers or 2, predictable=args.predictable)
    return results, format_offload_table


def _expert_parallel(args: argparse.Namespace, settings: BenchSettings) -> Figures:
    from moerun.benchmarks.expert_parallel import format_expert_parallel_table, run_expert_parallel_bench

    results = run_expert_parallel_bench(
        settings=settings, layers=args.layers or 2, prompt_tokens=args.prefill_tokens or 128
    )
    # rank 0 alone measures and reports
    return (results if "collectives" in results else None), format_expert_parallel_table


def _serve(args: argparse.Namespace, settings: BenchSettings) -> Figures:
    from moerun.benchmarks.serve import format_serve_table, run_serve_bench

    clients = _sizes(args.serve, "--serve")
    fmt = json_schema_format(args.json_schema) if args.json_schema is not None else None
    result = run_serve_bench(settings=settings, layers=args.layers or 2, clients=clients, response_format=fmt)
    return result, format_serve_table


def _batch(args: argparse.Namespace, settings: BenchSettings) -> Figures:
    if args.model != "":
        raise SystemExit("moerun bench: --batch runs on the generated model; give --model without a PATH.")
    from moerun.benchmarks.batch import format_batch_table, run_batch_bench

    sizes = _sizes(args.batch)
    return run_batch_bench(settings=settings, layers=args.layers or 2, sizes=sizes), format_batch_table


def _model(args: argparse.Namespace, settings: BenchSettings) -> Figures:
    from moerun.benchmarks.model import format_model_table, run_model_bench

    results = run_model_bench(
        settings=settings,
        layers=args.layers or 4,
        prompt_tokens=args.prefill_tokens or 512,
        generated=args.generated,
    )
    return results, format_model_table


def _layer(args: argparse.Namespace, settings: BenchSettings) -> Figures:
    from moerun.benchmarks.layer import REPEATS, format_table, run_bench

    results = run_bench(
        settings=replace(settings, repeats=REPEATS),
        shape_name=args.shape,
        prefill_tokens=args.prefill_tokens or 512,
        peer=not args.no_peer,
        peer_impl=args.peer_impl,
        formats=_formats(args),
        dequant_cache_gb=args.dequant_cache_gb,
    )
    return results, format_table


# mode -> (whether the flags ask for it, the function that runs it); the first asked for runs
MODES: dict[str, tuple[Callable[[argparse.Namespace], bool], Callable[..., Figures]]] = {
    "memory-limit": (lambda args: args.memory_limit_gb is not None, _memory_limit),  # --model FILE
    "checkpoint": (lambda args: bool(args.model), _checkpoint),  # --model PATH
    "offload": (lambda args: args.offload, _offload),
    "expert-parallel": (lambda args: args.model == "" and expert_parallel(args), _expert_parallel),
    "serve": (lambda args: args.serve is not None, _serve),
    "batch": (lambda args: args.batch is not None, _batch),  # needs --model without a PATH
    "model": (lambda args: args.model is not None, _model),  # --model without a PATH
    "layer": (lambda args: True, _layer),  # the default
}


def run(args: argparse.Namespace) -> int:
    def log(message: str) -> None:
        if not args.json:
            print(f"... {message}", file=sys.stderr, flush=True)

    if args.device is not None:
        args.device = resolve_device(args.device)
    check_threads(args)
    check_memory_argument(args)
    use_threads(args)
    if args.model is not None and args.offload:
        raise SystemExit("moerun bench: give --model or --offload, not both.")
    if args.peer and not args.model:
        from moerun.benchmarks.llama_cpp import check_peer

        check_peer(None)  # refuses in one sentence
    settings = BenchSettings(
        dtype=args.dtype,
        device=args.device,
        backend=args.backend,
        decode_steps=args.decode_steps,
        repeats=args.repeats,
        log=log,
    )
    measure = next(measure for asked, measure in MODES.values() if asked(args))
    results, table = measure(args, settings)
    if results is not None:
        print(json.dumps(results) if args.json else table(results))
    return 0


def _sizes(text: str, flag: str = "--batch") -> list[int]:
    """--batch 1,4,8 -> [1, 4, 8]."""
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise SystemExit(f"moerun bench: {flag} takes sizes >= 1 separated by commas, not {text!r}.")
    return sizes


def _formats(args: argparse.Namespace) -> dict[str, str] | None:
    """--format FMT or --formats gate_up=FMT,down=FMT -> {"gate_up": ..., "down": ...}."""
    if args.format and args.formats:
        raise SystemExit("moerun bench: give --format or --formats, not both.")
    if args.format:
        return {"gate_up": args.format, "down": args.format}
    if not args.formats:
        return None
    formats = {}
    for part in args.formats.split(","):
        projection, _, fmt = part.partition("=")
        if projection not in ("gate_up", "down") or not fmt:
            raise SystemExit(f"moerun bench: --formats takes gate_up=FMT,down=FMT, not {part!r}.")
        formats[projection] = fmt
    return formats
