/* Portable C kernels for every format, both modes: the scalar reference of the SIMD files and the
 * code every variant falls back to. Written with 16 independent float lanes so that compilers
 * vectorise them without reordering any sum (no -ffast-math): each lane sums a fixed subset of
 * elements in a fixed order, and the lanes are added in one fixed tree. */
#include "common.h"
#include "unpack.h"

fmt_info FMT[F_COUNT];

/* ------------------------------------------------------------------ shared loops */

typedef void (*kunpack_fn)(const uint8_t *, int8_t *, int16_t *, int16_t *, float *, float *);
typedef void (*bunpack_fn)(const uint8_t *, int8_t *, float *, float *);

/* Exact mode, k-quants: the block's values as dequant.py computes them ((d * sc) * q - dmin * mn),
 * then fp32 multiply-adds into 16 lanes per token. */
static inline __attribute__((always_inline)) void rows_k_exact(const uint8_t *w, size_t rb, int64_t r0,
                                                               int64_t r1, int64_t n, const void *const *xs,
                                                               int T, float *const *ys, kunpack_fn un,
                                                               int bytes, int has_min) {
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w + r * rb;
        float acc[MAX_T][16] = {{0}};
        for (int64_t b = 0; b < n / 256; b++) {
            int8_t q[256];
            int16_t sc[16], mn[16];
            float d, dmin, v[256];
            un(row + b * bytes, q, sc, mn, &d, &dmin);
            for (int g = 0; g < 16; g++) {
                float step = d * (float)sc[g], off = dmin * (float)mn[g];
                for (int l = 0; l < 16; l++) {
                    float x = step * (float)q[16 * g + l];
                    v[16 * g + l] = has_min ? x - off : x;
                }
            }
            for (int t = 0; t < T; t++) {
                const float *x = (const float *)xs[t] + b * 256;
                for (int j = 0; j < 256; j += 16)
                    for (int l = 0; l < 16; l++) acc[t][l] += v[j + l] * x[j + l];
            }
        }
        for (int t = 0; t < T; t++) ys[t][r] = sum16_tree(acc[t]);
    }
}

/* Integer mode, k-quants x q8_K: per super-block S1 = sum_g sc[g] * dot_g and S2 = sum_g mn[g] *
 * bsums[g] in int32 (exact), then acc += (yd * d) * S1 - (yd * dmin) * S2 in fp32. */
static inline __attribute__((always_inline)) void rows_k_int(const uint8_t *w, size_t rb, int64_t r0,
                                                             int64_t r1, int64_t n, const void *const *xs,
                                                             int T, float *const *ys, kunpack_fn un,
                                                             int bytes, int has_min) {
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w + r * rb;
        float acc[MAX_T] = {0};
        for (int64_t b = 0; b < n / 256; b++) {
            int8_t q[256];
            int16_t sc[16], mn[16];
            float d, dmin;
            un(row + b * bytes, q, sc, mn, &d, &dmin);
            for (int t = 0; t < T; t++) {
                const q8k_t *y = (const q8k_t *)xs[t] + b;
                int32_t s1 = 0, s2 = 0;
                for (int g = 0; g < 16; g++) {
                    int32_t dot = 0;
                    for (int l = 0; l < 16; l++) dot += (int32_t)q[16 * g + l] * y->qs[16 * g + l];
                    s1 += sc[g] * dot;
                    s2 += mn[g] * y->bsums[g];
                }
                acc[t] += (y->d * d) * (float)s1;
                if (has_min) acc[t] -= (y->d * dmin) * (float)s2;
            }
        }
        for (int t = 0; t < T; t++) ys[t][r] = acc[t];
    }
}

/* Exact mode, 32-blocks: the values as dequant.py computes them (d * q, then + m with a min). */
static inline __attribute__((always_inline)) void rows_b_exact(const uint8_t *w, size_t rb, int64_t r0,
                                                               int64_t r1, int64_t n, const void *const *xs,
                                                               int T, float *const *ys, bunpack_fn un,
                                                               int bytes, int has_min) {
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w + r * rb;
        float acc[MAX_T][16] = {{0}};
        for (int64_t b = 0; b < n / 32; b++) {
            int8_t q[32];
            float d, m = 0, v[32];
            un(row + b * bytes, q, &d, &m);
            for (int j = 0; j < 32; j++) v[j] = has_min ? d * (float)q[j] + m : d * (float)q[j];
            for (int t = 0; t < T; t++) {
                const float *x = (const float *)xs[t] + b * 32;
                for (int j = 0; j < 32; j += 16)
                    for (int l = 0; l < 16; l++) acc[t][l] += v[j + l] * x[j + l];
            }
        }
        for (int t = 0; t < T; t++) ys[t][r] = sum16_tree(acc[t]);
    }
}

/* Integer mode, 32-blocks x q8_0: acc += (d * yd) * dot in fp32, dot exact in int32; with a min,
 * acc += (d * yd) * dot + (m * yd) * sum (ggml's order, its q8_1 term m * s with s = yd * sum, here
 * without s's fp16 rounding). */
static inline __attribute__((always_inline)) void rows_b_int(const uint8_t *w, size_t rb, int64_t r0,
                                                             int64_t r1, int64_t n, const void *const *xs,
                                                             int T, float *const *ys, bunpack_fn un,
                                                             int bytes, int has_min) {
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w + r * rb;
        float acc[MAX_T] = {0};
        for (int64_t b = 0; b < n / 32; b++) {
            int8_t q[32];
            float d, m = 0;
            un(row + b * bytes, q, &d, &m);
            for (int t = 0; t < T; t++) {
                const q8a_t *y = (const q8a_t *)xs[t] + b;
                int32_t dot = 0;
                for (int j = 0; j < 32; j++) dot += (int32_t)q[j] * y->qs[j];
                if (has_min) acc[t] += (d * y->d) * (float)dot + (m * y->d) * (float)y->sum;
                else acc[t] += (d * y->d) * (float)dot;
            }
        }
        for (int t = 0; t < T; t++) ys[t][r] = acc[t];
    }
}

/* Dense float rows (f32 / f16 / bf16), fp32 multiply-adds into 16 lanes per token. */
static inline float load_float(const uint8_t *row, int64_t i, int kind) {
    if (kind == F_F32) {
        float f;
        memcpy(&f, row + 4 * i, 4);
        return f;
    }
    uint16_t h = rd16(row + 2 * i);
    if (kind == F_F16) return f16_to_f32(h);
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline __attribute__((always_inline)) void rows_float(const uint8_t *w, size_t rb, int64_t r0,
                                                             int64_t r1, int64_t n, const void *const *xs,
                                                             int T, float *const *ys, int kind) {
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *row = w + r * rb;
        float acc[MAX_T][16] = {{0}};
        int64_t j = 0;
        for (; j + 16 <= n; j += 16) {
            float v[16];
            for (int l = 0; l < 16; l++) v[l] = load_float(row, j + l, kind);
            for (int t = 0; t < T; t++) {
                const float *x = (const float *)xs[t] + j;
                for (int l = 0; l < 16; l++) acc[t][l] += v[l] * x[l];
            }
        }
        for (int l = 0; j + l < n; l++) {
            float v = load_float(row, j + l, kind);
            for (int t = 0; t < T; t++) acc[t][l] += v * ((const float *)xs[t])[j + l];
        }
        for (int t = 0; t < T; t++) ys[t][r] = sum16_tree(acc[t]);
    }
}

#define ROWS_ARGS                                                                                      \
    const uint8_t *w, size_t rb, int64_t r0, int64_t r1, int64_t n, const void *const *xs, int T,      \
        float *const *ys
/* Each kernel in two copies: T == 1 (decode; accumulators in registers) and any T. */
#define K_FORMAT(name, bytes, has_min)                                                                 \
    static void name##_exact(ROWS_ARGS) {                                                              \
        if (T == 1) rows_k_exact(w, rb, r0, r1, n, xs, 1, ys, unpack_##name, bytes, has_min);           \
        else rows_k_exact(w, rb, r0, r1, n, xs, T, ys, unpack_##name, bytes, has_min);                  \
    }                                                                                                  \
    static void name##_int(ROWS_ARGS) {                                                                \
        if (T == 1) rows_k_int(w, rb, r0, r1, n, xs, 1, ys, unpack_##name, bytes, has_min);             \
        else rows_k_int(w, rb, r0, r1, n, xs, T, ys, unpack_##name, bytes, has_min);                    \
    }
#define B_FORMAT(name, bytes, has_min)                                                                 \
    static void name##_exact(ROWS_ARGS) {                                                              \
        if (T == 1) rows_b_exact(w, rb, r0, r1, n, xs, 1, ys, unpack_##name, bytes, has_min);           \
        else rows_b_exact(w, rb, r0, r1, n, xs, T, ys, unpack_##name, bytes, has_min);                  \
    }                                                                                                  \
    static void name##_int(ROWS_ARGS) {                                                                \
        if (T == 1) rows_b_int(w, rb, r0, r1, n, xs, 1, ys, unpack_##name, bytes, has_min);             \
        else rows_b_int(w, rb, r0, r1, n, xs, T, ys, unpack_##name, bytes, has_min);                    \
    }

K_FORMAT(q2_k, 84, 1)
K_FORMAT(q3_k, 110, 0)
K_FORMAT(q4_k, 144, 1)
K_FORMAT(q5_k, 176, 1)
K_FORMAT(q6_k, 210, 0)
K_FORMAT(iq2_xxs, 66, 0)
K_FORMAT(iq2_xs, 74, 0)
K_FORMAT(iq2_s, 82, 0)
K_FORMAT(iq3_xxs, 98, 0)
K_FORMAT(iq3_s, 110, 0)
K_FORMAT(iq1_s, 50, 0)
K_FORMAT(iq1_m, 56, 0)
K_FORMAT(iq4_xs, 136, 0)
K_FORMAT(tq1_0, 54, 0)
K_FORMAT(tq2_0, 66, 0)
B_FORMAT(q8_0, 34, 0)
B_FORMAT(q4_0, 18, 0)
B_FORMAT(mxfp4, 17, 0)
B_FORMAT(mxfp4_oss, 17, 0)
B_FORMAT(q4_1, 20, 1)
B_FORMAT(q5_0, 22, 0)
B_FORMAT(q5_1, 24, 1)
B_FORMAT(iq4_nl, 18, 0)
#define FLOAT_FORMAT(name, kind)                                                                       \
    static void name##_rows(ROWS_ARGS) {                                                               \
        if (T == 1) rows_float(w, rb, r0, r1, n, xs, 1, ys, kind);                                      \
        else rows_float(w, rb, r0, r1, n, xs, T, ys, kind);                                             \
    }
FLOAT_FORMAT(f32, F_F32)
FLOAT_FORMAT(f16, F_F16)
FLOAT_FORMAT(bf16, F_BF16)

void init_generic(void) {
    FMT[F_F32] = (fmt_info){1, 4, ACT_F32, f32_rows, f32_rows};
    FMT[F_F16] = (fmt_info){1, 2, ACT_F32, f16_rows, f16_rows};
    FMT[F_BF16] = (fmt_info){1, 2, ACT_F32, bf16_rows, bf16_rows};
    FMT[F_Q8_0] = (fmt_info){32, 34, ACT_Q8_0, q8_0_exact, q8_0_int};
    FMT[F_Q4_0] = (fmt_info){32, 18, ACT_Q8_0, q4_0_exact, q4_0_int};
    FMT[F_Q2_K] = (fmt_info){256, 84, ACT_Q8_K, q2_k_exact, q2_k_int};
    FMT[F_Q3_K] = (fmt_info){256, 110, ACT_Q8_K, q3_k_exact, q3_k_int};
    FMT[F_Q4_K] = (fmt_info){256, 144, ACT_Q8_K, q4_k_exact, q4_k_int};
    FMT[F_Q5_K] = (fmt_info){256, 176, ACT_Q8_K, q5_k_exact, q5_k_int};
    FMT[F_Q6_K] = (fmt_info){256, 210, ACT_Q8_K, q6_k_exact, q6_k_int};
    FMT[F_MXFP4] = (fmt_info){32, 17, ACT_Q8_0, mxfp4_exact, mxfp4_int};
    FMT[F_MXFP4_OSS] = (fmt_info){32, 17, ACT_Q8_0, mxfp4_oss_exact, mxfp4_oss_int};
    FMT[F_Q4_1] = (fmt_info){32, 20, ACT_Q8_0, q4_1_exact, q4_1_int};
    FMT[F_Q5_0] = (fmt_info){32, 22, ACT_Q8_0, q5_0_exact, q5_0_int};
    FMT[F_Q5_1] = (fmt_info){32, 24, ACT_Q8_0, q5_1_exact, q5_1_int};
    FMT[F_IQ4_NL] = (fmt_info){32, 18, ACT_Q8_0, iq4_nl_exact, iq4_nl_int};
    FMT[F_IQ2_XXS] = (fmt_info){256, 66, ACT_Q8_K, iq2_xxs_exact, iq2_xxs_int};
    FMT[F_IQ2_XS] = (fmt_info){256, 74, ACT_Q8_K, iq2_xs_exact, iq2_xs_int};
    FMT[F_IQ2_S] = (fmt_info){256, 82, ACT_Q8_K, iq2_s_exact, iq2_s_int};
    FMT[F_IQ3_XXS] = (fmt_info){256, 98, ACT_Q8_K, iq3_xxs_exact, iq3_xxs_int};
    FMT[F_IQ3_S] = (fmt_info){256, 110, ACT_Q8_K, iq3_s_exact, iq3_s_int};
    FMT[F_IQ1_S] = (fmt_info){256, 50, ACT_Q8_K, iq1_s_exact, iq1_s_int};
    FMT[F_IQ1_M] = (fmt_info){256, 56, ACT_Q8_K, iq1_m_exact, iq1_m_int};
    FMT[F_IQ4_XS] = (fmt_info){256, 136, ACT_Q8_K, iq4_xs_exact, iq4_xs_int};
    FMT[F_TQ1_0] = (fmt_info){256, 54, ACT_Q8_K, tq1_0_exact, tq1_0_int};
    FMT[F_TQ2_0] = (fmt_info){256, 66, ACT_Q8_K, tq2_0_exact, tq2_0_int};
}

/* ------------------------------------------------------------------ activation quantisers */

/* ggml's nearest_int: round to nearest, ties to even, for |v| < 2^22. */
static inline int nearest_int(float v) {
    float f = v + 12582912.f;
    int32_t i;
    memcpy(&i, &f, 4);
    return (i & 0x007fffff) - 0x00400000;
}

/* ggml's quantize_row_q8_K_ref: iscale = -127 / (the x of largest |x|, first of ties),
 * qs = min(127, nearest_int(iscale * x)), d = 1 / iscale. */
void quantize_q8k(const float *x, int64_t n, q8k_t *y) {
    for (int64_t b = 0; b < n / 256; b++, x += 256, y++) {
        float amax = 0, max = 0;
        for (int j = 0; j < 256; j++) {
            float ax = fabsf(x[j]);
            if (ax > amax) {
                amax = ax;
                max = x[j];
            }
        }
        if (amax == 0) {
            memset(y, 0, sizeof *y);
            continue;
        }
        const float iscale = -127.f / max;
        for (int j = 0; j < 256; j++) {
            int v = nearest_int(iscale * x[j]);
            y->qs[j] = (int8_t)(v < 127 ? v : 127);
        }
        for (int g = 0; g < 16; g++) {
            int s = 0;
            for (int l = 0; l < 16; l++) s += y->qs[16 * g + l];
            y->bsums[g] = (int16_t)s;
        }
        y->d = 1 / iscale;
    }
}

/* ggml's quantize_row_q8_0_ref (and gguf-py's Q8_0): d = amax / 127, qs = roundf(x / d) (ties away
 * from zero), d kept at fp16 precision. */
void quantize_q8a(const float *x, int64_t n, q8a_t *y) {
    for (int64_t b = 0; b < n / 32; b++, x += 32, y++) {
        float amax = 0;
        for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(x[j]));
        const float d = amax / 127.f, id = d != 0 ? 1.f / d : 0.f;
        int32_t sum = 0;
        for (int j = 0; j < 32; j++) {
            float v = x[j] * id, r = truncf(v);
            if (fabsf(v - r) >= 0.5f) r += copysignf(1.f, v);
            int q = (int)r;
            q = q > 127 ? 127 : (q < -128 ? -128 : q);
            y->qs[j] = (int8_t)q;
            sum += q;
        }
        y->sum = sum;
        y->d = f16_to_f32(f32_to_f16(d));
    }
}

/* ------------------------------------------------------------------ row dequantisation */

/* Rows `rows[0 .. count)` of weights w (row_bytes apart, n elements each, format fmt) as fp32 into
 * out [count, n], each value as the exact mode computes it (dequant.py's float operations): an
 * embedding lookup of a quantised table. */
int moerun_dequantize_rows(int fmt, const uint8_t *w, int64_t row_bytes, int64_t n, const int64_t *rows,
                           int64_t count, float *out) {
    extern void moerun_ensure_init(void);
    moerun_ensure_init();
    if (fmt < 0 || fmt >= F_COUNT) return -1;
    if (n % FMT[fmt].block) return -2;
    static const kunpack_fn kun[F_COUNT] = {
        [F_Q2_K] = unpack_q2_k,       [F_Q3_K] = unpack_q3_k,       [F_Q4_K] = unpack_q4_k,   [F_Q5_K] = unpack_q5_k,
        [F_Q6_K] = unpack_q6_k,       [F_IQ2_XXS] = unpack_iq2_xxs, [F_IQ2_XS] = unpack_iq2_xs,
        [F_IQ2_S] = unpack_iq2_s,     [F_IQ3_XXS] = unpack_iq3_xxs, [F_IQ3_S] = unpack_iq3_s,
        [F_IQ1_S] = unpack_iq1_s,     [F_IQ1_M] = unpack_iq1_m,     [F_IQ4_XS] = unpack_iq4_xs,
        [F_TQ1_0] = unpack_tq1_0,     [F_TQ2_0] = unpack_tq2_0};
    static const bunpack_fn bun[F_COUNT] = {[F_Q8_0] = unpack_q8_0, [F_Q4_0] = unpack_q4_0, [F_MXFP4] = unpack_mxfp4,
                                            [F_MXFP4_OSS] = unpack_mxfp4_oss, [F_Q4_1] = unpack_q4_1,
                                            [F_Q5_0] = unpack_q5_0, [F_Q5_1] = unpack_q5_1,
                                            [F_IQ4_NL] = unpack_iq4_nl};
    const int bytes = FMT[fmt].bytes, has_min = fmt == F_Q2_K || fmt == F_Q4_K || fmt == F_Q5_K;
    const int b_min = fmt == F_Q4_1 || fmt == F_Q5_1;
    for (int64_t i = 0; i < count; i++) {
        const uint8_t *row = w + rows[i] * row_bytes;
        float *o = out + i * n;
        if (fmt == F_F32 || fmt == F_F16 || fmt == F_BF16) {
            for (int64_t j = 0; j < n; j++) o[j] = load_float(row, j, fmt);
        } else if (kun[fmt]) {
            for (int64_t b = 0; b < n / 256; b++) {
                int8_t q[256];
                int16_t sc[16], mn[16];
                float d, dmin;
                kun[fmt](row + b * bytes, q, sc, mn, &d, &dmin);
                for (int g = 0; g < 16; g++) {
                    float step = d * (float)sc[g], off = dmin * (float)mn[g];
                    for (int l = 0; l < 16; l++) {
                        float x = step * (float)q[16 * g + l];
                        o[b * 256 + 16 * g + l] = has_min ? x - off : x;
                    }
                }
            }
        } else {
            for (int64_t b = 0; b < n / 32; b++) {
                int8_t q[32];
                float d, m = 0;
                bun[fmt](row + b * bytes, q, &d, &m);
                for (int j = 0; j < 32; j++) o[b * 32 + j] = b_min ? d * (float)q[j] + m : d * (float)q[j];
            }
        }
    }
    return 0;
}
