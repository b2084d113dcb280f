/* AVX2 kernels of the grid i-quants and the ternary formats (iq2_xxs, iq2_xs, iq2_s, iq3_xxs, iq3_s,
 * iq1_s, iq1_m, tq1_0, tq2_0), exact mode and integer mode (x q8_K). They compute generic.c's bits:
 * in integer mode per super-block the exact int32 S = sum over sub-blocks of sc * dot (generic.c's
 * k-quant form, iq_unpack.h's values), then acc += (yd * d) * S in fp32; exact mode below.
 * As ggml-cpu's AVX2 vec_dot functions: each run of 32 weights is built from its grid entries (one
 * 64-bit load per 8 values, one 32-bit load per 4) as magnitudes, the signs go onto the activations
 * (a byte mask from the sign bits: x ^ m - m), then u8 x s8 pairs (vpmaddubsw) and the scales in
 * int16 x int16 (vpmaddwd). */
#include "common.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

#include "iq_unpack.h"

#define ROWS_ARGS                                                                                      \
    const uint8_t *w, size_t rb, int64_t r0, int64_t r1, int64_t n, const void *const *xs, int T,      \
        float *const *ys
#define ONE_OR_T(call) \
    do { if (T == 1) { call(1); } else { call(T); } } while (0)

/* One super-block as 8 runs of 32 elements: |q| as bytes, 0xFF where q < 0, the scales as int16
 * (lanes 0-7: elements 0-15's, 8-15: 16-31's), and d. */
typedef struct {
    __m256i mag[8], neg[8], sc[8];
    float d;
} runs_t;

/* Byte j: 0xFF where bit j of `bits` is set. */
static inline __m256i bit_mask(uint32_t bits) {
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32((int)bits),
        _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0x0000000000000000));
    return _mm256_cmpeq_epi8(_mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe)), _mm256_set1_epi64x(-1));
}

static inline __m256i scales16(int first, int second) {
    return _mm256_set_m128i(_mm_set1_epi16((short)second), _mm_set1_epi16((short)first));
}

static inline uint64_t entry8(const int8_t *e) {
    uint64_t v;
    memcpy(&v, e, 8);
    return v;
}

static inline uint32_t entry4(const int8_t *e) {
    uint32_t v;
    memcpy(&v, e, 4);
    return v;
}

/* A run of 4 grid entries of 8 values. */
static inline __m256i grid8x4(const int8_t (*grid)[8], int i0, int i1, int i2, int i3) {
    return _mm256_set_epi64x((long long)entry8(grid[i3]), (long long)entry8(grid[i2]), (long long)entry8(grid[i1]),
                             (long long)entry8(grid[i0]));
}

/* Signed values (IQ1's, TQ's): magnitude and sign mask. */
static inline void from_signed(__m256i q, __m256i *mag, __m256i *neg) {
    *mag = _mm256_abs_epi8(q);
    *neg = _mm256_cmpgt_epi8(_mm256_setzero_si256(), q);
}

static inline void decode_iq2_xxs(const uint8_t *b, runs_t *s) {
    for (int ib = 0; ib < 8; ib++) {
        const uint8_t *idx = b + 2 + 8 * ib;
        const uint32_t aux = rd32(idx + 4);
        s->mag[ib] = grid8x4(IQ2XXS_GRID, idx[0], idx[1], idx[2], idx[3]);
        uint32_t signs = 0;
        for (int l = 0; l < 4; l++) signs |= (uint32_t)KSIGNS_IQ2XS[(aux >> (7 * l)) & 127] << (8 * l);
        s->neg[ib] = bit_mask(signs);
        const int ls = 2 * (int)(aux >> 28) + 1;
        s->sc[ib] = scales16(ls, ls);
    }
    s->d = f16_at(b) * 0.125f;
}

static inline void decode_iq2_xs(const uint8_t *b, runs_t *s) {
    for (int ib = 0; ib < 8; ib++) {
        uint16_t word[4];
        uint32_t signs = 0;
        for (int l = 0; l < 4; l++) {
            word[l] = rd16(b + 2 + 8 * ib + 2 * l);
            signs |= (uint32_t)KSIGNS_IQ2XS[word[l] >> 9] << (8 * l);
        }
        s->mag[ib] = grid8x4(IQ2XS_GRID, word[0] & 511, word[1] & 511, word[2] & 511, word[3] & 511);
        s->neg[ib] = bit_mask(signs);
        s->sc[ib] = scales16(2 * (b[66 + ib] & 0xF) + 1, 2 * (b[66 + ib] >> 4) + 1);
    }
    s->d = f16_at(b) * 0.125f;
}

static inline void decode_iq2_s(const uint8_t *b, runs_t *s) {
    const uint8_t *qs = b + 2, *qh = b + 66;
    for (int ib = 0; ib < 8; ib++) {
        int idx[4];
        for (int l = 0; l < 4; l++) idx[l] = qs[4 * ib + l] | ((qh[ib] >> (2 * l)) & 3) << 8;
        s->mag[ib] = grid8x4(IQ2S_GRID, idx[0], idx[1], idx[2], idx[3]);
        s->neg[ib] = bit_mask(rd32(b + 34 + 4 * ib));
        s->sc[ib] = scales16(2 * (b[74 + ib] & 0xF) + 1, 2 * (b[74 + ib] >> 4) + 1);
    }
    s->d = f16_at(b) * 0.125f;
}

static inline void decode_iq3_xxs(const uint8_t *b, runs_t *s) {
    const uint8_t *qs = b + 2;
    for (int ib = 0; ib < 8; ib++) {
        const uint8_t *k = qs + 8 * ib;
        const uint32_t aux = rd32(b + 66 + 4 * ib);
        s->mag[ib] = _mm256_set_epi32(
            (int)entry4(IQ3XXS_GRID[k[7]]), (int)entry4(IQ3XXS_GRID[k[6]]), (int)entry4(IQ3XXS_GRID[k[5]]),
            (int)entry4(IQ3XXS_GRID[k[4]]), (int)entry4(IQ3XXS_GRID[k[3]]), (int)entry4(IQ3XXS_GRID[k[2]]),
            (int)entry4(IQ3XXS_GRID[k[1]]), (int)entry4(IQ3XXS_GRID[k[0]]));
        uint32_t signs = 0;
        for (int l = 0; l < 4; l++) signs |= (uint32_t)KSIGNS_IQ2XS[(aux >> (7 * l)) & 127] << (8 * l);
        s->neg[ib] = bit_mask(signs);
        const int ls = 2 * (int)(aux >> 28) + 1;
        s->sc[ib] = scales16(ls, ls);
    }
    s->d = f16_at(b) * 0.25f;
}

static inline void decode_iq3_s(const uint8_t *b, runs_t *s) {
    const uint8_t *qs = b + 2, *qh = b + 66;
    for (int ib = 0; ib < 8; ib++) {
        int idx[8];
        for (int k = 0; k < 8; k++) idx[k] = qs[8 * ib + k] | ((qh[ib] >> k) & 1) << 8;
        s->mag[ib] = _mm256_set_epi32(
            (int)entry4(IQ3S_GRID[idx[7]]), (int)entry4(IQ3S_GRID[idx[6]]), (int)entry4(IQ3S_GRID[idx[5]]),
            (int)entry4(IQ3S_GRID[idx[4]]), (int)entry4(IQ3S_GRID[idx[3]]), (int)entry4(IQ3S_GRID[idx[2]]),
            (int)entry4(IQ3S_GRID[idx[1]]), (int)entry4(IQ3S_GRID[idx[0]]));
        s->neg[ib] = bit_mask(rd32(b + 74 + 4 * ib));
        const int ls = 2 * ((b[106 + ib / 2] >> (4 * (ib % 2))) & 0xF) + 1;
        s->sc[ib] = scales16(ls, ls);
    }
    s->d = f16_at(b);
}

/* IQ1: 8 * grid (grid in {-1, 0, 1}: the sign of 8) plus the run's deltas. */
static inline __m256i iq1_run(__m256i grid, __m256i delta) {
    return _mm256_add_epi8(_mm256_sign_epi8(_mm256_set1_epi8(8), grid), delta);
}

static inline __m256i delta8(int minus) { return _mm256_set1_epi8((char)(minus ? -1 : 1)); }

static inline void decode_iq1_s(const uint8_t *b, runs_t *s) {
    const uint8_t *qs = b + 2;
    for (int ib = 0; ib < 8; ib++) {
        const uint16_t qh = rd16(b + 34 + 2 * ib);
        int idx[4];
        for (int l = 0; l < 4; l++) idx[l] = qs[4 * ib + l] | ((qh >> (3 * l)) & 7) << 8;
        const __m256i q = iq1_run(grid8x4(IQ1S_GRID, idx[0], idx[1], idx[2], idx[3]), delta8(qh >> 15));
        from_signed(q, &s->mag[ib], &s->neg[ib]);
        const int ls = 2 * ((qh >> 12) & 7) + 1;
        s->sc[ib] = scales16(ls, ls);
    }
    s->d = f16_at(b) * 0.125f;
}

static inline void decode_iq1_m(const uint8_t *b, runs_t *s) {
    uint16_t d_bits = 0, words[4];
    for (int k = 0; k < 4; k++) {
        words[k] = rd16(b + 48 + 2 * k);
        d_bits |= (uint16_t)((words[k] >> 12) << (4 * k));
    }
    for (int ib = 0; ib < 8; ib++) {
        int idx[4];
        long long delta[4];
        for (int l = 0; l < 4; l++) {
            const int g = 4 * ib + l, nib = (b[32 + g / 2] >> (4 * (g % 2))) & 0xF;
            idx[l] = b[g] | (nib & 7) << 8;
            delta[l] = nib >> 3 ? -1 : 0x0101010101010101;
        }
        const __m256i q = iq1_run(grid8x4(IQ1S_GRID, idx[0], idx[1], idx[2], idx[3]),
                                  _mm256_set_epi64x(delta[3], delta[2], delta[1], delta[0]));
        from_signed(q, &s->mag[ib], &s->neg[ib]);
        const uint16_t word = words[ib / 2];
        const int first = 2 * ((word >> (6 * (ib % 2))) & 7) + 1, second = 2 * ((word >> (6 * (ib % 2) + 3)) & 7) + 1;
        s->sc[ib] = scales16(first, second);
    }
    s->d = f16_to_f32(d_bits) * 0.125f;
}

/* The ternary formats' codes, 8 runs of 32 (run k: elements 32k .. 32k + 31), value code - 1. */
typedef void (*codes_fn)(const uint8_t *, __m256i *);

/* TQ2_0: run 4h + k is the 2-bit fields at shift 2k of bytes 32h .. 32h + 31, codes 0-3. */
static inline void codes_tq2_0(const uint8_t *b, __m256i code[8]) {
    for (int h = 0; h < 2; h++) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(b + 32 * h));
        for (int k = 0; k < 4; k++) code[4 * h + k] = _mm256_and_si256(_mm256_srli_epi16(v, 2 * k), _mm256_set1_epi8(3));
    }
}

/* TQ1_0's base-3 digit k of each byte v (iq_unpack.h) is (3p) >> 8 for p = v * 3^k mod 256, that is
 * (p > 85) + (p > 170): signed compares of p - 128, their -1s subtracted. */
static inline __m256i tq1_digit(__m256i p) {
    const __m256i s = _mm256_xor_si256(p, _mm256_set1_epi8((char)0x80));
    const __m256i one = _mm256_cmpgt_epi8(s, _mm256_set1_epi8(85 - 128));
    const __m256i two = _mm256_cmpgt_epi8(s, _mm256_set1_epi8(170 - 128));
    return _mm256_sub_epi8(_mm256_setzero_si256(), _mm256_add_epi8(one, two));
}

/* p * 3 and p * 9 in 8-bit lanes (9p = p + 8p, 8p as the 16-bit shift with the bits from the byte
 * below cleared). */
static inline __m256i times3(__m256i p) { return _mm256_add_epi8(p, _mm256_add_epi8(p, p)); }
static inline __m256i times9(__m256i p) {
    return _mm256_add_epi8(p, _mm256_and_si256(_mm256_slli_epi16(p, 3), _mm256_set1_epi8((char)0xF8)));
}

/* TQ1_0: bytes 0-31 give runs 0-4 (digit k: run k); bytes 32-47 give elements 160 + 16k + j (runs
 * 5, 6 and the first half of 7); bytes 48-51 give 240 + 4k + j. Codes 0-2. */
static inline void codes_tq1_0(const uint8_t *b, __m256i code[8]) {
    const __m256i v = _mm256_loadu_si256((const __m256i *)b), v3 = times3(v), v9 = times9(v);
    code[0] = tq1_digit(v), code[1] = tq1_digit(v3), code[2] = tq1_digit(v9);
    code[3] = tq1_digit(times9(v3)), code[4] = tq1_digit(times9(v9));
    const __m128i m = _mm_loadu_si128((const __m128i *)(b + 32));
    const __m256i m1_3 = _mm256_set_m128i(_mm_add_epi8(m, _mm_add_epi8(m, m)), m), m9_27 = times9(m1_3);
    code[5] = tq1_digit(m1_3), code[6] = tq1_digit(m9_27);
    /* bytes 48-51 times 3^k in dword k: their products in 16-bit lanes, the low bytes packed */
    const __m256i t = _mm256_mullo_epi16(_mm256_cvtepu8_epi16(_mm_set1_epi32((int)rd32(b + 48))),
                                         _mm256_setr_epi16(1, 1, 1, 1, 3, 3, 3, 3, 9, 9, 9, 9, 27, 27, 27, 27));
    const __m256i t8 = _mm256_and_si256(t, _mm256_set1_epi16(0xFF));
    const __m128i tail = _mm_packus_epi16(_mm256_castsi256_si128(t8), _mm256_extracti128_si256(t8, 1));
    code[7] = tq1_digit(_mm256_set_m128i(tail, _mm256_extracti128_si256(times9(m9_27), 0)));
}

/* Exact mode's runs: the codes as values code - 1 (magnitude and sign mask), scale 1. */
static inline void runs_of_codes(const __m256i code[8], float d, runs_t *s) {
    for (int r = 0; r < 8; r++) {
        from_signed(_mm256_sub_epi8(code[r], _mm256_set1_epi8(1)), &s->mag[r], &s->neg[r]);
        s->sc[r] = _mm256_set1_epi16(1);
    }
    s->d = d;
}

static inline void decode_tq2_0(const uint8_t *b, runs_t *s) {
    __m256i code[8];
    codes_tq2_0(b, code);
    runs_of_codes(code, f16_at(b + 64), s);
}

static inline void decode_tq1_0(const uint8_t *b, runs_t *s) {
    __m256i code[8];
    codes_tq1_0(b, code);
    runs_of_codes(code, f16_at(b + 52), s);
}

/* The ternary formats, integer mode (as ggml's AVX2 vec_dot): S = sum of code * x minus the sum of
 * the 256 x, in 16-bit lanes (u8 x s8 pairs through vpmaddubsw, |pair| <= 768, 8 of them and the
 * bsums <= 8192: exact), then summed in int32: generic.c's exact S. */
static inline __attribute__((always_inline)) void ternary_body(ROWS_ARGS, int bytes, int d_at, codes_fn decode) {
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w + r * rb;
        float acc[MAX_T] = {0};
        for (int64_t b = 0; b < n / 256; b++) {
            __m256i code[8];
            decode(row + b * bytes, code);
            const float d = f16_at(row + b * bytes + d_at);
            for (int t = 0; t < T; t++) {
                const q8k_t *y = (const q8k_t *)xs[t] + b;
                __m256i s16 = _mm256_sub_epi16(_mm256_setzero_si256(), _mm256_loadu_si256((const __m256i *)y->bsums));
                for (int k = 0; k < 8; k++)
                    s16 = _mm256_add_epi16(
                        s16, _mm256_maddubs_epi16(code[k], _mm256_loadu_si256((const __m256i *)(y->qs + 32 * k))));
                const __m256i sum = _mm256_madd_epi16(s16, _mm256_set1_epi16(1));
                __m128i h = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
                h = _mm_add_epi32(h, _mm_unpackhi_epi64(h, h));
                h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 1));
                acc[t] += (y->d * d) * (float)_mm_cvtsi128_si32(h);
            }
        }
        for (int t = 0; t < T; t++) ys[t][r] = acc[t];
    }
}

typedef void (*decode_fn)(const uint8_t *, runs_t *);

static inline __attribute__((always_inline)) void runs_body(ROWS_ARGS, int bytes, decode_fn decode) {
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w + r * rb;
        float acc[MAX_T] = {0};
        for (int64_t b = 0; b < n / 256; b++) {
            runs_t s;
            decode(row + b * bytes, &s);
            for (int t = 0; t < T; t++) {
                const q8k_t *y = (const q8k_t *)xs[t] + b;
                __m256i sum = _mm256_setzero_si256();
                for (int ib = 0; ib < 8; ib++) {
                    __m256i x = _mm256_loadu_si256((const __m256i *)(y->qs + 32 * ib));
                    x = _mm256_sub_epi8(_mm256_xor_si256(x, s.neg[ib]), s.neg[ib]);
                    sum = _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_maddubs_epi16(s.mag[ib], x), s.sc[ib]));
                }
                __m128i h = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
                h = _mm_add_epi32(h, _mm_unpackhi_epi64(h, h));
                h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 1));
                acc[t] += (y->d * s.d) * (float)_mm_cvtsi128_si32(h);
            }
        }
        for (int t = 0; t < T; t++) ys[t][r] = acc[t];
    }
}

/* Exact mode: each 16 elements' values step * q, step = d * sc, as generic.c's rows_k_exact, then
 * acc += v * x (a multiply, then an add) in its 16 lanes (two ymm), chunk after chunk, summed by
 * sum16_tree. */
static inline __attribute__((always_inline)) void runs_exact_body(ROWS_ARGS, int bytes, decode_fn decode) {
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w + r * rb;
        __m256 lo[MAX_T], hi[MAX_T];
        for (int t = 0; t < T; t++) lo[t] = hi[t] = _mm256_setzero_ps();
        for (int64_t b = 0; b < n / 256; b++) {
            runs_t s;
            decode(row + b * bytes, &s);
            for (int ib = 0; ib < 8; ib++) {
                int8_t q[32];
                int16_t sc[16];
                _mm256_storeu_si256((__m256i *)q, _mm256_sub_epi8(_mm256_xor_si256(s.mag[ib], s.neg[ib]), s.neg[ib]));
                _mm256_storeu_si256((__m256i *)sc, s.sc[ib]);
                for (int h = 0; h < 2; h++) {
                    const __m256 step = _mm256_set1_ps(s.d * (float)sc[8 * h]);
                    const __m128i q0 = _mm_loadl_epi64((const __m128i *)(q + 16 * h));
                    const __m128i q1 = _mm_loadl_epi64((const __m128i *)(q + 16 * h + 8));
                    const __m256 v0 = _mm256_mul_ps(step, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q0)));
                    const __m256 v1 = _mm256_mul_ps(step, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q1)));
                    for (int t = 0; t < T; t++) {
                        const float *x = (const float *)xs[t] + 256 * b + 32 * ib + 16 * h;
                        lo[t] = _mm256_add_ps(lo[t], _mm256_mul_ps(v0, _mm256_loadu_ps(x)));
                        hi[t] = _mm256_add_ps(hi[t], _mm256_mul_ps(v1, _mm256_loadu_ps(x + 8)));
                    }
                }
            }
        }
        for (int t = 0; t < T; t++) {
            float a[16];
            _mm256_storeu_ps(a, lo[t]);
            _mm256_storeu_ps(a + 8, hi[t]);
            ys[t][r] = sum16_tree(a);
        }
    }
}

#define RUNS_FORMAT(name, bytes)                                                                       \
    static void name##_int(ROWS_ARGS) {                                                                \
        if (T == 1) runs_body(w, rb, r0, r1, n, xs, 1, ys, bytes, decode_##name);                       \
        else runs_body(w, rb, r0, r1, n, xs, T, ys, bytes, decode_##name);                              \
    }                                                                                                  \
    static void name##_exact(ROWS_ARGS) {                                                              \
        if (T == 1) runs_exact_body(w, rb, r0, r1, n, xs, 1, ys, bytes, decode_##name);                 \
        else runs_exact_body(w, rb, r0, r1, n, xs, T, ys, bytes, decode_##name);                        \
    }
RUNS_FORMAT(iq2_xxs, 66)
RUNS_FORMAT(iq2_xs, 74)
RUNS_FORMAT(iq2_s, 82)
RUNS_FORMAT(iq3_xxs, 98)
RUNS_FORMAT(iq3_s, 110)
RUNS_FORMAT(iq1_s, 50)
RUNS_FORMAT(iq1_m, 56)
#define TERNARY_FORMAT(name, bytes, d_at)                                                              \
    static void name##_int(ROWS_ARGS) {                                                                \
        if (T == 1) ternary_body(w, rb, r0, r1, n, xs, 1, ys, bytes, d_at, codes_##name);               \
        else ternary_body(w, rb, r0, r1, n, xs, T, ys, bytes, d_at, codes_##name);                      \
    }                                                                                                  \
    static void name##_exact(ROWS_ARGS) {                                                              \
        if (T == 1) runs_exact_body(w, rb, r0, r1, n, xs, 1, ys, bytes, decode_##name);                 \
        else runs_exact_body(w, rb, r0, r1, n, xs, T, ys, bytes, decode_##name);                        \
    }
TERNARY_FORMAT(tq2_0, 66, 64)
TERNARY_FORMAT(tq1_0, 54, 52)

#define SET(F, name) (FMT[F].integer = name##_int, FMT[F].exact = name##_exact)
void init_avx2_iq(void) {
    SET(F_IQ2_XXS, iq2_xxs);
    SET(F_IQ2_XS, iq2_xs);
    SET(F_IQ2_S, iq2_s);
    SET(F_IQ3_XXS, iq3_xxs);
    SET(F_IQ3_S, iq3_s);
    SET(F_IQ1_S, iq1_s);
    SET(F_IQ1_M, iq1_m);
    SET(F_TQ2_0, tq2_0);
    SET(F_TQ1_0, tq1_0);
}
#else
void init_avx2_iq(void) {}
#endif
