/* The 32-element blocks of q4_1, q5_0, q5_1 and iq4_nl and IQ4's values decoded with AVX2, shared by
 * the avx2 and avx512 variants' kernels of them (avx2_iq4.c, avx512_iq4.c). Include after
 * <immintrin.h>, inside code compiled with AVX2 enabled. */
#ifndef MOERUN_IQ4_AVX2_H
#define MOERUN_IQ4_AVX2_H
#include "common.h"
#include "iq_tables.h"

static inline int32_t hsum_i32(__m256i v) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 1));
    return _mm_cvtsi128_si32(s);
}

/* 16 bytes of nibbles -> 32 bytes: low nibbles (elements 0-15), then high (16-31). */
static inline __m256i nibbles(const uint8_t *p) {
    const __m128i m4 = _mm_set1_epi8(0x0F), v = _mm_loadu_si128((const __m128i *)p);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m4), _mm_and_si128(v, m4));
}

/* Byte j: 0x10 where bit j of the little-endian uint32 at p is set (ggml's bytes_from_bits_32). */
static inline __m256i fifth_bits(const uint8_t *p) {
    uint32_t bits;
    memcpy(&bits, p, 4);
    const __m256i spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32((int)bits),
        _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0x0000000000000000));
    const __m256i set = _mm256_cmpeq_epi8(_mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe)),
                                          _mm256_set1_epi64x(-1));
    return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
}

/* IQ4's 16 values looked up from nibbles (signed bytes). */
static inline __m256i iq4_values(const uint8_t *p) {
    const __m256i table = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)KVALUES_IQ4NL));
    return _mm256_shuffle_epi8(table, nibbles(p));
}

/* One block's weights: unsigned codes (q4_1 in [0, 15], q5_* in [0, 31]; q5_0's offset of 16 comes
 * off through the activations' sum) or IQ4_NL's signed values; d, and m (q4_1, q5_1). */
static inline __m256i b32_codes(const uint8_t *blk, int kind, float *d, float *m) {
    *d = f16_at(blk);
    switch (kind) {
    case F_Q4_1:
        *m = f16_at(blk + 2);
        return nibbles(blk + 4);
    case F_Q5_0:
        return _mm256_or_si256(nibbles(blk + 6), fifth_bits(blk + 2));
    case F_Q5_1:
        *m = f16_at(blk + 2);
        return _mm256_or_si256(nibbles(blk + 8), fifth_bits(blk + 4));
    default: /* F_IQ4_NL */
        return iq4_values(blk + 2);
    }
}

/* sum of w * x over 32 bytes: w unsigned (< 128), or signed (then |w| times x with w's sign). */
static inline __m256i dot32(__m256i wv, __m256i x, int is_signed) {
    const __m256i p = is_signed ? _mm256_maddubs_epi16(_mm256_sign_epi8(wv, wv), _mm256_sign_epi8(x, wv))
                                : _mm256_maddubs_epi16(wv, x);
    return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
}

/* IQ4_XS's 8 sub-block scales ls - 32 as int32 lanes: ls's low nibble from bytes 4-7 (two a byte,
 * low first), its top 2 bits from the uint16 at byte 2. */
static inline __m256i iq4_xs_scales(const uint8_t *blk) {
    uint32_t low;
    memcpy(&low, blk + 4, 4);
    const __m256i lo = _mm256_and_si256(
        _mm256_srlv_epi32(_mm256_set1_epi32((int)low), _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28)),
        _mm256_set1_epi32(15));
    const __m256i hi = _mm256_and_si256(
        _mm256_srlv_epi32(_mm256_set1_epi32(rd16(blk + 2)), _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14)),
        _mm256_set1_epi32(3));
    return _mm256_sub_epi32(_mm256_or_si256(lo, _mm256_slli_epi32(hi, 4)), _mm256_set1_epi32(32));
}

static inline int b32_bytes(int kind) {
    return kind == F_Q4_1 ? 20 : kind == F_Q5_0 ? 22 : kind == F_Q5_1 ? 24 : 18;
}

#endif
