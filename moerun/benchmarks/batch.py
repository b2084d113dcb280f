"""`moerun bench --model --batch 1,4,8`: batched generation on the generated OLMoE-shaped model
(moerun.benchmarks.model's weights, shared with transformers' model): B prompts of the same length, each
B timed as moerun's batch (`model.generate([...])`, one forward pass per step) and transformers'
batched `generate` on the same tensors, interleaved. Aggregate tok/s (B x new tokens over the
whole call, prefill included), moerun's decode-only aggregate (its steps after every prompt is
read), each side's scaling over its own B=1, and whether both picked the same greedy tokens."""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence

import torch

from moerun.benchmarks import BenchSettings
from moerun.benchmarks.model import generated_run, logged_pair


def run_batch_bench(
    settings: BenchSettings,
    layers: int = 2,
    sizes: Sequence[int] = (1, 4, 8),
    prompt_tokens: int = 32,
    shape: dict | None = None,
) -> dict:
    """Each batch size: `settings.decode_steps` new tokens per prompt, moerun and transformers."""
    dtype, new_tokens, repeats, log = settings.dtype, settings.decode_steps, settings.repeats, settings.log
    peer, ours, device, backend = logged_pair(layers, settings, shape)
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, peer.config.vocab_size, (max(sizes), prompt_tokens), generator=gen)
    ours.warm_up()
    rows = []
    with torch.inference_mode():
        peer.generate(ids[:1, :4].to(device), max_new_tokens=2, do_sample=False, pad_token_id=0)  # warm-up
        for size in sizes:
            log(f"batch of {size}: {prompt_tokens}-token prompts, {new_tokens} new tokens x{repeats}")
            prompts = ids[:size].tolist()
            times = {"moerun": [], "transformers": []}
            decode = []
            for _ in range(repeats):
                start = time.perf_counter()
                outputs = ours.generate(prompts, new_tokens)
                times["moerun"].append(time.perf_counter() - start)
                runs = ours.stats()["sequences"]
                decode.append(sum(r["new_tokens"] - 1 for r in runs) / max(r["decode_s"] for r in runs))
                start = time.perf_counter()
                theirs = peer.generate(
                    ids[:size].to(device),
                    max_new_tokens=new_tokens,
                    min_new_tokens=new_tokens,
                    do_sample=False,
                    pad_token_id=0,
                )
                times["transformers"].append(time.perf_counter() - start)
            same = [[t.id for t in out] for out in outputs] == theirs[:, prompt_tokens:].tolist()
            median = {k: statistics.median(v) for k, v in times.items()}
            rows.append(
                {
                    "batch": size,
                    "tok_s": size * new_tokens / median["moerun"],
                    "peer_tok_s": size * new_tokens / median["transformers"],
                    "decode_tok_s": statistics.median(decode),
                    "same_greedy_tokens": same,
                }
            )
    for row in rows:
        row["vs_peer"] = row["tok_s"] / row["peer_tok_s"]
        row["scaling"] = row["decode_tok_s"] / rows[0]["decode_tok_s"]
        row["peer_scaling"] = row["peer_tok_s"] / rows[0]["peer_tok_s"]
    return {**generated_run(layers, dtype, device, backend, prompt_tokens, new_tokens), "rows": rows}


def format_batch_table(r: dict) -> str:
    lines = [
        f"moerun bench --model --batch  {r['model']}  dtype={r['dtype']}  device={r['device']}  "
        f"backend={r['backend']}  threads={r['threads']}  ({r['prompt_tokens']}-token prompts, "
        f"{r['new_tokens']} new tokens each)",
        "  batch   moerun tok/s  transformers tok/s  (ratio)   moerun decode tok/s  scaling  peer scaling",
    ]
    for row in r["rows"]:
        lines.append(
            f"  {row['batch']:5}  {row['tok_s']:13.1f}  {row['peer_tok_s']:18.1f}  ({row['vs_peer']:.2f}x)  "
            f"{row['decode_tok_s']:19.1f}  {row['scaling']:6.2f}x  {row['peer_scaling']:11.2f}x"
        )
    return "\n".join(lines)
