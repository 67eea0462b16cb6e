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

#define _DEFAULT_SOURCE /* syscall (amx.h) under -std=c11 */
#include "panel_gemm.h"
#include "amx.h"

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

/* From this many rows a bf16 or fp16 panel is widened once into an fp32 buffer for all its row blocks
 * (DEFINE_PANEL_ITEM) rather than in registers by each: the widening's two vector operations per
 * load competed with the multiply-adds (2 threads, the 0.5B's shapes, 64-256 rows: 1.05-1.2x).
 * Panels over NEXT_PANEL_MAX as fp32 stay widened in registers (the buffer would push the panel
 * out of the L2). */
#ifndef WIDEN_ONCE_ROWS
#define WIDEN_ONCE_ROWS 24
#endif

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
DEFINE_PANEL_ITEM(bf16, 1, 1, WIDEN_ONCE_ROWS, NEXT_PANEL_MAX)

/* y[m, n] (rows ldy apart) = x[m, k] (rows ldx apart) . W^T + bias (may be NULL), W packed bf16. */
void llmserve_gemm_bf16w(const float *x, int64_t m, int64_t k, int64_t ldx, const uint16_t *packed, int64_t n,
                         const float *bias, float *y, int64_t ldy, int32_t num_threads) {
    panel_gemm(bf16_item, x, m, k, ldx, (const uint8_t *)packed, k * NB * 2, n, bias, y, ldy, num_threads);
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
DEFINE_PANEL_ITEM(f16, 1, 1, WIDEN_ONCE_ROWS, NEXT_PANEL_MAX)

/* y[m, n] (rows ldy apart) = x[m, k] (rows ldx apart) . W^T + bias (may be NULL), W packed fp16. */
void llmserve_gemm_f16w(const float *x, int64_t m, int64_t k, int64_t ldx, const uint16_t *packed, int64_t n,
                        const float *bias, float *y, int64_t ldy, int32_t num_threads) {
    panel_gemm(f16_item, x, m, k, ldx, (const uint8_t *)packed, k * NB * 2, n, bias, y, ldy, num_threads);
}

/* bf16 products (linear_dtype="bfloat16", opt-in): a bf16 weight's GEMM with the activations rounded
 * to bf16 too, as vLLM and oneDNN compute a bf16 model, on the AVX512-BF16 instruction VDPBF16PS
 * (32 products an instruction, twice the FMA's 16) where the CPU has it, else its order in fused
 * multiply-adds. What it computes, on every instruction set alike:
 *
 *   xb = each x rounded to bf16 (to nearest, ties to even; a NaN stays a NaN)
 *   acc = 0.0f; for each pair p = 0 .. ceil(K / 2) - 1 in order:
 *       acc += xb[2p + 1] * w[2p + 1]    (the odd product first: exact in fp32, one rounding to nearest)
 *       acc += xb[2p] * w[2p]            (then the even one; a lone last k of an odd K pairs with 0)
 *   y = acc + bias
 *
 * with denormal operands read as zero and denormal results flushed to zero (MXCSR's DAZ and FTZ,
 * set while the call runs on each of its threads: the instruction's own rule), so that the FMA
 * emulation (AVX-512 without AVX512-BF16, AVX2, the generic build's fmaf) gives the instruction's
 * bits. A row's result is the same alone, in any batch, at any thread count and on every instruction
 * set, as the fp32 panels' is (panel_gemm.h's items and finish). Not the fp32 result: the rounding
 * of x changes the bits (docs/serving.md#linear-dtype).
 *
 * Layout: panels of NB columns; per pair p, NB 32-bit lanes w[c][2p] | w[c][2p + 1] << 16 (the
 * instruction's pair, the odd element in the high half); columns past n and k past K are zeros. The
 * activations are rounded into pairs once per call (a thread's buffer, the caller's). */
#include <math.h>
#if defined(__x86_64__)
#include <xmmintrin.h>
#endif
typedef int32_t vi __attribute__((vector_size(4 * W), aligned(4)));
typedef int32_t vi_at __attribute__((vector_size(4 * W), aligned(4), may_alias));

int64_t llmserve_gemm_bf16_pairs_size(int64_t n, int64_t k) { return (n + NB - 1) / NB * NB * ((k + 1) / 2) * 2; }

void llmserve_gemm_pack_bf16_pairs(const uint16_t *w, int64_t n, int64_t k, uint16_t *packed) {
    const int64_t panels = (n + NB - 1) / NB, kp = (k + 1) / 2;
    for (int64_t p = 0; p < panels; ++p)
        for (int64_t j = 0; j < kp; ++j) {
            uint16_t *dst = packed + ((p * kp + j) * NB) * 2;
            for (int c = 0; c < NB; ++c) {
                const int64_t col = p * NB + c;
                dst[2 * c] = col < n ? w[col * k + 2 * j] : 0;
                dst[2 * c + 1] = col < n && 2 * j + 1 < k ? w[col * k + 2 * j + 1] : 0;
            }
        }
}

/* x rounded to bf16: to nearest, ties to even; a NaN stays a (quiet) NaN. */
static inline uint16_t bf16_rne(float f) {
    uint32_t b;
    memcpy(&b, &f, 4);
    if ((b & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((b >> 16) | 0x40);
    return (uint16_t)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}

/* The first `rows` rows of x (k floats, ldx apart) as bf16 pairs, kp a row. */
static void round_pairs(const float *x, int64_t ldx, int64_t k, int64_t kp, int64_t rows, uint32_t *out) {
    for (int64_t r = 0; r < rows; ++r) {
        const float *xr = x + r * ldx;
        uint32_t *o = out + r * kp;
        for (int64_t j = 0; j < k / 2; ++j)
            o[j] = (uint32_t)bf16_rne(xr[2 * j]) | (uint32_t)bf16_rne(xr[2 * j + 1]) << 16;
        if (k & 1) o[kp - 1] = bf16_rne(xr[k - 1]);
    }
}

#ifndef DOT_ROWS
#define DOT_ROWS (4 * MC)
#endif
/* The caller's rounded rows (slot 1: the items it runs itself use slot 0 only) */
static uint32_t *pairs_buffer(size_t words) { return thread_buffer(1, sizeof(uint32_t) * words); }

/* acc + odd products, then + even ones, per lane: fused multiply-adds on the pairs' halves (a bf16
 * pair's product is exact in fp32, so each step has the instruction's one rounding). */
INLINE vf dot_pair_fma(vf acc, vi w, vi x) {
    const vi hi = (vi){0} + (int32_t)0xffff0000;
    vf wo, xo, we, xe;
    const vi a = w & hi, b = x & hi, c = w << 16, d = x << 16;
    memcpy(&wo, &a, sizeof wo);
    memcpy(&xo, &b, sizeof xo);
    memcpy(&we, &c, sizeof we);
    memcpy(&xe, &d, sizeof xe);
#if defined(__AVX512F__)
    acc = (vf)_mm512_fmadd_ps((__m512)wo, (__m512)xo, (__m512)acc);
    return (vf)_mm512_fmadd_ps((__m512)we, (__m512)xe, (__m512)acc);
#elif defined(__AVX2__) && defined(__FMA__)
    acc = (vf)_mm256_fmadd_ps((__m256)wo, (__m256)xo, (__m256)acc);
    return (vf)_mm256_fmadd_ps((__m256)we, (__m256)xe, (__m256)acc);
#else
    for (int l = 0; l < W; ++l) acc[l] = fmaf(wo[l], xo[l], acc[l]);
    for (int l = 0; l < W; ++l) acc[l] = fmaf(we[l], xe[l], acc[l]);
    return acc;
#endif
}

#if defined(__AVX512F__) && defined(__x86_64__)
#include <cpuid.h>
/* The instruction (assembled directly: the avx512 build's -march does not include AVX512-BF16; the
 * caller checks the CPU), accumulating in place. */
INLINE vf dot_pair_native(vf acc, vi w, vi x) {
    __asm__("vdpbf16ps %2, %1, %0" : "+v"(acc) : "v"(w), "v"(x));
    return acc;
}
static int cpu_bf16_dot(void) {
    unsigned a, b, c, d;
    return __get_cpuid_count(7, 1, &a, &b, &c, &d) && ((a >> 5) & 1);
}
#define HAVE_NATIVE_DOT 1
#else
INLINE vf dot_pair_native(vf acc, vi w, vi x) { return dot_pair_fma(acc, w, x); }
static int cpu_bf16_dot(void) { return 0; }
#define HAVE_NATIVE_DOT 0
#endif

static int bf16_dot_use = -1;
/* on: 1 the instruction where the CPU has it, 0 its FMA order (tests), -1 leave. Returns whether the
 * instruction runs now. */
int32_t llmserve_gemm_bf16_dot_native(int32_t on) {
    if (bf16_dot_use < 0 || on >= 0) bf16_dot_use = on != 0 && cpu_bf16_dot();
    return bf16_dot_use;
}

/* Rows [0, m) (m <= MR, a constant at each call site) of the pairs xp (kp a row, ldx apart) against
 * one panel; NATIVE a constant. */
INLINE void dot_rows(const uint32_t *restrict xp, int64_t ldx, const uint32_t *restrict panel, int64_t kp,
                     const int m, const float *restrict bias, float *restrict out, int64_t ldo, int cols,
                     const int NATIVE) {
    vf acc[MR][V];
    for (int i = 0; i < m; ++i)
        for (int v = 0; v < V; ++v) acc[i][v] = (vf){0};
    for (int64_t j = 0; j < kp; ++j) {
        const uint32_t *wp = panel + j * NB;
        for (int c = 0; c < NB; c += 16) __builtin_prefetch(wp + PREFETCH_K * NB + c, 0, 2);
        vi w[V];
        for (int v = 0; v < V; ++v) w[v] = *(const vi_at *)(wp + v * W);
        for (int i = 0; i < m; ++i) {
            const vi xb = (vi){0} + (int32_t)xp[i * ldx + j];
            for (int v = 0; v < V; ++v)
                acc[i][v] = NATIVE ? dot_pair_native(acc[i][v], w[v], xb) : dot_pair_fma(acc[i][v], w[v], xb);
        }
    }
    panel_finish(acc, m, bias, out, ldo, cols);
}

#define DOT_ALL_ROWS(NAME, NATIVE)                                                                        \
    static void NAME(const float *x, int64_t m, int64_t kp, int64_t ldx, const uint8_t *panel, const float *bias, \
                     float *y, int64_t ldy, int cols, const uint8_t *next, int64_t next_bytes) {         \
        (void)next;                                                                                      \
        (void)next_bytes;                                                                                \
        const uint32_t *xp = (const uint32_t *)(const void *)x, *pn = (const uint32_t *)(const void *)panel; \
        float pad[NB];                                                                                   \
        bias = panel_bias(bias, cols, pad);                                                              \
        ROW_BLOCKS(m, DOT_ROWS_CALL, NATIVE);                                                            \
    }
#define DOT_ROWS_CALL(NATIVE, i, c) dot_rows(xp + (i) * ldx, ldx, pn, kp, c, bias, y + (i) * ldy, ldy, cols, NATIVE)
DOT_ALL_ROWS(dot_all_rows_fma, 0)
#if HAVE_NATIVE_DOT
DOT_ALL_ROWS(dot_all_rows_native, 1)
#else
#define dot_all_rows_native dot_all_rows_fma
#endif

/* panel_items with denormals flushed on the running thread (restored after). */
static void dot_items(void *ctx, int64_t begin, int64_t end) {
#if defined(__x86_64__)
    const unsigned csr = _mm_getcsr();
    _mm_setcsr(csr | 0x8040u);
#endif
    panel_items(ctx, begin, end);
#if defined(__x86_64__)
    _mm_setcsr(csr);
#endif
}

/* y[m, n] (rows ldy apart) = x[m, k] (rows ldx apart) . W^T + bias (may be NULL) in bf16 products, W
 * packed by llmserve_gemm_pack_bf16_pairs. A coded entry, as quant_gemm.c's (the native layer loop
 * reports a refusal): code must be 0; returns 0, or nonzero with nothing written (-1: the
 * activations' buffer could not be had, -2: another code). */
int32_t llmserve_gemm_bf16_dot(int32_t code, const float *x, int64_t m, int64_t k, int64_t ldx,
                               const uint16_t *packed, int64_t n, const float *bias, float *y, int64_t ldy,
                               int32_t num_threads) {
    const int64_t kp = (k + 1) / 2;
    if (code != 0) return -2;
    if (m <= 0) return 0;
    /* DOT_ROWS rows at a time (each its own parallel loop), so that the rounded rows' buffer stays
     * bounded (1,024 rows of the 1.5B's down projection: 18 MB) whatever the call's rows */
    const int64_t block = m < DOT_ROWS ? m : DOT_ROWS;
    uint32_t *xp = pairs_buffer((size_t)(block * kp));
    if (!xp) return -1;
    const panel_all_rows_fn all_rows = llmserve_gemm_bf16_dot_native(-1) ? dot_all_rows_native : dot_all_rows_fma;
    for (int64_t r0 = 0; r0 < m; r0 += block) {
        const int64_t rows = m - r0 < block ? m - r0 : block;
        round_pairs(x + r0 * ldx, ldx, k, kp, rows, xp);
        /* the pairs pass as the rows (kp 32-bit words a row, the panel's k steps: pairs) */
        panel_gemm_items(dot_items, all_rows, (const float *)(const void *)xp, rows, kp, kp, (const uint8_t *)packed,
                         kp * NB * 4, n, bias, y + r0 * ldy, ldy, num_threads);
    }
    return 0;
}

/* bf16 weights on AMX-BF16 tiles (TDPBF16PS), exactly split activations: where the OS grants the
 * tiles (amx.h's probe), a bf16 weight is packed for them instead of the panels above (one copy
 * either way), and every row count M, 1 .. any, runs on the tiles (a row's 3 parts are 3 tile rows,
 * 16 a tile, the last tile with fewer; a tile row's sums never depend on its other rows), so a
 * row's result is the same bits alone and in any batch, chunk or thread count.
 *
 * The activations are fp32; each x is split by truncation into three bf16 parts,
 *   x1 = x with the low 16 bits cleared, r = x - x1 (exact), x2 = r truncated so, x3 = (r - x2)
 *   truncated so,
 * and x = x1 + x2 + x3 exactly (8 + 8 + 8 significand bits) wherever no part is below the smallest
 * normal 2^-126: the tile reads a subnormal bf16 as zero (DAZ), so bits of x below 2^-126 are lost
 * (then |x| < 2^-102 or the part is zero). A non-finite x keeps x1 = x and parts 2, 3 zero. Each
 * product w * xi of two bf16 is exact in fp32 (but where it is below 2^-126).
 *
 * The tile's order, measured on this machine's TDPBF16PS (768000 outputs of random, mixed-exponent,
 * cancelling and tiny inputs, every one bit-equal), is not the SDM's older pseudo-code (two adds per
 * pair into the accumulator) but its newer one: per instruction (32 k steps = 16 pairs), the even
 * and the odd elements of the pairs are two fp32 chains of fused multiply-adds from zero,
 *   E = fma(a[2j], b[2j], E), O = fma(a[2j+1], b[2j+1], O) for j = 0..15,
 * each step rounded to nearest even and flushed to zero if subnormal (FTZ; inputs DAZ), then
 *   C = C + (E + O)        (two fp32 adds, each RNE + FTZ).
 * The three parts of a row are three rows of the activation tiles (part-rows 3i .. 3i + 2, 16 a
 * tile), so one instruction a 32-k step serves them all, at one row as at many (a TDPBF16PS costs
 * the same at 1 row as at 16: three instructions, one a part into one accumulator, ran a decode's
 * row at 0.56-0.79x the FMA panels). So each part p has its own sum, a row of the C tile: Cp from
 * zero over the k tiles in order, and the output is y = (C1 + (C2 + C3)) + bias in plain fp32
 * adds. kernels/cpu/native_gemm.py's amx_bf16_reference states it in numpy; the tests hold the
 * kernel bit-equal to it.
 *
 * Layout: the weight (n x k) as panels of 32 columns (two tiles of 16), each k tile t of a panel
 * 2 KiB: [tile h 0..1][pair p 0..15][column c 0..15][2], element (column 32q + 16h + c,
 * k 32t + 2p + e); columns past n and k past K are zeros, and a subnormal weight is stored as zero
 * (what DAZ reads). So a panel is one sequential stream. */
#ifdef AMX_PATH
#define AKT 32   /* k steps per tile instruction */
#define ANP 32   /* columns per panel: two C tiles */

static int bf16_amx_use = 1; /* tests turn it off */

/* on: 1 use the tiles for bf16 weights where granted, 0 never, -1 leave. Returns whether they run
 * now (for weights packed from now on: a packed weight keeps its layout). */
int32_t llmserve_gemm_bf16_amx(int32_t on) {
    if (on == 0) bf16_amx_use = 0;
    if (on == 1) bf16_amx_use = 1;
    return bf16_amx_use && amx_bf16_listed() && amx_active();
}

/* Columns a panel of the packed form holds (its panels are one after another, each the same size). */
int32_t llmserve_gemm_bf16_amx_panel_width(void) { return ANP; }

/* Elements (uint16) of the packed form of an n x k weight. */
int64_t llmserve_gemm_bf16_amx_size(int64_t n, int64_t k) {
    return (n + ANP - 1) / ANP * ((k + AKT - 1) / AKT) * (ANP * AKT);
}

void llmserve_gemm_pack_bf16_amx(const uint16_t *w, int64_t n, int64_t k, uint16_t *packed) {
    const int64_t kt = (k + AKT - 1) / AKT, panels = (n + ANP - 1) / ANP;
    for (int64_t q = 0; q < panels; ++q)
        for (int64_t t = 0; t < kt; ++t) {
            uint16_t *dst = packed + (q * kt + t) * (ANP * AKT);
            for (int h = 0; h < 2; ++h)
                for (int p = 0; p < AKT / 2; ++p)
                    for (int c = 0; c < 16; ++c)
                        for (int e = 0; e < 2; ++e) {
                            const int64_t col = q * ANP + h * 16 + c, kk = t * AKT + 2 * p + e;
                            uint16_t v = col < n && kk < k ? w[col * k + kk] : 0;
                            if ((v & 0x7f80) == 0) v = 0; /* zero or subnormal: DAZ's zero */
                            dst[((h * 16 + p) * 16 + c) * 2 + e] = v;
                        }
        }
}

/* Rows [r0, r1) of x split into the parts' tiles (bf16 bits): part p of row i is part-row
 * j = 3i + p, and the part-rows fill the tiles in order, 16 a tile (a row's parts may straddle two
 * tiles): k tile t of tile g is one 16 x 32 tile of 1 KiB at parts + (g * kt + t) * 512 whose row
 * r holds part-row 16g + r; zeros past k. */
#define TR 16 /* part-rows a tile */
INLINE uint16_t *bf16_part_row(uint16_t *parts, int64_t kt, int64_t j) {
    return parts + (j / TR) * kt * 512 + (j % TR) * AKT;
}
static void bf16_split_rows(const float *x, int64_t ldx, int64_t k, int64_t kp, int64_t r0, int64_t r1,
                            uint16_t *parts) {
    const __m512i hi = _mm512_set1_epi32((int)0xffff0000u), expo = _mm512_set1_epi32(0x7f800000);
    const int64_t kt = kp / AKT;
    for (int64_t i = r0; i < r1; ++i) {
        const float *xr = x + i * ldx;
        uint16_t *row1 = bf16_part_row(parts, kt, 3 * i), *row2 = bf16_part_row(parts, kt, 3 * i + 1),
                 *row3 = bf16_part_row(parts, kt, 3 * i + 2);
        for (int64_t c = 0; c < kp; c += 16) {
            const int64_t at = (c / AKT) * 512 + c % AKT;
            uint16_t *p1 = row1 + at, *p2 = row2 + at, *p3 = row3 + at;
            const __mmask16 in = c + 16 <= k ? (__mmask16)0xffff : c < k ? (__mmask16)((1u << (k - c)) - 1) : 0;
            const __m512 v = _mm512_maskz_loadu_ps(in, xr + c);
            const __m512 v1 = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(v), hi));
            /* a non-finite x: parts 2 and 3 zero */
            const __mmask16 fin = _mm512_cmpneq_epi32_mask(_mm512_and_si512(_mm512_castps_si512(v), expo), expo);
            const __m512 r = _mm512_maskz_sub_ps(fin, v, v1);
            const __m512 v2 = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(r), hi));
            const __m512 v3 = _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(_mm512_sub_ps(r, v2)), hi));
            _mm256_storeu_si256((__m256i *)p1, _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v1), 16)));
            _mm256_storeu_si256((__m256i *)p2, _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v2), 16)));
            _mm256_storeu_si256((__m256i *)p3, _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v3), 16)));
        }
    }
}

/* The caller's buffer for the parts (the pool's threads read it while the caller waits). */
static uint16_t *bf16_parts_buffer(size_t elems) {
    static __thread uint16_t *buf;
    static __thread size_t cap;
    if (elems > cap) {
        void *grown = NULL;
        if (posix_memalign(&grown, 64, elems * 2)) return NULL;
        free(buf);
        buf = grown;
        cap = elems;
    }
    return buf;
}

/* Tiles: C 0, 1 and 3, 4 (part-rows of sums x 16 columns: the panel's two halves, for two tiles of
 * part-rows), A 2 and 7 (part-rows x 32: the two tiles' parts), B 5, 6 (16 pairs x 16 columns, the
 * halves' weights). */
static void bf16_amx_configure(int rows_a, int rows_b) {
    amx_config c;
    memset(&c, 0, sizeof c);
    c.palette_id = 1;
    c.rows[0] = c.rows[1] = c.rows[2] = (uint8_t)rows_a;
    c.rows[3] = c.rows[4] = c.rows[7] = (uint8_t)(rows_b ? rows_b : 1);
    c.rows[5] = c.rows[6] = 16;
    for (int t = 0; t < 8; ++t) c.colsb[t] = 64;
    TILE_CONFIGURE(c);
}

typedef struct {
    const float *x, *bias;
    const uint16_t *packed;
    uint16_t *parts;
    float *y;
    int64_t m, k, ldx, kt, kp, n, ldy, groups, panels, block;
} bf16_amx_job;

static void bf16_split_items(void *ctx, int64_t begin, int64_t end) {
    const bf16_amx_job *j = ctx;
    bf16_split_rows(j->x, j->ldx, j->k, j->kp, begin, end, j->parts);
}

/* out (part-rows 3i, 3i + 1, 3i + 2: row i's parts' sums C1, C2, C3, panel-wide) into y's rows r0..:
 * y = (C1 + (C2 + C3)) + bias, IEEE fp32 adds (MXCSR's default) (cols of the panel's ANP columns). */
INLINE void bf16_amx_finish(const bf16_amx_job *j, float out[][ANP], int64_t q, int64_t r0, int rows) {
    const int64_t c0 = q * ANP;
    const int cols = (int)(j->n - c0 < ANP ? j->n - c0 : ANP);
    const __mmask16 m0 = cols >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << cols) - 1);
    const __mmask16 m1 = cols >= 32 ? (__mmask16)0xffff : cols > 16 ? (__mmask16)((1u << (cols - 16)) - 1) : 0;
    const __m512 b0 = j->bias ? _mm512_maskz_loadu_ps(m0, j->bias + c0) : _mm512_setzero_ps();
    const __m512 b1 = j->bias ? _mm512_maskz_loadu_ps(m1, j->bias + c0 + 16) : _mm512_setzero_ps();
    for (int i = 0; i < rows; ++i) {
        float *yr = j->y + (r0 + i) * j->ldy + c0;
        __m512 v0 = _mm512_add_ps(_mm512_load_ps(&out[3 * i][0]),
                                  _mm512_add_ps(_mm512_load_ps(&out[3 * i + 1][0]), _mm512_load_ps(&out[3 * i + 2][0])));
        __m512 v1 = _mm512_add_ps(_mm512_load_ps(&out[3 * i][16]),
                                  _mm512_add_ps(_mm512_load_ps(&out[3 * i + 1][16]), _mm512_load_ps(&out[3 * i + 2][16])));
        if (j->bias) v0 = _mm512_add_ps(v0, b0), v1 = _mm512_add_ps(v1, b1);
        _mm512_mask_storeu_ps(yr, m0, v0);
        _mm512_mask_storeu_ps(yr + 16, m1, v1);
    }
}

/* Items: (block of up to j->block tiles of part-rows (16 a tile), panel q), block-major. An item runs
 * its panel's k in chunks of KC tiles (256 k: 16 KiB of weights, in L1), each chunk over the block's
 * tiles two at a time (four C tiles in flight), their C tiles stored between chunks (an fp32 store
 * and load: the sums' bits go on unchanged; a block of one or two tiles keeps them in the tiles over
 * all of K), so each weight byte loaded serves up to 16 * BLOCK / 3 rows and the block's parts stay
 * in the L2. A block is a multiple of 3 tiles (whole rows: a row's parts may straddle two tiles, never
 * two blocks), as many as keep its parts (1 KiB a tile and k tile) within ABLOCK_KIB of the L2, at
 * most BLOCK: 30 tiles (160 rows) at K = 896 (the panel's weights are read once a block; half as many
 * re-read them from memory twice as often), 9 (48 rows) at down's K = 4864, where 16 groups of 5
 * rows (2.4 MiB of parts) overflowed the 2 MiB L2 (RT, 2 threads, `.so`s alternated, two runs: down
 * 1.11-1.19x at 256 rows, 1.18-1.40x at 2048; gate_up 1.08-1.13x at 256). Whole tiles of part-rows
 * (was: groups of 5 rows, 15 of a tile's 16 rows) are 6 tiles at 32 rows instead of 7, 12 at 64
 * instead of 13.
 *
 * The tiles are configured once a call: one or two tiles with their own rows, else every tile as
 * 16 rows (a last tile's rows past 3m are whatever the parts buffer holds; a C row depends on its
 * own A row only, and finish reads the real rows): an ldtilecfg for the short last group twice a
 * chunk was 9% of a 32-row decode's samples. Prefetch: where a chunk has two or more pairs, its
 * pairs' k steps fetch the next chunk's weights (the next panel's after the last) into the L2, a few
 * lines a step; the weights' tile loads waited on memory (a weight made L1-resident ran a 32-row
 * step 1.74x faster, 2048 rows 1.54x). A whole 0.5B step of GEMMs (988 MB of bf16 weights, RT):
 * 32 rows 1.32x, 2048 rows 1.14x, 1 row (one pair: no prefetch, as measured before: the weights'
 * tile loads at one row ran 1.10x faster without an L2 prefetch 4 tiles ahead) unchanged. Fetching
 * into L1 instead: 1.06x / 1.07x. And the last chunk's k steps take ownership (prefetchw) of the
 * lines of y the item's finish writes, a few rows a step: the finish's stores missed (80 rows 38 KiB
 * apart at gate_up, y far beyond the L2) and held the tiles up; with y's stores sent to one
 * scratch line (a probe, wrong results) gate_up at 2048 rows ran 1.28x faster on one core, with the
 * prefetch 1.11x (docs/quantization.md, "Where the time goes"). */
#define BLOCK 30       /* tiles of part-rows a block, at most (a multiple of 3) */
#define ABLOCK_KIB 1792 /* a block's parts, at most (KiB of the L2) */
#define KC 8
#define PREFETCHW(p) __asm__ volatile("prefetchw %0" ::"m"(*(const char *)(p)))
static void bf16_amx_items(void *ctx, int64_t begin, int64_t end) {
    const bf16_amx_job *j = ctx;
    float out[BLOCK * TR][ANP] __attribute__((aligned(64)));
    int configured = 0;
    for (int64_t item = begin; item < end; ++item) {
        const int64_t blk = item / j->panels, q = item % j->panels, g0 = blk * j->block;
        const int gb = (int)(j->groups - g0 < j->block ? j->groups - g0 : j->block);
        /* a block is a multiple of 3 tiles: its part-rows are whole rows of x */
        const uint16_t *b = j->packed + q * j->kt * (ANP * AKT);
        const int64_t r_first = TR * g0 / 3, r_end = TR * (g0 + gb) / 3;
        const int64_t y_rows = (r_end < j->m ? r_end : j->m) - r_first;
        const int y_split = (((uintptr_t)j->y | (uintptr_t)(j->ldy * 4)) & 63) != 0; /* a row's 128 bytes over 3 lines */
        if (!configured) { /* once: one or two tiles as they are, else every tile as a whole one */
            const int64_t pr = 3 * j->m;
            bf16_amx_configure(pr < TR ? (int)pr : TR, j->groups == 2 ? (int)(pr - TR) : TR);
            configured = 1;
        }
        for (int64_t kc = 0; kc < j->kt; kc += KC) {
            const int64_t kend = kc + KC < j->kt ? kc + KC : j->kt;
            const int64_t nkend = kend + KC < j->kt ? kend + KC : j->kt; /* the next chunk's end */
            const int64_t chunk_lines = (kend < j->kt ? nkend - kend : (KC < j->kt ? KC : j->kt)) * (ANP * AKT * 2 / 64);
            const int64_t steps = (gb + 1) / 2 * (kend - kc);
            const int64_t pf_lines = gb > 2 ? (chunk_lines + steps - 1) / steps : 0;
            const int64_t yp_rows = kend == j->kt ? (y_rows + steps - 1) / steps : 0;
            for (int gi = 0; gi < gb; gi += 2) {
                const int rows_b = gi + 1 < gb;
                const uint16_t *a = j->parts + (g0 + gi) * j->kt * 512, *a2 = a + j->kt * 512;
                float(*oa)[ANP] = &out[gi * TR], (*ob)[ANP] = &out[(gi + 1) * TR];
                if (kc == 0) {
                    TILE_ZERO(0);
                    TILE_ZERO(1);
                    if (rows_b) {
                        TILE_ZERO(3);
                        TILE_ZERO(4);
                    }
                } else if (gb > 2) { /* one pair: its C tiles stay in the tiles over all of K */
                    TILE_LOAD(0, &oa[0][0], ANP * 4);
                    TILE_LOAD(1, &oa[0][16], ANP * 4);
                    if (rows_b) {
                        TILE_LOAD(3, &ob[0][0], ANP * 4);
                        TILE_LOAD(4, &ob[0][16], ANP * 4);
                    }
                }
                /* the next chunk's weights (the next panel's after the last chunk) into the L2, a few
                 * lines each k step spread over all the chunk's pairs, where there are two or more */
                const char *next = (const char *)(b + kend * (ANP * AKT));
                const int64_t it0 = (gi / 2) * (kend - kc);
                for (int64_t t = kc; t < kend; ++t) {
                    const uint16_t *bt = b + t * (ANP * AKT);
                    if (pf_lines) {
                        const int64_t l0 = (it0 + t - kc) * pf_lines;
                        for (int64_t l = l0; l < l0 + pf_lines && l < chunk_lines; ++l)
                            __builtin_prefetch(next + 64 * l, 0, 2);
                    }
                    if (yp_rows) { /* the last chunk: the rows of y this item's finish writes, for ownership */
                        const int64_t s0 = (it0 + t - kc) * yp_rows;
                        for (int64_t s = s0; s < s0 + yp_rows && s < y_rows; ++s) {
                            const char *yr = (const char *)(j->y + (r_first + s) * j->ldy + q * ANP);
                            PREFETCHW(yr);
                            PREFETCHW(yr + 64);
                            if (y_split) PREFETCHW(yr + 124);
                        }
                    }
                    /* each tile loaded just before its first product, the first weight tile's
                     * products before the second weight tile's load (was: both weight tiles, then
                     * the parts: a 0.5B step of GEMMs 1.07x at 8 rows, 1.01-1.02x at 1-256) */
                    TILE_LOAD(2, a + t * 512, 64);
                    TILE_LOAD(5, bt, 64);
                    TILE_DPBF16(0, 2, 5);
                    if (rows_b) {
                        TILE_LOAD(7, a2 + t * 512, 64);
                        TILE_DPBF16(3, 7, 5);
                    }
                    TILE_LOAD(6, bt + 16 * AKT, 64);
                    TILE_DPBF16(1, 2, 6);
                    if (rows_b) TILE_DPBF16(4, 7, 6);
                }
                if (gb > 2 || kend == j->kt) {
                    TILE_STORE(0, &oa[0][0], ANP * 4);
                    TILE_STORE(1, &oa[0][16], ANP * 4);
                    if (rows_b) {
                        TILE_STORE(3, &ob[0][0], ANP * 4);
                        TILE_STORE(4, &ob[0][16], ANP * 4);
                    }
                }
            }
        }
        bf16_amx_finish(j, out, q, r_first, (int)y_rows);
    }
    if (configured) TILE_RELEASE();
}

/* y[m, n] (rows ldy apart) = x[m, k] (rows ldx apart) . W^T + bias (may be NULL), W packed by
 * llmserve_gemm_pack_bf16_amx; the tiles must have been granted (llmserve_gemm_bf16_amx(-1)). */
void llmserve_gemm_bf16w_amx(const float *x, int64_t m, int64_t k, int64_t ldx, const uint16_t *packed, int64_t n,
                             const float *bias, float *y, int64_t ldy, int32_t num_threads) {
    if (m <= 0) return;
    const int64_t kt = (k + AKT - 1) / AKT, kp = kt * AKT, panels = (n + ANP - 1) / ANP,
                  groups = (3 * m + TR - 1) / TR; /* tiles of part-rows */
    uint16_t *parts = bf16_parts_buffer((size_t)(groups * kt * 512));
    if (!parts) abort();
    int64_t block = ABLOCK_KIB / kt;
    block = block > BLOCK ? BLOCK : block;
    block = block < 3 ? 3 : block - block % 3; /* whole rows of x a block */
    bf16_amx_job j = {x, bias, packed, parts, y, m, k, ldx, kt, kp, n, ldy, groups, panels, block};
    parallel_for(num_threads, m * kp > 65536, m, 16, bf16_split_items, &j);
    const int64_t items = panels * ((groups + block - 1) / block);
    if (groups <= block)
        parallel_for_guided(num_threads, m * n * k > 262144, items, 1, bf16_amx_items, &j);
    else
        parallel_for(num_threads, m * n * k > 262144, items, 1, bf16_amx_items, &j);
}
#endif
