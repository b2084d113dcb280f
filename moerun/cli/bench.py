"""`moerun bench`: one MoE layer with a real model's shapes against transformers' block (the
default), a whole generated model (--model), a checkpoint (--model PATH, with --peer llama.cpp on a
GGUF file), or expert streaming (--offload); a table or --json."""

from __future__ import annotations

import argparse
import json
import sys

from moerun.cli.common import (
    add_threads_argument,
    check_threads,
    expert_parallel,
    resolve_device,
    use_threads,
)
from moerun.moe.backends import BACKENDS
from moerun.quant.formats import COMPUTE_DTYPES


def add_parser(commands) -> None:
    from moerun.benchmarks.layer import SHAPES

    bench = commands.add_parser("bench", help="benchmark one MoE layer with a real model's shapes")
    bench.add_argument("--shape", choices=sorted(SHAPES), default="olmoe", help="whose layer shapes to use")
    bench.add_argument("--dtype", choices=sorted(COMPUTE_DTYPES), default="bf16", help="compute dtype")
    bench.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    bench.add_argument("--backend", choices=BACKENDS, default="auto", help="auto: triton on CUDA")
    bench.add_argument(
        "--prefill-tokens", type=int, help="prefill prompt length (default 512; --model PATH: 256)"
    )
    bench.add_argument("--decode-steps", type=int, default=32, help="decode steps timed")
    add_threads_argument(bench)
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
        help="with --model FILE.gguf: llama.cpp on the same file in the same run (needs llama-cpp-python)",
    )
    bench.add_argument("--repeats", type=int, default=3, help="with --model: repetitions of each measurement")
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
        "--expert-parallel",
        action="store_true",
        help="under torchrun: the model's experts spread over the ranks (on by itself when WORLD_SIZE > 1); "
        "--model without a PATH: the generated model expert-parallel against one process",
    )
    bench.add_argument("--json", action="store_true", help="print one JSON object")
    bench.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from moerun.benchmarks.layer import format_table, run_bench

    def log(message: str) -> None:
        if not args.json:
            print(f"... {message}", file=sys.stderr, flush=True)

    if args.device is not None:
        args.device = resolve_device(args.device)
    check_threads(args)
    use_threads(args)
    if args.model is not None and args.offload:
        raise SystemExit("moerun bench: give --model or --offload, not both.")
    if args.peer and not args.model:
        from moerun.benchmarks.llama_cpp import check_peer

        check_peer(None)  # refuses in one sentence
    if args.model:
        from moerun.benchmarks.checkpoint import format_checkpoint_table, run_checkpoint_bench

        results = run_checkpoint_bench(
            args.model,
            dtype=args.dtype,
            prefill_tokens=args.prefill_tokens or 256,
            decode_steps=args.decode_steps,
            repeats=args.repeats,
            peer=args.peer,
            device=args.device or "cpu",
            backend=args.backend,
            log=log,
            expert_parallel=expert_parallel(args),
        )
        if results is not None:  # rank 0 alone measures and prints
            print(json.dumps(results) if args.json else format_checkpoint_table(results))
        return 0
    if args.offload:
        from moerun.benchmarks.offload import format_offload_table, run_offload_bench

        results = run_offload_bench(
            layers=args.layers or 2,
            dtype=args.dtype,
            decode_steps=args.decode_steps,
            predictable=args.predictable,
            log=log,
        )
        print(json.dumps(results) if args.json else format_offload_table(results))
        return 0
    if args.model == "" and expert_parallel(args):
        from moerun.benchmarks.expert_parallel import format_expert_parallel_table, run_expert_parallel_bench

        results = run_expert_parallel_bench(
            layers=args.layers or 2,
            dtype=args.dtype,
            prompt_tokens=args.prefill_tokens or 128,
            decode_steps=args.decode_steps,
            repeats=args.repeats,
            backend=args.backend,
            log=log,
        )
        if "collectives" in results:  # rank 0 alone measures and prints
            print(json.dumps(results) if args.json else format_expert_parallel_table(results))
        return 0
    if args.serve is not None:
        from moerun.benchmarks.serve import format_serve_table, run_serve_bench

        results = run_serve_bench(
            layers=args.layers or 2,
            dtype=args.dtype,
            clients=_sizes(args.serve, "--serve"),
            new_tokens=args.decode_steps,
            device=args.device,
            backend=args.backend,
            log=log,
        )
        print(json.dumps(results) if args.json else format_serve_table(results))
        return 0
    if args.batch is not None and args.model != "":
        raise SystemExit("moerun bench: --batch runs on the generated model; give --model without a PATH.")
    if args.batch is not None:
        from moerun.benchmarks.batch import format_batch_table, run_batch_bench

        results = run_batch_bench(
            layers=args.layers or 2,
            dtype=args.dtype,
            sizes=_sizes(args.batch),
            new_tokens=args.decode_steps,
            repeats=args.repeats,
            device=args.device,
            backend=args.backend,
            log=log,
        )
        print(json.dumps(results) if args.json else format_batch_table(results))
        return 0
    if args.model is not None:
        from moerun.benchmarks.model import format_model_table, run_model_bench

        results = run_model_bench(
            layers=args.layers or 4,
            dtype=args.dtype,
            prompt_tokens=args.prefill_tokens or 512,
            decode_steps=args.decode_steps,
            repeats=args.repeats,
            device=args.device,
            backend=args.backend,
            log=log,
            generated=args.generated,
        )
        print(json.dumps(results) if args.json else format_model_table(results))
        return 0

    results = run_bench(
        shape_name=args.shape,
        dtype=args.dtype,
        device=args.device,
        prefill_tokens=args.prefill_tokens or 512,
        decode_steps=args.decode_steps,
        peer=not args.no_peer,
        formats=_formats(args),
        dequant_cache_gb=args.dequant_cache_gb,
        peer_impl=args.peer_impl,
        backend=args.backend,
        log=log,
    )
    print(json.dumps(results) if args.json else format_table(results))
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
