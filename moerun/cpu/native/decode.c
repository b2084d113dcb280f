/* One token's decode step through a decoder layer in two calls, so no Python runs between the small
 * operations of a layer:
 *   moerun_attention_decode  x += o(attend(rope(norm_qk(q, k, v of rms_norm(x)))), cache)), the new
 *                            key and value written into the cache at `pos`;
 *   moerun_moe_route         h = rms_norm(x), the router's logits of h and (softmax-then-top-k or
 *                            top-k-then-softmax) the token's k experts ascending with their weights;
 *                            the experts then run in moerun_moe_decode (moe.c) on h.
 * Each is one OpenMP parallel region with barriers between its phases. Every value is computed by one
 * thread in a fixed order (sums over 16 lanes, then the lanes in order), so the bits depend on
 * neither the thread count nor buffer addresses. */
#include <float.h>
#include <omp.h>
#include <stdlib.h>

#include "common.h"

/* A linear layer's weight as the row kernels read it: `rows` rows of `n` inputs in format `fmt`. */
typedef struct {
    const uint8_t *w;
    const float *bias; /* fp32 [rows] or NULL */
    int64_t rows, n;
    int32_t fmt, pad;
} moerun_linear;

enum { QK_NONE, QK_HEAD, QK_FULL };
enum { CACHE_F32, CACHE_F16, CACHE_BF16 };

/* An attention block: its norm, projections and the variants of the families (see attention.py). */
typedef struct {
    moerun_linear q, k, v, o;
    const float *norm;           /* the block's input RMSNorm, fp32 [hidden] */
    const float *q_norm, *k_norm; /* QK_HEAD: fp32 [head_dim]; QK_FULL: [heads * head_dim] etc. */
    const float *sinks;          /* fp32 [heads] (GPT-OSS) or NULL */
    int64_t hidden, heads, kv_heads, head_dim, window; /* window 0: every cached key */
    int32_t qk_norm, cache_dtype;
    float eps, clip, scale, qk_eps; /* eps: of `norm`; clip <= 0: none; scale: of the scores */
} moerun_attention;

/* 16 floats as one vector (GCC's vector extension: zmm on avx512, narrower pieces elsewhere); loads
 * and stores through memcpy, so any alignment. */
typedef float v16f __attribute__((vector_size(64)));
static inline v16f ld16(const float *p) {
    v16f v;
    memcpy(&v, p, sizeof v);
    return v;
}
static inline void st16(float *p, v16f v) { memcpy(p, &v, sizeof v); }

typedef float v8f __attribute__((vector_size(32)));
typedef float v4f __attribute__((vector_size(16)));

/* The 16 lanes summed pairwise: lane l + 8 into l, then + 4, + 2, + 1 (a fixed tree), in
 * registers where the compiler has __builtin_shufflevector (GCC 12, clang), else through memory. */
static inline float hsum16(v16f v) {
#if defined(__has_builtin) && __has_builtin(__builtin_shufflevector)
    v8f s8 = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
             __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
    v4f s4 = __builtin_shufflevector(s8, s8, 0, 1, 2, 3) + __builtin_shufflevector(s8, s8, 4, 5, 6, 7);
    return (s4[0] + s4[2]) + (s4[1] + s4[3]);
#else
    float l[16];
    memcpy(l, &v, sizeof l);
    for (int w = 8; w >= 1; w >>= 1)
        for (int i = 0; i < w; i++) l[i] += l[i + w];
    return l[0];
#endif
}

/* acc with a[l] * b[l] (b NULL: a[l]) added into lanes l < m (m < 16): the tail of a row; out of
 * line, so the loops above keep their accumulator in a register. */
static __attribute__((noinline)) v16f tail16(v16f acc, const float *a, const float *b, int64_t m) {
    float lanes[16];
    st16(lanes, acc);
    for (int64_t l = 0; l < m; l++) lanes[l] += b ? a[l] * b[l] : a[l];
    return ld16(lanes);
}

/* a . b over n: 16 lanes of products summed in order (a tail into lanes 0, 1, ..), then hsum16. */
static inline float dot16(const float *a, const float *b, int64_t n) {
    v16f acc = {0};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) acc += ld16(a + i) * ld16(b + i);
    return i < n ? hsum16(tail16(acc, a + i, b + i, n - i)) : hsum16(acc);
}

/* v[0 .. n) summed in 16 lanes in order (element j into lane j % 16), then hsum16. */
static inline float sum16(const float *v, int64_t n) {
    v16f acc = {0};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) acc += ld16(v + i);
    return i < n ? hsum16(tail16(acc, v + i, NULL, n - i)) : hsum16(acc);
}

/* e^x for x <= 0 (a softmax's shifted scores), relative error under 3e-7 (measured over [-87, 0] in
 * steps of 1e-4 against double exp), in branch-free operations the compiler vectorises: x = n ln2 + r, |r| <= ln2 / 2, e^r by its degree-6 Taylor polynomial, times
 * 2^n through the exponent bits; below -87 (where e^x < 2^-125) it is 0. */
static inline float exp_nonpositive(float x) {
    const float big = 12582912.f; /* 1.5 * 2^23: adding and subtracting it rounds to an integer */
    x = x < -87.f ? -87.f : x;
    float n = (x * 1.44269504f + big) - big;
    float r = (x - n * 0.693145752f) - n * 1.42860677e-6f; /* ln2 in two parts */
    float p = 1.f + r * (1.f + r * (0.5f + r * (1.6666667e-1f + r * (4.1666668e-2f + r * (8.3333338e-3f + r * 1.3888889e-3f)))));
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, 4);
    return x <= -87.f ? 0.f : p * scale;
}

/* x * rsqrt(mean(x^2) + eps) * w, the mean summed in double in order. */
static void rms_norm(const float *x, const float *w, int64_t n, float eps, float *y) {
    double ss = 0.0;
    for (int64_t i = 0; i < n; i++) ss += (double)x[i] * x[i];
    float r = 1.0f / sqrtf((float)(ss / (double)n) + eps);
    for (int64_t i = 0; i < n; i++) y[i] = w[i] * (x[i] * r);
}

static float bf16_to_f32(uint16_t b) {
    uint32_t bits = (uint32_t)b << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static uint16_t f32_to_bf16(float f) { /* nearest, ties to even, as torch's .to(bfloat16) */
    uint32_t x;
    memcpy(&x, &f, 4);
    if ((x & 0x7FFFFFFF) > 0x7F800000) return (uint16_t)((x >> 16) | 0x40); /* NaN stays NaN */
    return (uint16_t)((x + 0x7FFF + ((x >> 16) & 1)) >> 16);
}

static void store(int dtype, void *base, int64_t i, const float *src, int64_t n) {
    if (dtype == CACHE_F32) memcpy((float *)base + i, src, (size_t)n * sizeof(float));
    else if (dtype == CACHE_BF16)
        for (int64_t j = 0; j < n; j++) ((uint16_t *)base)[i + j] = f32_to_bf16(src[j]);
    else
        for (int64_t j = 0; j < n; j++) ((uint16_t *)base)[i + j] = f32_to_f16(src[j]);
}

static void copy_row(int dtype, const void *base, int64_t i, int64_t n, float *out) {
    if (dtype == CACHE_F32) {
        memcpy(out, (const float *)base + i, (size_t)n * sizeof(float));
        return;
    }
    const uint16_t *p = (const uint16_t *)base + i;
    if (dtype == CACHE_BF16)
        for (int64_t j = 0; j < n; j++) out[j] = bf16_to_f32(p[j]);
    else
        for (int64_t j = 0; j < n; j++) out[j] = f16_to_f32(p[j]);
}

#define ATT_TILE 32 /* cached positions converted to fp32 at a time */

/* An input vector in every form the linears reading it need: fp32, q8_0 and q8_K blocks. */
typedef struct {
    const float *x;
    q8a_t *q0;
    q8k_t *qk;
} act_forms;

static int need_act(const moerun_linear *l, int integer) { return integer ? FMT[l->fmt].act : ACT_F32; }

static int check_linear(const moerun_linear *l, int64_t rows, int64_t n) {
    if (l->fmt < 0 || l->fmt >= F_COUNT || !l->w) return -1;
    if (l->rows != rows || l->n != n || n % FMT[l->fmt].block) return -2;
    return 0;
}

static void forms_quantize(act_forms *f, int64_t n) { /* one thread */
    if (f->q0) quantize_q8a(f->x, n, f->q0);
    if (f->qk) quantize_q8k(f->x, n, f->qk);
}

/* This thread's share of l's rows: y[r] = row r . x (+ bias[r]). */
static void linear_rows(const moerun_linear *l, const act_forms *f, int integer, float *y, int tid, int nth) {
    const fmt_info *fi = &FMT[l->fmt];
    int act = integer ? fi->act : ACT_F32;
    rows_fn fn = act == ACT_F32 ? fi->exact : fi->integer;
    const void *xs[1] = {act == ACT_F32 ? (const void *)f->x : act == ACT_Q8_0 ? (const void *)f->q0
                                                                                : (const void *)f->qk};
    float *ys[1] = {y};
    int64_t lo = l->rows * tid / nth, hi = l->rows * (tid + 1) / nth;
    size_t rb = (size_t)(l->n / fi->block * fi->bytes);
    if (hi > lo) fn(l->w, rb, lo, hi, l->n, xs, 1, ys);
    if (l->bias)
        for (int64_t r = lo; r < hi; r++) y[r] += l->bias[r];
}

static int alloc_forms(act_forms *f, const float *x, int64_t n, const moerun_linear *const *ls, int count,
                       int integer) {
    int need0 = 0, needk = 0;
    for (int i = 0; i < count; i++) {
        int a = need_act(ls[i], integer);
        need0 |= a == ACT_Q8_0;
        needk |= a == ACT_Q8_K;
    }
    f->x = x;
    f->q0 = need0 ? malloc((size_t)(n / 32) * sizeof(q8a_t)) : NULL;
    f->qk = needk ? malloc((size_t)(n / 256) * sizeof(q8k_t)) : NULL;
    return (need0 && !f->q0) || (needk && !f->qk) ? -4 : 0;
}

static void rotate(float *v, const float *cos, const float *sin, int64_t D) {
    int64_t half = D / 2;
    for (int64_t i = 0; i < half; i++) {
        float a = v[i], b = v[half + i];
        v[i] = a * cos[i] - b * sin[i];
        v[half + i] = b * cos[i] + a * sin[i];
    }
}

/* x fp32 [hidden] (updated in place); cache_k, cache_v [kv_heads, capacity, head_dim] of cache_dtype;
 * the token at `pos` (< capacity); cos, sin fp32 [head_dim / 2] of that position. */
int moerun_attention_decode(const moerun_attention *a, float *x, void *cache_k, void *cache_v, int64_t capacity,
                            int64_t pos, const float *cos, const float *sin, int integer, int nthreads) {
    extern void moerun_ensure_init(void);
    moerun_ensure_init();
    const int64_t H = a->hidden, nh = a->heads, nkv = a->kv_heads, D = a->head_dim;
    if (nh <= 0 || nkv <= 0 || nh % nkv || D <= 0 || D % 2 || pos < 0 || pos >= capacity) return -1;
    if (a->cache_dtype < CACHE_F32 || a->cache_dtype > CACHE_BF16) return -1;
    int err = check_linear(&a->q, nh * D, H);
    err = err ? err : check_linear(&a->k, nkv * D, H);
    err = err ? err : check_linear(&a->v, nkv * D, H);
    err = err ? err : check_linear(&a->o, H, nh * D);
    if (err) return err;
    const int64_t first = a->window > 0 && pos - a->window + 1 > 0 ? pos - a->window + 1 : 0;
    const int64_t S = pos - first + 1, groups = nh / nkv;
    float *h = malloc((size_t)H * sizeof(float));
    float *qkv = malloc((size_t)((nh + 2 * nkv) * D) * sizeof(float));
    float *att = malloc((size_t)(nh * D) * sizeof(float)), *o = malloc((size_t)H * sizeof(float));
    float *scores = malloc((size_t)(nh * (S + 1)) * sizeof(float));
    float *tiles = malloc((size_t)(nkv * 2 * ATT_TILE * D) * sizeof(float));
    const moerun_linear *in[3] = {&a->q, &a->k, &a->v}, *out[1] = {&a->o};
    act_forms fx = {0}, fa = {0};
    if (!h || !qkv || !att || !o || !scores || !tiles) err = -4;
    err = err ? err : alloc_forms(&fx, h, H, in, 3, integer);
    err = err ? err : alloc_forms(&fa, att, nh * D, out, 1, integer);
    if (!err) {
        float *q = qkv, *k = qkv + nh * D, *v = k + nkv * D;
        const float clip = a->clip;
#pragma omp parallel num_threads(nthreads)
        {
            int nth = omp_get_num_threads(), tid = omp_get_thread_num();
#pragma omp single
            {
                rms_norm(x, a->norm, H, a->eps, h);
                forms_quantize(&fx, H);
            }
            linear_rows(&a->q, &fx, integer, q, tid, nth);
            linear_rows(&a->k, &fx, integer, k, tid, nth);
            linear_rows(&a->v, &fx, integer, v, tid, nth);
#pragma omp barrier
#pragma omp single
            {
                if (a->qk_norm == QK_FULL) {
                    rms_norm(q, a->q_norm, nh * D, a->qk_eps, q);
                    rms_norm(k, a->k_norm, nkv * D, a->qk_eps, k);
                }
                if (clip > 0)
                    for (int64_t i = 0; i < (nh + 2 * nkv) * D; i++)
                        qkv[i] = qkv[i] > clip ? clip : (qkv[i] < -clip ? -clip : qkv[i]);
            }
            /* per head: the head norm and rope of q and k heads; k and v heads into the cache */
#pragma omp for schedule(static)
            for (int64_t i = 0; i < nh + 2 * nkv; i++) {
                float *hv = qkv + i * D;
                if (i < nh + nkv) {
                    if (a->qk_norm == QK_HEAD) rms_norm(hv, i < nh ? a->q_norm : a->k_norm, D, a->qk_eps, hv);
                    rotate(hv, cos, sin, D);
                }
                if (i >= nh)
                    store(a->cache_dtype, i < nh + nkv ? cache_k : cache_v,
                          ((i - nh) % nkv * capacity + pos) * D, hv, D);
            }
            /* each kv head's group of query heads against the cached keys [first, pos], in tiles of
             * ATT_TILE positions converted to fp32 once for the group (implicit barrier above) */
#pragma omp for schedule(static)
            for (int64_t g = 0; g < nkv; g++) {
                float *kt = tiles + g * 2 * ATT_TILE * D, *vt = kt + ATT_TILE * D;
                float *sg = scores + g * groups * (S + 1); /* [groups][S + 1] */
                for (int64_t j0 = 0; j0 < S; j0 += ATT_TILE) {
                    const int64_t nt = S - j0 < ATT_TILE ? S - j0 : ATT_TILE;
                    for (int64_t i = 0; i < nt; i++)
                        copy_row(a->cache_dtype, cache_k, (g * capacity + first + j0 + i) * D, D, kt + i * D);
                    for (int64_t h = 0; h < groups; h++)
                        for (int64_t i = 0; i < nt; i++)
                            sg[h * (S + 1) + j0 + i] = dot16(q + (g * groups + h) * D, kt + i * D, D) * a->scale;
                }
                for (int64_t h = 0; h < groups; h++) {
                    const int64_t hq = g * groups + h;
                    float *sc = sg + h * (S + 1), m = a->sinks ? a->sinks[hq] : -FLT_MAX, denom = 0.f;
                    for (int64_t j = 0; j < S; j++) m = sc[j] > m ? sc[j] : m; /* exact in any order */
                    for (int64_t j = 0; j < S; j++) sc[j] = exp_nonpositive(sc[j] - m);
                    denom = sum16(sc, S);
                    if (a->sinks) denom += exp_nonpositive(a->sinks[hq] - m);
                    sc[S] = 1.f / denom;
                    for (int64_t d = 0; d < D; d++) att[hq * D + d] = 0.f;
                }
                for (int64_t j0 = 0; j0 < S; j0 += ATT_TILE) {
                    const int64_t nt = S - j0 < ATT_TILE ? S - j0 : ATT_TILE;
                    for (int64_t i = 0; i < nt; i++)
                        copy_row(a->cache_dtype, cache_v, (g * capacity + first + j0 + i) * D, D, vt + i * D);
                    for (int64_t h = 0; h < groups; h++) {
                        float *acc = att + (g * groups + h) * D;
                        const float *p = sg + h * (S + 1) + j0;
                        int64_t d0 = 0;
                        for (; d0 + 16 <= D; d0 += 16) { /* 16 outputs in a register across the tile */
                            v16f r = ld16(acc + d0);
                            for (int64_t i = 0; i < nt; i++) r += p[i] * ld16(vt + i * D + d0);
                            st16(acc + d0, r);
                        }
                        for (int64_t i = 0; i < nt; i++)
                            for (int64_t d = d0; d < D; d++) acc[d] += p[i] * vt[i * D + d];
                    }
                }
                for (int64_t h = 0; h < groups; h++) {
                    float *acc = att + (g * groups + h) * D;
                    const float inv = sg[h * (S + 1) + S];
                    for (int64_t d = 0; d < D; d++) acc[d] *= inv;
                }
            }
#pragma omp single
            forms_quantize(&fa, nh * D);
            linear_rows(&a->o, &fa, integer, o, tid, nth);
            int64_t lo = H * tid / nth, hi = H * (tid + 1) / nth; /* the rows this thread computed */
            for (int64_t r = lo; r < hi; r++) x[r] += o[r];
        }
    }
    free(h), free(qkv), free(att), free(o), free(scores), free(tiles);
    free(fx.q0), free(fx.qk), free(fa.q0), free(fa.qk);
    return err;
}

enum { ROUTE_LOGITS_ONLY = -1, ROUTE_SOFTMAX_TOPK = 0, ROUTE_TOPK_SOFTMAX = 1 };

/* The k largest of v [n] (ties: the lower index first) into idx [k], in descending value. */
static void top_k(const float *v, int64_t n, int64_t k, int64_t *idx) {
    for (int64_t j = 0; j < k; j++) {
        int64_t best = -1;
        for (int64_t i = 0; i < n; i++) {
            int taken = 0;
            for (int64_t t = 0; t < j && !taken; t++) taken = idx[t] == i;
            if (!taken && (best < 0 || v[i] > v[best])) best = i;
        }
        idx[j] = best;
    }
}

/* One token's routing from its logits l [E] into ids [k] (ascending) and weights [k]. */
static void route_one(const float *l, int64_t E, int kind, int64_t k, int renormalize, float *p, int64_t *top,
                      int64_t *ids, float *weights) {
    float m = l[0];
    for (int64_t e = 1; e < E; e++) m = l[e] > m ? l[e] : m;
    if (kind == ROUTE_SOFTMAX_TOPK) { /* softmax over all experts, then the k most probable */
        float sum = 0.f;
        for (int64_t e = 0; e < E; e++) sum += p[e] = expf(l[e] - m);
        for (int64_t e = 0; e < E; e++) p[e] /= sum;
        top_k(p, E, k, top);
        float total = 0.f;
        for (int64_t j = 0; j < k; j++) total += p[top[j]];
        for (int64_t j = 0; j < k; j++) weights[j] = renormalize ? p[top[j]] / total : p[top[j]];
    } else { /* the k largest logits, then a softmax over those k */
        top_k(l, E, k, top);
        float mk = l[top[0]], sum = 0.f;
        for (int64_t j = 0; j < k; j++) sum += weights[j] = expf(l[top[j]] - mk);
        for (int64_t j = 0; j < k; j++) weights[j] /= sum;
    }
    for (int64_t j = 0; j < k; j++) ids[j] = top[j];
    for (int64_t i = 1; i < k; i++) /* ascending id, each weight with its expert */
        for (int64_t j = i; j > 0 && ids[j - 1] > ids[j]; j--) {
            int64_t ti = ids[j];
            float tw = weights[j];
            ids[j] = ids[j - 1], weights[j] = weights[j - 1];
            ids[j - 1] = ti, weights[j - 1] = tw;
        }
}

/* T tokens x [T, H]: h = rms_norm(x, norm) [T, H] (norm NULL: the router reads x, h is not written);
 * logits [T, E] = router_w [E, H] . h (+ router_b); then, unless kind is ROUTE_LOGITS_ONLY, each
 * token's ids int64 [T, k] ascending and weights fp32 [T, k]. Every value is one token's alone (the
 * same bits in any batch). Returns 1 (and routes nothing) when a logit is not finite. */
int moerun_moe_route(const float *x, int64_t T, int64_t H, const float *norm, float eps, const float *router_w,
                     const float *router_b, int64_t E, int kind, int64_t k, int renormalize, float *h,
                     float *logits, int64_t *ids, float *weights, int nthreads) {
    if (T <= 0 || H <= 0 || E <= 0 || kind < ROUTE_LOGITS_ONLY || kind > ROUTE_TOPK_SOFTMAX) return -1;
    if (kind != ROUTE_LOGITS_ONLY && (k <= 0 || k > E)) return -1;
    const float *in = norm ? h : x;
#pragma omp parallel num_threads(nthreads)
    {
        if (norm) {
#pragma omp for schedule(static)
            for (int64_t t = 0; t < T; t++) rms_norm(x + t * H, norm, H, eps, h + t * H);
        }
#pragma omp for schedule(static)
        for (int64_t i = 0; i < T * E; i++) {
            const int64_t t = i / E, e = i % E;
            logits[i] = dot16(router_w + e * H, in + t * H, H) + (router_b ? router_b[e] : 0.f);
        }
    }
    for (int64_t i = 0; i < T * E; i++)
        if (!isfinite(logits[i])) return 1;
    if (kind == ROUTE_LOGITS_ONLY) return 0;
    int64_t *top = malloc((size_t)k * sizeof *top);
    float *p = malloc((size_t)E * sizeof *p);
    if (!top || !p) {
        free(top), free(p);
        return -4;
    }
    for (int64_t t = 0; t < T; t++)
        route_one(logits + t * E, E, kind, k, renormalize, p, top, ids + t * k, weights + t * k);
    free(top), free(p);
    return 0;
}
