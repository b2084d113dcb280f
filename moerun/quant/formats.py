"""The one table of weight formats, and QTensor: quantised expert weights as raw bytes.

A format stores a row of `in` elements as `in / block_size` blocks of `block_bytes` bytes each,
laid out as in ggml (`ggml-common.h`). Two MXFP4 layouts exist: `mxfp4` is GGUF's block (one E8M0
scale byte, then 16 bytes whose low nibbles hold elements 0-15 and high nibbles 16-31);
`mxfp4_gpt_oss` is GPT-OSS's safetensors layout regrouped into the same 17-byte block (scale byte,
then 16 bytes whose low nibble holds element 2j and high nibble element 2j+1).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


class FormatError(ValueError):
    """A tensor that a format cannot hold, or bytes that do not match a shape."""


@dataclass(frozen=True)
class QFormat:
    name: str
    block_size: int  # elements per block
    block_bytes: int  # bytes per block
    ggml_type: int | None  # GGMLQuantizationType value in GGUF files (None: not a GGUF type)

    def row_bytes(self, row_elements: int, what: str = "tensor") -> int:
        """Bytes of one row of `row_elements`; refuses a row that is not a whole number of blocks."""
        if row_elements % self.block_size:
            raise FormatError(
                f"{what}: a row of {row_elements} elements cannot be stored as {self.name}, whose blocks "
                f"hold {self.block_size} elements ({row_elements} is not a multiple of {self.block_size})."
            )
        return row_elements // self.block_size * self.block_bytes

    @property
    def is_float(self) -> bool:
        return self.block_size == 1


FORMATS = {
    f.name: f
    for f in [
        QFormat("f32", 1, 4, 0),
        QFormat("f16", 1, 2, 1),
        QFormat("bf16", 1, 2, 30),
        QFormat("q4_0", 32, 18, 2),
        QFormat("q4_1", 32, 20, 3),
        QFormat("q5_0", 32, 22, 6),
        QFormat("q5_1", 32, 24, 7),
        QFormat("q8_0", 32, 34, 8),
        QFormat("iq4_nl", 32, 18, 20),
        QFormat("q2_k", 256, 84, 10),
        QFormat("q3_k", 256, 110, 11),
        QFormat("q4_k", 256, 144, 12),
        QFormat("q5_k", 256, 176, 13),
        QFormat("q6_k", 256, 210, 14),
        QFormat("iq2_xxs", 256, 66, 16),
        QFormat("iq2_xs", 256, 74, 17),
        QFormat("iq2_s", 256, 82, 22),
        QFormat("iq3_xxs", 256, 98, 18),
        QFormat("iq3_s", 256, 110, 21),
        QFormat("iq1_s", 256, 50, 19),
        QFormat("iq1_m", 256, 56, 29),
        QFormat("iq4_xs", 256, 136, 23),
        QFormat("tq1_0", 256, 54, 34),
        QFormat("tq2_0", 256, 66, 35),
        QFormat("mxfp4", 32, 17, 39),
        QFormat("mxfp4_gpt_oss", 32, 17, None),
    ]
}
FLOAT_DTYPES = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
# the compute dtypes as the command line and the benchmarks name them (torch's "fp32" for f32)
COMPUTE_DTYPES = {"fp32" if name == "f32" else name: dtype for name, dtype in FLOAT_DTYPES.items()}


def get_format(name: str) -> QFormat:
    if name not in FORMATS:
        raise FormatError(f"Unknown weight format {name!r}; known formats: {', '.join(FORMATS)}.")
    return FORMATS[name]


@dataclass(frozen=True)
class QTensor:
    """Weights of logical shape [E, out, in] (or [out, in]) stored as raw bytes [E, out, row_bytes]
    (uint8), so one expert is one contiguous slice `data[e]`."""

    format: QFormat
    shape: tuple[int, ...]
    data: torch.Tensor  # uint8 [..., out, in / block_size * block_bytes]

    def __post_init__(self):
        expected = (*self.shape[:-1], self.format.row_bytes(self.shape[-1], f"tensor of shape {self.shape}"))
        if self.data.dtype != torch.uint8 or tuple(self.data.shape) != expected:
            raise FormatError(
                f"{self.format.name} tensor of shape {self.shape} needs uint8 bytes of shape {expected}, "
                f"got {self.data.dtype} {tuple(self.data.shape)}."
            )

    @classmethod
    def from_bytes(cls, format_name: str, shape: tuple[int, ...], data: torch.Tensor) -> QTensor:
        """Raw bytes (any shape, e.g. flat from a file) of a `format_name` tensor of logical `shape`."""
        fmt = get_format(format_name)
        row = fmt.row_bytes(shape[-1], f"tensor of shape {tuple(shape)}")
        rows = 1
        for dim in shape[:-1]:
            rows *= dim
        if data.numel() != rows * row:
            raise FormatError(
                f"{fmt.name} tensor of shape {tuple(shape)} needs {rows * row} bytes, got {data.numel()}."
            )
        return cls(fmt, tuple(shape), data.reshape(*shape[:-1], row))

    def expert(self, e: int) -> QTensor:
        return QTensor(self.format, self.shape[1:], self.data[e])

    @property
    def nbytes(self) -> int:
        return self.data.numel()


def storage_free(t: torch.Tensor | QTensor) -> torch.Tensor | QTensor:
    """A weight's stand-in: its shape and dtype (a QTensor's format) on the meta device, nothing read;
    what is computed from it (joined, transposed, dequantised) is a stand-in too."""
    if isinstance(t, QTensor):
        return QTensor(t.format, t.shape, t.data.to("meta"))
    return t.to("meta")
