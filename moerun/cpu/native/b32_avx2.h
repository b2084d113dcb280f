/* The 32-element blocks (q8_0, q4_0, mxfp4 in both nibble orders) decoded to int8 with AVX2, shared
 * by the avx2 and avx512 variants' integer kernels. Include after <immintrin.h>, inside the code a
 * variant compiles with AVX2 enabled. */
#ifndef MOERUN_B32_AVX2_H
#define MOERUN_B32_AVX2_H
#include "common.h"

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

#endif
