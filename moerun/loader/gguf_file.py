"""Reading GGUF files (versions 2 and 3, little-endian): metadata, tensor infos, and tensors as views of
the file memory-mapped copy-on-write.

The layout (ggml's `docs/gguf.md`): magic b"GGUF", version uint32, tensor count uint64, metadata
count uint64; the metadata key/value pairs; one info per tensor (name, dims in ggml order, ggml type,
offset into the data section); then the data section, starting at the next multiple of
`general.alignment` (default 32). ggml lists dims fastest-varying first (ne[0] is the row length), so
a torch shape is the dims reversed. Parsed here rather than with the `gguf` package so that moerun
needs no more than torch and numpy, and every tensor is a view of the mapped file.

Metadata strings are decoded as UTF-8 with errors="surrogateescape": a token that is not valid UTF-8
(some tokenizers hold raw bytes) still becomes a str, and `s.encode("utf-8", "surrogateescape")` gives
back its exact bytes. Numeric arrays (tokenizer scores and token types, 100k+ entries) become numpy
arrays; arrays of strings or of arrays become lists.
"""

from __future__ import annotations

import itertools
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from moerun.errors import CheckpointError, GGUFMetadataError, TensorError, quote
from moerun.loader.mapped import map_file, release_pages, view_bytes
from moerun.quant.formats import FORMATS, FormatError, QTensor

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4  # GGML_MAX_DIMS
# ggml type id -> (name, elements per block, bytes per block), as gguf-py's GGML_QUANT_SIZES.
GGML_TYPES = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    9: ("Q8_1", 32, 36),  # ggml's block_q8_1 (two fp16, 32 int8); gguf-py's table has an older 40
    10: ("Q2_K", 256, 84),
    11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66),
    17: ("IQ2_XS", 256, 74),
    18: ("IQ3_XXS", 256, 98),
    19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18),
    21: ("IQ3_S", 256, 110),
    22: ("IQ2_S", 256, 82),
    23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1),
    25: ("I16", 1, 2),
    26: ("I32", 1, 4),
    27: ("I64", 1, 8),
    28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56),
    30: ("BF16", 1, 2),
    34: ("TQ1_0", 256, 54),
    35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17),
}
# Types read as plain torch tensors; the block formats of moerun's format table become QTensors.
DENSE_TYPES = {
    0: torch.float32,
    1: torch.float16,
    30: torch.bfloat16,
    28: torch.float64,
    24: torch.int8,
    25: torch.int16,
    26: torch.int32,
    27: torch.int64,
}
FORMAT_OF_TYPE = {f.ggml_type: f.name for f in FORMATS.values() if f.ggml_type is not None}
QUANT_TYPES = {t: name for t, name in FORMAT_OF_TYPE.items() if not FORMATS[name].is_float}
# Metadata value types -> little-endian struct / numpy codes; 8 STRING and 9 ARRAY are read apart.
STRING, ARRAY, BOOL = 8, 9, 7
SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<B"}
SCALARS |= {10: "<Q", 11: "<q", 12: "<d"}
_LEAST_BYTES = {t: struct.calcsize(code) for t, code in SCALARS.items()} | {STRING: 8, ARRAY: 12}


def type_name(ggml_type: int) -> str:
    return GGML_TYPES[ggml_type][0] if ggml_type in GGML_TYPES else "unknown"


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # torch order: the row length (ggml's ne[0]) last
    ggml_type: int
    type_name: str  # "Q4_K", or "unknown"
    format: str | None  # its name in moerun.quant.formats.FORMATS, if there is one
    offset: int  # of its first byte in the file
    nbytes: int | None  # None: an unknown type, or rows that are not whole blocks


class _Cursor:
    """Reads little-endian values from the mapped bytes, refusing to read past their end."""

    def __init__(self, path: Path, buf: memoryview):
        self.path, self.buf, self.pos = path, buf, 0

    def take(self, n: int, what: str) -> int:
        start, self.pos = self.pos, self.pos + n
        if self.pos > len(self.buf):
            raise CheckpointError(
                f"{self.path}: the GGUF file is truncated in {what}, which needs bytes up to {self.pos} "
                f"of a {len(self.buf)}-byte file."
            )
        return start

    def unpack(self, code: str, what: str):
        return struct.unpack_from(code, self.buf, self.take(struct.calcsize(code), what))[0]

    def string(self, what: str) -> str:
        n = self.unpack("<Q", what)
        start = self.take(n, what)
        return str(self.buf[start : start + n], "utf-8", "surrogateescape")

    def value(self, vtype: int, what: str):
        if vtype in SCALARS:
            value = self.unpack(SCALARS[vtype], what)
            return bool(value) if vtype == BOOL else value
        if vtype == STRING:
            return self.string(what)
        if vtype == ARRAY:
            elem_type, count = self.unpack("<I", what), self.unpack("<Q", what)
            least = _LEAST_BYTES.get(elem_type, 1)  # every element takes at least this many bytes
            if count * least > len(self.buf) - self.pos:
                raise CheckpointError(
                    f"{self.path}: {what} is an array of {count} entries, more than the "
                    f"{len(self.buf) - self.pos} bytes left in the file can hold."
                )
            if elem_type in SCALARS:
                dtype = np.dtype(SCALARS[elem_type])
                start = self.take(count * dtype.itemsize, what)
                array = np.frombuffer(self.buf, dtype, count, start).copy()
                return array != 0 if elem_type == BOOL else array
            return [self.value(elem_type, what) for _ in range(count)]
        raise CheckpointError(f"{self.path}: {what} has value type {vtype}, which GGUF does not define.")


class GGUFFile:
    """One GGUF file, memory-mapped copy-on-write; the header, metadata and tensor infos are checked
    when it is opened, a tensor's type only when that tensor is asked for."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._data = map_file(self.path)
        size = self._data.numel()
        cursor = _Cursor(self.path, memoryview(self._data.numpy()))
        head = bytes(cursor.buf[:4])
        if not MAGIC.startswith(head):
            raise CheckpointError(f"{self.path}: not a GGUF file: it starts with {head!r}, not {MAGIC!r}.")
        cursor.take(4, "the header")  # a file cut inside the magic is a truncated one
        self.version: int = cursor.unpack("<I", "the header")
        if self.version & 0xFFFF == 0 and self.version >> 24 in VERSIONS:
            raise CheckpointError(
                f"{self.path}: a big-endian GGUF file; moerun reads little-endian GGUF files only."
            )
        if self.version not in VERSIONS:
            raise CheckpointError(
                f"{self.path}: GGUF version {self.version} is not supported (moerun reads versions 2 and 3)."
            )
        n_tensors, n_kv = cursor.unpack("<Q", "the header"), cursor.unpack("<Q", "the header")
        # a key/value pair takes at least 12 bytes, a tensor info 24: counts the file cannot hold are
        # refused before anything loops over them
        if n_kv * 12 + n_tensors * 24 > size - cursor.pos:
            raise CheckpointError(
                f"{self.path}: the header counts {n_kv} metadata keys and {n_tensors} tensors, more than "
                f"the {size}-byte file can hold, so it is truncated or corrupt."
            )

        self.metadata: dict[str, object] = {}
        for i in range(n_kv):
            key = cursor.string(f"metadata key {i} of {n_kv}")
            if key in self.metadata:
                raise CheckpointError(f"{self.path}: metadata key {quote(key)} appears twice.")
            what = f"the value of metadata key {quote(key)}"
            self.metadata[key] = cursor.value(cursor.unpack("<I", what), what)
        self.alignment = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if type(self.alignment) is not int or self.alignment <= 0 or self.alignment & (self.alignment - 1):
            raise GGUFMetadataError(
                f"{self.path}: general.alignment is {quote(self.alignment)}, not a positive power of two."
            )

        infos = []
        for i in range(n_tensors):
            what = f"tensor info {i} of {n_tensors}"
            name = cursor.string(what)
            n_dims = cursor.unpack("<I", what)
            if n_dims > MAX_DIMS:
                raise CheckpointError(
                    f"{self.path}: tensor {quote(name)} has {n_dims} dims; GGUF allows at most {MAX_DIMS}."
                )
            if n_dims == 0:  # ggml has no 0-d tensor: a scalar is one dim of 1
                raise TensorError(
                    f"{self.path}: tensor {quote(name)} has no dims; GGUF tensors have 1 to {MAX_DIMS}."
                )
            dims = [cursor.unpack("<Q", what) for _ in range(n_dims)]
            infos.append((name, dims, cursor.unpack("<I", what), cursor.unpack("<Q", what)))
        data_start = -(-cursor.pos // self.alignment) * self.alignment

        self._infos: dict[str, GGUFTensorInfo] = {}
        for name, dims, ggml_type, offset in infos:
            if name in self._infos:
                raise CheckpointError(f"{self.path}: two tensors are named {quote(name)}.")
            if offset % self.alignment:
                raise TensorError(
                    f"{self.path}: tensor {quote(name)} starts at offset {offset} of the data section, "
                    f"not a multiple of the file's alignment ({self.alignment}) as GGUF requires."
                )
            info = GGUFTensorInfo(
                name=name,
                shape=tuple(reversed(dims)),
                ggml_type=ggml_type,
                type_name=type_name(ggml_type),
                format=FORMAT_OF_TYPE.get(ggml_type),
                offset=data_start + offset,
                nbytes=_nbytes(dims, ggml_type),
            )
            if info.nbytes is not None and info.offset + info.nbytes > size:
                raise CheckpointError(
                    f"{self.path}: the file is truncated: tensor {quote(name)} ends at byte "
                    f"{info.offset + info.nbytes} but the file has {size} bytes."
                )
            self._infos[name] = info
        self._check_no_overlap()

    def _check_no_overlap(self) -> None:
        """Tensors' bytes may not overlap: each is its own array in ggml's data section."""
        spans = sorted((i.offset, i.offset + i.nbytes, i.name) for i in self._infos.values() if i.nbytes)
        for (_, end, first), (begin, _, second) in itertools.pairwise(spans):
            if begin < end:
                raise TensorError(
                    f"{self.path}: tensors {quote(first)} and {quote(second)} overlap in the file "
                    "(their offsets share bytes)."
                )

    def tensor_names(self) -> list[str]:
        return list(self._infos)

    def __contains__(self, name: str) -> bool:
        return name in self._infos

    def info(self, name: str) -> GGUFTensorInfo:
        if name not in self._infos:
            raise CheckpointError(f"{self.path} has no tensor named {quote(name)}.")
        return self._infos[name]

    def raw(self, name: str) -> torch.Tensor:
        """The tensor's bytes, uint8 [nbytes], a view of the mapped file (writes never reach the file).
        Works for every type whose block size is known, including those `tensor` refuses."""
        info = self.info(name)
        if info.ggml_type not in GGML_TYPES:
            raise self._unsupported(info)
        if info.nbytes is None:
            block = GGML_TYPES[info.ggml_type][1]
            raise CheckpointError(
                f"{self.path}: tensor {quote(name)} of type {info.type_name} has rows of {info.shape[-1]} "
                f"elements, not a multiple of its {block}-element blocks."
            )
        return self._data[info.offset : info.offset + info.nbytes]

    @property
    def mapped(self) -> torch.Tensor:
        """The whole file as uint8 [size] over its copy-on-write map (tensors are views of it)."""
        return self._data

    def tensor_at(self, address: int) -> tuple[str, int] | None:
        """(the name of the tensor whose bytes hold memory address `address`, the byte's offset in
        it), or None where the address is not in one of this file's tensors (e.g. a copy)."""
        offset = address - self._data.data_ptr()
        for name, info in self._infos.items():
            if info.nbytes is not None and info.offset <= offset < info.offset + info.nbytes:
                return name, offset - info.offset
        return None

    def release(self, name: str) -> None:
        """Give back the memory of a tensor already copied out of the map (see `release_pages`)."""
        info = self.info(name)
        if info.nbytes is not None:
            release_pages(self._data, info.offset, info.offset + info.nbytes)

    def tensor(self, name: str) -> torch.Tensor | QTensor:
        """F32/F16/BF16/F64 and I8-I64 tensors as torch tensors of the torch-order shape; the block
        formats of moerun's format table as QTensors. Both are views of the mapped file."""
        info = self.info(name)
        if info.ggml_type in DENSE_TYPES:
            return view_bytes(self.raw(name), DENSE_TYPES[info.ggml_type], info.shape)
        if info.ggml_type in QUANT_TYPES:
            raw = self.raw(name)
            try:
                return QTensor.from_bytes(QUANT_TYPES[info.ggml_type], info.shape, raw)
            except FormatError as e:
                raise TensorError(f"{self.path}: tensor {quote(name)}: {e}") from None
        raise self._unsupported(info)

    def _unsupported(self, info: GGUFTensorInfo) -> CheckpointError:
        supported = [GGML_TYPES[t][0] for t in [*DENSE_TYPES, *QUANT_TYPES]]
        return CheckpointError(
            f"{self.path}: tensor {quote(info.name)} has ggml type {info.type_name} ({info.ggml_type}), "
            f"which moerun does not read; it reads {', '.join(supported)}."
        )

    def __repr__(self) -> str:
        return f"GGUFFile({str(self.path)!r}, version {self.version}, {len(self._infos)} tensors)"


def _nbytes(dims: list[int], ggml_type: int) -> int | None:
    """Bytes of a tensor of ggml `dims`; None for an unknown type or rows that are not whole blocks."""
    if ggml_type not in GGML_TYPES:
        return None
    _, block_size, block_bytes = GGML_TYPES[ggml_type]
    row = dims[0] if dims else 1
    if row % block_size:
        return None
    return math.prod(dims[1:]) * (row // block_size) * block_bytes
