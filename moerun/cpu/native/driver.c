/* Exported entry points: matmul, moe_decode, the activation quantisers, feature detection.
 *
 * Threads split output rows into static contiguous chunks inside one OpenMP parallel region; each
 * output element is computed by one thread with code that depends on neither the thread count nor
 * buffer addresses, so results are bitwise reproducible. Return values: 0, or a negative error. */
#include <omp.h>
#include <stdlib.h>

#include "common.h"
#include "gemm.h"

gemm_ops GEMM[F_COUNT];

#ifndef MOERUN_VARIANT
#define MOERUN_VARIANT "generic"
#endif

static int initialised;
__attribute__((constructor)) void moerun_ensure_init(void) { /* runs when the library loads */
    if (initialised) return;
    init_generic();
    init_avx2();
    init_avx2_iq4();
    init_avx2_iq();
    init_avx512();
    init_avx512_iq4();
    init_avx512_iq();
    init_avx512_ternary();
    init_gemm_kq_avx512();
    init_gemm_q6k_avx512();
    init_gemm_b32_avx512();
    init_gemm_lanes_b32_avx512();
    init_gemm_lanes_k_avx512();
    initialised = 1;
}

const char *moerun_variant(void) { return MOERUN_VARIANT; }

/* Bit f set: format f has a prefill GEMM in this variant (integer mode). */
int moerun_gemm_formats(void) {
    moerun_ensure_init();
    int bits = 0;
    for (int f = 0; f < F_COUNT; f++) bits |= (GEMM[f].run != NULL) << f;
    return bits;
}

/* Bit 0 avx2, 1 fma, 2 f16c, 3 avx512f, 4 avx512bw, 5 avx512vl, 6 avx512vnni, 7 avx512dq,
 * 8 avx512bf16 (libgcc's checks include the OS's saving of the vector state). */
int moerun_cpu_features(void) {
    __builtin_cpu_init();
    int f = 0;
    f |= !!__builtin_cpu_supports("avx2") << 0;
    f |= !!__builtin_cpu_supports("fma") << 1;
    f |= !!__builtin_cpu_supports("f16c") << 2;
    f |= !!__builtin_cpu_supports("avx512f") << 3;
    f |= !!__builtin_cpu_supports("avx512bw") << 4;
    f |= !!__builtin_cpu_supports("avx512vl") << 5;
    f |= !!__builtin_cpu_supports("avx512vnni") << 6;
    f |= !!__builtin_cpu_supports("avx512dq") << 7;
    f |= !!__builtin_cpu_supports("avx512bf16") << 8;
    return f;
}

/* How many threads a parallel region asked for `nthreads` gets (to check the pool). */
int moerun_threads_used(int nthreads) {
    int used = 0;
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp single
        used = omp_get_num_threads();
    }
    return used;
}

static size_t act_bytes(int act, int64_t n) {
    if (act == ACT_Q8_K) return (size_t)(n / 256) * sizeof(q8k_t);
    if (act == ACT_Q8_0) return (size_t)(n / 32) * sizeof(q8a_t);
    return (size_t)n * sizeof(float);
}

static void quantize_act(int act, const float *x, int64_t n, void *out) {
    if (act == ACT_Q8_K) quantize_q8k(x, n, (q8k_t *)out);
    else quantize_q8a(x, n, (q8a_t *)out);
}

/* x [T, n] fp32 -> q8 blocks: act 1 = q8_0 (q8a_t, 40 bytes per 32), 2 = q8_K (292 bytes per 256). */
int moerun_quantize(int act, const float *x, int64_t T, int64_t n, void *out) {
    if ((act != ACT_Q8_0 && act != ACT_Q8_K) || n % (act == ACT_Q8_K ? 256 : 32)) return -1;
    for (int64_t t = 0; t < T; t++)
        quantize_act(act, x + t * n, n, (char *)out + t * act_bytes(act, n));
    return 0;
}

static int check_format(int fmt, int64_t n) {
    if (fmt < 0 || fmt >= F_COUNT) return -1;
    if (n % FMT[fmt].block) return -2;
    return 0;
}

/* Rows [lo, hi) for T tokens: tiles of rows whose weights fit in L2 for large T, MAX_T tokens at a time. */
static void rows_tiled(rows_fn fn, const uint8_t *w, size_t rb, int64_t lo, int64_t hi, int64_t n,
                       const char *xs_base, size_t x_stride, int64_t T, float *y, int64_t y_stride) {
    int64_t tile = T <= MAX_T ? hi - lo : (int64_t)(256 * 1024 / (rb ? rb : 1));
    if (tile < 1) tile = 1;
    for (int64_t r = lo; r < hi; r += tile) {
        int64_t re = r + tile < hi ? r + tile : hi;
        for (int64_t t0 = 0; t0 < T; t0 += MAX_T) {
            int nt = (int)(T - t0 < MAX_T ? T - t0 : MAX_T);
            const void *xs[MAX_T];
            float *ys[MAX_T];
            for (int i = 0; i < nt; i++) {
                xs[i] = xs_base + (size_t)(t0 + i) * x_stride;
                ys[i] = y + (t0 + i) * y_stride;
            }
            fn(w, rb, r, re, n, xs, nt, ys);
        }
    }
}

/* The GEMM path: quantise every token, rearrange them (gemm_prep), then each thread's rows. */
static int matmul_gemm(int fmt, const gemm_ops *g, const uint8_t *w, int64_t rows, int64_t n, int64_t rb,
                       const float *x, int64_t T, float *y, int nthreads) {
    const int act = FMT[fmt].act;
    const size_t xb = act_bytes(act, n), work = gemm_work_stride(g->work(fmt, n));
    nthreads = nthreads > 0 ? nthreads : 1; /* a team has at most this many threads: one work part each */
    const size_t sizes[3] = {xb * (size_t)T, g->size(fmt, T, n), work * (size_t)nthreads};
    void *parts[3];
    if (moerun_scratch_parts(3, sizes, parts)) return -4;
    char *xq = parts[0], *xl = parts[1], *works = parts[2];
    const int64_t groups = (T + GEMM_TOKENS - 1) / GEMM_TOKENS;
#pragma omp parallel num_threads(nthreads)
    {
        int nth = omp_get_num_threads(), tid = omp_get_thread_num();
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) quantize_act(act, x + t * n, n, (char *)xq + t * xb);
#pragma omp for schedule(static)
        for (int64_t gi = 0; gi < groups; gi++) g->prep(fmt, xq, gi, T, n, xl);
        int64_t lo = rows * tid / nth, hi = rows * (tid + 1) / nth;
        if (hi > lo) g->run(fmt, w, (size_t)rb, lo, hi, n, xl, T, y, rows, works + (size_t)tid * work);
    }
    return 0;
}

/* y [T, rows] = x [T, n] @ W^T; W: rows of row_bytes bytes of format fmt. integer: bit 0 integer
 * mode, bit 1 the row kernels even where the GEMM would run (tests and benchmarks compare them). */
int moerun_matmul(int fmt, const uint8_t *w, int64_t rows, int64_t n, int64_t row_bytes, const float *x,
                  int64_t T, float *y, int integer, int nthreads) {
    moerun_ensure_init();
    int err = check_format(fmt, n);
    if (err) return err;
    const fmt_info *f = &FMT[fmt];
    int act = integer & 1 ? f->act : ACT_F32;
    if (act != ACT_F32 && GEMM[fmt].run && T >= GEMM[fmt].min_t && !(integer & 2))
        return matmul_gemm(fmt, &GEMM[fmt], w, rows, n, row_bytes, x, T, y, nthreads);
    rows_fn fn = act == ACT_F32 ? f->exact : f->integer;
    size_t xb = act_bytes(act, n);
    const size_t xq_size = act != ACT_F32 ? xb * (size_t)T : 0;
    void *xq = NULL;
    if (xq_size && moerun_scratch_parts(1, &xq_size, &xq)) return -4;
    const char *xs_base = act == ACT_F32 ? (const char *)x : (const char *)xq;
#pragma omp parallel num_threads(nthreads)
    {
        int nth = omp_get_num_threads(), tid = omp_get_thread_num();
        if (act != ACT_F32) {
#pragma omp for schedule(static)
            for (int64_t t = 0; t < T; t++) quantize_act(act, x + t * n, n, (char *)xq + t * xb);
        }
        int64_t lo = rows * tid / nth, hi = rows * (tid + 1) / nth;
        if (hi > lo) rows_tiled(fn, w, (size_t)row_bytes, lo, hi, n, xs_base, xb, T, y, rows);
    }
    return 0;
}
