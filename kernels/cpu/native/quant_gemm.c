/* y = x . W^T (+ bias) with W held in quantized blocks, dequantized in registers; fp32 activations.
 * The blocks are GGUF's (Q8_0 / Q4_0 / Q4_1, and the K-quants Q2_K..Q6_K and IQ4_XS brought to the
 * forms below at load by kernels/cpu/quant_gemm.py), or made at load from an HF checkpoint.
 *
 * A decode step reads every weight once, so its time is the weight bytes over memory bandwidth:
 * Q4_1 is 0.75 bytes a weight here against fp32's 4. The kernel is panel_gemm.h's (shared with
 * small_gemm.c), with the panel's fp32 values made on the fly: panel p holds columns
 * [p * NB, (p + 1) * NB); per block of BK k steps (32; 16 for Q8_16) it stores the NB columns'
 * scales (fp32, then the minimums where the format has them), then the quants k-major, NB a row:
 *
 *   Q8_0   int8 quants, one byte each               w = d * q
 *   Q4_0   nibbles 0..15                            w = d * (q - 8)
 *   Q4_1   nibbles 0..15, minimums                  w = d * q (rounded) + m      (also Q4_K)
 *   U8_1   bytes 0..255, minimums                   w = d * q (rounded) + m      (Q5_K: 0..31)
 *   Q8_16  int8 quants, a scale per 16 k steps      w = d * q                    (Q6_K: -32..31)
 *   U8_16  bytes, a scale and minimum per 16 k steps w = d * q (rounded) + m     (Q2_K: 0..3)
 *
 * Nibble formats pack the k steps 2t and 2t + 1 of a column into the low and high nibble of one
 * byte. Columns past N are zero. Each weight is dequantized exactly as the gguf package does it
 * (no fused multiply-add where it rounds a product before adding), and the sums are the fp32
 * kernel's, so a row's result is bit-equal alone, in any batch and at any thread count, and
 * bit-equal to the fp32 native GEMM on the gguf-dequantized weight.
 *
 * Built per instruction set by native_build.py; threads: parallel.h's pool. */

#include <stdlib.h>

#include "panel_gemm.h"
#include "row_segments.h"

#ifndef PREFETCH_BLOCKS
#define PREFETCH_BLOCKS 2
#endif

enum { FMT_Q8_0 = 0, FMT_Q4_0 = 1, FMT_Q4_1 = 2, FMT_U8_1 = 3, FMT_Q8_16 = 4, FMT_U8_16 = 5, FMT_COUNT = 6 };

typedef int8_t vi8 __attribute__((vector_size(W), aligned(1), may_alias));
typedef uint8_t vu8 __attribute__((vector_size(W), aligned(1), may_alias));

/* A product that must be rounded on its own (the gguf package rounds d * q before adding m): the
 * empty asm hides it from -ffp-contract=fast, which would fuse it into the add. */
INLINE vf rounded(vf p) {
#if defined(__x86_64__) || defined(__i386__)
    __asm__("" : "+v"(p));
#endif
    return p;
}

/* W quants as floats: signed bytes, unsigned bytes, a byte's low and high nibbles. (The
 * compiler's own byte-to-float vector conversion went through general registers one lane at a time.) */
#if defined(__AVX512F__)
INLINE vf from_i8(const uint8_t *p) {
    return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
INLINE vf from_u8(const uint8_t *p) {
    return (vf)_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)));
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
INLINE vf from_u8(const uint8_t *p) {
    return (vf)_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
INLINE void from_nibbles(const uint8_t *p, vf *lo, vf *hi) {
    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    *lo = (vf)_mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15)));
    *hi = (vf)_mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
}
#else
INLINE vf from_i8(const uint8_t *p) { return __builtin_convertvector(*(const vi8 *)p, vf); }
INLINE vf from_u8(const uint8_t *p) { return __builtin_convertvector(*(const vu8 *)p, vf); }
INLINE void from_nibbles(const uint8_t *p, vf *lo, vf *hi) {
    const vu8 q = *(const vu8 *)p;
    *lo = __builtin_convertvector(q & 15, vf);
    *hi = __builtin_convertvector(q >> 4, vf);
}
#endif

int32_t llmserve_qgemm_panel_width(void) { return NB; }

INLINE int block_k(int fmt) { return fmt == FMT_Q8_16 || fmt == FMT_U8_16 ? 16 : 32; }
INLINE int has_min(int fmt) { return fmt == FMT_Q4_1 || fmt == FMT_U8_1 || fmt == FMT_U8_16; }
INLINE int nibbles(int fmt) { return fmt == FMT_Q4_0 || fmt == FMT_Q4_1; }
INLINE int64_t scale_bytes(int fmt) { return (int64_t)NB * 4 * (has_min(fmt) ? 2 : 1); }
INLINE int64_t quant_bytes(int fmt) { return (int64_t)NB * (nibbles(fmt) ? block_k(fmt) / 2 : block_k(fmt)); }
INLINE int64_t block_stride(int fmt) { return scale_bytes(fmt) + quant_bytes(fmt); }

int32_t llmserve_qgemm_block_k(int32_t fmt) { return fmt >= 0 && fmt < FMT_COUNT ? block_k(fmt) : -1; }

int64_t llmserve_qgemm_packed_bytes(int32_t fmt, int64_t n, int64_t k) {
    return ((n + NB - 1) / NB) * (k / block_k(fmt)) * block_stride(fmt);
}

/* q: n x k quants, one byte each (int8 bits for Q8_0 / Q8_16, 0..15 for Q4, 0..255 for U8_1 / U8_16);
 * d, m: n x k/BK fp32 (m only where the format has minimums). */
void llmserve_qgemm_pack(int32_t fmt, const uint8_t *q, const float *d, const float *m, int64_t n, int64_t k,
                         uint8_t *packed) {
    const int bk = block_k(fmt);
    const int64_t panels = (n + NB - 1) / NB, blocks = k / bk;
    const int64_t sb = scale_bytes(fmt), qb = quant_bytes(fmt);
    uint8_t *out = packed;
    for (int64_t p = 0; p < panels; ++p)
        for (int64_t b = 0; b < blocks; ++b) {
            float *ds = (float *)out, *ms = ds + NB;
            uint8_t *qs = out + sb;
            for (int c = 0; c < NB; ++c) {
                const int64_t j = p * NB + c;
                ds[c] = j < n ? d[j * blocks + b] : 0.0f;
                if (has_min(fmt)) ms[c] = j < n ? m[j * blocks + b] : 0.0f;
            }
            for (int t = 0; t < (nibbles(fmt) ? bk / 2 : bk); ++t)
                for (int c = 0; c < NB; ++c) {
                    const int64_t j = p * NB + c;
                    const uint8_t *src = q + j * k + b * bk;
                    uint8_t v = 0;
                    if (j < n) v = nibbles(fmt) ? (uint8_t)((src[2 * t] & 15) | (src[2 * t + 1] << 4)) : src[t];
                    qs[t * NB + c] = v;
                }
            out += sb + qb;
        }
}

/* One block's decoder state: where its quants are, its scales (and minimums) in registers. */
typedef struct {
    const uint8_t *qs;
    vf d[V], m[V];
} qblock;

INLINE qblock qblock_begin(const int fmt, const uint8_t *panel, int64_t g) {
    const int64_t stride = block_stride(fmt);
    const uint8_t *blk = panel + g * stride;
    for (int64_t off = 0; off < stride; off += 64) __builtin_prefetch(blk + PREFETCH_BLOCKS * stride + off, 0, 3);
    const float *ds = (const float *)blk;
    qblock s;
    s.qs = blk + scale_bytes(fmt);
    for (int v = 0; v < V; ++v) s.d[v] = loadv(ds + v * W);
    if (has_min(fmt))
        for (int v = 0; v < V; ++v) s.m[v] = loadv(ds + NB + v * W);
    return s;
}

typedef qblock q8_0_group, q4_0_group, q4_1_group, u8_1_group, q8_16_group, u8_16_group;
INLINE qblock q8_0_begin(const uint8_t *panel, int64_t k, int64_t g) { (void)k; return qblock_begin(FMT_Q8_0, panel, g); }
INLINE qblock q4_0_begin(const uint8_t *panel, int64_t k, int64_t g) { (void)k; return qblock_begin(FMT_Q4_0, panel, g); }
INLINE qblock q4_1_begin(const uint8_t *panel, int64_t k, int64_t g) { (void)k; return qblock_begin(FMT_Q4_1, panel, g); }
INLINE qblock u8_1_begin(const uint8_t *panel, int64_t k, int64_t g) { (void)k; return qblock_begin(FMT_U8_1, panel, g); }
INLINE qblock q8_16_begin(const uint8_t *panel, int64_t k, int64_t g) { (void)k; return qblock_begin(FMT_Q8_16, panel, g); }
INLINE qblock u8_16_begin(const uint8_t *panel, int64_t k, int64_t g) { (void)k; return qblock_begin(FMT_U8_16, panel, g); }

INLINE void q8_0_weights(const qblock *s, int t, vf w[1][V]) {
    for (int v = 0; v < V; ++v) w[0][v] = from_i8(s->qs + t * NB + v * W) * s->d[v];
}
INLINE void q8_16_weights(const qblock *s, int t, vf w[1][V]) { q8_0_weights(s, t, w); }
INLINE void u8_1_weights(const qblock *s, int t, vf w[1][V]) {
    for (int v = 0; v < V; ++v) w[0][v] = rounded(from_u8(s->qs + t * NB + v * W) * s->d[v]) + s->m[v];
}
INLINE void u8_16_weights(const qblock *s, int t, vf w[1][V]) { u8_1_weights(s, t, w); }
INLINE void q4_0_weights(const qblock *s, int t, vf w[2][V]) {
    for (int v = 0; v < V; ++v) {
        vf lo, hi;
        from_nibbles(s->qs + t * NB + v * W, &lo, &hi);
        w[0][v] = (lo - 8.0f) * s->d[v];
        w[1][v] = (hi - 8.0f) * s->d[v];
    }
}
INLINE void q4_1_weights(const qblock *s, int t, vf w[2][V]) {
    for (int v = 0; v < V; ++v) {
        vf lo, hi;
        from_nibbles(s->qs + t * NB + v * W, &lo, &hi);
        w[0][v] = rounded(lo * s->d[v]) + s->m[v];
        w[1][v] = rounded(hi * s->d[v]) + s->m[v];
    }
}

/* A format's kernel, and its work item: for more than one row block the panel is dequantized once
 * into a buffer that the fp32 kernel reads (panel_gemm.h's DEFINE_PANEL_ITEM). */
#define DEFINE_QUANT_FORMAT(NAME, GROUP, UNROLL)                                                         \
    DEFINE_PANEL_KERNEL(NAME, GROUP, UNROLL)                                                             \
    DEFINE_PANEL_ITEM(NAME, GROUP, UNROLL, MR + 1, INT64_MAX)

DEFINE_QUANT_FORMAT(q8_0, 32, 1)
DEFINE_QUANT_FORMAT(q4_0, 32, 2)
DEFINE_QUANT_FORMAT(q4_1, 32, 2)
DEFINE_QUANT_FORMAT(u8_1, 32, 1)
DEFINE_QUANT_FORMAT(q8_16, 16, 1)
DEFINE_QUANT_FORMAT(u8_16, 16, 1)

static const panel_all_rows_fn ITEMS[FMT_COUNT] = {q8_0_item, q4_0_item, q4_1_item, u8_1_item, q8_16_item, u8_16_item};

/* y[m, n] (rows ldy apart) = x[m, k] (rows ldx apart) . W^T + bias (may be NULL); k a whole number
 * of the format's blocks. Returns 0, or -1 for an unknown format or a partial block (nothing written).
 * fmt SEGMENTS: a projection of row ranges in different formats (row_segments.h). */
static int runs(int32_t fmt, int64_t k) { return fmt >= 0 && fmt < FMT_COUNT && k % block_k(fmt) == 0; }

int32_t llmserve_qgemm(int32_t fmt, const float *x, int64_t m, int64_t k, int64_t ldx, const uint8_t *packed,
                       int64_t n, const float *bias, float *y, int64_t ldy, int32_t num_threads) {
    if (fmt == SEGMENTS) /* row ranges in different formats (row_segments.h) */
        return run_segments(llmserve_qgemm, runs, x, m, k, ldx, packed, n, bias, y, ldy, num_threads);
    if (!runs(fmt, k)) return -1;
    const int64_t panel_bytes = (k / block_k(fmt)) * block_stride(fmt);
    panel_gemm(ITEMS[fmt], x, m, k, ldx, packed, panel_bytes, n, bias, y, ldy, num_threads);
    return 0;
}
