"""One engine run in a process of its own, for `moerun bench --memory-limit-gb`
(moerun.benchmarks.memory_limit starts it inside a memory cgroup):

    python -m moerun.benchmarks.engine_run '{"engine": "moerun", "path": ..., ...}'

It loads the GGUF file (moerun, or llama.cpp with or without its weight repacking), prefills a prompt,
then decodes the given tokens one step each, and prints one JSON line per event as it goes ("loaded",
"prefill", "step", "done"), each with the process's /proc/self/io `read_bytes` so far, so a run the
OOM killer or a timeout ends still leaves its figures up to there. Decode steps are fed tokens chosen
in advance, not picked from the logits: varied tokens, whose routing is new at every step, and the
same for every engine.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from moerun.benchmarks.procfs import read_io

ENGINES = ("moerun", "llama.cpp")


def emit(event: str, **figures) -> None:
    figures["read_bytes"] = read_io()["read_bytes"]
    print(json.dumps({"event": event, **figures}), flush=True)


def _open(spec: dict):
    """(the engine: prefill(ids) and step(token) -> logits, its expert store's stats or None)."""
    capacity = len(spec["prompt"]) + len(spec["tokens"]) + 1
    if spec["engine"] == "llama.cpp":
        from moerun.benchmarks.llama_cpp import LlamaCppPeer

        return LlamaCppPeer(spec["path"], capacity, spec["threads"], repack=spec["repack"]), lambda: None
    from moerun.benchmarks.checkpoint import MoerunContender
    from moerun.checkpoint.load import load
    from moerun.quant.formats import COMPUTE_DTYPES

    model = load(
        spec["path"], dtype=COMPUTE_DTYPES[spec["dtype"]], backend=spec["backend"], **spec["options"]
    )
    cache = model.expert_cache

    def store():
        if cache is None:
            return None
        summary = cache.summary()
        return {"slots": summary["slots"], "cache_bytes": summary["cache_bytes"], **summary["total"]}

    return MoerunContender(model, capacity), store


def run(spec: dict) -> None:
    torch.set_num_threads(spec["threads"])
    emit("start")
    start = time.perf_counter()
    engine, store = _open(spec)
    emit("loaded", seconds=time.perf_counter() - start, store=store())
    with torch.inference_mode():
        start = time.perf_counter()
        int(engine.prefill(spec["prompt"]).argmax())
        emit("prefill", seconds=time.perf_counter() - start, tokens=len(spec["prompt"]), store=store())
        for token in spec["tokens"]:
            start = time.perf_counter()
            int(engine.step(token).argmax())  # a greedy pick is part of a decode step
            emit("step", seconds=time.perf_counter() - start, store=store())
    emit("done", store=store())


if __name__ == "__main__":
    run(json.loads(sys.argv[1]))
