/* AVX-512 prefill GEMM for q4_1, q5_0, q5_1, iq4_nl (32-element blocks x q8_0 activations), iq4_xs,
 * iq3_s and iq2_xxs (x q8_K): each zmm lane holds one of 16 rows.
 *
 * The integer matvec of these formats (avx512_iq4.c, avx512_iq.c, as generic.c) applies the scales
 * on a scalar fp32 chain per output: the 32-element blocks one at a time, acc += (d * yd) *
 * float(dot - offset * ysum) (q5_0: offset 16, iq4_nl: 128), q4_1 and q5_1 acc += (d * yd) *
 * float(dot) + (m * yd) * float(ysum); the 256-element ones once per super-block, acc += (yd * d) *
 * float(S), S = the exact int32 sum over its 32-element sub-blocks of scale * dot. Exact integer
 * sums do not depend on how they are summed, so the GEMM puts 16 rows in the 16 lanes of a zmm: a
 * block of 16 rows is decoded once per token chunk into 8 zmm per 32 elements, zmm k holding the
 * unsigned codes 4k .. 4k + 3 of each row (value + 128 where values are signed), and each token's
 * 4 activations of that position are broadcast against it (vpdpbusd), giving 16 rows' dots with no
 * horizontal sums; the activations' sum times the offset comes off, the sub-block scales multiply
 * in int32 (vpmulld). The fp32 steps then run per lane in the matvec's order, so every output is
 * the matvec's bits. */
#include <stdlib.h>

#include "avx512.h"
#include "gemm.h"

#ifdef MOERUN_AVX512
#include "iq_tables.h"

#define GT GEMM_TOKENS
#define ROWS 16 /* rows per decoded tile: one per zmm lane */

/* IQ4's values + 128 (unsigned bytes), from KVALUES_IQ4NL at init. */
static uint8_t IQ4NL_UNSIGNED[16];

typedef struct {
    int32_t qs[GT][8]; /* each token's 32 activations, 4 to a dword */
    float d[GT];
    int32_t off[GT]; /* offset * sum of qs (q5_0, iq4_nl) */
    float sum[GT];   /* float(sum of qs) (q4_1, q5_1: the min's term) */
    int32_t pad[4];
} ax_t; /* [token groups][blocks], 192 bytes */

typedef struct {
    __m512i w[8]; /* codes 4k .. 4k + 3 of rows 0 .. 15 (unsigned; iq4_nl: values + 128) */
    __m512 d, m;  /* the rows' scales, mins */
} wdec_t;         /* one block of 16 rows */

static int block_bytes(int fmt) { return fmt == F_Q4_1 ? 20 : fmt == F_Q5_0 ? 22 : fmt == F_Q5_1 ? 24 : 18; }
static int qs_at(int fmt) { return fmt == F_Q4_1 ? 4 : fmt == F_Q5_0 ? 6 : fmt == F_Q5_1 ? 8 : 2; }
static int offset_of(int fmt) { return fmt == F_Q5_0 ? 16 : fmt == F_IQ4_NL ? 128 : 0; }
static int has_min(int fmt) { return fmt == F_Q4_1 || fmt == F_Q5_1; }
static int64_t padded(int64_t T) { return (T + GT - 1) / GT * GT; }

static size_t b32s_size(int fmt, int64_t T, int64_t n) {
    (void)fmt;
    return (size_t)(padded(T) / GT * (n / 32)) * sizeof(ax_t);
}

static void b32s_prep(int fmt, const void *xq, int64_t g, int64_t T, int64_t n, void *xl) {
    const int64_t nb = n / 32;
    const int offset = offset_of(fmt);
    ax_t *o = (ax_t *)xl + g * nb;
    for (int64_t b = 0; b < nb; b++) {
        memset(o + b, 0, sizeof *o);
        for (int i = 0; i < GT && GT * g + i < T; i++) {
            const q8a_t *y = (const q8a_t *)xq + (GT * g + i) * nb + b;
            memcpy(o[b].qs[i], y->qs, 32);
            o[b].d[i] = y->d;
            o[b].off[i] = offset * y->sum;
            o[b].sum[i] = (float)y->sum;
        }
    }
}

/* 16 rows' 16 bytes of nibbles (at byte `at` of each row's bytes rp[i]) -> w[8]: w[k] holds codes
 * 4k .. 4k + 3 of rows 0 .. 15 (low nibbles are elements 0-15, high 16-31), through table if given. */
static inline __attribute__((always_inline)) void nibbles16(const uint8_t *const rp[ROWS], int64_t at,
                                                            const uint8_t *table, __m512i w[8]) {
    /* z[a] holds rows a, 4 + a, 8 + a, 12 + a; after the 4 x 4 dword transpose in each 128-bit
     * lane, v[k] holds dword k of rows 0 .. 15 in order */
    __m512i z[4], v[4];
    for (int a = 0; a < 4; a++) {
        z[a] = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(rp[a] + at)));
        for (int l = 1; l < 4; l++) z[a] = _mm512_inserti32x4(z[a], _mm_loadu_si128((const __m128i *)(rp[4 * l + a] + at)), l);
    }
    const __m512i t0 = _mm512_unpacklo_epi32(z[0], z[1]), t1 = _mm512_unpackhi_epi32(z[0], z[1]);
    const __m512i t2 = _mm512_unpacklo_epi32(z[2], z[3]), t3 = _mm512_unpackhi_epi32(z[2], z[3]);
    v[0] = _mm512_unpacklo_epi64(t0, t2), v[1] = _mm512_unpackhi_epi64(t0, t2);
    v[2] = _mm512_unpacklo_epi64(t1, t3), v[3] = _mm512_unpackhi_epi64(t1, t3);
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    for (int k = 0; k < 4; k++) {
        w[k] = _mm512_and_si512(v[k], m4);
        w[k + 4] = _mm512_and_si512(_mm512_srli_epi16(v[k], 4), m4);
    }
    if (table) {
        const __m512i t = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)table));
        for (int k = 0; k < 8; k++) w[k] = _mm512_shuffle_epi8(t, w[k]);
    }
}

/* Block b of 16 rows (rp: each row's bytes) -> D. */
static inline __attribute__((always_inline)) void decode16(int fmt, const uint8_t *const rp[ROWS], int64_t b,
                                                           wdec_t *D) {
    const int64_t at = b * block_bytes(fmt);
    nibbles16(rp, at + qs_at(fmt), fmt == F_IQ4_NL ? IQ4NL_UNSIGNED : NULL, D->w);
    uint16_t d16[ROWS], m16[ROWS];
    for (int i = 0; i < ROWS; i++) {
        d16[i] = rd16(rp[i] + at);
        m16[i] = has_min(fmt) ? rd16(rp[i] + at + 2) : 0;
    }
    D->d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)d16));
    D->m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)m16));
    if (fmt == F_Q5_0 || fmt == F_Q5_1) { /* bit j of the uint32 qh: 0x10 on element j */
        int32_t qh[ROWS];
        for (int i = 0; i < ROWS; i++) memcpy(qh + i, rp[i] + at + (fmt == F_Q5_0 ? 2 : 4), 4);
        const __m512i h = _mm512_loadu_si512((const void *)qh);
        /* element 4k + e: byte k / 2 of qh, bit 4 * (k % 2) + e */
        const __m512i base = _mm512_broadcast_i32x4(_mm_setr_epi32(0, 0x04040404, 0x08080808, 0x0C0C0C0C));
        const __m512i lo = _mm512_set1_epi32(0x08040201), hi = _mm512_set1_epi32((int)0x80402010);
        for (int k = 0; k < 8; k++) {
            const __m512i ctl = _mm512_add_epi8(base, _mm512_set1_epi8((char)(k / 2)));
            const __mmask64 set = _mm512_test_epi8_mask(_mm512_shuffle_epi8(h, ctl), k % 2 ? hi : lo);
            D->w[k] = _mm512_or_si512(D->w[k], _mm512_maskz_set1_epi8(set, 0x10));
        }
    }
}

/* 16 decoded rows (D: [blocks]) times tokens 4g .. 4g + 3; rows i < nr, tokens < tn written. */
static inline __attribute__((always_inline)) void tile16(int fmt, const wdec_t *D, int64_t nb, const ax_t *x,
                                                         int64_t tn, int nr, float *y, int64_t ys) {
    __m512 acc[GT];
    for (int t = 0; t < GT; t++) acc[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const wdec_t *wd = D + b;
        const ax_t *a = x + b;
        __m512i s0[GT], s1[GT]; /* two chains per token: the exact int32 sums in any order */
        for (int t = 0; t < GT; t++) { /* the offset's term first */
            s0[t] = offset_of(fmt) ? _mm512_set1_epi32(-a->off[t]) : _mm512_setzero_si512();
            s1[t] = _mm512_setzero_si512();
        }
        for (int k = 0; k < 8; k += 2)
            for (int t = 0; t < GT; t++) {
                s0[t] = _mm512_dpbusd_epi32(s0[t], wd->w[k], _mm512_set1_epi32(a->qs[t][k]));
                s1[t] = _mm512_dpbusd_epi32(s1[t], wd->w[k + 1], _mm512_set1_epi32(a->qs[t][k + 1]));
            }
        for (int t = 0; t < GT; t++) {
            const __m512i dot = _mm512_add_epi32(s0[t], s1[t]);
            const __m512 yd = _mm512_set1_ps(a->d[t]);
            __m512 p = _mm512_mul_ps(_mm512_mul_ps(wd->d, yd), _mm512_cvtepi32_ps(dot));
            if (has_min(fmt)) p = _mm512_add_ps(p, _mm512_mul_ps(_mm512_mul_ps(wd->m, yd), _mm512_set1_ps(a->sum[t])));
            acc[t] = _mm512_add_ps(acc[t], p);
        }
    }
    const __mmask16 rows = (__mmask16)((1u << nr) - 1);
    for (int t = 0; t < GT && t < tn; t++) _mm512_mask_storeu_ps(y + t * ys, rows, acc[t]);
}

static inline __attribute__((always_inline)) void b32s_body(int fmt, const uint8_t *w, size_t rb, int64_t r0,
                                                            int64_t r1, int64_t n, const void *xl, int64_t T,
                                                            float *y, int64_t ys) {
    const int64_t nb = n / 32, groups = padded(T) / GT;
    wdec_t *D = aligned_alloc(64, (size_t)nb * sizeof(wdec_t));
    if (!D) return;
    int64_t chunk = 512 * 1024 / (int64_t)((size_t)nb * sizeof(ax_t));
    chunk = chunk < 1 ? 1 : chunk;
    for (int64_t g0 = 0; g0 < groups; g0 += chunk) {
        const int64_t g1 = g0 + chunk < groups ? g0 + chunk : groups;
        for (int64_t r = r0; r < r1; r += ROWS) {
            const int nr = (int)(r1 - r < ROWS ? r1 - r : ROWS);
            const uint8_t *rp[ROWS];
            for (int i = 0; i < ROWS; i++) rp[i] = w + (r + (i < nr ? i : 0)) * rb; /* lanes >= nr: unwritten */
            for (int64_t b = 0; b < nb; b++) decode16(fmt, rp, b, D + b);
            for (int64_t g = g0; g < g1; g++)
                tile16(fmt, D, nb, (const ax_t *)xl + g * nb, T - GT * g, nr, y + GT * g * ys + r, ys);
        }
    }
    free(D);
}

static void b32s_run(int fmt, const uint8_t *w, size_t rb, int64_t r0, int64_t r1, int64_t n, const void *xl,
                     int64_t T, float *y, int64_t ys) {
    switch (fmt) {
    case F_Q4_1: b32s_body(F_Q4_1, w, rb, r0, r1, n, xl, T, y, ys); break;
    case F_Q5_0: b32s_body(F_Q5_0, w, rb, r0, r1, n, xl, T, y, ys); break;
    case F_Q5_1: b32s_body(F_Q5_1, w, rb, r0, r1, n, xl, T, y, ys); break;
    default: b32s_body(F_IQ4_NL, w, rb, r0, r1, n, xl, T, y, ys); break;
    }
}

/* IQ4_XS (x q8_K): the matvec sums S = sum over the 8 sub-blocks of ls * dot (exact int32), then
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
    for (int ib = 0; ib < 8; ib++) nibbles16(rp, at + 8 + 16 * ib, IQ4NL_UNSIGNED, D->w[ib]);
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
    const __m512i base = _mm512_broadcast_i32x4(_mm_setr_epi32(0, 0x04040404, 0x08080808, 0x0C0C0C0C));
    const __m512i lo = _mm512_set1_epi32(0x08040201), hi = _mm512_set1_epi32((int)0x80402010);
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
            const __m512i sv = _mm512_loadu_si512((const void *)signs[ib]);
            const __m512i ctl = _mm512_add_epi8(base, _mm512_set1_epi8((char)(k / 2)));
            const __mmask64 neg = _mm512_test_epi8_mask(_mm512_shuffle_epi8(sv, ctl), k % 2 ? hi : lo);
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
    const __m512i spread = _mm512_broadcast_i32x4(_mm_setr_epi32(0, 0x04040404, 0x08080808, 0x0C0C0C0C));
    const __m512i lo = _mm512_set1_epi32(0x08040201), hi = _mm512_set1_epi32((int)0x80402010);
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
            const __m512i signs = _mm512_shuffle_epi8(_mm512_or_si512(si, _mm512_slli_epi32(par, 7)), spread);
            /* the 8-byte entries of rows 0-7 and 8-15, their low and high dwords sorted into rows */
            const __m512i e0 = _mm512_i32gather_epi64(_mm512_castsi512_si256(gi), (const void *)IQ2XXS_GRID, 8);
            const __m512i e1 = _mm512_i32gather_epi64(_mm512_extracti64x4_epi64(gi, 1), (const void *)IQ2XXS_GRID, 8);
            for (int h = 0; h < 2; h++) {
                const __m512i pick = _mm512_add_epi32(_mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0),
                                                      _mm512_set1_epi32(h));
                const __m512i v = _mm512_permutex2var_epi32(e0, pick, e1);
                const __mmask64 neg = _mm512_test_epi8_mask(signs, h ? hi : lo);
                D->w[ib][2 * l + h] = _mm512_mask_sub_epi8(_mm512_add_epi8(v, c128), neg, c128, v); /* 128 + value */
            }
        }
    }
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
    else k256_body(F_IQ4_XS, w, rb, r0, r1, n, xl, T, y, ys);
}

void init_gemm_lanes_avx512(void) {
    for (int i = 0; i < 16; i++) IQ4NL_UNSIGNED[i] = (uint8_t)(KVALUES_IQ4NL[i] + 128);
    GEMM[F_Q4_1] = (gemm_ops){2, b32s_size, b32s_prep, b32s_run};
    GEMM[F_Q5_0] = (gemm_ops){2, b32s_size, b32s_prep, b32s_run};
    GEMM[F_Q5_1] = (gemm_ops){2, b32s_size, b32s_prep, b32s_run};
    GEMM[F_IQ4_NL] = (gemm_ops){2, b32s_size, b32s_prep, b32s_run};
    GEMM[F_IQ4_XS] = (gemm_ops){2, xs_size, xs_prep, k256_run};
    GEMM[F_IQ3_S] = (gemm_ops){4, xs_size, xs_prep, k256_run};
    GEMM[F_IQ2_XXS] = (gemm_ops){4, xs_size, xs_prep, k256_run};
}
#else
void init_gemm_lanes_avx512(void) {}
#endif
