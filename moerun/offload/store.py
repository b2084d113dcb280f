"""ExpertStore: the bytes of one expert's projections for (layer, expert), read on demand.

Each streamed projection of a layer is an `ExpertSource` over what the loader gave: the canonical
[E, ...] expert tensor, or an `ExpertPieces` (moerun.offload.pieces) describing how expert e joins
from pieces of stored tensors (per-expert names, GGUF gate and up, GPT-OSS MXFP4 blocks and scales)
that were never joined in RAM. Whatever is a contiguous view of a memory-mapped checkpoint file is
read from the file at its offset by the loader's `FileReader` (moerun.loader.reads), with O_DIRECT
where the filesystem takes it (else pread, the range then dropped from the page cache): only that
expert's bytes are read, never through the map (which would keep every expert read in the page
cache), the GIL is released while reading, and a file truncated under us gives a clear
`ExpertReadError` instead of a SIGBUS from the map. What is only in RAM (a converted model) is copied
from there.

Dense projections are converted to the compute dtype on read when the file stores another dtype,
so a slot always holds exactly what the resident model would compute with. An optional host-RAM
tier (pinned on CUDA) keeps recently read experts with its own byte budget. Reads run on a pool of
reader threads (`submit`); `close` shuts them down.
"""

from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from moerun.loader.mapped import MappedFile
from moerun.loader.reads import FileReader, FileReadError
from moerun.offload.pieces import MXFP4_GPT_OSS, ExpertPieces
from moerun.quant.formats import QFormat, QTensor
from moerun.quant.scales import first_nonfinite_block

Key = tuple[str, int]  # (layer name, expert id)
PROJECTIONS = ("gate_up", "down")
READERS = 4  # reader threads: each expert read runs on one (its long ranges in chunks on the FileReader's)


class ExpertReadError(RuntimeError):
    """An expert's bytes could not be read (I/O error, file truncated or replaced while running)."""


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
    """One projection of one layer's experts: `read_into(e, dest, files, where)` fills dest with expert e.

    The projection is an `ExpertPieces` (a plain [E, ...] tensor or QTensor is the one-piece case).
    Each piece's share of expert e that is a contiguous view of a mapped checkpoint file is read from
    the file (a FileReader's scatter read): straight into the slot's rows when the bytes land as stored (rows
    `row, row + step, ...` as one scatter read), else into a staging buffer that a torch op puts in
    place (dtype conversion, transposition, MXFP4 regrouping). A share that is not in a file (a
    tensor the loader built in RAM) is copied from memory by the same recipe."""

    def __init__(
        self,
        weight: torch.Tensor | QTensor | ExpertPieces,
        name: str,
        dtype: torch.dtype,
        files: Sequence[MappedFile],
    ):
        self.pieces = weight if isinstance(weight, ExpertPieces) else ExpertPieces.of(weight)
        quantised = self.pieces.format is not None
        slot_dtype = torch.uint8 if quantised else dtype
        self.part = Part(name, slot_dtype, self.pieces.slot_shape(), self.pieces.format)
        self.num_experts = self.pieces.num_experts
        _check_fit(self.pieces, self.part, name)
        # per piece, per expert: (file, offset) of its bytes, or None (not a view of a mapped file)
        self.where = [_locate(piece.views, self.num_experts, files) for piece in self.pieces.pieces]
        self.source_bytes = sum(p.views[0].numel() * p.views[0].element_size() for p in self.pieces.pieces)
        self.files = {loc[0] for per_expert in self.where for loc in per_expert if loc is not None}

    def file_ranges(self) -> list[tuple[Path, int, int]]:
        """(file, begin, end) of every piece of every expert read from a file."""
        pieces = self.pieces.pieces
        return [
            (loc[0], loc[1], loc[1] + p.views[0].numel() * p.views[0].element_size())
            for p, per_expert in zip(pieces, self.where, strict=True)
            for loc in per_expert
            if loc is not None
        ]

    @property
    def file_backed(self) -> bool:
        """Whether every expert's bytes are read from the checkpoint file(s)."""
        return all(loc is not None for per_expert in self.where for loc in per_expert)

    def read_into(self, e: int, dest: torch.Tensor, files: FileReader, where: str) -> int:
        """Expert e into `dest` (a contiguous host tensor of `part`'s dtype and shape); returns the
        bytes read from the source."""
        pieces = self.pieces.pieces
        if self.pieces.join == MXFP4_GPT_OSS:  # (blocks [out, n/32, 16], scales [out, n/32])
            blocks, scales = (self._staged(i, e, files, where) for i in range(2))
            grouped = dest.view(*scales.shape, 17)  # each block: its scale byte, then its 16 bytes
            grouped[..., 0] = scales
            grouped[..., 1:] = blocks
            return self.source_bytes
        for i, piece in enumerate(pieces):
            loc, view = self.where[i][e], piece.views[e]
            # rows that land as stored are read into the slot; O_DIRECT (copying from an aligned
            # buffer) reads rows spread over the slot whole, then one strided copy puts them in place
            as_stored = not piece.transposed and view.dtype == dest.dtype
            if loc is not None and as_stored and (piece.step == 1 or not files.direct(loc[0])):
                row_bytes = dest[0].numel() * dest.element_size()
                flat = memoryview(dest.view(-1).view(torch.uint8).numpy())
                starts = [piece.row] if piece.step == 1 else range(piece.row, dest.shape[0], piece.step)
                n = piece.rows if piece.step == 1 else 1
                buffers = [flat[r * row_bytes : (r + n) * row_bytes] for r in starts][: piece.rows]
                files.read(loc[0], loc[1], buffers, where)
                continue
            src = self._staged(i, e, files, where)
            target = dest[piece.row :: piece.step][: piece.rows]
            target.copy_(src.transpose(-1, -2) if piece.transposed else src)  # elementwise conversion
        return self.source_bytes

    def _staged(self, i: int, e: int, files: FileReader, where: str) -> torch.Tensor:
        """Expert e's share of piece i as stored: read from its file into a fresh buffer, or the view."""
        loc, view = self.where[i][e], self.pieces.pieces[i].views[e]
        if loc is None:
            return view
        buf = torch.empty(view.shape, dtype=view.dtype)
        files.read(loc[0], loc[1], [memoryview(buf.view(-1).view(torch.uint8).numpy())], where)
        return buf


def _check_fit(pieces: ExpertPieces, part: Part, name: str) -> None:
    """Each piece's rows fit the slot, with the slot's row length (a loader bug otherwise)."""
    out, cols = part.shape
    for piece in pieces.pieces if pieces.join != MXFP4_GPT_OSS else ():
        stored = tuple(piece.views[0].shape)
        length = stored[0] if piece.transposed else stored[-1]
        if len(stored) != 2 or length != cols or piece.row + piece.step * (piece.rows - 1) >= out:
            raise ValueError(
                f"{name}: a piece of one expert stored {stored} (from row {piece.row}, every {piece.step}) "
                f"does not fit a slot of {tuple(part.shape)}."
            )


def _locate(
    views: Sequence[torch.Tensor], num_experts: int, files: Sequence[MappedFile]
) -> list[tuple[Path, int] | None]:
    """Per expert, (file, offset) of `views[e]` when it is a contiguous view of a mapped file."""

    def find(view: torch.Tensor) -> tuple[Path, int] | None:
        if not view.is_contiguous():
            return None
        ptr, n = view.data_ptr(), view.numel() * view.element_size()
        for f in files:
            base, size = f.data.data_ptr(), f.data.numel()
            if base <= ptr and ptr + n <= base + size:
                return f.path, ptr - base
        return None

    if isinstance(views, torch.Tensor):  # one [E, ...] tensor: expert e at a fixed stride
        first, last = find(views[0]), find(views[num_experts - 1])
        if first is None or last is None or first[0] != last[0]:
            return [None] * num_experts
        stride = views.stride(0) * views.element_size()
        return [(first[0], first[1] + e * stride) for e in range(num_experts)]
    return [find(views[e]) for e in range(num_experts)]


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
        layers: Mapping[str, Mapping[str, torch.Tensor | QTensor | ExpertPieces]],
        dtype: torch.dtype,
        files: Sequence[MappedFile] = (),
        readers: int = READERS,
        host_budget_bytes: int = 0,
        pin: bool = False,
        direct: bool = True,
    ):
        """`layers[name]` holds "gate_up" and "down" ([E, out, in] dense, QTensor or ExpertPieces);
        dense ones are read into `dtype`. `files` are the checkpoint's mapped files, so views of them
        are read from the files (with O_DIRECT where the filesystem takes it and `direct`).
        `host_budget_bytes` > 0 adds the host-RAM tier (pinned when `pin`)."""
        self.dtype = dtype
        self.sources = {
            layer: {p: ExpertSource(weights[p], p, dtype, files) for p in PROJECTIONS}
            for layer, weights in layers.items()
        }
        self.files = FileReader(
            (path for srcs in self.sources.values() for s in srcs.values() for path in s.files),
            direct=direct,
        )
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
        return {p: s.file_backed for p, s in self.sources[layer].items()}

    def read_counts(self) -> dict[str, int]:
        """Ranges read from the files with O_DIRECT and with pread, and the bytes each way read."""
        (direct, direct_bytes), (pread, pread_bytes) = self.files.counts["direct"], self.files.counts["pread"]
        return {"direct": direct, "direct_bytes": direct_bytes, "pread": pread, "pread_bytes": pread_bytes}

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
            where = f"expert {e} of {layer}.experts.{name}"
            source = self.sources[layer][name]
            try:
                total += source.read_into(e, dest, self.files, where)
            except FileReadError as err:
                raise ExpertReadError(str(err)) from err
            fmt = source.pieces.format
            if fmt is not None and (block := first_nonfinite_block(fmt, dest)) is not None:
                files = ", ".join(sorted(map(str, source.files))) or "host copy"
                raise ExpertReadError(
                    f"{files}: {where}: block {block} has a scale that is not a number "
                    "(inf or NaN); the file is damaged or was written wrong."
                )
        return total

    def drop_cached(self) -> None:
        """Drop the checkpoint files' pages from the page cache (those no map holds): a streamed
        model's dense part is its own copy, and the experts are read around the cache."""
        self.files.drop_cached()

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
        self.files.close()

    def __del__(self):
        with contextlib.suppress(Exception):  # interpreter shutdown: nothing left to report to
            self.close()
