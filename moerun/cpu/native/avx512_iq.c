/* AVX-512 kernels of the grid i-quants (iq2_xxs, iq2_xs, iq2_s, iq3_xxs, iq3_s), exact mode and
 * integer mode (x q8_K): the same bits as generic.c's (and avx2_iq.c's): per super-block the exact
 * int32 S = sum of sc * dot, then acc += (yd * d) * S in fp32. Two runs of 32 elements per zmm: grid
 * entries gathered (vpgatherqq / vpgatherdd), the sign bits as a mask that negates the activations,
 * u8 x s8 pairs (vpmaddubsw) and the scales in int32 (vpdpwssd). The ternary formats and IQ1 are in
 * avx512_ternary.c. */
#include "avx512_pairs.h"

#ifdef MOERUN_AVX512

/* Bit 7 of each byte (each below 128): the parity of its low 7 bits, as ksigns_iq2xs[v] = v | parity(v) << 7. */
static inline __m256i with_parity_bit(__m256i v) {
    const __m256i par = _mm256_broadcastsi128_si256(
        _mm_setr_epi8(0, -128, -128, 0, -128, 0, 0, -128, -128, 0, 0, -128, 0, -128, -128, 0)); /* parity(i) << 7 */
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const __m256i lo = _mm256_shuffle_epi8(par, _mm256_and_si256(v, m4));
    const __m256i hi = _mm256_shuffle_epi8(par, _mm256_and_si256(_mm256_srli_epi16(v, 4), m4));
    return _mm256_or_si256(v, _mm256_xor_si256(lo, hi));
}

/* IQ2_XXS / IQ3_XXS: the 8 runs' uint32 aux words (run k's in dword lane `stride` * k + `first` of
 * `aux`) -> the four pairs' sign masks (run 2c's four 7-bit fields at bits 0, 7, 14, 21 through
 * ksigns_iq2xs -> bytes 0-3 of mask c, run 2c + 1's -> bytes 4-7) and int16 scales 2 (aux >> 28) + 1. */
static inline void signs_scales_x8(__m512i aux, int stride, int first, pairs_t *s) {
    const __m512i run = _mm512_add_epi32(
        _mm512_mullo_epi32(_mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0), _mm512_set1_epi32(stride)),
        _mm512_set1_epi32(first));
    const __m512i shift = _mm512_set_epi32(21, 14, 7, 0, 21, 14, 7, 0, 21, 14, 7, 0, 21, 14, 7, 0);
    const __m512i f7 = _mm512_set1_epi32(127);
    const __m512i lo = _mm512_and_si512(_mm512_srlv_epi32(_mm512_permutexvar_epi32(run, aux), shift), f7);
    const __m512i later = _mm512_add_epi32(run, _mm512_set1_epi32(4 * stride)); /* runs 4-7 */
    const __m512i hi = _mm512_and_si512(_mm512_srlv_epi32(_mm512_permutexvar_epi32(later, aux), shift), f7);
    const __m256i bytes = with_parity_bit(
        _mm256_inserti128_si256(_mm256_castsi128_si256(_mm512_cvtepi32_epi8(lo)), _mm512_cvtepi32_epi8(hi), 1));
    const __m128i b01 = _mm256_castsi256_si128(bytes), b23 = _mm256_extracti128_si256(bytes, 1);
    s->neg[0] = (__mmask64)_mm_cvtsi128_si64(b01), s->neg[1] = (__mmask64)_mm_extract_epi64(b01, 1);
    s->neg[2] = (__mmask64)_mm_cvtsi128_si64(b23), s->neg[3] = (__mmask64)_mm_extract_epi64(b23, 1);
    /* int16 lane 2 (stride * k + first) holds run k's scale */
    const __m512i sc = _mm512_add_epi32(_mm512_slli_epi32(_mm512_srli_epi32(aux, 28), 1), _mm512_set1_epi32(1));
    const __m512i half = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16((short)(2 * stride)), 1);
    for (int c = 0; c < 4; c++) {
        const __m512i which = _mm512_add_epi16(half, _mm512_set1_epi16((short)(2 * (2 * c * stride + first))));
        s->sc[c] = _mm512_permutexvar_epi16(which, sc);
    }
}

static inline void pairs_iq2_xxs(const uint8_t *b, pairs_t *s) {
    /* run k: 4 index bytes (dword 2k of the 64 bytes at b + 2), then its uint32 aux (dword 2k + 1) */
    signs_scales_x8(_mm512_loadu_si512((const void *)(b + 2)), 2, 1, s);
    for (int c = 0; c < 4; c++) {
        const __m128i runs = _mm_loadu_si128((const __m128i *)(b + 2 + 16 * c)); /* runs 2c, 2c + 1 */
        const __m512i idx = _mm512_cvtepu8_epi64(_mm_shuffle_epi32(runs, _MM_SHUFFLE(3, 3, 2, 0)));
        s->mag[c] = _mm512_i64gather_epi64(idx, (const void *)IQ2XXS_GRID, 8);
    }
    s->d = f16_at(b) * 0.125f;
}

/* 16 odd scales 2s + 1 from 4-bit fields (two per byte at p, low nibble first; one per 16 elements)
 * -> pair c's int16 lanes: 8i .. 8i + 7 = scale 4c + i. */
static inline void odd_scales_x16(const uint8_t *p, pairs_t *s) {
    const __m128i v = _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)p));
    const __m128i lo = _mm_and_si128(v, _mm_set1_epi16(0xF)), hi = _mm_srli_epi16(v, 4);
    __m256i sc = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_unpacklo_epi16(lo, hi)), _mm_unpackhi_epi16(lo, hi), 1);
    sc = _mm256_add_epi16(_mm256_add_epi16(sc, sc), _mm256_set1_epi16(1));
    const __m512i which = _mm512_srli_epi16(
        _mm512_set_epi16(31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16, 15, 14, 13, 12, 11, 10, 9, 8,
                         7, 6, 5, 4, 3, 2, 1, 0),
        3);
    for (int c = 0; c < 4; c++)
        s->sc[c] = _mm512_permutexvar_epi16(_mm512_add_epi16(which, _mm512_set1_epi16((short)(4 * c))),
                                            _mm512_castsi256_si512(sc));
}

static inline void pairs_iq2_xs(const uint8_t *b, pairs_t *s) {
    /* 32 uint16: a 9-bit grid index, then a 7-bit index into ksigns_iq2xs */
    const __m512i words = _mm512_loadu_si512((const void *)(b + 2));
    const __m256i signs = with_parity_bit(_mm512_cvtepi16_epi8(_mm512_srli_epi16(words, 9)));
    const __m128i s01 = _mm256_castsi256_si128(signs), s23 = _mm256_extracti128_si256(signs, 1);
    s->neg[0] = (__mmask64)_mm_cvtsi128_si64(s01), s->neg[1] = (__mmask64)_mm_extract_epi64(s01, 1);
    s->neg[2] = (__mmask64)_mm_cvtsi128_si64(s23), s->neg[3] = (__mmask64)_mm_extract_epi64(s23, 1);
    const __m512i idx = _mm512_and_si512(words, _mm512_set1_epi16(511));
    for (int c = 0; c < 4; c++) {
        const __m512i i64 = _mm512_cvtepu16_epi64(_mm512_extracti32x4_epi32(idx, c));
        s->mag[c] = _mm512_i64gather_epi64(i64, (const void *)IQ2XS_GRID, 8);
    }
    odd_scales_x16(b + 66, s);
    s->d = f16_at(b) * 0.125f;
}

static inline void pairs_iq2_s(const uint8_t *b, pairs_t *s) {
    const __m512i shifts = _mm512_setr_epi64(0, 2, 4, 6, 8, 10, 12, 14);
    for (int c = 0; c < 4; c++) {
        const __m512i lo = _mm512_cvtepu8_epi64(_mm_loadl_epi64((const __m128i *)(b + 2 + 8 * c)));
        const __m512i hi = _mm512_and_si512(_mm512_srlv_epi64(_mm512_set1_epi64(rd16(b + 66 + 2 * c)), shifts),
                                            _mm512_set1_epi64(3));
        s->mag[c] = _mm512_i64gather_epi64(_mm512_or_si512(lo, _mm512_slli_epi64(hi, 8)), (const void *)IQ2S_GRID, 8);
        s->neg[c] = (__mmask64)rd64(b + 34 + 8 * c);
    }
    odd_scales_x16(b + 74, s);
    s->d = f16_at(b) * 0.125f;
}

static inline void pairs_iq3_xxs(const uint8_t *b, pairs_t *s) {
    signs_scales_x8(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(b + 66))), 1, 0, s); /* run k's aux */
    for (int c = 0; c < 4; c++) {
        const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + 2 + 16 * c)));
        s->mag[c] = _mm512_i32gather_epi32(idx, (const void *)IQ3XXS_GRID, 4);
    }
    s->d = f16_at(b) * 0.25f;
}

static inline void pairs_iq3_s(const uint8_t *b, pairs_t *s) {
    for (int c = 0; c < 4; c++) {
        __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + 2 + 16 * c)));
        idx = _mm512_or_si512(idx, _mm512_maskz_set1_epi32((__mmask16)rd16(b + 66 + 2 * c), 256)); /* bit 8 */
        s->mag[c] = _mm512_i32gather_epi32(idx, (const void *)IQ3S_GRID, 4);
        s->neg[c] = (__mmask64)rd64(b + 74 + 8 * c);
        const int la = 2 * (b[106 + c] & 0xF) + 1, lb = 2 * (b[106 + c] >> 4) + 1;
        s->sc[c] = scales4(la, la, lb, lb);
    }
    s->d = f16_at(b);
}

static inline __attribute__((always_inline)) void pairs_body(ROWS_ARGS, int bytes, pairs_fn decode) {
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w + r * rb;
        float acc[MAX_T] = {0};
        for (int64_t b = 0; b < n / 256; b++) {
            pairs_t s;
            prefetch_ahead(row + b * bytes, bytes);
            decode(row + b * bytes, &s);
            for (int t = 0; t < T; t++) {
                const q8k_t *y = (const q8k_t *)xs[t] + b;
                __m512i sum = _mm512_setzero_si512();
                for (int c = 0; c < 4; c++) {
                    __m512i x = _mm512_loadu_si512((const void *)(y->qs + 64 * c));
                    x = _mm512_mask_sub_epi8(x, s.neg[c], _mm512_setzero_si512(), x);
                    sum = _mm512_dpwssd_epi32(sum, _mm512_maddubs_epi16(s.mag[c], x), s.sc[c]);
                }
                acc[t] += (y->d * s.d) * (float)_mm512_reduce_add_epi32(sum);
            }
        }
        for (int t = 0; t < T; t++) ys[t][r] = acc[t];
    }
}

#define PAIRS_FORMAT(name, bytes)                                                                      \
    static void name##_int(ROWS_ARGS) {                                                                \
        if (T == 1) pairs_body(w, rb, r0, r1, n, xs, 1, ys, bytes, pairs_##name);                       \
        else pairs_body(w, rb, r0, r1, n, xs, T, ys, bytes, pairs_##name);                              \
    }                                                                                                  \
    PAIRS_EXACT(name, bytes)
PAIRS_FORMAT(iq2_xxs, 66)
PAIRS_FORMAT(iq2_xs, 74)
PAIRS_FORMAT(iq2_s, 82)
PAIRS_FORMAT(iq3_xxs, 98)
PAIRS_FORMAT(iq3_s, 110)

#define SET(F, name) (FMT[F].integer = name##_int, FMT[F].exact = name##_exact)
void init_avx512_iq(void) {
    SET(F_IQ2_XXS, iq2_xxs);
    SET(F_IQ2_XS, iq2_xs);
    SET(F_IQ2_S, iq2_s);
    SET(F_IQ3_XXS, iq3_xxs);
    SET(F_IQ3_S, iq3_s);
}
#else
void init_avx512_iq(void) {}
#endif
