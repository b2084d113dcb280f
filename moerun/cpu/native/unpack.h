/* Unpacking one block of each quantised format into its integer parts, the form generic.c's loops
 * take: 256-element blocks as value i = d * sc[i / 16] * q[i] - dmin * mn[i / 16] (a scale per 32,
 * as Q4_K/Q5_K's, repeated per 16; the i-quants and ternary formats in iq_unpack.h), 32-element
 * blocks as d * q[i] (+ m for q4_1 and q5_1). Layouts are ggml's (ggml-common.h); each unpacker
 * gives dequant.py's integer parts. */
#ifndef MOERUN_UNPACK_H
#define MOERUN_UNPACK_H
#include "common.h"
#include "iq_unpack.h"

static inline void k4_scales(const uint8_t *p, int16_t sc[16], int16_t mn[16]) {
    for (int s = 0; s < 8; s++) {
        int a, m;
        if (s < 4) {
            a = p[s] & 63;
            m = p[s + 4] & 63;
        } else {
            a = (p[s + 4] & 0xF) | ((p[s - 4] >> 6) << 4);
            m = (p[s + 4] >> 4) | ((p[s] >> 6) << 4);
        }
        sc[2 * s] = sc[2 * s + 1] = (int16_t)a;
        mn[2 * s] = mn[2 * s + 1] = (int16_t)m;
    }
}

static inline void unpack_q4_k(const uint8_t *b, int8_t q[256], int16_t sc[16], int16_t mn[16],
                               float *d, float *dmin) {
    *d = f16_at(b);
    *dmin = f16_at(b + 2);
    k4_scales(b + 4, sc, mn);
    const uint8_t *qs = b + 16;
    for (int k = 0; k < 4; k++)
        for (int l = 0; l < 32; l++) {
            q[64 * k + l] = (int8_t)(qs[32 * k + l] & 0xF);
            q[64 * k + 32 + l] = (int8_t)(qs[32 * k + l] >> 4);
        }
}

static inline void unpack_q5_k(const uint8_t *b, int8_t q[256], int16_t sc[16], int16_t mn[16],
                               float *d, float *dmin) {
    *d = f16_at(b);
    *dmin = f16_at(b + 2);
    k4_scales(b + 4, sc, mn);
    const uint8_t *qh = b + 16, *qs = b + 48;
    for (int k = 0; k < 4; k++)
        for (int l = 0; l < 32; l++) {
            int lo = 64 * k + l, hi = lo + 32;
            q[lo] = (int8_t)((qs[32 * k + l] & 0xF) | (((qh[l] >> (2 * k)) & 1) << 4));
            q[hi] = (int8_t)((qs[32 * k + l] >> 4) | (((qh[l] >> (2 * k + 1)) & 1) << 4));
        }
}

static inline void unpack_q6_k(const uint8_t *b, int8_t q[256], int16_t sc[16], int16_t mn[16],
                               float *d, float *dmin) {
    const uint8_t *ql = b, *qh = b + 128;
    for (int h = 0; h < 2; h++)
        for (int l = 0; l < 32; l++) {
            const uint8_t *L = ql + 64 * h, *H = qh + 32 * h;
            int8_t *o = q + 128 * h;
            o[l] = (int8_t)(((L[l] & 0xF) | (((H[l] >> 0) & 3) << 4)) - 32);
            o[l + 32] = (int8_t)(((L[l + 32] & 0xF) | (((H[l] >> 2) & 3) << 4)) - 32);
            o[l + 64] = (int8_t)(((L[l] >> 4) | (((H[l] >> 4) & 3) << 4)) - 32);
            o[l + 96] = (int8_t)(((L[l + 32] >> 4) | (((H[l] >> 6) & 3) << 4)) - 32);
        }
    for (int g = 0; g < 16; g++) {
        sc[g] = (int8_t)b[192 + g];
        mn[g] = 0;
    }
    *d = f16_at(b + 208);
    *dmin = 0;
}

static inline void unpack_q2_k(const uint8_t *b, int8_t q[256], int16_t sc[16], int16_t mn[16],
                               float *d, float *dmin) {
    for (int g = 0; g < 16; g++) {
        sc[g] = b[g] & 0xF;
        mn[g] = b[g] >> 4;
    }
    const uint8_t *qs = b + 16;
    for (int h = 0; h < 2; h++)
        for (int s = 0; s < 4; s++)
            for (int l = 0; l < 32; l++) q[128 * h + 32 * s + l] = (int8_t)((qs[32 * h + l] >> (2 * s)) & 3);
    *d = f16_at(b + 80);
    *dmin = f16_at(b + 82);
}

static inline void unpack_q3_k(const uint8_t *b, int8_t q[256], int16_t sc[16], int16_t mn[16],
                               float *d, float *dmin) {
    const uint8_t *hm = b, *qs = b + 32, *ps = b + 96;
    for (int g = 0; g < 16; g++) {
        int low = g < 8 ? (ps[g] & 0xF) : (ps[g - 8] >> 4);
        int high = (ps[8 + (g & 3)] >> (2 * (g >> 2))) & 3;
        sc[g] = (int16_t)((low | (high << 4)) - 32);
        mn[g] = 0;
    }
    for (int h = 0; h < 2; h++)
        for (int s = 0; s < 4; s++)
            for (int l = 0; l < 32; l++) {
                int i = 128 * h + 32 * s + l, run = 4 * h + s;
                int v = (qs[32 * h + l] >> (2 * s)) & 3;
                q[i] = (int8_t)(v - (((hm[l] >> run) & 1) ? 0 : 4));
            }
    *d = f16_at(b + 108);
    *dmin = 0;
}

/* 32-element blocks: value i = d * q[i] (+ m, for q4_1 and q5_1; the others leave m alone). */
static inline void unpack_q8_0(const uint8_t *b, int8_t q[32], float *d, float *m) {
    (void)m;
    *d = f16_at(b);
    memcpy(q, b + 2, 32);
}
static inline void unpack_q4_0(const uint8_t *b, int8_t q[32], float *d, float *m) {
    (void)m;
    *d = f16_at(b);
    for (int j = 0; j < 16; j++) {
        q[j] = (int8_t)((b[2 + j] & 0xF) - 8);
        q[j + 16] = (int8_t)((b[2 + j] >> 4) - 8);
    }
}
static inline void unpack_mxfp4(const uint8_t *b, int8_t q[32], float *d, float *m) {
    (void)m;
    *d = e8m0_half(b[0]);
    for (int j = 0; j < 16; j++) {
        q[j] = KVALUES_MXFP4[b[1 + j] & 0xF];
        q[j + 16] = KVALUES_MXFP4[b[1 + j] >> 4];
    }
}
static inline void unpack_mxfp4_oss(const uint8_t *b, int8_t q[32], float *d, float *m) {
    (void)m;
    *d = e8m0_half(b[0]);
    for (int j = 0; j < 16; j++) {
        q[2 * j] = KVALUES_MXFP4[b[1 + j] & 0xF];
        q[2 * j + 1] = KVALUES_MXFP4[b[1 + j] >> 4];
    }
}
/* Q4_1: d, m, then nibbles as Q4_0's, q in [0, 15]. */
static inline void unpack_q4_1(const uint8_t *b, int8_t q[32], float *d, float *m) {
    *d = f16_at(b);
    *m = f16_at(b + 2);
    for (int j = 0; j < 16; j++) {
        q[j] = (int8_t)(b[4 + j] & 0xF);
        q[j + 16] = (int8_t)(b[4 + j] >> 4);
    }
}
/* Q5_0 / Q5_1's 5-bit fields: nibbles as Q4_0's, bit j of the little-endian uint32 qh on top. */
static inline void five_bit(const uint8_t *qh, const uint8_t *qs, int offset, int8_t q[32]) {
    const uint32_t h = (uint32_t)qh[0] | (uint32_t)qh[1] << 8 | (uint32_t)qh[2] << 16 | (uint32_t)qh[3] << 24;
    for (int j = 0; j < 16; j++) {
        q[j] = (int8_t)(((qs[j] & 0xF) | ((h >> j) & 1) << 4) - offset);
        q[j + 16] = (int8_t)(((qs[j] >> 4) | ((h >> (j + 16)) & 1) << 4) - offset);
    }
}
static inline void unpack_q5_0(const uint8_t *b, int8_t q[32], float *d, float *m) {
    (void)m;
    *d = f16_at(b);
    five_bit(b + 2, b + 6, 16, q);
}
static inline void unpack_q5_1(const uint8_t *b, int8_t q[32], float *d, float *m) {
    *d = f16_at(b);
    *m = f16_at(b + 2);
    five_bit(b + 4, b + 8, 0, q);
}
static inline void unpack_iq4_nl(const uint8_t *b, int8_t q[32], float *d, float *m) {
    (void)m;
    *d = f16_at(b);
    for (int j = 0; j < 16; j++) {
        q[j] = KVALUES_IQ4NL[b[2 + j] & 0xF];
        q[j + 16] = KVALUES_IQ4NL[b[2 + j] >> 4];
    }
}

#endif
