"""Microbenchmark of moerun's native CPU kernels: GB/s of weight bytes read per call, against the
copy bandwidth measured in the same run (a 256 MiB tensor copied, read + write counted).

matmul T=1 on [2048, 2048] and [768, 2048] weights per format and mode; moe_decode with
Qwen3-30B-A3B-like shapes (H=2048, I=768, 8 of 64 experts; Q4_K gate_up + Q6_K down as Q4_K_M,
all-Q8_0, all-MXFP4) for T=1 and T=8; 1 vs 2 threads. Weights are random bytes with valid scale
fields (speed does not depend on the values). Every call reads weights that are not in the caches:
matmul cycles through copies of the weight totalling > 192 MiB, moe_decode through 16 routings
over 64 experts (~200 MB for Q4_K_M), so the figures are DRAM reads, as in decoding a real model. us/call: the
2-thread best.

Prediction written before the first run (2-core Zen 5, ~41 GB/s copy): Q4_K integer T=1 on 2
threads ~25-30 GB/s (llama.cpp: ~23), Q8_0 / MXFP4 integer ~25, bf16 ~20 (exact), the generic
variant 3-5x slower; 1 thread about 60% of 2.

Prefill (`--prefill`, or as part of the full run): integer matmul of T = 256 and 512 tokens on
[2048, 2048], [1536, 2048] (gate_up) and [2048, 768] (down) weights in GFLOP/s (2 * T * out * in per
call), the GEMM against the row kernels (`gemm=False`) and torch's bf16 matmul on the dequantised
weights, all measured in the same run. Weights here stay in cache between calls: prefill is compute
bound. Prediction written before measuring with this section (after single-thread probes while
writing the GEMM, which gave q4_k ~130 GFLOP/s on one core against torch bf16 ~210): on 2 quiet
cores q4_k GEMM ~220, q6_k ~170, q8_0 ~130, mxfp4 ~110 GFLOP/s, the row kernels 0.7-1x of that,
torch bf16 ~350; on this shared machine the 2-thread figures come out at about half, the median
lower still.

`--formats tq1_0,iq1_s` runs only the matmul T=1 table, for those formats, on Qwen3-30B-A3B's
expert shapes ([1536, 2048] gate_up, [2048, 768] down).

GEMM against row kernels for few tokens (`--gemm-speedup q5_0,iq2_xs`): one thread, a [1536, 2048]
weight in cache, integer matmul as dispatched (the GEMM from its format's threshold) and through the
row kernels (`gemm=False`), alternated call by call, the fastest of 300 calls each, for T = 1-6, 8
and 16 (`--tokens`). Below the threshold both are the row kernels: their ratio shows the noise.

Usage: python bench/cpu_kernels.py [--variant avx512] [--quick] [--prefill] [--formats a,b]
       [--gemm-speedup FMT,..]
"""

from __future__ import annotations

import argparse
import time
from functools import partial

import torch

from moerun import cpu
from moerun.activations import GLU
from moerun.quant.formats import FLOAT_DTYPES, get_format

# (offset, fp16 bits or byte) of the scale fields set to sane values in random blocks
SCALE_FIELDS = {
    "q8_0": [(0, 0x2000)],
    "q4_0": [(0, 0x2000)],
    "q2_k": [(80, 0x2000), (82, 0x2000)],
    "q3_k": [(108, 0x2000)],
    "q4_k": [(0, 0x2000), (2, 0x2000)],
    "q5_k": [(0, 0x2000), (2, 0x2000)],
    "q6_k": [(208, 0x2000)],
    "q4_1": [(0, 0x2000), (2, 0x2000)],
    "q5_0": [(0, 0x2000)],
    "q5_1": [(0, 0x2000), (2, 0x2000)],
    "tq1_0": [(52, 0x2000)],
    "tq2_0": [(64, 0x2000)],
    **{f: [(0, 0x2000)] for f in ("iq4_nl", "iq4_xs", "iq3_xxs", "iq3_s", "iq2_xxs", "iq2_xs", "iq2_s")},
    "iq1_s": [(0, 0x2000)],
}


def random_weight(fmt_name: str, rows: int, n: int, lead: tuple[int, ...] = ()) -> torch.Tensor:
    if fmt_name in FLOAT_DTYPES:
        return (torch.randn(*lead, rows, n) * 0.02).to(FLOAT_DTYPES[fmt_name])
    fmt = get_format(fmt_name)
    data = torch.randint(0, 256, (*lead, rows, n // fmt.block_size, fmt.block_bytes), dtype=torch.uint8)
    if fmt_name.startswith("mxfp4"):
        data[..., 0] = 120
    for off, bits in SCALE_FIELDS.get(fmt_name, []):
        data[..., off] = bits & 0xFF
        data[..., off + 1] = bits >> 8
    return data.reshape(*lead, rows, -1)


COLD_BYTES = 192 << 20  # more than any L3 this runs on


def cold_copies(w: torch.Tensor) -> list[torch.Tensor]:
    """Copies of w, cycled through so that each call reads its weights from DRAM."""
    return [w] + [w.clone() for _ in range(max(1, COLD_BYTES // (w.numel() * w.element_size())) - 1)]


def cycling(fn_of, items):
    """A no-argument function that calls fn_of(item) for the next item each time."""
    state = {"i": 0}

    def call():
        state["i"] = (state["i"] + 1) % len(items)
        return fn_of(items[state["i"]])

    return call


def timed(fn, min_time: float = 0.3) -> tuple[float, float]:
    """(median, fastest) seconds per call. On a machine shared with other work the fastest call is
    the one that got both cores; the median then includes waits for a descheduled thread."""
    fn()
    times, start = [], time.perf_counter()
    while time.perf_counter() - start < min_time or len(times) < 5:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2], min(times)


def copy_bandwidth() -> float:
    src = torch.empty(256 << 20, dtype=torch.uint8).random_()
    dst = torch.empty_like(src)
    return 2 * src.numel() / timed(lambda: dst.copy_(src))[1] / 1e9


def row(nbytes: float, per: list[tuple[float, float]], bw: float) -> str:
    """The table's figures from [(median, best) with 2 threads, (median, best) with 1]."""
    (med2, best2), (med1, best1) = per
    gbs = [nbytes / t / 1e9 for t in (med2, best2, med1, best1)]
    copy = f"{100 * gbs[1] / bw:>6.0f}%"
    return f"{gbs[0]:>9.1f}{gbs[1]:>10.1f}{copy}{gbs[2]:>9.1f}{gbs[3]:>10.1f}{best2 * 1e6:>8.0f}"


def moe_step(step, x, weights, integer, variant):
    gate_up, down, slot, _ = step
    return cpu.moe_decode(x, gate_up, down, (slot, weights), GLU(), integer, variant=variant)


def with_threads(n: int, fn):
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return fn()
    finally:
        torch.set_num_threads(old)


def gflops(flop: float, per: list[tuple[float, float]]) -> str:
    """GFLOP/s from [(median, best) with 2 threads, (median, best) with 1]."""
    return "".join(f"{flop / t / 1e9:>10.0f}" for pair in per for t in pair)


def prefill(variant: str, formats: list[str]) -> None:
    print("\nprefill: GFLOP/s (2 * T * out * in per call), weights in cache")
    cols = f"{'2thr med':>10}{'2thr best':>10}{'1thr med':>10}{'1thr best':>10}"
    print(f"{'matmul':<24}{'T':>4}  {'kernel':<16}{cols}")
    for rows, n in ((2048, 2048), (1536, 2048), (2048, 768)):
        for T in (256, 512):
            x = torch.randn(T, n)
            flop = 2 * T * rows * n
            dense, xb = (torch.randn(rows, n) * 0.02).bfloat16(), x.bfloat16()
            per = [with_threads(t, partial(timed, partial(torch.matmul, xb, dense.T))) for t in (2, 1)]
            print(f"{f'[{rows}, {n}]':<24}{T:>4}  {'torch bf16':<16}{gflops(flop, per)}")
            for fmt_name in formats:
                w = random_weight(fmt_name, rows, n)
                for gemm in (True, False):
                    call = partial(cpu.matmul, fmt_name, w, x, True, variant, gemm)
                    per = [with_threads(t, partial(timed, call)) for t in (2, 1)]
                    kernel = f"{fmt_name} {'gemm' if gemm else 'rows'}"
                    print(f"{'':<24}{T:>4}  {kernel:<16}{gflops(flop, per)}")


def fastest_alternated(calls: list, rounds: int) -> list[float]:
    """The fastest call of each of `calls`, called in turn `rounds` times (a shared machine's noise
    then falls on both alike)."""
    best = [float("inf")] * len(calls)
    for call in calls:
        call()
    for _ in range(rounds):
        for i, call in enumerate(calls):
            t0 = time.perf_counter()
            call()
            best[i] = min(best[i], time.perf_counter() - t0)
    return best


def gemm_speedup(variant: str, formats: list[str], tokens: list[int], rounds: int = 300) -> None:
    print(f"\none thread, [1536, 2048] in cache: us per call, fastest of {rounds} alternated calls")
    print(f"{'format':<10}{'T':>4}{'dispatched':>12}{'rows':>10}{'rows / dispatched':>19}")
    for fmt_name in formats:
        w = random_weight(fmt_name, 1536, 2048)
        for T in tokens:
            x = torch.randn(T, 2048)
            calls = [partial(cpu.matmul, fmt_name, w, x, True, variant, gemm) for gemm in (True, False)]
            gemm, rows = with_threads(1, partial(fastest_alternated, calls, rounds))
            print(f"{fmt_name:<10}{T:>4}{gemm * 1e6:>12.1f}{rows * 1e6:>10.1f}{rows / gemm:>19.2f}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--variant", default=None)
    parser.add_argument("--quick", action="store_true", help="only the hot formats")
    parser.add_argument("--prefill", action="store_true", help="only the prefill GEMM")
    parser.add_argument("--formats", default=None, help="only the matmul T=1 table, for these formats (a,b)")
    parser.add_argument("--gemm-speedup", default=None, help="formats a,b,..: GEMM vs rows, 1 thread")
    parser.add_argument("--tokens", default="1,2,3,4,5,6,8,16", help="token counts of --gemm-speedup")
    args = parser.parse_args()
    if not cpu.available():
        raise SystemExit(f"native CPU kernels unavailable: {cpu.unavailable_reason()}")
    variant = args.variant or cpu.isa()
    if args.gemm_speedup:
        gemm_speedup(variant, args.gemm_speedup.split(","), [int(t) for t in args.tokens.split(",")])
        return
    bw = with_threads(2, copy_bandwidth)
    print(f"variant {variant}; copy bandwidth (read + write) {bw:.1f} GB/s, 2 threads")
    hot = ["q4_k", "q6_k", "q8_0", "mxfp4"]
    if args.prefill:
        prefill(variant, hot)
        return
    formats = (
        args.formats.split(",")
        if args.formats
        else ["q4_k", "q6_k", "q8_0", "mxfp4", "bf16"]
        if args.quick
        else [
            "q4_k",
            "q6_k",
            "q8_0",
            "mxfp4",
            "bf16",
            "f16",
            "f32",
            "q4_0",
            "q2_k",
            "q3_k",
            "q5_k",
            "mxfp4_gpt_oss",
        ]
    )
    cols = f"{'2thr med':>9}{'2thr best':>10}{'% copy':>7}{'1thr med':>9}{'1thr best':>10}{'us/call':>8}"
    print("GB/s of weights read; % copy: the 2-thread best over the copy bandwidth")
    print(f"{'matmul T=1':<28}{'mode':<9}{cols}")
    for rows, n in ((1536, 2048), (2048, 768)) if args.formats else ((2048, 2048), (768, 2048)):
        for fmt_name in formats:
            w = random_weight(fmt_name, rows, n)
            copies = cold_copies(w)
            x = torch.randn(1, n)
            for integer in (True, False) if fmt_name not in FLOAT_DTYPES else (False,):
                call = cycling(partial(cpu.matmul, fmt_name, x=x, integer=integer, variant=variant), copies)
                per = [with_threads(t, partial(timed, call)) for t in (2, 1)]
                mode = "integer" if integer else "exact"
                print(
                    f"{fmt_name + f' [{rows}, {n}]':<28}{mode:<9}{row(w.numel() * w.element_size(), per, bw)}"
                )
    if args.formats:
        return

    H, I, E, k = 2048, 768, 64, 8
    head = f"{'moe_decode H=2048 I=768 8/64':<34}{'T':>3}{'mode':>9}"
    print(f"\n{head}{cols}")
    for gu_fmt, dn_fmt in (("q4_k", "q6_k"), ("q8_0", "q8_0"), ("mxfp4", "mxfp4")):
        gu_all, dn_all = random_weight(gu_fmt, 2 * I, H, (E,)), random_weight(dn_fmt, H, I, (E,))
        for T in (1, 8):
            g = torch.Generator().manual_seed(T)
            steps = []  # 16 routings, cycled: each call reads experts the last one did not
            for _ in range(16):
                ids = torch.stack([torch.randperm(E, generator=g)[:k].sort().values for _ in range(T)])
                distinct = ids.unique()
                slot = torch.searchsorted(distinct, ids).int()
                gu = [(gu_fmt, gu_all[e]) for e in distinct.tolist()]
                dn = [(dn_fmt, dn_all[e]) for e in distinct.tolist()]
                steps.append((gu, dn, slot, sum(d.numel() for _, d in gu + dn)))
            weights = torch.rand(T, k)
            x = torch.randn(T, H)
            nbytes = sum(st[3] for st in steps) / len(steps)
            n_experts = sum(len(st[0]) for st in steps) / len(steps)
            for integer in (True, False):
                run = partial(moe_step, x=x, weights=weights, integer=integer, variant=variant)
                call = cycling(run, steps)
                per = [with_threads(t, partial(timed, call)) for t in (2, 1)]
                mode = "integer" if integer else "exact"
                label = f"{gu_fmt} / {dn_fmt} ({n_experts:.0f} experts)"
                print(f"{label:<34}{T:>3}{mode:>9}{row(nbytes, per, bw)}")
    prefill(variant, hot)


if __name__ == "__main__":
    main()
