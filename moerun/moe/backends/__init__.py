"""Backends: modules with the same functions and signatures: `batch_plan`, `expert_rows`,
`combine` for prefill; `token_plan`, `token_forward` for decode (with the layer's KernelOptions);
`shared_expert`. `torch` is the
reference and the CPU path; `triton` is the GPU path (moerun.kernels), which also runs on CPU
tensors in triton's interpreter (`TRITON_INTERPRET=1`), as the tests run it."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from types import ModuleType

import torch

from moerun.settings import settings

Backend = ModuleType

BACKENDS = ("auto", "torch", "triton")


@dataclass(frozen=True)
class KernelOptions:
    """How a layer's kernels compute, fixed when the layer is made. `int8_activations`: decode
    quantises each token's activations per block to int8 (q8_1) for integer dot products with the
    quantised weights, as llama.cpp does (the triton backend; off until measured on a GPU:
    bench/gpu_kernels.py times both); off: activations stay in the compute dtype."""

    int8_activations: bool = False


DEFAULT_KERNEL_OPTIONS = KernelOptions()


def resolve_backend(name: str, device: torch.device) -> str:
    """`auto` -> triton on CUDA when triton is installed, else torch; checks that `name` can run
    on `device`."""
    if name not in BACKENDS:
        raise ValueError(f"backend={name!r} is not available; choose one of {list(BACKENDS)}.")
    has_triton = importlib.util.find_spec("triton") is not None
    if name == "auto":
        return "triton" if device.type == "cuda" and has_triton else "torch"
    if name == "triton":
        if not has_triton:
            raise ValueError("backend='triton' needs the triton package: pip install triton.")
        if device.type != "cuda" and not settings().triton_interpret:
            raise ValueError(
                f"backend='triton' runs on CUDA devices; on {device.type} it needs TRITON_INTERPRET=1 "
                "(triton's interpreter: slow, meant for tests)."
            )
    return name


def get_backend(name: str) -> Backend:
    if name == "torch":
        from moerun.moe.backends import torch_backend

        return torch_backend
    if name == "triton":
        from moerun.moe.backends import triton_backend

        return triton_backend
    raise ValueError(f"backend={name!r} is not available; choose one of {list(BACKENDS[1:])}.")
