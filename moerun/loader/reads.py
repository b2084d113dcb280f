"""Byte ranges of checkpoint files read into the caller's buffers, for expert streaming.

`FileReader` holds the files open and fills buffers (memoryviews, filled in order) from one
contiguous range of a file with `os.preadv`: only those bytes are touched, the GIL is released while
reading, and a file truncated under us gives a short read, refused with a `FileReadError` that says
so, instead of the SIGBUS a memory map would give. A long range is read as several chunks at once.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

try:
    _IOV_MAX = os.sysconf("SC_IOV_MAX")  # buffers one preadv call may scatter into
except (AttributeError, OSError, ValueError):
    _IOV_MAX = 1024
_IOV_MAX = _IOV_MAX if _IOV_MAX > 0 else 1024
# A read of at least two chunks is cut into chunks read at once on IO_THREADS threads.
# Measured on the offload bench's OLMoE experts (12 MiB, cold page cache, 8 misses a layer on 4
# readers): 4 MiB x 8 threads fetched 0.87-0.95 GB/s against 0.63-0.72 GB/s unsplit; 1-2 MiB
# chunks or 16 threads were no better, 8 MiB (experts left whole) no different from unsplit.
READ_CHUNK_BYTES = 4 * 2**20
IO_THREADS = 8


class FileReadError(RuntimeError):
    """A range of a file could not be read (I/O error, file truncated or replaced while running)."""


class FileReader:
    """The checkpoint files, open for reading, and a pool that reads one long range as several
    chunks at once: one expert's read alone keeps several requests in flight, which a disk (and a
    virtual one more so) needs to approach its bandwidth; misses read on `readers` threads each."""

    def __init__(self, paths: Iterable[Path], chunk_bytes: int = READ_CHUNK_BYTES, threads: int = IO_THREADS):
        self.fds: dict[Path, int] = {}
        try:
            for path in sorted(set(paths)):
                self.fds[path] = os.open(path, os.O_RDONLY)
        except OSError:
            self.close()
            raise
        self.chunk_bytes = chunk_bytes
        use_pool = chunk_bytes > 0 and threads > 0 and self.fds
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="moerun-expert-io") if use_pool else None

    def read(self, path: Path, offset: int, buffers: list[memoryview], where: str) -> None:
        """Fill `buffers` from `path`'s contiguous range at `offset` (chunks of it in parallel);
        `where` names what the bytes are, for the error message."""
        fd = self.fds[path]
        total = sum(len(b) for b in buffers)
        if self._pool is None or total < 2 * self.chunk_bytes:
            _pread(fd, buffers, offset, path, where)
            return
        chunks = _chunks(buffers, self.chunk_bytes)
        futures = [self._pool.submit(_pread, fd, bufs, offset + at, path, where) for at, bufs in chunks[1:]]
        try:
            _pread(fd, chunks[0][1], offset, path, where)
        finally:
            errors = [f.exception() for f in futures]  # every chunk lands (or fails) before we return
        for err in errors:
            if err is not None:
                raise err

    def close(self) -> None:
        if getattr(self, "_pool", None) is not None:
            self._pool.shutdown(wait=True)
        for fd in self.fds.values():
            os.close(fd)
        self.fds.clear()


def _chunks(buffers: list[memoryview], size: int) -> list[tuple[int, list[memoryview]]]:
    """`buffers` (filled in order from one range) cut into (offset in the range, buffers) of `size`
    bytes each, the last one shorter."""
    chunks: list[tuple[int, list[memoryview]]] = [(0, [])]
    at, room = 0, size
    for buf in (b.cast("B") for b in buffers):
        while len(buf):
            if room == 0:
                chunks.append((at, []))
                room = size
            piece, buf = buf[:room], buf[room:]
            chunks[-1][1].append(piece)
            at += len(piece)
            room -= len(piece)
    return chunks


def _pread(fd: int, buffers: list[memoryview], offset: int, path: Path, where: str) -> None:
    """Fill `buffers` from the file's contiguous range at `offset` (`os.preadv` scatters it, at most
    IOV_MAX buffers a call); a short read means the file shrank under us."""
    total = sum(len(b) for b in buffers)
    pending, first, done = [b.cast("B") for b in buffers if len(b)], 0, 0
    try:
        while first < len(pending):
            n = os.preadv(fd, pending[first : first + _IOV_MAX], offset + done)
            if n == 0:
                size = os.fstat(fd).st_size
                raise FileReadError(
                    f"{path}: {where} needs bytes [{offset}, {offset + total}) but the file now ends at "
                    f"{size}; it was truncated or replaced while moerun was running."
                )
            done += n
            while n:  # step past the filled buffers, trim a partly filled one
                if n >= len(pending[first]):
                    n -= len(pending[first])
                    first += 1
                else:
                    pending[first], n = pending[first][n:], 0
    except OSError as err:
        raise FileReadError(f"{path}: reading {where} failed ({err}).") from err
