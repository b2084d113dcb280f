/* The i-quants' and the ternary formats' 256-element super-blocks unpacked into the k-quants' form
 * (generic.c's): value i = d * sc[i / 16] * q[i], no min. As moerun.quant.iquants: d is the block's
 * fp16 scale times the format's power-of-two factor (1/8 for IQ2_* and IQ1_*, 1/4 for IQ3_XXS),
 * odd scales 2s + 1 where ggml has (s + 1/2), IQ1's grid values times 8 plus or minus 1; every
 * product is exact in fp32. A scale per 32 (or one per block) is repeated per 16. Layouts are
 * ggml's (ggml-common.h); the tables come from moerun.quant.iq_tables through the generated
 * iq_tables.h. */
#ifndef MOERUN_IQ_UNPACK_H
#define MOERUN_IQ_UNPACK_H
#include "common.h"
#include "iq_tables.h"

static inline uint32_t rd32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* 8 grid values with signs: bit j of `signs` set negates value j. */
static inline void signed8(const int8_t *grid, uint8_t signs, int8_t *q) {
    for (int j = 0; j < 8; j++) q[j] = (int8_t)(signs >> j & 1 ? -grid[j] : grid[j]);
}

static inline void scales_per_32(const int s[8], int16_t sc[16]) {
    for (int i = 0; i < 8; i++) sc[2 * i] = sc[2 * i + 1] = (int16_t)s[i];
}

/* 4-bit scales, two per byte (low nibble first), as odd 2s + 1, one per 16. */
static inline void odd_nibble_scales(const uint8_t *p, int count, int16_t *sc) {
    for (int i = 0; i < count; i++) sc[i] = (int16_t)(2 * ((p[i / 2] >> (4 * (i % 2))) & 0xF) + 1);
}

static inline void unpack_iq2_xxs(const uint8_t *b, int8_t q[256], int16_t sc[16], int16_t mn[16], float *d,
                                  float *dmin) {
    int s[8];
    for (int ib = 0; ib < 8; ib++) {
        const uint8_t *idx = b + 2 + 8 * ib;
        const uint32_t aux = rd32(idx + 4);
        for (int l = 0; l < 4; l++) signed8(IQ2XXS_GRID[idx[l]], KSIGNS_IQ2XS[(aux >> (7 * l)) & 127], q + 32 * ib + 8 * l);
        s[ib] = 2 * (int)(aux >> 28) + 1;
    }
    scales_per_32(s, sc);
    memset(mn, 0, 16 * sizeof *mn);
    *d = f16_at(b) * 0.125f;
    *dmin = 0;
}

static inline void unpack_iq2_xs(const uint8_t *b, int8_t q[256], int16_t sc[16], int16_t mn[16], float *d,
                                 float *dmin) {
    for (int l = 0; l < 32; l++) {
        const uint16_t word = rd16(b + 2 + 2 * l);
        signed8(IQ2XS_GRID[word & 511], KSIGNS_IQ2XS[word >> 9], q + 8 * l);
    }
    odd_nibble_scales(b + 66, 16, sc);
    memset(mn, 0, 16 * sizeof *mn);
    *d = f16_at(b) * 0.125f;
    *dmin = 0;
}

static inline void unpack_iq2_s(const uint8_t *b, int8_t q[256], int16_t sc[16], int16_t mn[16], float *d,
                                float *dmin) {
    const uint8_t *qs = b + 2, *signs = b + 34, *qh = b + 66;
    for (int l = 0; l < 32; l++) {
        const int index = qs[l] | ((qh[l / 4] >> (2 * (l % 4))) & 3) << 8;
        signed8(IQ2S_GRID[index], signs[l], q + 8 * l);
    }
    odd_nibble_scales(b + 74, 16, sc);
    memset(mn, 0, 16 * sizeof *mn);
    *d = f16_at(b) * 0.125f;
    *dmin = 0;
}

static inline void unpack_iq3_xxs(const uint8_t *b, int8_t q[256], int16_t sc[16], int16_t mn[16], float *d,
                                  float *dmin) {
    const uint8_t *qs = b + 2;
    int s[8];
    for (int ib = 0; ib < 8; ib++) {
        const uint32_t aux = rd32(b + 66 + 4 * ib);
        for (int l = 0; l < 4; l++) {
            int8_t grid[8];
            memcpy(grid, IQ3XXS_GRID[qs[8 * ib + 2 * l]], 4);
            memcpy(grid + 4, IQ3XXS_GRID[qs[8 * ib + 2 * l + 1]], 4);
            signed8(grid, KSIGNS_IQ2XS[(aux >> (7 * l)) & 127], q + 32 * ib + 8 * l);
        }
        s[ib] = 2 * (int)(aux >> 28) + 1;
    }
    scales_per_32(s, sc);
    memset(mn, 0, 16 * sizeof *mn);
    *d = f16_at(b) * 0.25f;
    *dmin = 0;
}

static inline void unpack_iq3_s(const uint8_t *b, int8_t q[256], int16_t sc[16], int16_t mn[16], float *d,
                                float *dmin) {
    const uint8_t *qs = b + 2, *qh = b + 66, *signs = b + 74;
    for (int l = 0; l < 32; l++) { /* 8 values: grid entries 2l and 2l + 1 */
        int8_t grid[8];
        for (int h = 0; h < 2; h++) {
            const int k = 2 * l + h, index = qs[k] | ((qh[k / 8] >> (k % 8)) & 1) << 8;
            memcpy(grid + 4 * h, IQ3S_GRID[index], 4);
        }
        signed8(grid, signs[l], q + 8 * l);
    }
    int s[8];
    for (int i = 0; i < 8; i++) s[i] = 2 * ((b[106 + i / 2] >> (4 * (i % 2))) & 0xF) + 1;
    scales_per_32(s, sc);
    memset(mn, 0, 16 * sizeof *mn);
    *d = f16_at(b);
    *dmin = 0;
}

/* IQ1's values: 8 * grid + 1, or 8 * grid - 1 where the delta is negative. */
static inline void iq1_values(const int8_t *grid, int minus, int8_t *q) {
    for (int j = 0; j < 8; j++) q[j] = (int8_t)(8 * grid[j] + (minus ? -1 : 1));
}

static inline void unpack_iq1_s(const uint8_t *b, int8_t q[256], int16_t sc[16], int16_t mn[16], float *d,
                                float *dmin) {
    const uint8_t *qs = b + 2;
    int s[8];
    for (int ib = 0; ib < 8; ib++) {
        const uint16_t qh = rd16(b + 34 + 2 * ib);
        for (int l = 0; l < 4; l++)
            iq1_values(IQ1S_GRID[qs[4 * ib + l] | ((qh >> (3 * l)) & 7) << 8], qh >> 15, q + 32 * ib + 8 * l);
        s[ib] = 2 * ((qh >> 12) & 7) + 1;
    }
    scales_per_32(s, sc);
    memset(mn, 0, 16 * sizeof *mn);
    *d = f16_at(b) * 0.125f;
    *dmin = 0;
}

static inline void unpack_iq1_m(const uint8_t *b, int8_t q[256], int16_t sc[16], int16_t mn[16], float *d,
                                float *dmin) {
    uint16_t d_bits = 0;
    for (int k = 0; k < 4; k++) {
        const uint16_t word = rd16(b + 48 + 2 * k);
        for (int i = 0; i < 4; i++) sc[4 * k + i] = (int16_t)(2 * ((word >> (3 * i)) & 7) + 1);
        d_bits |= (uint16_t)((word >> 12) << (4 * k));
    }
    for (int g = 0; g < 32; g++) {
        const int nib = (b[32 + g / 2] >> (4 * (g % 2))) & 0xF;
        iq1_values(IQ1S_GRID[b[g] | (nib & 7) << 8], nib >> 3, q + 8 * g);
    }
    memset(mn, 0, 16 * sizeof *mn);
    *d = f16_to_f32(d_bits) * 0.125f;
    *dmin = 0;
}

static inline void unpack_iq4_xs(const uint8_t *b, int8_t q[256], int16_t sc[16], int16_t mn[16], float *d,
                                 float *dmin) {
    const uint16_t high = rd16(b + 2);
    int s[8];
    for (int ib = 0; ib < 8; ib++) {
        s[ib] = (((b[4 + ib / 2] >> (4 * (ib % 2))) & 0xF) | ((high >> (2 * ib)) & 3) << 4) - 32;
        const uint8_t *qs = b + 8 + 16 * ib;
        for (int j = 0; j < 16; j++) {
            q[32 * ib + j] = KVALUES_IQ4NL[qs[j] & 0xF];
            q[32 * ib + 16 + j] = KVALUES_IQ4NL[qs[j] >> 4];
        }
    }
    scales_per_32(s, sc);
    memset(mn, 0, 16 * sizeof *mn);
    *d = f16_at(b);
    *dmin = 0;
}

static inline void unit_scales(int16_t sc[16], int16_t mn[16]) {
    for (int g = 0; g < 16; g++) sc[g] = 1, mn[g] = 0;
}

/* TQ2_0: 2-bit codes c, each 32 bytes holding runs of 32 at shifts 0, 2, 4, 6; value d * (c - 1). */
static inline void unpack_tq2_0(const uint8_t *b, int8_t q[256], int16_t sc[16], int16_t mn[16], float *d,
                                float *dmin) {
    for (int h = 0; h < 2; h++)
        for (int k = 0; k < 4; k++)
            for (int l = 0; l < 32; l++) q[128 * h + 32 * k + l] = (int8_t)(((b[32 * h + l] >> (2 * k)) & 3) - 1);
    unit_scales(sc, mn);
    *d = f16_at(b + 64);
    *dmin = 0;
}

/* TQ1_0: base-3 digits as fixed-point fractions: digit k of byte v is ((v * 3^k mod 256) * 3) >> 8.
 * Bytes 0-31 give elements 32k + j, 32-47 give 160 + 16k + j, 48-51 give 240 + 4k + j. */
static inline void tq1_digits(const uint8_t *p, int m, int count, int8_t *q) {
    static const uint8_t pow3[5] = {1, 3, 9, 27, 81};
    for (int k = 0; k < count; k++)
        for (int j = 0; j < m; j++) q[m * k + j] = (int8_t)((((uint8_t)(p[j] * pow3[k]) * 3) >> 8) - 1);
}

static inline void unpack_tq1_0(const uint8_t *b, int8_t q[256], int16_t sc[16], int16_t mn[16], float *d,
                                float *dmin) {
    tq1_digits(b, 32, 5, q);
    tq1_digits(b + 32, 16, 5, q + 160);
    tq1_digits(b + 48, 4, 4, q + 240);
    unit_scales(sc, mn);
    *d = f16_at(b + 52);
    *dmin = 0;
}

#endif
