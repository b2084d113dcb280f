"""Opt-in tracing of the MoE layer to stderr (`MOERUN_TRACE=perf,buffers`).

When tracing is off the layer gets `NO_TRACE`, whose stage() is a shared no-op context, so the
cost is one attribute lookup per stage.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator

import torch

from moerun.settings import settings


class LayerTrace:
    """Collects one layer call's stage times and prints them as one line when the call ends."""

    def __init__(self, layer_name: str, channels: frozenset[str]):
        self.layer_name = layer_name
        self.perf = "perf" in channels
        self.buffers = "buffers" in channels
        self.times_ms: dict[str, float] = {}

    @contextlib.contextmanager
    def stage(self, name: str, device: torch.device) -> Iterator[None]:
        if not self.perf:
            yield
            return
        _sync(device)
        start = time.perf_counter()
        yield
        _sync(device)
        self.times_ms[name] = self.times_ms.get(name, 0.0) + (time.perf_counter() - start) * 1e3

    def router_figures(
        self, logits: torch.Tensor, ids: torch.Tensor | None, weights: torch.Tensor | None, num_experts: int
    ) -> None:
        """Print the router's sanity figures: logits [T, E] fp32, ids [T, k], weights [T, k]."""
        if not self.buffers:
            return
        finite = logits[torch.isfinite(logits)]
        parts = [
            f"logits min={finite.min().item():.4g} max={finite.max().item():.4g}"
            if finite.numel()
            else "logits min=n/a max=n/a",
            f"nan={int(torch.isnan(logits).sum())} inf={int(torch.isinf(logits).sum())}",
        ]
        if ids is not None and weights is not None:
            out_of_range = int(((ids < 0) | (ids >= num_experts)).sum())
            parts.append(f"ids_out_of_range={out_of_range}")
            parts.append(f"weights min={weights.min().item():.4g} max={weights.max().item():.4g}")
        print(f"[moerun buffers] {self.layer_name} T={logits.shape[0]} " + " ".join(parts), file=sys.stderr)

    def finish(self, tokens: int) -> None:
        if self.perf and self.times_ms:
            stages = " ".join(f"{name}={ms:.3f}ms" for name, ms in self.times_ms.items())
            print(f"[moerun perf] {self.layer_name} T={tokens} {stages}", file=sys.stderr)


class _NoTrace:
    perf = False
    buffers = False
    _null = contextlib.nullcontext()

    def stage(self, name: str, device: torch.device) -> contextlib.nullcontext:
        return self._null

    def router_figures(self, *args, **kwargs) -> None:
        pass

    def finish(self, tokens: int) -> None:
        pass


NO_TRACE = _NoTrace()


def layer_trace(layer_name: str) -> LayerTrace | _NoTrace:
    channels = settings().trace
    return LayerTrace(layer_name, channels) if channels else NO_TRACE


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
