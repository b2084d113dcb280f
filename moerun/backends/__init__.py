"""Backends: modules with the same functions (`expert_rows`, `token_rows`, `combine`,
`combine_token`, `shared_expert`) and signatures. `torch` is the reference and the CPU path."""

from __future__ import annotations

from types import ModuleType

Backend = ModuleType

BACKENDS = ("torch",)


def get_backend(name: str) -> Backend:
    if name == "torch":
        from moerun.backends import torch_backend

        return torch_backend
    raise ValueError(f"backend={name!r} is not available; choose one of {list(BACKENDS)}.")
