"""moerun.loader.reads: byte ranges of a file scattered into buffers, a long range read in parallel
chunks, and a file cut short under the reader refused with a sentence."""

import pytest
import torch

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
