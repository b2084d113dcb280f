"""The `moerun` command line."""

from __future__ import annotations

import argparse
import json
import sys


def _bench(args: argparse.Namespace) -> int:
    from moerun.bench import format_table, run_bench

    def log(message: str) -> None:
        if not args.json:
            print(f"... {message}", file=sys.stderr, flush=True)

    if args.model and args.offload:
        raise SystemExit("moerun bench: give --model or --offload, not both.")
    if args.offload:
        from moerun.bench_offload import format_offload_table, run_offload_bench

        results = run_offload_bench(
            layers=args.layers or 2,
            dtype=args.dtype,
            decode_steps=args.decode_steps,
            predictable=args.predictable,
            log=log,
        )
        print(json.dumps(results) if args.json else format_offload_table(results))
        return 0
    if args.model:
        from moerun.bench_model import format_model_table, run_model_bench

        results = run_model_bench(
            layers=args.layers or 4,
            dtype=args.dtype,
            prompt_tokens=args.prefill_tokens,
            decode_steps=args.decode_steps,
            device=args.device,
            backend=args.backend,
            log=log,
        )
        print(json.dumps(results) if args.json else format_model_table(results))
        return 0

    results = run_bench(
        shape_name=args.shape,
        dtype=args.dtype,
        device=args.device,
        prefill_tokens=args.prefill_tokens,
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


def _inspect(args: argparse.Namespace) -> int:
    from moerun.describe import describe, format_description

    description = describe(args.path)
    print(json.dumps(description) if args.json else format_description(description))
    return 0


def _generate(args: argparse.Namespace) -> int:
    from moerun.commands import run_generate

    return run_generate(args)


def _chat(args: argparse.Namespace) -> int:
    from moerun.commands import chat_command

    return chat_command(args)


def _quantize(args: argparse.Namespace) -> int:
    from moerun.export import QuantizeSpec, quantize_checkpoint

    def log(message: str) -> None:
        print(f"moerun quantize: {message}", file=sys.stderr, flush=True)

    import torch

    spec = QuantizeSpec(experts=args.experts, down=args.down, rest=args.rest)  # refusals are ValueErrors
    # The reference k-quant searches are many small ops: on a shared 2-core machine they ran 20x
    # slower with two OpenMP threads than with one (docs/PERFORMANCE.md), hence one by default.
    previous = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        print(quantize_checkpoint(args.src, args.out, spec, force=args.force, log=log))
    finally:
        torch.set_num_threads(previous)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from moerun.bench import DTYPES, SHAPES

    parser = argparse.ArgumentParser(prog="moerun", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    bench = commands.add_parser("bench", help="benchmark one MoE layer with a real model's shapes")
    bench.add_argument("--shape", choices=sorted(SHAPES), default="olmoe")
    bench.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    bench.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    bench.add_argument(
        "--backend", choices=["auto", "torch", "triton"], default="auto", help="auto: triton on CUDA"
    )
    bench.add_argument("--prefill-tokens", type=int, default=512)
    bench.add_argument("--decode-steps", type=int, default=32)
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
        "--model",
        action="store_true",
        help="a whole generated OLMoE-shaped model against transformers' model (needs transformers)",
    )
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
    bench.add_argument("--json", action="store_true", help="print one JSON object")
    bench.set_defaults(run=_bench)
    from moerun.commands import add_model_arguments

    generate = commands.add_parser("generate", help="generate text from a prompt, streamed to stdout")
    add_model_arguments(generate)
    generate.add_argument("--prompt", required=True)
    generate.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    generate.add_argument("--json", action="store_true", help="print one JSON record at the end instead")
    generate.set_defaults(run=_generate)
    chat = commands.add_parser("chat", help="a conversation with the model's own chat template")
    add_model_arguments(chat)
    chat.set_defaults(run=_chat)
    inspect = commands.add_parser("inspect", help="what a checkpoint holds: architecture, formats, memory")
    inspect.add_argument(
        "path", help="a HF checkpoint directory, a .gguf file, or a hub id in the local cache"
    )
    inspect.add_argument("--json", action="store_true", help="print one JSON object")
    inspect.set_defaults(run=_inspect)
    quantize = commands.add_parser(
        "quantize", help="a Hugging Face checkpoint -> a GGUF file with quantised experts"
    )
    quantize.add_argument("src", help="a HF checkpoint directory, or a hub id in the local cache")
    quantize.add_argument("out", help="the .gguf file to write")
    quantize.add_argument(
        "--experts", required=True, help="format of the expert projections: q4_k, q6_k, q8_0, mxfp4, ..."
    )
    quantize.add_argument("--down", help="format of the experts' down projection (default: --experts)")
    quantize.add_argument(
        "--rest", default="f16", help="format of the other 2-D weights: f16 (default), bf16, f32, q8_0"
    )
    quantize.add_argument("--force", action="store_true", help="replace OUT if it exists")
    quantize.add_argument("--threads", type=int, default=1, help="torch threads while quantising (default 1)")
    quantize.set_defaults(run=_quantize)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, OSError) as err:  # bad input: files, settings, prompts (one sentence each)
        print(f"moerun {args.command}: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
