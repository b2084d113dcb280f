/* The MoE step as one call, for one token or many: gate_up of every expert of the step (each
 * expert's rows read once for all its tokens, through the prefill GEMM where it has enough of them),
 * the activation, down, and each token's ordered weighted sum, in one OpenMP parallel region with
 * barriers between the phases. The step's slots are laid out by expert ("positions"); threads split
 * the rows of all the step's experts (static contiguous chunks of about equal time: rows times the
 * expert's tokens, row_costs), then the positions, then the output columns. */
#include <omp.h>
#include <stdlib.h>

#include "common.h"
#include "gemm.h"

enum { ACT_SILU, ACT_GELU, ACT_GELU_TANH, ACT_GPT_OSS };
enum { TABLE_COLS = 6 }; /* the expert table's columns, see moerun_moe_decode */

static size_t q_bytes(int act, int64_t n) {
    if (act == ACT_Q8_K) return (size_t)(n / 256) * sizeof(q8k_t);
    if (act == ACT_Q8_0) return (size_t)(n / 32) * sizeof(q8a_t);
    return (size_t)n * sizeof(float);
}

static void quant(int act, const float *x, int64_t n, void *out) {
    if (act == ACT_Q8_K) quantize_q8k(x, n, (q8k_t *)out);
    else quantize_q8a(x, n, (q8a_t *)out);
}

/* h = [gate rows | up rows] of one position (and its bias, in the same order) -> a [I]. */
static void activate(int kind, float alpha, float limit, const float *h, const float *bias, int64_t I,
                     float *a) {
    for (int64_t i = 0; i < I; i++) {
        float g = h[i], u = h[I + i];
        if (bias) {
            g += bias[i];
            u += bias[I + i];
        }
        if (kind == ACT_GPT_OSS) {
            g = g > limit ? limit : g;
            u = u > limit ? limit : (u < -limit ? -limit : u);
            a[i] = (u + 1.f) * (g * (1.f / (1.f + expf(-(g * alpha)))));
            continue;
        }
        if (kind == ACT_SILU) g = g / (1.f + expf(-g));
        else if (kind == ACT_GELU) g = 0.5f * g * (1.f + erff(g * 0.70710678118654752f));
        else g = 0.5f * g * (1.f + tanhf(0.79788456080286536f * (g + 0.044715f * g * g * g)));
        a[i] = g * u;
    }
}

/* One expert's projection: rows r at w + r * rb; gate_up's are two halves stored apart, gate rows
 * [0, I) at w and up rows [I, 2I) at up (row I + j at up + j * rb), wherever each lies. */
typedef struct {
    const uint8_t *w, *up;
    size_t rb;
    rows_fn fn;
    int act, fmt;
    int gemm;  /* this expert's projection runs the prefill GEMM (enough tokens) */
    void *xl;  /* its rearranged activations (GEMM only) */
} proj_t;

/* Rows [r0, r1) of one rows-weight (w, rb) for the positions [q0, q1) of an expert, into column
 * `col` + r of their output rows. */
static void rows_of(const proj_t *p, const uint8_t *w, int64_t r0, int64_t r1, int64_t col, int64_t n,
                    int64_t q0, int64_t q1, const int64_t *in_row, const char *const *act_base,
                    const size_t *act_stride, float *y, int64_t y_stride, void *work) {
    if (r0 >= r1) return;
    if (p->gemm) {
        GEMM[p->fmt].run(p->fmt, w, p->rb, r0, r1, n, p->xl, q1 - q0, y + q0 * y_stride + col, y_stride, work);
        return;
    }
    for (int64_t i0 = q0; i0 < q1; i0 += MAX_T) {
        int nt = (int)(q1 - i0 < MAX_T ? q1 - i0 : MAX_T);
        const void *xs[MAX_T];
        float *ys[MAX_T];
        for (int i = 0; i < nt; i++) {
            xs[i] = act_base[p->act] + (size_t)in_row[i0 + i] * act_stride[p->act];
            ys[i] = y + (i0 + i) * y_stride + col;
        }
        p->fn(w, p->rb, r0, r1, n, xs, nt, ys);
    }
}

/* Rows [lo, hi) of the concatenation of every expert's `rows`-row projection. Expert e's tokens sit
 * at positions off[e] .. off[e + 1] - 1 (the step's slots ordered by expert); position p reads
 * input row in_row[p] of act_base and writes y + p * y_stride; work: the thread's GEMM working memory. */
static void phase_rows(const proj_t *p, int64_t lo, int64_t hi, int64_t rows, int64_t n, const int64_t *off,
                       const int64_t *in_row, const char *const *act_base, const size_t *act_stride,
                       float *y, int64_t y_stride, void *work) {
    for (int64_t e = lo / rows; e * rows < hi; e++) {
        int64_t r0 = lo > e * rows ? lo - e * rows : 0, r1 = hi < (e + 1) * rows ? hi - e * rows : rows;
        if (off[e + 1] == off[e]) continue;
        const int64_t half = p[e].up ? rows / 2 : rows; /* rows read from w; the rest from up */
        rows_of(&p[e], p[e].w, r0, r1 < half ? r1 : half, 0, n, off[e], off[e + 1], in_row, act_base, act_stride, y,
                y_stride, work);
        if (p[e].up)
            rows_of(&p[e], p[e].up, (r0 > half ? r0 : half) - half, r1 - half, half, n, off[e], off[e + 1], in_row,
                    act_base, act_stride, y, y_stride, work);
    }
}

/* The global row (of E experts' `rows`-row projections) at work b, where each row of expert e
 * costs cost[e + 1] - cost[e] (cost: prefix sums): splitting work 0 .. cost[E] * rows evenly gives
 * each thread about as much time, not as many rows. Monotone in b; f(0) = 0, f(cost[E] * rows) =
 * E * rows. */
static int64_t work_row(int64_t b, int64_t rows, const int64_t *cost, int64_t E) {
    for (int64_t e = 0; e < E; e++)
        if (b < cost[e + 1] * rows) return e * rows + (b - cost[e] * rows) / (cost[e + 1] - cost[e]);
    return E * rows;
}

/* Prefix sums of a row's cost per expert, in token-products: its tokens (the GEMM's rounded up to
 * its 4-token micro-kernel) and one more for decoding the row's blocks; 0 for an expert without
 * tokens. */
static void row_costs(const proj_t *p, const int64_t *off, int64_t E, int64_t *cost) {
    cost[0] = 0;
    for (int64_t e = 0; e < E; e++) {
        const int64_t cnt = off[e + 1] - off[e];
        const int64_t c = p[e].gemm ? (cnt + GEMM_TOKENS - 1) / GEMM_TOKENS * GEMM_TOKENS : cnt;
        cost[e + 1] = cost[e] + (cnt ? c + 1 : 0);
    }
}

/* Sets up the GEMM of each expert's projection that has enough tokens (integer mode, a GEMM for its
 * format): the byte offsets of their rearranged activations in one buffer; returns its size. *work:
 * raised to the most working memory one thread's GEMM of these needs. */
static size_t plan_gemm(proj_t *p, int64_t E, const int64_t *off, int64_t n, int integer, int allow,
                        size_t *xl_off, size_t *work) {
    size_t total = 0;
    for (int64_t e = 0; e < E; e++) {
        const int f = p[e].fmt;
        const int64_t cnt = off[e + 1] - off[e];
        p[e].gemm = allow && integer && GEMM[f].run && cnt >= GEMM[f].min_t;
        xl_off[e] = total;
        if (!p[e].gemm) continue;
        total += (GEMM[f].size(f, cnt, n) + 63) / 64 * 64;
        const size_t need = gemm_work_stride(GEMM[f].work(f, n));
        *work = need > *work ? need : *work;
    }
    return total;
}

/* table int64 [E, 6] per expert: gate_up's gate half and up half addresses and the bytes between
 * their rows (gate row j at gate + j * stride, up row j at up + j * stride: halves stored apart, or
 * one [2I, H] weight's halves, or its rows interleaved), then the down address, the gate_up bias
 * (fp32 [2I], gate's then up's; 0: none) and the down bias (0: none); fmts int32 [E, 2]: the formats
 * of gate_up and down. slot_expert int32 [T * k]: each slot's row of the table (a
 * token's slots ordered by expert id; -1: a slot this call does not compute); slot_weight fp32
 * [T * k]. x [T, H] -> out [T, H]: each token's computed slots summed in order, o = o + w * y, from 0
 * or (flags bit 1, accumulate) from what out holds, so a step split over calls in ascending groups
 * of experts sums the very same sequence. flags: bit 0 integer mode, bit 1 accumulate, bit 2 row
 * kernels only (no prefill GEMM; the bits are the same). */
int moerun_moe_decode(int64_t E, const int64_t *table, const int32_t *fmts, int64_t H, int64_t I,
                      int64_t T, int64_t k, const int32_t *slot_expert, const float *slot_weight,
                      const float *x, float *out, int act_kind, float alpha, float limit, int flags,
                      int nthreads) {
    extern void moerun_ensure_init(void);
    moerun_ensure_init();
    const int integer = flags & 1, accumulate = flags & 2, allow_gemm = !(flags & 4);
    nthreads = nthreads > 0 ? nthreads : 1; /* a team has at most this many threads: one GEMM work part each */
    const int64_t S = T * k, R1 = 2 * I;
    if (E <= 0 || S <= 0 || act_kind < 0 || act_kind > ACT_GPT_OSS) return -1;
    proj_t *gu = calloc((size_t)E, sizeof *gu), *dn = calloc((size_t)E, sizeof *dn);
    int64_t *off = calloc((size_t)E + 1, sizeof *off);
    int64_t *pos = malloc((size_t)S * sizeof *pos);          /* slot -> position */
    int64_t *tok = malloc((size_t)S * sizeof *tok);          /* position -> token */
    int64_t *ident = malloc((size_t)S * sizeof *ident);      /* position -> position */
    int64_t *expert_at = malloc((size_t)S * sizeof *expert_at);
    size_t *xl_off = calloc((size_t)E * 2, sizeof *xl_off);
    int64_t *cost = malloc((size_t)(E + 1) * 2 * sizeof *cost); /* gate_up's, then down's */
    int need[2][3] = {{0}};
    int err = 0;
    for (int64_t e = 0; e < E && !err && gu && dn; e++) {
        for (int j = 0; j < 2; j++) {
            int f = fmts[2 * e + j];
            int64_t n = j ? I : H;
            if (f < 0 || f >= F_COUNT || n % FMT[f].block) {
                err = -2;
                break;
            }
            proj_t *p = j ? &dn[e] : &gu[e];
            const int64_t *row = table + TABLE_COLS * e;
            p->w = (const uint8_t *)(intptr_t)row[j ? 3 : 0];
            p->up = j ? NULL : (const uint8_t *)(intptr_t)row[1];
            const size_t row_bytes = (size_t)(n / FMT[f].block * FMT[f].bytes);
            p->rb = j ? row_bytes : (size_t)row[2];
            if (p->rb < row_bytes || !p->w || (!j && !p->up)) {
                err = -2;
                break;
            }
            p->act = integer ? FMT[f].act : ACT_F32;
            p->fn = p->act == ACT_F32 ? FMT[f].exact : FMT[f].integer;
            p->fmt = f;
            need[j][p->act] = 1;
        }
    }
    for (int64_t s = 0; s < S && !err; s++)
        if (slot_expert[s] < -1 || slot_expert[s] >= E) err = -3;
    int64_t P = 0; /* positions: the computed slots */
    if (!err && off && pos && tok && ident && expert_at) {
        for (int64_t s = 0; s < S; s++)
            if (slot_expert[s] >= 0) off[slot_expert[s] + 1]++;
        for (int64_t e = 0; e < E; e++) off[e + 1] += off[e];
        P = off[E];
        int64_t *fill = malloc((size_t)E * sizeof *fill);
        if (fill) {
            memcpy(fill, off, (size_t)E * sizeof *fill);
            for (int64_t s = 0; s < S; s++) {
                if (slot_expert[s] < 0) continue;
                int64_t p = fill[slot_expert[s]]++;
                pos[s] = p, tok[p] = s / k, ident[p] = p, expert_at[p] = slot_expert[s];
            }
            free(fill);
        } else err = -4;
    }
    size_t xk = q_bytes(ACT_Q8_K, H), x0 = q_bytes(ACT_Q8_0, H);
    size_t ak = q_bytes(ACT_Q8_K, I), a0 = q_bytes(ACT_Q8_0, I);
    const size_t P1 = (size_t)(P > 0 ? P : 1);
    float *h = NULL, *a = NULL, *y = NULL;
    char *xq_k = NULL, *xq_0 = NULL, *aq_k = NULL, *aq_0 = NULL;
    char *xl1 = NULL, *xl2 = NULL, *xg = NULL; /* the GEMMs' activations; gathered token rows */
    char *works = NULL;                        /* each thread's GEMM working memory, `work` bytes apart */
    size_t work = 0;
    if (!gu || !dn || !off || !pos || !tok || !ident || !expert_at || !xl_off || !cost) err = err ? err : -4;
    if (!err) { /* the large buffers, carved from the thread's scratch (reused call to call) */
        size_t n1 = plan_gemm(gu, E, off, H, integer, allow_gemm, xl_off, &work);
        size_t n2 = plan_gemm(dn, E, off, I, integer, allow_gemm, xl_off + E, &work);
        row_costs(gu, off, E, cost);
        row_costs(dn, off, E, cost + E + 1);
        const size_t sizes[] = {P1 * (size_t)R1 * sizeof(float), P1 * (size_t)I * sizeof(float),
                                P1 * (size_t)H * sizeof(float), need[0][ACT_Q8_K] ? xk * (size_t)T : 0,
                                need[0][ACT_Q8_0] ? x0 * (size_t)T : 0, need[1][ACT_Q8_K] ? ak * P1 : 0,
                                need[1][ACT_Q8_0] ? a0 * P1 : 0, n1, n2, n1 ? (xk > x0 ? xk : x0) * P1 : 0,
                                work * (size_t)nthreads};
        void *parts[11];
        err = moerun_scratch_parts(11, sizes, parts);
        h = parts[0], a = parts[1], y = parts[2], xq_k = parts[3], xq_0 = parts[4];
        aq_k = parts[5], aq_0 = parts[6], xl1 = parts[7], xl2 = parts[8], xg = parts[9], works = parts[10];
        for (int64_t e = 0; e < E && !err; e++) {
            gu[e].xl = gu[e].gemm ? xl1 + xl_off[e] : NULL;
            dn[e].xl = dn[e].gemm ? xl2 + xl_off[E + e] : NULL;
        }
    }
    if (!err && !accumulate) memset(out, 0, (size_t)(T * H) * sizeof(float));
    if (!err && P > 0) {
        const char *xb[3] = {(const char *)x, xq_0, xq_k}, *ab[3] = {(const char *)a, aq_0, aq_k};
        size_t xst[3] = {(size_t)H * sizeof(float), x0, xk}, ast[3] = {(size_t)I * sizeof(float), a0, ak};
#pragma omp parallel num_threads(nthreads)
        {
            int nth = omp_get_num_threads(), tid = omp_get_thread_num();
            void *mine = works ? works + (size_t)tid * work : NULL;
#pragma omp for schedule(static)
            for (int64_t t = 0; t < T; t++) {
                if (xq_k) quantize_q8k(x + t * H, H, (q8k_t *)(xq_k + t * xk));
                if (xq_0) quantize_q8a(x + t * H, H, (q8a_t *)(xq_0 + t * x0));
            }
            if (xl1) { /* the GEMM experts' tokens gathered, then rearranged */
#pragma omp for schedule(dynamic)
                for (int64_t e = 0; e < E; e++) {
                    if (!gu[e].gemm) continue;
                    const int f = gu[e].fmt, act = FMT[f].act;
                    const size_t b = xst[act];
                    char *g = xg + off[e] * (xk > x0 ? xk : x0); /* room for either block kind */
                    for (int64_t q = off[e]; q < off[e + 1]; q++) memcpy(g + (q - off[e]) * b, xb[act] + tok[q] * b, b);
                    const int64_t cnt = off[e + 1] - off[e];
                    for (int64_t gi = 0; gi < (cnt + GEMM_TOKENS - 1) / GEMM_TOKENS; gi++)
                        GEMM[f].prep(f, g, gi, cnt, H, gu[e].xl);
                }
            }
            const int64_t *cg = cost, *cd = cost + E + 1;
            phase_rows(gu, work_row(cg[E] * R1 * tid / nth, R1, cg, E), work_row(cg[E] * R1 * (tid + 1) / nth, R1, cg, E),
                       R1, H, off, tok, xb, xst, h, R1, mine);
#pragma omp barrier
#pragma omp for schedule(static)
            for (int64_t q = 0; q < P; q++) {
                int64_t e = expert_at[q];
                const float *bias = (const float *)(intptr_t)table[TABLE_COLS * e + 4];
                activate(act_kind, alpha, limit, h + q * R1, bias, I, a + q * I);
                if (dn[e].act != ACT_F32) quant(dn[e].act, a + q * I, I, (char *)ab[dn[e].act] + q * ast[dn[e].act]);
            }
            if (xl2) {
#pragma omp for schedule(dynamic)
                for (int64_t e = 0; e < E; e++) {
                    if (!dn[e].gemm) continue;
                    const int f = dn[e].fmt;
                    const int64_t cnt = off[e + 1] - off[e];
                    const char *g = ab[FMT[f].act] + off[e] * ast[FMT[f].act];
                    for (int64_t gi = 0; gi < (cnt + GEMM_TOKENS - 1) / GEMM_TOKENS; gi++)
                        GEMM[f].prep(f, g, gi, cnt, I, dn[e].xl);
                }
            }
            phase_rows(dn, work_row(cd[E] * H * tid / nth, H, cd, E), work_row(cd[E] * H * (tid + 1) / nth, H, cd, E), H,
                       I, off, ident, ab, ast, y, H, mine);
#pragma omp barrier
            int64_t c0 = H * tid / nth, c1 = H * (tid + 1) / nth;
            for (int64_t t = 0; t < T; t++) {
                float *o = out + t * H;
                for (int64_t j = 0; j < k; j++) {
                    int64_t s = t * k + j;
                    if (slot_expert[s] < 0) continue;
                    const float *ys = y + pos[s] * H, *bias = (const float *)(intptr_t)table[TABLE_COLS * slot_expert[s] + 5];
                    float wgt = slot_weight[s];
                    for (int64_t c = c0; c < c1; c++) o[c] = o[c] + (bias ? ys[c] + bias[c] : ys[c]) * wgt;
                }
            }
        }
    }
    free(gu), free(dn), free(off), free(pos), free(tok), free(ident), free(expert_at), free(xl_off), free(cost);
    return err;
}
