"""Byte ranges of checkpoint files read into the caller's buffers for expert streaming, around the
OS page cache.

`FileReader` holds the files open and fills buffers (memoryviews, filled in order) from one
contiguous range of a file. It reads with O_DIRECT: the disk puts the range's aligned superset (O_DIRECT
wants offsets, lengths and addresses in multiples of `DIRECT_ALIGN`) into a buffer of the reading
thread, and the range is copied from there into the caller's buffers. So reading an expert fills no
page cache: through the page cache (or a map of the file) every expert ever read would stay cached,
and under a memory limit the OS would make room by dropping what the model holds, then read it again.
Where the filesystem refuses O_DIRECT (tmpfs, some network and FUSE filesystems) moerun says so once
and reads with `os.preadv` straight into the buffers, then drops the range from the page cache
(`posix_fadvise(DONTNEED)`), so the cache still does not grow with what was read.

Either way only the range's bytes are read, the GIL is released while reading (and while copying a
long stretch), and a file truncated under us gives a short read, refused with a `FileReadError` that
says so, instead of the SIGBUS a memory map would give. A long range is read as several chunks at
once on a pool of threads. `counts` says how many ranges (and bytes from the disk) each way read.
"""

from __future__ import annotations

import bisect
import errno
import mmap
import os
import sys
import threading
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

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
# O_DIRECT's alignment: a disk's logical block is at most a page (most are 512 bytes)
DIRECT_ALIGN = 4096
_COPY_WITHOUT_GIL = 1 << 16  # a copy this long goes through numpy, which lets other threads run
_O_DIRECT = getattr(os, "O_DIRECT", 0)
SAID: set[int] = set()  # filesystems (st_dev) already reported as refusing O_DIRECT


class FileReadError(RuntimeError):
    """A range of a file could not be read (I/O error, file truncated or replaced while running)."""


class _DirectRefused(Exception):
    """The filesystem refused an O_DIRECT read (EINVAL) after accepting the open."""


class FileReader:
    """The checkpoint files, open for reading, and a pool that reads one long range as several
    chunks at once: one expert's read alone keeps several requests in flight, which a disk (and a
    virtual one more so) needs to approach its bandwidth; misses read on `readers` threads each.

    `direct` False reads every file with `preadv` (then dropping the range from the page cache);
    True uses O_DIRECT where the filesystem takes it."""

    def __init__(
        self,
        paths: Iterable[Path],
        chunk_bytes: int = READ_CHUNK_BYTES,
        threads: int = IO_THREADS,
        direct: bool = True,
    ):
        self.fds: dict[Path, int] = {}
        self.direct_fds: dict[Path, int] = {}
        self._refused: set[Path] = set()
        try:
            for path in sorted(set(paths)):
                self.fds[path] = os.open(path, os.O_RDONLY)
                fd = _open_direct(path) if direct else None
                if fd is not None:
                    self.direct_fds[path] = fd
                elif direct:
                    _say_buffered(path, self.fds[path])
        except OSError:
            self.close()
            raise
        self.chunk_bytes = chunk_bytes
        # chunks of an O_DIRECT read: whole blocks, at least one
        self.direct_chunk = max(DIRECT_ALIGN, -(-chunk_bytes // DIRECT_ALIGN) * DIRECT_ALIGN)
        use_pool = chunk_bytes > 0 and threads > 0 and self.fds
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="moerun-expert-io") if use_pool else None
        self._local = threading.local()  # each thread's aligned buffer for O_DIRECT
        self._lock = threading.Lock()
        self.counts = {"direct": [0, 0], "pread": [0, 0]}  # way -> [ranges read, bytes from the disk]

    def direct(self, path: Path) -> bool:
        """Whether `path` is read with O_DIRECT (False: pread, then dropped from the page cache)."""
        return path in self.direct_fds and path not in self._refused

    def read(self, path: Path, offset: int, buffers: list[memoryview], where: str) -> None:
        """Fill `buffers` from `path`'s contiguous range at `offset` (chunks of it in parallel);
        `where` names what the bytes are, for the error message."""
        buffers = [b.cast("B") for b in buffers]
        if self.direct(path):
            try:
                self._read_direct(path, offset, buffers, where)
                return
            except _DirectRefused:
                with self._lock:
                    if path not in self._refused:
                        self._refused.add(path)
                        _say_buffered(path, self.fds[path])
        self._read_buffered(path, offset, buffers, where)

    def _read_direct(self, path: Path, offset: int, buffers: list[memoryview], where: str) -> None:
        fd, total = self.direct_fds[path], sum(len(b) for b in buffers)
        if total == 0:
            return
        begin = offset - offset % DIRECT_ALIGN
        end = -(-(offset + total) // DIRECT_ALIGN) * DIRECT_ALIGN
        spans = [(at, min(at + self.direct_chunk, end)) for at in range(begin, end, self.direct_chunk)]
        scatter = _Scatter(buffers, offset)
        job = (fd, scatter, path, where)
        self._run([(self._direct_span, (*job, a, b)) for a, b in spans])
        self._count("direct", end - begin)

    def _direct_span(self, fd: int, scatter: _Scatter, path: Path, where: str, begin: int, end: int) -> None:
        """Bytes [begin, end) (aligned) into this thread's aligned buffer, then what of them the
        caller wants into its buffers."""
        view = self._buffer()[: end - begin]
        want = min(end, scatter.end) - begin  # the file may end inside the last block
        got = 0
        try:
            while got < want:
                n = os.preadv(fd, [view[got:]], begin + got)
                if n == 0:
                    raise _truncated(fd, path, where, scatter.begin, scatter.end)
                got += n
        except OSError as err:
            if err.errno == errno.EINVAL:
                raise _DirectRefused from err
            raise FileReadError(f"{path}: reading {where} failed ({err}).") from err
        scatter.fill(begin, view[:got])

    def _buffer(self) -> memoryview:
        """This thread's page-aligned buffer of one chunk (an anonymous map: aligned by construction)."""
        buf = getattr(self._local, "view", None)
        if buf is None:
            self._local.map = mmap.mmap(-1, self.direct_chunk)
            buf = self._local.view = memoryview(self._local.map)
        return buf

    def _read_buffered(self, path: Path, offset: int, buffers: list[memoryview], where: str) -> None:
        fd = self.fds[path]
        total = sum(len(b) for b in buffers)
        if self._pool is None or total < 2 * self.chunk_bytes:
            jobs = [(_pread, (fd, buffers, offset, path, where))]
        else:
            chunks = _chunks(buffers, self.chunk_bytes)
            jobs = [(_pread, (fd, bufs, offset + at, path, where)) for at, bufs in chunks]
        self._run(jobs)
        self._count("pread", total)
        # what was read leaves the page cache (whole pages: a page shared with a neighbouring tensor is
        # read again if that tensor wants it; pages a map holds are not dropped)
        begin = offset - offset % DIRECT_ALIGN
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, begin, offset + total - begin, os.POSIX_FADV_DONTNEED)

    def _run(self, jobs: list) -> None:
        """Run `jobs` [(fn, args)]: the first on this thread, the others on the pool; every one
        lands (or fails) before this returns, and the first error is raised."""
        if self._pool is None or len(jobs) == 1:
            for fn, args in jobs:
                fn(*args)
            return
        futures = [self._pool.submit(fn, *args) for fn, args in jobs[1:]]
        try:
            jobs[0][0](*jobs[0][1])
        finally:
            errors = [f.exception() for f in futures]
        for err in errors:
            if err is not None:
                raise err

    def _count(self, way: str, nbytes: int) -> None:
        with self._lock:
            self.counts[way][0] += 1
            self.counts[way][1] += nbytes

    def drop_cached(self) -> None:
        """Drop the files' pages from the page cache (those no map holds), e.g. the dense part's
        once a streamed model has its own copy, so they are not charged to this process's memory."""
        if hasattr(os, "posix_fadvise"):
            for fd in self.fds.values():
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        if getattr(self, "_pool", None) is not None:
            self._pool.shutdown(wait=True)
        for fd in (*self.fds.values(), *self.direct_fds.values()):
            os.close(fd)
        self.fds.clear()
        self.direct_fds.clear()


class _Scatter:
    """Buffers filled in order from the file range [begin, end), filled piece by piece in any order."""

    def __init__(self, buffers: list[memoryview], begin: int):
        self.buffers = [b for b in buffers if len(b)]
        self.starts = []  # file offset of each buffer's first byte
        at = begin
        for b in self.buffers:
            self.starts.append(at)
            at += len(b)
        self.begin, self.end = begin, at

    def fill(self, at: int, data: memoryview) -> None:
        """Copy `data` (the file's bytes from offset `at`) into the buffers where they overlap."""
        lo, hi = max(at, self.begin), min(at + len(data), self.end)
        i = max(bisect.bisect_right(self.starts, lo) - 1, 0)
        while lo < hi:
            buf, start = self.buffers[i], self.starts[i]
            n = min(hi, start + len(buf)) - lo
            _copy(buf[lo - start : lo - start + n], data[lo - at : lo - at + n])
            lo += n
            i += 1


def _copy(dest: memoryview, src: memoryview) -> None:
    if len(dest) >= _COPY_WITHOUT_GIL:
        np.copyto(np.frombuffer(dest, np.uint8), np.frombuffer(src, np.uint8))
    else:
        dest[:] = src


def _open_direct(path: Path) -> int | None:
    """`path` opened with O_DIRECT, or None where the platform or filesystem refuses it."""
    if not _O_DIRECT:
        return None
    try:
        return os.open(path, os.O_RDONLY | _O_DIRECT)
    except OSError as err:
        if err.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            return None
        raise


def _say_buffered(path: Path, fd: int) -> None:
    """Once per filesystem: its files are read through the page cache."""
    dev = os.fstat(fd).st_dev
    if dev in SAID:
        return
    SAID.add(dev)
    print(
        f"moerun: {path}: its filesystem refuses O_DIRECT, so experts are read with pread and dropped "
        "from the page cache after each read.",
        file=sys.stderr,
        flush=True,
    )


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


def _truncated(fd: int, path: Path, where: str, begin: int, end: int) -> FileReadError:
    return FileReadError(
        f"{path}: {where} needs bytes [{begin}, {end}) but the file now ends at {os.fstat(fd).st_size}; "
        "it was truncated or replaced while moerun was running."
    )


def _pread(fd: int, buffers: list[memoryview], offset: int, path: Path, where: str) -> None:
    """Fill `buffers` from the file's contiguous range at `offset` (`os.preadv` scatters it, at most
    IOV_MAX buffers a call); a short read means the file shrank under us."""
    total = sum(len(b) for b in buffers)
    pending, first, done = [b.cast("B") for b in buffers if len(b)], 0, 0
    try:
        while first < len(pending):
            n = os.preadv(fd, pending[first : first + _IOV_MAX], offset + done)
            if n == 0:
                raise _truncated(fd, path, where, offset, offset + total)
            done += n
            while n:  # step past the filled buffers, trim a partly filled one
                if n >= len(pending[first]):
                    n -= len(pending[first])
                    first += 1
                else:
                    pending[first], n = pending[first][n:], 0
    except OSError as err:
        raise FileReadError(f"{path}: reading {where} failed ({err}).") from err
