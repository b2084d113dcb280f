"""The page cache, for benchmarks that must read files cold: drop a file's cached pages, ask how much
of a byte range is cached, and measure how fast the disk reads a file sequentially."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import sys
import time
from dataclasses import dataclass
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


@dataclass(frozen=True)
class DiskRead:
    """A sequential read of a file from the disk: bytes per second, the bytes read and how the page
    cache was kept out ("O_DIRECT", or "after POSIX_FADV_DONTNEED" where O_DIRECT is refused)."""

    bytes_per_s: float
    nbytes: int
    method: str


def sequential_read(path: Path, limit: int = 1 << 30, chunk: int = 8 << 20) -> DiskRead:
    """Read up to `limit` bytes of `path` from its start in `chunk`-byte reads, bypassing the page
    cache (O_DIRECT into a page-aligned buffer; where the file system refuses it, after dropping the
    file's cached pages), and time it."""
    size = min(os.path.getsize(path), limit) // 4096 * 4096
    chunk = max(min(chunk, size), 4096)
    buffer = mmap.mmap(-1, chunk)  # page-aligned, as O_DIRECT needs
    try:
        return _timed_read(path, size, buffer, os.O_DIRECT, "O_DIRECT")
    except OSError:  # EINVAL: a file system without direct I/O (tmpfs)
        drop_page_cache(path)
        return _timed_read(path, size, buffer, 0, "after POSIX_FADV_DONTNEED")
    finally:
        buffer.close()


def _timed_read(path: Path, size: int, buffer: mmap.mmap, flags: int, method: str) -> DiskRead:
    fd = os.open(path, os.O_RDONLY | flags)
    try:
        done, start = 0, time.perf_counter()
        while done < size:
            got = os.preadv(fd, [buffer], done)
            if got <= 0:
                break
            done += got
        seconds = time.perf_counter() - start
    finally:
        os.close(fd)
    return DiskRead(done / max(seconds, 1e-9), done, method)
