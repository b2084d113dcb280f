"""The one place moerun reads environment variables.

`MOERUN_TRACE` is a comma-separated list of trace channels:
  perf     per-stage wall times of each MoE layer call (route, plan, experts, combine)
  buffers  router sanity figures (logit min/max, NaN count, out-of-range ids, weight range)
The Hugging Face hub cache (where hub ids are looked up, never downloaded) follows huggingface_hub:
`HF_HUB_CACHE` (or its older name `HUGGINGFACE_HUB_CACHE`), else `HF_HOME/hub`, else
`XDG_CACHE_HOME/huggingface/hub`, else `~/.cache/huggingface/hub`.
`TRITON_INTERPRET=1` (triton's own switch, read here only to check the triton backend may run on CPU
tensors) runs Triton kernels in triton's interpreter.
`MOERUN_CPU_ISA` forces the native CPU kernels' variant: `generic`, `avx2` or `avx512` (at most what
the CPU supports), or `off` to not use them; unset picks the best the CPU runs.
`MOERUN_CPU_BUILD_DIR` is where those kernels are compiled to (default `~/.cache/moerun/cpu`).
`MOERUN_CPU_MALLOC`: `tuned` (default) raises glibc's malloc thresholds once the native CPU kernels
load (moerun.cpu.allocator), `default` leaves them as they are.
torchrun's `RANK`, `WORLD_SIZE`, `MASTER_ADDR` and `MASTER_PORT` (read by torch.distributed itself):
here only which are set, and `WORLD_SIZE` > 1 makes the command line run expert-parallel.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

TRACE_CHANNELS = frozenset({"perf", "buffers"})
CPU_ISAS = ("generic", "avx2", "avx512", "off")
CPU_MALLOCS = ("tuned", "default")
TORCHRUN_KEYS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class Settings:
    trace: frozenset[str] = frozenset()
    hf_hub_cache: Path = field(default_factory=lambda: Path.home() / ".cache" / "huggingface" / "hub")
    triton_interpret: bool = False
    cpu_isa: str | None = None  # MOERUN_CPU_ISA, one of CPU_ISAS; None: the best the CPU supports
    cpu_build_dir: Path | None = None
    cpu_malloc: str = "tuned"  # MOERUN_CPU_MALLOC, one of CPU_MALLOCS
    torchrun_keys: frozenset[str] = frozenset()  # which of TORCHRUN_KEYS are set
    world_size: int = 1  # WORLD_SIZE: the processes torchrun started
    rank: int = 0  # RANK: this one's
    local_rank: int = 0  # LOCAL_RANK: this one's on its machine (its GPU, with NCCL)

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> Settings:
        raw = environ.get("MOERUN_TRACE", "")
        channels = frozenset(part.strip() for part in raw.split(",") if part.strip())
        unknown = channels - TRACE_CHANNELS - {"all"}
        if unknown:
            raise ValueError(
                f"MOERUN_TRACE names unknown channel(s) {sorted(unknown)}; "
                f"known channels are {sorted(TRACE_CHANNELS)} or 'all'."
            )
        if "all" in channels:
            channels = TRACE_CHANNELS
        interpret = environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")
        cpu_isa = environ.get("MOERUN_CPU_ISA", "").strip().lower() or None
        if cpu_isa is not None and cpu_isa not in CPU_ISAS:
            raise ValueError(f"MOERUN_CPU_ISA={cpu_isa!r} is not one of {', '.join(CPU_ISAS)}.")
        build_dir = environ.get("MOERUN_CPU_BUILD_DIR", "").strip()
        cpu_malloc = environ.get("MOERUN_CPU_MALLOC", "").strip().lower() or "tuned"
        if cpu_malloc not in CPU_MALLOCS:
            raise ValueError(f"MOERUN_CPU_MALLOC={cpu_malloc!r} is not one of {', '.join(CPU_MALLOCS)}.")
        return cls(
            trace=channels,
            hf_hub_cache=_hf_hub_cache(environ),
            triton_interpret=interpret,
            cpu_isa=cpu_isa,
            cpu_build_dir=Path(build_dir).expanduser() if build_dir else None,
            cpu_malloc=cpu_malloc,
            torchrun_keys=frozenset(k for k in TORCHRUN_KEYS if k in environ),
            world_size=_count(environ, "WORLD_SIZE", 1),
            rank=_count(environ, "RANK", 0),
            local_rank=_count(environ, "LOCAL_RANK", 0),
        )


def _count(environ: Mapping[str, str], key: str, default: int) -> int:
    raw = environ.get(key, "").strip() or str(default)
    if not raw.isdigit() or int(raw) < default:
        raise ValueError(f"{key}={raw!r} is not a count of processes (torchrun sets it).")
    return int(raw)


def _hf_hub_cache(environ: Mapping[str, str]) -> Path:
    cache = environ.get("HF_HUB_CACHE") or environ.get("HUGGINGFACE_HUB_CACHE")
    if cache:
        return Path(cache).expanduser()
    home = environ.get("HF_HOME") or os.path.join(environ.get("XDG_CACHE_HOME") or "~/.cache", "huggingface")
    return Path(home).expanduser() / "hub"


@functools.cache
def settings() -> Settings:
    """Settings read from the environment once per process (tests call `settings.cache_clear()`)."""
    return Settings.from_env(os.environ)
