/* y = x . W^T (+ bias) with W held in 32-weight quantized blocks (GGUF Q8_0 / Q4_0 / Q4_1, or the
 * same blocks made at load from an HF checkpoint), dequantized in registers; fp32 activations.
 *
 * A decode step reads every weight once, so its time is the weight bytes over memory bandwidth:
 * Q4_1 is 0.75 bytes a weight here against fp32's 4. The kernel is small_gemm.c's, with the panel's
 * fp32 values made on the fly: panel p holds columns [p * NB, (p + 1) * NB); per block of 32 k
 * steps it stores the NB columns' scales (fp32, and Q4_1's minimums), then the quants k-major, NB
 * a row (one byte each for Q8_0; Q4_0 / Q4_1 pack the k steps 2t and 2t + 1 of a column into the
 * low and high nibble of one byte). Columns past N are zero.
 *
 * Each weight is dequantized exactly as the gguf package does it (Q8_0: d * q; Q4_0: d * (q - 8);
 * Q4_1: d * q, rounded, + m: no fused multiply-add there), and each output y[i][j] is one chain of
 * multiply-adds over k = 0..K-1 in order from zero, then + bias[j]: the very arithmetic of
 * small_gemm.c on the dequantized weight. So a row's result is bit-equal alone, in any batch and at
 * any thread count, and bit-equal to the fp32 native GEMM on the gguf-dequantized weight.
 *
 * Built per instruction set by native_build.py; OpenMP threads are torch's. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
#define W 16
#ifndef MR
#define MR 8
#define V 3
#endif
#else
#if defined(__AVX2__) && defined(__FMA__)
#define W 8
#else
#define W 4
#endif
#ifndef MR
#define MR 6
#define V 2
#endif
#endif
#define NB (V * W)
#define QK 32
#ifndef MC
#define MC 256
#endif
#ifndef PREFETCH_BLOCKS
#define PREFETCH_BLOCKS 2
#endif

enum { FMT_Q8_0 = 0, FMT_Q4_0 = 1, FMT_Q4_1 = 2 };

#define INLINE static inline __attribute__((always_inline))

typedef float vf __attribute__((vector_size(4 * W), aligned(4)));
typedef float vf_at __attribute__((vector_size(4 * W), aligned(4), may_alias));
typedef int8_t vi8 __attribute__((vector_size(W), aligned(1), may_alias));
typedef uint8_t vu8 __attribute__((vector_size(W), aligned(1), may_alias));

INLINE vf loadv(const float *p) { return *(const vf_at *)p; }
INLINE void storev(float *p, vf x) { *(vf_at *)p = x; }

/* A product that must be rounded on its own (the gguf package rounds d * q before adding m): the
 * empty asm hides it from -ffp-contract=fast, which would fuse it into the add. */
INLINE vf rounded(vf p) {
#if defined(__x86_64__) || defined(__i386__)
    __asm__("" : "+v"(p));
#endif
    return p;
}

/* W quants as floats: Q8_0's signed bytes; a Q4 byte's low and high nibbles. (The compiler's own
 * byte-to-float vector conversion went through general registers one lane at a time.) */
#if defined(__AVX512F__)
INLINE vf from_i8(const uint8_t *p) {
    return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
INLINE void from_nibbles(const uint8_t *p, vf *lo, vf *hi) {
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    *lo = (vf)_mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15)));
    *hi = (vf)_mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
}
#elif defined(__AVX2__)
INLINE vf from_i8(const uint8_t *p) {
    return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
INLINE void from_nibbles(const uint8_t *p, vf *lo, vf *hi) {
    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    *lo = (vf)_mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15)));
    *hi = (vf)_mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
}
#else
INLINE vf from_i8(const uint8_t *p) { return __builtin_convertvector(*(const vi8 *)p, vf); }
INLINE void from_nibbles(const uint8_t *p, vf *lo, vf *hi) {
    const vu8 q = *(const vu8 *)p;
    *lo = __builtin_convertvector(q & 15, vf);
    *hi = __builtin_convertvector(q >> 4, vf);
}
#endif

int32_t llmserve_qgemm_panel_width(void) { return NB; }

INLINE int64_t scale_bytes(int fmt) { return (int64_t)NB * 4 * (fmt == FMT_Q4_1 ? 2 : 1); }
INLINE int64_t quant_bytes(int fmt) { return (int64_t)NB * (fmt == FMT_Q8_0 ? QK : QK / 2); }

int64_t llmserve_qgemm_packed_bytes(int32_t fmt, int64_t n, int64_t k) {
    return ((n + NB - 1) / NB) * (k / QK) * (scale_bytes(fmt) + quant_bytes(fmt));
}

/* q: n x k quants, one byte each (int8 for Q8_0, 0..15 for Q4); d, m: n x k/32 fp32 (m only Q4_1). */
void llmserve_qgemm_pack(int32_t fmt, const uint8_t *q, const float *d, const float *m, int64_t n, int64_t k,
                         uint8_t *packed) {
    const int64_t panels = (n + NB - 1) / NB, blocks = k / QK;
    const int64_t sb = scale_bytes(fmt), qb = quant_bytes(fmt);
    uint8_t *out = packed;
    for (int64_t p = 0; p < panels; ++p)
        for (int64_t b = 0; b < blocks; ++b) {
            float *ds = (float *)out, *ms = ds + NB;
            uint8_t *qs = out + sb;
            for (int c = 0; c < NB; ++c) {
                const int64_t j = p * NB + c;
                ds[c] = j < n ? d[j * blocks + b] : 0.0f;
                if (fmt == FMT_Q4_1) ms[c] = j < n ? m[j * blocks + b] : 0.0f;
            }
            for (int t = 0; t < (fmt == FMT_Q8_0 ? QK : QK / 2); ++t)
                for (int c = 0; c < NB; ++c) {
                    const int64_t j = p * NB + c;
                    const uint8_t *src = q + j * k + b * QK;
                    uint8_t v = 0;
                    if (j < n)
                        v = fmt == FMT_Q8_0 ? src[t] : (uint8_t)((src[2 * t] & 15) | (src[2 * t + 1] << 4));
                    qs[t * NB + c] = v;
                }
            out += sb + qb;
        }
}

/* One k step of m rows: acc[i][v] += x[i][kk] * w[v], the fp32 GEMM's multiply-add. */
#define STEP(kk, w)                                                     \
    for (int i = 0; i < m; ++i) {                                       \
        const float xv = x[i * ldx + (kk)];                            \
        for (int v = 0; v < V; ++v) acc[i][v] += xv * (w)[v];          \
    }

INLINE void panel_rows(const int fmt, const float *restrict x, int64_t ldx, const uint8_t *restrict panel,
                       int64_t k, const int m, const float *restrict bias, float *restrict out, int64_t ldo,
                       int cols) {
    const int64_t sb = scale_bytes(fmt), stride = sb + quant_bytes(fmt), blocks = k / QK;
    vf acc[MR][V];
    for (int i = 0; i < m; ++i)
        for (int v = 0; v < V; ++v) acc[i][v] = (vf){0};
    for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t *blk = panel + b * stride;
        for (int64_t off = 0; off < stride; off += 64) __builtin_prefetch(blk + PREFETCH_BLOCKS * stride + off, 0, 3);
        const float *ds = (const float *)blk;
        const uint8_t *qs = blk + sb;
        const int64_t k0 = b * QK;
        vf dv[V];
        for (int v = 0; v < V; ++v) dv[v] = loadv(ds + v * W);
        if (fmt == FMT_Q8_0) {
            for (int t = 0; t < QK; ++t) {
                vf w[V];
                for (int v = 0; v < V; ++v)
                    w[v] = from_i8(qs + t * NB + v * W) * dv[v];
                STEP(k0 + t, w)
            }
        } else if (fmt == FMT_Q4_0) {
            for (int t = 0; t < QK / 2; ++t) {
                vf lo[V], hi[V];
                for (int v = 0; v < V; ++v) {
                    from_nibbles(qs + t * NB + v * W, &lo[v], &hi[v]);
                    lo[v] = (lo[v] - 8.0f) * dv[v];
                    hi[v] = (hi[v] - 8.0f) * dv[v];
                }
                STEP(k0 + 2 * t, lo)
                STEP(k0 + 2 * t + 1, hi)
            }
        } else {
            vf mv[V];
            for (int v = 0; v < V; ++v) mv[v] = loadv(ds + NB + v * W);
            for (int t = 0; t < QK / 2; ++t) {
                vf lo[V], hi[V];
                for (int v = 0; v < V; ++v) {
                    from_nibbles(qs + t * NB + v * W, &lo[v], &hi[v]);
                    lo[v] = rounded(lo[v] * dv[v]) + mv[v];
                    hi[v] = rounded(hi[v] * dv[v]) + mv[v];
                }
                STEP(k0 + 2 * t, lo)
                STEP(k0 + 2 * t + 1, hi)
            }
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

/* The whole panel dequantized into buf (k x NB floats), with the very operations panel_rows uses. */
INLINE void dequantize_panel(const int fmt, const uint8_t *restrict panel, int64_t k, float *restrict buf) {
    const int64_t sb = scale_bytes(fmt), stride = sb + quant_bytes(fmt), blocks = k / QK;
    for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t *blk = panel + b * stride;
        const float *ds = (const float *)blk;
        const uint8_t *qs = blk + sb;
        float *out = buf + b * QK * NB;
        vf dv[V], mv[V];
        for (int v = 0; v < V; ++v) dv[v] = loadv(ds + v * W);
        if (fmt == FMT_Q4_1)
            for (int v = 0; v < V; ++v) mv[v] = loadv(ds + NB + v * W);
        if (fmt == FMT_Q8_0) {
            for (int t = 0; t < QK; ++t)
                for (int v = 0; v < V; ++v) storev(out + t * NB + v * W, from_i8(qs + t * NB + v * W) * dv[v]);
        } else {
            for (int t = 0; t < QK / 2; ++t)
                for (int v = 0; v < V; ++v) {
                    vf lo, hi;
                    from_nibbles(qs + t * NB + v * W, &lo, &hi);
                    if (fmt == FMT_Q4_0) {
                        lo = (lo - 8.0f) * dv[v];
                        hi = (hi - 8.0f) * dv[v];
                    } else {
                        lo = rounded(lo * dv[v]) + mv[v];
                        hi = rounded(hi * dv[v]) + mv[v];
                    }
                    storev(out + 2 * t * NB + v * W, lo);
                    storev(out + (2 * t + 1) * NB + v * W, hi);
                }
        }
    }
}

/* small_gemm.c's panel kernel on a dequantized panel (in cache): for many rows, the weights are
 * dequantized once per panel instead of once per row block. Same chains, so the same bits. */
INLINE void f32_rows(const float *restrict x, int64_t ldx, const float *restrict wbuf, int64_t k, const int m,
                     const float *restrict bias, float *restrict out, int64_t ldo, int cols) {
    vf acc[MR][V];
    for (int i = 0; i < m; ++i)
        for (int v = 0; v < V; ++v) acc[i][v] = (vf){0};
    for (int64_t kk = 0; kk < k; ++kk) {
        vf w[V];
        for (int v = 0; v < V; ++v) w[v] = loadv(wbuf + kk * NB + v * W);
        STEP(kk, w)
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

static void f32_all_rows(const float *x, int64_t m, int64_t k, int64_t ldx, const float *wbuf, const float *bias,
                         float *y, int64_t ldy, int cols) {
    float bias_pad[NB];
    if (bias && cols < NB) {
        memset(bias_pad, 0, sizeof bias_pad);
        memcpy(bias_pad, bias, sizeof(float) * cols);
        bias = bias_pad;
    }
    int64_t i = 0;
    for (; i + MR <= m; i += MR) f32_rows(x + i * ldx, ldx, wbuf, k, MR, bias, y + i * ldy, ldy, cols);
    const float *xr = x + i * ldx;
    float *yr = y + i * ldy;
    switch (m - i) {
        case 1: f32_rows(xr, ldx, wbuf, k, 1, bias, yr, ldy, cols); break;
        case 2: f32_rows(xr, ldx, wbuf, k, 2, bias, yr, ldy, cols); break;
        case 3: f32_rows(xr, ldx, wbuf, k, 3, bias, yr, ldy, cols); break;
        case 4: f32_rows(xr, ldx, wbuf, k, 4, bias, yr, ldy, cols); break;
        case 5: f32_rows(xr, ldx, wbuf, k, 5, bias, yr, ldy, cols); break;
        case 6: f32_rows(xr, ldx, wbuf, k, 6 % MR, bias, yr, ldy, cols); break;
        case 7: f32_rows(xr, ldx, wbuf, k, 7 % MR, bias, yr, ldy, cols); break;
        default: break;
    }
}

static void dequantize_panel_fmt(int fmt, const uint8_t *panel, int64_t k, float *buf) {
    if (fmt == FMT_Q8_0)
        dequantize_panel(FMT_Q8_0, panel, k, buf);
    else if (fmt == FMT_Q4_0)
        dequantize_panel(FMT_Q4_0, panel, k, buf);
    else
        dequantize_panel(FMT_Q4_1, panel, k, buf);
}

/* The format is a constant in each instantiation, so that each inner loop is compiled for one. */
#define PANEL_ALL_ROWS(NAME, FMT)                                                                           \
    static void NAME(const float *x, int64_t m, int64_t k, int64_t ldx, const uint8_t *panel,              \
                     const float *bias, float *y, int64_t ldy, int cols) {                                 \
        float bias_pad[NB];                                                                                \
        if (bias && cols < NB) {                                                                           \
            memset(bias_pad, 0, sizeof bias_pad);                                                          \
            memcpy(bias_pad, bias, sizeof(float) * cols);                                                  \
            bias = bias_pad;                                                                               \
        }                                                                                                  \
        int64_t i = 0;                                                                                     \
        for (; i + MR <= m; i += MR)                                                                       \
            panel_rows(FMT, x + i * ldx, ldx, panel, k, MR, bias, y + i * ldy, ldy, cols);                \
        const float *xr = x + i * ldx;                                                                     \
        float *yr = y + i * ldy;                                                                           \
        switch (m - i) {                                                                                   \
            case 1: panel_rows(FMT, xr, ldx, panel, k, 1, bias, yr, ldy, cols); break;                    \
            case 2: panel_rows(FMT, xr, ldx, panel, k, 2, bias, yr, ldy, cols); break;                    \
            case 3: panel_rows(FMT, xr, ldx, panel, k, 3, bias, yr, ldy, cols); break;                    \
            case 4: panel_rows(FMT, xr, ldx, panel, k, 4, bias, yr, ldy, cols); break;                    \
            case 5: panel_rows(FMT, xr, ldx, panel, k, 5, bias, yr, ldy, cols); break;                    \
            case 6: panel_rows(FMT, xr, ldx, panel, k, 6 % MR, bias, yr, ldy, cols); break;               \
            case 7: panel_rows(FMT, xr, ldx, panel, k, 7 % MR, bias, yr, ldy, cols); break;               \
            default: break;                                                                                \
        }                                                                                                  \
    }

PANEL_ALL_ROWS(panels_q8_0, FMT_Q8_0)
PANEL_ALL_ROWS(panels_q4_0, FMT_Q4_0)
PANEL_ALL_ROWS(panels_q4_1, FMT_Q4_1)

/* A thread's dequantized-panel buffer, kept and grown, never freed: a fresh allocation per item
 * (over glibc's mmap threshold for K >= 683) cost page faults on every panel. NULL when out of
 * memory (the caller then dequantizes in registers: the same bits). */
static float *panel_buffer(size_t floats) {
    static __thread float *buf;
    static __thread size_t cap;
    if (floats > cap) {
        float *grown = realloc(buf, sizeof(float) * floats);
        if (!grown) return NULL;
        buf = grown;
        cap = floats;
    }
    return buf;
}

/* y[m, n] (rows ldy apart) = x[m, k] (rows ldx apart) . W^T + bias (may be NULL); k % 32 == 0.
 * Returns 0, or -1 for an unknown format (nothing written). */
int32_t llmserve_qgemm(int32_t fmt, const float *x, int64_t m, int64_t k, int64_t ldx, const uint8_t *packed,
                       int64_t n, const float *bias, float *y, int64_t ldy, int32_t num_threads) {
    if (fmt < FMT_Q8_0 || fmt > FMT_Q4_1 || k % QK) return -1;
    const int64_t panels = (n + NB - 1) / NB, chunks = (m + MC - 1) / MC;
    const int64_t panel_bytes = (k / QK) * (scale_bytes(fmt) + quant_bytes(fmt));
#pragma omp parallel for schedule(static) num_threads(num_threads) if (m * n * k > 262144)
    for (int64_t item = 0; item < chunks * panels; ++item) {
        const int64_t c = item / panels, p = item % panels, r0 = c * MC;
        const int64_t rows = m - r0 < MC ? m - r0 : MC;
        const int cols = (int)(n - p * NB < NB ? n - p * NB : NB);
        const float *xr = x + r0 * ldx;
        const uint8_t *panel = packed + p * panel_bytes;
        const float *bp = bias ? bias + p * NB : NULL;
        float *yr = y + r0 * ldy + p * NB;
        float *wbuf = rows > MR ? panel_buffer((size_t)(k * NB)) : NULL;
        if (wbuf) { /* more than one row block: dequantize the panel once */
            dequantize_panel_fmt(fmt, panel, k, wbuf);
            f32_all_rows(xr, rows, k, ldx, wbuf, bp, yr, ldy, cols);
        } else if (fmt == FMT_Q8_0)
            panels_q8_0(xr, rows, k, ldx, panel, bp, yr, ldy, cols);
        else if (fmt == FMT_Q4_0)
            panels_q4_0(xr, rows, k, ldx, panel, bp, yr, ldy, cols);
        else
            panels_q4_1(xr, rows, k, ldx, panel, bp, yr, ldy, cols);
    }
    return 0;
}
