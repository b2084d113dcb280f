"""What Linux says of a process, for benchmarks that run an engine in a subprocess: its I/O counters
(/proc/PID/io: `read_bytes` is what it had read from storage, page faults of a file map included) and
its memory (/proc/PID/status: resident anonymous, file-backed and shared memory), sampled while it runs
for the peaks."""

from __future__ import annotations

import threading
import time


def read_io(pid: int | str = "self") -> dict[str, int]:
    """/proc/PID/io as {field: count}: rchar, wchar, syscr, syscw, read_bytes, write_bytes, ..."""
    with open(f"/proc/{pid}/io") as f:
        return {key: int(value) for key, value in (line.split(":") for line in f if ":" in line)}


def read_status(pid: int | str = "self") -> dict[str, int]:
    """The memory fields of /proc/PID/status in bytes: VmRSS, VmHWM, RssAnon, RssFile, RssShmem, ...
    (every field the kernel gives in kB)."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            number, _, unit = value.strip().partition(" ")
            if unit == "kB":
                out[key] = int(number) * 1024
    return out


class RssSampler:
    """Samples a process's resident memory every `interval` seconds on a thread, from `start()` until
    `stop()` or the process's end: `peaks` holds the most seen of RssAnon, RssFile, RssShmem and VmRSS
    (each its own peak: the most anonymous memory and the most file pages need not come at once)."""

    FIELDS = ("RssAnon", "RssFile", "RssShmem", "VmRSS")

    def __init__(self, pid: int | str, interval: float = 0.05):
        self.pid, self.interval = pid, interval
        self.peaks = dict.fromkeys(self.FIELDS, 0)
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"rss-{pid}", daemon=True)

    def start(self) -> RssSampler:
        self._thread.start()
        return self

    def sample(self) -> bool:
        """One sample; False once the process is gone."""
        try:
            status = read_status(self.pid)
        except (OSError, ValueError):
            return False
        for key in self.FIELDS:
            self.peaks[key] = max(self.peaks[key], status.get(key, 0))
        self.samples += 1
        return True

    def _run(self) -> None:
        while not self._stop.is_set() and self.sample():
            time.sleep(self.interval)

    def stop(self) -> dict[str, int]:
        self._stop.set()
        self._thread.join()
        return dict(self.peaks)
