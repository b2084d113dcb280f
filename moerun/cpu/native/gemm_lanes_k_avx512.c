/* AVX-512 prefill GEMM for iq4_xs, the grid i-quants (iq3_xxs, iq3_s, iq2_xxs, iq2_xs, iq2_s, iq1_s,
 * iq1_m), tq2_0 and tq1_0 (x q8_K), 16 rows in the lanes of a zmm (gemm_lanes.h): per super-block
 * S = the exact int32 sum over the sub-blocks (of 32 elements, of 16 for iq2_xs, iq2_s and iq1_m) of
 * scale * dot, then acc += (yd * d) * float(S), as avx512_iq4.c's and avx512_iq.c's row kernels
 * (iq1's and the ternaries' split S differently, into the same integer). They share the
 * activations' layout and the tile; each has its own decode (the grid i-quants' in
 * gemm_lanes_grid_avx512.c). */
#include "gemm_lanes.h"

#ifdef MOERUN_AVX512
typedef struct {
    int32_t qs[GT][64];  /* each token's 256 activations, 4 to a dword */
    int32_t off[GT][16]; /* -128 * each 16 activations' sum (its bsums): the offset's term */
    float d[GT];
    int32_t pad[12];
} axk_t; /* [token groups][super-blocks], 1344 bytes */

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
            for (int j = 0; j < 16; j++) o[b].off[i][j] = -128 * y->bsums[j];
            o[b].d[i] = y->d;
        }
    }
}

/* IQ4_XS: sub-block ib's IQ4 values + 128 (as the b32 ones), its scale ls - 32 from a low nibble
 * (bits 4 ib of scales_l) and 2 top bits (bits 2 ib of scales_h). */
static void xs_decode16(const uint8_t *const rp[ROWS], int64_t b, sbdec_t *D) {
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
    for (int ib = 0; ib < 8; ib++) {
        const __m512i low = _mm512_and_si512(_mm512_srl_epi32(l, _mm_cvtsi32_si128(4 * ib)), _mm512_set1_epi32(15));
        const __m512i top = _mm512_and_si512(_mm512_srl_epi32(h, _mm_cvtsi32_si128(2 * ib)), _mm512_set1_epi32(3));
        scale_per32(D, ib, _mm512_sub_epi32(_mm512_or_si512(low, _mm512_slli_epi32(top, 4)), _mm512_set1_epi32(32)));
    }
}

/* TQ2_0: element 128h + 32k + j is code (byte 32h + j >> 2k) & 3, value code - 1; no scales; d the
 * fp16 at byte 64; as iq_unpack.h. Here the codes + 127 (value + 128) and scale 1. */
static void tq2_0_decode16(const uint8_t *const rp[ROWS], int64_t b, sbdec_t *D) {
    const int64_t at = b * 66;
    uint16_t d16[ROWS];
    for (int i = 0; i < ROWS; i++) d16[i] = rd16(rp[i] + at + 64);
    D->d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)d16));
    memset(D->ls, 1, sizeof D->ls);
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
static void tq1_0_decode16(const uint8_t *const rp[ROWS], int64_t b, sbdec_t *D) {
    const int64_t at = b * 54;
    uint16_t d16[ROWS];
    int32_t c[ROWS];
    for (int i = 0; i < ROWS; i++) {
        d16[i] = rd16(rp[i] + at + 52);
        memcpy(c + i, rp[i] + at + 48, 4);
    }
    D->d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)d16));
    memset(D->ls, 1, sizeof D->ls);
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

/* 16 decoded rows (D [nsb]) times tokens 4g .. 4g + 3 (x [nsb]); rows i < nr, tokens < tn written.
 * Per 16 elements two chains per token (elements 0-15, 16-31 of each sub-block of 32), each started
 * at the offset's term; per16: a scale each (else the two share one multiply). */
static inline __attribute__((always_inline)) void k_tile(int per16, const sbdec_t *D, int64_t nsb, const axk_t *x,
                                                         int64_t tn, int nr, float *y, int64_t ys) {
    __m512 acc[GT];
    for (int t = 0; t < GT; t++) acc[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nsb; b++) {
        const sbdec_t *wd = D + b;
        const axk_t *a = x + b;
        __m512i S[GT];
        for (int t = 0; t < GT; t++) S[t] = _mm512_setzero_si512();
        for (int ib = 0; ib < 8; ib++) {
            __m512i s0[GT], s1[GT];
            for (int t = 0; t < GT; t++) {
                s0[t] = _mm512_set1_epi32(a->off[t][2 * ib]);
                s1[t] = _mm512_set1_epi32(a->off[t][2 * ib + 1]);
            }
            for (int k = 0; k < 4; k++)
                for (int t = 0; t < GT; t++) {
                    s0[t] = _mm512_dpbusd_epi32(s0[t], wd->w[ib][k], _mm512_set1_epi32(a->qs[t][8 * ib + k]));
                    s1[t] = _mm512_dpbusd_epi32(s1[t], wd->w[ib][k + 4], _mm512_set1_epi32(a->qs[t][8 * ib + k + 4]));
                }
            const __m512i l0 = scale_of(wd, 2 * ib), l1 = scale_of(wd, 2 * ib + 1);
            for (int t = 0; t < GT; t++) {
                if (per16)
                    S[t] = _mm512_add_epi32(_mm512_add_epi32(S[t], _mm512_mullo_epi32(l0, s0[t])), _mm512_mullo_epi32(l1, s1[t]));
                else S[t] = _mm512_add_epi32(S[t], _mm512_mullo_epi32(l0, _mm512_add_epi32(s0[t], s1[t])));
            }
        }
        for (int t = 0; t < GT; t++)
            acc[t] = _mm512_add_ps(acc[t], _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(a->d[t]), wd->d),
                                                         _mm512_cvtepi32_ps(S[t])));
    }
    const __mmask16 rows = (__mmask16)((1u << nr) - 1);
    for (int t = 0; t < GT && t < tn; t++) _mm512_mask_storeu_ps(y + t * ys, rows, acc[t]);
}

static void tile_32(const void *D, int64_t nsb, const void *x, int64_t tn, int nr, float *y, int64_t ys) {
    k_tile(0, D, nsb, x, tn, nr, y, ys);
}

static void tile_16(const void *D, int64_t nsb, const void *x, int64_t tn, int nr, float *y, int64_t ys) {
    k_tile(1, D, nsb, x, tn, nr, y, ys);
}

static LANES_DECODE(lanes_iq4_xs, xs_decode16)
static LANES_DECODE(lanes_tq2_0, tq2_0_decode16)
static LANES_DECODE(lanes_tq1_0, tq1_0_decode16)

#define K256(decode, tile) {256, sizeof(sbdec_t), sizeof(axk_t), decode, tile}
static const lanes_fmt LANES[F_COUNT] = {
    [F_IQ4_XS] = K256(lanes_iq4_xs, tile_32),   [F_IQ3_XXS] = K256(lanes_iq3_xxs, tile_32),
    [F_IQ3_S] = K256(lanes_iq3_s, tile_32),     [F_IQ2_XXS] = K256(lanes_iq2_xxs, tile_32),
    [F_IQ2_XS] = K256(lanes_iq2_xs, tile_16),   [F_IQ2_S] = K256(lanes_iq2_s, tile_16),
    [F_IQ1_S] = K256(lanes_iq1_s, tile_32),     [F_IQ1_M] = K256(lanes_iq1_m, tile_16),
    [F_TQ2_0] = K256(lanes_tq2_0, tile_32),     [F_TQ1_0] = K256(lanes_tq1_0, tile_32),
};

static size_t k_work(int fmt, int64_t n) { return lanes_work(&LANES[fmt], n); }

static void k_run(int fmt, const uint8_t *w, size_t rb, int64_t r0, int64_t r1, int64_t n, const void *xl,
                  int64_t T, float *y, int64_t ys, void *work) {
    lanes_run(&LANES[fmt], w, rb, r0, r1, n, xl, T, y, ys, work);
}

/* min_t: from this many tokens the GEMM beat the row kernels, measured on one thread ([1536, 2048]
 * and [2048, 768] in cache, the fastest of calls alternated with the row kernels' by 10% or more) */
#define K_GEMM(min_t) ((gemm_ops){min_t, xs_size, xs_prep, k_work, k_run})
void init_gemm_lanes_k_avx512(void) {
    GEMM[F_IQ4_XS] = K_GEMM(2);
    GEMM[F_IQ3_XXS] = K_GEMM(3);
    GEMM[F_IQ3_S] = K_GEMM(3);
    GEMM[F_IQ2_XXS] = K_GEMM(2);
    GEMM[F_IQ2_XS] = K_GEMM(3);
    GEMM[F_IQ2_S] = K_GEMM(3);
    GEMM[F_IQ1_S] = K_GEMM(2);
    GEMM[F_IQ1_M] = K_GEMM(3);
    GEMM[F_TQ2_0] = K_GEMM(3);
    GEMM[F_TQ1_0] = K_GEMM(3);
}
#else
void init_gemm_lanes_k_avx512(void) {}
#endif
