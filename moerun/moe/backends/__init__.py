"""Backends: modules with the same functions and signatures: `batch_plan`, `expert_rows`,
`combine` for prefill; `token_plan`, `token_forward` for decode; `shared_expert` (each given the
layer's KernelOptions). `torch` is the reference (plain PyTorch, any device); `cpu` runs on the
native CPU kernels (moerun.cpu) with the weights in the file's format; `triton` is the GPU path
(moerun.kernels), which also runs on CPU tensors in triton's interpreter (`TRITON_INTERPRET=1`), as
the tests run it. `auto`: triton on CUDA, cpu on a CPU where the native kernels run, else torch."""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from types import ModuleType

import torch

from moerun.settings import settings

Backend = ModuleType

BACKENDS = ("auto", "torch", "triton", "cpu")


@dataclass(frozen=True)
class KernelOptions:
    """How a layer's kernels compute, fixed when the layer is made. `int8_activations`: activations
    quantised per block to int8 (q8_1 on the GPU, q8_K / q8_0 on the CPU) for integer dot products
    with the quantised weights, as llama.cpp does; False: activations stay in the compute dtype;
    None: the backend's default (cpu: on unless the compute dtype is fp32, as measured in
    docs/PERFORMANCE.md; triton: off until measured on a GPU, bench/gpu_kernels.py times both)."""

    int8_activations: bool | None = None

    def int8_on_cpu(self, dtype: torch.dtype) -> bool:
        """Whether the cpu backend quantises activations: as asked, else unless `dtype` is fp32."""
        return self.int8_activations if self.int8_activations is not None else dtype != torch.float32


DEFAULT_KERNEL_OPTIONS = KernelOptions()


def resolve_backend(name: str, device: torch.device) -> str:
    """`auto` -> triton on CUDA when triton is installed, cpu on a CPU where the native kernels run
    (moerun.cpu builds them on first use, or says once why it cannot), else torch; checks that
    `name` can run on `device`."""
    if name not in BACKENDS:
        raise ValueError(f"backend={name!r} is not available; choose one of {list(BACKENDS)}.")
    has_triton = importlib.util.find_spec("triton") is not None
    if name == "auto":
        if device.type == "cuda":
            return "triton" if has_triton else "torch"
        return "cpu" if device.type == "cpu" and _native_cpu() else "torch"
    if name == "cpu":
        if device.type != "cpu":
            raise ValueError(f"backend='cpu' runs on the CPU, not on {device.type}.")
        if not _native_cpu():
            from moerun import cpu

            raise ValueError(f"backend='cpu' needs the native CPU kernels: {cpu.unavailable_reason()}")
    if name == "triton":
        if not has_triton:
            raise ValueError("backend='triton' needs the triton package: pip install triton.")
        if device.type != "cuda" and not settings().triton_interpret:
            raise ValueError(
                f"backend='triton' runs on CUDA devices; on {device.type} it needs TRITON_INTERPRET=1 "
                "(triton's interpreter: slow, meant for tests)."
            )
    return name


def _native_cpu() -> bool:
    from moerun import cpu  # imported on first use: loading it may build the kernels

    return cpu.available()


def get_backend(name: str) -> Backend:
    if name == "cpu":
        from moerun.moe.backends import cpu_backend

        return cpu_backend
    if name == "torch":
        from moerun.moe.backends import torch_backend

        return torch_backend
    if name == "triton":
        from moerun.moe.backends import triton_backend

        return triton_backend
    raise ValueError(f"backend={name!r} is not available; choose one of {list(BACKENDS[1:])}.")
