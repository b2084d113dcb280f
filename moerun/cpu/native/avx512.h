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


#include "b32_avx2.h"


void init_avx512_exact(void);
#endif
#endif
