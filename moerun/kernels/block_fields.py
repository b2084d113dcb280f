"""Reading the fields of ggml blocks inside kernels: bytes, int8 quants and little-endian fp16 scales
at uint8 pointers (any shape), converted exactly to int32 or fp32."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def byte(ptr, mask):
    """The bytes at uint8 pointers `ptr`, as int32 (0 where masked)."""
    return tl.load(ptr, mask=mask, other=0).to(tl.int32)


@triton.jit
def int8(ptr, mask):
    """The bytes at `ptr` read as int8, as fp32."""
    return tl.load(ptr, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)


@triton.jit
def fp16_bits(bits):
    """fp16 bit patterns (int32 in [0, 65535]) -> their exact fp32 values."""
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def fp16(ptr, mask):
    """The little-endian fp16 field at uint8 pointers `ptr`, as its exact fp32 value."""
    return fp16_bits(byte(ptr, mask) | (byte(ptr + 1, mask) << 8))
