"""`moerun bench --offload`: expert streaming on a generated OLMoE-shaped checkpoint (random weights,
fused expert names, so the expert store reads each expert's bytes straight from the file).

One run measures: the RAM copy bandwidth and the store's own file -> RAM read bandwidth (with the
file's pages dropped from the page cache first, then again with them cached); decode with every
needed expert missing (a cache of top_k slots); decode tokens/s, hit rate, fetch throughput and
prefetch recall and waste at caches of 25/50/75/100% of the experts, each with prefetch off and
with prefetch_k = top_k, and at 50% again with the page cache dropped before every step (reads
wait on the disk, not on memory copies); and the fully resident model. `--predictable` writes a
checkpoint whose routing the next layer's router predicts exactly, to measure prefetch when its
predictions are right. Every streamed run decodes the same prompt
and tokens as the resident model, step for step in turns (so machine noise hits all alike), and its
logits are checked bitwise against the resident model's.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import struct
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from moerun.benchmarks import BenchSettings
from moerun.benchmarks.layer import copy_bandwidth
from moerun.benchmarks.model import OLMOE as OLMOE_SHAPES
from moerun.benchmarks.pagecache import cached_fraction, drop_page_cache
from moerun.checkpoint.load import load
from moerun.model import MoEModel
from moerun.offload import minimum_bytes
from moerun.quant.formats import COMPUTE_DTYPES

# OLMoE-1B-7B's layer shapes with a small vocabulary: 2 layers are about 1.6 GB in bf16
OLMOE = {**OLMOE_SHAPES, "vocab_size": 8192}
FRACTIONS = (0.25, 0.5, 0.75, 1.0)
_SAFETENSORS_DTYPE = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}


# -- the checkpoint ------------------------------------------------------------------------------
def _tensor_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """An OLMoE checkpoint's tensors as transformers names them, with fused expert projections."""
    H, I, E, V = (config[k] for k in ("hidden_size", "intermediate_size", "num_experts", "vocab_size"))
    kv = H // config["num_attention_heads"] * config["num_key_value_heads"]
    shapes = {"model.embed_tokens.weight": (V, H), "lm_head.weight": (V, H), "model.norm.weight": (H,)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for proj, shape in (("q", (H, H)), ("k", (kv, H)), ("v", (kv, H)), ("o", (H, H))):
            shapes[p + f"self_attn.{proj}_proj.weight"] = shape
        shapes[p + "self_attn.q_norm.weight"] = (H,)
        shapes[p + "self_attn.k_norm.weight"] = (kv,)
        shapes[p + "input_layernorm.weight"] = (H,)
        shapes[p + "post_attention_layernorm.weight"] = (H,)
        shapes[p + "mlp.gate.weight"] = (E, H)
        shapes[p + "mlp.experts.gate_up_proj"] = (E, 2 * I, H)
        shapes[p + "mlp.experts.down_proj"] = (E, H, I)
    return shapes


def write_checkpoint(
    directory: Path, layers: int, dtype: torch.dtype, shape: dict | None = None, predictable: bool = False
) -> Path:
    """A random OLMoE-shaped checkpoint (config.json + model.safetensors) in `directory`; `shape`
    overrides OLMOE's values. `predictable`: attention and expert outputs zero (o_proj, down_proj)
    and one router for every layer, so the hidden state never changes and the next layer's router on
    the current hidden state predicts exactly the experts it will ask for (every miss of the layers
    after the first). Written one tensor (one expert) at a time with a small safetensors writer of
    our own (the `safetensors` package is not a dependency), then fsynced so the page cache holds no
    dirty pages that would resist being dropped."""
    config = {"model_type": "olmoe", **OLMOE, **(shape or {}), "num_hidden_layers": layers}
    shapes = _tensor_shapes(config)
    size = torch.empty((), dtype=dtype).element_size()
    header, offset = {}, 0
    for name, dims in shapes.items():
        n = size * int(np.prod(dims))
        header[name] = {
            "dtype": _SAFETENSORS_DTYPE[dtype],
            "shape": list(dims),
            "data_offsets": [offset, offset + n],
        }
        offset += n
    raw = json.dumps(header).encode()
    raw += b" " * (-(8 + len(raw)) % 8)  # the data starts 8-byte aligned
    gen = torch.Generator().manual_seed(0)
    path = directory / "model.safetensors"
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        router = None
        for name, dims in shapes.items():
            if name.endswith("norm.weight"):
                chunks = [torch.ones(dims)]
            elif predictable and name.endswith(("o_proj.weight", "down_proj")):
                chunks = [torch.zeros(dims)]
            elif predictable and name.endswith("mlp.gate.weight"):
                router = torch.randn(dims, generator=gen).mul_(0.02) if router is None else router
                chunks = [router]
            elif "experts" in name:  # one expert at a time: [E, out, in] is E contiguous blocks
                chunks = (torch.randn(dims[1:], generator=gen).mul_(0.02) for _ in range(dims[0]))
            else:
                chunks = [torch.randn(dims, generator=gen).mul_(0.02)]
            for c in chunks:
                f.write(c.to(dtype).view(torch.uint8).numpy().tobytes())
        f.flush()
        os.fsync(f.fileno())
    (directory / "config.json").write_text(json.dumps(config))
    return directory


# -- measurements --------------------------------------------------------------------------------
def read_bandwidth(model: MoEModel, wave: int = 16) -> tuple[float, int]:
    """(bytes/s, bytes) reading every expert once through the store's own read path: `wave` reads
    at a time on its reader threads, each into its own host buffer, as the cache's misses do."""
    store = model.expert_cache.store
    keys = [(layer, e) for layer in store.sources for e in range(store.num_experts(layer))]
    buffers = [store.empty(keys[0][0]) for _ in range(min(wave, len(keys)))]
    total = 0
    start = time.perf_counter()
    for i in range(0, len(keys), wave):
        futures = [
            store.submit(store.read_into, k, b) for k, b in zip(keys[i : i + wave], buffers, strict=False)
        ]
        total += sum(f.result() for f in futures)
    return total / (time.perf_counter() - start), total


def _expert_ranges(model: MoEModel) -> list[tuple[int, int]]:
    """Byte ranges of the checkpoint file holding the streamed experts."""
    sources = [s for srcs in model.expert_cache.store.sources.values() for s in srcs.values()]
    return [(begin, end) for s in sources for _, begin, end in s.file_ranges()]


def _offload_total(model: MoEModel) -> dict:
    return model.stats()["offload"]["total"] if model.expert_cache is not None else {}


def race(
    models: dict[str, MoEModel],
    prompt: list[int],
    tokens: list[int],
    warmup: int,
    before_step: Callable[[], None] = lambda: None,
) -> dict[str, dict]:
    """Prefill `prompt` in each model, then decode `tokens` one at a time, each step in every model
    in turn (the order rotating step by step). The first `warmup` steps are not counted. Returns
    name -> {"seconds", "logits" (list of [V] per counted step), "offload" (counters over them)}."""
    caches = {}
    for name, model in models.items():
        caches[name] = model.new_cache(1, len(prompt) + len(tokens))
        model.forward(torch.tensor([prompt]), caches[name])
    out = {name: {"seconds": 0.0, "logits": []} for name in models}
    start = {}
    names = list(models)
    for i, token in enumerate(tokens):
        if i == warmup:
            start = {name: _offload_total(m) for name, m in models.items()}
        for name in names[i % len(names) :] + names[: i % len(names)]:
            model = models[name]
            before_step()
            t0 = time.perf_counter()
            logits = model.hidden_logits(model.forward(torch.tensor([[token]]), caches[name]))[0, -1]
            dt = time.perf_counter() - t0
            if i >= warmup:
                out[name]["seconds"] += dt
                out[name]["logits"].append(logits)
    for name, model in models.items():
        end = _offload_total(model)
        out[name]["offload"] = {k: end[k] - start[name][k] for k in end}
    return out


def _figures(
    run: dict, steps: int, read_per_load: int, resident: dict | None, slots: int | None = None
) -> dict:
    """The reported figures of one model's race result."""
    o = run["offload"]
    requests = o["hits"] + o["misses"]
    would_miss = o["misses"] + o["prefetch_used"]
    fetch_s = o["fetch_ms"] / 1e3
    figures = {
        "slots": slots,
        "tok_s": steps / run["seconds"],
        "hit_rate": o["hits"] / requests if requests else None,
        "misses": o["misses"],
        "bytes_read": o["bytes_read"],
        # bytes the misses asked for, per second spent in fetch (waiting for them)
        "miss_fetch_bytes_per_s": o["misses"] * read_per_load / fetch_s if o["misses"] else None,
        "prefetch_issued": o["prefetch_issued"],
        "prefetch_recall": o["prefetch_used"] / would_miss if o["prefetch_issued"] and would_miss else None,
        "prefetch_waste": o["prefetch_wasted"] / o["prefetch_issued"] if o["prefetch_issued"] else None,
    }
    if resident is not None:
        figures["vs_resident"] = resident["seconds"] / run["seconds"]
        figures["same_logits"] = all(
            torch.equal(a, b) for a, b in zip(run["logits"], resident["logits"], strict=True)
        )
    return figures


def run_offload_bench(
    settings: BenchSettings,
    layers: int = 2,
    prompt_tokens: int = 64,
    warmup_steps: int = 4,
    shape: dict | None = None,
    directory: str | os.PathLike | None = None,
    predictable: bool = False,
) -> dict:
    """Write the checkpoint (into `directory`, else a temporary one removed after) and measure, on
    the CPU (of `settings`: the dtype, the decode steps, `log`).
    `predictable`: the checkpoint's routing is predictable by construction (see write_checkpoint),
    to measure what prefetch gains when its predictions are right."""
    with contextlib.ExitStack() as stack:
        if directory is None:
            directory = stack.enter_context(tempfile.TemporaryDirectory(prefix="moerun-bench-offload-"))
        with torch.inference_mode():
            return _measure(
                Path(directory), layers, settings, prompt_tokens, warmup_steps, shape, predictable
            )


@dataclass
class _Run:
    """What every phase of the offload benchmark shares: the checkpoint, its shapes, the tokens."""

    root: Path
    torch_dtype: torch.dtype
    k: int
    prompt: list[int]
    tokens: list[int]
    warmup_steps: int
    decode_steps: int

    @property
    def path(self) -> Path:
        return self.root / "model.safetensors"

    def streamed(self, budget: int, prefetch_k: int | None = None) -> MoEModel:
        return load(self.root, dtype=self.torch_dtype, expert_cache_gb=budget / 2**30, prefetch_k=prefetch_k)

    def race(self, models: dict, cold: bool = False) -> dict:
        """Decode with `models` turn about; `cold`: the page cache dropped before every step."""
        if not cold:
            return race(models, self.prompt, self.tokens, self.warmup_steps)
        before = lambda: drop_page_cache(self.path)  # noqa: E731
        return race(models, self.prompt, self.tokens, self.warmup_steps, before_step=before)


def _measure(root, layers, settings, prompt_tokens, warmup_steps, shape, predictable) -> dict:
    dtype, decode_steps, log = settings.dtype, settings.decode_steps, settings.log
    torch_dtype = COMPUTE_DTYPES[dtype]
    kind = "predictable-routing" if predictable else "random"
    log(f"writing a {kind} {layers}-layer OLMoE-shaped checkpoint in {dtype} to {root}")
    write_checkpoint(root, layers, torch_dtype, shape, predictable)
    config = json.loads((root / "config.json").read_text())
    k, E, V = config["num_experts_per_tok"], config["num_experts"], config["vocab_size"]
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, V, (prompt_tokens,), generator=gen).tolist()
    tokens = torch.randint(0, V, (warmup_steps + decode_steps,), generator=gen).tolist()
    run = _Run(root, torch_dtype, k, prompt, tokens, warmup_steps, decode_steps)

    log("measuring RAM copy bandwidth")
    ram = copy_bandwidth("cpu") / 2  # bytes copied per second (copy_bandwidth counts read + write)
    # the smallest cache, top_k slots shared by every layer, so every expert a step needs misses
    H, I = config["hidden_size"], config["intermediate_size"]
    model = run.streamed(k * 3 * H * I * torch_dtype.itemsize)  # [2I, H] gate_up + [H, I] down each
    store = model.expert_cache.store
    slot_bytes = minimum_bytes(store, k) // k
    read_per_load = sum(s.source_bytes for s in next(iter(store.sources.values())).values())
    all_experts = E * len(store.sources)
    reads = _file_reads(run, model, log)
    all_miss = _all_miss(run, model, read_per_load, log)
    model.close()
    del model
    runs, resident_tok_s = _cache_fractions(run, all_experts, slot_bytes, read_per_load, log)
    gc.collect()  # the resident model's map kept the experts' pages cached: the cold runs need them gone
    cold_runs = _cold_half_cache(run, all_experts, slot_bytes, read_per_load, log)

    def run_at(fraction: float, prefetch: int) -> dict:
        return next(r for r in runs if r["cache_fraction"] == fraction and r["prefetch_k"] == prefetch)

    miss_cold = all_miss["cold"]["miss_fetch_bytes_per_s"]
    miss_warm = all_miss["warm"]["miss_fetch_bytes_per_s"]
    cold_bw, warm_bw = reads["file_read_cold_bytes_per_s"], reads["file_read_warm_bytes_per_s"]
    return {
        "model": f"olmoe-shaped, {layers} layers" + (", predictable routing" if predictable else ""),
        "dtype": dtype,
        "threads": torch.get_num_threads(),
        "checkpoint_bytes": run.path.stat().st_size,
        "experts": all_experts,
        "expert_bytes": slot_bytes,
        "top_k": k,
        "prompt_tokens": prompt_tokens,
        "decode_steps": decode_steps,
        "ram_copy_bytes_per_s": ram,
        **reads,
        "all_miss_cold": all_miss["cold"],
        "all_miss_warm": all_miss["warm"],
        "runs": runs,
        "resident_tok_s": resident_tok_s,
        "targets": {
            # >= 0.7: fetching every needed expert keeps up with the file
            "all_miss_fetch_vs_file_cold": miss_cold / cold_bw if miss_cold else None,
            "all_miss_fetch_vs_file_warm": miss_warm / warm_bw if miss_warm else None,
            # > 1: prefetch pays at a 50% cache
            "prefetch_speedup_at_50": run_at(0.5, k)["tok_s"] / run_at(0.5, 0)["tok_s"],
            "prefetch_speedup_at_50_cold": cold_runs[1]["tok_s"] / cold_runs[0]["tok_s"],
            # >= 0.95: a cache holding every expert costs (almost) nothing
            "full_cache_vs_resident": run_at(1.0, 0)["vs_resident"],
        },
        "cold_runs": cold_runs,  # 50% cache, page cache dropped before every step: off, then on
        "same_logits_as_resident": all(r["same_logits"] for r in runs),
    }


def _file_reads(run: _Run, model: MoEModel, log) -> dict:
    """The store's read path, file -> RAM, with the page cache dropped, then warm."""
    log("measuring file -> RAM reads (the store's read path) with the page cache dropped, then warm")
    ranges = _expert_ranges(model)
    drop_page_cache(run.path)
    cold_cached = cached_fraction(run.path, ranges)
    cold_bw, _ = read_bandwidth(model)
    warm_cached = cached_fraction(run.path, ranges)
    warm_bw, _ = read_bandwidth(model)
    return {
        "file_read_cold_bytes_per_s": cold_bw,
        "file_read_warm_bytes_per_s": warm_bw,
        "expert_pages_cached_before_cold_read": cold_cached,
        "expert_pages_cached_after_cold_read": warm_cached,
    }


def _all_miss(run: _Run, model: MoEModel, read_per_load: int, log) -> dict:
    """Decode with the smallest cache (every expert a step needs misses), cold and warm."""
    figures = {}
    for cold in (True, False):
        page_cache = "dropped before every step" if cold else "warm"
        log(f"decode with every expert missing ({run.k} slots), page cache {page_cache}")
        result = run.race({"min": model}, cold=cold)
        slots = model.expert_cache.num_slots
        figures["cold" if cold else "warm"] = _figures(
            result["min"], run.decode_steps, read_per_load, None, slots
        )
    return figures


def _cache_fractions(
    run: _Run, all_experts: int, slot_bytes: int, read_per_load: int, log
) -> tuple[list, float]:
    """Decode at each cache size of FRACTIONS, prefetch off and on, against the resident model:
    the runs' figures and the resident model's tok/s."""
    resident = load(run.root, dtype=run.torch_dtype)
    runs, resident_s = [], 0.0
    for fraction in FRACTIONS:
        log(f"decode at a cache of {fraction:.0%} of the experts: prefetch off, prefetch_k={run.k}, resident")
        budget = round(fraction * all_experts) * slot_bytes
        models = {
            "off": run.streamed(budget),
            "on": run.streamed(budget, prefetch_k=run.k),
            "resident": resident,
        }
        result = run.race(models)
        resident_s += result["resident"]["seconds"]
        for name, prefetch in (("off", 0), ("on", run.k)):
            slots = models[name].expert_cache.num_slots
            figures = _figures(result[name], run.decode_steps, read_per_load, result["resident"], slots)
            runs.append({"cache_fraction": fraction, "prefetch_k": prefetch, **figures})
            models[name].close()
    return runs, len(FRACTIONS) * run.decode_steps / resident_s


def _cold_half_cache(run: _Run, all_experts: int, slot_bytes: int, read_per_load: int, log) -> list[dict]:
    """Decode at a 50% cache with the page cache dropped before every step, prefetch off then on."""
    log(f"decode at a 50% cache, page cache dropped before every step: prefetch off, k={run.k}")
    budget = round(0.5 * all_experts) * slot_bytes
    models = {"off": run.streamed(budget), "on": run.streamed(budget, prefetch_k=run.k)}
    result = run.race(models, cold=True)
    cold_runs = []
    for name, prefetch in (("off", 0), ("on", run.k)):
        figures = _figures(
            result[name], run.decode_steps, read_per_load, None, models[name].expert_cache.num_slots
        )
        cold_runs.append({"cache_fraction": 0.5, "prefetch_k": prefetch, **figures})
        models[name].close()
    return cold_runs


def _pct(x: float | None) -> str:
    return "   -" if x is None else f"{100 * x:3.0f}%"


def _gbs(x: float | None) -> str:
    return "     -" if x is None else f"{x / 1e9:6.2f}"


def format_offload_table(r: dict) -> str:
    t = r["targets"]
    cached = r["expert_pages_cached_before_cold_read"]
    lines = [
        f"moerun bench --offload  {r['model']}  "
        f"{r['experts']} experts of {r['expert_bytes'] / 2**20:.1f} MiB  "
        f"top_k={r['top_k']}  dtype={r['dtype']}  threads={r['threads']}  "
        f"{r['decode_steps']} decode steps after a {r['prompt_tokens']}-token prompt",
        f"  RAM copy                          {_gbs(r['ram_copy_bytes_per_s'])} GB/s",
        f"  file -> RAM (store read path)     {_gbs(r['file_read_cold_bytes_per_s'])} GB/s cold "
        f"({'?' if cached is None else f'{100 * cached:.0f}%'} of expert pages cached before),"
        f" {_gbs(r['file_read_warm_bytes_per_s'])} GB/s from the page cache",
    ]
    for label, run, bw in (
        ("cold", r["all_miss_cold"], t["all_miss_fetch_vs_file_cold"]),
        ("warm", r["all_miss_warm"], t["all_miss_fetch_vs_file_warm"]),
    ):
        lines.append(
            f"  every expert missing, {label}      {_gbs(run['miss_fetch_bytes_per_s'])} GB/s fetched "
            f"({_pct(bw)} of the {label} file read)  {run['tok_s']:7.2f} tok/s  "
            f"hit rate {_pct(run['hit_rate'])}"
        )
    lines.append(
        "  cache  prefetch  slots    tok/s  vs resident  hit rate  miss GB/s  recall  waste  same logits"
    )
    for run in r["runs"] + r["cold_runs"]:
        prefetch = f"k={run['prefetch_k']}" if run["prefetch_k"] else "off"
        vs_resident = f"{run['vs_resident']:10.2f}x" if "vs_resident" in run else f"{'(cold)':>11}"
        lines.append(
            f"  {100 * run['cache_fraction']:4.0f}%  {prefetch:>8}  {run['slots']:5d}  {run['tok_s']:7.2f}  "
            f"{vs_resident}  {_pct(run['hit_rate']):>8}  "
            f"{_gbs(run['miss_fetch_bytes_per_s']):>9}  {_pct(run['prefetch_recall']):>6}  "
            f"{_pct(run['prefetch_waste']):>5}  {run.get('same_logits', '-')}"
        )
    lines.append(f"  resident                 {r['resident_tok_s']:7.2f}")
    lines.append(
        "  targets: every expert missing >= 70% of file read: "
        f"{_pct(t['all_miss_fetch_vs_file_cold'])} cold, {_pct(t['all_miss_fetch_vs_file_warm'])} warm; "
        f"prefetch at 50% > 1x: {t['prefetch_speedup_at_50']:.2f}x "
        f"({t['prefetch_speedup_at_50_cold']:.2f}x cold); "
        f"100% cache >= 95% of resident: {_pct(t['full_cache_vs_resident'])}"
    )
    return "\n".join(lines)
