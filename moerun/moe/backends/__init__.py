"""Backends: modules with the same functions and signatures: `batch_plan`, `expert_rows`,
`combine` for prefill; `token_plan`, `token_forward` for decode; `shared_expert`. `torch` is the
reference and the CPU path; `triton` is the GPU path (moerun.kernels), which also runs on CPU
tensors in triton's interpreter (`TRITON_INTERPRET=1`), as the tests run it."""

from __future__ import annotations

import importlib.util
from types import ModuleType

import torch

from moerun.settings import settings

Backend = ModuleType

BACKENDS = ("auto", "torch", "triton")


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
