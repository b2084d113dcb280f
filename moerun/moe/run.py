"""How a model runs, decided once at load: `RunSpec`, read by the model and each of its layers.

Nothing here changes while the model runs: the device and compute dtype, the backend object (which
already knows whether its kernels quantise activations), the dequantised-expert cache, expert
streaming (the expert cache and how many of the next layer's experts to prefetch) and expert
parallelism (this process's place in the group; moerun.distributed.ExpertParallel, which moe/ knows
only as the exchange it calls).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moerun.moe.backends import ActivationMode, Backend, make_backend
from moerun.offload import ExpertCache
from moerun.quant.cache import DequantCache

DEFAULT_PREFILL_CHUNK = 512  # positions a forward pass takes at most (a longer prompt runs in chunks)


@dataclass(frozen=True)
class RunSpec:
    device: torch.device
    dtype: torch.dtype  # the compute dtype of dense weights, activations between blocks and the KV cache
    backend: Backend
    dequant_cache: DequantCache | None = None  # prefill's dequantised experts, kept (None: not kept)
    expert_cache: ExpertCache | None = None  # stream routed experts through it (None: all resident)
    prefetch_k: int = 0  # streaming: the next MoE layer's predicted experts loaded while one computes
    expert_parallel: object | None = None  # moerun.distributed.ExpertParallel: this rank's share
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK

    def __post_init__(self):
        if self.prefetch_k and self.expert_cache is None:
            raise ValueError("prefetch_k needs expert_cache_gb: prefetching feeds the expert cache.")

    @classmethod
    def make(
        cls,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        backend: str = "auto",
        activations: ActivationMode | None = None,
        *,
        dequant_cache: DequantCache | None = None,
        expert_cache: ExpertCache | None = None,
        prefetch_k: int | None = None,
        expert_parallel: object | None = None,
    ) -> RunSpec:
        """A spec with the backend named (`auto` resolved for the device) made for `dtype` with its
        `activations` (None: the backend's default; moerun.moe.backends.make_backend)."""
        device = torch.device(device)
        return cls(
            device=device,
            dtype=dtype,
            backend=make_backend(backend, device, dtype, activations),
            dequant_cache=dequant_cache,
            expert_cache=expert_cache,
            prefetch_k=prefetch_k or 0,
            expert_parallel=expert_parallel,
        )

    @property
    def serves_experts_only(self) -> bool:
        """Expert parallelism, a rank other than 0: it computes its experts' rows for rank 0's
        steps, never the dense part (held as storage-free stand-ins: nothing read or copied)."""
        return self.expert_parallel is not None and not self.expert_parallel.leads
