/* AVX-512 prefill GEMM for q4_1, q5_0, q5_1 and iq4_nl (32-element blocks x q8_0 activations), 16
 * rows in the lanes of a zmm (gemm_lanes.h): per block, acc += (d * yd) * float(dot - offset *
 * ysum) (q5_0: offset 16, iq4_nl: 128; here the offset's term starts the int32 sum), q4_1 and q5_1
 * acc += (d * yd) * float(dot) + (m * yd) * float(ysum), as avx512_iq4.c's row kernels. */
#include "gemm_lanes.h"

#ifdef MOERUN_AVX512
typedef struct {
    int32_t qs[GT][8]; /* each token's 32 activations, 4 to a dword */
    float d[GT];
    int32_t off[GT]; /* offset * sum of qs (q5_0, iq4_nl) */
    float sum[GT];   /* float(sum of qs) (q4_1, q5_1: the min's term) */
    int32_t pad[4];
} ax_t; /* [token groups][blocks], 192 bytes */

typedef struct {
    __m512i w[8]; /* codes 4k .. 4k + 3 of rows 0 .. 15 (unsigned; iq4_nl: values + 128) */
    __m512 d, m;  /* the rows' scales, mins */
} wdec_t;         /* one block of 16 rows */

static int block_bytes(int fmt) { return fmt == F_Q4_1 ? 20 : fmt == F_Q5_0 ? 22 : fmt == F_Q5_1 ? 24 : 18; }
static int qs_at(int fmt) { return fmt == F_Q4_1 ? 4 : fmt == F_Q5_0 ? 6 : fmt == F_Q5_1 ? 8 : 2; }
static int offset_of(int fmt) { return fmt == F_Q5_0 ? 16 : fmt == F_IQ4_NL ? 128 : 0; }
static int has_min(int fmt) { return fmt == F_Q4_1 || fmt == F_Q5_1; }

static size_t b32s_size(int fmt, int64_t T, int64_t n) {
    (void)fmt;
    return (size_t)(padded(T) / GT * (n / 32)) * sizeof(ax_t);
}

static void b32s_prep(int fmt, const void *xq, int64_t g, int64_t T, int64_t n, void *xl) {
    const int64_t nb = n / 32;
    const int offset = offset_of(fmt);
    ax_t *o = (ax_t *)xl + g * nb;
    for (int64_t b = 0; b < nb; b++) {
        memset(o + b, 0, sizeof *o);
        for (int i = 0; i < GT && GT * g + i < T; i++) {
            const q8a_t *y = (const q8a_t *)xq + (GT * g + i) * nb + b;
            memcpy(o[b].qs[i], y->qs, 32);
            o[b].d[i] = y->d;
            o[b].off[i] = offset * y->sum;
            o[b].sum[i] = (float)y->sum;
        }
    }
}

/* Block b of 16 rows (rp: each row's bytes) -> D. */
static inline __attribute__((always_inline)) void decode16(int fmt, const uint8_t *const rp[ROWS], int64_t b,
                                                           wdec_t *D) {
    const int64_t at = b * block_bytes(fmt);
    nibbles16(rp, at + qs_at(fmt), fmt == F_IQ4_NL, D->w);
    uint16_t d16[ROWS], m16[ROWS];
    for (int i = 0; i < ROWS; i++) {
        d16[i] = rd16(rp[i] + at);
        m16[i] = has_min(fmt) ? rd16(rp[i] + at + 2) : 0;
    }
    D->d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)d16));
    D->m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)m16));
    if (fmt == F_Q5_0 || fmt == F_Q5_1) { /* bit j of the uint32 qh: 0x10 on element j */
        int32_t qh[ROWS];
        for (int i = 0; i < ROWS; i++) memcpy(qh + i, rp[i] + at + (fmt == F_Q5_0 ? 2 : 4), 4);
        const __m512i h = _mm512_loadu_si512((const void *)qh);
        for (int k = 0; k < 8; k++) D->w[k] = _mm512_or_si512(D->w[k], _mm512_maskz_set1_epi8(nibble_bits(h, k), 0x10));
    }
}

/* 16 decoded rows (D: [blocks]) times tokens 4g .. 4g + 3; rows i < nr, tokens < tn written. */
static inline __attribute__((always_inline)) void tile16(int fmt, const wdec_t *D, int64_t nb, const ax_t *x,
                                                         int64_t tn, int nr, float *y, int64_t ys) {
    __m512 acc[GT];
    for (int t = 0; t < GT; t++) acc[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const wdec_t *wd = D + b;
        const ax_t *a = x + b;
        __m512i s0[GT], s1[GT]; /* two chains per token: the exact int32 sums in any order */
        for (int t = 0; t < GT; t++) { /* the offset's term first */
            s0[t] = offset_of(fmt) ? _mm512_set1_epi32(-a->off[t]) : _mm512_setzero_si512();
            s1[t] = _mm512_setzero_si512();
        }
        for (int k = 0; k < 8; k += 2)
            for (int t = 0; t < GT; t++) {
                s0[t] = _mm512_dpbusd_epi32(s0[t], wd->w[k], _mm512_set1_epi32(a->qs[t][k]));
                s1[t] = _mm512_dpbusd_epi32(s1[t], wd->w[k + 1], _mm512_set1_epi32(a->qs[t][k + 1]));
            }
        for (int t = 0; t < GT; t++) {
            const __m512i dot = _mm512_add_epi32(s0[t], s1[t]);
            const __m512 yd = _mm512_set1_ps(a->d[t]);
            __m512 p = _mm512_mul_ps(_mm512_mul_ps(wd->d, yd), _mm512_cvtepi32_ps(dot));
            if (has_min(fmt)) p = _mm512_add_ps(p, _mm512_mul_ps(_mm512_mul_ps(wd->m, yd), _mm512_set1_ps(a->sum[t])));
            acc[t] = _mm512_add_ps(acc[t], p);
        }
    }
    const __mmask16 rows = (__mmask16)((1u << nr) - 1);
    for (int t = 0; t < GT && t < tn; t++) _mm512_mask_storeu_ps(y + t * ys, rows, acc[t]);
}

/* Each format's decode and tile, compiled for it (the format's branches resolved). */
#define B32S_FORMAT(name, F)                                                                           \
    static void name##_decode(const uint8_t *const rp[ROWS], int64_t nb, void *D) {                    \
        for (int64_t b = 0; b < nb; b++) decode16(F, rp, b, (wdec_t *)D + b);                          \
    }                                                                                                  \
    static void name##_tile(const void *D, int64_t nb, const void *x, int64_t tn, int nr, float *y,    \
                            int64_t ys) {                                                              \
        tile16(F, D, nb, x, tn, nr, y, ys);                                                            \
    }                                                                                                  \
    static const lanes_fmt name##_lanes = {32, sizeof(wdec_t), sizeof(ax_t), name##_decode, name##_tile};
B32S_FORMAT(q4_1, F_Q4_1)
B32S_FORMAT(q5_0, F_Q5_0)
B32S_FORMAT(q5_1, F_Q5_1)
B32S_FORMAT(iq4_nl, F_IQ4_NL)

static const lanes_fmt *const LANES[F_COUNT] = {
    [F_Q4_1] = &q4_1_lanes, [F_Q5_0] = &q5_0_lanes, [F_Q5_1] = &q5_1_lanes, [F_IQ4_NL] = &iq4_nl_lanes};

static size_t b32s_work(int fmt, int64_t n) { return lanes_work(LANES[fmt], n); }

static void b32s_run(int fmt, const uint8_t *w, size_t rb, int64_t r0, int64_t r1, int64_t n, const void *xl,
                     int64_t T, float *y, int64_t ys, void *work) {
    lanes_run(LANES[fmt], w, rb, r0, r1, n, xl, T, y, ys, work);
}

/* min_t: from this many tokens the GEMM beat the row kernels (measured as gemm_lanes_k_avx512.c's) */
#define B32S_GEMM(min_t) ((gemm_ops){min_t, b32s_size, b32s_prep, b32s_work, b32s_run})
void init_gemm_lanes_b32_avx512(void) {
    GEMM[F_Q4_1] = B32S_GEMM(3);
    GEMM[F_Q5_0] = B32S_GEMM(2);
    GEMM[F_Q5_1] = B32S_GEMM(3);
    GEMM[F_IQ4_NL] = B32S_GEMM(2);
}
#else
void init_gemm_lanes_b32_avx512(void) {}
#endif
