"""Finding blocks whose scale is not a number: an fp16 scale field that decodes to inf or NaN.

Such a block makes every value it holds inf or NaN, and so every logit downstream; ggml's
`ggml_validate_row_data` refuses the same blocks. The fp16 fields' offsets are ggml's block layouts
(ggml-common.h). MXFP4's E8M0 scale has no such value (ggml reads 255 as 2^127), and the float
formats hold values, not scales: neither is checked here.
"""

from __future__ import annotations

import torch

from moerun.quant.formats import QFormat

# Byte offsets of each block's fp16 scale fields (d, and dmin or m where the format has one).
FP16_SCALES: dict[str, tuple[int, ...]] = {
    "q4_0": (0,),
    "q4_1": (0, 2),
    "q5_0": (0,),
    "q5_1": (0, 2),
    "q8_0": (0,),
    "iq4_nl": (0,),
    "q2_k": (80, 82),
    "q3_k": (108,),
    "q4_k": (0, 2),
    "q5_k": (0, 2),
    "q6_k": (208,),
    "iq2_xxs": (0,),
    "iq2_xs": (0,),
    "iq2_s": (0,),
    "iq3_xxs": (0,),
    "iq3_s": (0,),
    "iq1_s": (0,),
    "iq4_xs": (0,),
    "tq1_0": (52,),
    "tq2_0": (64,),
}
# IQ1_M keeps its fp16 d in the top nibbles of the 4 uint16 at byte 48: d's exponent (bits 10-14)
# is the top 2 bits of byte 53 (the third word's nibble, d's bits 8-11) and bits 4-6 of byte 55
# (the fourth's, d's bits 12-15).
_CHUNK_BLOCKS = 1 << 20


def _exponent_all_ones(high: torch.Tensor) -> torch.Tensor:
    """The high bytes [...] of fp16 fields (bits 8-15): whether the 5 exponent bits are all set."""
    return (high & 0x7C) == 0x7C


def first_nonfinite_block(fmt: QFormat, data: torch.Tensor) -> int | None:
    """The index of the first block of `data` (uint8 [..., row_bytes] of format `fmt`, blocks
    counted in memory order) whose fp16 scale is inf or NaN; None where there is none or the
    format has no fp16 scale."""
    if fmt.name not in FP16_SCALES and fmt.name != "iq1_m":
        return None
    blocks = data.reshape(-1, fmt.block_bytes)
    for start in range(0, blocks.shape[0], _CHUNK_BLOCKS):
        chunk = blocks[start : start + _CHUNK_BLOCKS]
        if fmt.name == "iq1_m":
            bad = ((chunk[:, 53] & 0xC0) == 0xC0) & ((chunk[:, 55] & 0x70) == 0x70)
        else:
            bad = torch.zeros(chunk.shape[0], dtype=torch.bool)
            for offset in FP16_SCALES[fmt.name]:
                bad |= _exponent_all_ones(chunk[:, offset + 1])
        if bad.any():
            return start + int(bad.nonzero()[0])
    return None
