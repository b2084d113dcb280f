"""Whole-tensor dequantisation speed per format: GB/s of fp32 output per core (issue 3's target:
>= 1 GB/s per core). Usage: python bench/dequant_throughput.py [--threads N] [--rows 2048]."""

import argparse
import statistics
import time

import torch

from moerun.quant.dequant import dequantize
from moerun.quant.quantize import quantize

FORMATS = ["q8_0", "q4_0", "mxfp4", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "bf16", "f16"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--cols", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sample = torch.randn(64, args.cols, generator=torch.Generator().manual_seed(0))
    print(f"dequantise a [{args.rows}, {args.cols}] tensor to fp32, {args.threads} threads")
    print(f"{'format':8} {'ms':>8} {'GB/s out':>9} {'GB/s/core':>10}")
    for fmt in FORMATS:
        q = quantize(sample, fmt)  # quantise 64 rows (the reference k-quant search is slow), repeat them
        reps = args.rows // 64
        q = type(q)(q.format, (args.rows, args.cols), q.data.repeat(reps, 1).contiguous())
        dequantize(q)
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            dequantize(q)
            times.append(time.perf_counter() - start)
        t = statistics.median(times)
        gbs = args.rows * args.cols * 4 / t / 1e9
        print(f"{fmt:8} {t * 1e3:8.1f} {gbs:9.2f} {gbs / args.threads:10.2f}")


if __name__ == "__main__":
    main()
