/* The grid i-quants' decode for the 16-lane prefill GEMM of gemm_lanes_k_avx512.c (gemm_lanes.h):
 * one super-block of 16 rows into sbdec_t, each row's grid entries gathered into its dword lane,
 * as value + 128. Layouts and values as iq_unpack.h (ggml's). */
#include "gemm_lanes.h"

#ifdef MOERUN_AVX512
/* (v >> shift) & mask in each dword. */
static inline __m512i field(__m512i v, int shift, int mask) {
    return _mm512_and_si512(_mm512_srl_epi32(v, _mm_cvtsi32_si128(shift)), _mm512_set1_epi32(mask));
}

/* 128 + each byte of v, or 128 - it where neg is set. */
static inline __m512i signed_codes(__m512i v, __mmask64 neg) {
    const __m512i c128 = _mm512_set1_epi8((char)0x80);
    return _mm512_mask_sub_epi8(_mm512_add_epi8(v, c128), neg, c128, v);
}

/* 7-bit sign indices (each dword's low byte) -> KSIGNS_IQ2XS's signs: bit 7 set where the popcount
 * of the 7 bits is odd (ggml's table). */
static inline __m512i ksigns(__m512i si) {
    __m512i par = _mm512_xor_si512(si, _mm512_srli_epi32(si, 4));
    par = _mm512_xor_si512(par, _mm512_srli_epi32(par, 2));
    par = _mm512_and_si512(_mm512_xor_si512(par, _mm512_srli_epi32(par, 1)), _mm512_set1_epi32(1));
    return _mm512_or_si512(si, _mm512_slli_epi32(par, 7));
}

/* The 8-byte grid entries at index gi (dword lane i: row i's) -> e[0] their bytes 0-3, e[1] bytes
 * 4-7, row i's in dword lane i. */
static inline void gather8(__m512i gi, const void *grid, __m512i e[2]) {
    const __m512i lo = _mm512_i32gather_epi64(_mm512_castsi512_si256(gi), grid, 8); /* rows 0-7 */
    const __m512i hi = _mm512_i32gather_epi64(_mm512_extracti64x4_epi64(gi, 1), grid, 8);
    const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    e[0] = _mm512_permutex2var_epi32(lo, even, hi);
    e[1] = _mm512_permutex2var_epi32(lo, _mm512_add_epi32(even, _mm512_set1_epi32(1)), hi);
}

static inline __m512 f16x16(const uint16_t d16[ROWS]) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)d16)); }

/* The fp16 at byte `at` of each row. */
static inline __m512 f16_lanes(const uint8_t *const rp[ROWS], int64_t at) {
    uint16_t d16[ROWS];
    for (int i = 0; i < ROWS; i++) d16[i] = rd16(rp[i] + at);
    return f16x16(d16);
}

/* 16 scales 2 * nibble + 1, two per byte (low first), at byte `at` of each row (IQ2_XS, IQ2_S). */
static inline void odd_scales16(const uint8_t *const rp[ROWS], int64_t at, sbdec_t *D) {
    int32_t sc[2][ROWS];
    for (int i = 0; i < ROWS; i++) memcpy(&sc[0][i], rp[i] + at, 4), memcpy(&sc[1][i], rp[i] + at + 4, 4);
    for (int h = 0; h < 2; h++) {
        const __m512i s = _mm512_loadu_si512((const void *)sc[h]);
        for (int j = 0; j < 8; j++) {
            const __m512i nib = field(s, 4 * j, 15);
            set_scale(D, 8 * h + j, _mm512_add_epi32(_mm512_add_epi32(nib, nib), _mm512_set1_epi32(1)));
        }
    }
}

/* IQ3_XXS: grid entry m (elements 4m .. 4m + 3) is IQ3XXS_GRID[qs[m]]; sub-block ib's uint32 aux at
 * 66 + 4 ib holds the signs of its 4 groups of 8 (7-bit indices into KSIGNS_IQ2XS) and the scale
 * 2 * (aux >> 28) + 1; d the fp16 d times 0.25f. */
static void iq3_xxs_decode16(const uint8_t *const rp[ROWS], int64_t b, sbdec_t *D) {
    const int64_t at = b * 98;
    D->d = _mm512_mul_ps(f16_lanes(rp, at), _mm512_set1_ps(0.25f));
    __m512i aux[8];
    dwords16(rp, at + 66, aux);
    dwords16(rp, at + 82, aux + 4);
    for (int j = 0; j < 4; j++) { /* grid entries 16j .. 16j + 15: sub-blocks 2j, 2j + 1 */
        __m512i v[4];
        dwords16(rp, at + 2 + 16 * j, v);
        for (int half = 0; half < 2; half++) {
            const int ib = 2 * j + half;
            const __m512i top = _mm512_srli_epi32(aux[ib], 28);
            scale_per32(D, ib, _mm512_add_epi32(_mm512_add_epi32(top, top), _mm512_set1_epi32(1)));
            for (int k = 0; k < 8; k++) { /* entry 8 ib + k: byte e % 4 of v[e / 4] */
                const int e = 8 * half + k;
                const __m512i g = _mm512_i32gather_epi32(field(v[e / 4], 8 * (e % 4), 255), (const void *)IQ3XXS_GRID, 4);
                const __m512i signs = ksigns(field(aux[ib], 7 * (k / 2), 127)); /* group k / 2 */
                D->w[ib][k] = signed_codes(g, nibble_bits(signs, k % 2));
            }
        }
    }
}

/* IQ3_S: grid entry m (elements 4m .. 4m + 3) from index qs[m] | bit m of qh << 8; the sign of
 * element j bit j of the signs; the scale of sub-block ib 2 * (its nibble) + 1. */
static void iq3_s_decode16(const uint8_t *const rp[ROWS], int64_t b, sbdec_t *D) {
    const int64_t at = b * 110;
    int32_t qh[2][ROWS], sc[ROWS];
    for (int i = 0; i < ROWS; i++) {
        for (int h = 0; h < 2; h++) memcpy(&qh[h][i], rp[i] + at + 66 + 4 * h, 4);
        memcpy(sc + i, rp[i] + at + 106, 4);
    }
    D->d = f16_lanes(rp, at);
    const __m512i scv = _mm512_loadu_si512((const void *)sc);
    for (int ib = 0; ib < 8; ib++) {
        const __m512i nib = field(scv, 4 * ib, 15);
        scale_per32(D, ib, _mm512_add_epi32(_mm512_add_epi32(nib, nib), _mm512_set1_epi32(1)));
    }
    __m512i signs[8]; /* sub-block ib's sign dword */
    dwords16(rp, at + 74, signs);
    dwords16(rp, at + 90, signs + 4);
    for (int j = 0; j < 4; j++) { /* grid entries 16j .. 16j + 15: sub-blocks 2j, 2j + 1 */
        __m512i v[4];
        dwords16(rp, at + 2 + 16 * j, v);
        const __m512i h = _mm512_loadu_si512((const void *)qh[j / 2]);
        for (int e = 0; e < 16; e++) {
            const int m = 16 * j + e, ib = m / 8, k = m % 8; /* entry m: byte e % 4 of v[e / 4] */
            const __m512i idx = _mm512_or_si512(field(v[e / 4], 8 * (e % 4), 255), _mm512_slli_epi32(field(h, m % 32, 1), 8));
            const __m512i g = _mm512_i32gather_epi32(idx, (const void *)IQ3S_GRID, 4);
            D->w[ib][k] = signed_codes(g, nibble_bits(signs[ib], k)); /* bits 4k .. 4k + 3 of its sign dword */
        }
    }
}

/* IQ2_XXS: sub-block ib is 4 grid indices (bytes) and a uint32 aux: 4 7-bit indices into
 * KSIGNS_IQ2XS (the signs of each grid entry's 8 values) and the scale 2 * (aux >> 28) + 1; d is
 * the fp16 d times 0.125f. */
static void iq2_xxs_decode16(const uint8_t *const rp[ROWS], int64_t b, sbdec_t *D) {
    const int64_t at = b * 66;
    D->d = _mm512_mul_ps(f16_lanes(rp, at), _mm512_set1_ps(0.125f));
    for (int j = 0; j < 4; j++) { /* sub-blocks 2j, 2j + 1: dwords grid, aux, grid, aux */
        __m512i v[4];
        dwords16(rp, at + 2 + 16 * j, v);
        for (int half = 0; half < 2; half++) {
            const int ib = 2 * j + half;
            const __m512i g = v[2 * half], a = v[2 * half + 1], top = _mm512_srli_epi32(a, 28);
            scale_per32(D, ib, _mm512_add_epi32(_mm512_add_epi32(top, top), _mm512_set1_epi32(1)));
            for (int l = 0; l < 4; l++) { /* grid entry l: values 8l .. 8l + 7, dwords 2l and 2l + 1 */
                __m512i e[2];
                gather8(field(g, 8 * l, 255), IQ2XXS_GRID, e);
                const __m512i signs = ksigns(field(a, 7 * l, 127));
                for (int h = 0; h < 2; h++) D->w[ib][2 * l + h] = signed_codes(e[h], nibble_bits(signs, h));
            }
        }
    }
}

/* IQ2_XS: entry l (elements 8l .. 8l + 7) from the uint16 at 2 + 2l: a 9-bit index into IQ2XS_GRID,
 * then a 7-bit index into KSIGNS_IQ2XS; 16 scales (bytes 66 ..); d the fp16 d times 0.125f. */
static void iq2_xs_decode16(const uint8_t *const rp[ROWS], int64_t b, sbdec_t *D) {
    const int64_t at = b * 74;
    D->d = _mm512_mul_ps(f16_lanes(rp, at), _mm512_set1_ps(0.125f));
    odd_scales16(rp, at + 66, D);
    for (int j = 0; j < 4; j++) { /* entries 8j .. 8j + 7: sub-blocks 2j, 2j + 1 */
        __m512i v[4];
        dwords16(rp, at + 2 + 16 * j, v);
        for (int e = 0; e < 8; e++) { /* entry 8j + e: half-word e % 2 of v[e / 2] */
            const int l = 8 * j + e, ib = l / 4, k = 2 * (l % 4);
            const __m512i word = field(v[e / 2], 16 * (e % 2), 0xFFFF);
            __m512i g[2];
            gather8(_mm512_and_si512(word, _mm512_set1_epi32(511)), IQ2XS_GRID, g);
            const __m512i signs = ksigns(_mm512_srli_epi32(word, 9));
            for (int h = 0; h < 2; h++) D->w[ib][k + h] = signed_codes(g[h], nibble_bits(signs, h));
        }
    }
}

/* IQ2_S: entry l (elements 8l .. 8l + 7) from index qs[l] | ((qh[l / 4] >> 2 (l % 4)) & 3) << 8
 * into IQ2S_GRID; its signs the byte signs[l]; 16 scales (bytes 74 ..); d the fp16 d times 0.125f. */
static void iq2_s_decode16(const uint8_t *const rp[ROWS], int64_t b, sbdec_t *D) {
    const int64_t at = b * 82;
    D->d = _mm512_mul_ps(f16_lanes(rp, at), _mm512_set1_ps(0.125f));
    odd_scales16(rp, at + 74, D);
    int32_t qh[2][ROWS];
    for (int i = 0; i < ROWS; i++) memcpy(&qh[0][i], rp[i] + at + 66, 4), memcpy(&qh[1][i], rp[i] + at + 70, 4);
    for (int j = 0; j < 2; j++) { /* entries 16j .. 16j + 15: sub-blocks 4j .. 4j + 3 */
        __m512i v[4], s[4];
        dwords16(rp, at + 2 + 16 * j, v);
        dwords16(rp, at + 34 + 16 * j, s);
        const __m512i h = _mm512_loadu_si512((const void *)qh[j]);
        for (int e = 0; e < 16; e++) { /* entry 16j + e: byte e % 4 of v[e / 4], s[e / 4] */
            const int l = 16 * j + e, ib = l / 4, k = 2 * (l % 4);
            const __m512i idx = _mm512_or_si512(field(v[e / 4], 8 * (e % 4), 255), _mm512_slli_epi32(field(h, 2 * e, 3), 8));
            __m512i g[2];
            gather8(idx, IQ2S_GRID, g);
            for (int c = 0; c < 2; c++) D->w[ib][k + c] = signed_codes(g[c], nibble_bits(s[e / 4], 2 * (e % 4) + c));
        }
    }
}

/* IQ1's codes: 128 + 8 * grid + delta, from the grid bytes (-1, 0, 1) and c = 128 + delta. */
static inline __m512i iq1_codes(__m512i grid, __m512i c) {
    grid = _mm512_add_epi8(grid, grid);
    grid = _mm512_add_epi8(grid, grid);
    return _mm512_add_epi8(_mm512_add_epi8(grid, grid), c);
}

/* IQ1_S: sub-block ib's 4 grid entries (8 values in {-1, 0, 1} each) from qs bytes 4ib + l and bits
 * 3l .. 3l + 2 of its uint16 qh; value 8 * grid + delta (delta -1 where bit 15 of qh is set, else
 * +1); scale 2 * ((qh >> 12) & 7) + 1; d the fp16 d times 0.125f. */
static void iq1_s_decode16(const uint8_t *const rp[ROWS], int64_t b, sbdec_t *D) {
    const int64_t at = b * 50;
    D->d = _mm512_mul_ps(f16_lanes(rp, at), _mm512_set1_ps(0.125f));
    __m512i qs[8], qh[4]; /* sub-block ib's 4 index bytes; qh[j]: the uint16 of 2j, then 2j + 1 */
    dwords16(rp, at + 2, qs);
    dwords16(rp, at + 18, qs + 4);
    dwords16(rp, at + 34, qh);
    for (int ib = 0; ib < 8; ib++) {
        const __m512i h = field(qh[ib / 2], 16 * (ib % 2), 0xFFFF), s3 = field(h, 12, 7);
        scale_per32(D, ib, _mm512_add_epi32(_mm512_add_epi32(s3, s3), _mm512_set1_epi32(1)));
        const __mmask16 minus = _mm512_test_epi32_mask(h, _mm512_set1_epi32(0x8000));
        const __m512i c = _mm512_mask_blend_epi32(minus, _mm512_set1_epi8((char)129), _mm512_set1_epi8(127));
        for (int l = 0; l < 4; l++) { /* grid entry l: values 8l .. 8l + 7, dwords 2l and 2l + 1 */
            __m512i g[2];
            gather8(_mm512_or_si512(field(qs[ib], 8 * l, 255), _mm512_slli_epi32(field(h, 3 * l, 7), 8)), IQ1S_GRID, g);
            for (int k = 0; k < 2; k++) D->w[ib][2 * l + k] = iq1_codes(g[k], c);
        }
    }
}

/* IQ1_M: group g (elements 8g .. 8g + 7) from index qs[g] | (its nibble & 7) << 8 into IQ1S_GRID,
 * its nibble (of byte 32 + g / 2, low first) bit 3 the delta's sign: value 8 * grid + delta (-1
 * where set, else +1); 4 uint16 at 48: scale 4k + i (of elements 16 (4k + i) ..) 2 * ((word k >> 3i)
 * & 7) + 1, their top nibbles d's fp16 bits (word k's bits 4k .. 4k + 3); d times 0.125f. */
static void iq1_m_decode16(const uint8_t *const rp[ROWS], int64_t b, sbdec_t *D) {
    const int64_t at = b * 56;
    uint16_t d16[ROWS];
    int32_t sw[2][ROWS]; /* words 2h, 2h + 1 */
    for (int i = 0; i < ROWS; i++) {
        memcpy(&sw[0][i], rp[i] + at + 48, 4), memcpy(&sw[1][i], rp[i] + at + 52, 4);
        d16[i] = 0;
        for (int k = 0; k < 4; k++) d16[i] |= (uint16_t)((rd16(rp[i] + at + 48 + 2 * k) >> 12) << (4 * k));
    }
    D->d = _mm512_mul_ps(f16x16(d16), _mm512_set1_ps(0.125f));
    for (int h = 0; h < 2; h++) {
        const __m512i s = _mm512_loadu_si512((const void *)sw[h]);
        for (int half = 0; half < 2; half++)
            for (int i = 0; i < 4; i++) {
                const __m512i s3 = field(s, 16 * half + 3 * i, 7);
                set_scale(D, 8 * h + 4 * half + i, _mm512_add_epi32(_mm512_add_epi32(s3, s3), _mm512_set1_epi32(1)));
            }
    }
    __m512i hv[4]; /* hv[q]: the nibbles of groups 8q .. 8q + 7 */
    dwords16(rp, at + 32, hv);
    for (int j = 0; j < 2; j++) { /* groups 16j .. 16j + 15: sub-blocks 4j .. 4j + 3 */
        __m512i v[4];
        dwords16(rp, at + 16 * j, v);
        for (int e = 0; e < 16; e++) { /* group 16j + e: byte e % 4 of v[e / 4] */
            const int g = 16 * j + e, ib = g / 4, k = 2 * (g % 4);
            const __m512i nib = field(hv[g / 8], 4 * (g % 8), 15);
            const __m512i idx = _mm512_or_si512(field(v[e / 4], 8 * (e % 4), 255), _mm512_slli_epi32(field(nib, 0, 7), 8));
            __m512i grid[2];
            gather8(idx, IQ1S_GRID, grid);
            const __mmask16 minus = _mm512_test_epi32_mask(nib, _mm512_set1_epi32(8));
            const __m512i c = _mm512_mask_blend_epi32(minus, _mm512_set1_epi8((char)129), _mm512_set1_epi8(127));
            for (int h = 0; h < 2; h++) D->w[ib][k + h] = iq1_codes(grid[h], c);
        }
    }
}

LANES_DECODE(lanes_iq3_xxs, iq3_xxs_decode16)
LANES_DECODE(lanes_iq3_s, iq3_s_decode16)
LANES_DECODE(lanes_iq2_xxs, iq2_xxs_decode16)
LANES_DECODE(lanes_iq2_xs, iq2_xs_decode16)
LANES_DECODE(lanes_iq2_s, iq2_s_decode16)
LANES_DECODE(lanes_iq1_s, iq1_s_decode16)
LANES_DECODE(lanes_iq1_m, iq1_m_decode16)
#endif
