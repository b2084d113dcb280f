/* What the AVX-512 prefill GEMMs of q4_1, q5_0, q5_1, iq4_nl (gemm_lanes_b32_avx512.c: 32-element
 * blocks x q8_0 activations), iq4_xs, iq3_s, iq2_xxs, iq1_s, tq2_0 and tq1_0
 * (gemm_lanes_k_avx512.c: x q8_K) share: each zmm lane holds one of 16 rows.
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
#ifndef MOERUN_GEMM_LANES_H
#define MOERUN_GEMM_LANES_H
#include <stdlib.h>

#include "avx512.h"
#include "gemm.h"

#ifdef MOERUN_AVX512
#include "iq_tables.h"

#define GT GEMM_TOKENS
#define ROWS 16 /* rows per decoded tile: one per zmm lane */

static inline int64_t padded(int64_t T) { return (T + GT - 1) / GT * GT; }

/* 16 rows' 16 bytes (at byte `at` of each row's bytes rp[i]) -> v[4]: v[k] holds dword k of rows
 * 0 .. 15 in order. */
static inline __attribute__((always_inline)) void dwords16(const uint8_t *const rp[ROWS], int64_t at, __m512i v[4]) {
    /* z[a] holds rows a, 4 + a, 8 + a, 12 + a; then a 4 x 4 dword transpose in each 128-bit lane */
    __m512i z[4];
    for (int a = 0; a < 4; a++) {
        z[a] = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(rp[a] + at)));
        for (int l = 1; l < 4; l++)
            z[a] = _mm512_inserti32x4(z[a], _mm_loadu_si128((const __m128i *)(rp[4 * l + a] + at)), l);
    }
    const __m512i t0 = _mm512_unpacklo_epi32(z[0], z[1]), t1 = _mm512_unpackhi_epi32(z[0], z[1]);
    const __m512i t2 = _mm512_unpacklo_epi32(z[2], z[3]), t3 = _mm512_unpackhi_epi32(z[2], z[3]);
    v[0] = _mm512_unpacklo_epi64(t0, t2), v[1] = _mm512_unpackhi_epi64(t0, t2);
    v[2] = _mm512_unpacklo_epi64(t1, t3), v[3] = _mm512_unpackhi_epi64(t1, t3);
}

/* 16 rows' 16 bytes of nibbles (at byte `at` of each row's bytes rp[i]) -> w[8]: w[k] holds codes
 * 4k .. 4k + 3 of rows 0 .. 15 (low nibbles are elements 0-15, high 16-31); iq4: IQ4's values + 128
 * in their place. */
static inline __attribute__((always_inline)) void nibbles16(const uint8_t *const rp[ROWS], int64_t at,
                                                            int iq4, __m512i w[8]) {
    __m512i v[4];
    dwords16(rp, at, v);
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    for (int k = 0; k < 4; k++) {
        w[k] = _mm512_and_si512(v[k], m4);
        w[k + 4] = _mm512_and_si512(_mm512_srli_epi16(v[k], 4), m4);
    }
    if (iq4) { /* IQ4's values + 128 */
        const __m512i t = _mm512_add_epi8(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)KVALUES_IQ4NL)),
                                          _mm512_set1_epi8((char)0x80));
        for (int k = 0; k < 8; k++) w[k] = _mm512_shuffle_epi8(t, w[k]);
    }
}

/* Byte e of each dword: set where bit 4k + e (k < 8) of v's dword is (q5's fifth bits, signs). */
static inline __mmask64 nibble_bits(__m512i v, int k) {
    const __m512i spread = _mm512_broadcast_i32x4(_mm_setr_epi32(0, 0x04040404, 0x08080808, 0x0C0C0C0C));
    const __m512i at = _mm512_shuffle_epi8(v, _mm512_add_epi8(spread, _mm512_set1_epi8((char)(k / 2))));
    return _mm512_test_epi8_mask(at, _mm512_set1_epi32(k % 2 ? (int)0x80402010 : 0x08040201));
}

#endif
#endif
