"""Q8_1 activations and integer dot products of quantised weight rows with them: the torch reference
that GPU decode kernels are tested against.

`quantize_q8_1` is ggml's `quantize_row_q8_1_ref` (ggml-quants.c): blocks of 32 int8 quants `qs`,
an fp16 scale `d = amax / 127` and an fp16 `s = d * sum(qs)`. `dot_q8_1` multiplies a weight
format's integer quants (from `dequant.unpack_*`) with `qs`, sums the products per sub-block in
int32, and only then applies the float scales, as ggml's CUDA `vec_dot_*_q8_1` (vecdotq.cuh, the
mul_mat_vec_q path) does. Everything is torch ops and runs on the device that holds the tensors.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from moerun.quant import dequant, iquants
from moerun.quant.formats import FormatError, QTensor, get_format

F32 = torch.float32
I32 = torch.int32
QK8_1 = 32  # elements per q8_1 block
FP16_MAX = 65504.0
DOT_FORMATS = (
    "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl", "mxfp4", "q2_k", "q3_k", "q4_k", "q5_k", "q6_k",
    "iq4_xs",
)  # fmt: skip


@dataclass(frozen=True)
class Q8_1:
    """Activation rows [..., n] quantised to q8_1: value i is d[i // 32] * qs[i].

    qs: int8 [..., n] in [-127, 127]. d, s: float32 [..., n / 32], each holding an fp16 value
    exactly (the fp16 fields of ggml's `block_q8_1`); s = fp16(d_f32 * sum of the block's qs), where
    d_f32 is the float32 scale before its rounding to fp16."""

    qs: torch.Tensor
    d: torch.Tensor
    s: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        """The values d * qs, float32 [..., n]."""
        return (self.d[..., None] * self.qs.to(F32).unflatten(-1, (-1, QK8_1))).flatten(-2)

    def to_bytes(self) -> torch.Tensor:
        """ggml's block layout, uint8 [..., n / 32 * 36]: per block d (fp16), s (fp16), 32 int8 qs."""
        halves = torch.stack([self.d, self.s], dim=-1).to(torch.float16)  # [..., nb, 2]
        half_bytes = halves.contiguous().view(torch.uint8).unflatten(-1, (2, 2))  # [..., nb, 2, 2]
        if sys.byteorder == "big":
            half_bytes = half_bytes.flip(-1)
        qs = self.qs.contiguous().view(torch.uint8).unflatten(-1, (-1, QK8_1))  # [..., nb, 32]
        return torch.cat([half_bytes.flatten(-2), qs], dim=-1).flatten(-2)


def _round_half_away(v: torch.Tensor) -> torch.Tensor:
    """C's roundf: to nearest, ties away from zero (torch.round ties to even). v - trunc(v) is exact."""
    t = torch.trunc(v)
    return t + torch.sign(v) * ((v - t).abs() >= 0.5).to(v.dtype)


def quantize_q8_1(x: torch.Tensor) -> Q8_1:
    """Float activation rows [..., n] (n a multiple of 32) -> Q8_1, as ggml's `quantize_row_q8_1_ref`.

    Per block of 32 (x cast to float32 first): d = amax / 127 in float32; id = 1 / d (0 when d is 0);
    qs = roundf(x * id); the stored d is fp16(d) and s = fp16(d * sum(qs)), using the float32 d.
    One deviation: a block whose 1 / d overflows float32 (amax < ~3.7e-37; undefined behaviour in
    ggml) is stored as zeros. Refuses (FormatError) non-float input, a bad length, inf or NaN, and
    blocks whose d or s overflow fp16 (amax above 65504 * 127, or |d * sum(qs)| above 65504)."""
    if not x.is_floating_point() or x.ndim == 0 or x.shape[-1] == 0 or x.shape[-1] % QK8_1:
        raise FormatError(
            f"q8_1 quantises float rows whose length is a positive multiple of {QK8_1}; got a "
            f"{x.dtype} tensor of shape {tuple(x.shape)}."
        )
    blocks = x.to(F32).unflatten(-1, (-1, QK8_1))  # [..., nb, 32]
    if not torch.isfinite(blocks).all():
        raise FormatError("Cannot quantise activations containing inf or NaN to q8_1.")

    d = blocks.abs().amax(dim=-1) / 127.0  # [..., nb], float32 as in ggml
    inv = torch.where(d != 0, 1.0 / d, torch.zeros_like(d))
    tiny = torch.isinf(inv)
    inv = torch.where(tiny, torch.zeros_like(inv), inv)
    d = torch.where(tiny, torch.zeros_like(d), d)
    qs = _round_half_away(blocks * inv[..., None]).to(torch.int8)  # [..., nb, 32]
    s = qs.sum(dim=-1, dtype=I32).to(F32) * d

    d16, s16 = d.to(torch.float16), s.to(torch.float16)
    if torch.isinf(d16).any() or torch.isinf(s16).any():
        raise FormatError(
            f"Activations too large for q8_1's fp16 scales: a block's amax / 127 (at most "
            f"{d.max().item():.6g}) or d * sum(qs) (at most {s.abs().max().item():.6g}) exceeds "
            f"fp16's {FP16_MAX:g}; keep this layer's activations in float."
        )
    return Q8_1(qs=qs.flatten(-2), d=d16.to(F32), s=s16.to(F32))


# ---------------------------------------------------------------- integer dot products


def _isum(wq: torch.Tensor, aq: torch.Tensor, size: int) -> torch.Tensor:
    """Integer dot products per sub-block of `size`: wq [R, nb, B], aq [nb, B] -> int32 [R, nb, B / size]."""
    return (wq.to(I32) * aq.to(I32)).unflatten(-1, (-1, size)).sum(dim=-1, dtype=I32)


def _d8_per_sub_block(act: Q8_1, nb: int, size: int) -> torch.Tensor:
    """The q8_1 scale of each weight sub-block of `size` elements (16 or 32): float32 [nb, B / size]."""
    return act.d.reshape(nb, -1).repeat_interleave(QK8_1 // size, dim=-1)


def _k_quant(d, scales, q, act, size, dmin=None, mins=None) -> torch.Tensor:
    """d * sum_j d8_j * (sc_j * isum_j) [- dmin * sum_j d8_j * (m_j * qsum_j)] per super-block, summed:
    d, dmin [R, nb]; scales, mins [R, nb, 256 / size]; q [R, nb, 256] -> float32 [R]."""
    nb = q.shape[1]
    aq = act.qs.reshape(nb, -1)  # [nb, 256]
    d8 = _d8_per_sub_block(act, nb, size)  # [nb, S]
    sumf_d = (d8 * (_isum(q, aq, size) * scales.to(I32)).to(F32)).sum(dim=-1)  # [R, nb]
    out = d * sumf_d
    if dmin is not None:
        qsum = aq.to(I32).unflatten(-1, (-1, size)).sum(dim=-1, dtype=I32)  # [nb, S]
        sumf_m = (d8 * (qsum * mins.to(I32)).to(F32)).sum(dim=-1)  # [R, nb]
        out = out - dmin * sumf_m
    return out.sum(dim=-1)


def _dot_q8_0(blocks: torch.Tensor, act: Q8_1) -> torch.Tensor:
    d, q = dequant.unpack_q8_0(blocks)  # [R, nb], [R, nb, 32]
    isum = _isum(q, act.qs.reshape(-1, QK8_1), QK8_1)[..., 0]  # [R, nb]
    return (d * act.d * isum.to(F32)).sum(dim=-1)


def _dot_q4_0(blocks: torch.Tensor, act: Q8_1) -> torch.Tensor:
    d, q = dequant.unpack_q4_0(blocks)
    # Unsigned nibbles 0..15 against qs; the offset -8 comes back as -8 * s (ggml's vec_dot_q4_0_q8_1).
    isum = _isum(q.to(I32) + 8, act.qs.reshape(-1, QK8_1), QK8_1)[..., 0]  # [R, nb]
    return (d * (isum.to(F32) * act.d - 8.0 * act.s)).sum(dim=-1)


def _dot_with_min(d: torch.Tensor, m: torch.Tensor, q: torch.Tensor, act: Q8_1) -> torch.Tensor:
    """Q4_1 / Q5_1: per block isum * (d * d8) + m * s (ggml's vec_dot_q4_1/q5_1_q8_1), unsigned q."""
    isum = _isum(q, act.qs.reshape(-1, QK8_1), QK8_1)[..., 0]  # [R, nb]
    return (isum.to(F32) * (d * act.d) + m * act.s).sum(dim=-1)


def _dot_q4_1(blocks: torch.Tensor, act: Q8_1) -> torch.Tensor:
    return _dot_with_min(*dequant.unpack_q4_1(blocks), act)


def _dot_q5_1(blocks: torch.Tensor, act: Q8_1) -> torch.Tensor:
    return _dot_with_min(*dequant.unpack_q5_1(blocks), act)


def _dot_q5_0(blocks: torch.Tensor, act: Q8_1) -> torch.Tensor:
    d, q = dequant.unpack_q5_0(blocks)
    # As q4_0: the unsigned 5-bit fields 0..31 against qs, the offset -16 back as -16 * s.
    isum = _isum(q.to(I32) + 16, act.qs.reshape(-1, QK8_1), QK8_1)[..., 0]  # [R, nb]
    return (d * (isum.to(F32) * act.d - 16.0 * act.s)).sum(dim=-1)


def _dot_iq4_nl(blocks: torch.Tensor, act: Q8_1) -> torch.Tensor:
    d, q = dequant.unpack_iq4_nl(blocks)
    isum = _isum(q, act.qs.reshape(-1, QK8_1), QK8_1)[..., 0]  # [R, nb]
    return ((d * act.d) * isum.to(F32)).sum(dim=-1)


def _dot_iq4_xs(blocks: torch.Tensor, act: Q8_1) -> torch.Tensor:
    d, scales, q = iquants.unpack_iq4_xs(blocks)  # [R, nb], [R, nb, 8], [R, nb, 256]
    nb = q.shape[1]
    # per sub-block of 32: (d * d8_j) * (isum_j * (ls_j - 32)), as ggml's vec_dot_iq4_xs_q8_1
    isum = _isum(q, act.qs.reshape(nb, -1), QK8_1) * scales.to(I32)  # [R, nb, 8]
    return ((d[..., None] * act.d.reshape(nb, -1)) * isum.to(F32)).sum(dim=(-2, -1))


def _dot_mxfp4(blocks: torch.Tensor, act: Q8_1) -> torch.Tensor:
    e, codes = dequant.unpack_mxfp4(blocks)
    table = torch.tensor(dequant.MXFP4_VALUES, dtype=I32, device=codes.device)
    isum = _isum(table[codes.long()], act.qs.reshape(-1, QK8_1), QK8_1)[..., 0]  # [R, nb]
    return (dequant.e8m0_half_scale(e) * act.d * isum.to(F32)).sum(dim=-1)


def _dot_q2_k(blocks: torch.Tensor, act: Q8_1) -> torch.Tensor:
    d, dmin, scales, mins, q = dequant.unpack_q2_k(blocks)
    return _k_quant(d, scales, q, act, 16, dmin, mins)


def _dot_q3_k(blocks: torch.Tensor, act: Q8_1) -> torch.Tensor:
    d, scales, q = dequant.unpack_q3_k(blocks)
    return _k_quant(d, scales, q, act, 16)


def _dot_q4_k(blocks: torch.Tensor, act: Q8_1) -> torch.Tensor:
    d, dmin, scales, mins, q = dequant.unpack_q4_k(blocks)
    return _k_quant(d, scales, q, act, 32, dmin, mins)


def _dot_q5_k(blocks: torch.Tensor, act: Q8_1) -> torch.Tensor:
    d, dmin, scales, mins, q = dequant.unpack_q5_k(blocks)
    return _k_quant(d, scales, q, act, 32, dmin, mins)


def _dot_q6_k(blocks: torch.Tensor, act: Q8_1) -> torch.Tensor:
    d, scales, q = dequant.unpack_q6_k(blocks)
    return _k_quant(d, scales, q, act, 16)


_DOTS = {
    "q8_0": _dot_q8_0,
    "q4_0": _dot_q4_0,
    "q4_1": _dot_q4_1,
    "q5_0": _dot_q5_0,
    "q5_1": _dot_q5_1,
    "iq4_nl": _dot_iq4_nl,
    "iq4_xs": _dot_iq4_xs,
    "q2_k": _dot_q2_k,
    "q3_k": _dot_q3_k,
    "q4_k": _dot_q4_k,
    "q5_k": _dot_q5_k,
    "q6_k": _dot_q6_k,
    "mxfp4": _dot_mxfp4,
}


def dot_q8_1(fmt_name: str, weight_rows: torch.Tensor, act: Q8_1) -> torch.Tensor:
    """Dot products of weight rows with one q8_1 activation row, in ggml's integer form.

    weight_rows: uint8 [R, row_bytes] of format `fmt_name` (one of DOT_FORMATS), rows of n elements.
    act: Q8_1 of one row (qs [n], d and s [n / 32]), on the same device. Returns float32 [R].

    Per weight row, with q8_1 block b's fp16 scale d8_b and s_b, and isum = the int32 sum of products
    of the weight's integer quants with qs over a sub-block (weight scales are the fp16/E8M0 values):
      q8_0:  sum_b d_b * d8_b * isum_b                       (q in [-128, 127])
      q4_0:  sum_b d_b * (d8_b * isum_b - 8 * s_b)           (isum over the unsigned nibbles 0..15)
      q5_0:  sum_b d_b * (d8_b * isum_b - 16 * s_b)          (isum over the unsigned fields 0..31)
      q4_1, q5_1: sum_b isum_b * (d_b * d8_b) + m_b * s_b    (unsigned q; m the fp16 min)
      iq4_nl: sum_b (d_b * d8_b) * isum_b                    (q IQ4NL_VALUES, -127..113)
      iq4_xs: sum over sub-blocks j of 32 of (d * d8_j) * (isum_j * (ls_j - 32))
      mxfp4: sum_b (2^(e_b - 128) * d8_b) * isum_b           (q the doubled E2M1 values, -12..12)
      q3_k, q6_k: per super-block d * sum_j d8_j * (sc_j * isum_j), sub-blocks j of 16
             (q3_k: q in [-4, 3], sc in [-32, 31]; q6_k: q in [-32, 31], sc int8)
      q2_k, q4_k, q5_k: per super-block d * sum_j d8_j * (sc_j * isum_j)
             - dmin * sum_j d8_j * (m_j * qsum_j), with qsum_j the int32 sum of qs over sub-block j
             (sub-blocks of 16 for q2_k, 32 for q4_k/q5_k; unsigned q), summed over super-blocks.
    These are ggml's CUDA mul_mat_vec_q dot products (vecdotq.cuh): only the 32-element formats with
    an offset or a min use s; the k-quant mins use d8 times the integer sum of qs, as there. So the
    result is the float dot product of the dequantised weights with act.dequantize(), up to float32
    rounding and summation order, except for those using s, which differ from that by
    sum_b c_b * (s_b - d8_b * sum(qs_b)) (s's fp16 rounding), c_b = -8 d_b for q4_0, -16 d_b for
    q5_0, m_b for q4_1 and q5_1."""
    if fmt_name not in _DOTS:
        raise FormatError(
            f"No q8_1 dot product for weight format {fmt_name!r}; supported: {', '.join(DOT_FORMATS)}."
        )
    fmt = get_format(fmt_name)
    if act.qs.ndim != 1:
        raise FormatError(
            f"dot_q8_1 takes one activation row (qs of shape [n]); got qs of shape {tuple(act.qs.shape)}."
        )
    n = act.qs.shape[0]
    row_bytes = fmt.row_bytes(n, f"activation row of {n} elements")
    if weight_rows.dtype != torch.uint8 or weight_rows.ndim != 2 or weight_rows.shape[1] != row_bytes:
        raise FormatError(
            f"{fmt_name} weight rows for a q8_1 activation of {n} elements must be uint8 [R, {row_bytes}]; "
            f"got {weight_rows.dtype} {tuple(weight_rows.shape)}."
        )
    blocks = weight_rows.reshape(weight_rows.shape[0], -1, fmt.block_bytes)  # [R, nb, block_bytes]
    return _DOTS[fmt_name](blocks, act)


def matvec_q8_1(qtensor_expert: QTensor, x: torch.Tensor) -> torch.Tensor:
    """One expert's weights QTensor [out, in] times activations x float [..., in] -> float32 [..., out]:
    each row of x is quantised with `quantize_q8_1` and multiplied with `dot_q8_1`."""
    if len(qtensor_expert.shape) != 2 or x.ndim == 0 or x.shape[-1] != qtensor_expert.shape[1]:
        raise FormatError(
            f"matvec_q8_1 takes one expert's weights [out, in] and activations [..., in]; got weights "
            f"{qtensor_expert.shape} and activations {tuple(x.shape)}."
        )
    rows = x.reshape(-1, x.shape[-1])
    out = [dot_q8_1(qtensor_expert.format.name, qtensor_expert.data, quantize_q8_1(row)) for row in rows]
    out_dim = qtensor_expert.shape[0]
    if not out:
        return torch.empty(*x.shape[:-1], out_dim, dtype=F32, device=x.device)
    return torch.stack(out).reshape(*x.shape[:-1], out_dim)
