"""Reading a block's fields from raw little-endian bytes in torch: reinterpreted floats, fp16 scales
(exactly, NaN payloads kept, as the gguf package's numpy does) and packed bit fields."""

from __future__ import annotations

import sys

import torch

F32 = torch.float32


def reinterpret(data: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Little-endian bytes uint8 [..., k * size] as `dtype` [..., k], the bits unchanged."""
    size = torch.empty((), dtype=dtype).element_size()
    if sys.byteorder == "big":
        data = data.unflatten(-1, (-1, size)).flip(-1).flatten(-2)
    # view(dtype) needs a contiguous last dim and a storage offset aligned to the new element size;
    # slices of blocks (a scale field inside each block) are neither, so they are copied first.
    if not data.is_contiguous() or data.storage_offset() % size:
        data = data.clone(memory_format=torch.contiguous_format)
    return data.view(dtype)


def fp16(field: torch.Tensor) -> torch.Tensor:
    """An fp16 field, bytes [..., 2], as its exact value in float32 [...]."""
    return f16_to_f32(reinterpret(field, torch.float16).squeeze(-1))


def f16_to_f32(h: torch.Tensor) -> torch.Tensor:
    """float16 [...] -> float32 [...], exactly, NaN payloads included: torch's cast turns every NaN
    into one canonical NaN, while numpy (and so the gguf package) keeps the sign and mantissa bits."""
    values = h.to(F32)
    nan = torch.isnan(values)
    if not nan.any():  # weights hold no NaN: skip the bit surgery below
        return values
    # A NaN's float32 bits are its fp16 bits shifted up by 13 (the sign-extended int16 fills the
    # sign and the top exponent bits with copies of the sign), with the exponent's top 3 bits set.
    nan_bits = (h.view(torch.int16).to(torch.int32) << 13) | 0x70000000
    return torch.where(nan, nan_bits, values.view(torch.int32)).view(F32)


def split_bits(x: torch.Tensor, shifts: tuple[int, ...], mask: int) -> torch.Tensor:
    """uint8 [..., m] -> [..., len(shifts), m]: the field (x >> shift) & mask for each shift."""
    return torch.stack([(x >> s) & mask for s in shifts], dim=-2)
