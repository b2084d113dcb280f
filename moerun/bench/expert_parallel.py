"""`torchrun --nproc-per-node W -m moerun bench --model --expert-parallel`: the generated
OLMoE-shaped model (moerun.bench.model's weights, the same seed on every rank) run expert-parallel
over the W processes, against one process in the same run (rank 0 alone, the others waiting):
prefill and decode tok/s, and the exchange's share of a step (its milliseconds over the step's)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from moerun.bench.model import GENERATED, build_pair
from moerun.checkpoint.hf import canonical_tensors
from moerun.decoder.model import MoEModel
from moerun.distributed import ExpertParallel
from moerun.families import family
from moerun.moe.backends import resolve_backend
from moerun.quant.formats import COMPUTE_DTYPES


def _timings(model: MoEModel, ids: torch.Tensor, steps: list[int], repeats: int) -> tuple[float, float]:
    """(prefill seconds of `ids`, median seconds of one decode step after it)."""
    prefill, decode = [], []
    with torch.inference_mode():
        for _ in range(repeats):
            start = time.perf_counter()
            model.logits(ids)
            prefill.append(time.perf_counter() - start)
        cache = model.new_cache(1, ids.shape[1] + len(steps))
        model.forward(ids, cache)
        for i, token in enumerate(steps):
            start = time.perf_counter()
            model.hidden_logits(model.forward(torch.tensor([[token]]), cache)[0, -1])
            if i:
                decode.append(time.perf_counter() - start)
    return statistics.median(prefill), statistics.median(decode)


def run_expert_parallel_bench(
    layers: int = 2,
    dtype: str = "bf16",
    prompt_tokens: int = 128,
    decode_steps: int = 16,
    repeats: int = 3,
    shape: dict | None = None,
    backend: str = "auto",
    log: Callable[[str], None] = lambda s: None,
) -> dict:
    ep = ExpertParallel.from_env()
    backend = resolve_backend(backend, torch.device("cpu"))
    log(f"rank {ep.rank}/{ep.world}: building the {layers}-layer OLMoE-shaped model in {dtype}")
    peer, alone = build_pair(layers, COMPUTE_DTYPES[dtype], shape, "cpu", backend)
    state = peer.state_dict()
    config = family(GENERATED["olmoe"][0]).model_config(peer.config.to_dict())
    tensors, _ = canonical_tensors("olmoe", config, state.keys(), state.__getitem__)
    sharded = MoEModel(config, tensors, dtype=COMPUTE_DTYPES[dtype], backend=backend, expert_parallel=ep)
    vocab = peer.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (1, prompt_tokens), generator=gen)
    steps = torch.randint(0, vocab, (decode_steps + 1,), generator=gen).tolist()
    single = None
    if ep.rank == 0:
        log("one process (rank 0 alone)")
        single = _timings(alone, ids, steps, repeats)
    dist.barrier()
    log(f"{ep.world} processes, expert-parallel")
    before = ep.stats.ms, ep.stats.calls
    start = time.perf_counter()
    parallel = _timings(sharded, ids, steps, repeats)
    wall_ms = 1e3 * (time.perf_counter() - start)
    exchange_ms, exchanges = ep.stats.ms - before[0], ep.stats.calls - before[1]
    result = {
        "model": f"olmoe-shaped, {layers} layers",
        "dtype": dtype,
        "backend": backend,
        "world": ep.world,
        "threads": torch.get_num_threads(),
        "prompt_tokens": prompt_tokens,
        "placement": ep.placement(config.moe.num_experts),
        "prefill_tok_s": prompt_tokens / parallel[0],
        "decode_tok_s": 1 / parallel[1],
        "exchange_share": exchange_ms / wall_ms,
        "exchanges": exchanges,
        "exchange_bytes_decode_step": config.moe.top_k * config.hidden * 4 * sum(config.moe_layers),
    }
    if single is not None:
        result.update(single_prefill_tok_s=prompt_tokens / single[0], single_decode_tok_s=1 / single[1])
    return result


def format_expert_parallel_table(r: dict) -> str:
    lines = [
        f"moerun bench --model --expert-parallel  {r['model']}  dtype={r['dtype']}  backend={r['backend']}  "
        f"world={r['world']}  threads/rank={r['threads']}",
        f"  {r['placement']}",
        f"  prefill T={r['prompt_tokens']}  {r['world']} ranks {r['prefill_tok_s']:8.1f} tok/s   "
        f"one process {r.get('single_prefill_tok_s', float('nan')):8.1f} tok/s",
        f"  decode        {r['world']} ranks {r['decode_tok_s']:8.1f} tok/s   "
        f"one process {r.get('single_decode_tok_s', float('nan')):8.1f} tok/s",
        f"  exchange: {100 * r['exchange_share']:.0f}% of the timed run ({r['exchanges']} all-reduces; "
        f"{r['exchange_bytes_decode_step']} B of rows a decode step)",
    ]
    return "\n".join(lines)
