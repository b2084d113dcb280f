/* AVX-512 prefill GEMM for q6_k x q8_K (integer mode), by avx512.h's Q6_K contract.
 *
 * The row kernel reaches each sub-block sum through a transpose-add per token; here both sides are
 * transposed once instead (q6k_transpose): the weights when a row's block is decoded (once per 4
 * rows and token chunk), the activations in gemm_prep (once per call). Then each (row, token) block
 * is four chained vpdpbusd started at the activations' -32 * bsums, one conversion and one fp32
 * multiply-add, with 4 rows decoded once against the tokens 4 at a time. */
#include "avx512.h"
#include "gemm.h"

#ifdef MOERUN_AVX512
#define GR 4 /* rows per micro-kernel */
#define GT GEMM_TOKENS

typedef struct {
    __m512i q[4]; /* the transposed weights */
    __m512 dsc;   /* d * sc_g in lane order */
} q6dec_t;

typedef struct {
    __m512i q[4]; /* the transposed activations */
    __m512i off;  /* -32 * bsums_g in lane order */
} q6x_t;          /* [Tp][nb], then the scales yd [Tp][nb] */

static int64_t padded(int64_t T) { return (T + GT - 1) / GT * GT; }

static size_t q6_size(int fmt, int64_t T, int64_t n) {
    (void)fmt;
    return (size_t)(padded(T) * (n / 256)) * (sizeof(q6x_t) + sizeof(float));
}

static void q6_prep(int fmt, const void *xq, int64_t g, int64_t T, int64_t n, void *xl) {
    (void)fmt;
    const int64_t nb = n / 256, Tp = padded(T);
    q6x_t *x = xl;
    float *yd = (float *)(x + Tp * nb);
    for (int i = 0; i < GT; i++) {
        const int64_t t = GT * g + i;
        for (int64_t b = 0; b < nb; b++) {
            q6x_t *o = x + t * nb + b;
            if (t >= T) {
                memset(o, 0, sizeof *o);
                yd[t * nb + b] = 0;
                continue;
            }
            const q8k_t *y = (const q8k_t *)xq + t * nb + b;
            __m512i c[4];
            for (int k = 0; k < 4; k++) c[k] = _mm512_loadu_si512((const void *)(y->qs + 64 * k));
            q6k_transpose(c, o->q);
            o->off = q6k_offsets(y->bsums);
            yd[t * nb + b] = y->d;
        }
    }
}

/* Rows r .. r + nr - 1 (nr <= GR; D holds GR decoded rows per block, the missing ones zero) times
 * tokens 4g .. 4g + 3, written where t < T. */
static void q6_tile(const q6dec_t *D, int64_t nb, const q6x_t *x, const float *yd, int64_t g, int64_t T, int nr,
                    float *y, int64_t ys) {
    __m512 acc[GR][GT];
    for (int i = 0; i < GR; i++)
        for (int t = 0; t < GT; t++) acc[i][t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const q6dec_t *W = D + b * GR;
        for (int t = 0; t < GT; t++) {
            const q6x_t *X = x + (GT * g + t) * nb + b;
            const __m512 ydv = _mm512_set1_ps(yd[(GT * g + t) * nb + b]);
            __m512i s[GR];
            for (int i = 0; i < GR; i++) s[i] = X->off;
            for (int k = 0; k < 4; k++) {
                const __m512i xv = _mm512_load_si512((const void *)&X->q[k]);
                for (int i = 0; i < GR; i++) s[i] = _mm512_dpbusd_epi32(s[i], W[i].q[k], xv);
            }
            for (int i = 0; i < GR; i++)
                acc[i][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[i]), _mm512_mul_ps(W[i].dsc, ydv), acc[i][t]);
        }
    }
    for (int i = 0; i < nr; i++)
        for (int t = 0; t < GT && GT * g + t < T; t++) y[(GT * g + t) * ys + i] = _mm512_reduce_add_ps(acc[i][t]);
}

/* Tokens in chunks whose activations stay in L2 (each chunk re-decodes the rows). */
static int64_t token_chunk(int64_t nb) {
    int64_t c = (512 * 1024 / (nb * (int64_t)(sizeof(q6x_t) + sizeof(float)))) / GT * GT;
    return c < GT ? GT : c;
}

static size_t q6_work(int fmt, int64_t n) {
    (void)fmt;
    return (size_t)(n / 256 * GR) * sizeof(q6dec_t);
}

static void q6_run(int fmt, const uint8_t *w, size_t rb, int64_t r0, int64_t r1, int64_t n, const void *xl,
                   int64_t T, float *y, int64_t ys, void *work) {
    (void)fmt;
    const int64_t nb = n / 256, Tp = padded(T);
    const q6x_t *x = xl;
    const float *yd = (const float *)(x + Tp * nb);
    q6dec_t *D = work; /* [blocks][GR] */
    const int64_t groups = Tp / GT, chunk = token_chunk(nb) / GT;
    for (int64_t g0 = 0; g0 < groups; g0 += chunk) {
        const int64_t g1 = g0 + chunk < groups ? g0 + chunk : groups;
        for (int64_t r = r0; r < r1; r += GR) {
            const int nr = (int)(r1 - r < GR ? r1 - r : GR);
            for (int64_t b = 0; b < nb; b++)
                for (int i = 0; i < GR; i++) {
                    q6dec_t *o = D + b * GR + i;
                    if (i >= nr) {
                        memset(o, 0, sizeof *o);
                        continue;
                    }
                    const uint8_t *blk = w + (r + i) * rb + b * 210;
                    __m512i q[4];
                    q6k_weights(blk, q);
                    q6k_transpose(q, o->q);
                    o->dsc = q6k_scales(blk);
                }
            for (int64_t g = g0; g < g1; g++) q6_tile(D, nb, x, yd, g, T, nr, y + r, ys);
        }
    }
}

void init_gemm_q6k_avx512(void) { GEMM[F_Q6_K] = (gemm_ops){2, q6_size, q6_prep, q6_work, q6_run}; }
#else
void init_gemm_q6k_avx512(void) {}
#endif
