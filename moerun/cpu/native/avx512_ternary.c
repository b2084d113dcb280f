/* AVX-512 kernels of the formats whose values are ternary: tq1_0, tq2_0, and iq1_s / iq1_m (grid
 * values in {-1, 0, 1}, times 8, plus a delta of +-1), exact mode and integer mode (x q8_K): the same
 * bits as generic.c's (and avx2_iq.c's): per super-block the exact int32 S = sum of sc * dot, then
 * acc += (yd * d) * S in fp32. IQ1's signed values as magnitudes and a mask (exact mode), or in
 * integer mode as u8 parts (vpmaddubsw, the scales through vpdpwssd) with the rest through the
 * bsums. The ternary formats' integer mode: their codes 0-2 (0-3) straight into vpdpbusd, the 256
 * activations' sum taken off; for one or two tokens four rows at a time, their sums reduced together
 * and their fp32 steps in the lanes of one register. */
#include "avx512_pairs.h"

#ifdef MOERUN_AVX512

/* TQ2_0: pair c = runs 2c, 2c + 1 = the fields at shifts 4(c % 2) and 4(c % 2) + 2 of bytes
 * 32(c / 2) .. + 31, as codes 0-3; value code - 1 (code 3, which ggml's quantiser never writes, is 2). */
static inline void codes_tq2_0(const uint8_t *b, __m512i code[4]) {
    const __m512i shift = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1); /* 0 | 2 */
    for (int c = 0; c < 4; c++) {
        const __m512i v = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(b + 32 * (c / 2))));
        code[c] = _mm512_and_si512(
            _mm512_srlv_epi16(v, _mm512_add_epi16(shift, _mm512_set1_epi16((short)(4 * (c % 2))))), _mm512_set1_epi8(3));
    }
}

static inline void pairs_tq2_0(const uint8_t *b, pairs_t *s) {
    __m512i code[4];
    codes_tq2_0(b, code);
    for (int c = 0; c < 4; c++) {
        s->mag[c] = _mm512_abs_epi8(_mm512_sub_epi8(code[c], _mm512_set1_epi8(1)));
        s->neg[c] = _mm512_cmpeq_epi8_mask(code[c], _mm512_setzero_si512());
        s->sc[c] = _mm512_set1_epi16(1);
    }
    s->d = f16_at(b + 64);
}

/* Signed values (IQ1's, TQ1's): magnitudes and the mask of the negative ones. */
static inline void pair_from_signed(__m512i q, pairs_t *s, int c) {
    s->mag[c] = _mm512_abs_epi8(q);
    s->neg[c] = _mm512_movepi8_mask(q);
}

/* IQ1: 8 * grid (grid bytes in {-1, 0, 1}, shifted within 16-bit lanes, the bits that cross into
 * the next byte masked off) plus the deltas. */
static inline __m512i iq1_values_x8(__m512i grid, __m512i delta) {
    return _mm512_add_epi8(_mm512_and_si512(_mm512_slli_epi16(grid, 3), _mm512_set1_epi8((char)0xF8)), delta);
}

static inline void pairs_iq1_s(const uint8_t *b, pairs_t *s) {
    const __m512i shifts = _mm512_setr_epi64(0, 3, 6, 9, 16, 19, 22, 25);
    for (int c = 0; c < 4; c++) {
        const uint16_t qa = rd16(b + 34 + 4 * c), qb = rd16(b + 36 + 4 * c);
        const __m512i lo = _mm512_cvtepu8_epi64(_mm_loadl_epi64((const __m128i *)(b + 2 + 8 * c)));
        const __m512i hi = _mm512_and_si512(_mm512_srlv_epi64(_mm512_set1_epi64(qa | (uint32_t)qb << 16), shifts),
                                            _mm512_set1_epi64(7));
        const __m512i grid =
            _mm512_i64gather_epi64(_mm512_or_si512(lo, _mm512_slli_epi64(hi, 8)), (const void *)IQ1S_GRID, 8);
        const __m512i delta = _mm512_inserti64x4(_mm512_set1_epi8((char)(qa >> 15 ? -1 : 1)),
                                                 _mm256_set1_epi8((char)(qb >> 15 ? -1 : 1)), 1);
        pair_from_signed(iq1_values_x8(grid, delta), s, c);
        const int la = 2 * ((qa >> 12) & 7) + 1, lb = 2 * ((qb >> 12) & 7) + 1;
        s->sc[c] = scales4(la, la, lb, lb);
    }
    s->d = f16_at(b) * 0.125f;
}

static inline void pairs_iq1_m(const uint8_t *b, pairs_t *s) {
    const __m512i shifts = _mm512_setr_epi64(0, 4, 8, 12, 16, 20, 24, 28);
    uint16_t d_bits = 0;
    for (int c = 0; c < 4; c++) {
        const uint16_t word = rd16(b + 48 + 2 * c); /* the pair's 4 scales, one nibble of d */
        d_bits |= (uint16_t)((word >> 12) << (4 * c));
        const uint32_t nib = rd32(b + 32 + 4 * c); /* group l: 3 index bits, then the delta's sign */
        const __m512i lo = _mm512_cvtepu8_epi64(_mm_loadl_epi64((const __m128i *)(b + 8 * c)));
        const __m512i hi = _mm512_and_si512(_mm512_srlv_epi64(_mm512_set1_epi64(nib), shifts), _mm512_set1_epi64(7));
        const __m512i grid =
            _mm512_i64gather_epi64(_mm512_or_si512(lo, _mm512_slli_epi64(hi, 8)), (const void *)IQ1S_GRID, 8);
        __mmask8 minus = 0;
        for (int l = 0; l < 8; l++) minus |= (__mmask8)(((nib >> (4 * l + 3)) & 1) << l);
        const __m512i delta = _mm512_mask_blend_epi64(minus, _mm512_set1_epi8(1), _mm512_set1_epi8(-1));
        pair_from_signed(iq1_values_x8(grid, delta), s, c);
        s->sc[c] = scales4(2 * (word & 7) + 1, 2 * ((word >> 3) & 7) + 1, 2 * ((word >> 6) & 7) + 1,
                           2 * ((word >> 9) & 7) + 1);
    }
    s->d = f16_to_f32(d_bits) * 0.125f;
}

/* TQ1_0's digits (iq_unpack.h): digit k of byte v is (3p) >> 8 for p = v * 3^k mod 256, in {0, 1, 2}.
 * Bytes 0-31 give elements 32k + j, bytes 32-47 give 160 + 16k + j, bytes 48-51 give 240 + 4k + j,
 * so the four chunks of 64 elements are the digits of [v, 3v], [9v, 27v], [81v, m, 3m] and
 * [9m, 27m, 81m, t, 3t, 9t, 27t] (v, m, t: bytes 0-31, 32-47, 48-51; t's four products 4 bytes each).
 *
 * The digits of the bytes of a times c (int16 lane i: both its bytes times c[i]), in 16-bit
 * arithmetic: with p = lo * c mod 256, p << 8 = a * (c << 8) mod 2^16 and mulhi(p << 8, 3) = (3p) >> 8;
 * with q = hi * c mod 256, q << 8 = (a & 0xFF00) * c mod 2^16 and mulhi(q << 8, 768) = 3q, whose
 * high byte is (3q) >> 8. */
static inline __m512i tq1_digits_times(__m512i a, __m512i c) {
    const __m512i high = _mm512_set1_epi16((short)0xFF00);
    const __m512i lo = _mm512_mulhi_epu16(_mm512_mullo_epi16(a, _mm512_slli_epi16(c, 8)), _mm512_set1_epi16(3));
    const __m512i hi = _mm512_mulhi_epu16(_mm512_mullo_epi16(_mm512_and_si512(a, high), c), _mm512_set1_epi16(768));
    return _mm512_ternarylogic_epi32(lo, hi, high, 0xF8); /* lo | (hi & high) */
}

/* int16 lanes 0-15 = lo, 16-31 = hi. */
static inline __m512i halves16(short lo, short hi) {
    return _mm512_inserti64x4(_mm512_set1_epi16(lo), _mm256_set1_epi16(hi), 1);
}

static inline void codes_tq1_0(const uint8_t *b, __m512i digits[4]) {
    const __m512i vv = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)b));
    const __m128i m = _mm_loadu_si128((const __m128i *)(b + 32));
    const __m512i vmm = _mm512_inserti64x4(vv, _mm256_broadcastsi128_si256(m), 1);
    const __m512i mmmt = _mm512_mask_set1_epi32(_mm512_broadcast_i32x4(m), 0xF000, (int)rd32(b + 48));
    digits[0] = tq1_digits_times(vv, halves16(1, 3));
    digits[1] = tq1_digits_times(vv, halves16(9, 27));
    digits[2] = tq1_digits_times(vmm, _mm512_set_epi16(3, 3, 3, 3, 3, 3, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, 81, 81, 81, 81, 81,
                                                       81, 81, 81, 81, 81, 81, 81, 81, 81, 81, 81));
    digits[3] = tq1_digits_times(mmmt, _mm512_set_epi16(27, 27, 9, 9, 3, 3, 1, 1, 81, 81, 81, 81, 81, 81, 81, 81, 27,
                                                        27, 27, 27, 27, 27, 27, 27, 9, 9, 9, 9, 9, 9, 9, 9));
}

static inline void pairs_tq1_0(const uint8_t *b, pairs_t *s) {
    __m512i digits[4];
    codes_tq1_0(b, digits);
    for (int c = 0; c < 4; c++) {
        pair_from_signed(_mm512_sub_epi8(digits[c], _mm512_set1_epi8(1)), s, c);
        s->sc[c] = _mm512_set1_epi16(1);
    }
    s->d = f16_at(b + 52);
}

/* The ternary formats, integer mode: S = sum of (code - 1) * x = sum of code * x (codes 0-3, u8 x s8
 * through vpdpbusd) minus the sum of the 256 x (the 16 bsums), exact in int32 as generic.c's. */
typedef void (*codes_fn)(const uint8_t *, __m512i *);

static inline __attribute__((always_inline)) void ternary_body(ROWS_ARGS, int bytes, int d_at, codes_fn decode) {
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w + r * rb;
        float acc[MAX_T] = {0};
        for (int64_t b = 0; b < n / 256; b++) {
            __m512i code[4];
            prefetch_ahead(row + b * bytes, bytes);
            decode(row + b * bytes, code);
            const float d = f16_at(row + b * bytes + d_at);
            for (int t = 0; t < T; t++) {
                const q8k_t *y = (const q8k_t *)xs[t] + b;
                __m512i sum = _mm512_sub_epi32(_mm512_setzero_si512(),
                                               _mm512_cvtepi16_epi32(_mm256_loadu_si256((const __m256i *)y->bsums)));
                for (int c = 0; c < 4; c++)
                    sum = _mm512_dpbusd_epi32(sum, code[c], _mm512_loadu_si512((const void *)(y->qs + 64 * c)));
                acc[t] += (y->d * d) * (float)_mm512_reduce_add_epi32(sum);
            }
        }
        for (int t = 0; t < T; t++) ys[t][r] = acc[t];
    }
}

/* The sums of the 16 int32 lanes of a, b, c and d, in dwords 0-3: pairs of lanes summed within each
 * 128-bit lane (unpack), then the four 128-bit lanes. */
static inline __m128i sum4_epi32(__m512i a, __m512i b, __m512i c, __m512i d) {
    const __m512i ab = _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b));
    const __m512i cd = _mm512_add_epi32(_mm512_unpacklo_epi32(c, d), _mm512_unpackhi_epi32(c, d));
    const __m512i abcd = _mm512_add_epi32(_mm512_unpacklo_epi64(ab, cd), _mm512_unpackhi_epi64(ab, cd));
    const __m256i half = _mm256_add_epi32(_mm512_castsi512_si256(abcd), _mm512_extracti64x4_epi64(abcd, 1));
    return _mm_add_epi32(_mm256_castsi256_si128(half), _mm256_extracti128_si256(half, 1));
}

/* T = 1 or 2, rows r .. r + 3 together: the 4 rows' sums reduced at once, and each row's fp32 steps
 * in its own lane, the same operations in the same order as ternary_body's. */
static inline __attribute__((always_inline)) void ternary_rows4(const uint8_t *w, size_t rb, int64_t r, int64_t n,
                                                               const void *const *xs, int T, float *const *ys,
                                                               int bytes, int d_at, codes_fn decode) {
    __m128 acc[2] = {_mm_setzero_ps(), _mm_setzero_ps()};
    for (int64_t b = 0; b < n / 256; b++) {
        const uint8_t *blk = w + r * rb + b * bytes;
        const q8k_t *y[2];
        __m512i x[2][4], start[2], sum[2][4];
        for (int t = 0; t < T; t++) {
            y[t] = (const q8k_t *)xs[t] + b;
            for (int c = 0; c < 4; c++) x[t][c] = _mm512_loadu_si512((const void *)(y[t]->qs + 64 * c));
            start[t] = _mm512_sub_epi32(_mm512_setzero_si512(),
                                        _mm512_cvtepi16_epi32(_mm256_loadu_si256((const __m256i *)y[t]->bsums)));
        }
        for (int i = 0; i < 4; i++) {
            __m512i code[4];
            decode(blk + i * rb, code);
            for (int t = 0; t < T; t++) {
                sum[t][i] = start[t];
                for (int c = 0; c < 4; c++) sum[t][i] = _mm512_dpbusd_epi32(sum[t][i], code[c], x[t][c]);
            }
        }
        const uint64_t d16 = rd16(blk + d_at) | (uint64_t)rd16(blk + rb + d_at) << 16 |
                             (uint64_t)rd16(blk + 2 * rb + d_at) << 32 | (uint64_t)rd16(blk + 3 * rb + d_at) << 48;
        const __m128 d = _mm_cvtph_ps(_mm_cvtsi64_si128((long long)d16));
        for (int t = 0; t < T; t++) {
            const __m128 S = _mm_cvtepi32_ps(sum4_epi32(sum[t][0], sum[t][1], sum[t][2], sum[t][3]));
            acc[t] = _mm_add_ps(acc[t], _mm_mul_ps(_mm_mul_ps(_mm_set1_ps(y[t]->d), d), S));
        }
    }
    for (int t = 0; t < T; t++) _mm_storeu_ps(ys[t] + r, acc[t]);
}

static inline __attribute__((always_inline)) void ternary_rows(ROWS_ARGS, int bytes, int d_at, codes_fn decode) {
    int64_t r = r0;
    if (T == 1)
        for (; r + 4 <= r1; r += 4) ternary_rows4(w, rb, r, n, xs, 1, ys, bytes, d_at, decode);
    else if (T == 2)
        for (; r + 4 <= r1; r += 4) ternary_rows4(w, rb, r, n, xs, 2, ys, bytes, d_at, decode);
    ternary_body(w, rb, r, r1, n, xs, T, ys, bytes, d_at, decode);
}

/* IQ1_S, integer mode: q = 8 g + delta_k (g in {-1, 0, 1} from the grid, delta_k = +-1 per run k of
 * 32), so S = sum_k sc_k (8 sum (g + 1) x + (delta_k - 8) sum x): g + 1 as u8 through vpmaddubsw,
 * 8 sc_k through vpdpwssd, and the runs' activation sums (two bsums each) times sc_k (delta_k - 8).
 * The same int32 S as generic.c's. */
typedef struct {
    __m512i g1[4], sc[4]; /* pair c: unsigned bytes times x (here g + 1); int16 scales (8 sc_k), 16 lanes per run */
    __m512i coef;         /* int16 lanes 0-15: times bsums (here sc_k (delta_k - 8) in 2k, 2k + 1); 16-31 zero */
    float d;
} iq1_int_t;

static inline void iq1_s_int_parts(const uint8_t *b, iq1_int_t *s) {
    const __m128i qh = _mm_loadu_si128((const __m128i *)(b + 34)); /* run k's uint16 */
    const __m128i sc = _mm_add_epi16(_mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(qh, 12), _mm_set1_epi16(7)), 1),
                                     _mm_set1_epi16(1));
    const __m128i dm8 = _mm_add_epi16(_mm_set1_epi16(-7), _mm_slli_epi16(_mm_srai_epi16(qh, 15), 1)); /* -7 or -9 */
    const __m128i coef = _mm_mullo_epi16(sc, dm8);
    s->coef = _mm512_zextsi256_si512(
        _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_unpacklo_epi16(coef, coef)), _mm_unpackhi_epi16(coef, coef), 1));
    const __m512i sc8 = _mm512_castsi128_si512(_mm_slli_epi16(sc, 3));
    const __m512i half = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(1), 1);
    for (int c = 0; c < 4; c++) s->sc[c] = _mm512_permutexvar_epi16(_mm512_add_epi16(half, _mm512_set1_epi16((short)(2 * c))), sc8);
    /* group 4k + l's index: qs byte 4k + l, then bits 3l .. 3l + 2 of run k's uint16 */
    const __m512i qh32 = _mm512_castsi256_si512(_mm256_cvtepu16_epi32(qh));
    const __m512i shift = _mm512_set_epi32(9, 6, 3, 0, 9, 6, 3, 0, 9, 6, 3, 0, 9, 6, 3, 0);
    const __m512i run = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    for (int h = 0; h < 2; h++) { /* runs 4h .. 4h + 3 */
        const __m512i lo = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + 2 + 16 * h)));
        const __m512i k = _mm512_add_epi32(run, _mm512_set1_epi32(4 * h));
        const __m512i hi = _mm512_and_si512(_mm512_srlv_epi32(_mm512_permutexvar_epi32(k, qh32), shift), _mm512_set1_epi32(7));
        const __m512i idx = _mm512_or_si512(lo, _mm512_slli_epi32(hi, 8));
        const __m512i one = _mm512_set1_epi8(1);
        s->g1[2 * h] = _mm512_add_epi8(_mm512_i32gather_epi64(_mm512_castsi512_si256(idx), (const void *)IQ1S_GRID, 8), one);
        s->g1[2 * h + 1] = _mm512_add_epi8(_mm512_i32gather_epi64(_mm512_extracti64x4_epi64(idx, 1), (const void *)IQ1S_GRID, 8), one);
    }
    s->d = f16_at(b) * 0.125f;
}

/* IQ1_M, integer mode: q + 9 = 8 g + delta + 9 (in 0-18, delta = +-1 per 8 elements) as u8 through
 * vpmaddubsw, its 16 scales sc_G through vpdpwssd, and -9 sc_G times the bsums. */
static inline void iq1_m_int_parts(const uint8_t *b, iq1_int_t *s) {
    const uint64_t words = rd64(b + 48); /* 4 uint16: scales 4k .. 4k + 3 (3 bits each), a nibble of d */
    const uint16_t d_bits = (uint16_t)(((words >> 12) & 0xF) | ((words >> 24) & 0xF0) | ((words >> 36) & 0xF00) |
                                       ((words >> 48) & 0xF000));
    const __m256i w16 = _mm256_permutexvar_epi16(
        _mm256_setr_epi16(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3), _mm256_castsi128_si256(_mm_cvtsi64_si128((long long)words)));
    __m256i sc = _mm256_and_si256(_mm256_srlv_epi16(w16, _mm256_setr_epi16(0, 3, 6, 9, 0, 3, 6, 9, 0, 3, 6, 9, 0, 3, 6, 9)),
                                  _mm256_set1_epi16(7));
    sc = _mm256_add_epi16(_mm256_add_epi16(sc, sc), _mm256_set1_epi16(1));
    s->coef = _mm512_zextsi256_si512(_mm256_mullo_epi16(sc, _mm256_set1_epi16(-9)));
    const __m512i which = _mm512_srli_epi16(
        _mm512_set_epi16(31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16, 15, 14, 13, 12, 11, 10, 9, 8,
                         7, 6, 5, 4, 3, 2, 1, 0),
        3);
    for (int c = 0; c < 4; c++)
        s->sc[c] = _mm512_permutexvar_epi16(_mm512_add_epi16(which, _mm512_set1_epi16((short)(4 * c))), _mm512_castsi256_si512(sc));
    const __m512i shifts = _mm512_setr_epi64(0, 4, 8, 12, 16, 20, 24, 28);
    for (int c = 0; c < 4; c++) {
        /* group 8c + l: index qs byte, then bits 4l .. 4l + 2 of the pair's uint32 at 32 + 4c; bit 4l + 3 the delta's sign */
        const __m512i nib = _mm512_srlv_epi64(_mm512_set1_epi64(rd32(b + 32 + 4 * c)), shifts);
        const __m512i lo = _mm512_cvtepu8_epi64(_mm_loadl_epi64((const __m128i *)(b + 8 * c)));
        const __m512i idx = _mm512_or_si512(lo, _mm512_slli_epi64(_mm512_and_si512(nib, _mm512_set1_epi64(7)), 8));
        const __m512i grid = _mm512_i64gather_epi64(idx, (const void *)IQ1S_GRID, 8);
        const __mmask8 minus = _mm512_test_epi64_mask(nib, _mm512_set1_epi64(8));
        const __m512i delta9 = _mm512_mask_blend_epi64(minus, _mm512_set1_epi8(10), _mm512_set1_epi8(8)); /* delta + 9 */
        s->g1[c] = iq1_values_x8(grid, delta9);
    }
    s->d = f16_to_f32(d_bits) * 0.125f;
}

typedef void (*iq1_parts_fn)(const uint8_t *, iq1_int_t *);

static inline __attribute__((always_inline)) void iq1_body(ROWS_ARGS, int bytes, iq1_parts_fn decode) {
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w + r * rb;
        float acc[MAX_T] = {0};
        for (int64_t b = 0; b < n / 256; b++) {
            iq1_int_t s;
            prefetch_ahead(row + b * bytes, bytes);
            decode(row + b * bytes, &s);
            for (int t = 0; t < T; t++) {
                const q8k_t *y = (const q8k_t *)xs[t] + b;
                const __m512i bsums = _mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i *)y->bsums));
                __m512i sum = _mm512_dpwssd_epi32(_mm512_setzero_si512(), bsums, s.coef);
                for (int c = 0; c < 4; c++) {
                    const __m512i x = _mm512_loadu_si512((const void *)(y->qs + 64 * c));
                    sum = _mm512_dpwssd_epi32(sum, _mm512_maddubs_epi16(s.g1[c], x), s.sc[c]);
                }
                acc[t] += (y->d * s.d) * (float)_mm512_reduce_add_epi32(sum);
            }
        }
        for (int t = 0; t < T; t++) ys[t][r] = acc[t];
    }
}

#define TERNARY_FORMAT(name, bytes, d_at)                                                              \
    static void name##_int(ROWS_ARGS) {                                                                \
        ternary_rows(w, rb, r0, r1, n, xs, T, ys, bytes, d_at, codes_##name);                            \
    }                                                                                                  \
    PAIRS_EXACT(name, bytes)
#define IQ1_FORMAT(name, bytes)                                                                        \
    static void name##_int(ROWS_ARGS) {                                                                \
        if (T == 1) iq1_body(w, rb, r0, r1, n, xs, 1, ys, bytes, name##_int_parts);                     \
        else iq1_body(w, rb, r0, r1, n, xs, T, ys, bytes, name##_int_parts);                            \
    }                                                                                                  \
    PAIRS_EXACT(name, bytes)
IQ1_FORMAT(iq1_s, 50)
IQ1_FORMAT(iq1_m, 56)
TERNARY_FORMAT(tq2_0, 66, 64)
TERNARY_FORMAT(tq1_0, 54, 52)

#define SET(F, name) (FMT[F].integer = name##_int, FMT[F].exact = name##_exact)
void init_avx512_ternary(void) {
    SET(F_TQ2_0, tq2_0);
    SET(F_IQ1_S, iq1_s);
    SET(F_IQ1_M, iq1_m);
    SET(F_TQ1_0, tq1_0);
}
#else
void init_avx512_ternary(void) {}
#endif
