/* AVX2 integer-mode kernels (AVX2 + FMA + F16C): q4_k, q6_k x q8_K; q8_0, q4_0, mxfp4 (both nibble
 * orders) x q8_0. As ggml-cpu's AVX2 vec_dot functions: u8 x s8 products (vpmaddubsw), scales applied
 * in int32 (vpmaddwd), one fp32 multiply-add per block. Unaligned loads only; the order of every
 * sum depends only on the row. (The avx512 variant replaces these where it has its own.) */
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

#define Q4K_CALL(TT) q4_k_body(w, rb, r0, r1, n, xs, TT, ys)
#define Q6K_CALL(TT) q6_k_body(w, rb, r0, r1, n, xs, TT, ys)
#define Q80_CALL(TT) b32_body(w, rb, r0, r1, n, xs, TT, ys, F_Q8_0)
#define Q40_CALL(TT) b32_body(w, rb, r0, r1, n, xs, TT, ys, F_Q4_0)
#define MX_CALL(TT) b32_body(w, rb, r0, r1, n, xs, TT, ys, F_MXFP4)
#define MXO_CALL(TT) b32_body(w, rb, r0, r1, n, xs, TT, ys, F_MXFP4_OSS)
static void q4_k_int(ROWS_ARGS) { ONE_OR_T(Q4K_CALL); }
static void q6_k_int(ROWS_ARGS) { ONE_OR_T(Q6K_CALL); }
static void q8_0_int(ROWS_ARGS) { ONE_OR_T(Q80_CALL); }
static void q4_0_int(ROWS_ARGS) { ONE_OR_T(Q40_CALL); }
static void mxfp4_int(ROWS_ARGS) { ONE_OR_T(MX_CALL); }
static void mxfp4_oss_int(ROWS_ARGS) { ONE_OR_T(MXO_CALL); }

void init_avx2(void) {
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
