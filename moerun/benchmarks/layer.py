"""`moerun bench`: one synthetic MoE layer with the shapes of a real model, random weights.

Measures prefill (T tokens at once) and decode (one token per step, a fresh random token each
step) tokens/s, the bytes/s of expert weights decode reads, and a memory-copy bandwidth measured in
the same run as the roofline. When transformers is installed, its own MoE block of the same family
runs on the very same weight tensors, so the ratios compare like with like on this machine now.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from moerun.benchmarks import BenchSettings
from moerun.benchmarks.peers import peer_block, run_peer, transformers_available
from moerun.families import family
from moerun.families.moe_block import export
from moerun.moe.backends import resolve_backend
from moerun.moe.layer import MoELayer, layer_run
from moerun.quant.cache import DequantCache
from moerun.quant.formats import COMPUTE_DTYPES, QTensor
from moerun.quant.quantize import quantize


@dataclass(frozen=True)
class BenchShape:
    model_type: str
    config: dict  # the model's config.json keys that shape one MoE layer


SHAPES = {
    "olmoe": BenchShape(
        "olmoe",
        dict(
            hidden_size=2048,
            intermediate_size=1024,
            num_experts=64,
            num_experts_per_tok=8,
            norm_topk_prob=False,
        ),
    ),
    "qwen3-30b-a3b": BenchShape(
        "qwen3_moe",
        dict(
            hidden_size=2048,
            moe_intermediate_size=768,
            num_experts=128,
            num_experts_per_tok=8,
            norm_topk_prob=True,
        ),
    ),
    "mixtral-8x7b": BenchShape(
        "mixtral", dict(hidden_size=4096, intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2)
    ),
    "gpt-oss-20b": BenchShape(
        "gpt_oss",
        dict(
            hidden_size=2880,
            intermediate_size=2880,
            num_local_experts=32,
            num_experts_per_tok=4,
            swiglu_limit=7.0,
        ),
    ),
}


def random_layer(
    shape: BenchShape, dtype: torch.dtype, device: str, seed: int = 0, backend: str = "torch"
) -> MoELayer:
    """A layer of `shape` with uniform random weights scaled like a trained model's (unit-ish outputs)."""
    spec = family(shape.model_type).moe_spec(shape.config)
    gen = torch.Generator(device=device).manual_seed(seed)
    tensors = {}
    for name, dims in spec.tensor_shapes().items():
        fan_in = dims[-1] if len(dims) > 1 and not name.endswith("bias") else 1
        bound = (3.0 / fan_in) ** 0.5 if fan_in > 1 else 0.1
        router = name.startswith("router.")
        tensor = torch.empty(dims, dtype=torch.float32 if router else dtype, device=device)
        tensors[name] = tensor.uniform_(-bound, bound, generator=gen)
    return MoELayer(
        spec, tensors, name=f"bench.{shape.model_type}", run=layer_run(tensors, dtype, device, backend)
    )


def quantised_layer(
    dense: MoELayer, formats: dict[str, str], log: Callable[[str], None], cache: DequantCache | None = None
) -> MoELayer:
    """`dense` with its expert projections quantised per `formats`.

    Quantising every expert of a real shape takes minutes with the reference k-quant search, so two
    experts are quantised and their bytes repeated (in separate memory) for the rest: speed depends
    on the bytes read, not on their values."""
    tensors = dict(dense.tensors)
    for projection, fmt in formats.items():
        key = f"experts.{projection}"
        weight = tensors[key]
        distinct = min(2, weight.shape[0])
        log(f"quantising {key} to {fmt}")
        sample = quantize(weight[:distinct].float(), fmt)
        repeats = -(-weight.shape[0] // distinct)
        data = sample.data.repeat(repeats, 1, 1)[: weight.shape[0]].contiguous()
        tensors[key] = QTensor(sample.format, tuple(weight.shape), data)
    run = dataclasses.replace(dense.run, dequant_cache=cache)
    return MoELayer(dense.spec, tensors, name=dense.name, run=run)


def copy_bandwidth(device: str, nbytes: int = 256 * 2**20, repeats: int = 5) -> float:
    """Best observed bytes/s of a large device copy, counting bytes read plus bytes written."""
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = min(timed(lambda: dst.copy_(src), device) for _ in range(repeats))
    return 2 * nbytes / best


def timed(fn: Callable[[], object], device: str = "cpu") -> float:
    """Wall seconds of one call, the device synchronised before and after."""
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _measure(
    contenders: dict[str, Callable],
    x_prefill: torch.Tensor,
    x_decode: torch.Tensor,
    device: str,
    repeats: int,
) -> dict[str, tuple[float, float]]:
    """name -> (median prefill seconds, median seconds per decode step).

    Contenders run interleaved, call by call, so drift in a shared machine's speed hits them alike.
    Decode feeds a fresh random token [1, H] each step, so each step routes anew."""
    for forward in contenders.values():  # warm-up: first-call allocations and kernel selection
        forward(x_prefill)
        forward(x_decode[:1])
    prefill = {name: [] for name in contenders}
    decode = {name: [] for name in contenders}
    for _ in range(repeats):
        for name, forward in contenders.items():
            prefill[name].append(timed(lambda f=forward: f(x_prefill), device))
    for i in range(1, x_decode.shape[0]):
        for name, forward in contenders.items():
            decode[name].append(timed(lambda f=forward, i=i: f(x_decode[i : i + 1]), device))
    return {name: (statistics.median(prefill[name]), statistics.median(decode[name])) for name in contenders}


# `moerun bench`'s layer mode times each contender this many times (--repeats is for --model)
REPEATS = 5


def run_bench(
    settings: BenchSettings,
    shape_name: str = "olmoe",
    prefill_tokens: int = 512,
    peer: bool = True,
    peer_impl: str = "grouped_mm",
    shape: BenchShape | None = None,
    formats: dict[str, str] | None = None,
    dequant_cache_gb: float = 0.0,
) -> dict:
    """Run the benchmark and return its figures (see the module docstring).

    `formats` ({"gate_up": fmt, "down": fmt}) quantises the expert projections; the peer is then the
    same layer dense in `dtype`, and the decode figure counts the quantised bytes read."""
    dtype, decode_steps, repeats, log = settings.dtype, settings.decode_steps, settings.repeats, settings.log
    device = settings.device or ("cuda" if torch.cuda.is_available() else "cpu")
    shape = shape or SHAPES[shape_name]
    torch_dtype = COMPUTE_DTYPES[dtype]
    backend = resolve_backend(settings.backend, torch.device(device))
    log(f"building a random {shape_name} layer ({dtype}, {device}, {backend} backend)")
    layer = random_layer(shape, torch_dtype, device, backend=backend)
    spec = layer.spec
    gen = torch.Generator(device=device).manual_seed(1)
    x_prefill = torch.randn(prefill_tokens, spec.hidden, generator=gen, device=device).to(torch_dtype)
    x_decode = torch.randn(decode_steps + 1, spec.hidden, generator=gen, device=device).to(torch_dtype)

    results = {
        "shape": shape_name,
        "dtype": dtype,
        "device": device,
        "backend": backend,
        "threads": torch.get_num_threads(),
        "prefill_tokens": prefill_tokens,
        "top_k": spec.top_k,
        "num_experts": spec.num_experts,
        "peer": None,
        "peer_note": None,  # why there is no peer, when there is none
    }
    contenders = {"moerun": layer}
    if formats:
        dense = layer
        cache = DequantCache(int(dequant_cache_gb * 2**30)) if dequant_cache_gb > 0 else None
        layer = quantised_layer(dense, formats, log, cache)
        contenders = {"moerun": layer, "peer": dense}
        results["formats"] = formats
        results["peer"] = f"moerun dense {dtype} (same weights before quantisation)"
    elif peer and transformers_available():
        # transformers keeps its router in the model dtype: only those small tensors are copied
        peer_tensors = {k: v.to(torch_dtype) for k, v in export(shape.model_type, layer.tensors).items()}
        block = peer_block(shape.model_type, shape.config, peer_tensors, experts_implementation=peer_impl)
        contenders["peer"] = lambda x: run_peer(block, x)
        results["peer"] = f"transformers {block.__class__.__name__} (experts_implementation={peer_impl})"
    else:
        results["peer_note"] = (
            "--no-peer" if not peer else "transformers not installed: pip install transformers"
        )
    with torch.inference_mode():
        log("measuring copy bandwidth")
        results["copy_bytes_per_s"] = copy_bandwidth(device)
        log(f"prefill T={prefill_tokens} x{repeats} and {decode_steps} decode steps: {', '.join(contenders)}")
        times = _measure(contenders, x_prefill, x_decode, device, repeats)
    prefill_s, decode_s = times["moerun"]
    results["prefill_tok_s"] = prefill_tokens / prefill_s
    results["decode_tok_s"] = 1.0 / decode_s
    results["expert_bytes"] = layer.experts.bytes_per_expert()  # as stored: quantised or dense
    results["decode_weight_bytes_per_s"] = spec.top_k * results["expert_bytes"] / decode_s
    results["decode_roofline_fraction"] = results["decode_weight_bytes_per_s"] / results["copy_bytes_per_s"]
    if formats and layer.experts.cache is not None:
        stats = layer.experts.cache.stats
        results["dequant_cache"] = {"hits": stats.hits, "misses": stats.misses, "bytes": stats.bytes}
    results["peer_prefill_tok_s"] = results["peer_decode_tok_s"] = None
    if "peer" in times:
        results.update(_peer_figures(times, prefill_tokens))
        if not formats:  # a quantised layer repeats two experts' bytes: its outputs are not comparable
            with torch.inference_mode():
                ours, theirs = layer(x_prefill).float(), contenders["peer"](x_prefill).float()
            results["peer_max_rel_diff"] = ((ours - theirs).abs().max() / theirs.abs().max()).item()
    return results


def _peer_figures(times: dict, prefill_tokens: int) -> dict:
    """The peer's rates and the ratios, from each contender's (prefill s, decode step s)."""
    (prefill_s, decode_s), (peer_prefill_s, peer_decode_s) = times["moerun"], times["peer"]
    return {
        "peer_prefill_tok_s": prefill_tokens / peer_prefill_s,
        "peer_decode_tok_s": 1.0 / peer_decode_s,
        "prefill_vs_peer": peer_prefill_s / prefill_s,
        "decode_vs_peer": peer_decode_s / decode_s,
    }


def format_table(r: dict) -> str:
    gb = 1e9
    lines = [
        f"moerun bench  shape={r['shape']}  dtype={r['dtype']}  device={r['device']}  "
        f"backend={r['backend']}  threads={r['threads']}"
        + (f"  formats={r['formats']}" if r.get("formats") else ""),
        f"  experts={r['num_experts']} top_k={r['top_k']}  bytes/expert={r['expert_bytes'] / 2**20:.1f} MiB",
        f"  copy bandwidth (read+write)       {r['copy_bytes_per_s'] / gb:8.1f} GB/s",
        f"  prefill T={r['prefill_tokens']:<5}                {r['prefill_tok_s']:8.1f} tok/s",
        f"  decode                            {r['decode_tok_s']:8.1f} tok/s",
        f"  decode expert bytes read          {r['decode_weight_bytes_per_s'] / gb:8.1f} GB/s "
        f"({100 * r['decode_roofline_fraction']:.0f}% of copy bandwidth)",
    ]
    if r.get("dequant_cache"):
        c = r["dequant_cache"]
        lines.append(
            f"  dequantised-expert cache: {c['hits']} hits, {c['misses']} misses, "
            f"{c['bytes'] / 2**20:.0f} MiB held"
        )
    if not r["peer"]:
        lines.append(f"  peer: none ({r['peer_note']}) - no ratios")
        return "\n".join(lines)
    lines += [
        f"  peer: {r['peer']}",
        f"  peer prefill{r['peer_prefill_tok_s']:32.1f} tok/s (moerun {r['prefill_vs_peer']:.2f}x)",
        f"  peer decode{r['peer_decode_tok_s']:33.1f} tok/s (moerun {r['decode_vs_peer']:.2f}x)",
    ]
    if r.get("peer_max_rel_diff") is not None:
        note = "" if r["dtype"] == "fp32" else "  (peer routes on low-precision logits: near ties may differ)"
        lines.append(f"  max |moerun - peer| / max |peer|  {r['peer_max_rel_diff']:8.1e}{note}")
    return "\n".join(lines)
