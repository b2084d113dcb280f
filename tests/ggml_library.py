"""llama.cpp's own quantisers, called through the ggml library that llama-cpp-python ships
(`ggml_quantize_chunk`, what llama-quantize runs per tensor), for tests that compare bytes with
ours. `ggml_quantize` is None where llama-cpp-python is not installed."""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np

from moerun.quant.formats import FORMATS


def _library() -> ctypes.CDLL | None:
    try:
        import llama_cpp
    except ImportError:
        return None
    path = Path(llama_cpp.__file__).parent / "lib" / "libggml-base.so"
    if not path.exists():
        return None
    lib = ctypes.CDLL(str(path))
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
    lib.ggml_quantize_chunk.argtypes += [ctypes.c_int64] * 3 + [ctypes.c_void_p]
    return lib


_LIB = _library()


def _quantize(name: str, x: np.ndarray) -> np.ndarray:
    """Rows x [rows, n] float32 -> ggml's bytes [rows, n / block_size * block_bytes] of format `name`,
    without an importance matrix."""
    fmt = FORMATS[name]
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.zeros((x.shape[0], fmt.row_bytes(x.shape[1])), np.uint8)
    written = _LIB.ggml_quantize_chunk(fmt.ggml_type, x.ctypes.data, out.ctypes.data, 0, *x.shape, None)
    assert written == out.size
    return out


ggml_quantize = _quantize if _LIB is not None else None
