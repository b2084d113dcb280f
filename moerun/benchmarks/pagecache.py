"""The page cache, for benchmarks that must read files cold: drop a file's cached pages, and ask
how much of a byte range is cached."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from pathlib import Path

import numpy as np


def drop_page_cache(path: Path) -> None:
    """Ask the kernel to drop the file's clean cached pages (POSIX_FADV_DONTNEED). Pages some process
    has mapped and touched stay (a resident model's experts), and so does the whole file where the
    file system is memory itself (tmpfs); `cached_fraction` says what stayed."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _mincore():
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True).mincore
    except (OSError, AttributeError, TypeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    return fn


_MINCORE = _mincore()


def cached_fraction(path: Path, ranges: list[tuple[int, int]]) -> float | None:
    """The fraction of the pages of byte ranges [begin, end) of `path` in the page cache (mincore on
    a fresh read-only map, which touches nothing); None where mincore is not available."""
    if _MINCORE is None:
        return None
    data = np.memmap(path, dtype=np.uint8, mode="r")
    page = os.sysconf("SC_PAGE_SIZE")
    vec = np.zeros(-(-data.size // page), dtype=np.uint8)
    if _MINCORE(data.ctypes.data, data.size, vec.ctypes.data) != 0:
        return None
    pages = np.concatenate([np.arange(b // page, -(-e // page)) for b, e in ranges])
    fraction = float((vec[pages] & 1).mean())
    del data
    return fraction
