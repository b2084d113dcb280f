"""ExpertStore: the bytes of one expert's projections for (layer, expert), read on demand.

Each streamed projection of a layer is an `ExpertSource` over the canonical [E, ...] expert tensor
the loader built. Where that tensor is a contiguous view of a memory-mapped checkpoint file (fused
safetensors names, GGUF tensors stored as moerun runs them), expert e is read with `os.pread` from
the file at its offset: only that expert's bytes are touched, the GIL is released while reading, and
a file truncated under us gives a short read (a clear `ExpertReadError`) instead of a SIGBUS from
the map. Where the loader had to build the tensor in RAM (per-expert names stacked, GGUF gate and
up fused, GPT-OSS MXFP4 regrouped), expert e is copied from that host tensor.

Dense projections are converted to the compute dtype on read when the file stores another dtype,
so a slot always holds exactly what the resident model would compute with. An optional host-RAM
tier (pinned on CUDA) keeps recently read experts with its own byte budget. Reads run on a pool of
reader threads (`submit`); `close` shuts them down.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from moerun.quant.formats import QFormat, QTensor

Key = tuple[str, int]  # (layer name, expert id)
PROJECTIONS = ("gate_up", "down")


class ExpertReadError(RuntimeError):
    """An expert's bytes could not be read (I/O error, file truncated or replaced while running)."""


@dataclass(frozen=True)
class MappedFile:
    """A checkpoint file and the uint8 tensor over its memory map (from `moerun.loader`)."""

    path: Path
    data: torch.Tensor


@dataclass(frozen=True)
class Part:
    """How a slot holds one projection of one expert: dense in the compute dtype, or raw bytes."""

    name: str  # "gate_up" | "down"
    dtype: torch.dtype  # compute dtype (dense) or torch.uint8 (quantised bytes)
    shape: tuple[int, ...]  # one expert: [out, in] dense, [out, row_bytes] quantised
    format: QFormat | None = None

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()


Layout = tuple[Part, ...]


class ExpertSource:
    """One projection of one layer's experts: `read_into(e, dest)` fills dest with expert e."""

    def __init__(
        self, weight: torch.Tensor | QTensor, name: str, dtype: torch.dtype, files: Sequence[MappedFile]
    ):
        quantised = isinstance(weight, QTensor)
        self.tensor = weight.data if quantised else weight  # [E, out, in] or [E, out, row_bytes]
        slot_dtype = torch.uint8 if quantised else dtype
        self.part = Part(name, slot_dtype, tuple(self.tensor.shape[1:]), weight.format if quantised else None)
        self.num_experts = self.tensor.shape[0]
        self.source_bytes = self.tensor[0].numel() * self.tensor.element_size()  # one expert as stored
        self.file: Path | None = None
        self.offset = self.stride = 0
        for f in files:  # a contiguous view of a mapped file is read from the file itself
            base, size = f.data.data_ptr(), f.data.numel()
            ptr = self.tensor.data_ptr()
            if self.tensor.is_contiguous() and base <= ptr < base + size:
                self.file, self.offset = f.path, ptr - base
                self.stride = self.source_bytes
                break

    def read_into(self, e: int, dest: torch.Tensor, fd: int | None, where: str) -> int:
        """Expert e into `dest` (a host tensor of `part`'s dtype and shape); returns bytes read."""
        if self.file is None:
            dest.copy_(self.tensor[e])
            return self.source_bytes
        same = self.tensor.dtype == dest.dtype
        target = dest if same else torch.empty(self.tensor.shape[1:], dtype=self.tensor.dtype)
        buf = target.view(-1).view(torch.uint8).numpy()
        begin = self.offset + e * self.stride
        done = 0
        try:
            while done < self.source_bytes:
                n = os.preadv(fd, [memoryview(buf)[done:]], begin + done)
                if n == 0:
                    size = os.fstat(fd).st_size
                    raise ExpertReadError(
                        f"{self.file}: {where} needs bytes [{begin}, {begin + self.source_bytes}) but the "
                        f"file now ends at {size}; it was truncated or replaced while moerun was running."
                    )
                done += n
        except OSError as err:
            raise ExpertReadError(f"{self.file}: reading {where} failed ({err}).") from err
        if not same:
            dest.copy_(target)  # dtype conversion, elementwise: bitwise what the resident model has
        return self.source_bytes


class HostTier:
    """Recently read experts in host RAM (pinned on CUDA), least recently used dropped past the budget."""

    def __init__(self, budget_bytes: int, pin: bool):
        self.budget_bytes, self.pin = budget_bytes, pin
        self.bytes = 0
        self._entries: OrderedDict[Key, dict[str, torch.Tensor]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Key) -> dict[str, torch.Tensor] | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
            return entry

    def put(self, key: Key, entry: dict[str, torch.Tensor]) -> None:
        size = sum(t.numel() * t.element_size() for t in entry.values())
        if size > self.budget_bytes:
            return
        with self._lock:
            if key in self._entries:
                return
            while self.bytes + size > self.budget_bytes:
                _, old = self._entries.popitem(last=False)
                self.bytes -= sum(t.numel() * t.element_size() for t in old.values())
            self._entries[key] = entry
            self.bytes += size


class ExpertStore:
    """layer name -> its streamed projections; reads (layer, expert) on reader threads."""

    def __init__(
        self,
        layers: Mapping[str, Mapping[str, torch.Tensor | QTensor]],
        dtype: torch.dtype,
        files: Sequence[MappedFile] = (),
        readers: int = 4,
        host_budget_bytes: int = 0,
        pin: bool = False,
    ):
        """`layers[name]` holds "gate_up" and "down" ([E, out, in] dense or QTensor); dense ones are
        read into `dtype`. `files` are the checkpoint's mapped files, so views of them are read with
        pread. `host_budget_bytes` > 0 adds the host-RAM tier (pinned buffers when `pin`)."""
        self.dtype = dtype
        self.sources = {
            layer: {p: ExpertSource(weights[p], p, dtype, files) for p in PROJECTIONS}
            for layer, weights in layers.items()
        }
        paths = {s.file for srcs in self.sources.values() for s in srcs.values() if s.file is not None}
        self._fds = {path: os.open(path, os.O_RDONLY) for path in paths}
        self.host = HostTier(host_budget_bytes, pin) if host_budget_bytes > 0 else None
        self.pin = pin
        self._pool = ThreadPoolExecutor(max_workers=readers, thread_name_prefix="moerun-expert-reader")
        self._closed = False

    def layout(self, layer: str) -> Layout:
        return tuple(self.sources[layer][p].part for p in PROJECTIONS)

    def num_experts(self, layer: str) -> int:
        return self.sources[layer]["gate_up"].num_experts

    def file_backed(self, layer: str) -> dict[str, bool]:
        """Projection -> whether it is read from the file (False: from a host copy made at load)."""
        return {p: s.file is not None for p, s in self.sources[layer].items()}

    def read_into(self, key: Key, dests: Mapping[str, torch.Tensor]) -> int:
        """Expert `key`'s projections into host tensors `dests` (part name -> tensor); bytes read
        from the source (0 when the host tier had it)."""
        if self._closed:
            raise ExpertReadError("The expert store is closed; the model's reader threads have shut down.")
        layer, e = key
        if self.host is not None:
            entry = self.host.get(key)
            read = 0
            if entry is None:
                entry = self.empty(layer, pin=self.pin)
                read = self._read(key, entry)
                self.host.put(key, entry)
            for name, dest in dests.items():
                dest.copy_(entry[name])
            return read
        return self._read(key, dests)

    def _read(self, key: Key, dests: Mapping[str, torch.Tensor]) -> int:
        layer, e = key
        total = 0
        for name, dest in dests.items():
            src = self.sources[layer][name]
            fd = self._fds.get(src.file) if src.file is not None else None
            total += src.read_into(e, dest, fd, f"expert {e} of {layer}.experts.{name}")
        return total

    def empty(self, layer: str, pin: bool = False) -> dict[str, torch.Tensor]:
        """Host buffers for one expert of `layer` (pinned when asked)."""
        return {
            part.name: torch.empty(part.shape, dtype=part.dtype, pin_memory=pin)
            for part in self.layout(layer)
        }

    def submit(self, fn: Callable, *args) -> Future:
        if self._closed:
            raise ExpertReadError("The expert store is closed; the model's reader threads have shut down.")
        return self._pool.submit(fn, *args)

    def close(self) -> None:
        """Wait for reads in flight, stop the reader threads and close the files."""
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True)
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __del__(self):
        with contextlib.suppress(Exception):  # interpreter shutdown: nothing left to report to
            self.close()
