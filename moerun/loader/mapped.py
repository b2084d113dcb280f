"""Files as copy-on-write memory maps, and typed views of their bytes: shared by the format readers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch


def map_file(path: Path) -> torch.Tensor:
    """The whole file as a uint8 [size] tensor over a private (copy-on-write) memory map: pages are
    read from disk when first touched, and a write to the tensor changes a private copy of its page,
    never the file, so callers may modify what they are given."""
    if path.stat().st_size == 0:  # mmap refuses empty files
        return torch.empty(0, dtype=torch.uint8)
    return torch.from_numpy(np.memmap(path, dtype=np.uint8, mode="c"))


def view_bytes(data: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Little-endian bytes uint8 [n] as a `dtype` tensor of `shape`, sharing their memory when the
    offset is aligned for `dtype`; a misaligned tensor (a file that does not pad) is copied first."""
    if data.storage_offset() % data.new_empty((), dtype=dtype).element_size():
        data = data.clone()
    return data.view(dtype).reshape(shape)
