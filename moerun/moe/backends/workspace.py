"""Reusable scratch buffers for one layer's large temporaries.

A fresh multi-megabyte CPU tensor is a fresh mmap: writing it page-faults every 4 KiB page, which
costs as much as the arithmetic for prefill-sized rows. A Workspace hands out views of buffers
that persist between calls and only grow.
"""

from __future__ import annotations

import torch


class Workspace:
    def __init__(self):
        self._buffers: dict[str, torch.Tensor] = {}

    def get(
        self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        """An uninitialised [shape] view of the buffer called `name` (valid until the next get of it)."""
        numel = 1
        for dim in shape:
            numel *= dim
        buffer = self._buffers.get(name)
        if buffer is None or buffer.numel() < numel or buffer.dtype != dtype or buffer.device != device:
            buffer = torch.empty(numel, dtype=dtype, device=device)
            self._buffers[name] = buffer
        return buffer[:numel].view(shape)
