/* The prefill GEMM's contract, shared by the driver and the AVX-512 GEMM files.
 *
 * Integer mode only (q8_K / q8_0 activations). The activations are quantised once per call with
 * the matvec's quantisers, rearranged once (gemm_prep) into a 64-byte aligned layout the inner
 * kernel streams, and every weight block is decoded once per 4 rows and token chunk and reused for
 * all the chunk's tokens. Each output element is the same sequence of integer sums and fp32
 * operations as the integer matvec (the row kernels of avx512.c) performs for it, so the GEMM equals
 * the matvec bit for bit whatever T, the thread count or the buffer addresses. */
#ifndef MOERUN_GEMM_H
#define MOERUN_GEMM_H
#include "common.h"

#define GEMM_TOKENS 4 /* tokens per micro-kernel; the layout pads T to a multiple of it */

/* Bytes of the rearranged activations of T tokens of n elements for format fmt (0: no GEMM). */
typedef size_t (*gemm_size_fn)(int fmt, int64_t T, int64_t n);
/* Fills token group g (tokens 4g .. 4g + 3; those >= T as zeros) of the layout from xq, the
 * matvec's q8 blocks [T][n / block] (q8k_t or q8a_t). */
typedef void (*gemm_prep_fn)(int fmt, const void *xq, int64_t g, int64_t T, int64_t n, void *xl);
/* Bytes of one thread's working memory for rows of n elements (its decoded weight rows). The caller
 * gives each thread its own, 64-byte aligned, carved with the call's other buffers from the scratch
 * region (common.h), so a run never allocates and cannot fail. */
typedef size_t (*gemm_work_fn)(int fmt, int64_t n);
/* y[t * y_stride + r] for rows [r0, r1) and all T tokens; work: gemm_work_fn's bytes. */
typedef void (*gemm_run_fn)(int fmt, const uint8_t *w, size_t rb, int64_t r0, int64_t r1, int64_t n,
                            const void *xl, int64_t T, float *y, int64_t y_stride, void *work);

typedef struct {
    int min_t; /* from this many tokens the GEMM beats the row kernels (measured; speed only) */
    gemm_size_fn size;
    gemm_prep_fn prep;
    gemm_work_fn work;
    gemm_run_fn run;
} gemm_ops;

/* A thread's share of working memory in a buffer of `threads` of them: 64-byte multiples. */
static inline size_t gemm_work_stride(size_t bytes) { return (bytes + 63) / 64 * 64; }

/* Per format: the GEMM of this variant, or run == NULL (the row kernels take every T). */
extern gemm_ops GEMM[F_COUNT];
void init_gemm_kq_avx512(void); /* q4_k, q5_k */
void init_gemm_q6k_avx512(void);
void init_gemm_b32_avx512(void); /* q8_0, q4_0, mxfp4 (both nibble orders) */
void init_gemm_lanes_b32_avx512(void); /* q4_1, q5_0, q5_1, iq4_nl */
void init_gemm_lanes_k_avx512(void);   /* iq4_xs, the grid i-quants, tq2_0, tq1_0 */

#endif
