"""GPT-OSS's MXFP4 checkpoint layout and GGUF's, converted both ways without loss.

GPT-OSS stores each MXFP4 weight as `*_blocks` uint8 [..., n / 32, 16] (byte j: element 2j in the
low nibble, 2j + 1 in the high) and `*_scales` uint8 [..., n / 32] (E8M0). moerun holds such weights
as `mxfp4_gpt_oss` 17-byte blocks (scale byte, then the 16 bytes) or converts them to GGUF's `mxfp4`
block (elements 0-15 in the low nibbles, 16-31 in the high). The conversions only move nibbles and
bytes.
"""

from __future__ import annotations

import torch

from moerun.quant.dequant import unpack_mxfp4
from moerun.quant.formats import FormatError


def _check_gpt_oss(blocks: torch.Tensor, scales: torch.Tensor) -> None:
    if (
        blocks.dtype != torch.uint8
        or scales.dtype != torch.uint8
        or blocks.ndim < 2
        or blocks.shape[-1] != 16
        or blocks.shape[:-1] != scales.shape
    ):
        raise FormatError(
            f"GPT-OSS MXFP4 weights need `blocks` uint8 [..., n / 32, 16] and `scales` uint8 "
            f"[..., n / 32]; got blocks {blocks.dtype} {tuple(blocks.shape)} and scales {scales.dtype} "
            f"{tuple(scales.shape)}."
        )


def _split_mxfp4_blocks(data: torch.Tensor, fmt_name: str) -> torch.Tensor:
    """Rows of 17-byte blocks, uint8 [..., n / 32 * 17] -> [..., n / 32, 17]."""
    if data.dtype != torch.uint8 or data.ndim == 0 or data.shape[-1] % 17:
        raise FormatError(
            f"{fmt_name} bytes must be uint8 [..., n / 32 * 17] (17-byte blocks); "
            f"got {data.dtype} {tuple(data.shape)}."
        )
    return data.unflatten(-1, (-1, 17))


def gpt_oss_layout_bytes(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """GPT-OSS `*_blocks` [..., n / 32, 16] and `*_scales` [..., n / 32] -> `mxfp4_gpt_oss` bytes
    uint8 [..., n / 32 * 17]: each block's scale byte, then its 16 bytes unchanged."""
    _check_gpt_oss(blocks, scales)
    return torch.cat([scales[..., None], blocks], dim=-1).flatten(-2)


def mxfp4_from_gpt_oss(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """GPT-OSS `*_blocks` [..., n / 32, 16] and `*_scales` [..., n / 32] -> GGUF `mxfp4` bytes
    uint8 [..., n / 32 * 17] (the nibbles regrouped: elements 0-15 low, 16-31 high)."""
    _check_gpt_oss(blocks, scales)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2)  # [..., n / 32, 32]
    qs = codes[..., :16] | codes[..., 16:] << 4
    return torch.cat([scales[..., None], qs], dim=-1).flatten(-2)


def mxfp4_to_gpt_oss(data: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF `mxfp4` bytes uint8 [..., n / 32 * 17] -> GPT-OSS (`*_blocks` uint8 [..., n / 32, 16],
    `*_scales` uint8 [..., n / 32]); the exact inverse of `mxfp4_from_gpt_oss`."""
    e, codes = unpack_mxfp4(_split_mxfp4_blocks(data, "mxfp4"))
    blocks = codes[..., 0::2] | codes[..., 1::2] << 4
    return blocks, e.clone(memory_format=torch.contiguous_format)


def gpt_oss_layout_to_mxfp4(data: torch.Tensor) -> torch.Tensor:
    """`mxfp4_gpt_oss` bytes [..., n / 32 * 17] -> GGUF `mxfp4` bytes of the same shape and values."""
    blocks = _split_mxfp4_blocks(data, "mxfp4_gpt_oss")
    return mxfp4_from_gpt_oss(blocks[..., 1:17], blocks[..., 0])


def mxfp4_to_gpt_oss_layout(data: torch.Tensor) -> torch.Tensor:
    """GGUF `mxfp4` bytes [..., n / 32 * 17] -> `mxfp4_gpt_oss` bytes of the same shape and values."""
    return gpt_oss_layout_bytes(*mxfp4_to_gpt_oss(data))
