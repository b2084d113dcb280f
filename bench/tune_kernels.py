"""Tune the Triton kernels' launch configs on this GPU and write them as data.

    python bench/tune_kernels.py [--out DIR] [--smoke]

For each (kernel, format, shape) below, every candidate config is run on random weights of that
format, checked against the default config's output (a candidate that computes something else is
dropped), and timed with CUDA events; the fastest is written to DIR/<GPU name>.json
(moerun/kernels/launch_configs/ by default) under the key "<kernel>|<format>|<n>x<k>", merged into
what the file already holds. moerun.kernels.configs reads it back. `--smoke` tunes tiny shapes
over two candidates each (on CPU: triton's interpreter), to test the script.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from gpu_kernels import SHAPES, SMOKE, _seconds, random_blocks  # noqa: E402

from moerun.activations import GLU  # noqa: E402
from moerun.families import family  # noqa: E402
from moerun.kernels import decode, grouped_gemm  # noqa: E402
from moerun.kernels.configs import CONFIG_DIR, device_name, gpu_file_name, launch_config, plan_block_m  # noqa: E402
from moerun.kernels.device_plan import build_device_plan  # noqa: E402
from moerun.kernels.weights import kernel_weight  # noqa: E402
from moerun.quant.formats import get_format  # noqa: E402

CASES = [("gpt-oss-20b", "mxfp4"), ("mixtral-8x7b", "bf16"), ("mixtral-8x7b", "q4_k")]
DECODE_GRID = dict(BLOCK_N=[16, 32, 64, 128], BLOCK_K=[128, 256, 512], num_warps=[2, 4, 8])
PREFILL_GRID = dict(BLOCK_N=[64, 128], BLOCK_K=[32, 64, 128], num_warps=[4, 8], num_stages=[2, 3, 4])


def candidates(grid: dict[str, list[int]], smoke: bool) -> list[dict]:
    configs = [dict(zip(grid, values, strict=True)) for values in itertools.product(*grid.values())]
    return configs[:2] if smoke else configs


def weights(shape_name: str, fmt: str, device: str, smoke: bool):
    """(spec, gate_up KernelWeight, down KernelWeight) with random weights of `fmt`."""
    shape = (SMOKE if smoke else SHAPES)[shape_name]
    spec = family(shape.model_type).moe_spec(shape.config)
    E, H, I = spec.num_experts, spec.hidden, spec.intermediate
    gen = torch.Generator(device=device).manual_seed(0)
    out = []
    for dims in ((E, 2 * I, H), (E, H, I)):
        if fmt == "bf16":
            w = (torch.rand(dims, generator=gen, device=device) - 0.5) / dims[-1] ** 0.5
            out.append(kernel_weight(w.to(torch.bfloat16)))
        else:
            out.append(kernel_weight(random_blocks(fmt, dims, device, gen)))
    return spec, out[0], out[1]


def launches(kernel: str, spec, gate_up, down, device: str, tokens: int):
    """fn(config) -> the rows of `kernel`'s output that hold results (prefill leaves padding rows
    unwritten), run once with `config`."""
    k, H, I = spec.top_k, spec.hidden, spec.intermediate
    gen = torch.Generator(device=device).manual_seed(1)
    slots = torch.randperm(spec.num_experts, generator=gen, device=device)[:k].sort().values.int()
    route_w = torch.full((k,), 1.0 / k, device=device)
    act = GLU()
    if kernel == "decode_gate_up":
        x = torch.randn(H, generator=gen, device=device).to(torch.bfloat16)
        return lambda c: decode.gate_up_experts(x, slots, slots, gate_up, None, c)
    if kernel == "decode_down":
        a = torch.randn(k, I, generator=gen, device=device)
        return lambda c: decode.down_experts(a, slots, slots, down, None, route_w, c)
    ids = torch.stack(
        [torch.randperm(spec.num_experts, generator=gen, device=device)[:k] for _ in range(tokens)]
    )
    block_m = plan_block_m(device_name(torch.device(device)))
    plan = build_device_plan(ids, torch.full(ids.shape, 1.0 / k, device=device), spec.num_experts, block_m)
    used = plan.sorted_rows < tokens * k  # [max_rows]: rows that hold an assignment
    if kernel == "prefill_gate_up":
        x = torch.randn(tokens, H, generator=gen, device=device).to(torch.bfloat16)
        return lambda c: grouped_gemm.gate_up_activation(
            x, plan, gate_up, None, act, {**c, "BLOCK_M": block_m}
        )[used]
    a = torch.randn(plan.max_rows, I, generator=gen, device=device).to(torch.bfloat16)
    return lambda c: grouped_gemm.down_weighted(a, plan, down, None, {**c, "BLOCK_M": block_m})[used]


def tune(device: str, smoke: bool, tokens: int, log=print) -> dict[str, dict]:
    gpu = device_name(torch.device(device))
    found = {}
    for shape_name, fmt in CASES[:1] if smoke else CASES:
        spec, gate_up, down = weights(shape_name, fmt, device, smoke)
        projections = (("decode_gate_up", gate_up), ("decode_down", down))
        projections += (("prefill_gate_up", gate_up), ("prefill_down", down))
        for kernel, weight in projections:
            run = launches(kernel, spec, gate_up, down, device, tokens)
            reference = run(launch_config(kernel, fmt, weight.n, weight.k, gpu))
            grid = DECODE_GRID if kernel.startswith("decode") else PREFILL_GRID
            timings = []
            for config in candidates(grid, smoke):
                if kernel.startswith("decode") and config["BLOCK_K"] % get_format(fmt).block_size:
                    continue  # the GEMV steps over whole blocks
                try:
                    out = run(config)
                except Exception as err:  # noqa: BLE001 - a config this GPU cannot run is skipped
                    log(f"  {kernel} {fmt} {config}: {type(err).__name__}")
                    continue
                if not torch.allclose(out.float(), reference.float(), rtol=2e-2, atol=1e-3):
                    log(f"  {kernel} {fmt} {config}: wrong output, dropped")
                    continue
                repeats = 1 if smoke else 20
                seconds = statistics.median(
                    _seconds(lambda c=config, r=run: r(c), device, repeats) for _ in range(3)
                )
                timings.append((seconds, config))
            if timings:
                seconds, best = min(timings, key=lambda t: t[0])
                found[f"{kernel}|{fmt}|{weight.n}x{weight.k}"] = best
                log(f"{kernel:16} {fmt:6} {weight.n}x{weight.k}: {1e6 * seconds:9.1f} us {best}")
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=CONFIG_DIR, help="directory of the JSON files")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, two candidates")
    parser.add_argument("--tokens", type=int, default=4096, help="prefill tokens to tune for")
    args = parser.parse_args()
    if args.smoke and args.out == CONFIG_DIR:
        parser.error("--smoke writes tiny-shape configs: give --out a scratch directory.")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    found = tune(device, args.smoke, 8 if args.smoke else args.tokens)
    path = args.out / gpu_file_name(device_name(torch.device(device)))
    table = json.loads(path.read_text()) if path.exists() else {}
    table.update(found)
    args.out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    print(f"wrote {len(found)} configs to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
