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

/* bf16 weights on AMX-BF16 tiles (TDPBF16PS), exactly split activations: where the OS grants the
 * tiles (amx.h's probe), a bf16 weight is packed for them instead of the panels above (one copy
 * either way), and every row count M, 1 .. any, runs on the tiles (a group of fewer than 16 rows
 * is a tile configured with fewer rows; a row's sums never depend on the tile's other rows), so a
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
 * An output is C from zero over the k tiles t in order and, in each, the parts x1, x2, x3 in order,
 * then y = C + bias. kernels/cpu/native_gemm.py's amx_bf16_reference states it in numpy; the tests
 * hold the kernel bit-equal to it.
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

/* Rows [r0, r1) of x split into the parts' tiles (bf16 bits): for group g of 16 rows and k tile t,
 * the parts x1, x2, x3 as three 16 x 32 tiles of 1 KiB in a row, parts + ((g * kt + t) * 3 + p) * 512,
 * row r of the group at r * 32; zeros past k. So a tile load reads 1 KiB in a run (rows kp apart
 * had the tile loads of a 4864-wide activation on 16 pages each). */
static void bf16_split_rows(const float *x, int64_t ldx, int64_t k, int64_t kp, int64_t m, int64_t r0, int64_t r1,
                            uint16_t *parts) {
    const __m512i hi = _mm512_set1_epi32((int)0xffff0000u), expo = _mm512_set1_epi32(0x7f800000);
    for (int64_t i = r0; i < r1; ++i) {
        const float *xr = x + i * ldx;
        (void)m;
        uint16_t *row = parts + (i / 16) * (kp / AKT) * 3 * 512 + (i % 16) * AKT;
        for (int64_t c = 0; c < kp; c += 16) {
            uint16_t *p1 = row + (c / AKT) * 3 * 512 + c % AKT, *p2 = p1 + 512, *p3 = p2 + 512;
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

/* Tiles: C 0, 1 (rows x 16 columns of sums, the panel's two halves), A 2, 3, 4 (rows x 32 of the
 * parts x1, x2, x3), B 5, 6 (16 pairs x 16 columns of the halves' weights). */
static void bf16_amx_configure(int rows) {
    amx_config c;
    memset(&c, 0, sizeof c);
    c.palette_id = 1;
    for (int t = 0; t < 5; ++t) c.rows[t] = (uint8_t)rows, c.colsb[t] = 64;
    for (int t = 5; t < 7; ++t) c.rows[t] = 16, c.colsb[t] = 64;
    TILE_CONFIGURE(c);
}

typedef struct {
    const float *x, *bias;
    const uint16_t *packed;
    uint16_t *parts;
    float *y;
    int64_t m, k, ldx, kt, kp, n, ldy, groups, panels, emu_from;
} bf16_amx_job;

static void bf16_split_items(void *ctx, int64_t begin, int64_t end) {
    const bf16_amx_job *j = ctx;
    bf16_split_rows(j->x, j->ldx, j->k, j->kp, j->m, begin, end, j->parts);
}

/* The same math without the tiles, for a batch's last row past its full groups of 16 (a decode's
 * one row): one row against one panel, the tile's order step for step in AVX-512 with MXCSR's FTZ
 * set (the parts and the packed weights hold no subnormal, so DAZ has nothing to do): per k tile,
 * the three parts' even and odd chains (12 vectors: 2 halves x 3 parts x even/odd) from zero over
 * the 16 pairs, then C += E + O part by part. A TDPBF16PS costs the same at 1 row as at 16 (one row:
 * 17 GFLOP/s a core, weights in L2); this, three times the FMA panels' multiply-adds, ran 23; two
 * or more rows run faster on the tiles (EMU_ROWS). */
#ifndef EMU_ROWS
#define EMU_ROWS 1
#endif
INLINE void bf16_emu_row(const uint16_t *a, const uint16_t *b, int64_t kt, float out[ANP]) {
    const __m512i odd = _mm512_set1_epi32((int)0xffff0000u);
    __m512 c0 = _mm512_setzero_ps(), c1 = _mm512_setzero_ps();
    for (int64_t t = 0; t < kt; ++t) {
        const uint16_t *bt = b + t * (ANP * AKT);
        for (int l = 0; l < ANP * AKT * 2; l += 64) __builtin_prefetch((const char *)bt + 4 * ANP * AKT * 2 + l, 0, 2);
        __m512 e[3][2], o[3][2];
        for (int p = 0; p < 3; ++p)
            for (int h = 0; h < 2; ++h) e[p][h] = o[p][h] = _mm512_setzero_ps();
        for (int j = 0; j < AKT / 2; ++j) {
            __m512 we[2], wo[2];
            for (int h = 0; h < 2; ++h) {
                const __m512i v = _mm512_loadu_si512((const void *)(bt + (h * 16 + j) * 32));
                we[h] = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
                wo[h] = _mm512_castsi512_ps(_mm512_and_si512(v, odd));
            }
            for (int p = 0; p < 3; ++p) {
                const uint16_t *xp = a + (t * 3 + p) * 512 + 2 * j;
                uint32_t pair;
                memcpy(&pair, xp, 4);
                const __m512 xe = _mm512_set1_ps(((union { uint32_t u; float f; }){pair << 16}).f);
                const __m512 xo = _mm512_set1_ps(((union { uint32_t u; float f; }){pair & 0xffff0000u}).f);
                for (int h = 0; h < 2; ++h) {
                    e[p][h] = _mm512_fmadd_ps(xe, we[h], e[p][h]);
                    o[p][h] = _mm512_fmadd_ps(xo, wo[h], o[p][h]);
                }
            }
        }
        for (int p = 0; p < 3; ++p) {
            c0 = _mm512_add_ps(c0, _mm512_add_ps(e[p][0], o[p][0]));
            c1 = _mm512_add_ps(c1, _mm512_add_ps(e[p][1], o[p][1]));
        }
    }
    _mm512_store_ps(out, c0);
    _mm512_store_ps(out + 16, c1);
}

/* out (rows x ANP, the panel's sums) + bias into y's rows r0.. (cols of the panel's ANP columns). */
INLINE void bf16_amx_finish(const bf16_amx_job *j, float out[][ANP], int64_t q, int64_t r0, int rows) {
    const int64_t c0 = q * ANP;
    const int cols = (int)(j->n - c0 < ANP ? j->n - c0 : ANP);
    const __mmask16 m0 = cols >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << cols) - 1);
    const __mmask16 m1 = cols >= 32 ? (__mmask16)0xffff : cols > 16 ? (__mmask16)((1u << (cols - 16)) - 1) : 0;
    const __m512 b0 = j->bias ? _mm512_maskz_loadu_ps(m0, j->bias + c0) : _mm512_setzero_ps();
    const __m512 b1 = j->bias ? _mm512_maskz_loadu_ps(m1, j->bias + c0 + 16) : _mm512_setzero_ps();
    for (int i = 0; i < rows; ++i) {
        float *yr = j->y + (r0 + i) * j->ldy + c0;
        __m512 v0 = _mm512_load_ps(&out[i][0]), v1 = _mm512_load_ps(&out[i][16]);
        if (j->bias) v0 = _mm512_add_ps(v0, b0), v1 = _mm512_add_ps(v1, b1);
        _mm512_mask_storeu_ps(yr, m0, v0);
        _mm512_mask_storeu_ps(yr + 16, m1, v1);
    }
}

/* Items over the emulated rows: one panel each, its rows one after another. */
static void bf16_emu_items(void *ctx, int64_t begin, int64_t end) {
    const bf16_amx_job *j = ctx;
    const unsigned csr = _mm_getcsr();
    _mm_setcsr(csr | 0x8000); /* FTZ */
    float out[1][ANP] __attribute__((aligned(64)));
    for (int64_t q = begin; q < end; ++q)
        for (int64_t r = j->emu_from; r < j->m; ++r) {
            bf16_emu_row(j->parts + (r / 16) * j->kt * 3 * 512 + (r % 16) * AKT, j->packed + q * j->kt * (ANP * AKT),
                         j->kt, out[0]);
            bf16_amx_finish(j, out, q, r, 1);
        }
    _mm_setcsr(csr);
}

/* Items: (block of up to BLOCK groups of 16 rows, panel q), block-major. An item runs its panel's
 * k in chunks of KC tiles (512 k: 32 KiB of weights, in L1), each chunk over all the block's groups,
 * their C tiles stored between chunks (an fp32 store and load: the sums' bits go on unchanged), so
 * each weight byte loaded serves up to 128 rows and the block's parts stay in the L2. */
#define BLOCK 8
#define KC 16
static void bf16_amx_items(void *ctx, int64_t begin, int64_t end) {
    const bf16_amx_job *j = ctx;
    float out[BLOCK * 16][ANP] __attribute__((aligned(64)));
    int configured = 0;
    for (int64_t item = begin; item < end; ++item) {
        const int64_t blk = item / j->panels, q = item % j->panels, g0 = blk * BLOCK;
        const int gb = (int)(j->groups - g0 < BLOCK ? j->groups - g0 : BLOCK);
        const uint16_t *b = j->packed + q * j->kt * (ANP * AKT);
        for (int64_t kc = 0; kc < j->kt; kc += KC) {
            const int64_t kend = kc + KC < j->kt ? kc + KC : j->kt;
            for (int gi = 0; gi < gb; ++gi) {
                const int64_t r0 = 16 * (g0 + gi);
                const int rows = (int)(j->m - r0 < 16 ? j->m - r0 : 16);
                if (rows != configured) bf16_amx_configure(rows), configured = rows;
                const uint16_t *a = j->parts + (g0 + gi) * j->kt * 3 * 512;
                if (kc == 0) {
                    TILE_ZERO(0);
                    TILE_ZERO(1);
                } else {
                    TILE_LOAD(0, &out[gi * 16][0], ANP * 4);
                    TILE_LOAD(1, &out[gi * 16][16], ANP * 4);
                }
                for (int64_t t = kc; t < kend; ++t) {
                    const uint16_t *bt = b + t * (ANP * AKT), *at = a + t * 3 * 512;
                    if (gi == 0)
                        for (int l = 0; l < ANP * AKT * 2; l += 64)
                            __builtin_prefetch((const char *)bt + 4 * ANP * AKT * 2 + l, 0, 2);
                    TILE_LOAD(5, bt, 64);
                    TILE_LOAD(6, bt + 16 * AKT, 64);
                    TILE_LOAD(2, at, 64);
                    TILE_LOAD(3, at + 512, 64);
                    TILE_LOAD(4, at + 1024, 64);
                    TILE_DPBF16(0, 2, 5);
                    TILE_DPBF16(1, 2, 6);
                    TILE_DPBF16(0, 3, 5);
                    TILE_DPBF16(1, 3, 6);
                    TILE_DPBF16(0, 4, 5);
                    TILE_DPBF16(1, 4, 6);
                }
                TILE_STORE(0, &out[gi * 16][0], ANP * 4);
                TILE_STORE(1, &out[gi * 16][16], ANP * 4);
            }
        }
        for (int gi = 0; gi < gb; ++gi) {
            const int64_t r0 = 16 * (g0 + gi);
            bf16_amx_finish(j, &out[gi * 16], q, r0, (int)(j->m - r0 < 16 ? j->m - r0 : 16));
        }
    }
    if (configured) TILE_RELEASE();
}

/* y[m, n] (rows ldy apart) = x[m, k] (rows ldx apart) . W^T + bias (may be NULL), W packed by
 * llmserve_gemm_pack_bf16_amx; the tiles must have been granted (llmserve_gemm_bf16_amx(-1)). */
void llmserve_gemm_bf16w_amx(const float *x, int64_t m, int64_t k, int64_t ldx, const uint16_t *packed, int64_t n,
                             const float *bias, float *y, int64_t ldy, int32_t num_threads) {
    if (m <= 0) return;
    const int64_t kt = (k + AKT - 1) / AKT, kp = kt * AKT, panels = (n + ANP - 1) / ANP;
    int64_t groups = (m + 15) / 16;
    uint16_t *parts = bf16_parts_buffer((size_t)(3 * 16 * ((m + 15) / 16) * kp));
    if (!parts) abort();
    /* rows past the full groups of 16: on the tiles (a group of fewer rows) or, EMU_ROWS or fewer,
     * the tiles' math in AVX-512 (bf16_emu_row); the same bits either way */
    const int64_t tail = m % 16, emu_from = tail && tail <= EMU_ROWS ? m - tail : m;
    if (emu_from < m) groups = m / 16;
    bf16_amx_job j = {x, bias, packed, parts, y, m, k, ldx, kt, kp, n, ldy, groups, panels, emu_from};
    parallel_for(num_threads, m * kp > 65536, m, 16, bf16_split_items, &j);
    if (groups)
        parallel_for(num_threads, m * n * k > 262144, panels * ((groups + BLOCK - 1) / BLOCK), 1, bf16_amx_items, &j);
    if (emu_from < m)
        parallel_for_guided(num_threads, (m - emu_from) * n * k > 262144, panels, 1, bf16_emu_items, &j);
}
#endif
