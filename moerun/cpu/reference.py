"""The torch reference of moerun.cpu, with the same signatures: what each kernel computes, in float64.

Exact mode: dequantise (moerun.quant.dequant, bit-exact against the gguf package) and multiply in
float64. Integer mode: quantise the activations with the kernels' algorithm (ggml's q8_K and q8_0
reference quantisers, here in numpy float32), take every integer dot product exactly, and apply the
per-block scales as the kernels do (each block's fp32 scale product, then float64 sums). The
256-element formats (k-quants, i-quants, ternary) go through q8_K with a scale per 16 elements
(moerun.quant.iquants' SuperBlocks for the i-quants), the 32-element ones through q8_0, q4_1's and
q5_1's min through the sum of each activation block's qs. Besides each value, `matmul_terms`
returns the sum of the absolute values of every term, which bounds the error of a kernel's fp32
arithmetic.
"""

from __future__ import annotations

import numpy as np
import torch

from moerun.activations import Activation
from moerun.quant import dequant, iquants
from moerun.quant.formats import get_format

F64 = torch.float64


def quantize_q8_k(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x float32 [T, n] -> (d float32 [T, n/256], qs int8 [T, n], bsums int64 [T, n/16]), as ggml's
    quantize_row_q8_K_ref: max = the x of largest |x| (first of ties), iscale = -127 / max,
    qs = min(127, round-half-even(iscale * x)), d = 1 / iscale; all-zero blocks give d = 0, qs = 0."""
    xb = x.numpy().astype(np.float32).reshape(x.shape[0], -1, 256)
    first = np.abs(xb).argmax(-1)[..., None]
    peak = np.take_along_axis(xb, first, -1)  # [T, nb, 1]
    with np.errstate(divide="ignore", invalid="ignore"):
        iscale = np.where(peak == 0, np.float32(0), np.float32(-127) / peak).astype(np.float32)
        d = np.where(peak == 0, np.float32(0), np.float32(1) / iscale).astype(np.float32)
    qs = np.minimum(127, np.rint((iscale * xb).astype(np.float32))).astype(np.int8)
    bsums = qs.reshape(x.shape[0], -1, 16).astype(np.int64).sum(-1)
    return torch.from_numpy(d[..., 0]), torch.from_numpy(qs.reshape(x.shape)), torch.from_numpy(bsums)


def quantize_q8_0(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x float32 [T, n] -> (d float32 [T, n/32] holding fp16 values, qs int8 [T, n]), as ggml's
    quantize_row_q8_0_ref: d = amax / 127, qs = roundf(x / d) with ties away from zero."""
    xb = x.numpy().astype(np.float32).reshape(x.shape[0], -1, 32)
    d = (np.abs(xb).max(-1, keepdims=True) / np.float32(127)).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)
    v = (xb * inv).astype(np.float32)
    qs = np.clip(np.trunc(v) + np.where(np.abs(v - np.trunc(v)) >= 0.5, np.sign(v), 0), -128, 127).astype(
        np.int8
    )
    d16 = d[..., 0].astype(np.float16).astype(np.float32)
    return torch.from_numpy(d16), torch.from_numpy(qs.reshape(x.shape))


def _blocks(fmt_name: str, data: torch.Tensor) -> torch.Tensor:
    fmt = get_format(fmt_name)
    return data.reshape(data.shape[0], -1, fmt.block_bytes)  # [out, nb, block_bytes]


def _k_parts(fmt_name: str, blocks: torch.Tensor):
    """-> (d, dmin, sc, mn, q): d, dmin float32 [out, nb]; sc, mn int64 [out, nb, 16] (one per 16
    elements); q int64 [out, nb, 256]. The i-quants and ternary formats: iquants' SuperBlocks, no min."""
    unpack = iquants.UNPACKERS.get(fmt_name) or getattr(dequant, f"unpack_{fmt_name}")
    parts = unpack(blocks)
    if len(parts) == 3:
        d, sc, q = parts
        dmin, mn = torch.zeros_like(d), torch.zeros_like(sc)
    else:
        d, dmin, sc, mn, q = parts
    rep = 16 // sc.shape[-1]
    return d, dmin, sc.long().repeat_interleave(rep, -1), mn.long().repeat_interleave(rep, -1), q.long()


def _b32_parts(fmt_name: str, blocks: torch.Tensor):
    """-> (d float32 [out, nb], q int64 [out, nb, 32], m float32 [out, nb]: the min, zero without)."""
    if fmt_name.startswith("mxfp4"):
        e, codes = getattr(dequant, f"unpack_{fmt_name}")(blocks)
        d = dequant.e8m0_half_scale(e)
        return d, torch.tensor(dequant.MXFP4_VALUES)[codes.long()], torch.zeros_like(d)
    parts = getattr(dequant, f"unpack_{fmt_name}")(blocks)
    if len(parts) == 3:  # q4_1, q5_1: value d * q + m
        d, m, q = parts
        return d, q.long(), m
    d, q = parts
    return d, q.long(), torch.zeros_like(d)


def matmul_terms(
    fmt_name: str, data: torch.Tensor, x: torch.Tensor, integer: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (value float64 [T, out], magnitude float64 [T, out]: the sum of |term| over every product
    and scale term the kernel adds, so |kernel - value| <= c * 2^-24 * magnitude for fp32 sums)."""
    fmt = get_format(fmt_name)
    if not integer or fmt.is_float:
        w = dequant.dequantize_bytes(fmt, data.view(torch.uint8) if data.dtype != torch.uint8 else data).to(
            F64
        )
        return x.to(F64) @ w.T, x.to(F64).abs() @ w.abs().T
    blocks = _blocks(fmt_name, data)
    if fmt.block_size == 256:
        d, dmin, sc, mn, q = _k_parts(fmt_name, blocks)
        xd, qs, bsums = quantize_q8_k(x)
        qs = qs.to(F64).unflatten(-1, (-1, 16, 16))  # [T, nb, 16, 16]
        qg = q.to(F64).unflatten(-1, (16, 16))  # [out, nb, 16, 16]
        dots = torch.einsum("obgl,tbgl->tobg", qg, qs)  # exact: integers below 2^53
        absdots = torch.einsum("obgl,tbgl->tobg", qg.abs(), qs.abs())
        s1 = (dots * sc.to(F64)).sum(-1)  # [T, out, nb]
        s2 = (bsums.to(F64).unflatten(-1, (-1, 16))[:, None] * mn.to(F64)).sum(-1)
        scale = (xd[:, None] * d[None]).to(F64)  # fp32 products, as the kernels form them
        scale_min = (xd[:, None] * dmin[None]).to(F64)
        value = (scale * s1 - scale_min * s2).sum(-1)
        mag = (scale.abs() * (absdots * sc.abs().to(F64)).sum(-1) + (scale_min * s2).abs()).sum(-1)
        return value, mag
    d, q, m = _b32_parts(fmt_name, blocks)
    xd, qs = quantize_q8_0(x)
    qs = qs.to(F64).unflatten(-1, (-1, 32))
    dots = torch.einsum("obl,tbl->tob", q.to(F64), qs)
    absdots = torch.einsum("obl,tbl->tob", q.to(F64).abs(), qs.abs())
    scale = (d[None] * xd[:, None]).to(F64)
    # the min's term, (m * yd) * (sum of the block's qs), as ggml's q8_1 pairing
    min_terms = (m[None] * xd[:, None]).to(F64) * qs.sum(-1)[:, None]  # [T, out, nb]
    return (scale * dots + min_terms).sum(-1), (scale.abs() * absdots + min_terms.abs()).sum(-1)


def matmul(fmt_name: str, data: torch.Tensor, x: torch.Tensor, integer: bool = False) -> torch.Tensor:
    """moerun.cpu.matmul's value in float64 [T, out]."""
    return matmul_terms(fmt_name, data, x.reshape(-1, x.shape[-1]), integer)[0]


def moe_decode(
    x: torch.Tensor,
    gate_up: list[tuple[str, torch.Tensor]],
    down: list[tuple[str, torch.Tensor]],
    slots: tuple[torch.Tensor, torch.Tensor],
    act: Activation,
    integer: bool = False,
    biases: tuple[list[torch.Tensor | None], list[torch.Tensor | None]] | None = None,
) -> torch.Tensor:
    """moerun.cpu.moe_decode in float64 [T, H] (integer mode: the activation is computed in float64
    from the reference's gate_up outputs, rounded to float32 and quantised again for down)."""
    slot_expert, slot_weight = slots
    gate_up_bias, down_bias = biases if biases is not None else (None, None)
    T, k = slot_expert.shape
    out = torch.zeros(T, x.shape[1], dtype=F64)
    for t in range(T):
        for j in range(k):
            e = int(slot_expert[t, j])
            h = matmul(*gate_up[e], x[t : t + 1], integer)[0]
            if gate_up_bias and gate_up_bias[e] is not None:
                h = h + gate_up_bias[e].to(F64)
            a = act(h[None])  # moerun.activations on float64
            # integer mode quantises the activation from float32, as the kernel holds it
            y = matmul(*down[e], a.float() if integer else a, integer)[0]
            if down_bias and down_bias[e] is not None:
                y = y + down_bias[e].to(F64)
            out[t] += float(slot_weight[t, j]) * y
    return out
