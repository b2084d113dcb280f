/* AVX-512 exact-mode kernels: fp32 activations; q8_0, q4_0, mxfp4, q4_k and q6_k blocks decoded
 * with dequant.py's float operations (no fused multiply-add in the decode), dense f32 / f16 / bf16
 * rows; fp32 multiply-adds in 16 lanes whose order depends only on the row. */
#include "avx512.h"

#ifdef MOERUN_AVX512
/* Exact mode for 32-element blocks: each block's values d * q (one fp32 product, as dequant.py),
 * multiply-added into 16 lanes. */
static inline __attribute__((always_inline)) void b32_exact(ROWS_ARGS, int kind) {
    const int bytes = kind == F_Q8_0 ? 34 : kind == F_Q4_0 ? 18 : 17;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w + r * rb;
        __m512 acc[MAX_T];
        for (int t = 0; t < T; t++) acc[t] = _mm512_setzero_ps();
        for (int64_t b = 0; b < n / 32; b++) {
            float d;
            prefetch_ahead(row + b * bytes, bytes);
            __m256i q = b32_weights(row + b * bytes, kind, &d);
            if (kind == F_Q4_0) q = _mm256_sub_epi8(q, _mm256_set1_epi8(8));
            const __m512 dv = _mm512_set1_ps(d);
            __m512 v0 = _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q))));
            __m512 v1 = _mm512_mul_ps(dv, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1))));
            for (int t = 0; t < T; t++) {
                const float *x = (const float *)xs[t] + 32 * b;
                acc[t] = _mm512_fmadd_ps(v0, _mm512_loadu_ps(x), acc[t]);
                acc[t] = _mm512_fmadd_ps(v1, _mm512_loadu_ps(x + 16), acc[t]);
            }
        }
        for (int t = 0; t < T; t++) ys[t][r] = _mm512_reduce_add_ps(acc[t]);
    }
}

/* Exact mode, Q4_K: (d * sc) * q - dmin * mn per element, as dequant.py, then multiply-adds. */
static inline __attribute__((always_inline)) void q4_k_exact_body(ROWS_ARGS) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    const __m512i shift = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w + r * rb;
        __m512 acc[MAX_T];
        for (int t = 0; t < T; t++) acc[t] = _mm512_setzero_ps();
        for (int64_t b = 0; b < n / 256; b++) {
            const uint8_t *blk = row + b * 144;
            prefetch_ahead(blk, 144);
            const float d = f16_at(blk), dmin = f16_at(blk + 2);
            uint8_t sm[16];
            _mm_storeu_si128((__m128i *)sm, k4_scales_mins(blk + 4));
            for (int c = 0; c < 4; c++) {
                __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * c)));
                __m512i q = _mm512_and_si512(_mm512_srlv_epi16(v, shift), m4);
                for (int quarter = 0; quarter < 4; quarter++) { /* 16 elements of sub-block 2c + quarter / 2 */
                    int s = 2 * c + quarter / 2;
                    __m512 step = _mm512_set1_ps(d * (float)sm[s]), offv = _mm512_set1_ps(dmin * (float)sm[8 + s]);
                    __m128i q16 = _mm512_extracti32x4_epi32(q, 0);
                    if (quarter == 1) q16 = _mm512_extracti32x4_epi32(q, 1);
                    if (quarter == 2) q16 = _mm512_extracti32x4_epi32(q, 2);
                    if (quarter == 3) q16 = _mm512_extracti32x4_epi32(q, 3);
                    __m512 val = _mm512_sub_ps(_mm512_mul_ps(step, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(q16))), offv);
                    for (int t = 0; t < T; t++) {
                        const float *x = (const float *)xs[t] + 256 * b + 64 * c + 16 * quarter;
                        acc[t] = _mm512_fmadd_ps(val, _mm512_loadu_ps(x), acc[t]);
                    }
                }
            }
        }
        for (int t = 0; t < T; t++) ys[t][r] = _mm512_reduce_add_ps(acc[t]);
    }
}

/* Exact mode, Q6_K: (d * sc) * (q - 32) per element, as dequant.py, then multiply-adds. */
static inline __attribute__((always_inline)) void q6_k_exact_body(ROWS_ARGS) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), m2 = _mm512_set1_epi8(0x03), k32 = _mm512_set1_epi8(32);
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w + r * rb;
        __m512 acc[MAX_T];
        for (int t = 0; t < T; t++) acc[t] = _mm512_setzero_ps();
        for (int64_t b = 0; b < n / 256; b++) {
            const uint8_t *blk = row + b * 210;
            prefetch_ahead(blk, 210);
            const float d = f16_at(blk + 208);
            const int8_t *sc = (const int8_t *)(blk + 192);
            for (int h = 0; h < 2; h++) {
                __m512i L = _mm512_loadu_si512((const void *)(blk + 64 * h));
                __m256i Q = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
                __m512i Q2 = _mm512_inserti64x4(_mm512_castsi256_si512(Q), _mm256_srli_epi16(Q, 2), 1);
                __m512i qa = _mm512_or_si512(_mm512_and_si512(L, m4), _mm512_slli_epi16(_mm512_and_si512(Q2, m2), 4));
                __m512i qb = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(L, 4), m4),
                                             _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(Q2, 4), m2), 4));
                for (int half = 0; half < 2; half++) {
                    __m512i q = _mm512_sub_epi8(half ? qb : qa, k32); /* elements 128h + 64 half .. + 63 */
                    for (int quarter = 0; quarter < 4; quarter++) {
                        int g = 8 * h + 4 * half + quarter;
                        __m128i q16 = quarter == 0   ? _mm512_extracti32x4_epi32(q, 0)
                                      : quarter == 1 ? _mm512_extracti32x4_epi32(q, 1)
                                      : quarter == 2 ? _mm512_extracti32x4_epi32(q, 2)
                                                     : _mm512_extracti32x4_epi32(q, 3);
                        __m512 val = _mm512_mul_ps(_mm512_set1_ps(d * (float)sc[g]),
                                                   _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q16)));
                        for (int t = 0; t < T; t++) {
                            const float *x = (const float *)xs[t] + 256 * b + 16 * g;
                            acc[t] = _mm512_fmadd_ps(val, _mm512_loadu_ps(x), acc[t]);
                        }
                    }
                }
            }
        }
        for (int t = 0; t < T; t++) ys[t][r] = _mm512_reduce_add_ps(acc[t]);
    }
}

/* Dense float rows, exact mode. Each (row, token) sums in 16 lanes with two accumulators, a0 taking
 * elements 32k .. 32k + 15 and a1 32k + 16 .. 32k + 31 (k in order), the n % 32 tail in order as
 * scalars, then y = reduce(a0 + a1) + tail: the same operations whatever T and however rows and
 * tokens are grouped below. */
static inline __m512 load16(const uint8_t *row, int64_t j, int kind) {
    if (kind == F_F32) return _mm512_loadu_ps((const float *)row + j);
    __m256i h = _mm256_loadu_si256((const __m256i *)(row + 2 * j));
    if (kind == F_F16) return _mm512_cvtph_ps(h);
    /* bf16: word k to the top half of lane k, zeros below (one vpermw, not a widen and a shift) */
    const __m512i to_top = _mm512_set_epi16(15, 0, 14, 0, 13, 0, 12, 0, 11, 0, 10, 0, 9, 0, 8, 0, 7, 0, 6, 0,
                                            5, 0, 4, 0, 3, 0, 2, 0, 1, 0, 0, 0);
    return _mm512_castsi512_ps(_mm512_maskz_permutexvar_epi16(0xAAAAAAAA, to_top, _mm512_castsi256_si512(h)));
}

static inline float load1(const uint8_t *row, int64_t j, int kind) {
    float v;
    if (kind == F_F32) memcpy(&v, row + 4 * j, 4);
    else if (kind == F_F16) v = f16_to_f32(rd16(row + 2 * j));
    else {
        uint32_t bits = (uint32_t)rd16(row + 2 * j) << 16;
        memcpy(&v, &bits, 4);
    }
    return v;
}

/* R rows from `row` (rb bytes apart) x G tokens (R, G <= 4, 2 R G + R + 1 <= 32 zmm): 2 R G
 * accumulators in registers; per 16 elements each weight vector is loaded (and widened) once for the
 * G tokens, each x vector once for the R rows. Meanwhile the rows at `next` are prefetched into L2,
 * as far along as this block's. */
static inline __attribute__((always_inline)) void float_block(const uint8_t *row, size_t rb, int64_t r,
                                                              int64_t n, const void *const *xs,
                                                              float *const *ys, const uint8_t *next, int R,
                                                              int G, int kind) {
    const int es = kind == F_F32 ? 4 : 2;
    __m512 acc[2][4][4]; /* [even / odd 16 elements][row][token] */
    for (int h = 0; h < 2; h++)
        for (int i = 0; i < R; i++)
            for (int t = 0; t < G; t++) acc[h][i][t] = _mm512_setzero_ps();
    int64_t j = 0;
    for (; j + 32 <= n; j += 32) {
        for (int i = 0; i < R; i++)
            for (int b = 0; b < 32 * es; b += 64) _mm_prefetch((const char *)next + i * rb + j * es + b, _MM_HINT_T1);
        for (int h = 0; h < 2; h++) {
            __m512 v[4];
            for (int i = 0; i < R; i++) v[i] = load16(row + i * rb, j + 16 * h, kind);
            for (int t = 0; t < G; t++) {
                __m512 x = _mm512_loadu_ps((const float *)xs[t] + j + 16 * h);
                __asm__("" : "+v"(x)); /* one load for the R rows, not a memory operand per multiply-add */
                for (int i = 0; i < R; i++) acc[h][i][t] = _mm512_fmadd_ps(v[i], x, acc[h][i][t]);
            }
        }
    }
    for (int i = 0; i < R; i++)
        for (int t = 0; t < G; t++) {
            float tail = 0;
            for (int64_t k = j; k < n; k++) tail += load1(row + i * rb, k, kind) * ((const float *)xs[t])[k];
            ys[t][r + i] = _mm512_reduce_add_ps(_mm512_add_ps(acc[0][i][t], acc[1][i][t])) + tail;
        }
}

/* Tokens in the next group of at most G, `left` to go: never a lone token unless T is 1 (with G = 3,
 * 4 goes as 2 + 2; with G = 4, 5 as 3 + 2). */
static inline int token_group(int left, int G) {
    if (left <= G) return left;
    return G == 3 && left == 4 ? 2 : G == 4 && left == 5 ? 3 : G;
}

/* R rows x all T tokens, group by group: the rows stay in L1 meanwhile, and the first group
 * prefetches the next block's rows. */
static inline __attribute__((always_inline)) void float_tokens(const uint8_t *row, size_t rb, int64_t r,
                                                               int64_t n, const void *const *xs, int T,
                                                               float *const *ys, const uint8_t *next, int R,
                                                               int G, int kind) {
    for (int t = 0; t < T;) {
        const int g = token_group(T - t, G);
        if (g == 4) float_block(row, rb, r, n, xs + t, ys + t, next, R, 4, kind);
        else if (g == 3) float_block(row, rb, r, n, xs + t, ys + t, next, R, 3, kind);
        else if (g == 2) float_block(row, rb, r, n, xs + t, ys + t, next, R, 2, kind);
        else float_block(row, rb, r, n, xs + t, ys + t, next, R, 1, kind);
        next = row; /* (lines in L1 already: cheap) */
        t += g;
    }
}

/* Blocks of R rows (the last (r1 - r0) % R one by one), each times every token. */
static inline __attribute__((always_inline)) void float_rows_rg(ROWS_ARGS, int R, int G, int kind) {
    int64_t r = r0;
    for (; r + R <= r1; r += R) {
        const uint8_t *next = w + (r + 2 * R <= r1 ? r + R : r) * rb;
        float_tokens(w + r * rb, rb, r, n, xs, T, ys, next, R, G, kind);
    }
    for (; r < r1; r++) float_tokens(w + r * rb, rb, r, n, xs, T, ys, w + r * rb, 1, G, kind);
}

/* A multiple of 4 tokens: blocks of 3 rows x 4 tokens; else 4 rows x 3 tokens (a last 4 as 2 + 2,
 * one token as 4 x 1). Either way 12 multiply-adds per 7 vector loads. */
static inline __attribute__((always_inline)) void float_rows(ROWS_ARGS, int kind) {
    if (T % 4 == 0) float_rows_rg(w, rb, r0, r1, n, xs, T, ys, 3, 4, kind);
    else float_rows_rg(w, rb, r0, r1, n, xs, T, ys, 4, 3, kind);
}

#define F32_CALL(TT) float_rows(w, rb, r0, r1, n, xs, TT, ys, F_F32)
#define F16_CALL(TT) float_rows(w, rb, r0, r1, n, xs, TT, ys, F_F16)
#define BF16_CALL(TT) float_rows(w, rb, r0, r1, n, xs, TT, ys, F_BF16)
#define Q80E_CALL(TT) b32_exact(w, rb, r0, r1, n, xs, TT, ys, F_Q8_0)
#define Q40E_CALL(TT) b32_exact(w, rb, r0, r1, n, xs, TT, ys, F_Q4_0)
#define MXE_CALL(TT) b32_exact(w, rb, r0, r1, n, xs, TT, ys, F_MXFP4)
#define MXOE_CALL(TT) b32_exact(w, rb, r0, r1, n, xs, TT, ys, F_MXFP4_OSS)
#define Q4KE_CALL(TT) q4_k_exact_body(w, rb, r0, r1, n, xs, TT, ys)
#define Q6KE_CALL(TT) q6_k_exact_body(w, rb, r0, r1, n, xs, TT, ys)
static void f32_rows(ROWS_ARGS) { F32_CALL(T); }
static void f16_rows(ROWS_ARGS) { F16_CALL(T); }
static void bf16_rows(ROWS_ARGS) { BF16_CALL(T); }
static void q8_0_exact(ROWS_ARGS) { ONE_OR_T(Q80E_CALL); }
static void q4_0_exact(ROWS_ARGS) { ONE_OR_T(Q40E_CALL); }
static void mxfp4_exact(ROWS_ARGS) { ONE_OR_T(MXE_CALL); }
static void mxfp4_oss_exact(ROWS_ARGS) { ONE_OR_T(MXOE_CALL); }
static void q4_k_exact(ROWS_ARGS) { ONE_OR_T(Q4KE_CALL); }
static void q6_k_exact(ROWS_ARGS) { ONE_OR_T(Q6KE_CALL); }

void init_avx512_exact(void) {
    FMT[F_F32].exact = FMT[F_F32].integer = f32_rows;
    FMT[F_F16].exact = FMT[F_F16].integer = f16_rows;
    FMT[F_BF16].exact = FMT[F_BF16].integer = bf16_rows;
    FMT[F_Q8_0].exact = q8_0_exact;
    FMT[F_Q4_0].exact = q4_0_exact;
    FMT[F_MXFP4].exact = mxfp4_exact;
    FMT[F_MXFP4_OSS].exact = mxfp4_oss_exact;
    FMT[F_Q4_K].exact = q4_k_exact;
    FMT[F_Q6_K].exact = q6_k_exact;
}
#endif
