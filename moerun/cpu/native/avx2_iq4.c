/* AVX2 kernels of q4_1, q5_0, q5_1, iq4_nl (integer mode: x q8_0) and iq4_xs (x q8_K), exact mode and
 * integer mode. Each computes generic.c's bits: in integer mode the same exact int32 sums (however
 * they are added up) and the same fp32 steps in the same order, per block
 * acc += (d * yd) * dot (with a min: + (m * yd) * sum, added to it first), per IQ4_XS super-block
 * acc += (yd * d) * S, S = sum of sc * dot over its sub-blocks. The products as ggml-cpu's AVX2
 * vec_dot functions: u8 x s8 pairs (vpmaddubsw), unsigned codes where the format has them (the
 * offset of q5_0 through the activation block's sum), IQ4's signed values as |w| times x with w's
 * sign. */
#include "common.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

#include "iq4_avx2.h"

#define ROWS_ARGS                                                                                      \
    const uint8_t *w, size_t rb, int64_t r0, int64_t r1, int64_t n, const void *const *xs, int T,      \
        float *const *ys
#define ONE_OR_T(call) \
    do { if (T == 1) { call(1); } else { call(T); } } while (0)

static inline __attribute__((always_inline)) void b32_body(ROWS_ARGS, int kind) {
    const int bytes = b32_bytes(kind), has_min = kind == F_Q4_1 || kind == F_Q5_1, is_signed = kind == F_IQ4_NL;
    const int offset = kind == F_Q5_0 ? 16 : 0;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w + r * rb;
        float acc[MAX_T] = {0};
        for (int64_t b = 0; b < n / 32; b++) {
            float d, m = 0;
            const __m256i wv = b32_codes(row + b * bytes, kind, &d, &m);
            for (int t = 0; t < T; t++) {
                const q8a_t *y = (const q8a_t *)xs[t] + b;
                const __m256i x = _mm256_loadu_si256((const __m256i *)y->qs);
                const int32_t dot = hsum_i32(dot32(wv, x, is_signed)) - offset * y->sum;
                if (has_min) acc[t] += (d * y->d) * (float)dot + (m * y->d) * (float)y->sum;
                else acc[t] += (d * y->d) * (float)dot;
            }
        }
        for (int t = 0; t < T; t++) ys[t][r] = acc[t];
    }
}

/* IQ4_XS: 8 sub-blocks of 32 (16 bytes of nibbles each), 6-bit scales ls - 32. */
static inline __attribute__((always_inline)) void iq4_xs_body(ROWS_ARGS) {
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w + r * rb;
        float acc[MAX_T] = {0};
        for (int64_t b = 0; b < n / 256; b++) {
            const uint8_t *blk = row + b * 136;
            const float d = f16_at(blk);
            int32_t ls[8];
            _mm256_storeu_si256((__m256i *)ls, iq4_xs_scales(blk));
            __m256i q[8], sc[8];
            for (int ib = 0; ib < 8; ib++) {
                q[ib] = iq4_values(blk + 8 + 16 * ib);
                sc[ib] = _mm256_set1_epi16((short)ls[ib]);
            }
            for (int t = 0; t < T; t++) {
                const q8k_t *y = (const q8k_t *)xs[t] + b;
                __m256i s = _mm256_setzero_si256();
                for (int ib = 0; ib < 8; ib++) {
                    const __m256i x = _mm256_loadu_si256((const __m256i *)(y->qs + 32 * ib));
                    const __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(q[ib], q[ib]), _mm256_sign_epi8(x, q[ib]));
                    s = _mm256_add_epi32(s, _mm256_madd_epi16(p, sc[ib]));
                }
                acc[t] += (y->d * d) * (float)hsum_i32(s);
            }
        }
        for (int t = 0; t < T; t++) ys[t][r] = acc[t];
    }
}

/* Exact mode: generic.c's values (d * q (+ m); IQ4_XS (d * sc) * q per 16) multiplied by x and added
 * (not fused) into its 16 lanes (two ymm), chunk after chunk, then its sum16_tree. */
static inline __m256 values8(__m128i q8, float d) { /* 8 int8 (low half of q8) times d */
    return _mm256_mul_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8)));
}

static inline void lanes_add(__m256 *lo, __m256 *hi, __m256 v0, __m256 v1, const float *x) {
    *lo = _mm256_add_ps(*lo, _mm256_mul_ps(v0, _mm256_loadu_ps(x)));
    *hi = _mm256_add_ps(*hi, _mm256_mul_ps(v1, _mm256_loadu_ps(x + 8)));
}

static inline float lanes_sum(__m256 lo, __m256 hi) {
    float a[16];
    _mm256_storeu_ps(a, lo);
    _mm256_storeu_ps(a + 8, hi);
    return sum16_tree(a);
}

static inline __attribute__((always_inline)) void b32_exact_body(ROWS_ARGS, int kind) {
    const int bytes = b32_bytes(kind), has_min = kind == F_Q4_1 || kind == F_Q5_1;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w + r * rb;
        __m256 lo[MAX_T], hi[MAX_T];
        for (int t = 0; t < T; t++) lo[t] = hi[t] = _mm256_setzero_ps();
        for (int64_t b = 0; b < n / 32; b++) {
            float d, m = 0;
            __m256i q = b32_codes(row + b * bytes, kind, &d, &m);
            if (kind == F_Q5_0) q = _mm256_sub_epi8(q, _mm256_set1_epi8(16));
            const __m128i q0 = _mm256_castsi256_si128(q), q1 = _mm256_extracti128_si256(q, 1);
            __m256 v[4] = {values8(q0, d), values8(_mm_srli_si128(q0, 8), d), values8(q1, d),
                           values8(_mm_srli_si128(q1, 8), d)};
            if (has_min)
                for (int i = 0; i < 4; i++) v[i] = _mm256_add_ps(v[i], _mm256_set1_ps(m));
            for (int t = 0; t < T; t++) {
                const float *x = (const float *)xs[t] + 32 * b;
                lanes_add(&lo[t], &hi[t], v[0], v[1], x);
                lanes_add(&lo[t], &hi[t], v[2], v[3], x + 16);
            }
        }
        for (int t = 0; t < T; t++) ys[t][r] = lanes_sum(lo[t], hi[t]);
    }
}

static inline __attribute__((always_inline)) void iq4_xs_exact_body(ROWS_ARGS) {
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w + r * rb;
        __m256 lo[MAX_T], hi[MAX_T];
        for (int t = 0; t < T; t++) lo[t] = hi[t] = _mm256_setzero_ps();
        for (int64_t b = 0; b < n / 256; b++) {
            const uint8_t *blk = row + b * 136;
            const float d = f16_at(blk);
            int32_t ls[8];
            _mm256_storeu_si256((__m256i *)ls, iq4_xs_scales(blk));
            for (int ib = 0; ib < 8; ib++) {
                const float step = d * (float)ls[ib];
                const __m256i q = iq4_values(blk + 8 + 16 * ib);
                const __m128i q0 = _mm256_castsi256_si128(q), q1 = _mm256_extracti128_si256(q, 1);
                const __m256 v[4] = {values8(q0, step), values8(_mm_srli_si128(q0, 8), step), values8(q1, step),
                                     values8(_mm_srli_si128(q1, 8), step)};
                for (int t = 0; t < T; t++) {
                    const float *x = (const float *)xs[t] + 256 * b + 32 * ib;
                    lanes_add(&lo[t], &hi[t], v[0], v[1], x);
                    lanes_add(&lo[t], &hi[t], v[2], v[3], x + 16);
                }
            }
        }
        for (int t = 0; t < T; t++) ys[t][r] = lanes_sum(lo[t], hi[t]);
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

void init_avx2_iq4(void) {
    FMT[F_Q4_1].integer = q4_1_int, FMT[F_Q4_1].exact = q4_1_exact;
    FMT[F_Q5_0].integer = q5_0_int, FMT[F_Q5_0].exact = q5_0_exact;
    FMT[F_Q5_1].integer = q5_1_int, FMT[F_Q5_1].exact = q5_1_exact;
    FMT[F_IQ4_NL].integer = iq4_nl_int, FMT[F_IQ4_NL].exact = iq4_nl_exact;
    FMT[F_IQ4_XS].integer = iq4_xs_int, FMT[F_IQ4_XS].exact = iq4_xs_exact;
}
#else
void init_avx2_iq4(void) {}
#endif
