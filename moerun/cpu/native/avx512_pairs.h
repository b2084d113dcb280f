/* What the AVX-512 kernels of the grid i-quants (avx512_iq.c) and of the ternary formats and IQ1
 * (avx512_ternary.c) share: a super-block decoded as 4 pairs of runs of 32 (pairs_t), and exact
 * mode computed from it. */
#ifndef MOERUN_AVX512_PAIRS_H
#define MOERUN_AVX512_PAIRS_H
#include "avx512.h"

#ifdef MOERUN_AVX512
#include "iq_unpack.h"

/* One super-block as 4 pairs of runs: magnitudes, a mask of the negative values, int16 scales
 * (lanes 8i .. 8i + 7 for the pair's elements 16i .. 16i + 15), and d. */
typedef struct {
    __m512i mag[4], sc[4];
    __mmask64 neg[4];
    float d;
} pairs_t;

/* int16 lanes 8i .. 8i + 7 = s[i]: one scale per 16 elements of a pair of runs. */
static inline __m512i scales4(int s0, int s1, int s2, int s3) {
    const __m512i which = _mm512_srli_epi16(
        _mm512_set_epi16(31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16, 15, 14, 13, 12, 11, 10, 9, 8,
                         7, 6, 5, 4, 3, 2, 1, 0),
        3);
    return _mm512_permutexvar_epi16(which, _mm512_castsi128_si512(_mm_setr_epi16((short)s0, (short)s1, (short)s2,
                                                                                 (short)s3, 0, 0, 0, 0)));
}

static inline uint64_t rd64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

typedef void (*pairs_fn)(const uint8_t *, pairs_t *);

/* Exact mode: each 16 elements' values step * q, step = d * sc, as generic.c's rows_k_exact, then
 * acc += v * x (a multiply, then an add) in its 16 lanes, chunk after chunk, summed by sum16_tree. */
static inline __attribute__((always_inline)) void pairs_exact_body(ROWS_ARGS, int bytes, pairs_fn decode) {
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w + r * rb;
        __m512 acc[MAX_T];
        for (int t = 0; t < T; t++) acc[t] = _mm512_setzero_ps();
        for (int64_t b = 0; b < n / 256; b++) {
            pairs_t s;
            decode(row + b * bytes, &s);
            for (int c = 0; c < 4; c++) {
                int8_t q[64];
                int16_t sc[32];
                _mm512_storeu_si512((void *)q, _mm512_mask_sub_epi8(s.mag[c], s.neg[c], _mm512_setzero_si512(), s.mag[c]));
                _mm512_storeu_si512((void *)sc, s.sc[c]);
                for (int g = 0; g < 4; g++) {
                    const __m512 step = _mm512_set1_ps(s.d * (float)sc[8 * g]);
                    const __m128i q16 = _mm_loadu_si128((const __m128i *)(q + 16 * g));
                    const __m512 v = _mm512_mul_ps(step, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q16)));
                    for (int t = 0; t < T; t++) {
                        const float *x = (const float *)xs[t] + 256 * b + 64 * c + 16 * g;
                        acc[t] = _mm512_add_ps(acc[t], _mm512_mul_ps(v, _mm512_loadu_ps(x)));
                    }
                }
            }
        }
        for (int t = 0; t < T; t++) ys[t][r] = sum16_zmm(acc[t]);
    }
}

#define PAIRS_EXACT(name, bytes)                                                                       \
    static void name##_exact(ROWS_ARGS) {                                                              \
        if (T == 1) pairs_exact_body(w, rb, r0, r1, n, xs, 1, ys, bytes, pairs_##name);                 \
        else pairs_exact_body(w, rb, r0, r1, n, xs, T, ys, bytes, pairs_##name);                        \
    }
#endif
#endif
