"""Files as copy-on-write memory maps, and typed views of their bytes: shared by the format readers."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import sys
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch


@dataclass(frozen=True)
class MappedFile:
    """A checkpoint file and the uint8 tensor over its memory map (`map_file`'s)."""

    path: Path
    data: torch.Tensor


# The start address of every live map made by `map_file` (an entry goes when its map is unmapped),
# so `release_mapped` can tell a view of a file map from other memory.
_LIVE_MAPS: set[int] = set()


def map_file(path: Path) -> torch.Tensor:
    """The whole file as a uint8 [size] tensor over a private (copy-on-write) memory map: pages are
    read from disk when first touched, and a write to the tensor changes a private copy of its page,
    never the file, so callers may modify what they are given."""
    if path.stat().st_size == 0:  # mmap refuses empty files
        return torch.empty(0, dtype=torch.uint8)
    array = np.memmap(path, dtype=np.uint8, mode="c")
    data = torch.from_numpy(array)  # its storage keeps `array`, and so the map, alive
    _LIVE_MAPS.add(data.data_ptr())
    weakref.finalize(array, _LIVE_MAPS.discard, data.data_ptr())
    return data


def view_bytes(data: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Little-endian bytes uint8 [n] as a `dtype` tensor of `shape`, sharing their memory when the
    offset is aligned for `dtype`; a misaligned tensor (a file that does not pad) is copied first."""
    if data.storage_offset() % data.new_empty((), dtype=dtype).element_size():
        data = data.clone()
    return data.view(dtype).reshape(shape)


def _madvise():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError, TypeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return fn


_MADVISE = _madvise() if sys.platform.startswith("linux") else None
_MADV_DONTNEED = 4
_PAGE = mmap.PAGESIZE


def release_pages(data: torch.Tensor, begin: int, end: int) -> None:
    """Drop this process's pages of bytes [begin, end) of a mapped file (`map_file`'s tensor) once
    they have been copied elsewhere, so the loader does not hold a tensor twice. Only whole pages
    inside the range go; the next touch would read them from the file again. Never call it on bytes
    something still uses after writing to them: a private page written to is discarded too."""
    if data.numel():
        _release_range(data.data_ptr() + begin, data.data_ptr() + end)


def release_mapped(view: torch.Tensor) -> None:
    """`release_pages` for a contiguous tensor that may be a view of a `map_file` map (read, never
    written to): its whole pages go; anything else is left alone."""
    if view.untyped_storage().data_ptr() in _LIVE_MAPS and view.is_contiguous():
        _release_range(view.data_ptr(), view.data_ptr() + view.numel() * view.element_size())


def _release_range(begin: int, end: int) -> None:
    if _MADVISE is None:
        return
    first = -(-begin // _PAGE) * _PAGE
    last = end // _PAGE * _PAGE
    if last > first:
        _MADVISE(first, last - first, _MADV_DONTNEED)


_MADV_POPULATE_READ = 22  # Linux 5.14+: fault the range's pages in now, reading what is not cached
_POPULATE_CHUNK = 64 << 20  # bytes a call: the thread can stop between calls


def populate(views: list[torch.Tensor]) -> bool:
    """Map the pages of `views` (tensors that may be views of `map_file` maps; others are skipped)
    into this process now, reading from the file what the page cache lacks, in order of address and
    chunk by chunk. A resident model's experts are touched first by whichever token routes to them,
    each page one fault (a 30B-A3B model's 17 GB of experts are 4.5 million pages): populated ahead,
    decoding takes no fault, as llama.cpp's populated map does. False where the kernel cannot."""
    if _MADVISE is None:
        return False
    ranges = sorted(
        (v.data_ptr(), v.data_ptr() + v.numel() * v.element_size())
        for v in views
        if v.numel() and v.untyped_storage().data_ptr() in _LIVE_MAPS and v.is_contiguous()
    )
    merged: list[list[int]] = []
    for begin, end in ranges:
        if merged and begin <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([begin, end])
    for begin, end in merged:
        first, last = begin // _PAGE * _PAGE, -(-end // _PAGE) * _PAGE
        for start in range(first, last, _POPULATE_CHUNK):
            if _MADVISE(start, min(_POPULATE_CHUNK, last - start), _MADV_POPULATE_READ) != 0:
                return False  # an older kernel (EINVAL), or a map gone: the faults will do it
    return True


def populate_in_background(views: list[torch.Tensor]) -> threading.Thread:
    """`populate` on a daemon thread (it holds `views`, and so their maps, until it is done), so
    loading returns at once and the first prompt runs meanwhile."""
    thread = threading.Thread(target=populate, args=(views,), name="moerun-populate", daemon=True)
    thread.start()
    return thread
