/* AVX-512 prefill GEMM for iq4_xs, iq3_s, iq2_xxs, iq1_s, tq2_0 and tq1_0 (x q8_K), 16 rows in
 * the lanes of a zmm (gemm_lanes.h): per super-block S = the exact int32 sum over the 32-element
 * sub-blocks of scale * dot, then acc += (yd * d) * float(S), as avx512_iq4.c's and avx512_iq.c's
 * row kernels (iq1_s's and the ternaries' split S differently, into the same integer). They share
 * the activations' layout and the tile; each has its own decode. */
#include "gemm_lanes.h"

#ifdef MOERUN_AVX512
/* IQ4_XS: the matvec sums S = sum over the 8 sub-blocks of ls * dot (exact int32), then
 * acc += (yd * d) * float(S) per super-block. Here each sub-block's dot comes as the b32 ones do
 * (values + 128, the activations' sum times 128 taken off), times the 16 rows' ls (vpmulld). */
typedef struct {
    int32_t qs[GT][64];  /* each token's 256 activations, 4 to a dword */
    int32_t off[GT][8];  /* 128 * each sub-block's sum of qs */
    float d[GT];
    int32_t pad[12];
} axk_t; /* [token groups][super-blocks], 1216 bytes */

typedef struct {
    __m512i w[8][8]; /* sub-block ib's codes 4k .. 4k + 3 of rows 0 .. 15 (IQ4 values + 128) */
    __m512i ls[8];   /* sub-block ib's scale of each row (int32, ls - 32) */
    __m512 d;
} xsdec_t; /* one super-block of 16 rows */

static size_t xs_size(int fmt, int64_t T, int64_t n) {
    (void)fmt;
    return (size_t)(padded(T) / GT * (n / 256)) * sizeof(axk_t);
}

static void xs_prep(int fmt, const void *xq, int64_t g, int64_t T, int64_t n, void *xl) {
    (void)fmt;
    const int64_t nsb = n / 256;
    axk_t *o = (axk_t *)xl + g * nsb;
    for (int64_t b = 0; b < nsb; b++) {
        memset(o + b, 0, sizeof *o);
        for (int i = 0; i < GT && GT * g + i < T; i++) {
            const q8k_t *y = (const q8k_t *)xq + (GT * g + i) * nsb + b;
            memcpy(o[b].qs[i], y->qs, 256);
            for (int ib = 0; ib < 8; ib++) o[b].off[i][ib] = 128 * (y->bsums[2 * ib] + y->bsums[2 * ib + 1]);
            o[b].d[i] = y->d;
        }
    }
}

static void xs_decode16(const uint8_t *const rp[ROWS], int64_t b, xsdec_t *D) {
    const int64_t at = b * 136;
    for (int ib = 0; ib < 8; ib++) nibbles16(rp, at + 8 + 16 * ib, 1, D->w[ib]);
    uint16_t d16[ROWS];
    int32_t lo[ROWS], hi[ROWS];
    for (int i = 0; i < ROWS; i++) {
        d16[i] = rd16(rp[i] + at);
        hi[i] = rd16(rp[i] + at + 2);
        memcpy(lo + i, rp[i] + at + 4, 4);
    }
    D->d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)d16));
    const __m512i l = _mm512_loadu_si512((const void *)lo), h = _mm512_loadu_si512((const void *)hi);
    for (int ib = 0; ib < 8; ib++) { /* ls's low nibble: bits 4ib of scales_l; its top 2: bits 2ib of scales_h */
        const __m512i low = _mm512_and_si512(_mm512_srl_epi32(l, _mm_cvtsi32_si128(4 * ib)), _mm512_set1_epi32(15));
        const __m512i top = _mm512_and_si512(_mm512_srl_epi32(h, _mm_cvtsi32_si128(2 * ib)), _mm512_set1_epi32(3));
        D->ls[ib] = _mm512_sub_epi32(_mm512_or_si512(low, _mm512_slli_epi32(top, 4)), _mm512_set1_epi32(32));
    }
}

/* IQ3_S: grid entry m (elements 4m .. 4m + 3) from index qs[m] | bit m of qh << 8; the sign of
 * element j bit j of the signs; the scale of sub-block ib 2 * (its nibble) + 1; as iq_unpack.h. */
static void iq3_s_decode16(const uint8_t *const rp[ROWS], int64_t b, xsdec_t *D) {
    const int64_t at = b * 110;
    uint16_t d16[ROWS];
    int32_t qh[2][ROWS], signs[8][ROWS], sc[ROWS];
    for (int i = 0; i < ROWS; i++) {
        d16[i] = rd16(rp[i] + at);
        for (int h = 0; h < 2; h++) memcpy(&qh[h][i], rp[i] + at + 66 + 4 * h, 4);
        for (int s = 0; s < 8; s++) memcpy(&signs[s][i], rp[i] + at + 74 + 4 * s, 4);
        memcpy(sc + i, rp[i] + at + 106, 4);
    }
    D->d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)d16));
    const __m512i scv = _mm512_loadu_si512((const void *)sc);
    for (int ib = 0; ib < 8; ib++) {
        const __m512i nib = _mm512_and_si512(_mm512_srl_epi32(scv, _mm_cvtsi32_si128(4 * ib)), _mm512_set1_epi32(15));
        D->ls[ib] = _mm512_add_epi32(_mm512_add_epi32(nib, nib), _mm512_set1_epi32(1));
    }
    const __m512i c128 = _mm512_set1_epi8((char)0x80);
    for (int j = 0; j < 4; j++) { /* grid entries 16j .. 16j + 15: sub-blocks 2j, 2j + 1 */
        __m512i z[4], v[4];
        for (int a = 0; a < 4; a++) {
            z[a] = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(rp[a] + at + 2 + 16 * j)));
            for (int l = 1; l < 4; l++)
                z[a] = _mm512_inserti32x4(z[a], _mm_loadu_si128((const __m128i *)(rp[4 * l + a] + at + 2 + 16 * j)), l);
        }
        const __m512i t0 = _mm512_unpacklo_epi32(z[0], z[1]), t1 = _mm512_unpackhi_epi32(z[0], z[1]);
        const __m512i t2 = _mm512_unpacklo_epi32(z[2], z[3]), t3 = _mm512_unpackhi_epi32(z[2], z[3]);
        v[0] = _mm512_unpacklo_epi64(t0, t2), v[1] = _mm512_unpackhi_epi64(t0, t2);
        v[2] = _mm512_unpacklo_epi64(t1, t3), v[3] = _mm512_unpackhi_epi64(t1, t3);
        const __m512i h = _mm512_loadu_si512((const void *)qh[j / 2]);
        for (int e = 0; e < 16; e++) {
            const int m = 16 * j + e, ib = m / 8, k = m % 8; /* entry m: dword e % 4 .. of v[e / 4] */
            __m512i idx = _mm512_and_si512(_mm512_srl_epi32(v[e / 4], _mm_cvtsi32_si128(8 * (e % 4))),
                                           _mm512_set1_epi32(255));
            const __m512i top = _mm512_and_si512(_mm512_srl_epi32(h, _mm_cvtsi32_si128(m % 32)), _mm512_set1_epi32(1));
            idx = _mm512_or_si512(idx, _mm512_slli_epi32(top, 8));
            const __m512i g = _mm512_i32gather_epi32(idx, (const void *)IQ3S_GRID, 4);
            /* elements 4k .. 4k + 3 of sub-block ib: bits 4k .. 4k + 3 of its sign dword */
            const __mmask64 neg = nibble_bits(_mm512_loadu_si512((const void *)signs[ib]), k);
            D->w[ib][k] = _mm512_mask_sub_epi8(_mm512_add_epi8(g, c128), neg, c128, g); /* 128 + value */
        }
    }
}

/* IQ2_XXS: sub-block ib is 4 grid indices (bytes) and a uint32 aux: 4 7-bit indices into
 * KSIGNS_IQ2XS (the signs of each grid entry's 8 values) and the scale 2 * (aux >> 28) + 1; d is
 * the fp16 d times 0.125f; as iq_unpack.h. */
static void iq2_xxs_decode16(const uint8_t *const rp[ROWS], int64_t b, xsdec_t *D) {
    const int64_t at = b * 66;
    uint16_t d16[ROWS];
    int32_t grid[8][ROWS], aux[8][ROWS];
    for (int i = 0; i < ROWS; i++) {
        d16[i] = rd16(rp[i] + at);
        for (int ib = 0; ib < 8; ib++) {
            memcpy(&grid[ib][i], rp[i] + at + 2 + 8 * ib, 4);
            memcpy(&aux[ib][i], rp[i] + at + 6 + 8 * ib, 4);
        }
    }
    D->d = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)d16)), _mm512_set1_ps(0.125f));
    const __m512i c128 = _mm512_set1_epi8((char)0x80);
    for (int ib = 0; ib < 8; ib++) {
        const __m512i g = _mm512_loadu_si512((const void *)grid[ib]), a = _mm512_loadu_si512((const void *)aux[ib]);
        const __m512i top = _mm512_srli_epi32(a, 28);
        D->ls[ib] = _mm512_add_epi32(_mm512_add_epi32(top, top), _mm512_set1_epi32(1));
        for (int l = 0; l < 4; l++) { /* grid entry l: values 8l .. 8l + 7, dwords 2l and 2l + 1 */
            const __m512i gi = _mm512_and_si512(_mm512_srl_epi32(g, _mm_cvtsi32_si128(8 * l)), _mm512_set1_epi32(255));
            /* KSIGNS_IQ2XS[i] is i with bit 7 making the popcount even (ggml's table) */
            const __m512i si = _mm512_and_si512(_mm512_srl_epi32(a, _mm_cvtsi32_si128(7 * l)), _mm512_set1_epi32(127));
            __m512i par = _mm512_xor_si512(si, _mm512_srli_epi32(si, 4));
            par = _mm512_xor_si512(par, _mm512_srli_epi32(par, 2));
            par = _mm512_and_si512(_mm512_xor_si512(par, _mm512_srli_epi32(par, 1)), _mm512_set1_epi32(1));
            const __m512i signs = _mm512_or_si512(si, _mm512_slli_epi32(par, 7));
            /* the 8-byte entries of rows 0-7 and 8-15, their low and high dwords sorted into rows */
            const __m512i e0 = _mm512_i32gather_epi64(_mm512_castsi512_si256(gi), (const void *)IQ2XXS_GRID, 8);
            const __m512i e1 = _mm512_i32gather_epi64(_mm512_extracti64x4_epi64(gi, 1), (const void *)IQ2XXS_GRID, 8);
            for (int h = 0; h < 2; h++) { /* dwords 2i + h of e0, then of e1 */
                const __m512i pick = _mm512_add_epi32(
                    _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0), _mm512_set1_epi32(h));
                const __m512i v = _mm512_permutex2var_epi32(e0, pick, e1);
                const __mmask64 neg = nibble_bits(signs, h);
                D->w[ib][2 * l + h] = _mm512_mask_sub_epi8(_mm512_add_epi8(v, c128), neg, c128, v); /* 128 + value */
            }
        }
    }
}

/* IQ1_S: sub-block ib's 4 grid entries (8 values in {-1, 0, 1} each) from qs bytes 4ib + l and bits
 * 3l .. 3l + 2 of its uint16 qh; value 8 * grid + delta (delta -1 where bit 15 of qh is set, else
 * +1); scale 2 * ((qh >> 12) & 7) + 1; d the fp16 d times 0.125f; as iq_unpack.h. */
static void iq1_s_decode16(const uint8_t *const rp[ROWS], int64_t b, xsdec_t *D) {
    const int64_t at = b * 50;
    uint16_t d16[ROWS];
    int32_t qs[8][ROWS], qh[8][ROWS];
    for (int i = 0; i < ROWS; i++) {
        d16[i] = rd16(rp[i] + at);
        for (int ib = 0; ib < 8; ib++) {
            memcpy(&qs[ib][i], rp[i] + at + 2 + 4 * ib, 4);
            qh[ib][i] = rd16(rp[i] + at + 34 + 2 * ib);
        }
    }
    D->d = _mm512_mul_ps(_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)d16)), _mm512_set1_ps(0.125f));
    for (int ib = 0; ib < 8; ib++) {
        const __m512i q = _mm512_loadu_si512((const void *)qs[ib]), h = _mm512_loadu_si512((const void *)qh[ib]);
        const __m512i s3 = _mm512_and_si512(_mm512_srli_epi32(h, 12), _mm512_set1_epi32(7));
        D->ls[ib] = _mm512_add_epi32(_mm512_add_epi32(s3, s3), _mm512_set1_epi32(1));
        const __mmask16 minus = _mm512_test_epi32_mask(h, _mm512_set1_epi32(0x8000));
        const __m512i c = _mm512_mask_blend_epi32(minus, _mm512_set1_epi8((char)129), _mm512_set1_epi8(127)); /* 128 + delta */
        for (int l = 0; l < 4; l++) { /* grid entry l: values 8l .. 8l + 7, dwords 2l and 2l + 1 */
            const __m512i lo = _mm512_and_si512(_mm512_srl_epi32(q, _mm_cvtsi32_si128(8 * l)), _mm512_set1_epi32(255));
            const __m512i hi = _mm512_and_si512(_mm512_srl_epi32(h, _mm_cvtsi32_si128(3 * l)), _mm512_set1_epi32(7));
            const __m512i gi = _mm512_or_si512(lo, _mm512_slli_epi32(hi, 8));
            const __m512i e0 = _mm512_i32gather_epi64(_mm512_castsi512_si256(gi), (const void *)IQ1S_GRID, 8);
            const __m512i e1 = _mm512_i32gather_epi64(_mm512_extracti64x4_epi64(gi, 1), (const void *)IQ1S_GRID, 8);
            for (int k = 0; k < 2; k++) { /* dwords 2i + k of e0, then of e1 */
                const __m512i pick = _mm512_add_epi32(
                    _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0), _mm512_set1_epi32(k));
                __m512i v = _mm512_permutex2var_epi32(e0, pick, e1);
                v = _mm512_add_epi8(v, v);
                v = _mm512_add_epi8(v, v);
                v = _mm512_add_epi8(v, v); /* 8 * grid, bytewise */
                D->w[ib][2 * l + k] = _mm512_add_epi8(v, c);
            }
        }
    }
}

/* TQ2_0: element 128h + 32k + j is code (byte 32h + j >> 2k) & 3, value code - 1; no scales; d the
 * fp16 at byte 64; as iq_unpack.h. Here the codes + 127 (value + 128) and scale 1. */
static void tq2_0_decode16(const uint8_t *const rp[ROWS], int64_t b, xsdec_t *D) {
    const int64_t at = b * 66;
    uint16_t d16[ROWS];
    for (int i = 0; i < ROWS; i++) d16[i] = rd16(rp[i] + at + 64);
    D->d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)d16));
    for (int ib = 0; ib < 8; ib++) D->ls[ib] = _mm512_set1_epi32(1);
    for (int part = 0; part < 4; part++) { /* bytes 16 part .. 16 part + 15: half h = part / 2, dwords 4 (part % 2) .. */
        __m512i v[4];
        dwords16(rp, at + 16 * part, v);
        const int h = part / 2, m0 = 4 * (part % 2);
        for (int k = 0; k < 4; k++)
            for (int m = 0; m < 4; m++)
                D->w[4 * h + k][m0 + m] = _mm512_add_epi8(
                    _mm512_and_si512(_mm512_srl_epi32(v[m], _mm_cvtsi32_si128(2 * k)), _mm512_set1_epi8(3)),
                    _mm512_set1_epi8(127));
    }
}

/* TQ1_0: digit k of byte v is ((v * 3^k mod 256) * 3) >> 8 (a base-3 digit as a fixed-point
 * fraction); here of each byte of v, as 127 + digit (value + 128, value = digit - 1). */
static inline __m512i tq1_code(__m512i v, int k) {
    static const short pow3[5] = {1, 3, 9, 27, 81};
    const __m512i p = _mm512_set1_epi16(pow3[k]), ff = _mm512_set1_epi16(0xFF), three = _mm512_set1_epi16(3);
    __m512i lo = _mm512_and_si512(_mm512_mullo_epi16(_mm512_and_si512(v, ff), p), ff);
    __m512i hi = _mm512_and_si512(_mm512_mullo_epi16(_mm512_srli_epi16(v, 8), p), ff);
    lo = _mm512_srli_epi16(_mm512_mullo_epi16(lo, three), 8);
    hi = _mm512_srli_epi16(_mm512_mullo_epi16(hi, three), 8);
    return _mm512_add_epi8(_mm512_or_si512(lo, _mm512_slli_epi16(hi, 8)), _mm512_set1_epi8(127));
}

/* TQ1_0: bytes 0-31 give elements 32k + j (digit k, sub-block k < 5), 32-47 give 160 + 16k + j,
 * 48-51 give 240 + 4k + j; d the fp16 at byte 52; no scales; as iq_unpack.h. */
static void tq1_0_decode16(const uint8_t *const rp[ROWS], int64_t b, xsdec_t *D) {
    const int64_t at = b * 54;
    uint16_t d16[ROWS];
    int32_t c[ROWS];
    for (int i = 0; i < ROWS; i++) {
        d16[i] = rd16(rp[i] + at + 52);
        memcpy(c + i, rp[i] + at + 48, 4);
    }
    D->d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)d16));
    for (int ib = 0; ib < 8; ib++) D->ls[ib] = _mm512_set1_epi32(1);
    __m512i a[8], bb[4];
    dwords16(rp, at, a);
    dwords16(rp, at + 16, a + 4);
    dwords16(rp, at + 32, bb);
    for (int k = 0; k < 5; k++)
        for (int m = 0; m < 8; m++) D->w[k][m] = tq1_code(a[m], k);
    for (int k = 0; k < 5; k++) /* elements 160 + 16k + 4m .. : sub-block 5 + k / 2, dword 4 (k % 2) + m */
        for (int m = 0; m < 4; m++) D->w[5 + k / 2][4 * (k % 2) + m] = tq1_code(bb[m], k);
    const __m512i cv = _mm512_loadu_si512((const void *)c);
    for (int k = 0; k < 4; k++) D->w[7][4 + k] = tq1_code(cv, k); /* elements 240 + 4k .. 240 + 4k + 3 */
}

static void xs_tile16(const xsdec_t *D, int64_t nsb, const axk_t *x, int64_t tn, int nr, float *y, int64_t ys) {
    __m512 acc[GT];
    for (int t = 0; t < GT; t++) acc[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nsb; b++) {
        const xsdec_t *wd = D + b;
        const axk_t *a = x + b;
        __m512i S[GT];
        for (int t = 0; t < GT; t++) S[t] = _mm512_setzero_si512();
        for (int ib = 0; ib < 8; ib++) {
            __m512i s0[GT], s1[GT];
            for (int t = 0; t < GT; t++) {
                s0[t] = _mm512_set1_epi32(-a->off[t][ib]);
                s1[t] = _mm512_setzero_si512();
            }
            for (int k = 0; k < 8; k += 2)
                for (int t = 0; t < GT; t++) {
                    s0[t] = _mm512_dpbusd_epi32(s0[t], wd->w[ib][k], _mm512_set1_epi32(a->qs[t][8 * ib + k]));
                    s1[t] = _mm512_dpbusd_epi32(s1[t], wd->w[ib][k + 1], _mm512_set1_epi32(a->qs[t][8 * ib + k + 1]));
                }
            for (int t = 0; t < GT; t++) {
                S[t] = _mm512_add_epi32(S[t], _mm512_mullo_epi32(wd->ls[ib], _mm512_add_epi32(s0[t], s1[t])));
            }
        }
        for (int t = 0; t < GT; t++)
            acc[t] = _mm512_add_ps(acc[t], _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(a->d[t]), wd->d),
                                                         _mm512_cvtepi32_ps(S[t])));
    }
    const __mmask16 rows = (__mmask16)((1u << nr) - 1);
    for (int t = 0; t < GT && t < tn; t++) _mm512_mask_storeu_ps(y + t * ys, rows, acc[t]);
}

static inline __attribute__((always_inline)) void k256_body(int fmt, const uint8_t *w, size_t rb, int64_t r0,
                                                            int64_t r1, int64_t n, const void *xl, int64_t T,
                                                            float *y, int64_t ys) {
    const int64_t nsb = n / 256, groups = padded(T) / GT;
    xsdec_t *D = aligned_alloc(64, (size_t)nsb * sizeof(xsdec_t));
    if (!D) return;
    int64_t chunk = 512 * 1024 / (int64_t)((size_t)nsb * sizeof(axk_t));
    chunk = chunk < 1 ? 1 : chunk;
    for (int64_t g0 = 0; g0 < groups; g0 += chunk) {
        const int64_t g1 = g0 + chunk < groups ? g0 + chunk : groups;
        for (int64_t r = r0; r < r1; r += ROWS) {
            const int nr = (int)(r1 - r < ROWS ? r1 - r : ROWS);
            const uint8_t *rp[ROWS];
            for (int i = 0; i < ROWS; i++) rp[i] = w + (r + (i < nr ? i : 0)) * rb; /* lanes >= nr: unwritten */
            for (int64_t b = 0; b < nsb; b++) {
                if (fmt == F_IQ3_S) iq3_s_decode16(rp, b, D + b);
                else if (fmt == F_IQ2_XXS) iq2_xxs_decode16(rp, b, D + b);
                else if (fmt == F_IQ1_S) iq1_s_decode16(rp, b, D + b);
                else if (fmt == F_TQ2_0) tq2_0_decode16(rp, b, D + b);
                else if (fmt == F_TQ1_0) tq1_0_decode16(rp, b, D + b);
                else xs_decode16(rp, b, D + b);
            }
            for (int64_t g = g0; g < g1; g++)
                xs_tile16(D, nsb, (const axk_t *)xl + g * nsb, T - GT * g, nr, y + GT * g * ys + r, ys);
        }
    }
    free(D);
}

static void k256_run(int fmt, const uint8_t *w, size_t rb, int64_t r0, int64_t r1, int64_t n, const void *xl,
                     int64_t T, float *y, int64_t ys) {
    if (fmt == F_IQ3_S) k256_body(F_IQ3_S, w, rb, r0, r1, n, xl, T, y, ys);
    else if (fmt == F_IQ2_XXS) k256_body(F_IQ2_XXS, w, rb, r0, r1, n, xl, T, y, ys);
    else if (fmt == F_IQ1_S) k256_body(F_IQ1_S, w, rb, r0, r1, n, xl, T, y, ys);
    else if (fmt == F_TQ2_0) k256_body(F_TQ2_0, w, rb, r0, r1, n, xl, T, y, ys);
    else if (fmt == F_TQ1_0) k256_body(F_TQ1_0, w, rb, r0, r1, n, xl, T, y, ys);
    else k256_body(F_IQ4_XS, w, rb, r0, r1, n, xl, T, y, ys);
}

void init_gemm_lanes_k_avx512(void) {
    GEMM[F_IQ4_XS] = (gemm_ops){2, xs_size, xs_prep, k256_run};
    GEMM[F_IQ3_S] = (gemm_ops){4, xs_size, xs_prep, k256_run};
    GEMM[F_IQ2_XXS] = (gemm_ops){4, xs_size, xs_prep, k256_run};
    GEMM[F_IQ1_S] = (gemm_ops){3, xs_size, xs_prep, k256_run};
    GEMM[F_TQ2_0] = (gemm_ops){3, xs_size, xs_prep, k256_run};
    GEMM[F_TQ1_0] = (gemm_ops){3, xs_size, xs_prep, k256_run};
}
#else
void init_gemm_lanes_k_avx512(void) {}
#endif
