"""Random block-quantised weights for the kernel tests: every byte random (so every bit pattern of
the quants, grid indices, signs and packed sub-block scales occurs), except the fp16 scales, which
hold random values that keep |w| near 0.05 (MXFP4: E8M0 scales near 2^-6)."""

import torch

from moerun.quant.formats import QTensor, get_format

# Byte offset of each fp16 scale in a block, and its size
SCALE_FIELDS = {
    "q8_0": [(0, 1e-3)],
    "q4_0": [(0, 1e-2)],
    "q4_1": [(0, 1e-2), (2, 1e-2)],
    "q5_0": [(0, 5e-3)],
    "q5_1": [(0, 5e-3), (2, 5e-3)],
    "iq4_nl": [(0, 5e-4)],
    "q2_k": [(80, 1e-3), (82, 1e-3)],
    "q3_k": [(108, 5e-4)],
    "q4_k": [(0, 2e-4), (2, 2e-4)],
    "q5_k": [(0, 1e-4), (2, 1e-4)],
    "q6_k": [(208, 5e-5)],
    "iq2_xxs": [(0, 3e-4)],
    "iq2_xs": [(0, 3e-4)],
    "iq2_s": [(0, 3e-4)],
    "iq3_xxs": [(0, 1e-4)],
    "iq3_s": [(0, 1e-4)],
    "iq1_s": [(0, 3e-3)],
    "iq4_xs": [(0, 2e-5)],
    "tq1_0": [(52, 5e-2)],
    "tq2_0": [(64, 5e-2)],
}
IQ1_M_SCALE = 3e-3  # iq1_m's d lies in the top nibbles of bytes 49, 51, 53 and 55, lowest first


def random_blocks(fmt: str, shape: tuple[int, ...], gen: torch.Generator, device="cpu") -> QTensor:
    """A QTensor of logical shape [..., k] (k a whole number of blocks) of random bytes of `fmt`."""
    f = get_format(fmt)
    *lead, k = shape
    data = torch.randint(0, 256, (*lead, k // f.block_size, f.block_bytes), generator=gen, dtype=torch.uint8)
    for offset, scale in SCALE_FIELDS.get(fmt, []):
        d = (torch.rand(data.shape[:-1], generator=gen) + 0.5) * scale
        data[..., offset : offset + 2] = d.half().view(torch.uint8).reshape(*d.shape, 2)
    if fmt == "iq1_m":
        d = ((torch.rand(data.shape[:-1], generator=gen) + 0.5) * IQ1_M_SCALE).half().view(torch.int16).int()
        for j in range(4):
            nibble = ((d >> (4 * j)) & 0x0F).to(torch.uint8)
            data[..., 49 + 2 * j] = (data[..., 49 + 2 * j] & 0x0F) | (nibble << 4)
    if fmt == "mxfp4":
        data[..., 0] = torch.randint(120, 125, data.shape[:-1], generator=gen, dtype=torch.uint8)
    return QTensor(f, tuple(shape), data.reshape(*lead, -1).to(device))
