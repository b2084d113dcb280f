/* AVX-512 integer-mode kernels (F + BW + VL + VNNI): q2_k .. q6_k x q8_K; q8_0, q4_0, mxfp4 x q8_0.
 * As ggml-cpu's x86 vec_dot functions: u8 x s8 products (vpmaddubsw / vpdpbusd), the sub-block
 * scales applied in int32 (vpdpwssd; q6_k: in fp32, avx512.h), one fp32 multiply-add per block. Weights are unpacked once
 * per block for all T tokens; every load is unaligned, and the order of the sums depends only on
 * the row, so results do not depend on addresses or the thread count. */
#include "avx512.h"

#ifdef MOERUN_AVX512
/* Q4_K: each 32 bytes of qs hold sub-blocks 2c (low nibbles) and 2c + 1 (high): broadcast them to
 * both halves of a zmm and shift the upper half by 4, giving elements 64c .. 64c + 63 in order.
 * The mins term, dmin * sum_s mn[s] * (bsums of s), goes into a second (4-lane) accumulator. */
/* (Q5_K: the same with a fifth bit per element, bit s of qh[l] for sub-block s, l = 0..31.) */
static inline __attribute__((always_inline)) void q45_k_body(ROWS_ARGS, int five) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    const __m512i shift = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
    const __m512i idx_lo = _mm512_inserti64x4(_mm512_set1_epi16(0), _mm256_set1_epi16(1), 1);
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w + r * rb;
        __m512 acc[MAX_T];
        __m128 accm[MAX_T];
        for (int t = 0; t < T; t++) acc[t] = _mm512_setzero_ps(), accm[t] = _mm_setzero_ps();
        for (int64_t b = 0; b < n / 256; b++) {
            const uint8_t *blk = row + b * (five ? 176 : 144);
            const uint8_t *qs = blk + (five ? 48 : 16);
            prefetch_ahead(blk, five ? 176 : 144);
            const float d = f16_at(blk), dmin = f16_at(blk + 2);
            const __m128i scmn = k4_scales_mins(blk + 4);
            const __m512i scv = _mm512_castsi256_si512(_mm256_cvtepu8_epi16(scmn)); /* 16-bit: sc 0-7 */
            const __m128i mins = _mm_cvtepu8_epi16(_mm_srli_si128(scmn, 8));
            __m512i q[4], s16[4];
            for (int c = 0; c < 4; c++) {
                __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(qs + 32 * c)));
                q[c] = _mm512_and_si512(_mm512_srlv_epi16(v, shift), m4);
                if (five) {
                    __m512i hv = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(blk + 16)));
                    __m512i hs = _mm512_add_epi16(idx_lo, _mm512_set1_epi16(2 * c)); /* shifts 2c, 2c + 1 */
                    __m512i bit = _mm512_and_si512(_mm512_srlv_epi16(hv, hs), _mm512_set1_epi8(1));
                    q[c] = _mm512_or_si512(q[c], _mm512_slli_epi16(bit, 4));
                }
                s16[c] = _mm512_permutexvar_epi16(_mm512_add_epi16(idx_lo, _mm512_set1_epi16(2 * c)), scv);
            }
            for (int t = 0; t < T; t++) {
                const q8k_t *y = (const q8k_t *)xs[t] + b;
                __m512i s = _mm512_setzero_si512();
                for (int c = 0; c < 4; c++) {
                    __m512i xv = _mm512_loadu_si512((const void *)(y->qs + 64 * c));
                    s = _mm512_dpwssd_epi32(s, _mm512_maddubs_epi16(q[c], xv), s16[c]);
                }
                acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_set1_ps(y->d * d), acc[t]);
                const __m128i bs = _mm_hadd_epi16(_mm_loadu_si128((const __m128i *)y->bsums),
                                                  _mm_loadu_si128((const __m128i *)(y->bsums + 8)));
                const __m128i m = _mm_madd_epi16(mins, bs); /* 4 x int32, exact */
                accm[t] = _mm_fmadd_ps(_mm_cvtepi32_ps(m), _mm_set1_ps(y->d * dmin), accm[t]);
            }
        }
        for (int t = 0; t < T; t++) {
            __m128 m = _mm_add_ps(accm[t], _mm_movehl_ps(accm[t], accm[t]));
            m = _mm_add_ss(m, _mm_movehdup_ps(m));
            ys[t][r] = _mm512_reduce_add_ps(acc[t]) - _mm_cvtss_f32(m);
        }
    }
}

/* Q6_K (the contract is avx512.h's): per token, one vpdpbusd per natural chunk c gives lanes
 * 4l + k of sub-block 4c + l, four elements each; a 4 x 4 transpose-add within the 128-bit lanes sums
 * each sub-block into lane 4l + c. */
static inline __attribute__((always_inline)) void q6_k_body(ROWS_ARGS) {
    const __m512i zero = _mm512_setzero_si512();
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w + r * rb;
        __m512 acc[MAX_T];
        for (int t = 0; t < T; t++) acc[t] = _mm512_setzero_ps();
        for (int64_t b = 0; b < n / 256; b++) {
            const uint8_t *blk = row + b * 210;
            prefetch_ahead(blk, 210);
            __m512i q[4];
            q6k_weights(blk, q);
            const __m512 dsc = q6k_scales(blk);
            for (int t = 0; t < T; t++) {
                const q8k_t *y = (const q8k_t *)xs[t] + b;
                __m512i p[4];
                for (int c = 0; c < 4; c++)
                    p[c] = _mm512_dpbusd_epi32(zero, q[c], _mm512_loadu_si512((const void *)(y->qs + 64 * c)));
                const __m512i s01 = _mm512_add_epi32(_mm512_unpacklo_epi32(p[0], p[1]), _mm512_unpackhi_epi32(p[0], p[1]));
                const __m512i s23 = _mm512_add_epi32(_mm512_unpacklo_epi32(p[2], p[3]), _mm512_unpackhi_epi32(p[2], p[3]));
                __m512i s = _mm512_add_epi32(_mm512_unpacklo_epi64(s01, s23), _mm512_unpackhi_epi64(s01, s23));
                s = _mm512_add_epi32(s, q6k_offsets(y->bsums));
                acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(dsc, _mm512_set1_ps(y->d)), acc[t]);
            }
        }
        for (int t = 0; t < T; t++) ys[t][r] = _mm512_reduce_add_ps(acc[t]);
    }
}

/* Q2_K and Q3_K: 16 groups of 16 elements, each 64-element chunk (h, j) = elements
 * 128h + 64j .. + 63 taking the 2-bit fields at shifts 4j and 4j + 2 of qs[32h .. 32h + 31].
 * Q2_K: value = d * sc[g] * q - dmin * mn[g], q in [0, 3]. Q3_K: q = low2 + 4 * hbit - 4 (hbit:
 * bit 4h + 2j (+1) of hmask[l]), so q + 4 in [0, 7] goes through vpmaddubsw and the 4 comes off
 * through bsums, like Q6_K's 32. */
static inline __attribute__((always_inline)) void q23_k_body(ROWS_ARGS, int three) {
    const __m512i m2 = _mm512_set1_epi8(3), one = _mm512_set1_epi8(1);
    const __m512i halves = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1); /* 0 | 2 */
    const __m512i hbits = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(1), 1);  /* 0 | 1 */
    const __m512i lane16 = _mm512_srli_epi16(
        _mm512_set_epi16(31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16, 15, 14, 13, 12, 11, 10,
                         9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
        3); /* 16-bit lane i of a chunk holds elements 2i, 2i + 1: group i / 8 of the chunk */
    const int bytes = three ? 110 : 84;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w + r * rb;
        __m512 acc[MAX_T];
        __m256 accm[MAX_T];
        for (int t = 0; t < T; t++) acc[t] = _mm512_setzero_ps(), accm[t] = _mm256_setzero_ps();
        for (int64_t b = 0; b < n / 256; b++) {
            const uint8_t *blk = row + b * bytes, *qs = blk + (three ? 32 : 16);
            prefetch_ahead(blk, bytes);
            float d, dmin = 0;
            __m128i sc8, mn8 = _mm_setzero_si128();
            if (three) {
                uint32_t a[4], tmp;
                memcpy(a, blk + 96, 12);
                tmp = a[2];
                const uint32_t k1 = 0x03030303, k2 = 0x0f0f0f0f;
                a[2] = ((a[0] >> 4) & k2) | (((tmp >> 4) & k1) << 4);
                a[3] = ((a[1] >> 4) & k2) | (((tmp >> 6) & k1) << 4);
                a[0] = (a[0] & k2) | ((tmp & k1) << 4);
                a[1] = (a[1] & k2) | (((tmp >> 2) & k1) << 4);
                sc8 = _mm_sub_epi8(_mm_set_epi32((int)a[3], (int)a[2], (int)a[1], (int)a[0]), _mm_set1_epi8(32));
                d = f16_at(blk + 108);
            } else {
                __m128i raw = _mm_loadu_si128((const __m128i *)blk);
                sc8 = _mm_and_si128(raw, _mm_set1_epi8(0x0F));
                mn8 = _mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(0x0F));
                d = f16_at(blk + 80);
                dmin = f16_at(blk + 82);
            }
            const __m256i sc16 = _mm256_cvtepi8_epi16(sc8), mn16 = _mm256_cvtepu8_epi16(mn8);
            const __m512i scv = _mm512_castsi256_si512(sc16);
            __m512i q[4], s16[4];
            for (int c = 0; c < 4; c++) { /* c = 2h + j */
                int h = c >> 1, j = c & 1;
                __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(qs + 32 * h)));
                q[c] = _mm512_and_si512(_mm512_srlv_epi16(v, _mm512_add_epi16(halves, _mm512_set1_epi16(4 * j))), m2);
                if (three) {
                    __m512i hm = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)blk));
                    __m512i sh = _mm512_add_epi16(hbits, _mm512_set1_epi16(4 * h + 2 * j));
                    __m512i bit = _mm512_and_si512(_mm512_srlv_epi16(hm, sh), one);
                    q[c] = _mm512_or_si512(q[c], _mm512_slli_epi16(bit, 2));
                }
                s16[c] = _mm512_permutexvar_epi16(_mm512_add_epi16(lane16, _mm512_set1_epi16(4 * c)), scv);
            }
            for (int t = 0; t < T; t++) {
                const q8k_t *y = (const q8k_t *)xs[t] + b;
                __m512i s = _mm512_setzero_si512();
                for (int c = 0; c < 4; c++) {
                    __m512i xv = _mm512_loadu_si512((const void *)(y->qs + 64 * c));
                    s = _mm512_dpwssd_epi32(s, _mm512_maddubs_epi16(q[c], xv), s16[c]);
                }
                const __m256i bs = _mm256_loadu_si256((const __m256i *)y->bsums);
                if (three) /* q = stored - 4: take 4 * sum_g sc[g] * bsums[g] off */
                    s = _mm512_sub_epi32(s, _mm512_zextsi256_si512(_mm256_slli_epi32(_mm256_madd_epi16(sc16, bs), 2)));
                acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_set1_ps(y->d * d), acc[t]);
                if (!three)
                    accm[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(mn16, bs)), _mm256_set1_ps(y->d * dmin),
                                              accm[t]);
            }
        }
        for (int t = 0; t < T; t++) {
            __m256 m = accm[t];
            __m128 m4 = _mm_add_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
            m4 = _mm_add_ps(m4, _mm_movehl_ps(m4, m4));
            m4 = _mm_add_ss(m4, _mm_movehdup_ps(m4));
            ys[t][r] = _mm512_reduce_add_ps(acc[t]) - _mm_cvtss_f32(m4);
        }
    }
}

/* 32-element blocks x q8_0, two blocks per zmm: signed weights as |w| (u8) times x with w's sign
 * (s8) through vpdpbusd, as ggml does; per block (d * yd) in fp32 times the exact int32 lanes. An odd
 * last block takes the upper half's place with zero weights. */
static inline __attribute__((always_inline)) void b32_int(ROWS_ARGS, int kind) {
    const int bytes = kind == F_Q8_0 ? 34 : kind == F_Q4_0 ? 18 : 17;
    const int64_t nb = n / 32;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w + r * rb;
        __m512 acc[MAX_T];
        for (int t = 0; t < T; t++) acc[t] = _mm512_setzero_ps();
        for (int64_t b = 0; b < nb; b += 2) {
            const int two = b + 1 < nb;
            prefetch_ahead(row + b * bytes, 2 * (int)bytes);
            float d0, d1 = 0;
            __m256i w0 = b32_weights(row + b * bytes, kind, &d0);
            __m256i w1 = two ? b32_weights(row + (b + 1) * bytes, kind, &d1) : _mm256_setzero_si256();
            __m512i wv = _mm512_inserti64x4(_mm512_castsi256_si512(w0), w1, 1);
            __m512i wabs = kind == F_Q4_0 ? wv : _mm512_abs_epi8(wv);
            __mmask64 neg = kind == F_Q4_0 ? 0 : _mm512_movepi8_mask(wv);
            __m512 dw = _mm512_insertf32x8(_mm512_set1_ps(d0), _mm256_set1_ps(d1), 1);
            for (int t = 0; t < T; t++) {
                const q8a_t *y = (const q8a_t *)xs[t] + b;
                __m256i x1 = two ? _mm256_loadu_si256((const __m256i *)y[1].qs) : _mm256_setzero_si256();
                __m512i xv = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)y[0].qs)), x1, 1);
                xv = _mm512_mask_sub_epi8(xv, neg, _mm512_setzero_si512(), xv);
                __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wabs, xv);
                if (kind == F_Q4_0) {
                    __m512i off = _mm512_maskz_set1_epi32(0x0001, 8 * y[0].sum);
                    if (two) off = _mm512_mask_set1_epi32(off, 0x0100, 8 * y[1].sum);
                    p = _mm512_sub_epi32(p, off);
                }
                __m512 dy = _mm512_insertf32x8(_mm512_set1_ps(y[0].d), _mm256_set1_ps(two ? y[1].d : 0.f), 1);
                acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(dw, dy), acc[t]);
            }
        }
        for (int t = 0; t < T; t++) ys[t][r] = _mm512_reduce_add_ps(acc[t]);
    }
}

/* Four 32-element blocks' weights as int8 in two zmm (blocks 0-1, 2-3), for mxfp4 (both nibble
 * orders) and q4_0 (unsigned codes), with the nibbles split and looked up 64 bytes at a time. */
static inline void b32x4_nibbles(const uint8_t *blk, int bytes, int off, int kind, const int8_t *values,
                                 __m512i out[2]) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(blk + off)));
    v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(blk + bytes + off)), 1);
    v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(blk + 2 * bytes + off)), 2);
    v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(blk + 3 * bytes + off)), 3);
    __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
    if (kind != F_Q4_0) {
        const __m512i table = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)values));
        lo = _mm512_shuffle_epi8(table, lo);
        hi = _mm512_shuffle_epi8(table, hi);
    }
    if (kind == F_MXFP4_OSS) { /* element 2j low nibble, 2j + 1 high: interleave within each block */
        __m512i a = _mm512_unpacklo_epi8(lo, hi), b = _mm512_unpackhi_epi8(lo, hi);
        lo = a, hi = b; /* lane i: block i's elements 0-15 (a) and 16-31 (b) */
    }
    const __m512i i01 = _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0), i23 = _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4);
    out[0] = _mm512_permutex2var_epi64(lo, i01, hi);
    out[1] = _mm512_permutex2var_epi64(lo, i23, hi);
}

static float E8M0_HALF_TABLE[256]; /* e8m0_half(e), filled by init_avx512: a load, not bit surgery */

static inline float b32_scale(const uint8_t *blk, int kind) {
    return kind == F_Q8_0 || kind == F_Q4_0 ? f16_at(blk) : E8M0_HALF_TABLE[blk[0]];
}

/* The integer dot of two blocks (one zmm of weights) with two q8_0 activation blocks, into acc. */
static inline __m512 b32_pair(__m512i wv, float d0, float d1, const q8a_t *y, int kind, __m512 acc) {
    __m512i xv = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)y[0].qs)),
                                    _mm256_loadu_si256((const __m256i *)y[1].qs), 1);
    __m512i p;
    if (kind == F_Q4_0) {
        p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv, xv);
        __m512i off = _mm512_mask_set1_epi32(_mm512_maskz_set1_epi32(0x0001, 8 * y[0].sum), 0x0100, 8 * y[1].sum);
        p = _mm512_sub_epi32(p, off);
    } else {
        xv = _mm512_mask_sub_epi8(xv, _mm512_movepi8_mask(wv), _mm512_setzero_si512(), xv);
        p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_abs_epi8(wv), xv);
    }
    /* the two blocks' fp32 scale products d * yd, lanes 0-7 and 8-15 */
    const float p0 = d0 * y[0].d, p1 = d1 * y[1].d;
    __m512 dv = _mm512_mask_broadcastss_ps(_mm512_set1_ps(p0), 0xFF00, _mm_set_ss(p1));
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), dv, acc);
}

/* mxfp4 / q4_0 rows: groups of four blocks through b32x4_nibbles, the rest (n / 32 % 4) one pair
 * or block at a time through b32_int's path. */
static inline __attribute__((always_inline)) void b32x4_int(ROWS_ARGS, int kind) {
    const int bytes = kind == F_Q4_0 ? 18 : 17, off = kind == F_Q4_0 ? 2 : 1;
    const int64_t nb = n / 32, nb4 = nb / 4 * 4;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w + r * rb;
        __m512 acc[MAX_T], acc2[MAX_T]; /* blocks 0-1 and 2-3 of each group: two dependency chains */
        for (int t = 0; t < T; t++) acc[t] = acc2[t] = _mm512_setzero_ps();
        for (int64_t b = 0; b < nb4; b += 4) {
            const uint8_t *blk = row + b * bytes;
            prefetch_ahead(blk, 4 * (int)bytes);
            __m512i wv[2];
            b32x4_nibbles(blk, bytes, off, kind, KVALUES_MXFP4, wv);
            float d[4];
            for (int i = 0; i < 4; i++) d[i] = b32_scale(blk + i * bytes, kind);
            for (int t = 0; t < T; t++) {
                const q8a_t *y = (const q8a_t *)xs[t] + b;
                acc[t] = b32_pair(wv[0], d[0], d[1], y, kind, acc[t]);
                acc2[t] = b32_pair(wv[1], d[2], d[3], y + 2, kind, acc2[t]);
            }
        }
        for (int64_t b = nb4; b < nb; b++) { /* leftover blocks: one at a time, upper half zero */
            float d;
            __m256i w0 = b32_weights(row + b * bytes, kind, &d);
            __m512i wv = _mm512_castsi256_si512(w0);
            wv = _mm512_inserti64x4(wv, _mm256_setzero_si256(), 1);
            for (int t = 0; t < T; t++) {
                const q8a_t *y = (const q8a_t *)xs[t] + b;
                q8a_t pair[2];
                pair[0] = y[0];
                memset(&pair[1], 0, sizeof pair[1]);
                acc[t] = b32_pair(wv, d, 0.f, pair, kind, acc[t]);
            }
        }
        for (int t = 0; t < T; t++) ys[t][r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[t], acc2[t]));
    }
}

/* kvalues_mxfp4 + 12: the same weights as unsigned bytes (0 .. 24). */
static const int8_t KVALUES_MXFP4_U12[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};
#define B32_ONE_MAX_UNITS 256 /* rows of up to 16384 inputs; longer ones take b32_int / b32x4_int */

/* T = 1 for the signed 32-element formats (q8_0, mxfp4): the activation's units (two blocks in one
 * zmm) prepared once per call, so a row's unit costs one vpdpbusd. Weights go in as unsigned bytes
 * (q8_0: w + 128; mxfp4: w + 12) and each lane starts at -(offset x the sum of its 4 activations):
 * the same exact int32 lanes as b32_int's and b32x4_int's sign trick, the same units, accumulators
 * and fp32 steps, so the same bits. */
static inline __attribute__((always_inline)) void b32_one(ROWS_ARGS, int kind) {
    const int x4 = kind != F_Q8_0, bytes = kind == F_Q8_0 ? 34 : 17;
    const int64_t nb = n / 32, nu = nb / 2;
    const q8a_t *y = (const q8a_t *)xs[0];
    __m512i X[B32_ONE_MAX_UNITS], C[B32_ONE_MAX_UNITS];
    __m512 DY[B32_ONE_MAX_UNITS];
    const __m512i offset = _mm512_set1_epi8((char)(kind == F_Q8_0 ? 0x80 : 12));
    for (int64_t u = 0; u < nu; u++) {
        X[u] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)y[2 * u].qs)),
                                  _mm256_loadu_si256((const __m256i *)y[2 * u + 1].qs), 1);
        C[u] = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_dpbusd_epi32(_mm512_setzero_si512(), offset, X[u]));
        DY[u] = _mm512_insertf32x8(_mm512_set1_ps(y[2 * u].d), _mm256_set1_ps(y[2 * u + 1].d), 1);
    }
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w + r * rb;
        __m512 acc = _mm512_setzero_ps(), acc2 = _mm512_setzero_ps();
        if (!x4) {
            for (int64_t u = 0; u < nu; u++) {
                const uint8_t *blk = row + 2 * u * bytes;
                __m512i wv = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(blk + 2))),
                                                _mm256_loadu_si256((const __m256i *)(blk + bytes + 2)), 1);
                __m512 dw = _mm512_insertf32x8(_mm512_set1_ps(f16_at(blk)), _mm256_set1_ps(f16_at(blk + bytes)), 1);
                __m512i p = _mm512_dpbusd_epi32(C[u], _mm512_xor_si512(wv, flip), X[u]);
                acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(dw, DY[u]), acc);
            }
            ys[0][r] = _mm512_reduce_add_ps(acc);
            continue;
        }
        for (int64_t b = 0; b < nb; b += 4) {
            const uint8_t *blk = row + b * bytes;
            prefetch_ahead(blk, 4 * (int)bytes);
            __m512i wv[2];
            b32x4_nibbles(blk, bytes, 1, kind, KVALUES_MXFP4_U12, wv);
            const int64_t u = b / 2;
            __m512 d01 = _mm512_insertf32x8(_mm512_set1_ps(E8M0_HALF_TABLE[blk[0]]),
                                            _mm256_set1_ps(E8M0_HALF_TABLE[blk[bytes]]), 1);
            __m512 d23 = _mm512_insertf32x8(_mm512_set1_ps(E8M0_HALF_TABLE[blk[2 * bytes]]),
                                            _mm256_set1_ps(E8M0_HALF_TABLE[blk[3 * bytes]]), 1);
            __m512i p0 = _mm512_dpbusd_epi32(C[u], wv[0], X[u]), p1 = _mm512_dpbusd_epi32(C[u + 1], wv[1], X[u + 1]);
            acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p0), _mm512_mul_ps(d01, DY[u]), acc);
            acc2 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p1), _mm512_mul_ps(d23, DY[u + 1]), acc2);
        }
        ys[0][r] = _mm512_reduce_add_ps(_mm512_add_ps(acc, acc2));
    }
}

#define Q4K_CALL(TT) q45_k_body(w, rb, r0, r1, n, xs, TT, ys, 0)
#define Q5K_CALL(TT) q45_k_body(w, rb, r0, r1, n, xs, TT, ys, 1)
#define Q6K_CALL(TT) q6_k_body(w, rb, r0, r1, n, xs, TT, ys)
#define Q2K_CALL(TT) q23_k_body(w, rb, r0, r1, n, xs, TT, ys, 0)
#define Q3K_CALL(TT) q23_k_body(w, rb, r0, r1, n, xs, TT, ys, 1)
static void q4_k_int(ROWS_ARGS) { ONE_OR_T(Q4K_CALL); }
static void q5_k_int(ROWS_ARGS) { ONE_OR_T(Q5K_CALL); }
static void q6_k_int(ROWS_ARGS) { ONE_OR_T(Q6K_CALL); }
static void q2_k_int(ROWS_ARGS) { ONE_OR_T(Q2K_CALL); }
static void q3_k_int(ROWS_ARGS) { ONE_OR_T(Q3K_CALL); }

#define Q80_CALL(TT) b32_int(w, rb, r0, r1, n, xs, TT, ys, F_Q8_0)
#define Q40_CALL(TT) b32x4_int(w, rb, r0, r1, n, xs, TT, ys, F_Q4_0)
#define MX_CALL(TT) b32x4_int(w, rb, r0, r1, n, xs, TT, ys, F_MXFP4)
#define MXO_CALL(TT) b32x4_int(w, rb, r0, r1, n, xs, TT, ys, F_MXFP4_OSS)
/* b32_one where its units cover the row exactly (x4 kinds: whole groups of four blocks) */
static int b32_one_fits(int kind, int64_t n) {
    const int64_t nb = n / 32;
    return nb / 2 <= B32_ONE_MAX_UNITS && (kind == F_Q8_0 ? nb % 2 == 0 : nb % 4 == 0);
}
static void q8_0_int(ROWS_ARGS) {
    if (T == 1 && b32_one_fits(F_Q8_0, n)) b32_one(w, rb, r0, r1, n, xs, 1, ys, F_Q8_0);
    else ONE_OR_T(Q80_CALL);
}
static void q4_0_int(ROWS_ARGS) { ONE_OR_T(Q40_CALL); }
static void mxfp4_int(ROWS_ARGS) {
    if (T == 1 && b32_one_fits(F_MXFP4, n)) b32_one(w, rb, r0, r1, n, xs, 1, ys, F_MXFP4);
    else ONE_OR_T(MX_CALL);
}
static void mxfp4_oss_int(ROWS_ARGS) {
    if (T == 1 && b32_one_fits(F_MXFP4_OSS, n)) b32_one(w, rb, r0, r1, n, xs, 1, ys, F_MXFP4_OSS);
    else ONE_OR_T(MXO_CALL);
}

void init_avx512(void) {
    init_avx512_exact();
    for (int e = 0; e < 256; e++) E8M0_HALF_TABLE[e] = e8m0_half((uint8_t)e);
    FMT[F_Q4_K].integer = q4_k_int;
    FMT[F_Q5_K].integer = q5_k_int;
    FMT[F_Q6_K].integer = q6_k_int;
    FMT[F_Q2_K].integer = q2_k_int;
    FMT[F_Q3_K].integer = q3_k_int;
    FMT[F_Q8_0].integer = q8_0_int;
    FMT[F_Q4_0].integer = q4_0_int;
    FMT[F_MXFP4].integer = mxfp4_int;
    FMT[F_MXFP4_OSS].integer = mxfp4_oss_int;
}
#else
void init_avx512(void) {}
#endif
