"""Cold reads of expert-sized ranges of a file, the three ways a streamed expert could be read:
moerun's reader with O_DIRECT, its pread fallback (then dropped from the page cache), and touching a
memory map of the file (the OS page cache, as an mmap-only engine reads). Before each pass the file's
pages are dropped (posix_fadvise DONTNEED), so every pass reads the disk; `--readers` ranges are in
flight at once, as the expert store's reader threads keep them. Prints GB/s, the best of `--repeats`.

    python scripts/expert_read_bandwidth.py FILE [--expert-mb 4.5 --count 64 --readers 4 --repeats 3]
"""

from __future__ import annotations

import argparse
import mmap
import os
import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from moerun.loader.reads import FileReader


def drop(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)


def one_pass(path: Path, ranges: list[tuple[int, int]], readers: int, way: str) -> float:
    """Seconds to read every range once, `readers` at a time."""
    drop(path)
    if way == "mmap":
        f = open(path, "rb")  # noqa: SIM115 - closed below, after the map
        mapped = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
        data = np.frombuffer(mapped, np.uint8)

        def read(r):
            out = np.empty(r[1], np.uint8)
            np.copyto(out, data[r[0] : r[0] + r[1]])
    else:
        reader = FileReader([path], direct=way == "o_direct")
        if way == "o_direct" and not reader.direct(path):
            raise SystemExit(f"{path}: its filesystem refuses O_DIRECT.")

        def read(r):
            out = np.empty(r[1], np.uint8)
            reader.read(path, r[0], [memoryview(out)], "a range")

    start = time.perf_counter()
    with ThreadPoolExecutor(readers) as pool:
        list(pool.map(read, ranges))
    seconds = time.perf_counter() - start
    if way == "mmap":
        del data
        mapped.close()
        f.close()
    else:
        reader.close()
    return seconds


def main() -> None:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=raw)
    parser.add_argument("file", type=Path)
    parser.add_argument("--expert-mb", type=float, default=4.5)
    parser.add_argument("--count", type=int, default=64)
    parser.add_argument("--readers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    size, length = args.file.stat().st_size, int(args.expert_mb * 2**20)
    rng = random.Random(0)
    ranges = [(rng.randrange(0, size - length) // 32 * 32, length) for _ in range(args.count)]
    total = sum(n for _, n in ranges)
    for way in ("o_direct", "pread", "mmap"):
        best = min(one_pass(args.file, ranges, args.readers, way) for _ in range(args.repeats))
        print(f"{way:9s} {total / best / 1e9:6.2f} GB/s  ({args.count} ranges of {args.expert_mb} MiB, cold)")


if __name__ == "__main__":
    main()
