"""GPU benchmarks of the Triton kernels: decode per MoE layer against the HBM roofline, prefill
TFLOP/s against torch._grouped_mm and the torch backend. bench/gpu_check.sh runs it.

    python bench/gpu_kernels.py [--json results.json] [--smoke]

Roofline: the bytes of the k experts a decode step must read, divided by the copy bandwidth
measured in the same run (2 x bytes / time of a large device-to-device copy). Decode is timed two
ways: the whole layer call (route, host stage, graph replay, combine) and the graphed expert step
alone. Weights are random: block formats get random quants with finite, modest scales (the speed of
a kernel does not depend on the values). `--smoke` runs tiny shapes (on CPU: triton's interpreter),
to check the script itself.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from moerun.benchmarks.layer import SHAPES, BenchShape, copy_bandwidth, random_layer  # noqa: E402
from moerun.moe.backends import ActivationMode  # noqa: E402
from moerun.moe.layer import MoELayer, layer_run  # noqa: E402
from moerun.quant.formats import QTensor, get_format  # noqa: E402

# (shape, format of the expert weights) pairs the issue asks for
# (shape, format, integer decode on q8_1 activations)
DECODE_CASES = [
    ("gpt-oss-20b", "mxfp4", False),
    ("gpt-oss-20b", "mxfp4", True),
    ("mixtral-8x7b", "bf16", False),
    ("mixtral-8x7b", "q4_k", False),
    ("mixtral-8x7b", "q4_k", True),
]
PREFILL_CASES = [("mixtral-8x7b", "bf16"), ("gpt-oss-20b", "bf16"), ("gpt-oss-20b", "mxfp4")]
SMOKE = {
    "gpt-oss-20b": BenchShape("gpt_oss", dict(hidden_size=256, intermediate_size=256, num_local_experts=8,
                                              num_experts_per_tok=4, swiglu_limit=7.0)),
    "mixtral-8x7b": BenchShape("mixtral", dict(hidden_size=256, intermediate_size=512, num_local_experts=4,
                                               num_experts_per_tok=2)),
}  # fmt: skip
# fp16 fields set in every random block so its values stay finite and small
_SCALE_FIELDS = {"q4_k": (0, 4), "q8_0": (0, 2), "q6_k": (208, 210), "q4_0": (0, 2)}


def random_blocks(fmt_name: str, shape: tuple[int, ...], device: str, gen: torch.Generator) -> QTensor:
    """Random quants of format `fmt_name`, logical shape [E, n, k], with finite modest scales."""
    fmt = get_format(fmt_name)
    *lead, k = shape
    blocks = torch.randint(0, 256, (*lead, k // fmt.block_size, fmt.block_bytes), dtype=torch.uint8,
                           generator=gen, device=device)  # fmt: skip
    if fmt_name.startswith("mxfp4"):
        blocks[..., 0] = 120  # E8M0 scale 2^-7
    else:
        start, end = _SCALE_FIELDS[fmt_name]
        scale = torch.tensor([1e-3], dtype=torch.float16).view(torch.uint8).to(device)  # 2 bytes
        blocks[..., start:end] = scale.repeat((end - start) // 2)
    return QTensor(fmt, tuple(shape), blocks.flatten(-2))


def make_layer(
    shape_name: str, fmt: str, backend: str, device: str, smoke: bool, q8_1: bool = False
) -> MoELayer:
    shape = (SMOKE if smoke else SHAPES)[shape_name]
    dense = random_layer(shape, torch.bfloat16, device)
    tensors = dict(dense.tensors)
    if fmt != "bf16":
        gen = torch.Generator(device=device).manual_seed(0)
        for name in ("experts.gate_up", "experts.down"):
            tensors[name] = random_blocks(fmt, tuple(tensors[name].shape), device, gen)
    activations = ActivationMode.INT8 if q8_1 else ActivationMode.EXACT
    run = layer_run(tensors, torch.bfloat16, device, backend, activations)
    return MoELayer(dense.spec, tensors, name=f"bench.{shape_name}", run=run)


def _seconds(fn, device: str, repeats: int) -> float:
    """Seconds per call of fn, over `repeats` back-to-back calls (CUDA events on the GPU)."""
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        for _ in range(repeats):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3 / repeats
    begin = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - begin) / repeats


def _median(fn, device: str, repeats: int, rounds: int = 5) -> float:
    return statistics.median(_seconds(fn, device, repeats) for _ in range(rounds))


def expert_bytes(layer: MoELayer) -> int:
    """Bytes of one expert's projections as stored."""
    return layer.experts.bytes_per_expert()


def bench_decode(shape_name: str, fmt: str, q8_1: bool, device: str, bandwidth: float, smoke: bool) -> dict:
    from moerun.moe.backends import triton_backend

    layer = make_layer(shape_name, fmt, "triton", device, smoke, q8_1)
    spec = layer.spec
    x = torch.randn(1, spec.hidden, device=device, dtype=torch.bfloat16)
    repeats = 2 if smoke else 200
    for _ in range(3):  # compile, then capture the graph
        layer(x)
    whole = _median(lambda: layer(x), device, repeats)
    prepared = triton_backend._prepared(layer.experts, torch.device(device), layer.backend)
    ids = torch.arange(spec.top_k, dtype=torch.int32, device=device)
    weights = torch.full((spec.top_k,), 1.0 / spec.top_k, device=device)
    step = prepared.decode_graph(x[0], spec.top_k, spec.activation, layer.experts.dtype)
    experts_only = _median(lambda: step.run(x=x[0], slots=ids, experts=ids, weights=weights), device, repeats)
    roofline = spec.top_k * expert_bytes(layer) / bandwidth
    return dict(
        shape=shape_name, format=fmt, q8_1=q8_1, top_k=spec.top_k,
        expert_mb=spec.top_k * expert_bytes(layer) / 1e6,
        roofline_us=1e6 * roofline, layer_us=1e6 * whole, experts_us=1e6 * experts_only,
        layer_x_roofline=whole / roofline, experts_x_roofline=experts_only / roofline,
    )  # fmt: skip


def grouped_mm_moe(layer: MoELayer, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor):
    """The same routed experts on torch._grouped_mm (dense bf16): sorted rows, two grouped GEMMs."""
    k = ids.shape[1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=layer.spec.num_experts)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    rows = x[order // k]  # [T*k, H]
    gate_up = layer.experts.gate_up.transpose(-2, -1)  # [E, H, 2I]
    down = layer.experts.down.transpose(-2, -1)  # [E, I, H]
    h = torch._grouped_mm(rows, gate_up, offs=offs)
    a = layer.spec.activation(h.float()).to(x.dtype)
    y = torch._grouped_mm(a, down, offs=offs).float() * weights.reshape(-1)[order, None]
    out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    return out.index_add_(0, order // k, y)


def bench_prefill(shape_name: str, fmt: str, device: str, tokens: int, smoke: bool) -> dict:
    from moerun.moe.routing import route, router_logits

    triton_layer = make_layer(shape_name, fmt, "triton", device, smoke)
    spec = triton_layer.spec
    x = torch.randn(tokens, spec.hidden, device=device, dtype=torch.bfloat16)
    flops = 2 * tokens * spec.top_k * 3 * spec.hidden * spec.intermediate
    repeats = 1 if smoke else 5
    triton_layer(x)
    result = dict(shape=shape_name, format=fmt, tokens=tokens)
    result["triton_tflops"] = flops / _median(lambda: triton_layer(x), device, repeats, 3) / 1e12
    tensors = triton_layer.tensors
    torch_run = layer_run(tensors, torch.bfloat16, device, "torch")
    torch_layer = MoELayer(spec, tensors, name="bench", run=torch_run)
    torch_layer(x)
    result["torch_tflops"] = flops / _median(lambda: torch_layer(x), device, repeats, 3) / 1e12
    if fmt == "bf16" and device == "cuda" and hasattr(torch, "_grouped_mm"):
        weights, ids = route(spec.routing, router_logits(x, triton_layer.tensors["router.weight"]))
        try:
            grouped_mm_moe(triton_layer, x, ids, weights)
            seconds = _median(lambda: grouped_mm_moe(triton_layer, x, ids, weights), device, repeats, 3)
            result["grouped_mm_tflops"] = flops / seconds / 1e12
        except RuntimeError as err:  # e.g. a GPU torch._grouped_mm does not support
            result["grouped_mm_error"] = str(err).splitlines()[0]
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write every figure to this file")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, to test the script")
    parser.add_argument("--tokens", type=int, default=4096, help="prefill tokens (default 4096)")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokens = 8 if args.smoke else args.tokens
    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu (triton interpreter)"
    bandwidth = copy_bandwidth(device, (1 << 20) if args.smoke else (2 << 30), repeats=10)
    results = dict(device=gpu, torch=torch.__version__, copy_gb_s=bandwidth / 1e9, decode=[], prefill=[])
    print(f"{gpu}: copy bandwidth {bandwidth / 1e9:.0f} GB/s (torch {torch.__version__})")
    print(f"{'decode, one MoE layer':32} {'expert MB':>9} {'roofline us':>11} {'layer us':>9} {'x':>5} "
          f"{'experts us':>10} {'x':>5}")  # fmt: skip
    for shape_name, fmt, q8_1 in DECODE_CASES:
        r = bench_decode(shape_name, fmt, q8_1, device, bandwidth, args.smoke)
        results["decode"].append(r)
        name = f"{shape_name} {fmt}{' q8_1' if q8_1 else ''}"
        print(f"{name:32} {r['expert_mb']:9.1f} {r['roofline_us']:11.1f} {r['layer_us']:9.1f} "
              f"{r['layer_x_roofline']:5.2f} {r['experts_us']:10.1f} "
              f"{r['experts_x_roofline']:5.2f}")  # fmt: skip
    print(f"{'prefill T=' + str(tokens) + ', TFLOP/s':32} {'triton':>9} {'torch':>9} {'_grouped_mm':>11}")
    for shape_name, fmt in PREFILL_CASES:
        r = bench_prefill(shape_name, fmt, device, tokens, args.smoke)
        results["prefill"].append(r)
        peer = f"{r['grouped_mm_tflops']:11.1f}" if "grouped_mm_tflops" in r else f"{'n/a':>11}"
        print(f"{shape_name + ' ' + fmt:32} {r['triton_tflops']:9.2f} {r['torch_tflops']:9.2f} {peer}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
        print(f"full figures: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
