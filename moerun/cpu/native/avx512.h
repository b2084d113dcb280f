/* Helpers shared by the AVX-512 kernel files (avx512.c: integer mode; avx512_exact.c: exact mode). */
#ifndef MOERUN_AVX512_H
#define MOERUN_AVX512_H
#include "common.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define MOERUN_AVX512 1
#include <immintrin.h>

#define ROWS_ARGS                                                                                      \
    const uint8_t *w, size_t rb, int64_t r0, int64_t r1, int64_t n, const void *const *xs, int T,      \
        float *const *ys

/* T == 1 (decode) gets its own copy of each kernel, in which the accumulators stay in registers. */
#define ONE_OR_T(call) \
    do { if (T == 1) { call(1); } else { call(T); } } while (0)

/* Q4_K's 12 bytes of 6-bit scales and mins -> 8 scales (bytes 0-7) and 8 mins (8-15), built in
 * registers (ggml's kmask shuffle), not through a stored array that a vector load would stall on. */
static inline __m128i k4_scales_mins(const uint8_t *p) {
    uint32_t u[3];
    memcpy(u, p, 12);
    const uint32_t m1 = 0x3f3f3f3f, m2 = 0x0f0f0f0f, m3 = 0x03030303;
    uint32_t sc_lo = u[0] & m1, mn_lo = u[1] & m1;
    uint32_t sc_hi = (u[2] & m2) | (((u[0] >> 6) & m3) << 4);
    uint32_t mn_hi = ((u[2] >> 4) & m2) | (((u[1] >> 6) & m3) << 4);
    return _mm_set_epi32((int)mn_hi, (int)mn_lo, (int)sc_hi, (int)sc_lo);
}


/* One 32-element block's weights as int8 (q4_0: its unsigned 4-bit codes; the offset 8 comes off
 * through the activation block's sum) and its fp32 scale. */
static inline __m256i b32_weights(const uint8_t *blk, int kind, float *d) {
    const __m128i m4 = _mm_set1_epi8(0x0F);
    if (kind == F_Q8_0) {
        *d = f16_at(blk);
        return _mm256_loadu_si256((const __m256i *)(blk + 2));
    }
    if (kind == F_Q4_0) {
        *d = f16_at(blk);
        __m128i v = _mm_loadu_si128((const __m128i *)(blk + 2));
        return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m4), _mm_and_si128(v, m4));
    }
    const __m128i table = _mm_loadu_si128((const __m128i *)KVALUES_MXFP4);
    *d = e8m0_half(blk[0]);
    __m128i v = _mm_loadu_si128((const __m128i *)(blk + 1));
    __m128i lo = _mm_shuffle_epi8(table, _mm_and_si128(v, m4));
    __m128i hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(v, 4), m4));
    return kind == F_MXFP4 ? _mm256_set_m128i(hi, lo)
                           : _mm256_set_m128i(_mm_unpackhi_epi8(lo, hi), _mm_unpacklo_epi8(lo, hi));
}


void init_avx512_exact(void);
#endif
#endif
