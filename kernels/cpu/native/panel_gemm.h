/* The panel kernel that every native linear shares (small_gemm.c: fp32 and bf16 weights;
 * quant_gemm.c: the quantized blocks): y = x . W^T (+ bias), fp32 activations and sums, on a weight
 * packed once into panels of NB columns. What differs between them is only how a panel's weights
 * become fp32 vectors, a "decoder" that the including file writes:
 *
 *   typedef ... NAME_group;                              what one group of k steps needs (scales...)
 *   INLINE NAME_group NAME_begin(const uint8_t *panel, int64_t k, int64_t g);   group g's start
 *   INLINE void NAME_weights(const NAME_group *s, int t, vf w[UNROLL][V]);      steps t*U .. t*U+U-1
 *
 * and then DEFINE_PANEL_KERNEL(NAME, GROUP, UNROLL) makes NAME_all_rows(): GROUP k steps share a
 * begin (fp32: 1; a quantized block: 32), UNROLL steps come from one weights call (a byte of two
 * nibbles gives two). The decoder is inlined, so each weight format compiles to its own loop.
 *
 * The arithmetic is the same for every format: MR rows x NB columns of sums in registers, each
 * output y[i][j] one chain of multiply-adds over k = 0..K-1 in order from zero, then + bias[j],
 * whatever the other rows, their number, the thread or the panel split. So a row's result is
 * bit-equal alone and in any batch, and a decoded format's result is bit-equal to the fp32 kernel's
 * on the decoded weights (the decoders round as their reference dequantizers do). */

#ifndef LLMSERVE_PANEL_GEMM_H
#define LLMSERVE_PANEL_GEMM_H

#include <stdint.h>
#include <string.h>

#include "parallel.h"
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
#define W 16
#ifndef MR
#define MR 8 /* 8 rows x 3 vectors: 24 of the 32 registers hold sums */
#define V 3
#endif
#else
#if defined(__AVX2__) && defined(__FMA__)
#define W 8
#else
#define W 4
#endif
#ifndef MR
#define MR 6 /* 6 x 2: 12 of 16 (4 x 3 measured a little slower with AVX2) */
#define V 2
#endif
#endif
#define NB (V * W)
/* Rows per work item: an item is (rows, panel), so that two threads split a narrow weight's rows
 * when its panels are few. */
#ifndef MC
#define MC 256
#endif

#define INLINE static inline __attribute__((always_inline))

typedef float vf __attribute__((vector_size(4 * W), aligned(4)));
typedef float vf_at __attribute__((vector_size(4 * W), aligned(4), may_alias));

INLINE vf loadv(const float *p) { return *(const vf_at *)p; }
INLINE void storev(float *p, vf x) { *(vf_at *)p = x; }

/* The rows' sums + bias, stored: cols of the NB columns (the last panel may be narrower). */
INLINE void panel_finish(vf acc[MR][V], const int m, const float *restrict bias, float *restrict out,
                         int64_t ldo, int cols) {
    if (bias) {
        vf bv[V];
        for (int v = 0; v < V; ++v) bv[v] = loadv(bias + v * W);
        for (int i = 0; i < m; ++i)
            for (int v = 0; v < V; ++v) acc[i][v] += bv[v];
    }
    if (cols == NB) {
        for (int i = 0; i < m; ++i)
            for (int v = 0; v < V; ++v) storev(out + i * ldo + v * W, acc[i][v]);
    } else {
        for (int i = 0; i < m; ++i) {
            float row[NB];
            for (int v = 0; v < V; ++v) storev(row + v * W, acc[i][v]);
            memcpy(out + i * ldo, row, sizeof(float) * cols);
        }
    }
}

/* The last panel's bias, zero past N (its loads read NB floats). */
INLINE const float *panel_bias(const float *bias, int cols, float pad[NB]) {
    if (!bias || cols == NB) return bias;
    memset(pad, 0, sizeof(float) * NB);
    memcpy(pad, bias, sizeof(float) * cols);
    return pad;
}

/* NAME_rows: rows [0, m) of x (m <= MR, a constant at each call site) against one panel.
 * NAME_all_rows: every row of x, MR at a time, then the rest (a switch: each count its own loop). */
#define DEFINE_PANEL_KERNEL(NAME, GROUP, UNROLL)                                                         \
    INLINE void NAME##_rows(const float *restrict x, int64_t ldx, const uint8_t *restrict panel, int64_t k,   \
                            const int m, const float *restrict bias, float *restrict out, int64_t ldo,      \
                            int cols) {                                                                  \
        vf acc[MR][V];                                                                                   \
        for (int i = 0; i < m; ++i)                                                                      \
            for (int v = 0; v < V; ++v) acc[i][v] = (vf){0};                                             \
        for (int64_t g = 0; g < k / (GROUP); ++g) {                                                      \
            const NAME##_group s = NAME##_begin(panel, k, g);                                            \
            for (int t = 0; t < (GROUP) / (UNROLL); ++t) {                                               \
                vf w[UNROLL][V];                                                                         \
                NAME##_weights(&s, t, w);                                                                \
                for (int u = 0; u < (UNROLL); ++u) {                                                     \
                    const int64_t kk = g * (GROUP) + t * (UNROLL) + u;                                   \
                    for (int i = 0; i < m; ++i) {                                                        \
                        const float xv = x[i * ldx + kk];                                                \
                        for (int v = 0; v < V; ++v) acc[i][v] += xv * w[u][v];                           \
                    }                                                                                    \
                }                                                                                        \
            }                                                                                            \
        }                                                                                                \
        panel_finish(acc, m, bias, out, ldo, cols);                                                      \
    }                                                                                                    \
    static void NAME##_all_rows(const float *x, int64_t m, int64_t k, int64_t ldx, const uint8_t *panel,     \
                                const float *bias, float *y, int64_t ldy, int cols) {                    \
        float pad[NB];                                                                                   \
        bias = panel_bias(bias, cols, pad);                                                              \
        int64_t i = 0;                                                                                   \
        for (; i + MR <= m; i += MR) NAME##_rows(x + i * ldx, ldx, panel, k, MR, bias, y + i * ldy, ldy, cols); \
        const float *xr = x + i * ldx;                                                                   \
        float *yr = y + i * ldy;                                                                         \
        switch (m - i) {                                                                                 \
            case 1: NAME##_rows(xr, ldx, panel, k, 1, bias, yr, ldy, cols); break;                       \
            case 2: NAME##_rows(xr, ldx, panel, k, 2, bias, yr, ldy, cols); break;                       \
            case 3: NAME##_rows(xr, ldx, panel, k, 3, bias, yr, ldy, cols); break;                       \
            case 4: NAME##_rows(xr, ldx, panel, k, 4 % MR, bias, yr, ldy, cols); break;                  \
            case 5: NAME##_rows(xr, ldx, panel, k, 5 % MR, bias, yr, ldy, cols); break;                  \
            case 6: NAME##_rows(xr, ldx, panel, k, 6 % MR, bias, yr, ldy, cols); break;                  \
            case 7: NAME##_rows(xr, ldx, panel, k, 7 % MR, bias, yr, ldy, cols); break;                  \
            default: break;                                                                              \
        }                                                                                                \
    }

typedef void (*panel_all_rows_fn)(const float *x, int64_t m, int64_t k, int64_t ldx, const uint8_t *panel,
                                  const float *bias, float *y, int64_t ldy, int cols);

typedef struct {
    panel_all_rows_fn all_rows;
    const float *x, *bias;
    const uint8_t *packed;
    float *y;
    int64_t m, k, ldx, ldy, n, panel_bytes, panels;
} panel_job;

/* Work items [begin, end): item = row chunk * panels + panel. */
static void panel_items(void *ctx, int64_t begin, int64_t end) {
    const panel_job *j = ctx;
    for (int64_t item = begin; item < end; ++item) {
        const int64_t c = item / j->panels, p = item % j->panels, r0 = c * MC;
        const int64_t rows = j->m - r0 < MC ? j->m - r0 : MC;
        const int cols = (int)(j->n - p * NB < NB ? j->n - p * NB : NB);
        j->all_rows(j->x + r0 * j->ldx, rows, j->k, j->ldx, j->packed + p * j->panel_bytes,
                    j->bias ? j->bias + p * NB : NULL, j->y + r0 * j->ldy + p * NB, j->ldy, cols);
    }
}

/* y[m, n] (rows ldy apart) = x[m, k] (rows ldx apart) . W^T + bias (may be NULL), with the weight's
 * panels panel_bytes apart: the work items (rows, panel) shared among the threads (parallel.h). */
static void panel_gemm(panel_all_rows_fn all_rows, const float *x, int64_t m, int64_t k, int64_t ldx,
                       const uint8_t *packed, int64_t panel_bytes, int64_t n, const float *bias, float *y,
                       int64_t ldy, int32_t num_threads) {
    const int64_t panels = (n + NB - 1) / NB, chunks = (m + MC - 1) / MC;
    panel_job j = {all_rows, x, bias, packed, y, m, k, ldx, ldy, n, panel_bytes, panels};
    /* One chunk of rows (a decode's GEMV): the panels in shrinking contiguous ranges, so each thread
     * streams long runs of the weight (parallel.h; quant_int8act.c does the same). */
    if (chunks == 1)
        parallel_for_guided(num_threads, m * n * k > 262144, panels, 1, panel_items, &j);
    else
        parallel_for(num_threads, m * n * k > 262144, chunks * panels, 1, panel_items, &j);
}

/* The fp32 decoder: a panel of k rows of NB floats, prefetched this many k steps ahead (12 KB on
 * AVX-512): the hardware prefetcher alone left a 16-row GEMM on a weight from memory at 60-70% of
 * the rate with it. (A prefetch past the end of the buffer is harmless: prefetches never fault.) */
#ifndef PREFETCH_K
#define PREFETCH_K 64
#endif
typedef const float *f32_group;
INLINE f32_group f32_begin(const uint8_t *panel, int64_t k, int64_t g) {
    (void)k;
    const float *wp = (const float *)panel + g * NB;
    for (int c = 0; c < NB; c += 16) __builtin_prefetch(wp + PREFETCH_K * NB + c, 0, 3);
    return wp;
}
INLINE void f32_weights(const f32_group *s, int t, vf w[1][V]) {
    (void)t;
    for (int v = 0; v < V; ++v) w[0][v] = loadv(*s + v * W);
}
DEFINE_PANEL_KERNEL(f32, 1, 1)

#endif
