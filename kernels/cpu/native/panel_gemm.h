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
 * DEFINE_PANEL_ITEM(NAME, GROUP, UNROLL, MIN_ROWS, MAX_BYTES) makes NAME_item(), the work item: from
 * MIN_ROWS rows on (and a panel of at most MAX_BYTES as fp32), the panel is decoded once into a
 * thread's buffer that the fp32 kernel then reads for every row block, instead of once per block.
 *
 * The arithmetic is the same for every format: MR rows x NB columns of sums in registers, each
 * output y[i][j] one chain of multiply-adds over k = 0..K-1 in order from zero, then + bias[j],
 * whatever the other rows, their number, the thread or the panel split. So a row's result is
 * bit-equal alone and in any batch, and a decoded format's result is bit-equal to the fp32 kernel's
 * on the decoded weights (the decoders round as their reference dequantizers do). */

#ifndef LLMSERVE_PANEL_GEMM_H
#define LLMSERVE_PANEL_GEMM_H

#include <stdint.h>
#include <stdlib.h>
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

/* The next panel, asked for into L2 while this one runs (issue 44): with more than one row block, the
 * first block's pass streamed its panel from L3 or memory at the rate of the L1's few outstanding
 * misses (the later blocks read it from L2), and the cores sat on it. Now each block asks for its
 * share of the next panel's lines (the next work item's: panels are consecutive), a few per k group,
 * so that the stream runs under the arithmetic. One row block (a decode's GEMV) has no reuse to hide
 * it under: nothing is asked. Prefetches only: the arithmetic, and so the bits, are unchanged.
 * Only for panels of at most NEXT_PANEL_MAX bytes, so that two fit the L2 (1.25-2 MiB a core) beside
 * the rows' activations: the 0.5B's down projection (K = 4,864: 934 KB fp32) read 0.9x with it. */
#ifndef NEXT_PANEL_MAX
#define NEXT_PANEL_MAX (512 * 1024)
#endif
typedef struct {
    const char *next;
    int64_t steps, lines_per_block;
    int per;
} next_share;

INLINE next_share next_shares(int64_t m, int64_t groups, const uint8_t *next, int64_t next_bytes) {
    next_share ns = {(const char *)next, 0, 0, 0};
    const int64_t blocks = (m + MR - 1) / MR, lines = (next_bytes + 63) / 64;
    if (!next || blocks < 2 || groups < 1 || next_bytes > NEXT_PANEL_MAX) return ns;
    ns.lines_per_block = (lines + blocks - 1) / blocks;
    int64_t per = (ns.lines_per_block + groups - 1) / groups;
    ns.per = (int)(per > 4 ? 4 : per);
    ns.steps = (ns.lines_per_block + ns.per - 1) / ns.per;
    if (ns.steps > groups) ns.steps = groups;
    return ns;
}

INLINE const char *share_at(const next_share *ns, int64_t block) {
    return ns->steps ? ns->next + block * ns->lines_per_block * 64 : NULL;
}

INLINE void prefetch_lines(const char *p, int n) {
    __builtin_prefetch(p, 0, 2);
    if (n > 1) __builtin_prefetch(p + 64, 0, 2);
    if (n > 2) __builtin_prefetch(p + 128, 0, 2);
    if (n > 3) __builtin_prefetch(p + 192, 0, 2);
}

/* CALL(NAME, i, c) for the row blocks of M rows: c = MR rows from row i, then the rest (a switch, so
 * that each count is a constant: its own loop). */
#define ROW_BLOCKS(M, CALL, NAME)                                                                        \
    do {                                                                                                 \
        int64_t i_ = 0;                                                                                  \
        for (; i_ + MR <= (M); i_ += MR) CALL(NAME, i_, MR);                                             \
        switch ((M) - i_) {                                                                              \
            case 1: CALL(NAME, i_, 1); break;                                                            \
            case 2: CALL(NAME, i_, 2); break;                                                            \
            case 3: CALL(NAME, i_, 3); break;                                                            \
            case 4: CALL(NAME, i_, 4 % MR); break;                                                       \
            case 5: CALL(NAME, i_, 5 % MR); break;                                                       \
            case 6: CALL(NAME, i_, 6 % MR); break;                                                       \
            case 7: CALL(NAME, i_, 7 % MR); break;                                                       \
            default: break;                                                                              \
        }                                                                                                \
    } while (0)
_Static_assert(MR >= 4 && MR <= 8, "ROW_BLOCKS' remainder switch covers 4 <= MR <= 8");

/* NAME_rows: rows [0, m) of x (m <= MR, a constant at each call site) against one panel.
 * NAME_all_rows: every row of x, MR at a time, then the rest (a switch: each count its own loop). */
#define DEFINE_PANEL_KERNEL(NAME, GROUP, UNROLL)                                                         \
    INLINE void NAME##_rows(const float *restrict x, int64_t ldx, const uint8_t *restrict panel, int64_t k,   \
                            const int m, const float *restrict bias, float *restrict out, int64_t ldo,      \
                            int cols, const char *pf, int64_t pf_steps, int pf_per) {                    \
        vf acc[MR][V];                                                                                   \
        for (int i = 0; i < m; ++i)                                                                      \
            for (int v = 0; v < V; ++v) acc[i][v] = (vf){0};                                             \
        for (int64_t g = 0; g < k / (GROUP); ++g) {                                                      \
            if (g < pf_steps) prefetch_lines(pf + g * pf_per * 64, pf_per);                              \
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
                                const float *bias, float *y, int64_t ldy, int cols, const uint8_t *next,  \
                                int64_t next_bytes) {                                                    \
        float pad[NB];                                                                                   \
        bias = panel_bias(bias, cols, pad);                                                              \
        const next_share ns = next_shares(m, k / (GROUP), next, next_bytes);                             \
        ROW_BLOCKS(m, PANEL_ROWS_CALL, NAME);                                                            \
    }
#define PANEL_ROWS_CALL(NAME, i, c)                                                                      \
    NAME##_rows(x + (i) * ldx, ldx, panel, k, c, bias, y + (i) * ldy, ldy, cols, share_at(&ns, (i) / MR), \
                ns.steps, ns.per)

typedef void (*panel_all_rows_fn)(const float *x, int64_t m, int64_t k, int64_t ldx, const uint8_t *panel,
                                  const float *bias, float *y, int64_t ldy, int cols, const uint8_t *next,
                                  int64_t next_bytes);

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
                    j->bias ? j->bias + p * NB : NULL, j->y + r0 * j->ldy + p * NB, j->ldy, cols,
                    p + 1 < j->panels ? j->packed + (p + 1) * j->panel_bytes : NULL, j->panel_bytes);
    }
}

/* panel_gemm (below) with `items` running each thread's share of the items (panel_items, or a
 * wrapper of it: small_gemm.c's bf16 products set the thread's denormal flags around it). */
static void panel_gemm_items(range_fn items, panel_all_rows_fn all_rows, const float *x, int64_t m, int64_t k,
                             int64_t ldx, const uint8_t *packed, int64_t panel_bytes, int64_t n, const float *bias,
                             float *y, int64_t ldy, int32_t num_threads) {
    const int64_t panels = (n + NB - 1) / NB, chunks = (m + MC - 1) / MC;
    panel_job j = {all_rows, x, bias, packed, y, m, k, ldx, ldy, n, panel_bytes, panels};
    /* One chunk of rows (a decode's GEMV): the panels in shrinking contiguous ranges, so each thread
     * streams long runs of the weight (parallel.h; quant_int8act.c does the same). */
    if (chunks == 1)
        parallel_for_guided(num_threads, m * n * k > 262144, panels, 1, items, &j);
    else
        parallel_for(num_threads, m * n * k > 262144, chunks * panels, 1, items, &j);
}

/* y[m, n] (rows ldy apart) = x[m, k] (rows ldx apart) . W^T + bias (may be NULL), with the weight's
 * panels panel_bytes apart: the work items (rows, panel) shared among the threads (parallel.h). */
static void panel_gemm(panel_all_rows_fn all_rows, const float *x, int64_t m, int64_t k, int64_t ldx,
                       const uint8_t *packed, int64_t panel_bytes, int64_t n, const float *bias, float *y,
                       int64_t ldy, int32_t num_threads) {
    panel_gemm_items(panel_items, all_rows, x, m, k, ldx, packed, panel_bytes, n, bias, y, ldy, num_threads);
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

/* A thread's buffer number `slot` (0 or 1) of at least `bytes`, kept and grown, never freed: a fresh
 * allocation per item (over glibc's mmap threshold for K >= 683) cost page faults on every panel.
 * Its contents are not kept when it grows. NULL when out of memory. */
static void *thread_buffer(int slot, size_t bytes) {
    static __thread void *buf[2];
    static __thread size_t cap[2];
    if (bytes > cap[slot]) {
        void *grown = realloc(buf[slot], bytes);
        if (!grown) return NULL;
        buf[slot] = grown;
        cap[slot] = bytes;
    }
    return buf[slot];
}
/* A decoded panel's (slot 0; NULL: the caller then decodes in registers, the same bits). */
static float *panel_buffer(size_t floats) { return thread_buffer(0, sizeof(float) * floats); }

/* A format's work item: with MIN_ROWS rows or more and a panel of at most MAX_BYTES as fp32, the
 * panel is decoded once (with the very decoder the kernel uses) into a thread's buffer that the fp32
 * kernel then reads, instead of once per row block; else the format's own kernel decodes as it
 * reads. Same values, same chains, so the same bits. */
#define DEFINE_PANEL_ITEM(NAME, GROUP, UNROLL, MIN_ROWS, MAX_BYTES)                                      \
    static void NAME##_item(const float *x, int64_t m, int64_t k, int64_t ldx, const uint8_t *panel,    \
                            const float *bias, float *y, int64_t ldy, int cols, const uint8_t *next,     \
                            int64_t next_bytes) {                                                        \
        const int once = m >= (MIN_ROWS) && k * NB * (int64_t)sizeof(float) <= (MAX_BYTES);             \
        float *wbuf = once ? panel_buffer((size_t)(k * NB)) : NULL;                                      \
        if (!wbuf) {                                                                                     \
            NAME##_all_rows(x, m, k, ldx, panel, bias, y, ldy, cols, next, next_bytes);                  \
            return;                                                                                      \
        }                                                                                                \
        for (int64_t g = 0; g < k / (GROUP); ++g) {                                                      \
            const NAME##_group s = NAME##_begin(panel, k, g);                                            \
            for (int t = 0; t < (GROUP) / (UNROLL); ++t) {                                               \
                vf w[UNROLL][V];                                                                         \
                NAME##_weights(&s, t, w);                                                                \
                for (int u = 0; u < (UNROLL); ++u)                                                       \
                    for (int v = 0; v < V; ++v)                                                          \
                        storev(wbuf + (g * (GROUP) + t * (UNROLL) + u) * NB + v * W, w[u][v]);           \
            }                                                                                            \
        }                                                                                                \
        f32_all_rows(x, m, k, ldx, (const uint8_t *)wbuf, bias, y, ldy, cols, next, next_bytes);         \
    }

#endif
