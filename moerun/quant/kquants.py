"""ggml's reference k-quant quantisers (Q2_K to Q6_K) in torch, vectorised over blocks.

Each `quantize_q*_k` takes float32 super-blocks [N, 256] and returns their GGUF bytes [N, block_bytes].
They follow `quantize_row_q*_K_ref` in ggml-quants.c, the path llama.cpp takes when it has no
importance matrix: the same searches for sub-block scales and mins (`make_qkx2_quants`,
`make_q3_quants`, `make_qx_quants`), the same quantisation of those scales against an fp16
super-block scale, the same final re-rounding of every element against the stored scales, and the
byte layouts of `ggml-common.h`.

The searches run over all sub-blocks at once, held element-major ([n, G]: element i of every group
is one contiguous row). Their Python loops run over candidate grids and over the n elements of a
group, never over blocks. Sums over a group's elements are taken left to right, as ggml's loops take
them: different candidate grids often fit within a rounding error of each other, and only the same
order of additions breaks those near-ties the way ggml does. With that, the bytes match ggml's
reference compiled without floating-point contraction (no fused multiply-adds).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moerun.quant.formats import FormatError

QK_K = 256
# ggml treats a group whose largest |x| is below this as all zero.
GROUP_MAX_EPS = 1e-15
F32 = torch.float32


def nearest_int(x: torch.Tensor) -> torch.Tensor:
    """ggml's `nearest_int` (adding 1.5 * 2^23) rounds half to even, as torch.round does."""
    return torch.round(x)


def f32(value: float) -> torch.Tensor:
    """A float32 scalar, so that arithmetic on constants rounds as C's `float` does."""
    return torch.tensor(value, dtype=F32)


def div(a: torch.Tensor | float, b: torch.Tensor | float) -> torch.Tensor:
    """a / b rounded once, as C divides. torch computes `number / tensor` as reciprocal * number,
    and CUDA `tensor / number` as tensor * (1 / number); each rounds twice and can differ in the
    last bit, which moves rounding boundaries."""
    if not isinstance(a, torch.Tensor):
        a = torch.full_like(b, a)
    if not isinstance(b, torch.Tensor):
        b = torch.full_like(a, b)
    return a / b


def seq_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum of t [n, ...] over its first dim, left to right from +0.0, as a C loop accumulates: [...].
    Several sums of the same loop go in one call, stacked after the first dim."""
    acc = torch.zeros_like(t[0])
    for row in t:
        acc = acc + row
    return acc


def half_bytes(d: torch.Tensor, fmt_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """fp16 scales [N] as (the float32 value they round to [N], their bytes [N, 2]).

    Refuses scales beyond fp16's range: ggml would store inf, which dequantises to inf or NaN."""
    h = d.to(torch.float16)
    if torch.isinf(h).any():
        raise FormatError(
            f"Cannot quantise to {fmt_name}: a block's scale ({d.abs().max().item():.4g}) exceeds float16's "
            f"range of 65504, so its values are too large for this format; store them as f32 or bf16."
        )
    return h.to(F32), h.reshape(-1, 1).view(torch.uint8)


def first_absmax(x: torch.Tensor, dim: int = -1) -> tuple[torch.Tensor, torch.Tensor]:
    """(max |x|, the signed x that first attains it) along `dim`, as ggml's `ax > amax` scan."""
    idx = x.abs().argmax(dim, keepdim=True)  # argmax returns the first of equal maxima
    signed = x.gather(dim, idx).squeeze(dim)
    return signed.abs(), signed


def pack_bits(parts: torch.Tensor, bits: int) -> torch.Tensor:
    """OR together parts [..., k, m] (uint8, each < 2^bits), part i shifted by i * bits: [..., m]."""
    out = parts[..., 0, :].clone()
    for i in range(1, parts.shape[-2]):
        out |= parts[..., i, :] << (bits * i)
    return out


def to_groups(x: torch.Tensor, sub: int) -> torch.Tensor:
    """Super-blocks [N, 256] -> element-major groups [sub, N * 256 / sub] (group g = N-major)."""
    return x.reshape(-1, sub).t().contiguous()


def from_groups(t: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of `to_groups` for per-element results: [sub, N * S] -> [N, S, sub]."""
    return t.t().reshape(n, -1, t.shape[0])


# ---------------------------------------------------------------- scale searches, x: [n, G]


@dataclass(frozen=True)
class ScaleMinSpec:
    """A k-quant with a scale and a min per sub-block, and the arguments ggml's reference passes to
    `make_qkx2_quants` for it."""

    name: str
    sub: int  # elements per sub-block
    nmax: int  # levels run 0..nmax
    rmin: float  # candidate grid k has nmax + rmin + rdelta * k steps across the sub-block's range
    rdelta: float
    nstep: int  # candidates k = 0..nstep
    use_mad: bool  # fit error |err| rather than err^2
    n_scale: int  # sub-block scales and mins are stored as 0..n_scale times an fp16 d (or dmin)


Q2_K = ScaleMinSpec("q2_k", sub=16, nmax=3, rmin=-0.5, rdelta=0.1, nstep=15, use_mad=True, n_scale=15)
Q4_K = ScaleMinSpec("q4_k", sub=32, nmax=15, rmin=-1.0, rdelta=0.1, nstep=20, use_mad=False, n_scale=63)
Q5_K = ScaleMinSpec("q5_k", sub=32, nmax=31, rmin=-0.5, rdelta=0.1, nstep=15, use_mad=False, n_scale=63)


def search_scale_min(
    x: torch.Tensor, w: torch.Tensor, spec: ScaleMinSpec
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ggml's `make_qkx2_quants`: x ~ scale * L - min with L in [0, nmax], for groups x, w [n, G].

    Starts from the plain min/max grid, then tries nstep + 1 stretched grids, each refit by weighted
    least squares, and keeps the one of smallest weighted error (|err| if use_mad, else err^2).
    Returns scale [G], min [G] (a non-negative offset: x ~ scale * L - min) and L [n, G] (float)."""
    nmax = spec.nmax
    lo = x.amin(0).clamp(max=0)  # the min is never above 0, so that 0 stays representable
    hi = x.amax(0)
    flat = hi == lo
    sum_w, sum_x = seq_sum(torch.stack([w, w * x], dim=1))

    def error(scale, offset, L):
        diff = scale * L + offset - x
        return seq_sum(w * (diff.abs() if spec.use_mad else diff * diff))

    def levels(iscale, origin):
        return nearest_int(iscale * (x - origin)).clamp(0, nmax)

    iscale = div(nmax, torch.where(flat, 1, hi - lo))
    scale = div(1, iscale)
    best = error(scale, lo, levels(iscale, lo))
    # The winning grid, as (iscale, origin): its levels are recomputed once at the end.
    grid_iscale, grid_origin = iscale, lo
    for step in range(spec.nstep + 1):
        # ggml grids from the best min found so far, not the data's min: `lo` moves as fits improve.
        iscale = (f32(spec.rdelta) * step + spec.rmin + nmax) / torch.where(flat, 1, hi - lo)
        Laux = levels(iscale, lo)
        wl = w * Laux
        sum_l, sum_l2, sum_xl = seq_sum(torch.stack([wl, wl * Laux, wl * x], dim=1))
        D = sum_w * sum_l2 - sum_l * sum_l
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
        # A positive min would leave 0 unrepresentable; refit the scale alone with min = 0.
        clipped = this_min > 0
        this_min = torch.where(clipped, 0, this_min)
        this_scale = torch.where(clipped, sum_xl / sum_l2, this_scale)
        this_error = error(this_scale, this_min, Laux)
        better = (D > 0) & (this_error < best)
        best = torch.where(better, this_error, best)
        grid_iscale = torch.where(better, iscale, grid_iscale)
        grid_origin = torch.where(better, lo, grid_origin)
        scale = torch.where(better, this_scale, scale)
        lo = torch.where(better, this_min, lo)
    L = torch.where(flat, 0, levels(grid_iscale, grid_origin))
    return torch.where(flat, 0, scale), -lo, L


def search_signed_scale(x: torch.Tensor, nmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml's `make_qx_quants` with rmse_type 1 and no importance: x ~ scale * (L - nmax), L in
    [0, 2 nmax), weighted by x^2, trying 18 grids around the one that maps the largest |x| to -nmax.
    Returns scale [G] (signed) and L [n, G] (float); all-zero groups give 0 and L = 0."""
    amax, peak = first_absmax(x, dim=0)
    zero = amax < GROUP_MAX_EPS
    peak = torch.where(zero, 1, peak)
    w = x * x
    wx = w * x

    def fit(iscale):
        l = nearest_int(iscale * x).clamp(-nmax, nmax - 1)
        sumlx, suml2 = seq_sum(torch.stack([wx * l, w * l * l], dim=1))
        return l, sumlx, suml2

    L, sumlx, suml2 = fit(div(-nmax, peak))
    scale = torch.where(suml2 != 0, sumlx / suml2, 0)
    best = scale * sumlx
    for step in [*range(-9, 0), *range(1, 10)]:
        l, sumlx, suml2 = fit(-(f32(0.1) * step + nmax) / peak)
        better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        scale = torch.where(better, sumlx / suml2, scale)
        best = torch.where(better, scale * sumlx, best)
        L = torch.where(better, l, L)
    return torch.where(zero, 0, scale), torch.where(zero, 0, L + nmax)


def search_q3_scale(x: torch.Tensor, nmax: int = 4, passes: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml's `make_q3_quants` with do_rmse: start from the grid mapping the largest |x| to -nmax,
    then up to `passes` sweeps that move one element at a time to the level that most improves
    the x^2-weighted fit. Returns scale [G] (signed) and L [n, G] in [0, 2 nmax) (float)."""
    amax, peak = first_absmax(x, dim=0)
    zero = amax < GROUP_MAX_EPS
    peak = torch.where(zero, 1, peak)
    w = x * x
    wx = w * x
    L = nearest_int(div(-nmax, peak) * x).clamp(-nmax, nmax - 1)
    sumlx, suml2 = seq_sum(torch.stack([wx * L, w * L * L], dim=1))
    for _ in range(passes):
        # Each element's move depends on the sums left by the one before it, as in ggml's loop.
        changed = torch.zeros_like(zero)
        for i in range(x.shape[0]):
            xi, wi, wxi, li = x[i], w[i], wx[i], L[i]
            slx = sumlx - wxi * li
            sl2 = suml2 - wi * li * li
            new_l = nearest_int(xi * sl2 / slx).clamp(-nmax, nmax - 1)
            slx_new = slx + wxi * new_l
            sl2_new = sl2 + wi * new_l * new_l
            take = (
                (slx > 0)
                & (new_l != li)
                & (sl2_new > 0)
                & (slx_new * slx_new * suml2 > sumlx * sumlx * sl2_new)
            )
            L[i] = torch.where(take, new_l, li)
            sumlx = torch.where(take, slx_new, sumlx)
            suml2 = torch.where(take, sl2_new, suml2)
            changed |= take
        # A sweep that changes nothing leaves the same state, so later sweeps would change nothing.
        if not changed.any():
            break
    scale = torch.where(suml2 > 0, sumlx / suml2, 0)
    return torch.where(zero, 0, scale), torch.where(zero, 0, L + nmax)


# ---------------------------------------------------------------- byte layouts


def _pack_2bit(L: torch.Tensor) -> torch.Tensor:
    """Levels [N, 256] < 4 as ggml's `qs`: byte 32c + l holds element 128c + 32s + l at bits 2s."""
    return pack_bits(L.reshape(-1, 2, 4, 32), 2).reshape(-1, 64)


def _pack_nibbles_k(L: torch.Tensor) -> torch.Tensor:
    """Levels [N, 256] < 16 as Q4_K/Q5_K's `qs`: byte 32c + l holds elements 64c + l (low nibble)
    and 64c + 32 + l (high nibble)."""
    return pack_bits(L.reshape(-1, 4, 2, 32), 4).reshape(-1, 128)


def _pack_6bit_scale_min(ls: torch.Tensor, lm: torch.Tensor) -> torch.Tensor:
    """Eight 6-bit scales and mins [N, 8] into Q4_K/Q5_K's 12 bytes: bytes 0-3 (4-7) hold scales
    (mins) 0-3 in their low 6 bits and the top 2 bits of scales (mins) 4-7 in their top 2 bits;
    bytes 8-11 hold the low 4 bits of scales 4-7 (low nibble) and mins 4-7 (high nibble)."""
    return torch.cat(
        [
            ls[:, :4] | (ls[:, 4:] >> 4) << 6,
            lm[:, :4] | (lm[:, 4:] >> 4) << 6,
            (ls[:, 4:] & 15) | (lm[:, 4:] & 15) << 4,
        ],
        dim=-1,
    )


# ---------------------------------------------------------------- formats


def _scales_and_mins(spec: ScaleMinSpec, x: torch.Tensor, w: torch.Tensor):
    """The shared body of Q2_K, Q4_K and Q5_K: fit a scale and a min per sub-block (weights w
    [sub, G]), quantise both to 0..n_scale against fp16 super-block maxima, then re-round every
    element against the stored values.
    Returns levels [N, 256], ls and lm [N, 256 / sub] (float) and the bytes of d and dmin."""
    n, sub, n_scale = x.shape[0], spec.sub, spec.n_scale
    scale, offset, L = search_scale_min(to_groups(x, sub), w, spec)
    scale, offset, L = scale.reshape(n, -1), offset.reshape(n, -1), from_groups(L, n)
    # ggml's maxima start from +0.0 and only rise (so a -0.0 min leaves dmin at +0.0).
    max_scale = scale.amax(-1)
    max_scale = torch.where(max_scale > 0, max_scale, 0)
    max_min = offset.amax(-1)
    max_min = torch.where(max_min > 0, max_min, 0)
    inv_scale = torch.where(max_scale > 0, div(n_scale, max_scale), 0)[:, None]
    inv_min = torch.where(max_min > 0, div(n_scale, max_min), 0)[:, None]
    # ggml stores these through uint8 with no lower bound; a negative fit would wrap, so clamp at 0.
    ls = nearest_int(inv_scale * scale).clamp(0, n_scale)
    lm = nearest_int(inv_min * offset).clamp(0, n_scale)
    d, d_bytes = half_bytes(div(max_scale, n_scale), spec.name)
    dmin, dmin_bytes = half_bytes(div(max_min, n_scale), spec.name)
    d_sub = (d[:, None] * ls)[..., None]  # [N, S, 1]
    m_sub = (dmin[:, None] * lm)[..., None]
    requant = nearest_int((x.reshape(n, -1, sub) + m_sub) / d_sub).clamp(0, spec.nmax)
    # Sub-blocks whose stored scale is 0 keep the levels of the search, as in ggml.
    L = torch.where(d_sub != 0, requant, L)
    return L.reshape(n, QK_K), ls, lm, d_bytes, dmin_bytes


def quantize_q2_k(x: torch.Tensor) -> torch.Tensor:
    """[N, 256] float32 -> [N, 84]: scales[16] (4-bit scale | 4-bit min << 4), qs[64], d, dmin."""
    L, ls, lm, d, dmin = _scales_and_mins(Q2_K, x, to_groups(x.abs(), 16))
    u8 = torch.uint8
    return torch.cat([ls.to(u8) | lm.to(u8) << 4, _pack_2bit(L.to(u8)), d, dmin], dim=-1)


def _q45_weights(x: torch.Tensor) -> torch.Tensor:
    """Q4_K/Q5_K weigh each element by the RMS of its 32-element sub-block plus its own |x|: [32, G]."""
    xg = to_groups(x, 32)
    rms = div(seq_sum(xg * xg), 32).sqrt()
    return rms + xg.abs()


def quantize_q4_k(x: torch.Tensor) -> torch.Tensor:
    """[N, 256] float32 -> [N, 144]: d, dmin, 6-bit scales and mins[12], qs[128]."""
    L, ls, lm, d, dmin = _scales_and_mins(Q4_K, x, _q45_weights(x))
    u8 = torch.uint8
    return torch.cat([d, dmin, _pack_6bit_scale_min(ls.to(u8), lm.to(u8)), _pack_nibbles_k(L.to(u8))], dim=-1)


def quantize_q5_k(x: torch.Tensor) -> torch.Tensor:
    """[N, 256] float32 -> [N, 176]: d, dmin, 6-bit scales and mins[12], qh[32], qs[128]."""
    L, ls, lm, d, dmin = _scales_and_mins(Q5_K, x, _q45_weights(x))
    u8 = torch.uint8
    L = L.to(u8)
    # Bit 4 of element 64c + 32h + j goes to bit 2c + h of qh[j].
    qh = pack_bits((L >> 4).reshape(-1, 8, 32), 1)
    scales = _pack_6bit_scale_min(ls.to(u8), lm.to(u8))
    return torch.cat([d, dmin, scales, qh, _pack_nibbles_k(L & 15)], dim=-1)


def quantize_q3_k(x: torch.Tensor) -> torch.Tensor:
    """[N, 256] float32 -> [N, 110]: hmask[32], qs[64], 6-bit signed scales[12], d."""
    n = x.shape[0]
    scale, L = search_q3_scale(to_groups(x, 16))
    scale, L = scale.reshape(n, 16), from_groups(L, n)
    _, max_scale = first_absmax(scale)
    has_scale = max_scale != 0
    iscale = div(-32, torch.where(has_scale, max_scale, 1))[:, None]
    # Stored as 6 bits with an offset of 32; a block without scales stores zeros (sc = -32, d = 0).
    ls = torch.where(has_scale[:, None], nearest_int(iscale * scale).clamp(-32, 31) + 32, 0)
    d, d_bytes = half_bytes(torch.where(has_scale, div(1, iscale.squeeze(-1)), 0), "q3_k")
    d_sub = (d[:, None] * (ls - 32))[..., None]
    requant = nearest_int(x.reshape(n, 16, 16) / d_sub).clamp(-4, 3) + 4
    L = torch.where(d_sub != 0, requant, L).reshape(n, QK_K).to(torch.uint8)

    ls = ls.to(torch.uint8)
    # The low 4 bits of scale j go to byte j % 8 (low nibble for j < 8, else high); its top 2 bits
    # go to byte 8 + j % 4, at bit 2 * (j // 4).
    low = (ls[:, :8] & 15) | (ls[:, 8:] & 15) << 4
    high = pack_bits(ls.reshape(n, 4, 4) >> 4, 2)
    # Bit 2 of element 32b + m goes to bit b of hmask[m]; qs keeps the low 2 bits.
    hmask = pack_bits((L >> 2).reshape(n, 8, 32), 1)
    return torch.cat([hmask, _pack_2bit(L & 3), low, high, d_bytes], dim=-1)


def quantize_q6_k(x: torch.Tensor) -> torch.Tensor:
    """[N, 256] float32 -> [N, 210]: ql[128], qh[64], int8 scales[16], d."""
    n = x.shape[0]
    scale, L = search_signed_scale(to_groups(x, 16), nmax=32)
    scale, L = scale.reshape(n, 16), from_groups(L, n)
    max_abs, max_scale = first_absmax(scale)
    zero = max_abs < GROUP_MAX_EPS
    iscale = div(-128, torch.where(zero, 1, max_scale))[:, None]
    sc = torch.where(zero[:, None], 0, nearest_int(iscale * scale).clamp(-128, 127))
    d, d_bytes = half_bytes(torch.where(zero, 0, div(1, iscale.squeeze(-1))), "q6_k")
    d_sub = (d[:, None] * sc)[..., None]
    requant = nearest_int(x.reshape(n, 16, 16) / d_sub).clamp(-32, 31) + 32
    L = torch.where(d_sub != 0, requant, L)
    # ggml writes an all-zero block, levels included, for a super-block without scales.
    L = torch.where(zero[:, None, None], 0, L).reshape(n, QK_K).to(torch.uint8)

    quarters = L.reshape(n, 2, 4, 32)  # [N, half c, quarter s, l]: element 128c + 32s + l
    low = quarters & 15
    ql = (low[:, :, :2] | low[:, :, 2:] << 4).reshape(n, 128)
    qh = pack_bits(quarters >> 4, 2).reshape(n, 64)
    return torch.cat([ql, qh, sc.to(torch.int8).view(torch.uint8), d_bytes], dim=-1)
