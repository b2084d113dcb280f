/* What the AVX-512 prefill GEMMs of q4_1, q5_0, q5_1, iq4_nl (gemm_lanes_b32_avx512.c: 32-element
 * blocks x q8_0 activations), iq4_xs, the grid i-quants, tq2_0 and tq1_0 (gemm_lanes_k_avx512.c,
 * gemm_lanes_grid_avx512.c: x q8_K) share: each zmm lane holds one of 16 rows.
 *
 * The integer matvec of these formats (avx512_iq4.c, avx512_iq.c, as generic.c) applies the scales
 * on a scalar fp32 chain per output: the 32-element blocks one at a time, acc += (d * yd) *
 * float(dot - offset * ysum) (q5_0: offset 16, iq4_nl: 128), q4_1 and q5_1 acc += (d * yd) *
 * float(dot) + (m * yd) * float(ysum); the 256-element ones once per super-block, acc += (yd * d) *
 * float(S), S = the exact int32 sum over its sub-blocks (of 32 or 16 elements) of scale * dot. Exact
 * integer sums do not depend on how they are summed, so the GEMM puts 16 rows in the 16 lanes of a
 * zmm: a block of 16 rows is decoded once per token chunk into 8 zmm per 32 elements, zmm k holding
 * the unsigned codes 4k .. 4k + 3 of each row (value + 128 where values are signed), and each
 * token's 4 activations of that position are broadcast against it (vpdpbusd), giving 16 rows' dots
 * with no horizontal sums; the activations' sum times the offset comes off, the sub-block scales
 * multiply in int32 (vpmulld). The fp32 steps then run per lane in the matvec's order, so every
 * output is the matvec's bits. One loop (lanes_run) drives every format: what differs is a
 * lanes_fmt, the format's decode and the tile of its activation kind. */
#ifndef MOERUN_GEMM_LANES_H
#define MOERUN_GEMM_LANES_H
#include "avx512.h"
#include "gemm.h"

#ifdef MOERUN_AVX512
#include "iq_tables.h"

#define GT GEMM_TOKENS
#define ROWS 16 /* rows per decoded tile: one per zmm lane */

static inline int64_t padded(int64_t T) { return (T + GT - 1) / GT * GT; }

/* 16 rows' 16 bytes (at byte `at` of each row's bytes rp[i]) -> v[4]: v[k] holds dword k of rows
 * 0 .. 15 in order. */
static inline __attribute__((always_inline)) void dwords16(const uint8_t *const rp[ROWS], int64_t at, __m512i v[4]) {
    /* z[a] holds rows a, 4 + a, 8 + a, 12 + a; then a 4 x 4 dword transpose in each 128-bit lane */
    __m512i z[4];
    for (int a = 0; a < 4; a++) {
        z[a] = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(rp[a] + at)));
        for (int l = 1; l < 4; l++)
            z[a] = _mm512_inserti32x4(z[a], _mm_loadu_si128((const __m128i *)(rp[4 * l + a] + at)), l);
    }
    const __m512i t0 = _mm512_unpacklo_epi32(z[0], z[1]), t1 = _mm512_unpackhi_epi32(z[0], z[1]);
    const __m512i t2 = _mm512_unpacklo_epi32(z[2], z[3]), t3 = _mm512_unpackhi_epi32(z[2], z[3]);
    v[0] = _mm512_unpacklo_epi64(t0, t2), v[1] = _mm512_unpackhi_epi64(t0, t2);
    v[2] = _mm512_unpacklo_epi64(t1, t3), v[3] = _mm512_unpackhi_epi64(t1, t3);
}

/* 16 rows' 16 bytes of nibbles (at byte `at` of each row's bytes rp[i]) -> w[8]: w[k] holds codes
 * 4k .. 4k + 3 of rows 0 .. 15 (low nibbles are elements 0-15, high 16-31); iq4: IQ4's values + 128
 * in their place. */
static inline __attribute__((always_inline)) void nibbles16(const uint8_t *const rp[ROWS], int64_t at,
                                                            int iq4, __m512i w[8]) {
    __m512i v[4];
    dwords16(rp, at, v);
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    for (int k = 0; k < 4; k++) {
        w[k] = _mm512_and_si512(v[k], m4);
        w[k + 4] = _mm512_and_si512(_mm512_srli_epi16(v[k], 4), m4);
    }
    if (iq4) { /* IQ4's values + 128 */
        const __m512i t = _mm512_add_epi8(_mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)KVALUES_IQ4NL)),
                                          _mm512_set1_epi8((char)0x80));
        for (int k = 0; k < 8; k++) w[k] = _mm512_shuffle_epi8(t, w[k]);
    }
}

/* Byte e of each dword: set where bit 4k + e (k < 8) of v's dword is (q5's fifth bits, signs). */
static inline __mmask64 nibble_bits(__m512i v, int k) {
    const __m512i spread = _mm512_broadcast_i32x4(_mm_setr_epi32(0, 0x04040404, 0x08080808, 0x0C0C0C0C));
    const __m512i at = _mm512_shuffle_epi8(v, _mm512_add_epi8(spread, _mm512_set1_epi8((char)(k / 2))));
    return _mm512_test_epi8_mask(at, _mm512_set1_epi32(k % 2 ? (int)0x80402010 : 0x08040201));
}

/* A lane GEMM's format: how 16 rows' blocks decode, and the tile that multiplies them with a token
 * group's activations. */
typedef struct {
    int block;      /* elements per block (32 or 256) */
    size_t decoded; /* bytes of one block of 16 rows, decoded (a multiple of 64) */
    size_t act;     /* bytes of one block of a token group's activations (the format's gemm_prep layout) */
    /* blocks 0 .. nb - 1 of the 16 rows rp[i] -> D [nb] */
    void (*decode)(const uint8_t *const rp[ROWS], int64_t nb, void *D);
    /* 16 decoded rows (D [nb]) times a token group's activations (x [nb]) -> y[t * ys + i] for the
     * rows i < nr and the group's tokens t < tn */
    void (*tile)(const void *D, int64_t nb, const void *x, int64_t tn, int nr, float *y, int64_t ys);
} lanes_fmt;

/* gemm_work_fn: the decoded blocks of 16 rows. */
static inline size_t lanes_work(const lanes_fmt *L, int64_t n) { return (size_t)(n / L->block) * L->decoded; }

/* gemm_run_fn: rows [r0, r1) times the T tokens of xl. The token groups go in chunks whose
 * activations stay in L2 (about 512 KiB; each chunk decodes the rows again); in a chunk, each 16 rows
 * are decoded once into work and reused for all the chunk's groups. */
static inline void lanes_run(const lanes_fmt *L, const uint8_t *w, size_t rb, int64_t r0, int64_t r1, int64_t n,
                             const void *xl, int64_t T, float *y, int64_t ys, void *work) {
    const int64_t nb = n / L->block, groups = padded(T) / GT;
    int64_t chunk = 512 * 1024 / (int64_t)((size_t)nb * L->act);
    chunk = chunk < 1 ? 1 : chunk;
    for (int64_t g0 = 0; g0 < groups; g0 += chunk) {
        const int64_t g1 = g0 + chunk < groups ? g0 + chunk : groups;
        for (int64_t r = r0; r < r1; r += ROWS) {
            const int nr = (int)(r1 - r < ROWS ? r1 - r : ROWS);
            const uint8_t *rp[ROWS];
            for (int i = 0; i < ROWS; i++) rp[i] = w + (r + (i < nr ? i : 0)) * rb; /* lanes >= nr: unwritten */
            L->decode(rp, nb, work);
            for (int64_t g = g0; g < g1; g++)
                L->tile(work, nb, (const char *)xl + (size_t)(g * nb) * L->act, T - GT * g, nr, y + GT * g * ys + r, ys);
        }
    }
}

/* One super-block of 16 rows, decoded (the q8_K formats): w[ib][k] holds elements 32 ib + 4k ..
 * 32 ib + 4k + 3 of rows 0 .. 15 as value + 128; ls[j][i] row i's scale of elements 16j .. 16j + 15
 * (of 32 where the format has 8 scales: then ls[2 ib] = ls[2 ib + 1]), as int8 (every format's
 * fits; a quarter of the bytes the tile streams as int32); d the fp32 factor. */
typedef struct {
    __m512i w[8][8];
    int8_t ls[16][ROWS];
    __m512 d;
} sbdec_t;

/* Scale j of the 16 rows, from int32 lanes. */
static inline void set_scale(sbdec_t *D, int j, __m512i ls) { _mm_store_si128((__m128i *)D->ls[j], _mm512_cvtepi32_epi8(ls)); }
static inline void scale_per32(sbdec_t *D, int ib, __m512i ls) {
    set_scale(D, 2 * ib, ls);
    set_scale(D, 2 * ib + 1, ls);
}
/* Scale j of the 16 rows as int32 lanes. */
static inline __m512i scale_of(const sbdec_t *D, int j) { return _mm512_cvtepi8_epi32(_mm_load_si128((const __m128i *)D->ls[j])); }

/* lanes_fmt.decode `name` from `decode16`, which decodes super-block b of the 16 rows. */
#define LANES_DECODE(name, decode16)                                                                   \
    void name(const uint8_t *const rp[ROWS], int64_t nb, void *D) {                                    \
        for (int64_t b = 0; b < nb; b++) decode16(rp, b, (sbdec_t *)D + b);                            \
    }

/* gemm_lanes_grid_avx512.c: the grid i-quants' decode (lanes_fmt.decode into sbdec_t [nb]). */
void lanes_iq3_xxs(const uint8_t *const rp[ROWS], int64_t nb, void *D);
void lanes_iq3_s(const uint8_t *const rp[ROWS], int64_t nb, void *D);
void lanes_iq2_xxs(const uint8_t *const rp[ROWS], int64_t nb, void *D);
void lanes_iq2_xs(const uint8_t *const rp[ROWS], int64_t nb, void *D);
void lanes_iq2_s(const uint8_t *const rp[ROWS], int64_t nb, void *D);
void lanes_iq1_s(const uint8_t *const rp[ROWS], int64_t nb, void *D);
void lanes_iq1_m(const uint8_t *const rp[ROWS], int64_t nb, void *D);

#endif
#endif
