"""Hit rates of the expert cache's eviction choices on generated routing, no model and no timing:
LRU alone, LRU with the hot set (the default), LFU; routing uniform over the experts (the worst
case) or skewed (a Zipf law: a few experts take most of the traffic, as published traces of real MoE
models show). Each step every layer asks for `top_k` distinct experts drawn from its own law.

    python scripts/expert_cache_policies.py [--experts 128 --top-k 8 --layers 8 --steps 600]
"""

from __future__ import annotations

import argparse
import random
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

import moerun.offload.cache as cache_module
from moerun.loader import SafetensorsFile
from moerun.loader.mapped import MappedFile
from moerun.offload import ExpertCache, ExpertStore, minimum_bytes

HOT_SHARE = cache_module.HOT_SHARE  # the default


def laws(experts: int, layers: int, skew: float, seed: int) -> list[list[float]]:
    """Per layer, each expert's share of the traffic: rank r gets 1/(r+1)^skew, ranks shuffled."""
    rng = random.Random(seed)
    out = []
    for _ in range(layers):
        weights = [1 / (r + 1) ** skew for r in range(experts)]
        rng.shuffle(weights)
        total = sum(weights)
        out.append([w / total for w in weights])
    return out


def draw(rng: random.Random, law: list[float], k: int) -> list[int]:
    chosen: list[int] = []
    while len(chosen) < k:
        e = rng.choices(range(len(law)), law)[0]
        if e not in chosen:
            chosen.append(e)
    return chosen


def hit_rate(path: Path, args, law, slots: int, policy: str, hot_share: float) -> float:
    f = SafetensorsFile(path)
    weights = {f"l{i}": {p: f.tensor(f"l{i}.{p}") for p in ("gate_up", "down")} for i in range(args.layers)}
    store = ExpertStore(weights, torch.bfloat16, files=[MappedFile(f.path, f.mapped)])
    cache_module.HOT_SHARE = hot_share
    cache = ExpertCache(store, slots * minimum_bytes(store, 1), top_k=args.top_k, policy=policy)
    rng = random.Random(1)
    for step in range(args.steps):
        if step == args.steps // 3:  # warmed up: count from here
            start = cache.stats.copy()
        cache.begin_step()
        for i in range(args.layers):
            keys = [(f"l{i}", e) for e in draw(rng, law[i], args.top_k)]
            cache.fetch_many(keys)
            cache.release(keys)
        cache.end_step()
    s = cache.stats - start
    cache.close()
    return s.hits / (s.hits + s.misses)


def main() -> None:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=600)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "experts.safetensors"
        tensors = {}
        for i in range(args.layers):
            tensors[f"l{i}.gate_up"] = torch.zeros(args.experts, 16, 4, dtype=torch.bfloat16)
            tensors[f"l{i}.down"] = torch.zeros(args.experts, 4, 8, dtype=torch.bfloat16)
        save_file(tensors, path)
        print("routing              cache   lru   lru+hot   lfu   (hit rate after a third of the steps)")
        for name, skew in (("uniform", 0.0), ("skewed (Zipf 1.2)", 1.2)):
            law = laws(args.experts, args.layers, skew, seed=0)
            top = sorted(law[0], reverse=True)[: args.experts // 8]
            for share in (0.25, 0.5):
                slots = int(share * args.experts * args.layers)
                rates = [
                    hit_rate(path, args, law, slots, "lru", 0.0),
                    hit_rate(path, args, law, slots, "lru", HOT_SHARE),
                    hit_rate(path, args, law, slots, "lfu", 0.0),
                ]
                print(f"{name:20s} {share:5.0%}  " + "  ".join(f"{r:6.1%}" for r in rates))
            print(f"{'':20s} (the top 1/8 of the experts take {sum(top):.0%} of the traffic)")


if __name__ == "__main__":
    main()
