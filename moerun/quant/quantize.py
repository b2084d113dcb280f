"""Quantise float weights into the formats of `formats.FORMATS`, as ggml's reference quantisers do.

`quantize_rows` turns float rows into the bytes of one format; `quantize` wraps a [E, out, in] or
[out, in] tensor into a QTensor. Block formats follow `quantize_row_*_ref` in ggml-quants.c (the
path llama.cpp takes without an importance matrix): Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, MXFP4, TQ1_0 and
TQ2_0 here, the k-quants in `kquants`, IQ4_NL and IQ4_XS in `iq4`. The formats here give the same
bytes as the gguf package's numpy quantisers (MXFP4 except for blocks below 2^-125, where ggml's
exponent wraps around and ours stops at its smallest).
f32, f16 and bf16 are plain round-to-nearest-even casts, stored little-endian.

Everything is torch, vectorised over blocks, and runs on the device that holds the input.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import torch

from moerun.quant import iq4, kquants
from moerun.quant.formats import FLOAT_DTYPES, FormatError, QFormat, QTensor, get_format

F32 = torch.float32
# Blocks are quantised a slice of about this many elements at a time, to bound temporary memory.
CHUNK_ELEMENTS = 1 << 20

# MXFP4's E2M1 values, doubled so that they are integers (ggml's `kvalues_mxfp4`); the stored scale
# is then half the E8M0 scale. Indices 8-15 are the negatives of 0-7.
MXFP4_MAGNITUDES = (0, 1, 2, 3, 4, 6, 8, 12)


def _round_half_away(x: torch.Tensor) -> torch.Tensor:
    """C's roundf (ties away from zero), without floor(|x| + 0.5)'s error just below one half."""
    a = x.abs()
    whole = a.floor()
    return torch.sign(x) * (whole + (2 * (a - whole)).floor())


def _as_int8_like_c(q: torch.Tensor) -> torch.Tensor:
    """A float -> int8 conversion as x86 performs C's: inf and NaN (from 1/d overflowing on tiny
    blocks, whose fp16 scale is 0 anyway) become 0, as they do in ggml and numpy."""
    return torch.where(torch.isfinite(q), q, 0)


def _scale_and_inverse(d: torch.Tensor, fmt_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp16 bytes [N, 2] of d, 1 / d [N, 1] or 0 where d is 0), as ggml's `id = d ? 1.0f/d : 0.0f`."""
    inv = torch.where(d == 0, 0, kquants.div(1, d))[:, None]
    return kquants.half_bytes(d, fmt_name)[1], inv


def quantize_q8_0(x: torch.Tensor) -> torch.Tensor:
    """[N, 32] float32 -> [N, 34]: fp16 d = max|x| / 127, then 32 int8 of roundf(x / d)."""
    d_bytes, inv = _scale_and_inverse(kquants.div(x.abs().amax(-1), 127), "q8_0")
    q = _as_int8_like_c(_round_half_away(x * inv)).clamp(-128, 127)
    return torch.cat([d_bytes, q.to(torch.int8).view(torch.uint8)], dim=-1)


def quantize_q4_0(x: torch.Tensor) -> torch.Tensor:
    """[N, 32] float32 -> [N, 18]: fp16 d = (the x of largest |x|) / -8, then 16 bytes whose low
    nibbles hold elements 0-15 and high nibbles 16-31, each trunc(x / d + 8.5) capped at 15."""
    _, peak = kquants.first_absmax(x)
    d_bytes, inv = _scale_and_inverse(kquants.div(peak, -8), "q4_0")
    q = _as_int8_like_c(torch.trunc(x * inv + 8.5)).clamp(0, 15).to(torch.uint8)
    return torch.cat([d_bytes, _nibbles(q)], dim=-1)


def _min_and_step(x: torch.Tensor, levels: int, fmt_name: str):
    """Q4_1 / Q5_1's block min m and step d = (max - m) / levels: (d and m fp16 bytes [N, 4],
    trunc((x - m) / d + 0.5) [N, 32] as float)."""
    lo, hi = x.amin(-1), x.amax(-1)
    d_bytes, inv = _scale_and_inverse(kquants.div(hi - lo, levels), fmt_name)
    _, m_bytes = kquants.half_bytes(lo, fmt_name)
    q = _as_int8_like_c(torch.trunc((x - lo[:, None]) * inv + 0.5))
    return torch.cat([d_bytes, m_bytes], -1), q


def _fifth_bits(q: torch.Tensor) -> torch.Tensor:
    """Bit 4 of each of 32 codes [N, 32] as a little-endian uint32 [N, 4] (bit i: element i)."""
    bits = ((q >> 4) & 1).reshape(-1, 4, 8)
    weights = torch.tensor([1 << i for i in range(8)], dtype=torch.uint8, device=q.device)
    return (bits * weights).sum(-1, dtype=torch.uint8)


def _nibbles(q: torch.Tensor) -> torch.Tensor:
    """Codes [N, 32] -> 16 bytes: low nibbles elements 0-15, high nibbles 16-31."""
    return (q[:, :16] & 15) | (q[:, 16:] & 15) << 4


def quantize_q4_1(x: torch.Tensor) -> torch.Tensor:
    """[N, 32] float32 -> [N, 20]: fp16 d = (max - min) / 15, fp16 min, then 16 bytes of nibbles
    min(15, trunc((x - min) / d + 0.5))."""
    head, q = _min_and_step(x, 15, "q4_1")
    return torch.cat([head, _nibbles(q.clamp(0, 15).to(torch.uint8))], -1)


def quantize_q5_1(x: torch.Tensor) -> torch.Tensor:
    """[N, 32] float32 -> [N, 24]: fp16 d = (max - min) / 31, fp16 min, the codes' fifth bits as a
    uint32, then their low nibbles as Q4_1's."""
    head, q = _min_and_step(x, 31, "q5_1")
    q = q.clamp(0, 31).to(torch.uint8)
    return torch.cat([head, _fifth_bits(q), _nibbles(q)], -1)


def quantize_q5_0(x: torch.Tensor) -> torch.Tensor:
    """[N, 32] float32 -> [N, 22]: fp16 d = (the x of largest |x|) / -16, the fifth bits of
    min(31, trunc(x / d + 16.5)) as a uint32, then their low nibbles as Q4_0's."""
    _, peak = kquants.first_absmax(x)
    d_bytes, inv = _scale_and_inverse(kquants.div(peak, -16), "q5_0")
    q = _as_int8_like_c(torch.trunc(x * inv + 16.5)).clamp(0, 31).to(torch.uint8)
    return torch.cat([d_bytes, _fifth_bits(q), _nibbles(q)], -1)


def _ternary(x: torch.Tensor, fmt_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """TQ1_0 / TQ2_0's codes roundf(x / max|x|) + 1 in {0, 1, 2} [N, 256] (int64), fp16 d bytes."""
    d_bytes, inv = _scale_and_inverse(x.abs().amax(-1), fmt_name)
    return (_as_int8_like_c(_round_half_away(x * inv)) + 1).to(torch.int64), d_bytes


def quantize_tq2_0(x: torch.Tensor) -> torch.Tensor:
    """[N, 256] float32 -> [N, 66]: per 128 elements 32 bytes whose bits 2k, 2k+1 hold the code of
    element 32k + j of byte j; then fp16 d = max|x|."""
    q, d_bytes = _ternary(x, "tq2_0")
    runs = q.reshape(-1, 2, 4, 32) << torch.tensor([0, 2, 4, 6], device=x.device)[:, None]
    return torch.cat([runs.sum(-2).reshape(-1, 64).to(torch.uint8), d_bytes], -1)


def quantize_tq1_0(x: torch.Tensor) -> torch.Tensor:
    """[N, 256] float32 -> [N, 54]: five codes a byte as a base-3 number c0 c1 c2 c3 c4 (elements
    j, 32 + j, ... of bytes 0-31; 160 + j, 176 + j, ... of 32-47), bytes 48-51 four codes each
    (240 + j, 244 + j, 248 + j, 252 + j, the last digit 0), each number v stored as
    ceil(v * 256 / 243) so that digit k is ((byte * 3^k mod 256) * 3) >> 8; then fp16 d = max|x|."""
    q, d_bytes = _ternary(x, "tq1_0")
    powers = torch.tensor([81, 27, 9, 3, 1], device=x.device)[:, None]
    parts = (
        (q[:, :160].reshape(-1, 5, 32) * powers).sum(-2),
        (q[:, 160:240].reshape(-1, 5, 16) * powers).sum(-2),
        (q[:, 240:].reshape(-1, 4, 4) * powers[:4]).sum(-2),
    )
    v = torch.cat(parts, -1)
    return torch.cat([((v * 256 + 242) // 243).to(torch.uint8), d_bytes], -1)


def _mxfp4_codes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, 32] float32 -> (E8M0 exponents [N] uint8, 4-bit codes [N, 32] uint8), as ggml: the exponent
    is floor(log2 max|x|) - 2 (+127 bias), and each x takes the first code of least |value - x|."""
    amax = x.abs().amax(-1)
    # log2 in float64 then rounded to float32 is what a correctly rounded log2f gives; it decides
    # maxima just below a power of two as ggml and numpy do. Blocks below 2^-125 would need a
    # negative exponent, which ggml's uint8 cast wraps around; they get the smallest scale instead.
    log2 = torch.log2(amax.double()).to(F32).floor()
    e = torch.where(amax > 0, log2 - 2 + 127, 0).clamp(0, 254)
    # ggml's half-scale of E8M0 e: 2^(e - 128), built from its float32 bits (e < 2: a subnormal).
    e_int = e.to(torch.int32)
    bits = torch.where(e_int < 2, torch.full_like(e_int, 0x00200000) << e_int, (e_int - 1) << 23)
    half_scale = bits.view(F32)[:, None]
    # The nearest magnitude wins; a tie keeps the earlier (smaller) one, as ggml's strict `<` scan.
    # Negative x mirror positive x exactly, so only magnitudes need comparing.
    a = x.abs()
    best_err = a.clone()  # the error of magnitude 0
    best = torch.zeros_like(x, dtype=torch.uint8)
    for code, magnitude in enumerate(MXFP4_MAGNITUDES[1:], start=1):
        err = (magnitude * half_scale - a).abs()
        closer = err < best_err
        best_err = torch.where(closer, err, best_err)
        best = torch.where(closer, code, best)
    # A negative x takes the negative code (index + 8), except for 0, whose first index is 0.
    best = torch.where((x < 0) & (best > 0), best + 8, best)
    return e.to(torch.uint8), best


def quantize_mxfp4(x: torch.Tensor) -> torch.Tensor:
    """[N, 32] float32 -> [N, 17] GGUF MXFP4: E8M0 scale byte, then low nibbles elements 0-15 and
    high nibbles 16-31."""
    e, codes = _mxfp4_codes(x)
    return torch.cat([e[:, None], codes[:, :16] | codes[:, 16:] << 4], dim=-1)


def quantize_mxfp4_gpt_oss(x: torch.Tensor) -> torch.Tensor:
    """[N, 32] float32 -> [N, 17] in GPT-OSS's nibble order: byte j holds elements 2j (low) and
    2j + 1 (high). Same codes and scale as `quantize_mxfp4`."""
    e, codes = _mxfp4_codes(x)
    return torch.cat([e[:, None], codes[:, 0::2] | codes[:, 1::2] << 4], dim=-1)


BLOCK_QUANTIZERS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "q8_0": quantize_q8_0,
    "q4_0": quantize_q4_0,
    "q4_1": quantize_q4_1,
    "q5_0": quantize_q5_0,
    "q5_1": quantize_q5_1,
    "iq4_nl": iq4.quantize_iq4_nl,
    "iq4_xs": iq4.quantize_iq4_xs,
    "tq1_0": quantize_tq1_0,
    "tq2_0": quantize_tq2_0,
    "mxfp4": quantize_mxfp4,
    "mxfp4_gpt_oss": quantize_mxfp4_gpt_oss,
    "q2_k": kquants.quantize_q2_k,
    "q3_k": kquants.quantize_q3_k,
    "q4_k": kquants.quantize_q4_k,
    "q5_k": kquants.quantize_q5_k,
    "q6_k": kquants.quantize_q6_k,
}

# Formats moerun reads but does not write, and why. ggml makes the first three only with an importance
# matrix (ggml_quantize_requires_imatrix); the others' grid searches are not implemented here.
_NEEDS_IMATRIX = "ggml makes it only with an importance matrix (llama-imatrix), which moerun does not compute"
_GRID_SEARCH = "moerun lacks its codebook-grid search, which llama.cpp runs with an importance matrix"
READ_ONLY = {
    "iq2_xxs": _NEEDS_IMATRIX,
    "iq2_xs": _NEEDS_IMATRIX,
    "iq1_s": _NEEDS_IMATRIX,
    "iq1_m": _GRID_SEARCH,
    "iq2_s": _GRID_SEARCH,
    "iq3_xxs": _GRID_SEARCH,
    "iq3_s": _GRID_SEARCH,
}
WRITABLE = (*FLOAT_DTYPES, *BLOCK_QUANTIZERS)


def not_writable(name: str) -> str:
    """The sentence saying why moerun cannot write format `name`."""
    if name in READ_ONLY:
        return (
            f"moerun reads {name} but cannot write it: {READ_ONLY[name]}; make the file with llama.cpp's "
            f"llama-quantize and load it with moerun."
        )
    return f"Quantising to {name} is not supported; moerun writes {', '.join(WRITABLE)}."


def _check_finite(x: torch.Tensor, fmt: QFormat) -> None:
    bad = ~torch.isfinite(x)
    count = int(bad.sum())
    if count:
        first = tuple(int(i) for i in bad.nonzero()[0])
        raise FormatError(
            f"Cannot quantise a tensor of shape {tuple(x.shape)} to {fmt.name}: it holds {count} "
            f"non-finite value(s) (inf or NaN), the first at index {first}."
        )


def _cast_bytes(fmt: QFormat, x: torch.Tensor) -> torch.Tensor:
    cast = x.detach().to(FLOAT_DTYPES[fmt.name])
    if not torch.isfinite(cast).all():
        raise FormatError(
            f"Cannot store a tensor whose largest |value| is {x.abs().max().item():.4g} as {fmt.name}: "
            f"it overflows that type's range."
        )
    data = cast.contiguous().view(torch.uint8)  # the host's byte order
    if sys.byteorder == "big":
        size = cast.element_size()
        data = data.reshape(*data.shape[:-1], -1, size).flip(-1).reshape(data.shape)
    return data


def quantize_rows(fmt: QFormat, x: torch.Tensor) -> torch.Tensor:
    """Float rows x [..., n] -> the bytes of `fmt`, uint8 [..., n / block_size * block_bytes].

    Refuses (FormatError) a row length that is not a whole number of blocks, and inf or NaN."""
    if not x.is_floating_point():
        raise FormatError(f"Cannot quantise a {x.dtype} tensor to {fmt.name}: quantisation needs floats.")
    if x.ndim == 0:
        raise FormatError(f"Cannot quantise a 0-d tensor to {fmt.name}: it has no rows.")
    row_bytes = fmt.row_bytes(x.shape[-1], f"tensor of shape {tuple(x.shape)}")
    _check_finite(x, fmt)
    if fmt.is_float:
        return _cast_bytes(fmt, x)
    if fmt.name not in BLOCK_QUANTIZERS:
        raise FormatError(not_writable(fmt.name))
    quantize_blocks = BLOCK_QUANTIZERS[fmt.name]
    blocks = x.detach().to(F32).reshape(-1, fmt.block_size)  # [N, block_size]; no autograd graph
    per_chunk = max(1, CHUNK_ELEMENTS // fmt.block_size)
    chunks = [quantize_blocks(chunk) for chunk in blocks.split(per_chunk)]
    out = torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.uint8, device=x.device)
    return out.reshape(*x.shape[:-1], row_bytes)


def quantize(x: torch.Tensor, format_name: str) -> QTensor:
    """Weights x [E, out, in] or [out, in] (float) as a QTensor of `format_name`, whose bytes
    [E, out, row_bytes] hold each expert as one contiguous slice."""
    fmt = get_format(format_name)
    if x.ndim not in (2, 3):
        raise FormatError(
            f"Cannot quantise a tensor of shape {tuple(x.shape)}: weights are [E, out, in] or [out, in]."
        )
    return QTensor(fmt, tuple(x.shape), quantize_rows(fmt, x).contiguous())
