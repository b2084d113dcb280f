"""`torchrun --nproc-per-node W -m moerun bench --model --expert-parallel`: the generated
OLMoE-shaped model (moerun.benchmarks.model's weights, the same seed on every rank) run expert-parallel
over the W processes (rank 0 runs it, the others serve their experts), against one process in the
same run (rank 0 alone, the others waiting): prefill and decode tok/s with each collective bringing
the rows back (all-to-all and reduce, alternated round by round), and per step on rank 0 the bytes
it sends (the layers' inputs) and receives (the other ranks' rows), the milliseconds of those
collectives and of its own experts."""

from __future__ import annotations

import statistics
import time

import torch

from moerun.benchmarks import BenchSettings
from moerun.benchmarks.model import GENERATED, build_pair
from moerun.checkpoint.hf import canonical_tensors
from moerun.distributed import ExpertParallel
from moerun.distributed.expert_parallel import COLLECTIVES, StepFigures
from moerun.families import family
from moerun.model import MoEModel
from moerun.moe.backends import resolve_backend
from moerun.moe.run import RunSpec
from moerun.quant.formats import COMPUTE_DTYPES


def _prefill(model: MoEModel, ids: torch.Tensor) -> float:
    start = time.perf_counter()
    model.logits(ids)
    return time.perf_counter() - start


def _decode(model: MoEModel, ids: torch.Tensor, steps: list[int]) -> list[float]:
    """Seconds of each decode step after the first, following a prefill of `ids`."""
    cache = model.new_cache(1, ids.shape[1] + len(steps))
    model.forward(ids, cache)
    seconds = []
    for i, token in enumerate(steps):
        start = time.perf_counter()
        model.hidden_logits(model.forward(torch.tensor([[token]]), cache)[0, -1])
        if i:
            seconds.append(time.perf_counter() - start)
    return seconds


def _timings(model: MoEModel, ids: torch.Tensor, steps: list[int], repeats: int) -> tuple[float, float]:
    """(median prefill seconds of `ids`, median seconds of one decode step after it)."""
    with torch.inference_mode():
        prefill = [_prefill(model, ids) for _ in range(repeats)]
        decode = [s for _ in range(repeats) for s in _decode(model, ids, steps)]
    return statistics.median(prefill), statistics.median(decode)


def _phase(figures: list[StepFigures]) -> dict:
    """Median per-step figures of one phase (prefill or decode) on rank 0."""
    return {
        "sent_bytes": int(statistics.median(f.sent_bytes for f in figures)),
        "received_bytes": int(statistics.median(f.received_bytes for f in figures)),
        "exchange_ms": statistics.median(f.exchange_ms for f in figures),
        "expert_ms": statistics.median(f.expert_ms for f in figures),
    }


def _parallel_timings(
    model: MoEModel, ep: ExpertParallel, ids: torch.Tensor, steps: list[int], repeats: int
) -> dict:
    """Per collective: prefill and decode seconds (medians) and per-step figures, the collectives
    alternated round by round so that the machine's drift falls on both."""
    runs = {c: {"prefill": [], "decode": [], "prefill_steps": [], "decode_steps": []} for c in COLLECTIVES}
    with torch.inference_mode():
        for _ in range(repeats):
            for collective, run in runs.items():
                ep.collective = collective  # the others follow: each step says which
                run["prefill"].append(_prefill(model, ids))
                run["prefill_steps"].append(ep.stats.last)
                run["decode"] += _decode(model, ids, steps)
                run["decode_steps"].append(ep.stats.last)
    ep.collective = COLLECTIVES[0]
    return {
        c: {
            "prefill_tok_s": ids.shape[1] / statistics.median(run["prefill"]),
            "decode_tok_s": 1 / statistics.median(run["decode"]),
            "prefill_step": _phase(run["prefill_steps"]),
            "decode_step": _phase(run["decode_steps"]),
        }
        for c, run in runs.items()
    }


def run_expert_parallel_bench(
    settings: BenchSettings, layers: int = 2, prompt_tokens: int = 128, shape: dict | None = None
) -> dict:
    """On the CPU, whatever `settings.device` says (the ranks exchange over gloo)."""
    dtype, decode_steps, repeats, log = settings.dtype, settings.decode_steps, settings.repeats, settings.log
    ep = ExpertParallel.from_env()
    backend = resolve_backend(settings.backend, torch.device("cpu"))
    log(f"rank {ep.rank}/{ep.world}: building the {layers}-layer OLMoE-shaped model in {dtype}")
    peer, alone = build_pair(layers, COMPUTE_DTYPES[dtype], shape, "cpu", backend)
    state = peer.state_dict()
    config = family(GENERATED["olmoe"][0]).model_config(peer.config.to_dict())
    tensors, _ = canonical_tensors("olmoe", config, state.keys(), state.__getitem__)
    sharded = MoEModel(
        config, tensors, RunSpec.make("cpu", COMPUTE_DTYPES[dtype], backend, expert_parallel=ep)
    )
    vocab = peer.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (1, prompt_tokens), generator=gen)
    steps = torch.randint(0, vocab, (decode_steps + 1,), generator=gen).tolist()
    result = {
        "model": f"olmoe-shaped, {layers} layers",
        "dtype": dtype,
        "backend": backend,
        "world": ep.world,
        "threads": torch.get_num_threads(),
        "prompt_tokens": prompt_tokens,
        "placement": ep.placement(config.moe.num_experts),
    }
    if not ep.leads:
        log("serving this rank's experts to rank 0")
        sharded.serve_experts()
        return {**result, "served": ep.stats.as_dict()}
    log("one process (rank 0 alone)")
    single = _timings(alone, ids, steps, repeats)
    log(f"{ep.world} processes, expert-parallel, collectives {' and '.join(COLLECTIVES)} alternated")
    result["collectives"] = _parallel_timings(sharded, ep, ids, steps, repeats)
    sharded.close()  # the other ranks' serve_experts returns
    result["steps"] = ep.stats.steps
    return {**result, "single_prefill_tok_s": prompt_tokens / single[0], "single_decode_tok_s": 1 / single[1]}


def _figures(step: dict) -> str:
    return (
        f"{step['sent_bytes'] / 1024:.0f} KiB, {step['received_bytes'] / 1024:.0f} KiB, "
        f"{step['exchange_ms']:.2f} ms, {step['expert_ms']:.2f} ms"
    )


def format_expert_parallel_table(r: dict) -> str:
    nan = float("nan")
    one_prefill, one_decode = r.get("single_prefill_tok_s", nan), r.get("single_decode_tok_s", nan)
    lines = [
        f"moerun bench --model --expert-parallel  {r['model']}  dtype={r['dtype']}  backend={r['backend']}  "
        f"world={r['world']}  threads/rank={r['threads']}",
        f"  {r['placement']}   one process: prefill T={r['prompt_tokens']} "
        f"{one_prefill:.1f} tok/s, decode {one_decode:.1f} tok/s",
        f"  {'collective':<11} {'prefill tok/s':>13} {'x1':>6} {'decode tok/s':>13} {'x1':>6}   "
        "per step on rank 0: inputs sent KiB, rows received KiB, their ms, own experts ms (prefill | decode)",
    ]
    for c, f in r["collectives"].items():
        p, d = f["prefill_step"], f["decode_step"]
        lines.append(
            f"  {c:<11} {f['prefill_tok_s']:13.1f} {f['prefill_tok_s'] / one_prefill:5.2f}x "
            f"{f['decode_tok_s']:13.1f} {f['decode_tok_s'] / one_decode:5.2f}x   "
            f"{_figures(p)} | {_figures(d)}"
        )
    return "\n".join(lines)
