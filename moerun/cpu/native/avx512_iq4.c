/* AVX-512 kernels of q4_1, q5_0, q5_1, iq4_nl (integer mode: x q8_0) and iq4_xs (x q8_K): the same bits
 * as generic.c's (and avx2_iq4.c's). Integer mode: the exact int32 sums computed 64 bytes at a time,
 * the fp32 steps in generic.c's order, one block after another. Exact mode: generic.c's values and
 * its 16 fp32 lanes (below).
 * 32-element blocks: their weights as unsigned bytes (IQ4_NL's values + 128), u8 x s8 through
 * vpdpbusd, then an in-register reduction to the blocks' sums, from which the offset times the
 * activation block's sum comes off (q5_0: 16, iq4_nl: 128). 16 blocks per step, each block's fp32
 * product in a lane (the per-block operations vectorised, then added in block order); the last
 * n / 32 % 16 blocks four per step, then avx2_iq4.c's path.
 * IQ4_XS: two sub-blocks per zmm, |w| times x with w's sign (vpmaddubsw), the sub-block scales
 * applied in int32 (vpdpwssd), one reduction per super-block. */
#include "avx512.h"

#ifdef MOERUN_AVX512
#include "iq4_avx2.h"

/* IQ4's values + 128 (unsigned bytes), from KVALUES_IQ4NL at init. */
static uint8_t IQ4NL_UNSIGNED[16];

/* Four blocks' 16 bytes of nibbles (at `at` in each) -> two zmm: blocks 0-1 and 2-3, each block's
 * low nibbles then high (its elements in order), through `table` if given. */
static inline void nibbles_x4(const uint8_t *blk, int bytes, int at, const uint8_t *table, __m512i out[2]) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    __m512i v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(blk + at)));
    for (int i = 1; i < 4; i++) v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(blk + i * bytes + at)), i);
    __m512i lo = _mm512_and_si512(v, m4), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
    if (table) {
        const __m512i t = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)table));
        lo = _mm512_shuffle_epi8(t, lo);
        hi = _mm512_shuffle_epi8(t, hi);
    }
    out[0] = _mm512_permutex2var_epi64(lo, _mm512_set_epi64(11, 10, 3, 2, 9, 8, 1, 0), hi);
    out[1] = _mm512_permutex2var_epi64(lo, _mm512_set_epi64(15, 14, 7, 6, 13, 12, 5, 4), hi);
}

/* Q5's fifth bits of two blocks (uint32 at p and p + bytes) as 0x10 in their bytes. */
static inline __m512i fifth_bits_x2(const uint8_t *p, int bytes) {
    uint32_t a, b;
    memcpy(&a, p, 4);
    memcpy(&b, p + bytes, 4);
    return _mm512_maskz_set1_epi8((__mmask64)a | (__mmask64)b << 32, 0x10);
}

/* The four blocks' exact int32 sums of u * x: p01 (blocks 0, 1 in lanes 0-7, 8-15) and p23 ->
 * sums[0], sums[1], sums[2], sums[3]. */
static inline void sums_x4(__m512i p01, __m512i p23, int32_t sums[4]) {
    __m512i t = _mm512_add_epi32(_mm512_unpacklo_epi32(p01, p23), _mm512_unpackhi_epi32(p01, p23));
    t = _mm512_add_epi32(t, _mm512_shuffle_epi32(t, _MM_PERM_BADC)); /* per 128 bits: (p01's, p23's) */
    t = _mm512_add_epi32(t, _mm512_shuffle_i32x4(t, t, _MM_SHUFFLE(2, 3, 0, 1)));
    int32_t lanes[16];
    _mm512_storeu_si512((void *)lanes, t);
    sums[0] = lanes[0], sums[1] = lanes[8], sums[2] = lanes[1], sums[3] = lanes[9];
}

/* Eight vpdpbusd results (p[j]: blocks 2j, 2j + 1 in lanes 0-7, 8-15) -> the 16 blocks' sums, block
 * i in lane i: pairs of vectors added in a transpose tree. */
static inline __m512i sums_x16(const __m512i p[8]) {
    __m512i a[4], c[2];
    for (int j = 0; j < 4; j++)
        a[j] = _mm512_add_epi32(_mm512_unpacklo_epi32(p[2 * j], p[2 * j + 1]), _mm512_unpackhi_epi32(p[2 * j], p[2 * j + 1]));
    for (int j = 0; j < 2; j++) /* per 128 bits, dword k: that part of p[4j + k] */
        c[j] = _mm512_add_epi32(_mm512_unpacklo_epi64(a[2 * j], a[2 * j + 1]), _mm512_unpackhi_epi64(a[2 * j], a[2 * j + 1]));
    const __m512i t = _mm512_add_epi32(_mm512_shuffle_i32x4(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                       _mm512_shuffle_i32x4(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
    /* lanes: blocks 0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15 */
    return _mm512_permutexvar_epi32(_mm512_set_epi32(15, 11, 14, 10, 13, 9, 12, 8, 7, 3, 6, 2, 5, 1, 4, 0), t);
}

/* 16 blocks at a time: the weights of four 4-block steps, the dot products through sums_x16, and
 * each block's fp32 product in a lane of prod[t] (the same operations as generic.c's, lane by lane),
 * which the caller adds to the accumulator block after block. */
static inline __attribute__((always_inline)) void b32_x16(const uint8_t *blk, const void *const *xs, int T,
                                                          int64_t b, int kind, __m512 *prod) {
    const int bytes = b32_bytes(kind), has_min = kind == F_Q4_1 || kind == F_Q5_1;
    const int at = kind == F_Q4_1 ? 4 : kind == F_Q5_0 ? 6 : kind == F_Q5_1 ? 8 : 2;
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    __m512i u[8];
    for (int g = 0; g < 4; g++) {
        const uint8_t *q = blk + 4 * g * bytes;
        nibbles_x4(q, bytes, at, kind == F_IQ4_NL ? IQ4NL_UNSIGNED : NULL, u + 2 * g);
        if (kind == F_Q5_0 || kind == F_Q5_1) {
            const int qh = kind == F_Q5_0 ? 2 : 4;
            u[2 * g] = _mm512_or_si512(u[2 * g], fifth_bits_x2(q + qh, bytes));
            u[2 * g + 1] = _mm512_or_si512(u[2 * g + 1], fifth_bits_x2(q + 2 * bytes + qh, bytes));
        }
    }
    /* each block's first 4 bytes: d, then m (q4_1, q5_1) */
    const __m512i dm = _mm512_i32gather_epi32(_mm512_mullo_epi32(lane, _mm512_set1_epi32(bytes)), (const void *)blk, 1);
    const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(dm));
    const __m512 m = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(dm, 16)));
    const __m512i ystep = _mm512_mullo_epi32(lane, _mm512_set1_epi32((int)sizeof(q8a_t)));
    for (int t = 0; t < T; t++) {
        const q8a_t *y = (const q8a_t *)xs[t] + b;
        __m512i p[8];
        for (int j = 0; j < 8; j++) {
            const __m512i x = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)y[2 * j].qs)),
                                                 _mm256_loadu_si256((const __m256i *)y[2 * j + 1].qs), 1);
            p[j] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u[j], x);
        }
        __m512i dot = sums_x16(p);
        const __m512 yd = _mm512_i32gather_ps(ystep, (const void *)&y->d, 1);
        const __m512i ysum = _mm512_i32gather_epi32(ystep, (const void *)&y->sum, 1);
        if (kind == F_Q5_0) dot = _mm512_sub_epi32(dot, _mm512_slli_epi32(ysum, 4));
        if (kind == F_IQ4_NL) dot = _mm512_sub_epi32(dot, _mm512_slli_epi32(ysum, 7));
        prod[t] = _mm512_mul_ps(_mm512_mul_ps(d, yd), _mm512_cvtepi32_ps(dot));
        if (has_min) prod[t] = _mm512_add_ps(prod[t], _mm512_mul_ps(_mm512_mul_ps(m, yd), _mm512_cvtepi32_ps(ysum)));
    }
}

/* Blocks b .. nb - 1 of a row, added to acc: 4 blocks a step, then avx2_iq4.c's step. */
static inline __attribute__((always_inline)) void b32_rest(const uint8_t *row, const void *const *xs, int T,
                                                           int64_t b, int64_t nb, int kind, float *acc) {
    const int bytes = b32_bytes(kind), has_min = kind == F_Q4_1 || kind == F_Q5_1;
    const int offset = kind == F_Q5_0 ? 16 : kind == F_IQ4_NL ? 128 : 0;
    const int at = kind == F_Q4_1 ? 4 : kind == F_Q5_0 ? 6 : kind == F_Q5_1 ? 8 : 2;
    const int64_t nb4 = nb / 4 * 4;
    for (; b < nb4; b += 4) {
        const uint8_t *blk = row + b * bytes;
        prefetch_ahead(blk, 4 * bytes);
        __m512i u[2];
        nibbles_x4(blk, bytes, at, kind == F_IQ4_NL ? IQ4NL_UNSIGNED : NULL, u);
        if (kind == F_Q5_0 || kind == F_Q5_1) {
            const int qh = kind == F_Q5_0 ? 2 : 4;
            u[0] = _mm512_or_si512(u[0], fifth_bits_x2(blk + qh, bytes));
            u[1] = _mm512_or_si512(u[1], fifth_bits_x2(blk + 2 * bytes + qh, bytes));
        }
        float d[4], m[4] = {0};
        for (int i = 0; i < 4; i++) {
            d[i] = f16_at(blk + i * bytes);
            if (has_min) m[i] = f16_at(blk + i * bytes + 2);
        }
        for (int t = 0; t < T; t++) {
            const q8a_t *y = (const q8a_t *)xs[t] + b;
            __m512i x[2];
            for (int h = 0; h < 2; h++)
                x[h] = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)y[2 * h].qs)),
                                          _mm256_loadu_si256((const __m256i *)y[2 * h + 1].qs), 1);
            int32_t dot[4];
            sums_x4(_mm512_dpbusd_epi32(_mm512_setzero_si512(), u[0], x[0]),
                    _mm512_dpbusd_epi32(_mm512_setzero_si512(), u[1], x[1]), dot);
            for (int i = 0; i < 4; i++) {
                const float p = (d[i] * y[i].d) * (float)(dot[i] - offset * y[i].sum);
                if (has_min) acc[t] += p + (m[i] * y[i].d) * (float)y[i].sum;
                else acc[t] += p;
            }
        }
    }
    for (; b < nb; b++) { /* avx2_iq4.c's step */
        float d, m = 0;
        const __m256i wv = b32_codes(row + b * bytes, kind, &d, &m);
        for (int t = 0; t < T; t++) {
            const q8a_t *y = (const q8a_t *)xs[t] + b;
            const __m256i x = _mm256_loadu_si256((const __m256i *)y->qs);
            const int32_t dot = hsum_i32(dot32(wv, x, kind == F_IQ4_NL)) - (kind == F_Q5_0 ? 16 : 0) * y->sum;
            if (has_min) acc[t] += (d * y->d) * (float)dot + (m * y->d) * (float)y->sum;
            else acc[t] += (d * y->d) * (float)dot;
        }
    }
}

/* Decode (T == 1) takes two rows at a time: the fp32 sums of the two rows are independent chains, one
 * add per block each, which then overlap. */
static inline __attribute__((always_inline)) void b32_body(ROWS_ARGS, int kind) {
    const int bytes = b32_bytes(kind);
    const int64_t nb = n / 32;
    for (int64_t r = r0; r < r1; r += T == 1 ? 2 : 1) {
        const int two = T == 1 && r + 1 < r1;
        const uint8_t *row = w + r * rb, *row2 = row + rb;
        float acc[MAX_T] = {0}, acc2 = 0;
        int64_t b = 0;
        for (; b + 16 <= nb; b += 16) {
            __m512 prod[MAX_T], prod2;
            float pv[16], pv2[16];
            b32_x16(row + b * bytes, xs, T, b, kind, prod);
            if (two) {
                b32_x16(row2 + b * bytes, xs, 1, b, kind, &prod2);
                _mm512_storeu_ps(pv2, prod2);
            }
            for (int t = 0; t < T; t++) {
                _mm512_storeu_ps(pv, prod[t]);
                for (int i = 0; i < 16; i++) {
                    acc[t] += pv[i];
                    if (two) acc2 += pv2[i];
                }
            }
        }
        b32_rest(row, xs, T, b, nb, kind, acc);
        for (int t = 0; t < T; t++) ys[t][r] = acc[t];
        if (two) {
            b32_rest(row2, xs, 1, b, nb, kind, &acc2);
            ys[0][r + 1] = acc2;
        }
    }
}

static inline __attribute__((always_inline)) void iq4_xs_body(ROWS_ARGS) {
    const __m512i pair = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(1), 1); /* 0 | 1 */
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w + r * rb;
        float acc[MAX_T] = {0};
        for (int64_t b = 0; b < n / 256; b++) {
            const uint8_t *blk = row + b * 136;
            prefetch_ahead(blk, 136);
            const float d = f16_at(blk);
            const __m512i scv = _mm512_castsi128_si512(_mm256_cvtepi32_epi16(iq4_xs_scales(blk))); /* int16 */
            __m512i q[4], qa[4], sc[4];
            __mmask64 neg[4];
            for (int h = 0; h < 2; h++) /* sub-blocks 4h .. 4h + 3: 16 bytes each, contiguous */
                nibbles_x4(blk + 8 + 64 * h, 16, 0, (const uint8_t *)KVALUES_IQ4NL, q + 2 * h);
            for (int c = 0; c < 4; c++) {
                qa[c] = _mm512_abs_epi8(q[c]);
                neg[c] = _mm512_movepi8_mask(q[c]);
                sc[c] = _mm512_permutexvar_epi16(_mm512_add_epi16(pair, _mm512_set1_epi16((short)(2 * c))), scv);
            }
            for (int t = 0; t < T; t++) {
                const q8k_t *y = (const q8k_t *)xs[t] + b;
                __m512i s = _mm512_setzero_si512();
                for (int c = 0; c < 4; c++) {
                    __m512i x = _mm512_loadu_si512((const void *)(y->qs + 64 * c));
                    x = _mm512_mask_sub_epi8(x, neg[c], _mm512_setzero_si512(), x);
                    s = _mm512_dpwssd_epi32(s, _mm512_maddubs_epi16(qa[c], x), sc[c]);
                }
                acc[t] += (y->d * d) * (float)_mm512_reduce_add_epi32(s);
            }
        }
        for (int t = 0; t < T; t++) ys[t][r] = acc[t];
    }
}

/* Exact mode, 32-element blocks: d * q (+ m), as generic.c's rows_b_exact, then acc += v * x (a
 * multiply, then an add) in its 16 lanes, the block's two halves in order, summed by sum16_tree. */
static inline __attribute__((always_inline)) void b32_exact_body(ROWS_ARGS, int kind) {
    const int bytes = b32_bytes(kind), has_min = kind == F_Q4_1 || kind == F_Q5_1;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w + r * rb;
        __m512 acc[MAX_T];
        for (int t = 0; t < T; t++) acc[t] = _mm512_setzero_ps();
        for (int64_t b = 0; b < n / 32; b++) {
            float d, m = 0;
            prefetch_ahead(row + b * bytes, bytes);
            __m256i q = b32_codes(row + b * bytes, kind, &d, &m);
            if (kind == F_Q5_0) q = _mm256_sub_epi8(q, _mm256_set1_epi8(16));
            __m512 v[2];
            for (int h = 0; h < 2; h++) {
                const __m128i q16 = h ? _mm256_extracti128_si256(q, 1) : _mm256_castsi256_si128(q);
                v[h] = _mm512_mul_ps(_mm512_set1_ps(d), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q16)));
                if (has_min) v[h] = _mm512_add_ps(v[h], _mm512_set1_ps(m));
            }
            for (int t = 0; t < T; t++) {
                const float *x = (const float *)xs[t] + 32 * b;
                acc[t] = _mm512_add_ps(acc[t], _mm512_mul_ps(v[0], _mm512_loadu_ps(x)));
                acc[t] = _mm512_add_ps(acc[t], _mm512_mul_ps(v[1], _mm512_loadu_ps(x + 16)));
            }
        }
        for (int t = 0; t < T; t++) ys[t][r] = sum16_zmm(acc[t]);
    }
}

/* Exact mode, IQ4_XS: (d * sc) * q per 16 elements, as generic.c's rows_k_exact. */
static inline __attribute__((always_inline)) void iq4_xs_exact_body(ROWS_ARGS) {
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w + r * rb;
        __m512 acc[MAX_T];
        for (int t = 0; t < T; t++) acc[t] = _mm512_setzero_ps();
        for (int64_t b = 0; b < n / 256; b++) {
            const uint8_t *blk = row + b * 136;
            prefetch_ahead(blk, 136);
            const float d = f16_at(blk);
            int32_t ls[8];
            _mm256_storeu_si256((__m256i *)ls, iq4_xs_scales(blk));
            __m512i pairs[4];
            for (int h = 0; h < 2; h++) nibbles_x4(blk + 8 + 64 * h, 16, 0, (const uint8_t *)KVALUES_IQ4NL, pairs + 2 * h);
            int8_t q[256];
            for (int c = 0; c < 4; c++) _mm512_storeu_si512((void *)(q + 64 * c), pairs[c]);
            for (int ib = 0; ib < 8; ib++) {
                const __m512 step = _mm512_set1_ps(d * (float)ls[ib]);
                for (int h = 0; h < 2; h++) {
                    const __m128i q16 = _mm_loadu_si128((const __m128i *)(q + 32 * ib + 16 * h));
                    const __m512 v = _mm512_mul_ps(step, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q16)));
                    for (int t = 0; t < T; t++) {
                        const float *x = (const float *)xs[t] + 256 * b + 32 * ib + 16 * h;
                        acc[t] = _mm512_add_ps(acc[t], _mm512_mul_ps(v, _mm512_loadu_ps(x)));
                    }
                }
            }
        }
        for (int t = 0; t < T; t++) ys[t][r] = sum16_zmm(acc[t]);
    }
}

#define Q41E_CALL(TT) b32_exact_body(w, rb, r0, r1, n, xs, TT, ys, F_Q4_1)
#define Q50E_CALL(TT) b32_exact_body(w, rb, r0, r1, n, xs, TT, ys, F_Q5_0)
#define Q51E_CALL(TT) b32_exact_body(w, rb, r0, r1, n, xs, TT, ys, F_Q5_1)
#define IQ4NLE_CALL(TT) b32_exact_body(w, rb, r0, r1, n, xs, TT, ys, F_IQ4_NL)
#define IQ4XSE_CALL(TT) iq4_xs_exact_body(w, rb, r0, r1, n, xs, TT, ys)
static void q4_1_exact(ROWS_ARGS) { ONE_OR_T(Q41E_CALL); }
static void q5_0_exact(ROWS_ARGS) { ONE_OR_T(Q50E_CALL); }
static void q5_1_exact(ROWS_ARGS) { ONE_OR_T(Q51E_CALL); }
static void iq4_nl_exact(ROWS_ARGS) { ONE_OR_T(IQ4NLE_CALL); }
static void iq4_xs_exact(ROWS_ARGS) { ONE_OR_T(IQ4XSE_CALL); }

#define Q41_CALL(TT) b32_body(w, rb, r0, r1, n, xs, TT, ys, F_Q4_1)
#define Q50_CALL(TT) b32_body(w, rb, r0, r1, n, xs, TT, ys, F_Q5_0)
#define Q51_CALL(TT) b32_body(w, rb, r0, r1, n, xs, TT, ys, F_Q5_1)
#define IQ4NL_CALL(TT) b32_body(w, rb, r0, r1, n, xs, TT, ys, F_IQ4_NL)
#define IQ4XS_CALL(TT) iq4_xs_body(w, rb, r0, r1, n, xs, TT, ys)
static void q4_1_int(ROWS_ARGS) { ONE_OR_T(Q41_CALL); }
static void q5_0_int(ROWS_ARGS) { ONE_OR_T(Q50_CALL); }
static void q5_1_int(ROWS_ARGS) { ONE_OR_T(Q51_CALL); }
static void iq4_nl_int(ROWS_ARGS) { ONE_OR_T(IQ4NL_CALL); }
static void iq4_xs_int(ROWS_ARGS) { ONE_OR_T(IQ4XS_CALL); }

void init_avx512_iq4(void) {
    for (int i = 0; i < 16; i++) IQ4NL_UNSIGNED[i] = (uint8_t)(KVALUES_IQ4NL[i] + 128);
    FMT[F_Q4_1].integer = q4_1_int, FMT[F_Q4_1].exact = q4_1_exact;
    FMT[F_Q5_0].integer = q5_0_int, FMT[F_Q5_0].exact = q5_0_exact;
    FMT[F_Q5_1].integer = q5_1_int, FMT[F_Q5_1].exact = q5_1_exact;
    FMT[F_IQ4_NL].integer = iq4_nl_int, FMT[F_IQ4_NL].exact = iq4_nl_exact;
    FMT[F_IQ4_XS].integer = iq4_xs_int, FMT[F_IQ4_XS].exact = iq4_xs_exact;
}
#else
void init_avx512_iq4(void) {}
#endif
