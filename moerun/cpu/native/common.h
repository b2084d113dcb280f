/* Shared declarations of moerun's native CPU kernels: format ids, the activation blocks of integer
 * mode, the row-kernel signature and the per-format dispatch table.
 *
 * Every source file is compiled once per ISA variant (generic, avx2, avx512) with different flags;
 * the SIMD files compile to nothing where their instructions are not enabled. */
#ifndef MOERUN_COMMON_H
#define MOERUN_COMMON_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* Format ids: the order of moerun.cpu.library.FORMAT_IDS. */
enum {
    F_F32, F_F16, F_BF16, F_Q8_0, F_Q4_0, F_Q2_K, F_Q3_K, F_Q4_K, F_Q5_K, F_Q6_K, F_MXFP4, F_MXFP4_OSS,
    F_Q4_1, F_Q5_0, F_Q5_1, F_IQ4_NL, F_IQ2_XXS, F_IQ2_XS, F_IQ2_S, F_IQ3_XXS, F_IQ3_S, F_IQ1_S, F_IQ1_M,
    F_IQ4_XS, F_TQ1_0, F_TQ2_0,
    F_COUNT
};

/* What integer mode quantises the activations to, per weight format. */
enum { ACT_F32 = 0, ACT_Q8_0 = 1, ACT_Q8_K = 2 };

/* q8_K (ggml's block_q8_K): value i = d * qs[i]; bsums[g] = sum of qs[16g .. 16g + 15]. */
typedef struct {
    float d;
    int8_t qs[256];
    int16_t bsums[16];
} q8k_t;

/* q8_0 activations: value i = d * qs[i], d an fp16 value held as float (ggml stores it as fp16);
 * sum = sum of qs (for q4_0's offset of 8, and q4_1's and q5_1's min, where ggml pairs them with
 * q8_1, whose s is d * sum). */
typedef struct {
    float d;
    int32_t sum;
    int8_t qs[32];
} q8a_t;

#define MAX_T 16 /* tokens one row-kernel call handles */

/* A row kernel reads each weight once, block by block, and the hardware prefetcher stops at every
 * 4 KB page, which leaves one core reading weights at ~14 GB/s on a Xeon. Asking for the bytes
 * PREFETCH_AHEAD past each block as it is read (the rows after it, across page boundaries) keeps
 * enough reads in flight to reach the memory's bandwidth: Q4_K and Q6_K decode reads 1.6-2x faster
 * (docs/PERFORMANCE.md). A prefetch never faults, so asking past a weight's end is harmless; the
 * arithmetic is untouched. */
#define PREFETCH_AHEAD 2048
static inline void prefetch_ahead(const uint8_t *p, int bytes) {
    for (int o = 0; o < bytes; o += 64) __builtin_prefetch(p + PREFETCH_AHEAD + o, 0, 3);
}

/* Rows [r0, r1) of weights w (row_bytes apart, n elements each) times T <= MAX_T activation rows:
 * ys[t][r] = dot(row r, xs[t]). xs[t] is float [n] (exact mode) or the row's q8 blocks. */
typedef void (*rows_fn)(const uint8_t *w, size_t row_bytes, int64_t r0, int64_t r1, int64_t n,
                        const void *const *xs, int T, float *const *ys);

typedef struct {
    int block;     /* elements per block */
    int bytes;     /* bytes per block */
    int act;       /* ACT_* of integer mode */
    rows_fn exact; /* fp32 activations */
    rows_fn integer;
} fmt_info;

extern fmt_info FMT[F_COUNT];
void init_generic(void);
void init_avx512(void); /* overrides entries of FMT where the variant has faster code */
void init_avx2(void);
/* The formats added second, in the same bits as generic.c's: q4_1, q5_0, q5_1, iq4_nl, iq4_xs (_iq4);
 * the grid i-quants, tq1_0 and tq2_0 (_iq; on avx512 tq1_0, tq2_0, iq1_s and iq1_m in _ternary). */
void init_avx2_iq4(void);
void init_avx512_iq4(void);
void init_avx2_iq(void);
void init_avx512_iq(void);
void init_avx512_ternary(void);

/* A call's large buffers (the MoE step's hidden rows, a prompt's quantised activations), carved
 * from the calling thread's scratch region, which is kept from call to call: fresh allocations
 * would cost a page fault per 4 KiB on first touch. parts[i] gets sizes[i] bytes, 64-byte aligned
 * (NULL where sizes[i] is 0), with 64 bytes to spare after the last (a vector load may read past
 * it). Contents undefined; valid until the thread's next request (one per entry point call, not
 * nested). Returns 0, or -4 out of memory (every part NULL). */
int moerun_scratch_parts(int n, const size_t *sizes, void **parts);

/* Exact mode's last step: 16 fp32 lanes summed in one fixed tree (SIMD kernels that keep generic.c's
 * bits store their lanes and call this). */
static inline float sum16_tree(float a[16]) {
    for (int w = 8; w >= 1; w >>= 1)
        for (int l = 0; l < w; l++) a[l] += a[l + w];
    return a[0];
}

void quantize_q8k(const float *x, int64_t n, q8k_t *y);
void quantize_q8a(const float *x, int64_t n, q8a_t *y);

#ifdef __F16C__
#include <immintrin.h>
#endif

static inline float f16_to_f32(uint16_t h) {
#ifdef __F16C__
    return _cvtsh_ss(h); /* exact; a signalling NaN comes back quiet */
#endif
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 31, m = h & 1023, bits;
    if (e == 31) {
        bits = sign | 0x7F800000u | (m << 13);
    } else if (e == 0) {
        float v = (float)m * (1.0f / 16777216.0f); /* m * 2^-24, exact */
        return sign ? -v : v;
    } else {
        bits = sign | ((e + 112) << 23) | (m << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static inline uint16_t rd16(const uint8_t *p) { return (uint16_t)(p[0] | (p[1] << 8)); }
static inline float f16_at(const uint8_t *p) { return f16_to_f32(rd16(p)); }

/* float32 -> nearest fp16 (ties to even), as numpy's astype(float16) and F16C do. */
static inline uint16_t f32_to_f16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000, ax = x & 0x7FFFFFFF;
    if (ax >= 0x7F800000) return (uint16_t)(sign | 0x7C00 | (ax > 0x7F800000 ? 0x200 : 0));
    if (ax >= 0x477FF000) return (uint16_t)(sign | 0x7C00); /* rounds to inf */
    if (ax < 0x38800000) {                                  /* fp16 subnormal or zero */
        float a;
        memcpy(&a, &ax, 4);
        float q = a * 16777216.0f; /* units of 2^-24; exact scaling */
        uint32_t qi = (uint32_t)q;
        float rem = q - (float)qi;
        if (rem > 0.5f || (rem == 0.5f && (qi & 1))) qi++;
        return (uint16_t)(sign | qi);
    }
    uint32_t mant = ax & 0x7FFFFF, exp = (ax >> 23) - 112;
    uint32_t h = (exp << 10) | (mant >> 13), rest = mant & 0x1FFF;
    if (rest > 0x1000 || (rest == 0x1000 && (h & 1))) h++;
    return (uint16_t)(sign | h);
}

/* ggml's E8M0 half scale, 2^(e - 128) (e < 2: subnormal). */
static inline float e8m0_half(uint8_t e) {
    uint32_t bits = e < 2 ? (0x00200000u << e) : ((uint32_t)(e - 1) << 23);
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* ggml's kvalues_mxfp4: E2M1 values doubled. */
static const int8_t KVALUES_MXFP4[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

#endif
