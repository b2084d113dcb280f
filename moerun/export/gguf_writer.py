"""Writing GGUF files (version 3, little-endian), the inverse of `gguf_file`: metadata with explicit
value types (llama.cpp checks them), tensors dense or as QTensor bytes, each aligned.

Tensors are written out as they are added, to a spill file (in `spill_dir`: the target's directory,
when the caller knows it), so memory holds one tensor at a time, not the whole output; `write` then
writes the header and copies the spilled data after it. The file is written to a temporary name next
to the target and renamed at the end, so an interrupted run leaves no half file; an existing target
is refused unless `force`."""

from __future__ import annotations

import os
import shutil
import struct
import tempfile
from pathlib import Path

import numpy as np
import torch

from moerun.errors import CheckpointError
from moerun.loader.gguf_file import ARRAY, BOOL, DEFAULT_ALIGNMENT, MAGIC, SCALARS, STRING
from moerun.quant.formats import QTensor

UINT8, INT8, UINT16, INT16, UINT32, INT32, FLOAT32 = 0, 1, 2, 3, 4, 5, 6
UINT64, INT64, FLOAT64 = 10, 11, 12
_NUMPY_TYPES = {
    np.dtype(np.uint8): UINT8, np.dtype(np.int8): INT8, np.dtype(np.uint16): UINT16,
    np.dtype(np.int16): INT16, np.dtype(np.uint32): UINT32, np.dtype(np.int32): INT32,
    np.dtype(np.float32): FLOAT32, np.dtype(np.uint64): UINT64, np.dtype(np.int64): INT64,
    np.dtype(np.float64): FLOAT64, np.dtype(np.bool_): BOOL,
}  # fmt: skip
_DENSE_GGML = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 30}


def _infer_type(value) -> int:
    if isinstance(value, bool):
        return BOOL
    if isinstance(value, int):
        return UINT32 if 0 <= value < 2**32 else INT64
    if isinstance(value, float):
        return FLOAT32
    if isinstance(value, str):
        return STRING
    raise TypeError(f"cannot infer a GGUF type for {type(value).__name__}; pass value_type")


def _string(text: str) -> bytes:
    raw = text.encode("utf-8", "surrogateescape")
    return struct.pack("<Q", len(raw)) + raw


def _value(value, vtype: int, elem_type: int | None) -> bytes:
    if vtype == STRING:
        return _string(value)
    if vtype == ARRAY:
        if isinstance(value, np.ndarray):
            elem_type = _NUMPY_TYPES[value.dtype] if elem_type is None else elem_type
        elif elem_type is None:
            elem_type = _infer_type(value[0]) if len(value) else INT32
        head = struct.pack("<IQ", elem_type, len(value))
        if elem_type == STRING:
            return head + b"".join(_string(v) for v in value)
        code = SCALARS[elem_type]
        return head + np.asarray(value, dtype=np.dtype(code)).tobytes()
    return struct.pack(SCALARS[vtype], value)


class GGUFWriter:
    def __init__(self, alignment: int = DEFAULT_ALIGNMENT, spill_dir: str | os.PathLike | None = None):
        self.alignment = alignment
        self.metadata: dict[str, tuple[object, int, int | None]] = {}
        self.infos: dict[str, tuple[tuple[int, ...], int, int]] = {}  # name -> (shape, ggml type, offset)
        # the tensors' data, each padded to the alignment, in the order added; removed when closed
        self._spill = tempfile.TemporaryFile(prefix=".moerun-gguf-", dir=spill_dir)  # noqa: SIM115 - closed in write/close
        if alignment != DEFAULT_ALIGNMENT:
            self.add("general.alignment", alignment, UINT32)

    def add(self, key: str, value, value_type: int | None = None, elem_type: int | None = None) -> None:
        """One metadata entry; the type is inferred (int -> uint32, float -> float32, list/ndarray ->
        array) unless given, as llama.cpp reads some keys only in their exact type."""
        if isinstance(value, list | tuple | np.ndarray):
            value_type = ARRAY
        self.metadata[key] = (value, _infer_type(value) if value_type is None else value_type, elem_type)

    def add_tensor(self, name: str, tensor: torch.Tensor | QTensor) -> None:
        """Write `tensor`'s bytes to the spill file now; the caller may drop it afterwards."""
        if isinstance(tensor, QTensor):
            if tensor.format.ggml_type is None:
                raise ValueError(f"{name}: format {tensor.format.name} has no GGUF type.")
            ggml_type, data = tensor.format.ggml_type, tensor.data
        elif tensor.dtype not in _DENSE_GGML:
            raise ValueError(f"{name}: dtype {tensor.dtype} cannot be written to GGUF (f32, f16, bf16).")
        else:
            ggml_type, data = _DENSE_GGML[tensor.dtype], tensor
        if name in self.infos:
            raise ValueError(f"{name}: a tensor of that name was already added.")
        offset = self._spill.tell()
        raw = self._bytes(data)
        self._spill.write(memoryview(raw))
        self._spill.write(b"\0" * (-raw.size % self.alignment))
        self.infos[name] = (tuple(tensor.shape), ggml_type, offset)

    @staticmethod
    def _bytes(data: torch.Tensor) -> np.ndarray:
        return data.detach().contiguous().cpu().view(torch.uint8).reshape(-1).numpy()

    def _header(self) -> bytes:
        header = [MAGIC, struct.pack("<IQQ", 3, len(self.infos), len(self.metadata))]
        header += [
            _string(k) + struct.pack("<I", t) + _value(v, t, e) for k, (v, t, e) in self.metadata.items()
        ]
        for name, (shape, ggml_type, offset) in self.infos.items():
            dims = list(reversed(shape))
            header.append(
                _string(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, ggml_type, offset)
            )
        return b"".join(header)

    def write(self, path: str | os.PathLike, force: bool = False) -> Path:
        """The header, then the spilled tensor data, to `path`; closes the writer."""
        path = Path(path)
        if path.exists() and not force:
            raise CheckpointError(
                f"{path} exists; moerun does not write over files (pass force to replace it)."
            )
        temporary = path.with_name(f".{path.name}.partial-{os.getpid()}")
        try:
            with open(temporary, "wb") as f:
                f.write(self._header())
                f.write(b"\0" * (-f.tell() % self.alignment))
                self._spill.seek(0)
                shutil.copyfileobj(self._spill, f, 16 * 2**20)
            os.replace(temporary, path)
        finally:
            temporary.unlink(missing_ok=True)
            self.close()
        return path

    def close(self) -> None:
        """Remove the spill file (also done when the writer is garbage collected)."""
        self._spill.close()
