"""moerun.loader.reads: byte ranges of a file scattered into buffers, a long range read in parallel
chunks, and a file cut short under the reader refused with a sentence; O_DIRECT reads of ranges off
its alignment, the pread fallback (a filesystem refusing O_DIRECT at open or at read), and the page
cache left as it was (mincore)."""

import ctypes
import errno
import mmap
import os
import sys

import numpy as np
import pytest
import torch

from moerun.loader import reads
from moerun.loader.reads import FileReader, FileReadError, _chunks


def test_chunks_cover_the_buffers_in_order():
    buffers = [memoryview(bytearray(n)) for n in (5, 0, 11, 3)]
    chunks = _chunks(buffers, 4)
    assert [at for at, _ in chunks] == [0, 4, 8, 12, 16]
    assert [sum(len(b) for b in bufs) for _, bufs in chunks] == [4, 4, 4, 4, 3]


def test_a_long_range_is_read_in_parallel_chunks(tmp_path):
    data = torch.randint(0, 256, (10_000,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    path = tmp_path / "blob"
    path.write_bytes(data.numpy().tobytes())
    reader = FileReader([path], chunk_bytes=333, threads=3)
    out = torch.zeros(50, 150, dtype=torch.uint8)  # 7500 bytes: rows scattered as even then odd
    flat = memoryview(out.view(-1).numpy())
    rows = [flat[r * 150 : (r + 1) * 150] for r in (*range(0, 50, 2), *range(1, 50, 2))]
    reader.read(path, 1000, rows, "a test range")
    want = data[1000:8500].view(50, 150)
    assert torch.equal(out[0::2], want[:25]) and torch.equal(out[1::2], want[25:])
    with open(path, "r+b") as handle:
        handle.truncate(5000)
    with pytest.raises(FileReadError, match="a test range needs bytes .* truncated or replaced"):
        reader.read(path, 1000, rows, "a test range")
    reader.close()


# -- O_DIRECT, the pread fallback, and the page cache ----------------------------------------


def _blob(path, size=3 * 4096 * 7 + 123, seed=5) -> bytes:
    data = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    path.write_bytes(data.numpy().tobytes())
    return path.read_bytes()


def _direct_reader(path, **kw) -> FileReader:
    reader = FileReader([path], **kw)
    if not reader.direct(path):
        reader.close()
        pytest.skip(f"the filesystem of {path} refuses O_DIRECT")
    return reader


@pytest.mark.parametrize("chunk", [4096, 3 * 4096, 2**20], ids=["1-block", "3-block", "whole"])
def test_direct_reads_unaligned_ranges_into_scattered_buffers(tmp_path, chunk):
    """Offsets, lengths and buffer addresses off O_DIRECT's alignment, ranges crossing chunk borders
    and running to the file's last byte: the bytes are the file's (Python's own read of it)."""
    path = tmp_path / "blob"
    data = _blob(path)
    reader = _direct_reader(path, chunk_bytes=chunk, threads=3)
    gen = torch.Generator().manual_seed(6)
    ranges = [(1, 10), (4095, 2), (4096, 4096), (777, 20_000), (len(data) - 5000, 5000), (0, len(data))]
    for offset, size in ranges:
        out = torch.zeros(size + 3, dtype=torch.uint8)  # +1 below: buffers start off alignment
        flat = memoryview(out.numpy())
        cuts = sorted({0, size, *torch.randint(0, size, (4,), generator=gen).tolist()})
        buffers = [flat[1 + a : 1 + b] for a, b in zip(cuts, cuts[1:], strict=False)]
        reader.read(path, offset, buffers, "a test range")
        assert bytes(out[1 : 1 + size].numpy()) == data[offset : offset + size]
        assert out[0] == 0 and out[size + 1] == 0  # nothing written around the buffers
    assert reader.counts["direct"][0] == len(ranges) and reader.counts["pread"][0] == 0
    reader.close()


def test_a_file_cut_short_under_a_direct_read_is_refused(tmp_path):
    path = tmp_path / "blob"
    _blob(path)
    reader = _direct_reader(path, chunk_bytes=4096, threads=2)
    with open(path, "r+b") as handle:
        handle.truncate(10_000)
    out = memoryview(bytearray(5000))
    with pytest.raises(FileReadError, match=r"a test range needs bytes \[8000, 13000\) .* ends at 10000"):
        reader.read(path, 8000, [out], "a test range")
    reader.close()


def test_a_filesystem_refusing_direct_reads_falls_back_to_pread_and_says_so_once(
    tmp_path, monkeypatch, capsys
):
    """A filesystem that refuses O_DIRECT at open (EINVAL, as tmpfs did before Linux 6.6): pread
    reads the same bytes; the note comes once for the filesystem, however many readers open it."""
    path = tmp_path / "blob"
    data = _blob(path)
    real = os.open

    def refusing(name, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(name, flags, *args)

    monkeypatch.setattr(reads.os, "open", refusing)
    reads.SAID.clear()
    readers = [FileReader([path]) for _ in range(2)]
    said = capsys.readouterr().err
    assert said.count("refuses O_DIRECT") == 1 and str(path) in said
    out = memoryview(bytearray(9000))
    readers[0].read(path, 333, [out], "a test range")
    assert bytes(out) == data[333:9333]
    assert readers[0].counts == {"direct": [0, 0], "pread": [1, 9000]}
    for reader in readers:
        reader.close()


def test_a_direct_read_refused_at_read_time_falls_back_to_pread(tmp_path, monkeypatch, capsys):
    """Some filesystems take the O_DIRECT open and refuse the read (EINVAL): the range is read again
    with pread, and the file is read that way from then on."""
    path = tmp_path / "blob"
    data = _blob(path)
    reader = _direct_reader(path, chunk_bytes=4096, threads=2)
    real = os.preadv
    direct_fd = reader.direct_fds[path]

    def refusing(fd, buffers, offset):
        if fd == direct_fd:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, buffers, offset)

    monkeypatch.setattr(reads.os, "preadv", refusing)
    reads.SAID.clear()
    out = memoryview(bytearray(10_000))
    reader.read(path, 100, [out], "a test range")
    assert bytes(out) == data[100:10_100]
    assert not reader.direct(path) and "refuses O_DIRECT" in capsys.readouterr().err
    reader.read(path, 0, [out], "a test range")
    assert reader.counts["pread"][0] == 2 and reader.counts["direct"][0] == 0
    reader.close()


def _cached_pages(path, begin: int, end: int) -> int:
    """Pages of path's bytes [begin, end) in the page cache (mincore over a fresh map of the file)."""
    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mapped:
        base = np.frombuffer(mapped, np.uint8).ctypes.data
        first, last = begin // page, -(-end // page)
        vec = (ctypes.c_ubyte * (last - first))()
        libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
        assert libc.mincore(base + first * page, (last - first) * page, vec) == 0, ctypes.get_errno()
        return sum(v & 1 for v in vec)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="posix_fadvise and mincore: Linux")
@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "pread-then-dropped"])
def test_reads_leave_nothing_in_the_page_cache(tmp_path, direct):
    """What the reader read is not in the page cache afterwards (O_DIRECT never puts it there; pread
    drops it); a plain read of the same range leaves it there, so the check can tell."""
    path = tmp_path / "blob"
    size = 64 * 4096
    _blob(path, size)
    with open(path, "rb+") as f:
        os.fsync(f.fileno())  # written pages are dirty until written back; then they can be dropped
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    if _cached_pages(path, 0, size):
        pytest.skip("this filesystem keeps the file's pages cached (tmpfs-like)")
    reader = _direct_reader(path, chunk_bytes=8 * 4096) if direct else FileReader([path], direct=False)
    reader.read(path, 5 * 4096, [memoryview(bytearray(40 * 4096))], "a test range")
    assert _cached_pages(path, 0, size) == 0
    with open(path, "rb") as f:
        os.pread(f.fileno(), 40 * 4096, 5 * 4096)
    assert _cached_pages(path, 5 * 4096, 45 * 4096) > 30
    reader.close()
