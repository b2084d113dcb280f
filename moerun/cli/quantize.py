"""`moerun quantize SRC OUT.gguf`: a Hugging Face checkpoint to a GGUF file with quantised experts."""

from __future__ import annotations

import argparse
import sys


def add_parser(commands) -> None:
    quantize = commands.add_parser(
        "quantize", help="a Hugging Face checkpoint -> a GGUF file with quantised experts"
    )
    quantize.add_argument("src", help="a HF checkpoint directory, or a hub id in the local cache")
    quantize.add_argument("out", help="the .gguf file to write")
    quantize.add_argument(
        "--experts",
        required=True,
        help="format of the expert projections: q2_k .. q6_k, iq4_xs, iq4_nl, q4_0, q4_1, q5_0, q5_1, q8_0, "
        "tq1_0, tq2_0, mxfp4, f16, bf16, f32 (the other i-quants need an importance matrix: llama-quantize)",
    )
    quantize.add_argument("--down", help="format of the experts' down projection (default: --experts)")
    quantize.add_argument(
        "--rest",
        default="f16",
        help="format of the other 2-D weights: f16 (default), bf16, f32, q8_0, q5_1, q5_0, iq4_nl",
    )
    quantize.add_argument("--force", action="store_true", help="replace OUT if it exists")
    quantize.add_argument("-t", "--threads", type=int, default=1, help="torch threads while quantising")
    quantize.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
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
