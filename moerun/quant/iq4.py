"""ggml's IQ4_NL and IQ4_XS quantisers without an importance matrix, in torch, vectorised over blocks.

Both store 4-bit codes into `IQ4NL_VALUES`, a non-linear grid of 16 int8 values, against a scale per
32-element sub-block. They follow `quantize_iq4_nl` / `quantize_iq4_xs` in ggml-quants.c (what
llama.cpp's quantiser runs; both call `quantize_row_iq4_nl_impl` with ntry 7) taking the path for
no importance matrix, where element j of a sub-block weighs x_j^2:

1. A sub-block whose largest |x| is below 1e-15 gets scale 0.
2. Otherwise the scale starts at max / 127 (max: the signed x of largest |x|, the first one). For it
   and for each of the 15 inverse scales (t - 127) / max, t = -7 .. 7, every x takes the value
   nearest to x * inverse (a tie goes to the larger value), and the least-squares scale
   d = sum(w q x) / sum(w q^2) of those values is kept where it explains more of x, i.e. where
   sum(w q x)^2 / sum(w q^2) beats the best so far (the first candidate always counts).
3. IQ4_NL stores that scale as fp16; IQ4_XS stores d = -(the scale of largest |scale|) / 32 as fp16
   and each sub-block's scale as l = round(scale / d) in [-32, 31] (6 bits, offset 32).
4. Every x is then coded again against the scale kept (IQ4_NL) or against d * l (IQ4_XS), both in
   float32 before any fp16 rounding, as ggml does.

Sums over a sub-block's 32 elements are taken left to right, as ggml's loops take them, so that
near-ties between candidate scales break the same way; the sub-blocks are held element-major
([32, G]) for that.
"""

from __future__ import annotations

import torch

from moerun.quant import kquants
from moerun.quant.iq_tables import IQ4NL_VALUES

F32 = torch.float32
SUB = 32  # elements per scale
NTRY = 7  # quantize_iq4_nl / quantize_iq4_xs: inverse scales (t - 127) / max for t in -NTRY .. NTRY


def _values(device: torch.device) -> torch.Tensor:
    return torch.tensor(IQ4NL_VALUES, dtype=F32, device=device)


# The doubled midpoints value[i - 1] + value[i] are integers in [2 value[0], 2 value[-1]]: 2y reaches
# one exactly when floor(2y) does, so a table indexed by floor(2y) holds each code.
_LOW, _HIGH = 2 * IQ4NL_VALUES[0], 2 * IQ4NL_VALUES[-1]
_MIDPOINTS = [IQ4NL_VALUES[i - 1] + IQ4NL_VALUES[i] for i in range(1, len(IQ4NL_VALUES))]
_CODE_OF_FLOOR = [sum(k >= m for m in _MIDPOINTS) for k in range(_LOW, _HIGH + 1)]


def nearest_code(y: torch.Tensor) -> torch.Tensor:
    """ggml's `best_index_int8` over IQ4NL_VALUES: the code of the value nearest to y, a tie going
    to the larger value (y picks value i once 2y reaches value[i - 1] + value[i], exact in float32;
    NaN, which reaches none, code 0). Codes int64, y's shape."""
    table = torch.tensor(_CODE_OF_FLOOR, dtype=torch.int64, device=y.device)
    twice = torch.nan_to_num(y + y, nan=_LOW).clamp(_LOW, _HIGH).floor()
    return table[(twice - _LOW).long()]


def _sums(x: torch.Tensor, w: torch.Tensor, inverse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum w q x, sum w q^2) [G] of x [32, G] coded against `inverse` [G], left to right."""
    q = _values(x.device)[nearest_code(inverse * x)]
    wq = w * q
    sums = kquants.seq_sum(torch.stack([wq * x, wq * q], dim=1))  # [32, 2, G] -> [2, G]
    return sums[0], sums[1]


def sub_block_scales(x: torch.Tensor) -> torch.Tensor:
    """Steps 1-2 of the module docstring: x [32, G] (element-major sub-blocks) -> scales [G]."""
    w = x * x
    amax, peak = kquants.first_absmax(x, dim=0)
    d = kquants.div(-peak, float(IQ4NL_VALUES[0]))
    sumqx, sumq2 = _sums(x, w, kquants.div(1, d))
    d = torch.where(sumq2 > 0, kquants.div(sumqx, sumq2), 0)
    best = d * sumqx
    for t in range(-NTRY, NTRY + 1):
        inverse = kquants.div(float(t + IQ4NL_VALUES[0]), peak)
        sumqx, sumq2 = _sums(x, w, inverse)
        better = (sumq2 > 0) & (sumqx * sumqx > best * sumq2)
        d = torch.where(better, kquants.div(sumqx, sumq2), d)
        best = torch.where(better, d * sumqx, best)
    return torch.where(amax < kquants.GROUP_MAX_EPS, 0, d)


def _inverse(d: torch.Tensor) -> torch.Tensor:
    """ggml's `d ? 1/d : 0`."""
    return torch.where(d == 0, 0, kquants.div(1, d))


def _pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """Codes [N, S] -> [N, S / 2] bytes: per 32 elements, low nibbles 0-15 and high nibbles 16-31."""
    runs = codes.to(torch.uint8).reshape(codes.shape[0], -1, 2, 16)
    return (runs[:, :, 0] | runs[:, :, 1] << 4).flatten(1)


def quantize_iq4_nl(x: torch.Tensor) -> torch.Tensor:
    """[N, 32] float32 -> [N, 18]: fp16 scale, then 16 bytes of codes (low nibbles elements 0-15)."""
    d = sub_block_scales(x.t().contiguous())
    codes = nearest_code(_inverse(d)[:, None] * x)
    _, d_bytes = kquants.half_bytes(d, "iq4_nl")
    return torch.cat([d_bytes, _pack_codes(codes)], -1)


def quantize_iq4_xs(x: torch.Tensor) -> torch.Tensor:
    """[N, 256] float32 -> [N, 136]: fp16 d, uint16 of the 8 scales' top 2 bits (2 bits each), 4
    bytes of their low nibbles (sub-block 2i low, 2i + 1 high), then 128 bytes of codes."""
    n = x.shape[0]
    scales = sub_block_scales(x.reshape(-1, SUB).t().contiguous()).reshape(n, -1)  # [N, 8]
    largest, biggest = kquants.first_absmax(scales)
    # ggml's max_scale starts at +0 and changes only for a |scale| above 0: all-zero blocks get -0.
    d = kquants.div(-torch.where(largest > 0, biggest, 0), 32)
    l = kquants.nearest_int(_inverse(d)[:, None] * scales).clamp(-32, 31)  # [N, 8]
    step = d[:, None] * l
    codes = nearest_code(_inverse(step).repeat_interleave(SUB, -1) * x)
    _, d_bytes = kquants.half_bytes(d, "iq4_xs")
    fields = (l + 32).to(torch.int64)
    high = ((fields >> 4) << torch.arange(0, 16, 2, device=x.device)).sum(-1)
    high_bytes = torch.stack([high & 0xFF, high >> 8], -1).to(torch.uint8)
    low = (fields & 15).reshape(n, 4, 2)
    low_bytes = (low[..., 0] | low[..., 1] << 4).to(torch.uint8)
    return torch.cat([d_bytes, high_bytes, low_bytes, _pack_codes(codes)], -1)
