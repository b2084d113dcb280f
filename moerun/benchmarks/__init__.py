"""Benchmarks and their peers, each a mode of `moerun bench`: `layer` (one MoE layer vs
transformers' block, the default), `model` (a whole generated model), `checkpoint` (a checkpoint
moerun loads, with llama.cpp as a peer: `llama_cpp`), `memory_limit` (each engine alone under one
memory limit, in a process of its own: `engine_run`), `offload` (expert streaming), `batch` and
`serve` (batched generation, the HTTP server), `expert_parallel`; `cgroup` (a child memory cgroup),
`pagecache` (dropping the page cache, the disk's sequential read), `procfs` (a process's reads and
resident memory), `peers` (transformers' blocks on the same weights), `weight_bytes` (bytes read per
token). `BenchSettings`: how every one of them measures."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


def _quiet(message: str) -> None:
    pass


@dataclass(frozen=True)
class BenchSettings:
    """How a benchmark measures, the settings `moerun bench`'s modes share: the compute dtype, the
    device (None: cuda when there is one; the checkpoint benchmark: cpu) and backend, the decode steps
    (new tokens per sequence where a benchmark generates), the repetitions of each measurement, and
    `log` for what it is doing. A benchmark reads those it uses."""

    dtype: str = "bf16"
    device: str | None = None
    backend: str = "auto"
    decode_steps: int = 32
    repeats: int = 3
    log: Callable[[str], None] = _quiet
