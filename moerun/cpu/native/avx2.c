/* AVX2 kernels (AVX2 + FMA + F16C). Integer mode: q4_k, q6_k x q8_K; q8_0, q4_0, mxfp4 (both nibble
 * orders) x q8_0. As ggml-cpu's AVX2 vec_dot functions: u8 x s8 products (vpmaddubsw), scales applied
 * in int32 (vpmaddwd), one fp32 multiply-add per block. Dense f32 / f16 / bf16 rows: generic.c's
 * rows_float, operation for operation, in blocks of rows x tokens. Unaligned loads only; the order
 * of every sum depends only on the row. (The avx512 variant replaces these where it has its own.) */
#include "common.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

#define ROWS_ARGS                                                                                      \
    const uint8_t *w, size_t rb, int64_t r0, int64_t r1, int64_t n, const void *const *xs, int T,      \
        float *const *ys
#define ONE_OR_T(call) \
    do { if (T == 1) { call(1); } else { call(T); } } while (0)

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline float hsum4(__m128 s) {
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Q4_K's 6-bit scales (bytes 0-7) and mins (8-15), built in registers. */
static inline __m128i k4_sm(const uint8_t *p) {
    uint32_t u[3];
    memcpy(u, p, 12);
    const uint32_t m1 = 0x3f3f3f3f, m2 = 0x0f0f0f0f, m3 = 0x03030303;
    return _mm_set_epi32((int)(((u[2] >> 4) & m2) | (((u[1] >> 6) & m3) << 4)), (int)(u[1] & m1),
                         (int)((u[2] & m2) | (((u[0] >> 6) & m3) << 4)), (int)(u[0] & m1));
}

static inline __attribute__((always_inline)) void q4_k_body(ROWS_ARGS) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w + r * rb;
        __m256 acc[MAX_T];
        __m128 accm[MAX_T];
        for (int t = 0; t < T; t++) acc[t] = _mm256_setzero_ps(), accm[t] = _mm_setzero_ps();
        for (int64_t b = 0; b < n / 256; b++) {
            const uint8_t *blk = row + b * 144;
            prefetch_ahead(blk, 144);
            const float d = f16_at(blk), dmin = f16_at(blk + 2);
            const __m128i sm = k4_sm(blk + 4);
            const __m128i mins = _mm_cvtepu8_epi16(_mm_srli_si128(sm, 8));
            uint8_t scb[16];
            _mm_storeu_si128((__m128i *)scb, sm);
            __m256i q[8], s16[8];
            for (int c = 0; c < 4; c++) {
                __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 16 + 32 * c));
                q[2 * c] = _mm256_and_si256(v, m4);
                q[2 * c + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
            }
            for (int s = 0; s < 8; s++) s16[s] = _mm256_set1_epi16(scb[s]);
            for (int t = 0; t < T; t++) {
                const q8k_t *y = (const q8k_t *)xs[t] + b;
                __m256i si = _mm256_setzero_si256();
                for (int s = 0; s < 8; s++) {
                    __m256i p = _mm256_maddubs_epi16(q[s], _mm256_loadu_si256((const __m256i *)(y->qs + 32 * s)));
                    si = _mm256_add_epi32(si, _mm256_madd_epi16(p, s16[s]));
                }
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(si), _mm256_set1_ps(y->d * d), acc[t]);
                const __m128i bs = _mm_hadd_epi16(_mm_loadu_si128((const __m128i *)y->bsums),
                                                  _mm_loadu_si128((const __m128i *)(y->bsums + 8)));
                accm[t] = _mm_fmadd_ps(_mm_cvtepi32_ps(_mm_madd_epi16(mins, bs)), _mm_set1_ps(y->d * dmin), accm[t]);
            }
        }
        for (int t = 0; t < T; t++) ys[t][r] = hsum8(acc[t]) - hsum4(accm[t]);
    }
}

static inline __attribute__((always_inline)) void q6_k_body(ROWS_ARGS) {
    const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(0x03);
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w + r * rb;
        __m256 acc[MAX_T];
        for (int t = 0; t < T; t++) acc[t] = _mm256_setzero_ps();
        for (int64_t b = 0; b < n / 256; b++) {
            const uint8_t *blk = row + b * 210;
            prefetch_ahead(blk, 210);
            const float d = f16_at(blk + 208);
            const int8_t *sc = (const int8_t *)(blk + 192);
            const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)sc));
            __m256i q[8], s16[8];
            for (int h = 0; h < 2; h++) {
                __m256i L0 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h));
                __m256i L1 = _mm256_loadu_si256((const __m256i *)(blk + 64 * h + 32));
                __m256i Q = _mm256_loadu_si256((const __m256i *)(blk + 128 + 32 * h));
                q[4 * h + 0] = _mm256_or_si256(_mm256_and_si256(L0, m4), _mm256_slli_epi16(_mm256_and_si256(Q, m2), 4));
                q[4 * h + 1] = _mm256_or_si256(_mm256_and_si256(L1, m4),
                                               _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(Q, 2), m2), 4));
                q[4 * h + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(L0, 4), m4),
                                               _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(Q, 4), m2), 4));
                q[4 * h + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(L1, 4), m4),
                                               _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(Q, 6), m2), 4));
            }
            for (int c = 0; c < 8; c++) /* 32 elements: groups 2c (low 128 bits) and 2c + 1 */
                s16[c] = _mm256_set_m128i(_mm_set1_epi16(sc[2 * c + 1]), _mm_set1_epi16(sc[2 * c]));
            for (int t = 0; t < T; t++) {
                const q8k_t *y = (const q8k_t *)xs[t] + b;
                __m256i si = _mm256_setzero_si256();
                for (int c = 0; c < 8; c++) {
                    __m256i p = _mm256_maddubs_epi16(q[c], _mm256_loadu_si256((const __m256i *)(y->qs + 32 * c)));
                    si = _mm256_add_epi32(si, _mm256_madd_epi16(p, s16[c]));
                }
                __m256i corr = _mm256_madd_epi16(sc16, _mm256_loadu_si256((const __m256i *)y->bsums));
                si = _mm256_sub_epi32(si, _mm256_slli_epi32(corr, 5));
                acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(si), _mm256_set1_ps(y->d * d), acc[t]);
            }
        }
        for (int t = 0; t < T; t++) ys[t][r] = hsum8(acc[t]);
    }
}

#include "b32_avx2.h"

/* Blocks alternate between two accumulators (two dependency chains). */
static inline __attribute__((always_inline)) void b32_body(ROWS_ARGS, int kind) {
    const int bytes = kind == F_Q8_0 ? 34 : kind == F_Q4_0 ? 18 : 17;
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w + r * rb;
        __m256 acc[2][MAX_T];
        for (int t = 0; t < T; t++) acc[0][t] = acc[1][t] = _mm256_setzero_ps();
        for (int64_t b = 0; b < n / 32; b++) {
            float d;
            prefetch_ahead(row + b * bytes, (int)bytes);
            __m256i wv = b32_weights(row + b * bytes, kind, &d);
            __m256i wa = kind == F_Q4_0 ? wv : _mm256_sign_epi8(wv, wv);
            for (int t = 0; t < T; t++) {
                const q8a_t *y = (const q8a_t *)xs[t] + b;
                __m256i xv = _mm256_loadu_si256((const __m256i *)y->qs);
                if (kind != F_Q4_0) xv = _mm256_sign_epi8(xv, wv);
                __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(wa, xv), ones);
                if (kind == F_Q4_0) p = _mm256_sub_epi32(p, _mm256_zextsi128_si256(_mm_cvtsi32_si128(8 * y->sum)));
                acc[b & 1][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d * y->d), acc[b & 1][t]);
            }
        }
        for (int t = 0; t < T; t++) ys[t][r] = hsum8(_mm256_add_ps(acc[0][t], acc[1][t]));
    }
}

/* Dense float rows, as generic.c's rows_float computes them: per token 16 fp32 lanes, lane l taking
 * elements 16k + l (k in order) as a multiply then an add, the n % 16 tail into lanes 0, 1, .. in
 * order, then sum16's halving tree (8 + 8, 4 + 4, 2 + 2, 1 + 1). Here the lanes are two ymm (0-7,
 * 8-15) and a block of R rows x G tokens keeps its 2 R G of them in registers (2 R G + R + 1 <= 16):
 * each weight vector is loaded once for the G tokens, each x vector once for the R rows. */
static inline __m256 load8(const uint8_t *row, int64_t j, int kind) {
    if (kind == F_F32) return _mm256_loadu_ps((const float *)row + j);
    __m128i h = _mm_loadu_si128((const __m128i *)(row + 2 * j));
    if (kind == F_F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
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

static inline __attribute__((always_inline)) void float_block(const uint8_t *row, size_t rb, int64_t r,
                                                              int64_t n, const void *const *xs,
                                                              float *const *ys, int R, int G, int kind) {
    __m256 acc[2][2][3]; /* [lanes 0-7 / 8-15][row][token] */
    for (int h = 0; h < 2; h++)
        for (int i = 0; i < R; i++)
            for (int t = 0; t < G; t++) acc[h][i][t] = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 16 <= n; j += 16)
        for (int h = 0; h < 2; h++) {
            __m256 v[2];
            for (int i = 0; i < R; i++) v[i] = load8(row + i * rb, j + 8 * h, kind);
            for (int t = 0; t < G; t++) {
                __m256 x = _mm256_loadu_ps((const float *)xs[t] + j + 8 * h);
                __asm__("" : "+x"(x)); /* one load for the R rows, not a memory operand per multiply */
                for (int i = 0; i < R; i++) acc[h][i][t] = _mm256_add_ps(acc[h][i][t], _mm256_mul_ps(v[i], x));
            }
        }
    for (int i = 0; i < R; i++)
        for (int t = 0; t < G; t++) {
            __m256 lo = acc[0][i][t], hi = acc[1][i][t];
            if (j < n) { /* the tail, lane by lane */
                float a[16];
                _mm256_storeu_ps(a, lo);
                _mm256_storeu_ps(a + 8, hi);
                for (int l = 0; j + l < n; l++) a[l] += load1(row + i * rb, j + l, kind) * ((const float *)xs[t])[j + l];
                lo = _mm256_loadu_ps(a);
                hi = _mm256_loadu_ps(a + 8);
            }
            const __m256 s8 = _mm256_add_ps(lo, hi);
            const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
            const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
            ys[t][r + i] = _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
        }
}

/* R rows x all T tokens, in groups of 3 (4 tokens as 2 + 2). */
static inline __attribute__((always_inline)) void float_tokens(const uint8_t *row, size_t rb, int64_t r,
                                                               int64_t n, const void *const *xs, int T,
                                                               float *const *ys, int R, int kind) {
    for (int t = 0; t < T;) {
        const int left = T - t, g = left <= 3 ? left : left == 4 ? 2 : 3;
        if (g == 3) float_block(row, rb, r, n, xs + t, ys + t, R, 3, kind);
        else if (g == 2) float_block(row, rb, r, n, xs + t, ys + t, R, 2, kind);
        else float_block(row, rb, r, n, xs + t, ys + t, R, 1, kind);
        t += g;
    }
}

/* Blocks of 2 rows, the last one alone; one token row by row (one stream of weights, which the
 * hardware prefetcher follows: blocks of 4 rows read cold weights ~20% slower). */
static inline __attribute__((always_inline)) void float_rows(ROWS_ARGS, int kind) {
    int64_t r = r0;
    if (T > 1)
        for (; r + 2 <= r1; r += 2) float_tokens(w + r * rb, rb, r, n, xs, T, ys, 2, kind);
    for (; r < r1; r++) float_tokens(w + r * rb, rb, r, n, xs, T, ys, 1, kind);
}

#define Q4K_CALL(TT) q4_k_body(w, rb, r0, r1, n, xs, TT, ys)
#define Q6K_CALL(TT) q6_k_body(w, rb, r0, r1, n, xs, TT, ys)
#define Q80_CALL(TT) b32_body(w, rb, r0, r1, n, xs, TT, ys, F_Q8_0)
#define Q40_CALL(TT) b32_body(w, rb, r0, r1, n, xs, TT, ys, F_Q4_0)
#define MX_CALL(TT) b32_body(w, rb, r0, r1, n, xs, TT, ys, F_MXFP4)
#define MXO_CALL(TT) b32_body(w, rb, r0, r1, n, xs, TT, ys, F_MXFP4_OSS)
static void f32_rows(ROWS_ARGS) { float_rows(w, rb, r0, r1, n, xs, T, ys, F_F32); }
static void f16_rows(ROWS_ARGS) { float_rows(w, rb, r0, r1, n, xs, T, ys, F_F16); }
static void bf16_rows(ROWS_ARGS) { float_rows(w, rb, r0, r1, n, xs, T, ys, F_BF16); }
static void q4_k_int(ROWS_ARGS) { ONE_OR_T(Q4K_CALL); }
static void q6_k_int(ROWS_ARGS) { ONE_OR_T(Q6K_CALL); }
static void q8_0_int(ROWS_ARGS) { ONE_OR_T(Q80_CALL); }
static void q4_0_int(ROWS_ARGS) { ONE_OR_T(Q40_CALL); }
static void mxfp4_int(ROWS_ARGS) { ONE_OR_T(MX_CALL); }
static void mxfp4_oss_int(ROWS_ARGS) { ONE_OR_T(MXO_CALL); }

void init_avx2(void) {
    FMT[F_F32].exact = FMT[F_F32].integer = f32_rows;
    FMT[F_F16].exact = FMT[F_F16].integer = f16_rows;
    FMT[F_BF16].exact = FMT[F_BF16].integer = bf16_rows;
    FMT[F_Q4_K].integer = q4_k_int;
    FMT[F_Q6_K].integer = q6_k_int;
    FMT[F_Q8_0].integer = q8_0_int;
    FMT[F_Q4_0].integer = q4_0_int;
    FMT[F_MXFP4].integer = mxfp4_int;
    FMT[F_MXFP4_OSS].integer = mxfp4_oss_int;
}
#else
void init_avx2(void) {}
#endif
