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


/* Q6_K in integer mode (the row kernels of avx512.c and the GEMM of gemm_q6k_avx512.c compute the
 * same thing). Per super-block and token, the 16 sub-block sums S_g = sum of q_i * x_i over the
 * sub-block's 16 elements minus 32 * bsums_g (q in [0, 63], the offset 32 through the activations'
 * bsums): exact int32, however computed. Then fp32 lane 4 (g % 4) + g / 4 of the (row, token)
 * accumulator gets acc += float(S_g) * (dsc * yd), dsc = d * sc_g (exact: 11 x 8 significant bits);
 * the output is _mm512_reduce_add_ps(acc). Lane L = 4l + c thus holds sub-block 4c + l: the 128-bit
 * lane l of natural chunk c (elements 64c .. 64c + 63) is exactly sub-block 4c + l. */
#define Q6K_LANE_ORDER _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0)

/* The block's weights q in [0, 63] in natural order, chunk c = elements 64c .. 64c + 63: per half h
 * of 128, ql's 64 bytes give the low 4 bits of elements 0-63 (low nibbles) and 64-127 (high), qh's
 * 32 bytes their top 2 bits. */
static inline void q6k_weights(const uint8_t *blk, __m512i q[4]) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), m2 = _mm512_set1_epi8(0x03);
    for (int h = 0; h < 2; h++) {
        __m512i L = _mm512_loadu_si512((const void *)(blk + 64 * h));
        __m256i Q = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
        __m512i Q2 = _mm512_inserti64x4(_mm512_castsi256_si512(Q), _mm256_srli_epi16(Q, 2), 1);
        q[2 * h] = _mm512_or_si512(_mm512_and_si512(L, m4), _mm512_slli_epi16(_mm512_and_si512(Q2, m2), 4));
        q[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(L, 4), m4),
                                       _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(Q2, 4), m2), 4));
    }
}

/* d * sc_g in lane order (fp32). */
static inline __m512 q6k_scales(const uint8_t *blk) {
    const __m512i sc = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(blk + 192)));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_permutexvar_epi32(Q6K_LANE_ORDER, sc)),
                         _mm512_set1_ps(f16_at(blk + 208)));
}

/* -32 * bsums_g in lane order: the starting value of each sub-block's sum. */
static inline __m512i q6k_offsets(const int16_t *bsums) {
    const __m512i b = _mm512_cvtepi16_epi32(_mm256_loadu_si256((const __m256i *)bsums));
    return _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(_mm512_permutexvar_epi32(Q6K_LANE_ORDER, b), 5));
}

/* Four vectors' 4 x 4 dword transpose within each 128-bit lane: out[k] dword 4l + c = in[c] dword
 * 4l + k. Applied to a block's chunks (weights or activations), vpdpbusd of out[k] against out[k]
 * steps lane 4l + c through sub-block 4c + l, four elements per step. */
static inline void q6k_transpose(const __m512i in[4], __m512i out[4]) {
    const __m512i t0 = _mm512_unpacklo_epi32(in[0], in[1]), t1 = _mm512_unpackhi_epi32(in[0], in[1]);
    const __m512i t2 = _mm512_unpacklo_epi32(in[2], in[3]), t3 = _mm512_unpackhi_epi32(in[2], in[3]);
    out[0] = _mm512_unpacklo_epi64(t0, t2), out[1] = _mm512_unpackhi_epi64(t0, t2);
    out[2] = _mm512_unpacklo_epi64(t1, t3), out[3] = _mm512_unpackhi_epi64(t1, t3);
}


#include "b32_avx2.h"

/* common.h's sum16_tree of a zmm's lanes, for kernels that keep generic.c's bits. */
static inline float sum16_zmm(__m512 acc) {
    float a[16];
    _mm512_storeu_ps(a, acc);
    return sum16_tree(a);
}


void init_avx512_exact(void);
#endif
#endif
