/* y = x . W^T (+ bias) in fp32, on a weight packed once at load: the model's linears on the CPU,
 * with the weight kept as fp32, or as bf16 or fp16 (half the bytes; widened to fp32 in registers).
 *
 * A decode step's linears have M = 1..64 rows against a weight of N x K that comes from memory
 * (a step streams every layer, more than the L3 holds); there oneDNN's prepacked kernels reached
 * 60-80% of this kernel's rate. This one streams each weight through once per step in panels of NB
 * columns and holds MR rows x NB columns of sums in registers, so that each weight vector loaded
 * feeds MR multiply-adds and each row value broadcast feeds V; on prefills (M in the hundreds or
 * thousands) it measured level with oneDNN. docs/architecture.md, "The CPU path"; docs/design/native-gemm.md.
 * The kernel itself is panel_gemm.h's (shared with quant_gemm.c).
 *
 * The packed weight is panel-major: panel p holds columns [p * NB, (p + 1) * NB) as K rows of NB
 * values (columns past N are zero), so a panel is one sequential stream.
 *
 * A bf16 weight is widened exactly (its bits are an fp32's top half), and so is an fp16 one (every
 * fp16 value, subnormals included, is an fp32 value: F16C's vcvtph2ps, or the bit arithmetic of the
 * generic build), so either result is bit-equal to the fp32 GEMM on the widened values, with the
 * same row independence.
 *
 * Built per instruction set like paged_attention.c (native_build.py); threads: parallel.h's pool. */

#include "panel_gemm.h"

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

/* y[m, n] (rows ldy apart) = x[m, k] (rows ldx apart) . W^T + bias (may be NULL). */
void llmserve_gemm_f32(const float *x, int64_t m, int64_t k, int64_t ldx, const float *packed, int64_t n,
                       const float *bias, float *y, int64_t ldy, int32_t num_threads) {
    panel_gemm(f32_all_rows, x, m, k, ldx, (const uint8_t *)packed, k * NB * 4, n, bias, y, ldy, num_threads);
}

/* bf16 or fp16 weights: w holds the 16-bit patterns (n x k); packed: ceil(n / NB) panels of k x NB
 * of them (the packing moves bits, so one function serves both). */
void llmserve_gemm_pack_bf16(const uint16_t *w, int64_t n, int64_t k, uint16_t *packed) {
    const int64_t panels = (n + NB - 1) / NB;
    for (int64_t p = 0; p < panels; ++p)
        for (int64_t kk = 0; kk < k; ++kk) {
            uint16_t *dst = packed + (p * k + kk) * NB;
            for (int c = 0; c < NB; ++c) {
                const int64_t j = p * NB + c;
                dst[c] = j < n ? w[j * k + kk] : 0;
            }
        }
}

/* W bf16 values as fp32: the 16 bits shifted into the top of each lane. */
#if defined(__AVX512F__)
INLINE vf widen_bf16(const uint16_t *p) {
    const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p));
    return (vf)_mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
}
#elif defined(__AVX2__)
INLINE vf widen_bf16(const uint16_t *p) {
    const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return (vf)_mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
}
#else
typedef uint16_t vu16 __attribute__((vector_size(2 * W), aligned(2), may_alias));
typedef uint32_t vu32 __attribute__((vector_size(4 * W)));
INLINE vf widen_bf16(const uint16_t *p) {
    const vu32 bits = __builtin_convertvector(*(const vu16 *)p, vu32) << 16;
    vf out;
    memcpy(&out, &bits, sizeof out);
    return out;
}
#endif

/* The same distance ahead in bytes as the fp32 panel's prefetch (twice the k steps), into L2
 * (prefetcht1) rather than L1: over a model's bf16 weights at M = 1, 2 threads, 24.1 -> 26.8 GB/s
 * (1 thread: 12.8 -> 14.1), where the fp32 panel gains nothing from it. */
typedef const uint16_t *bf16_group;
INLINE bf16_group bf16_begin(const uint8_t *panel, int64_t k, int64_t g) {
    (void)k;
    const uint16_t *wp = (const uint16_t *)panel + g * NB;
    for (int c = 0; c < NB; c += 32) __builtin_prefetch(wp + 2 * PREFETCH_K * NB + c, 0, 2);
    return wp;
}
INLINE void bf16_weights(const bf16_group *s, int t, vf w[1][V]) {
    (void)t;
    for (int v = 0; v < V; ++v) w[0][v] = widen_bf16(*s + v * W);
}
DEFINE_PANEL_KERNEL(bf16, 1, 1)

/* y[m, n] (rows ldy apart) = x[m, k] (rows ldx apart) . W^T + bias (may be NULL), W packed bf16. */
void llmserve_gemm_bf16w(const float *x, int64_t m, int64_t k, int64_t ldx, const uint16_t *packed, int64_t n,
                         const float *bias, float *y, int64_t ldy, int32_t num_threads) {
    panel_gemm(bf16_all_rows, x, m, k, ldx, (const uint8_t *)packed, k * NB * 2, n, bias, y, ldy, num_threads);
}

/* W fp16 values as fp32, exactly. */
#if defined(__AVX512F__)
INLINE vf widen_f16(const uint16_t *p) {
    return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}
#elif defined(__AVX2__) && defined(__F16C__)
INLINE vf widen_f16(const uint16_t *p) { return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
#else
/* The IEEE conversion by integer arithmetic: sign; a normal's exponent rebiased (15 -> 127) with its
 * mantissa shifted up 13; a subnormal (exponent 0) is mantissa * 2^-24, exact in fp32; inf/NaN keep
 * an all-ones exponent. */
INLINE float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    uint32_t bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else {
        float f = (float)man * 5.9604644775390625e-08f; /* 2^-24 */
        memcpy(&bits, &f, sizeof bits);
        bits |= sign;
    }
    float out;
    memcpy(&out, &bits, sizeof out);
    return out;
}
INLINE vf widen_f16(const uint16_t *p) {
    vf out;
    for (int i = 0; i < W; ++i) out[i] = half_to_float(p[i]);
    return out;
}
#endif

INLINE void f16_weights(const bf16_group *s, int t, vf w[1][V]) {
    (void)t;
    for (int v = 0; v < V; ++v) w[0][v] = widen_f16(*s + v * W);
}
#define f16_group bf16_group
#define f16_begin bf16_begin
DEFINE_PANEL_KERNEL(f16, 1, 1)

/* y[m, n] (rows ldy apart) = x[m, k] (rows ldx apart) . W^T + bias (may be NULL), W packed fp16. */
void llmserve_gemm_f16w(const float *x, int64_t m, int64_t k, int64_t ldx, const uint16_t *packed, int64_t n,
                        const float *bias, float *y, int64_t ldy, int32_t num_threads) {
    panel_gemm(f16_all_rows, x, m, k, ldx, (const uint8_t *)packed, k * NB * 2, n, bias, y, ldy, num_threads);
}
