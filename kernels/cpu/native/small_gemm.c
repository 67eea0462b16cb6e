/* y = x . W^T (+ bias) in fp32, on a weight packed once at load: the model's linears on the CPU.
 *
 * A decode step's linears have M = 1..64 rows against a weight of N x K that comes from memory
 * (a step streams every layer, more than the L3 holds); there oneDNN's prepacked kernels reached
 * 60-80% of this kernel's rate. This one streams each weight through once per step in panels of NB
 * columns and holds MR rows x NB columns of sums in registers, so that each weight vector loaded
 * feeds MR multiply-adds and each row value broadcast feeds V; on prefills (M in the hundreds or
 * thousands) it measured level with oneDNN. docs/architecture.md, "The CPU path"; docs/design/native-gemm.md.
 *
 * The packed weight is panel-major: panel p holds columns [p * NB, (p + 1) * NB) as K rows of NB
 * floats (columns past N are zero), so a panel is one sequential stream.
 *
 * Every output y[i][j] is one chain of multiply-adds over k = 0..K-1 in order, started at zero,
 * then + bias[j]: the same code and order whatever the other rows, their number, the thread or
 * the panel split. So a row's result is bit-equal alone and in any batch.
 *
 * Built per instruction set like paged_attention.c (native_build.py); OpenMP threads are torch's. */

#include <stdint.h>
#include <string.h>

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
/* The panel is prefetched this many k steps ahead (12 KB on AVX-512): the hardware prefetcher
 * alone left a 16-row GEMM on a weight from memory at 60-70% of the rate with it. (A prefetch
 * past the end of the buffer is harmless: prefetches never fault.) */
#ifndef PREFETCH_K
#define PREFETCH_K 64
#endif
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

int32_t llmserve_gemm_panel_width(void) { return NB; }

/* packed: ceil(n / NB) panels of k x NB floats. */
void llmserve_gemm_pack_f32(const float *w, int64_t n, int64_t k, float *packed) {
    const int64_t panels = (n + NB - 1) / NB;
    for (int64_t p = 0; p < panels; ++p)
        for (int64_t kk = 0; kk < k; ++kk) {
            float *dst = packed + (p * k + kk) * NB;
            for (int c = 0; c < NB; ++c) {
                const int64_t j = p * NB + c;
                dst[c] = j < n ? w[j * k + kk] : 0.0f;
            }
        }
}

/* rows [0, m) of x (m <= MR, a constant at each call site) against one panel; sums to out
 * (ld floats apart), cols of them. */
INLINE void panel_rows(const float *restrict x, int64_t ldx, const float *restrict panel, int64_t k,
                       const int m, const float *restrict bias, float *restrict out, int64_t ldo,
                       int cols) {
    vf acc[MR][V];
    for (int i = 0; i < m; ++i)
        for (int v = 0; v < V; ++v) acc[i][v] = (vf){0};
    for (int64_t kk = 0; kk < k; ++kk) {
        const float *wp = panel + kk * NB;
        for (int c = 0; c < NB; c += 16) __builtin_prefetch(wp + PREFETCH_K * NB + c, 0, 3);
        vf wv[V];
        for (int v = 0; v < V; ++v) wv[v] = loadv(wp + v * W);
        for (int i = 0; i < m; ++i) {
            const float b = x[i * ldx + kk];
            for (int v = 0; v < V; ++v) acc[i][v] += b * wv[v];
        }
    }
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

static void panel_all_rows(const float *x, int64_t m, int64_t k, int64_t ldx, const float *panel,
                           const float *bias, float *y, int64_t ldy, int cols) {
    float bias_pad[NB];
    if (bias && cols < NB) { /* the last panel's bias, zero past N */
        memset(bias_pad, 0, sizeof bias_pad);
        memcpy(bias_pad, bias, sizeof(float) * cols);
        bias = bias_pad;
    }
    int64_t i = 0;
    for (; i + MR <= m; i += MR) panel_rows(x + i * ldx, ldx, panel, k, MR, bias, y + i * ldy, ldy, cols);
    const float *xr = x + i * ldx;
    float *yr = y + i * ldy;
    switch (m - i) {
#define ROWS(r) \
    case r: panel_rows(xr, ldx, panel, k, r, bias, yr, ldy, cols); break;
        ROWS(1) ROWS(2) ROWS(3)
#if MR > 4
        ROWS(4) ROWS(5)
#endif
#if MR > 6
        ROWS(6) ROWS(7)
#endif
#undef ROWS
        default: break;
    }
}

/* y[m, n] (rows ldy apart) = x[m, k] (rows ldx apart) . W^T + bias (may be NULL). */
void llmserve_gemm_f32(const float *x, int64_t m, int64_t k, int64_t ldx, const float *packed, int64_t n,
                       const float *bias, float *y, int64_t ldy, int32_t num_threads) {
    const int64_t panels = (n + NB - 1) / NB, chunks = (m + MC - 1) / MC;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (m * n * k > 262144)
    for (int64_t item = 0; item < chunks * panels; ++item) {
        const int64_t c = item / panels, p = item % panels, r0 = c * MC;
        const int64_t rows = m - r0 < MC ? m - r0 : MC;
        const int cols = (int)(n - p * NB < NB ? n - p * NB : NB);
        panel_all_rows(x + r0 * ldx, rows, k, ldx, packed + p * k * NB, bias ? bias + p * NB : NULL,
                       y + r0 * ldy + p * NB, ldy, cols);
    }
}
