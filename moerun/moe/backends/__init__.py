"""Backends: objects with one interface and declared capabilities, made once at load (`make_backend`)
with how their kernels compute.

`torch` is the reference (plain PyTorch, any device); `cpu` runs on the native CPU kernels
(moerun.cpu) with the weights in the file's format, every linear of the model included; `triton` is
the GPU path (moerun.kernels), which also runs on CPU tensors in triton's interpreter
(`TRITON_INTERPRET=1`), as the tests run it. `auto`: triton on CUDA, cpu on a CPU where the native
kernels run, else torch.

What a backend does for a MoE layer: `route` (router logits, checked, and the selection where its
kernels make it), `experts` (a step's tokens through their experts and the ordered combine, whatever
plan its kernels want), `expert_rows` over a batched plan (expert parallelism: a rank's span of
rows), `shared_expert`, and `linear` for every other projection. What it declares:
  streams_prefill   prefill visits experts group by group, so a stream can fetch them in turn
                    (triton's one grouped GEMM reads every touched expert at once: no)
  native_linears    every linear runs on its kernels, quantised weights kept in the file's format
  one_call_decode   one token of one sequence runs as native calls (moerun.decoder.native_step)
  reads_experts_in_place  its kernels read routed experts where the file put them: gate and up
                    apart, or each expert's matrix on its own (moerun.quant.halves): no copy
"""

from __future__ import annotations

import importlib.util

import torch

from moerun.moe.backends.base import ActivationMode, Backend
from moerun.settings import settings

__all__ = ["BACKENDS", "ActivationMode", "Backend", "make_backend", "resolve_backend"]

BACKENDS = ("auto", "torch", "triton", "cpu")


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


def make_backend(
    name: str, device: torch.device | str, dtype: torch.dtype, activations: ActivationMode | None = None
) -> Backend:
    """The backend `name` ("auto" resolved for `device`) computing in `dtype`, its `activations`
    decided here (None: the backend's default). cpu quantises activations to int8 unless the compute
    dtype is fp32 (whose users ask for the exact numbers; docs/PERFORMANCE.md measured the rest);
    triton keeps them in the compute dtype until measured on a GPU (bench/gpu_kernels.py times
    both); torch, the reference, never quantises them."""
    resolved = resolve_backend(name, torch.device(device))
    if resolved == "cpu":
        from moerun.moe.backends.cpu_backend import CpuBackend

        default = ActivationMode.EXACT if dtype == torch.float32 else ActivationMode.INT8
        return CpuBackend(activations or default)
    if resolved == "triton":
        from moerun.moe.backends.triton_backend import TritonBackend

        return TritonBackend(activations or ActivationMode.EXACT)
    from moerun.moe.backends.torch_backend import TorchBackend

    return TorchBackend()
