"""Reading safetensors checkpoints: one file (`SafetensorsFile`) or a model's files as one name space
(`SafetensorsCheckpoint`: a single file, a directory with `model.safetensors`, or shards listed by
`model.safetensors.index.json`).

The format (https://github.com/huggingface/safetensors): an 8-byte little-endian header length N,
N bytes of JSON `{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}`,
then the data, offsets counted from the end of the header. Parsed here rather than with the
`safetensors` package so that the file is only ever memory-mapped copy-on-write and tensors are views
of the mapped bytes, read from disk when first touched.
"""

from __future__ import annotations

import itertools
import math
import os
import struct
from pathlib import Path

import torch

from moerun.errors import CheckpointError, TensorError, quote
from moerun.loader.json_file import parse_json, read_json
from moerun.loader.mapped import map_file, release_pages, view_bytes

MAX_HEADER_BYTES = 100_000_000  # the safetensors package's own limit
DTYPES = {
    name: dtype
    for name, dtype in {
        "F64": torch.float64,
        "F32": torch.float32,
        "F16": torch.float16,
        "BF16": torch.bfloat16,
        "I64": torch.int64,
        "I32": torch.int32,
        "I16": torch.int16,
        "I8": torch.int8,
        "U8": torch.uint8,
        "BOOL": torch.bool,
        "U16": getattr(torch, "uint16", None),
        "U32": getattr(torch, "uint32", None),
        "U64": getattr(torch, "uint64", None),
        "F8_E4M3": getattr(torch, "float8_e4m3fn", None),
        "F8_E5M2": getattr(torch, "float8_e5m2", None),
        "F8_E8M0": getattr(torch, "float8_e8m0fnu", None),
    }.items()
    if dtype is not None
}
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


class SafetensorsFile:
    """One safetensors file, memory-mapped copy-on-write; the header is checked when it is opened."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._entries: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
        header, data_start = self._read_header()
        self.metadata: dict[str, str] = self._check_metadata(header.pop("__metadata__", {}))
        size = self.path.stat().st_size
        for name, entry in header.items():
            dtype, shape, begin, end = self._check_entry(name, entry)
            self._entries[name] = (dtype, shape, data_start + begin, data_start + end)
        self._check_no_overlap()
        cut = [name for name, entry in self._entries.items() if entry[3] > size]
        if cut:
            first = min(cut, key=lambda name: self._entries[name][2])
            more = f" (and {len(cut) - 1} more)" if len(cut) > 1 else ""
            raise CheckpointError(
                f"{self.path}: the file is truncated: tensor {quote(first)}{more} ends at byte "
                f"{self._entries[first][3]} but the file has {size} bytes."
            )
        self._data = map_file(self.path)

    def _read_header(self) -> tuple[dict, int]:
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 8:
                raise CheckpointError(
                    f"{self.path}: the file has {size} bytes, too few for a safetensors header length (8)."
                )
            (n,) = struct.unpack("<Q", f.read(8))
            if n > MAX_HEADER_BYTES:
                raise CheckpointError(
                    f"{self.path}: the header length {n} is over the {MAX_HEADER_BYTES}-byte limit, "
                    "so this is not a safetensors file (or its first 8 bytes are corrupt)."
                )
            if 8 + n > size:
                raise CheckpointError(
                    f"{self.path}: the header length {n} runs past the end of the {size}-byte file, "
                    "so the file is truncated or not a safetensors file."
                )
            raw = f.read(n)
        # the format forbids a name twice: a second entry would silently win
        return parse_json(raw, f"{self.path}: the safetensors header", unique_keys=True), 8 + n

    def _check_metadata(self, metadata: object) -> dict[str, str]:
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            raise CheckpointError(
                f"{self.path}: '__metadata__' must map strings to strings, got {quote(metadata)}."
            )
        return metadata

    def _check_entry(self, name: str, entry: object) -> tuple[torch.dtype, tuple[int, ...], int, int]:
        where = f"{self.path}: tensor {quote(name)}"
        if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
            raise CheckpointError(f"{where} needs 'dtype', 'shape' and 'data_offsets', got {quote(entry)}.")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise CheckpointError(f"{where} has dtype {quote(dtype)}; moerun reads {', '.join(DTYPES)}.")
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise CheckpointError(f"{where} has shape {quote(shape)}, not a list of non-negative integers.")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(type(o) is int for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]
        ):
            raise CheckpointError(
                f"{where} has data_offsets {quote(offsets)}, not [begin, end] with 0 <= begin <= end."
            )
        torch_dtype = DTYPES[dtype]
        expected = math.prod(shape) * torch_dtype.itemsize
        if offsets[1] - offsets[0] != expected:
            raise CheckpointError(
                f"{where} of dtype {dtype} and shape {quote(shape)} needs {quote(expected)} bytes, "
                f"but its data_offsets {quote(offsets)} span {quote(offsets[1] - offsets[0])}."
            )
        return torch_dtype, tuple(shape), offsets[0], offsets[1]

    def _check_no_overlap(self) -> None:
        """Tensors' bytes may not overlap (the format forbids it: one write would change two)."""
        spans = sorted(
            (begin, end, name) for name, (_, _, begin, end) in self._entries.items() if end > begin
        )
        for (_, end, first), (begin, _, second) in itertools.pairwise(spans):
            if begin < end:
                raise TensorError(
                    f"{self.path}: tensors {quote(first)} and {quote(second)} overlap in the file "
                    "(their data_offsets share bytes), which the safetensors format forbids."
                )

    def _entry(self, name: str) -> tuple[torch.dtype, tuple[int, ...], int, int]:
        if name not in self._entries:
            raise CheckpointError(f"{self.path} has no tensor named {quote(name)}.")
        return self._entries[name]

    def names(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name)[1]

    def dtype(self, name: str) -> torch.dtype:
        return self._entry(name)[0]

    def tensor(self, name: str) -> torch.Tensor:
        """The tensor as a view of the mapped file (a copy only if its offset is misaligned for its
        dtype); writing to it never changes the file."""
        dtype, shape, begin, end = self._entry(name)
        return view_bytes(self._data[begin:end], dtype, shape)

    @property
    def mapped(self) -> torch.Tensor:
        """The whole file as uint8 [size] over its copy-on-write map (tensors are views of it)."""
        return self._data

    def release(self, name: str) -> None:
        """Give back the memory of a tensor already copied out of the map (see `release_pages`)."""
        _, _, begin, end = self._entry(name)
        release_pages(self._data, begin, end)

    def __repr__(self) -> str:
        return f"SafetensorsFile({str(self.path)!r}, {len(self._entries)} tensors)"


class SafetensorsCheckpoint:
    """The tensors of a model's safetensors files under one name space. `path` is a `.safetensors`
    file, a `*.safetensors.index.json` file, or a directory holding `model.safetensors.index.json`
    (shards) or `model.safetensors`."""

    def __init__(self, path: str | os.PathLike):
        path = Path(path)
        if path.is_dir():
            if (path / INDEX_NAME).is_file():
                path = path / INDEX_NAME
            elif (path / SINGLE_NAME).is_file():
                path = path / SINGLE_NAME
            else:
                others = sorted(p.name for p in path.glob("*.safetensors"))
                found = f"; it holds {', '.join(others)} but no index naming them" if others else ""
                raise CheckpointError(
                    f"{path}: the directory has neither {INDEX_NAME} nor {SINGLE_NAME}{found}."
                )
        elif not path.is_file():
            raise CheckpointError(f"{path}: no such file or directory.")
        self.path = path
        if path.name.endswith(".index.json"):
            shards, self._where = self._read_index(path)
        else:
            shards = [SafetensorsFile(path)]
            self._where = dict.fromkeys(shards[0].names(), shards[0])
        self.files: list[Path] = [shard.path for shard in shards]  # sorted by name: shard 00001 first
        self.metadata: dict[str, str] = shards[0].metadata if shards else {}

    @staticmethod
    def _read_index(index: Path) -> tuple[list[SafetensorsFile], dict[str, SafetensorsFile]]:
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(
            isinstance(f, str) and f == Path(f).name for f in weight_map.values()
        ):
            raise CheckpointError(
                f"{index}: 'weight_map' must map tensor names to the names of shard files beside it."
            )
        shards: dict[str, SafetensorsFile] = {}
        where: dict[str, SafetensorsFile] = {}
        for name, file_name in weight_map.items():
            if file_name not in shards:
                shard_path = index.parent / file_name
                if not shard_path.is_file():
                    raise CheckpointError(
                        f"{index}: shard {quote(file_name)} (holding tensor {quote(name)}) is not in "
                        f"{index.parent}."
                    )
                shards[file_name] = SafetensorsFile(shard_path)
            if name not in shards[file_name]:
                raise CheckpointError(
                    f"{index}: names tensor {quote(name)} in shard {quote(file_name)}, which has no "
                    "such tensor."
                )
            where[name] = shards[file_name]
        return [shards[file_name] for file_name in sorted(shards)], where

    def _file(self, name: str) -> SafetensorsFile:
        if name not in self._where:
            raise CheckpointError(f"{self.path} has no tensor named {quote(name)}.")
        return self._where[name]

    def names(self) -> list[str]:
        return list(self._where)

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def shape(self, name: str) -> tuple[int, ...]:
        return self._file(name).shape(name)

    def dtype(self, name: str) -> torch.dtype:
        return self._file(name).dtype(name)

    def tensor(self, name: str) -> torch.Tensor:
        return self._file(name).tensor(name)

    def release(self, name: str) -> None:
        self._file(name).release(name)

    @property
    def shards(self) -> list[SafetensorsFile]:
        """The files, each once."""
        return list({id(f): f for f in self._where.values()}.values())

    def __repr__(self) -> str:
        n, files = len(self._where), len(self.files)
        return f"SafetensorsCheckpoint({str(self.path)!r}, {n} tensors in {files} files)"
