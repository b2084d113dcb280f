/* AVX2 integer-mode kernels of q4_1, q5_0, q5_1, iq4_nl (x q8_0) and iq4_xs (x q8_K), used by the
 * avx2 and avx512 variants. Each computes generic.c's integer mode bit for bit: the same exact int32
 * sums (however they are added up) and the same fp32 steps in the same order, per block
 * acc += (d * yd) * dot (+ (m * yd) * sum with a min), per IQ4_XS super-block acc += (yd * d) * S,
 * S = sum of sc * dot over its sub-blocks. The products as ggml-cpu's AVX2 vec_dot functions: u8 x s8
 * pairs (vpmaddubsw), unsigned codes where the format has them (the offset of q5_0 through the
 * activation block's sum), IQ4's signed values as |w| times x with w's sign. */
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
                acc[t] += (d * y->d) * (float)dot;
                if (has_min) acc[t] += (m * y->d) * (float)y->sum;
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
            const uint16_t high = rd16(blk + 2);
            __m256i q[8], sc[8];
            for (int ib = 0; ib < 8; ib++) {
                q[ib] = iq4_values(blk + 8 + 16 * ib);
                const int ls = ((blk[4 + ib / 2] >> (4 * (ib % 2))) & 0xF) | ((high >> (2 * ib)) & 3) << 4;
                sc[ib] = _mm256_set1_epi16((short)(ls - 32));
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
    FMT[F_Q4_1].integer = q4_1_int;
    FMT[F_Q5_0].integer = q5_0_int;
    FMT[F_Q5_1].integer = q5_1_int;
    FMT[F_IQ4_NL].integer = iq4_nl_int;
    FMT[F_IQ4_XS].integer = iq4_xs_int;
}
#else
void init_avx2_iq4(void) {}
#endif
