/* AVX-512 prefill GEMM for the 32-element blocks q8_0, q4_0, mxfp4 (both nibble orders) x q8_0.
 *
 * The integer matvec (avx512.c) takes blocks in "units" of one zmm, two blocks (or one, the upper
 * half zero): q8_0 pairs (0, 1), (2, 3), .. into one accumulator (b32_int); q4_0 and mxfp4 groups of
 * four blocks, pairs alternating between two accumulators, then the n / 32 % 4 leftover blocks one
 * per unit into the first (b32x4_int). Per unit and output: 16 exact int32 lanes p (vpdpbusd), then
 * acc += float(p) * (d * yd). The GEMM walks the same units in the same order. Signed weights
 * (q8_0, mxfp4) meet activations offset to unsigned (x + 128) with the accumulator started at
 * -128 * (the lane's 4 weights): the same exact lane sums as the matvec's sign trick, one
 * instruction fewer per output. */
#include "avx512.h"
#include "gemm.h"

#ifdef MOERUN_AVX512
#define GT GEMM_TOKENS

typedef struct {
    __m512i w, init; /* weights (q4_0: unsigned codes); vpdpbusd's starting lanes */
    __m512 dw;       /* the blocks' scales, 8 lanes each */
} bdec_t;

typedef struct {
    __m512i xs;  /* the two blocks' int8 activations */
    __m512 dy;   /* their scales, 8 lanes each */
    __m512i off; /* q4_0: 8 * each block's sum of qs, in lanes 0 and 8 */
} bx_t;          /* [Tp][units] */

static int x4_kind(int fmt) { return fmt != F_Q8_0; }
static int block_bytes(int fmt) { return fmt == F_Q8_0 ? 34 : fmt == F_Q4_0 ? 18 : 17; }

/* How many units a row of nb blocks takes, and unit u's blocks (b1 = -1: none). */
static int64_t unit_count(int fmt, int64_t nb) { return x4_kind(fmt) ? nb / 4 * 2 + nb % 4 : (nb + 1) / 2; }
static void unit_blocks(int fmt, int64_t nb, int64_t u, int64_t *b0, int64_t *b1) {
    const int64_t pairs = x4_kind(fmt) ? nb / 4 * 2 : nb / 2;
    if (u < pairs) {
        *b0 = 2 * u, *b1 = 2 * u + 1;
    } else {
        *b0 = 2 * pairs + (u - pairs), *b1 = -1; /* q8_0: the odd last block; else n / 32 % 4 singles */
    }
}

static int64_t padded(int64_t T) { return (T + GT - 1) / GT * GT; }

static size_t b32_size(int fmt, int64_t T, int64_t n) {
    return (size_t)(padded(T) * unit_count(fmt, n / 32)) * sizeof(bx_t);
}

static void b32_prep(int fmt, const void *xq, int64_t g, int64_t T, int64_t n, void *xl) {
    const int64_t nb = n / 32, nu = unit_count(fmt, nb);
    bx_t *x = xl;
    const q8a_t zero = {0};
    for (int i = 0; i < GT; i++) {
        const int64_t t = GT * g + i;
        for (int64_t u = 0; u < nu; u++) {
            int64_t b0, b1;
            unit_blocks(fmt, nb, u, &b0, &b1);
            const q8a_t *y0 = t < T ? (const q8a_t *)xq + t * nb + b0 : &zero;
            const q8a_t *y1 = t < T && b1 >= 0 ? (const q8a_t *)xq + t * nb + b1 : &zero;
            bx_t *o = x + t * nu + u;
            o->xs = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)y0->qs)),
                                       _mm256_loadu_si256((const __m256i *)y1->qs), 1);
            o->dy = _mm512_insertf32x8(_mm512_set1_ps(y0->d), _mm256_set1_ps(y1->d), 1);
            o->off = _mm512_mask_set1_epi32(_mm512_maskz_set1_epi32(0x0001, 8 * y0->sum), 0x0100, 8 * y1->sum);
        }
    }
}

static void b32_decode(int fmt, const uint8_t *row, int64_t nb, int64_t u, bdec_t *o) {
    int64_t b0, b1;
    unit_blocks(fmt, nb, u, &b0, &b1);
    const int bytes = block_bytes(fmt);
    float d0, d1 = 0;
    __m256i w0 = b32_weights(row + b0 * bytes, fmt, &d0);
    __m256i w1 = b1 >= 0 ? b32_weights(row + b1 * bytes, fmt, &d1) : _mm256_setzero_si256();
    o->w = _mm512_inserti64x4(_mm512_castsi256_si512(w0), w1, 1);
    o->dw = _mm512_insertf32x8(_mm512_set1_ps(d0), _mm256_set1_ps(d1), 1);
    o->init = _mm512_setzero_si512();
    if (fmt != F_Q4_0) /* -128 * (sum of the lane's 4 weights): cancels the +128 on the activations */
        o->init = _mm512_sub_epi32(o->init, _mm512_dpbusd_epi32(o->init, _mm512_set1_epi8((char)0x80), o->w));
}

/* acc[i][t] += one unit's products, for R rows and GT tokens. */
static inline __attribute__((always_inline)) void b32_unit(int q4, int R, const bdec_t *W, const bx_t *x,
                                                           int64_t nu, __m512 acc[][GT]) {
    __m512i xv[GT];
    __m512 dy[GT];
    for (int t = 0; t < GT; t++) {
        xv[t] = x[t * nu].xs;
        if (!q4) xv[t] = _mm512_xor_si512(xv[t], _mm512_set1_epi8((char)0x80));
        dy[t] = x[t * nu].dy;
    }
    for (int i = 0; i < R; i++)
        for (int t = 0; t < GT; t++) {
            __m512i p = q4 ? _mm512_sub_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), W[i].w, xv[t]), x[t * nu].off)
                           : _mm512_dpbusd_epi32(W[i].init, xv[t], W[i].w);
            acc[i][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_mul_ps(W[i].dw, dy[t]), acc[i][t]);
        }
}

/* R decoded rows (D: [units][R]) times tokens 4g .. 4g + 3; rows i < nr, tokens < T written. */
static inline __attribute__((always_inline)) void b32_tile(int fmt, int R, const bdec_t *D, int64_t nb,
                                                           const bx_t *xl, int64_t g, int64_t T, int nr,
                                                           float *y, int64_t ys) {
    const int64_t nu = unit_count(fmt, nb), pairs = x4_kind(fmt) ? nb / 4 * 2 : 0;
    const int q4 = fmt == F_Q4_0;
    const bx_t *x = xl + GT * g * nu;
    __m512 acc[4][GT], acc2[4][GT];
    for (int i = 0; i < R; i++)
        for (int t = 0; t < GT; t++) acc[i][t] = acc2[i][t] = _mm512_setzero_ps();
    int64_t u = 0;
    for (; u < pairs; u += 2) { /* q4_0 / mxfp4: blocks 0-1 into acc, 2-3 into acc2 */
        b32_unit(q4, R, D + u * R, x + u, nu, acc);
        b32_unit(q4, R, D + (u + 1) * R, x + u + 1, nu, acc2);
    }
    for (; u < nu; u++) b32_unit(q4, R, D + u * R, x + u, nu, acc);
    for (int i = 0; i < nr; i++)
        for (int t = 0; t < GT && GT * g + t < T; t++)
            y[(GT * g + t) * ys + i] = _mm512_reduce_add_ps(pairs ? _mm512_add_ps(acc[i][t], acc2[i][t]) : acc[i][t]);
}

static int rows_at_once(int fmt) { return x4_kind(fmt) ? 2 : 4; } /* two accumulators per output: half the rows */

static size_t b32_work(int fmt, int64_t n) {
    return (size_t)(unit_count(fmt, n / 32) * rows_at_once(fmt)) * sizeof(bdec_t);
}

static void b32_run(int fmt, const uint8_t *w, size_t rb, int64_t r0, int64_t r1, int64_t n, const void *xl,
                    int64_t T, float *y, int64_t ys, void *work) {
    const int R = rows_at_once(fmt);
    const int64_t nb = n / 32, nu = unit_count(fmt, nb);
    bdec_t *D = work; /* [units][R] */
    const int64_t groups = padded(T) / GT;
    int64_t chunk = (512 * 1024 / (int64_t)(nu * sizeof(bx_t) * GT));
    chunk = chunk < 1 ? 1 : chunk;
    for (int64_t g0 = 0; g0 < groups; g0 += chunk) {
        const int64_t g1 = g0 + chunk < groups ? g0 + chunk : groups;
        for (int64_t r = r0; r < r1; r += R) {
            const int nr = (int)(r1 - r < R ? r1 - r : R);
            for (int64_t u = 0; u < nu; u++)
                for (int i = 0; i < R; i++) {
                    if (i < nr) b32_decode(fmt, w + (r + i) * rb, nb, u, D + u * R + i);
                    else memset(D + u * R + i, 0, sizeof(bdec_t));
                }
            for (int64_t g = g0; g < g1; g++) {
                if (fmt == F_Q8_0) b32_tile(F_Q8_0, 4, D, nb, xl, g, T, nr, y + r, ys);
                else if (fmt == F_Q4_0) b32_tile(F_Q4_0, 2, D, nb, xl, g, T, nr, y + r, ys);
                else b32_tile(fmt, 2, D, nb, xl, g, T, nr, y + r, ys);
            }
        }
    }
}

void init_gemm_b32_avx512(void) {
    GEMM[F_Q8_0] = (gemm_ops){4, b32_size, b32_prep, b32_work, b32_run};
    GEMM[F_Q4_0] = (gemm_ops){8, b32_size, b32_prep, b32_work, b32_run};
    GEMM[F_MXFP4] = (gemm_ops){8, b32_size, b32_prep, b32_work, b32_run};
    GEMM[F_MXFP4_OSS] = (gemm_ops){8, b32_size, b32_prep, b32_work, b32_run};
}
#else
void init_gemm_b32_avx512(void) {}
#endif
