/* AVX-512 prefill GEMM for the k-quants q4_k, q5_k x q8_K (integer mode; q6_k: gemm_q6k_avx512.c).
 *
 * The integer matvec (avx512.c) computes, per output (row r, token t) and super-block b, 16 int32
 * lanes s (vpmaddubsw + vpdpwssd over four 64-element chunks, lane j holding elements 4j .. 4j + 3
 * of each chunk times their sub-block scale), then acc += float(s) * (yd * d) in 16 fp32 lanes, and
 * a 4-lane mins accumulator; the output is reduce(acc) - hsum(mins). Integer sums
 * are exact, so any instruction sequence giving the same lane values gives the same s; the fp32
 * steps are repeated here in the same order. What changes is the blocking: 4 rows are decoded
 * once (into the vectors the matvec builds in registers) and run against the tokens 4 at a time,
 * so each decoded chunk feeds 4 tokens and each activation chunk 4 rows. */
#include "avx512.h"
#include "gemm.h"

#ifdef MOERUN_AVX512
#define GR 4 /* rows per micro-kernel */
#define GT GEMM_TOKENS

/* One row's super-block as the matvec holds it: the u8 chunks, the per-lane int16 scales, and its
 * 8 mins repeated in each 128-bit lane (vpmaddwd against 4 tokens' pairwise bsums at once). */
typedef struct {
    __m512i q[4], s16[4], mins;
} kdec_t;

/* The activation layout of T tokens (Tp: T rounded up to GT), each part 64-byte aligned. */
typedef struct {
    int8_t *qs;     /* [Tp][nb][256] */
    __m512i *bs8;   /* [Tp / GT][nb]: per token its 8 pairwise bsums sums, a 128-bit lane each */
    float *yd;      /* [Tp / GT][nb][GT] */
    __m512 *ydv;    /* [Tp / GT][nb]: each token's d in its 4 lanes */
} kx_t;

static int64_t padded(int64_t T) { return (T + GT - 1) / GT * GT; }

static kx_t kx_layout(void *base, int64_t T, int64_t nb) {
    const int64_t Tp = padded(T);
    char *p = base;
    kx_t x;
    x.qs = (int8_t *)p, p += Tp * nb * 256;
    x.bs8 = (__m512i *)p, p += Tp / GT * nb * 64;
    x.ydv = (__m512 *)p, p += Tp / GT * nb * 64;
    x.yd = (float *)p;
    return x;
}

static size_t kq_size(int fmt, int64_t T, int64_t n) {
    (void)fmt;
    const int64_t Tp = padded(T), nb = n / 256;
    return (size_t)(Tp * nb * 256 + Tp / GT * nb * (64 + 64) + Tp * nb * 4);
}

static void kq_prep(int fmt, const void *xq, int64_t g, int64_t T, int64_t n, void *xl) {
    (void)fmt;
    const int64_t nb = n / 256;
    kx_t x = kx_layout(xl, T, nb);
    for (int64_t b = 0; b < nb; b++) {
        __m128i bs8[GT];
        float d[GT];
        for (int i = 0; i < GT; i++) {
            const int64_t t = GT * g + i;
            int8_t *qs = x.qs + (t * nb + b) * 256;
            if (t >= T) {
                memset(qs, 0, 256);
                bs8[i] = _mm_setzero_si128();
                d[i] = 0;
                continue;
            }
            const q8k_t *y = (const q8k_t *)xq + t * nb + b;
            memcpy(qs, y->qs, 256);
            const __m256i bs = _mm256_loadu_si256((const __m256i *)y->bsums);
            bs8[i] = _mm_hadd_epi16(_mm256_castsi256_si128(bs), _mm256_extracti128_si256(bs, 1));
            d[i] = y->d;
        }
        __m512i v = _mm512_castsi128_si512(bs8[0]);
        v = _mm512_inserti32x4(v, bs8[1], 1);
        v = _mm512_inserti32x4(v, bs8[2], 2);
        x.bs8[g * nb + b] = _mm512_inserti32x4(v, bs8[3], 3);
        x.ydv[g * nb + b] = _mm512_set_ps(d[3], d[3], d[3], d[3], d[2], d[2], d[2], d[2], d[1], d[1], d[1],
                                          d[1], d[0], d[0], d[0], d[0]);
        memcpy(x.yd + (g * nb + b) * GT, d, sizeof d);
    }
}

/* One super-block of one row, decoded as q45_k_body decodes it. */
static inline void kq_decode(int fmt, const uint8_t *blk, kdec_t *o, float *d, float *dmin) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    const int five = fmt == F_Q5_K;
    const __m512i shift = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
    const __m512i idx_lo = _mm512_inserti64x4(_mm512_set1_epi16(0), _mm256_set1_epi16(1), 1);
    const uint8_t *qs = blk + (five ? 48 : 16);
    *d = f16_at(blk);
    *dmin = f16_at(blk + 2);
    const __m128i scmn = k4_scales_mins(blk + 4);
    const __m512i scv = _mm512_castsi256_si512(_mm256_cvtepu8_epi16(scmn));
    for (int c = 0; c < 4; c++) {
        __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(qs + 32 * c)));
        o->q[c] = _mm512_and_si512(_mm512_srlv_epi16(v, shift), m4);
        if (five) {
            __m512i hv = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(blk + 16)));
            __m512i hs = _mm512_add_epi16(idx_lo, _mm512_set1_epi16(2 * c));
            __m512i bit = _mm512_and_si512(_mm512_srlv_epi16(hv, hs), _mm512_set1_epi8(1));
            o->q[c] = _mm512_or_si512(o->q[c], _mm512_slli_epi16(bit, 4));
        }
        o->s16[c] = _mm512_permutexvar_epi16(_mm512_add_epi16(idx_lo, _mm512_set1_epi16(2 * c)), scv);
    }
    o->mins = _mm512_broadcast_i32x4(_mm_cvtepu8_epi16(_mm_srli_si128(scmn, 8)));
}

/* Rows r .. r + nr - 1 (nr <= GR; D holds GR decoded rows per block, the missing ones zero) times
 * tokens 4g .. 4g + 3, written where t < T. */
static inline __attribute__((always_inline)) void kq_tile(const kdec_t *D, const float *dd,
                                                          const float *dm, int64_t nb, const kx_t *x,
                                                          int64_t g, int64_t T, int nr, float *y,
                                                          int64_t ys) {
    __m512 acc[GR][GT], accm[GR];
    for (int i = 0; i < GR; i++) {
        accm[i] = _mm512_setzero_ps();
        for (int t = 0; t < GT; t++) acc[i][t] = _mm512_setzero_ps();
    }
    const int8_t *xq = x->qs + GT * g * nb * 256;
    for (int64_t b = 0; b < nb; b++) {
        const kdec_t *W = D + b * GR;
        __m512i s[GR][GT];
        for (int i = 0; i < GR; i++)
            for (int t = 0; t < GT; t++) s[i][t] = _mm512_setzero_si512();
        for (int c = 0; c < 4; c++) {
            __m512i xv[GT];
            for (int t = 0; t < GT; t++) xv[t] = _mm512_load_si512((const void *)(xq + (t * nb + b) * 256 + 64 * c));
            for (int i = 0; i < GR; i++) {
                const __m512i q = W[i].q[c], sv = W[i].s16[c];
                for (int t = 0; t < GT; t++) s[i][t] = _mm512_dpwssd_epi32(s[i][t], _mm512_maddubs_epi16(q, xv[t]), sv);
            }
        }
        const float *yd = x->yd + (g * nb + b) * GT;
        for (int i = 0; i < GR; i++)
            for (int t = 0; t < GT; t++)
                acc[i][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s[i][t]), _mm512_set1_ps(yd[t] * dd[b * GR + i]), acc[i][t]);
        for (int i = 0; i < GR; i++) {
            const __m512i m = _mm512_madd_epi16(W[i].mins, x->bs8[g * nb + b]);
            const __m512 sc = _mm512_mul_ps(x->ydv[g * nb + b], _mm512_set1_ps(dm[b * GR + i]));
            accm[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(m), sc, accm[i]);
        }
    }
    for (int i = 0; i < nr; i++)
        for (int t = 0; t < GT && GT * g + t < T; t++) {
            /* the matvec's hsum of its 4-lane mins accumulator */
            __m128 m = _mm512_extractf32x4_ps(accm[i], 0);
            if (t == 1) m = _mm512_extractf32x4_ps(accm[i], 1);
            if (t == 2) m = _mm512_extractf32x4_ps(accm[i], 2);
            if (t == 3) m = _mm512_extractf32x4_ps(accm[i], 3);
            m = _mm_add_ps(m, _mm_movehl_ps(m, m));
            m = _mm_add_ss(m, _mm_movehdup_ps(m));
            y[(GT * g + t) * ys + i] = _mm512_reduce_add_ps(acc[i][t]) - _mm_cvtss_f32(m);
        }
}

/* Tokens in chunks whose activations stay in L2 (each chunk re-decodes the rows). */
static int64_t token_chunk(int64_t nb) {
    int64_t c = (512 * 1024 / (nb * 288)) / GT * GT;
    return c < GT ? GT : c;
}

/* The decoded rows [blocks][GR], then their scales dd and mins dm [blocks][GR] each. */
static size_t kq_work(int fmt, int64_t n) {
    (void)fmt;
    return (size_t)(n / 256 * GR) * (sizeof(kdec_t) + 2 * sizeof(float));
}

static void kq_run(int fmt, const uint8_t *w, size_t rb, int64_t r0, int64_t r1, int64_t n, const void *xl,
                   int64_t T, float *y, int64_t ys, void *work) {
    const int64_t nb = n / 256, bytes = fmt == F_Q5_K ? 176 : 144;
    const kx_t x = kx_layout((void *)xl, T, nb);
    kdec_t *D = work;
    float *dd = (float *)(D + nb * GR), *dm = dd + nb * GR;
    const int64_t groups = padded(T) / GT, chunk = token_chunk(nb) / GT;
    for (int64_t g0 = 0; g0 < groups; g0 += chunk) {
        const int64_t g1 = g0 + chunk < groups ? g0 + chunk : groups;
        for (int64_t r = r0; r < r1; r += GR) {
            const int nr = (int)(r1 - r < GR ? r1 - r : GR);
            for (int64_t b = 0; b < nb; b++)
                for (int i = 0; i < GR; i++) {
                    kdec_t *o = D + b * GR + i;
                    if (i < nr) kq_decode(fmt, w + (r + i) * rb + b * bytes, o, &dd[b * GR + i], &dm[b * GR + i]);
                    else memset(o, 0, sizeof *o), dd[b * GR + i] = dm[b * GR + i] = 0;
                }
            for (int64_t g = g0; g < g1; g++) kq_tile(D, dd, dm, nb, &x, g, T, nr, y + r, ys);
        }
    }
}

void init_gemm_kq_avx512(void) {
    /* faster than the row kernels from T of about 16 */
    GEMM[F_Q4_K] = (gemm_ops){16, kq_size, kq_prep, kq_work, kq_run};
    GEMM[F_Q5_K] = (gemm_ops){16, kq_size, kq_prep, kq_work, kq_run};
}
#else
void init_gemm_kq_avx512(void) {}
#endif
