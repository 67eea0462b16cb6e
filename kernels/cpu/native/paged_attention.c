/* Paged attention on the CPU, reading K/V from the cache blocks in place (fp32; a second build,
 * KV_BF16, reads a bf16 cache: see kv_t below).
 *
 * The arithmetic is the reference's (kernels/reference/paged_attention.py): each query vector
 * attends to context positions [0, limit) of its sequence, softmax(q . k * scale) . v. What
 * differs is where the data comes from: K and V rows are read straight out of the blocks named by
 * the block table, once per work item, where the torch path first copies them out of the cache
 * and then reads the copy.
 *
 * The code is written at the target's own vector width W: 16 floats (one AVX-512 register), 8
 * (AVX2) or 4 (SSE2, NEON); each is its own build (native_build.py), chosen at run time. Work
 * items are (sequence, KV head, tile of query vectors). q . k is one chain of fused multiply-adds
 * over d for every query (the order above, the same on every ISA). A decode's item holds the query
 * heads that share the KV head: it transposes each W K rows (positions into lanes) and broadcasts
 * its queries' values, each broadcast feeding two groups of W positions (one block's, or two
 * blocks' where each holds only W) (AVX2: a broadcast is its own load), up to 8 heads' chains at a
 * time. A chunk's tile holds 2W query vectors (its rows
 * times those heads, in order) in the lanes of two vectors: q . k at 8 (AVX-512) positions is D
 * multiply-adds of the transposed queries by the K rows' broadcast values (rows copied out of the
 * cache once per item), with no horizontal sums, and the same for the output over V.
 * Long contexts go partition by partition (PART positions from position 0, an online softmax):
 * within a partition the scores, their maximum, the numerators and the weighted V rows are exact
 * as above, and each query merges its partitions' results in order through one function that
 * decodes and chunks share (merge_partition). A decode's partitions are separate work items
 * (split-K: a decode at 16k has 64 to share among threads), each for every KV head at once (the
 * cache interleaves the heads in a row: each pass uses a row whole, read from memory once; a
 * decode at depth is bound by memory), merged in a second pass (a
 * sequence with a few rows at depth, where its tiles would leave lanes idle, runs the same way, all
 * its rows in each partition's item, each row merged as its decode: split_k_rows); a
 * chunk's work item is four tiles that take each partition in turn, so that its K/V rows come from
 * memory once for the four and from L2 after, and its scores stay in L1.
 * Every vector's result is computed in the same order whatever else is in its group, tile, step
 * or thread, and a chunk's lane sums in a decode's order (q . k's chain, the softmax sums, the
 * partitions and their merge), so a row's output depends only on its query and its context: the
 * same bits alone or in a batch, in any split of its chunk, at any thread count, and as the decode
 * of its position (what a recompute after preemption meets: tokens decoded one by one come back as
 * rows of one chunk).
 *
 * Measured on the 2-core AVX2 EPYC (one thread, CPU time, Qwen2.5-0.5B's 14 query / 2 KV heads of
 * 64, ratios to the whole-context kernel before it): a 512-row chunk at 16k of context 2.6x
 * faster (partitions 1.5x, the groups of four tiles 1.4x more), at 4k 1.3x; a decode 1.2-1.4x.
 *
 * A layer with soft-capped scores (Gemma 2: `softcap` > 0) caps each scaled score, tanh(s / cap) * cap,
 * before the mask and the softmax, through one scalar function for decodes and chunks alike.
 *
 * Its work items (a decode's partitions, a chunk's groups of tiles) are shared among threads by
 * parallel.h's pool; a score soft-cap or other per-layer option belongs in Args (one place both
 * paths read).
 *
 * On AMX-BF16 tiles (the AVX-512 build, where amx.h's probe grants the tiles, head size a multiple
 * of 32, and only with LLMSERVE_AMX_ATTENTION=1: off by default, docs/performance.md has why):
 * q . k and the pass over V run on TDPBF16PS, each fp32 operand split by truncation into three bf16
 * parts (x = x1 + x2 + x3 exactly where no part is below 2^-126, which the tile reads as zero); of
 * the nine part products the six with i + j <= 2 are summed (the rest are each under 2^-24 of the
 * whole). Per 32 k steps (dims for q . k, positions over V) each TDPBF16PS sums the even and the odd
 * k of its 16 pairs as two fp32 chains from zero, then C = C + (E + O) (small_gemm.c's measured
 * order); a group of 16 query vectors has two sums, C0 = t1 s1 and C1 = t1 s2, t1 s3, t2 s1, t2 s2,
 * t3 s1 in that order (AMX_GROUP_PRODUCTS: s the parts that stay in tiles, K's or V's; t the
 * queries' or the weights'); a score is (C0 + C1) * scale, a weighted V sum C0 + C1. A partition's
 * K and V rows are split once per work item (amx_split_partition), the softmax runs with the queries
 * in lanes (amx_lane_softmax), the partitions merge through merge_partition. Decodes (a decode's
 * query heads of one KV head are one group) and chunks (groups of 16 of the item's vectors, two per
 * load of the parts) call the same out-of-line functions (amx_group_partition_64 / _128), and a
 * query's values never depend on its group's other queries (tile rows and columns are independent;
 * zero weights add exact zeros), so the bitwise properties above hold on this path too, within it:
 * a machine runs one path or the other for every call. kernels/cpu/native_attention.py states the
 * two products' order in numpy (amx_scores_reference, amx_weighted_v_reference); the tests hold the
 * kernel bit-equal to it.
 *
 * bf16 products (BF16_DOT, with KV_BF16: the `paged_attention:kv_bf16_dot` builds, an engine's
 * attention_dtype "bfloat16"): each query and each softmax numerator is rounded to bf16 (nearest
 * even; the numerators' sums add the rounded values), and q . k and the pass over V sum their
 * products in pairs in VDPBF16PS's order: from 0, each pair's odd product (dims 2i + 1, or position
 * 2i + 1 of the pass's positions counted from an even one), then its even one, each added with one
 * rounding (a product of two bf16 is exact in fp32). A chunk's tiles run the instruction itself
 * where the CPU has AVX512-BF16 (the `_native` build: 32 products an instruction against an FMA's
 * 16), elsewhere two fused multiply-adds a pair (dp_v): the same bits, as every call runs with
 * denormals flushed as the instruction flushes them (FLUSH_DENORMALS). A decode forms the same sums
 * with multiply-adds in that order, so a chunk's row is still its decode's bits, and the partitions,
 * the softmax and the merges are as above. No tile path. tests/test_attention_bf16_products.py holds
 * the kernel to a numpy statement of the order. */

#define _DEFAULT_SOURCE /* syscall (amx.h) under -std=c11 */
#include <float.h>
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "amx.h"
#include "parallel.h"

#if defined(BF16_DOT) && !defined(KV_BF16)
#error "BF16_DOT reads a bf16 cache: build it with KV_BF16"
#endif
/* With BF16_DOT every call runs with denormal operands read as 0 and denormal results flushed to 0
 * (MXCSR's DAZ and FTZ, on x86), as VDPBF16PS always does: its emulation (two fused multiply-adds)
 * and every other operation of the call then give the same bits on every x86 build. */
#if defined(BF16_DOT) && defined(__x86_64__)
#include <xmmintrin.h>
#define FLUSH_DENORMALS_BEGIN const unsigned csr_saved_ = _mm_getcsr(); _mm_setcsr(csr_saved_ | 0x8040u);
#define FLUSH_DENORMALS_END _mm_setcsr(csr_saved_);
#else
#define FLUSH_DENORMALS_BEGIN
#define FLUSH_DENORMALS_END
#endif

#if defined(__AVX512F__)
#define W 16
#define REGS 32
#elif defined(__AVX2__) && defined(__FMA__)
#define W 8
#define REGS 16
#else
#define W 4
#define REGS 16
#endif

/* Whether the common shapes get their own instances (head size 64 and 128 a constant, a chunk's
 * partitions inside every lane's range without masks): not on the generic build (SSE2), which runs
 * only where forced (native_attention.py: slower than the torch path there), so that its compile
 * stays short. The instances differ in speed only: the same operations in the same order. */
#define SPECIALIZED (W > 4)

/* A chunk's tile: T vectors' lanes of query vectors (TILE in all), and PV_ELEMS output elements
 * of each per pass over V, so that the accumulators fill half the registers. Two vectors per tile
 * halve the loads per multiply-add against one (a K or V value broadcast feeds both): 1.3-1.5x on
 * AVX-512 chunks; four measured no faster. */
#ifndef T
#define T 2
#endif
#define TILE (T * W)
#ifndef PV_ELEMS
#define PV_ELEMS (REGS / 2 / T)
#endif
/* T, PV_ELEMS, QP and CSUB (below) may be set with -D for a blocking sweep (docs/performance.md,
 * "broadcasts that cost nothing"); a pass over V takes PV_ELEMS elements of every head size at a
 * time, so it must divide them (native_attention.py takes head sizes that are multiples of 16). */
_Static_assert(16 % PV_ELEMS == 0, "PV_ELEMS must divide every head size (multiples of 16)");

#define INLINE static inline __attribute__((always_inline))

#if W == 16 || W == 8
#include <immintrin.h>
#endif

/* GCC/Clang vector types at the target's width, so that values stay in whole registers.
 * Aligned to a float only: GCC does not realign every stack frame (OpenMP's outlined functions
 * among them) for wide types, and aligned moves there fault. */
typedef float vf __attribute__((vector_size(4 * W), aligned(4)));
/* The same type for reading and writing floats in place (any float's address, any alias). */
typedef float vf_at __attribute__((vector_size(4 * W), aligned(4), may_alias));
typedef int32_t vi __attribute__((vector_size(4 * W), aligned(4)));
typedef float v8 __attribute__((vector_size(32), aligned(4)));
typedef float v4 __attribute__((vector_size(16), aligned(4)));
typedef float v4_at __attribute__((vector_size(16), aligned(4), may_alias));

INLINE vf loadv(const float *p) { return *(const vf_at *)p; }

/* The cache's element: fp32, or with KV_BF16 (the `paged_attention:kv_bf16` build, native_build.py)
 * bf16, the top half of an fp32 (a cache written by rounding to nearest even). Every read of the
 * cache widens W values to fp32 by a 16-bit shift (exact) and the arithmetic after it is the fp32
 * build's, operation for operation: a bf16 cache's result is bit-equal to the fp32 build's on a
 * cache holding the same values widened, on every path (decodes, chunks, a few rows, the tiles). */
#ifdef KV_BF16
typedef uint16_t kv_t;
#else
typedef float kv_t;
#endif

INLINE vf load_kv(const kv_t *p) {
#ifndef KV_BF16
    return loadv(p);
#elif W == 16
    return (vf)_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
#elif W == 8
    return (vf)_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
#else
    vi x;
    for (int l = 0; l < W; ++l) x[l] = (int32_t)((uint32_t)p[l] << 16);
    return (vf)x;
#endif
}

INLINE void storev(float *p, vf x) { *(vf_at *)p = x; }

/* x in every lane. Not `(vf){0} + x`: that adds +0.0 first (it turns -0.0 into +0.0, so the
 * compiler must keep the add), a scalar add on a multiply-add port and a broadcast on the other
 * for every broadcast value, where a multiply-add can broadcast from memory itself: the chunk's
 * passes ran at half the multiply-add rate. The same values but for the sign of a zero, which no
 * product, sum or exponent here tells apart from +0. */
INLINE vf splat_v(float x) {
#if W == 16
    return (vf)_mm512_set1_ps(x);
#elif W == 8
    return (vf)_mm256_set1_ps(x);
#else
    vf r;
    for (int l = 0; l < W; ++l) r[l] = x;
    return r;
#endif
}

INLINE vf select_v(vi keep, vf yes, vf no) { return (vf)(((vi)yes & keep) | ((vi)no & ~keep)); }

/* x > m ? x : m, lane by lane (the second operand where either is NaN or both are zeros): one
 * MAXPS where there is one, the same values as the select. */
INLINE vf max_v(vf x, vf m) {
#if W == 16
    return (vf)_mm512_max_ps((__m512)x, (__m512)m);
#elif W == 8
    return (vf)_mm256_max_ps((__m256)x, (__m256)m);
#else
    return select_v(x > m, x, m);
#endif
}

/* fmaf(a, b, c) lane by lane: one rounding (the decode's scalar merge runs fmaf). */
INLINE vf fma_v(vf a, vf b, vf c) {
#if W == 16
    return (vf)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif W == 8
    return (vf)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
    for (int l = 0; l < W; ++l) a[l] = fmaf(a[l], b[l], c[l]);
    return a;
#endif
}

/* acc + x * y as the chains of q . k and of the passes over V write it: one fused multiply-add
 * where the ISA has them, written as one so that the compiler cannot choose which of two products
 * to fuse (`x0 * y0 + x1 * y1` once a loop's first step is peeled: builds that differed only
 * elsewhere fused the other product, and a chunk's row stopped being its decode's bits); the
 * generic build (SSE2: no fused multiply-add, nothing contracted) rounds the product first. */
INLINE vf madd_v(vf x, vf y, vf acc) {
#if W > 4
    return fma_v(x, y, acc);
#else
    return acc + x * y;
#endif
}

#ifdef BF16_DOT
/* acc + hi(a) hi(b), then + lo(a) lo(b): VDPBF16PS's order (each 32-bit lane two bf16, the odd one
 * in the high half); emulated by two fused multiply-adds where the CPU lacks it (the products of
 * two bf16 are exact in fp32, so each step is the instruction's one rounding) */
INLINE vf dp_v(vf acc, vi a, vi b) {
#if defined(__AVX512BF16__) && W == 16
    /* the instruction itself: with the intrinsic GCC 12 rotated the tile's accumulators through
     * other registers each iteration and spilled one in q . k's loop (a chunk 1.5x -> 1.6x
     * the fp32 products') */
    __asm__("vdpbf16ps %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
    return acc;
#else
    const vi m = (vi){0} + (int32_t)0xffff0000;
    acc = fma_v((vf)(a & m), (vf)(b & m), acc);
    return fma_v((vf)(a << 16), (vf)(b << 16), acc);
#endif
}
INLINE vi splat_i(uint32_t x) {
#if W == 16
    return (vi)_mm512_set1_epi32((int)x);
#else
    vi r;
    for (int l = 0; l < W; ++l) r[l] = (int32_t)x;
    return r;
#endif
}
/* round to nearest even to bf16, kept as the fp32 bit pattern with its low half 0 */
INLINE vi round_bf16_bits(vf x) {
    const vi b = (vi)x;
    return (b + 0x7fff + ((b >> 16) & 1)) & (int32_t)0xffff0000;
}
INLINE uint16_t bf16_of(float x) { return (uint16_t)((uint32_t)round_bf16_bits(splat_v(x))[0] >> 16); }
#endif

/* e^x for x <= 0, W lanes: the softmax numerators and the partition merges' factors of decodes and
 * chunks alike (a lane's value depends only on its x: the scalar exp_np below is the same bits).
 * x is clamped at -87 (e^-87 for anything below); n = x log2(e) rounded to nearest (adding and
 * subtracting 1.5 * 2^23, which leaves n in the low bits of the sum), r = x - n ln2 in two steps
 * (Cody-Waite: 0.693359375 then -2.12194440e-4, |r| <= ln2 / 2), e^r a degree-6 polynomial in
 * Horner form (a minimax fit of relative error with 1 as its constant term, coefficients rounded to
 * float), times 2^n built from n's bits: fewer operations than fast_exp.h's formula (no floor, no
 * conversion to integer, Horner's form down to the constant term).
 * Max relative error over every float in [-87, 0], against exp in double: 1.48 x 2^-24 (8.8e-8)
 * with fused multiply-adds (AVX-512, AVX2: the same bits), 1.89 x 2^-24 without (generic);
 * fast_exp.h's exp_nonpositive 1.43 x 2^-24, libm's expf 1.00 x 2^-24 (the old and the new differ
 * by at most 2.00 x 2^-24). Written lane by lane: GCC vectorizes the loop, and compiled the
 * vector-typed form of the same formula worse on AVX2 (the AVX2 chunk 0.90x of main with it);
 * AVX-512's VRNDSCALEPS and VSCALEFPS in its place measured no faster (0.98-1.02x). */
#define EXP_C6 0x1.6ae732p-10f
#define EXP_C5 0x1.126782p-7f
#define EXP_C4 0x1.555822p-5f
#define EXP_C3 0x1.55541ap-3f
#define EXP_C2 0x1.fffffcp-2f
/* x * y + z as the exponential's steps write it: fused where the ISA has fused multiply-adds, as
 * one call (left to the compiler's contraction, one instance once kept a product apart, shared
 * with another, and a chunk's row stopped being its decode's bits); rounded twice on the generic
 * build (SSE2 has none). */
#if W > 4
#define MADDF(x, y, z) __builtin_fmaf((x), (y), (z))
#else
#define MADDF(x, y, z) ((x) * (y) + (z))
#endif
INLINE vf exp_np_v(vf x) {
    float e[W];
    for (int j = 0; j < W; ++j) {
        const float v = x[j] < -87.0f ? -87.0f : x[j];
        const float u = MADDF(v, 1.44269504088896341f, 0x1.8p23f); /* n + 1.5 * 2^23: n in the low bits */
        const float n = u - 0x1.8p23f;
        float r = MADDF(-n, 0.693359375f, v); /* the product exact: at most 16 bits */
        r = MADDF(-n, -2.12194440e-4f, r);
        float p = MADDF(EXP_C6, r, EXP_C5);
        p = MADDF(p, r, EXP_C4);
        p = MADDF(p, r, EXP_C3);
        p = MADDF(p, r, EXP_C2);
        p = MADDF(p, r, 1.0f);
        p = MADDF(p, r, 1.0f);
        union {
            float f;
            int32_t i;
        } b = {.f = u};
        b.i = (int32_t)((uint32_t)b.i << 23) + (127 << 23);
        e[j] = p * b.f;
    }
    return loadv(e);
}

/* exp_np_v for one value (the same bits as its lane). */
INLINE float exp_np(float x) { return exp_np_v(splat_v(x))[0]; }

/* q . k, for decodes and chunks alike: one chain of fused multiply-adds over d in order,
 * q[0] * k[0] first (a product), then fma(q[d], k[d], acc) for d = 1 .. D - 1, then times the
 * scale. The same on every ISA. A chunk's tile computes it vertically (queries in lanes, K values
 * broadcast: a plain register-blocked product, tile_scores_block); a decode transposes each W K
 * rows so that positions are in lanes (transpose_rows) and broadcasts its queries' values
 * (decode_heads_scores). */

/* Transposes the W x W matrix of rows r[0..W) in place: stage b swaps bit b of the row and the
 * column index (2 two-source shuffles per pair of rows). */
#define TR_PAIR(r, b, LO, HI)                                        \
    for (int i_ = 0; i_ < W; ++i_)                                   \
        if (!(i_ & (b))) {                                           \
            const vf x_ = r[i_], y_ = r[i_ + (b)];                   \
            r[i_] = __builtin_shufflevector(x_, y_, LO);             \
            r[i_ + (b)] = __builtin_shufflevector(x_, y_, HI);       \
        }
#if W == 16
#define LO8 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23
#define HI8 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31
#define LO4 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27
#define HI4 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31
#define LO2 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29
#define HI2 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31
#define LO1 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30
#define HI1 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31
INLINE void transpose_w(vf *r) {
    TR_PAIR(r, 8, LO8, HI8)
    TR_PAIR(r, 4, LO4, HI4)
    TR_PAIR(r, 2, LO2, HI2)
    TR_PAIR(r, 1, LO1, HI1)
}
#elif W == 8
#define LO4 0, 1, 2, 3, 8, 9, 10, 11
#define HI4 4, 5, 6, 7, 12, 13, 14, 15
#define LO2 0, 1, 8, 9, 4, 5, 12, 13
#define HI2 2, 3, 10, 11, 6, 7, 14, 15
#define LO1 0, 8, 2, 10, 4, 12, 6, 14
#define HI1 1, 9, 3, 11, 5, 13, 7, 15
INLINE void transpose_w(vf *r) {
    TR_PAIR(r, 4, LO4, HI4)
    TR_PAIR(r, 2, LO2, HI2)
    TR_PAIR(r, 1, LO1, HI1)
}
#else
#define LO2 0, 1, 4, 5
#define HI2 2, 3, 6, 7
#define LO1 0, 4, 2, 6
#define HI1 1, 5, 3, 7
INLINE void transpose_w(vf *r) {
    TR_PAIR(r, 2, LO2, HI2)
    TR_PAIR(r, 1, LO1, HI1)
}
#endif

/* kt[d] = the d-th values of m <= W K rows from k (ps apart), in lanes 0 .. m - 1 (lanes from m
 * on repeat row m - 1: their scores are never stored). Where `ahead` is given, the same part of its
 * first `am` rows (ps apart) is asked for from memory as these are read, a line for a line: a later
 * work item's K rows (attend_rows_part). */
INLINE void transpose_rows_asking(vf *restrict kt, const kv_t *restrict k, int64_t ps, int m, const int D,
                                  const kv_t *ahead, int am) {
    for (int c = 0; c < D / W; ++c) {
        vf r[W];
        if (c * W * (int)sizeof(kv_t) % 64 == 0) /* a line each (a bf16 row's part is half a line) */
            for (int i = 0; i < am; ++i) __builtin_prefetch(ahead + i * ps + c * W, 0, 2);
#if W == 8 && !defined(KV_BF16)
        /* the first stage (halves of rows i and i + 4 swapped) done by the loads: each vector
         * built from two 4-float halves (an insert from memory, no shuffle-port work) */
        for (int i = 0; i < W; ++i) {
            const int lo = i % 4, hi = i % 4 + 4, half = i / 4 * 4;
            const v4 x = *(const v4_at *)(k + (lo < m ? lo : m - 1) * ps + c * W + half);
            const v4 y = *(const v4_at *)(k + (hi < m ? hi : m - 1) * ps + c * W + half);
            r[i] = __builtin_shufflevector(x, y, 0, 1, 2, 3, 4, 5, 6, 7);
        }
        TR_PAIR(r, 2, LO2, HI2)
        TR_PAIR(r, 1, LO1, HI1)
#else
        for (int i = 0; i < W; ++i) r[i] = load_kv(k + (i < m ? i : m - 1) * ps + c * W);
        transpose_w(r);
#endif
        for (int i = 0; i < W; ++i) kt[c * W + i] = r[i];
    }
}
INLINE void transpose_rows(vf *restrict kt, const kv_t *restrict k, int64_t ps, int m, const int D) {
    transpose_rows_asking(kt, k, ps, m, D, NULL, 0);
}

/* The scores of G query vectors (q: their first, qs apart) at the m positions transposed in kt
 * (NG groups of W positions: kt[g * D + d], the last group's m of them; the groups before it whole),
 * scaled, into rows[j * rs ...]: one chain of multiply-adds over d per lane (a position). Each
 * query value broadcast feeds the NG groups (two halve the loads per multiply-add where a
 * broadcast is its own load: AVX2). */
INLINE void decode_heads_scores(const float *restrict q, int64_t qs, const vf *restrict kt, float *restrict rows,
                                int64_t rs, int m, float scale, const int G, const int NG, const int D) {
    vf acc[G][NG];
#ifdef BF16_DOT /* VDPBF16PS's order (dp_v): from 0, each pair's odd product, then its even one */
    for (int j = 0; j < G; ++j)
        for (int g = 0; g < NG; ++g) acc[j][g] = (vf){0};
    for (int d = 0; d < D; d += 2)
        for (int j = 0; j < G; ++j) {
            const float b1 = q[j * qs + d + 1], b0 = q[j * qs + d];
            for (int g = 0; g < NG; ++g) acc[j][g] = madd_v(splat_v(b1), kt[g * D + d + 1], acc[j][g]);
            for (int g = 0; g < NG; ++g) acc[j][g] = madd_v(splat_v(b0), kt[g * D + d], acc[j][g]);
        }
#else
    for (int j = 0; j < G; ++j)
        for (int g = 0; g < NG; ++g) acc[j][g] = q[j * qs] * kt[g * D];
    for (int d = 1; d < D; ++d)
        for (int j = 0; j < G; ++j) {
            const float b = q[j * qs + d];
            for (int g = 0; g < NG; ++g) acc[j][g] = madd_v(splat_v(b), kt[g * D + d], acc[j][g]);
        }
#endif
    for (int j = 0; j < G; ++j)
        for (int g = 0; g < NG; ++g) {
            const vf x = acc[j][g] * scale;
            if (g < NG - 1 || m == W)
                storev(rows + j * rs + g * W, x);
            else
                for (int l = 0; l < m; ++l) rows[j * rs + g * W + l] = x[l];
        }
}

/* softmax numerators of s[0, n) in place (their maximum into *max_out), exactly 0 before position lo (outside a sliding window;
 * their scores are -inf); returns their sum (W partial sums, fixed tree). */
INLINE float softmax_numerators(float *restrict s, int n, int lo, float *max_out) {
    /* the maximum, W lanes at a time (a maximum is exact: any order gives the same) */
    vf mv = (vf){0} - INFINITY;
    int p = 0;
    for (; p + W <= n; p += W) {
        const vf x = loadv(s + p);
        mv = select_v(x > mv, x, mv);
    }
    float m = -INFINITY;
    for (int l = 0; l < W; ++l) m = mv[l] > m ? mv[l] : m;
    for (; p < n; ++p) m = s[p] > m ? s[p] : m;
    *max_out = m;
    vf acc = {0};
    vi lane;
    for (int l = 0; l < W; ++l) lane[l] = l;
    p = 0;
    for (; p + W <= n; p += W) {
        vf e = select_v(lane + p < lo, (vf){0}, exp_np_v(loadv(s + p) - m));
#ifdef BF16_DOT
        e = (vf)round_bf16_bits(e);
#endif
        storev(s + p, e);
        acc += e;
    }
    for (int l = 0; p + l < n; ++l) {
        float e = p + l < lo ? 0.0f : exp_np(s[p + l] - m);
#ifdef BF16_DOT
        e = ((vf)round_bf16_bits(splat_v(e)))[0];
#endif
        s[p + l] = e;
        acc[l] += e;
    }
    for (int w = W / 2; w > 0; w /= 2)
        for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
    return acc[0];
}

typedef struct {
    const float *q;
    int64_t q_stride_token, q_stride_head;
    const kv_t *k_cache, *v_cache; /* [num_blocks, block_size, num_kv_heads, head_dim] */
    const int32_t *block_tables;
    int64_t block_table_stride;
    const int32_t *seq_lens, *query_start_loc;
    int32_t num_heads, num_kv_heads, block_size;
    float scale;
    int32_t window; /* > 0: a query sees only the last `window` positions up to its own */
    float softcap;  /* > 0: every scaled score s becomes tanh(s / softcap) * softcap (Gemma 2) */
    float *out; /* [num_tokens, num_heads, head_dim], contiguous */
    int32_t ahead; /* work items on from its own whose rows a split-K item asks for (ahead_partitions) */
} Args;

/* A scaled score soft-capped (a layer with `softcap` > 0). One out-of-line scalar function for the
 * decode's scores and every lane of a chunk's, so that both are the same bits. */
__attribute__((noinline)) static float soft_cap(float s, float cap) { return tanhf(s / cap) * cap; }

/* A tile's scaled scores, soft-capped when CAP (a constant: the uncapped tile has no test). */
INLINE vf capped_v(const Args *a, vf x, const int CAP) {
    if (CAP)
        for (int l = 0; l < W; ++l) x[l] = soft_cap(x[l], a->softcap);
    return x;
}

/* Where sequence b's tokens and blocks are. */
typedef struct {
    int start, q_len, ctx; /* its first query token, its queries this step, its context */
    const int32_t *table;  /* its block table */
} Seq;

INLINE Seq seq_of(const Args *a, int b) {
    const int start = a->query_start_loc[b];
    return (Seq){start, a->query_start_loc[b + 1] - start, a->seq_lens[b],
                 a->block_tables + (int64_t)b * a->block_table_stride};
}

/* KV head h's row of position 0 of the sequence's blk-th block, in cache. */
INLINE const kv_t *block_at(const Args *a, const kv_t *cache, const Seq *s, int blk, int h, const int D) {
    return cache + ((int64_t)s->table[blk] * a->block_size * a->num_kv_heads + h) * D;
}

/* Query vector `head` of the sequence's query token `row`. */
INLINE const float *query_at(const Args *a, const Seq *s, int row, int head) {
    return a->q + (int64_t)(s->start + row) * a->q_stride_token + (int64_t)head * a->q_stride_head;
}

/* The largest divisor of n that is at most `most` (a constant where n and most are). */
INLINE int largest_divisor_at_most(int n, int most) {
    int d = most < n ? most : n;
    while (n % d) --d;
    return d;
}
/* KV partitions: positions [i * PART, (i + 1) * PART) of a sequence, counted from its position 0
 * whatever the step, batch or thread count. Each query's attention is computed partition by
 * partition (scores, their maximum, softmax numerators and their sum, the weighted V rows: all
 * exact within the partition, as before), and the partitions' results are merged in order by one
 * function (merge_partition): the online softmax. A partition's scores stay in L1 (PART rows of a
 * tile's lanes: 32 KiB with AVX-512, 16 KiB with AVX2) where a whole context's did not fit L2, and
 * a decode's partitions are separate work items (split-K), merged after them in the same order. */
#define PART 256
/* Positions of a chunk tile's pass over V whose rows stay in L1 (32 rows: 8 KiB at head size 64). */
#define SUB 32
/* The same for a chunk tile's pass over V: 64 rows (16 KiB at head size 64) and the tile's weights
 * for them (8 KiB) stay in L1 across its D / PV_ELEMS passes, with half the passes' accumulator
 * loads and stores of 32 rows (1.03x on a 490-row chunk at 6,912; 128: no better). */
#ifndef CSUB
#define CSUB 64
#endif
/* Tiles of a chunk that one work item runs partition by partition, sharing each partition's K/V
 * rows, copied out of the cache once per item (TG * 16 KiB of running outputs and queries at head
 * size 64 stay in L2 beside them): at most TG, fewer (down to TG_MIN) where a step's chunks would
 * have too few items for its threads. Which tiles share an item changes no bits. */
#define TG 16
#define TG_MIN 4
/* A tile's transposed queries: D vectors per lane group, or with BF16_DOT their D / 2 bf16 pairs */
#ifdef BF16_DOT
#define QT_VECS (D / 2)
#else
#define QT_VECS D
#endif

/* One query's running result (o: D elements, `os` apart; its maximum score m and sum l so far)
 * merged with a partition's (acc: its weighted V sum, `as` apart; its maximum mi and sum li). One
 * of the two rescale factors is exactly 1 and is not applied: the other is a fused multiply-add,
 * written as one (fmaf), so that the compiler's contraction cannot differ. Not inlined: decodes
 * and chunks run these very instructions, so a query's bits are the same in both. A partition
 * whose positions are all masked (mi -inf, li and acc 0) changes nothing; m starts at -FLT_MAX. */
static __attribute__((noinline)) void merge_partition(float *restrict o, int64_t os, float *m, float *l,
                                                      const float *restrict acc, int64_t as, float mi,
                                                      float li, int D) {
    if (mi > *m) {
        const float alpha = exp_np(*m - mi);
        for (int d = 0; d < D; ++d) o[d * os] = fmaf(o[d * os], alpha, acc[d * as]);
        *l = fmaf(*l, alpha, li);
        *m = mi;
    } else {
        const float beta = exp_np(mi - *m);
        for (int d = 0; d < D; ++d) o[d * os] = fmaf(acc[d * as], beta, o[d * os]);
        *l = fmaf(li, beta, *l);
    }
}

/* Query heads per decode_heads_scores call: their accumulators (NG per head) and the NG K
 * vectors fit the registers. */
#define HG(NG) ((REGS - (NG) - 1) / (NG) > 8 ? 8 : (REGS - (NG) - 1) / (NG))

/* decode_heads_scores for rep query vectors (q: the first, qs apart), HG(NG) at a time, into rows
 * PART apart from row0. */
INLINE void decode_all_heads(const float *q, int64_t qs, const vf *kt, float *row0, int m, float scale, int rep,
                             const int NG, const int D) {
    int v = 0;
    for (; v + HG(NG) <= rep; v += HG(NG))
        decode_heads_scores(q + v * qs, qs, kt, row0 + (int64_t)v * PART, PART, m, scale, HG(NG), NG, D);
    const float *qv = q + v * qs;
    float *rv = row0 + (int64_t)v * PART;
    switch (rep - v) {
#define HEADS_CASE(g)                                                          \
    case g:                                                                    \
        if (g < HG(NG)) decode_heads_scores(qv, qs, kt, rv, PART, m, scale, g, NG, D); \
        break;
        HEADS_CASE(1) HEADS_CASE(2) HEADS_CASE(3) HEADS_CASE(4) HEADS_CASE(5) HEADS_CASE(6) HEADS_CASE(7)
#undef HEADS_CASE
    default: break;
    }
}

/* Calls fn(blk, off, p, n) for the runs of positions [from, to) that lie in one cache block each:
 * block blk from its row off, positions p .. p + n. */
#define FOR_RUNS(a, from, to, BODY)                                                        \
    for (int p_ = (from); p_ < (to);) {                                                    \
        const int blk = p_ / (a)->block_size, off = p_ % (a)->block_size;                 \
        const int n = (a)->block_size - off < (to) - p_ ? (a)->block_size - off : (to) - p_; \
        const int p = p_;                                                                  \
        BODY;                                                                              \
        p_ += n;                                                                           \
    }

/* Decode queries whose outputs accumulate together over one V row load, and the most vectors of
 * each query's output held at a time: the G x SLICE accumulators fill half the registers, enough
 * independent chains to hide the multiply-add's latency. */
#define DECODE_PV_GROUP (REGS >= 32 ? 4 : 1)

/* The weighted V sums of G queries (from `head` on; their numerators in rows PART apart, from
 * position P0) over positions [s0, s1), added to acc_out (D floats per query; `first`: it holds
 * nothing yet, the sums start from 0), SLICE vectors at a time: a query's sums run over positions
 * in order, whichever queries share its group and wherever the positions are cut into calls.
 * Where `sn` is given, the head's V row of its position p + shift (below `end`) is asked for from
 * memory as row p is read: a later work item's (attend_rows_part). */
/* Asks for a cache row's D values from memory, a request a line. */
INLINE void ask_row(const kv_t *row, const int D) {
    for (int c = 0; c < D; c += 64 / (int)sizeof(kv_t)) __builtin_prefetch(row + c, 0, 2);
}

INLINE void decode_part_output(const Args *a, const Seq *sq, int head, const float *w, int P0, int s0, int s1,
                               float *acc_out, int first, const int G, const int D, const Seq *sn, int shift,
                               int end) {
    const int h = head / (a->num_heads / a->num_kv_heads);
    const int64_t ps = (int64_t)a->num_kv_heads * D;
    const int nv = D / W, SLICE = largest_divisor_at_most(nv, REGS / 2 / G);
    for (int c0 = 0; c0 < nv; c0 += SLICE) {
        vf acc[G][SLICE];
        for (int j = 0; j < G; ++j)
            for (int c = 0; c < SLICE; ++c)
                acc[j][c] = first ? (vf){0} : loadv(acc_out + (int64_t)j * D + (c0 + c) * W);
        FOR_RUNS(a, s0, s1, {
            const kv_t *vb = block_at(a, a->v_cache, sq, blk, h, D) + off * ps + c0 * W;
            /* the rows asked for: [nv, nv + na * ps), in one block of sn's (its positions lie in blocks
             * as p's do: shift is a multiple of the block size) */
            const kv_t *nv = NULL;
            int na = 0;
            if (sn && c0 == 0 && p + shift < end) {
                const int q = p + shift;
                nv = block_at(a, a->v_cache, sn, q / a->block_size, h, D) + (int64_t)(q % a->block_size) * ps;
                na = end - q < n ? end - q : n;
                na = a->block_size - q % a->block_size < na ? a->block_size - q % a->block_size : na;
            }
#ifdef BF16_DOT /* positions in pairs (p, p + 1) from an even p: p + 1's product, then p's (dp_v's order) */
            int i = 0;
            for (; i + 1 < n; i += 2) {
                const kv_t *vp = vb + i * ps;
                for (int r = i; r < i + 2 && r < na; ++r) ask_row(nv + r * ps, D);
                for (int j = 0; j < G; ++j) {
                    const float w0 = w[(int64_t)j * PART + p - P0 + i];
                    const float w1 = w[(int64_t)j * PART + p - P0 + i + 1];
                    for (int c = 0; c < SLICE; ++c) {
                        acc[j][c] = madd_v(splat_v(w1), load_kv(vp + ps + c * W), acc[j][c]);
                        acc[j][c] = madd_v(splat_v(w0), load_kv(vp + c * W), acc[j][c]);
                    }
                }
            }
            if (i < n) /* a lone last position */
                for (int j = 0; j < G; ++j) {
                    const float w0 = w[(int64_t)j * PART + p - P0 + i];
                    for (int c = 0; c < SLICE; ++c)
                        acc[j][c] = madd_v(splat_v(w0), load_kv(vb + i * ps + c * W), acc[j][c]);
                }
#else
            for (int i = 0; i < n; ++i) {
                const kv_t *vp = vb + i * ps;
                if (i < na) ask_row(nv + i * ps, D);
                for (int j = 0; j < G; ++j) {
                    const float wj = w[(int64_t)j * PART + p - P0 + i];
                    for (int c = 0; c < SLICE; ++c) acc[j][c] = madd_v(splat_v(wj), load_kv(vp + c * W), acc[j][c]);
                }
            }
#endif
        });
        for (int j = 0; j < G; ++j)
            for (int c = 0; c < SLICE; ++c) storev(acc_out + (int64_t)j * D + (c0 + c) * W, acc[j][c]);
    }
}

/* Asks for the whole cache rows (every KV head's) of positions [from, to) of the sequence, K's
 * and V's, ahead of use: a split-K item's partition, all at once as the item starts (at 256
 * decodes of a few hundred positions each the items are bound by memory, and requests given
 * together keep more of it in flight than the next block's asked for block by block: 1.05-1.07x,
 * docs/performance.md, "The 256-request run outside the GEMMs"). A K line and the V line at the
 * same place in turn: two runs of memory read at once (1.01-1.06x at 4k-16k of context against
 * all K's lines then V's; a line of each 4 KiB piece in turn, 64 runs at once: 0.6-0.75x). The
 * rows of one block are one run of memory, but the next block may be anywhere, where the hardware
 * prefetcher does not follow. Only where rows come from: the same bits.
 *
 * The core waits on these requests (each holds one of its few line-fill buffers until its line
 * comes) and the item's arithmetic runs after them, from cache. Tried in their place on the 2-core
 * Xeon (docs/performance.md): one request per line the passes consume, a fixed distance ahead
 * (64-512 lines), so that the arithmetic would overlap the memory: 0.8-1.06x (the requests' rate
 * bound by the fill buffers, about 7 GB/s a core); the same in bursts of 32-128 lines:
 * 0.85-1.07x; every other line (for the adjacent-line prefetcher): 0.77-0.9x; into L1
 * (prefetcht0): 0.99-1.18x (1.0x at 16k); non-temporal (prefetchnta): 0.4x; no request:
 * 0.77-0.89x. On the Zen 4 an item now also asks for the next one's rows a line per line it reads
 * (below), which does overlap them with its arithmetic there; this request of its own rows stays
 * (skipped where an earlier item had asked ahead: no faster). */
INLINE void prefetch_partition(const Args *a, const Seq *s, int from, int to, const int D) {
    const int64_t ps = (int64_t)a->num_kv_heads * D;
    FOR_RUNS(a, from, to, {
        (void)p;
        const kv_t *kb = block_at(a, a->k_cache, s, blk, 0, D) + off * ps;
        const kv_t *vb = block_at(a, a->v_cache, s, blk, 0, D) + off * ps;
        for (int64_t e = 0; e < n * ps; e += 64 / (int)sizeof(kv_t)) {
            __builtin_prefetch(kb + e, 0, 2);
            __builtin_prefetch(vb + e, 0, 2);
        }
    });
}

/* A split-K item asks, while it computes, for the rows of the work item its thread will likely
 * take later: the pool hands items out one at a time in order, so a thread's c-th claim from now is
 * about c * threads items on, the same sequence's later partition or, past its end, the next
 * sequences' first ones (a decode of a few hundred positions is one to three items). It asks a line
 * for a line it reads: as its pass over its own K reads a K row's part, the same part of that
 * item's row at the same place in its partition; as its pass over V reads a V row, that item's.
 * Requests given all together, or a slice of them at a time, leave the core waiting on its fill
 * buffers with the arithmetic stopped; one beside each line read keep about as many in flight and
 * the arithmetic running (docs/performance.md, "A decode's later items asked for ahead"). c is the
 * claims that hold about AHEAD_BYTES of K/V rows, at least 1. Only where rows come from: the same
 * bits. */
#ifndef AHEAD_BYTES
#define AHEAD_BYTES (256 << 10)
#endif
static int ahead_partitions(int num_kv_heads, int head_dim, int threads) {
    const int64_t part_bytes = (int64_t)PART * num_kv_heads * head_dim * (int64_t)sizeof(kv_t) * 2;
    const int claims = part_bytes >= AHEAD_BYTES ? 1 : (int)(AHEAD_BYTES / part_bytes);
    return claims * (threads > 1 ? threads : 1);
}

/* A split-K item's partition `part`: the last R query rows of sequence b (a decode: its one row; a
 * sequence with a few rows at depth, FEW_ROWS: all of them), each row's query heads of every KV
 * head, each row with its own context (its position + 1) and window; it asks for partition next_part
 * of sequence next_b's rows as it goes (none where next_b < 0: above). Row i's result for KV head h
 * (rep rows of D weighted V sums, then rep maxima, rep sums) goes to partial + h * hstride + i *
 * pstride; a row whose context ends before the partition, or whose window starts after it, writes
 * nothing (its merge skips it). Every row's values are its decode's, operation for operation: the
 * scores are one lane's chain each whatever else shares the pass (the rows share each transposed K
 * group and the partition's K/V rows, read from memory once for all rows), and each row's softmax
 * and pass over V run over its own positions, [its first read, its own end). The passes take every
 * KV head at each position (the cache interleaves the heads in a row): each cache row is used
 * whole while it is in L1, and the item's scores for all its heads stay there (14 heads x 256
 * positions: 14 KiB). D is a compile-time constant where the caller can make it one (64, 128), so
 * that queries and accumulators stay in registers. */
INLINE void attend_rows_part(const Args *a, int b, int part, int R, float *scores, float *partial, int64_t hstride,
                             int64_t pstride, int next_b, int next_part, const int D) {
    const int H = a->num_kv_heads, rep = a->num_heads / H;
    const int bs = a->block_size;
    const Seq sq = seq_of(a, b);
    const int P0 = part * PART;
    /* row i (of the last R): context ctx_i, window start lo_i, partition end P1_i; the rows that
     * have this partition are a run [i0, i1) (contexts rise with i, and windows with them) */
    int i0 = R, i1 = 0;
    for (int i = 0; i < R; ++i) {
        const int ctx_i = sq.ctx - R + 1 + i, lo_i = a->window > 0 && ctx_i > a->window ? ctx_i - a->window : 0;
        const int P1_i = P0 + PART < ctx_i ? P0 + PART : ctx_i;
        if (ctx_i > P0 && P1_i > lo_i) {
            if (i < i0) i0 = i;
            i1 = i + 1;
        }
    }
    if (i0 >= i1) return;
    const int nv = (i1 - i0) * rep; /* a KV head's query vectors of rows i0 .. i1, rows times heads */
    vf *restrict kt = (vf *)(scores + (int64_t)H * nv * PART); /* two groups of W K rows, transposed */
    float *restrict qs = (float *)(kt + 2 * D); /* the query vectors, D apart (offsets known to the compiler) */
    for (int h = 0; h < H; ++h)
        for (int i = i0; i < i1; ++i)
            for (int v = 0; v < rep; ++v)
            {
                float *qd = qs + (int64_t)(h * nv + (i - i0) * rep + v) * D;
                memcpy(qd, query_at(a, &sq, sq.q_len - R + i, h * rep + v), sizeof(float) * D);
#ifdef BF16_DOT /* the queries' bf16 values (the chunk's pairs hold the same) */
                for (int d = 0; d < D; d += W) storev(qd + d, (vf)round_bf16_bits(loadv(qd + d)));
#endif
            }
    /* the first position read (row i0's: blocks wholly before its window are never read) and the
     * last row's end */
    const int ctx0 = sq.ctx - R + 1 + i0, ctxl = sq.ctx - R + i1;
    const int lo0 = a->window > 0 && ctx0 > a->window ? ctx0 - a->window : 0;
    const int r0 = P0 > lo0 / bs * bs ? P0 : lo0 / bs * bs;
    const int P1 = P0 + PART < ctxl ? P0 + PART : ctxl;
#ifndef NO_PREFETCH
    prefetch_partition(a, &sq, r0, P1, D);
#endif
    /* [N0, N1) of sequence next_b (sn): the partition asked for ahead; position p's rows are asked for
     * with those of N0 + p - r0 (a shift by whole blocks) */
    const Seq sn = next_b >= 0 ? seq_of(a, next_b) : sq;
    const int N0 = next_b >= 0 ? next_part * PART : 0;
    const int N1 = next_b < 0 ? 0 : N0 + PART < sn.ctx ? N0 + PART : sn.ctx;
    /* scores[(h * nv + u) * PART + p - P0] = q_u . k_p * scale, for KV head h's every vector u at
     * [r0, P1) */
    const int64_t ps = (int64_t)H * D;
    if (bs % W == 0) {
        /* every W positions from r0 lie in one block (r0 and the blocks' bounds are multiples of
         * W): 2W at a time, from two blocks where a block holds only W (16 positions on AVX-512),
         * so that each query value broadcast feeds two groups and its heads' chains are twice as
         * many; each lane's chain over d is the same, so are the bits */
        for (int p0 = r0; p0 < P1; p0 += 2 * W) {
            /* the K rows asked for beside these two groups' (each group of W lies in one block) */
            const kv_t *n1 = NULL, *n2 = NULL;
            int a1 = 0, a2 = 0;
#ifndef NO_PREFETCH
            const int f1 = N0 + (p0 - r0), f2 = f1 + W;
            if (f1 < N1) {
                a1 = N1 - f1 < W ? N1 - f1 : W;
                n1 = block_at(a, a->k_cache, &sn, f1 / bs, 0, D) + (int64_t)(f1 % bs) * ps;
            }
            if (f2 < N1) {
                a2 = N1 - f2 < W ? N1 - f2 : W;
                n2 = block_at(a, a->k_cache, &sn, f2 / bs, 0, D) + (int64_t)(f2 % bs) * ps;
            }
#endif
            const kv_t *k1 = block_at(a, a->k_cache, &sq, p0 / bs, 0, D) + (int64_t)(p0 % bs) * ps;
            float *row0 = scores + p0 - P0;
            if (p0 + W < P1) {
                const int p1 = p0 + W, m = P1 - p1 < W ? P1 - p1 : W;
                const kv_t *k2 = block_at(a, a->k_cache, &sq, p1 / bs, 0, D) + (int64_t)(p1 % bs) * ps;
                for (int h = 0; h < H; ++h) {
                    transpose_rows_asking(kt, k1 + h * D, ps, W, D, n1 ? n1 + h * D : NULL, a1);
                    transpose_rows_asking(kt + D, k2 + h * D, ps, m, D, n2 ? n2 + h * D : NULL, a2);
                    decode_all_heads(qs + (int64_t)h * nv * D, D, kt, row0 + (int64_t)h * nv * PART, m, a->scale, nv, 2,
                                     D);
                }
            } else
                for (int h = 0; h < H; ++h) {
                    transpose_rows_asking(kt, k1 + h * D, ps, P1 - p0, D, n1 ? n1 + h * D : NULL, a1);
                    decode_all_heads(qs + (int64_t)h * nv * D, D, kt, row0 + (int64_t)h * nv * PART, P1 - p0, a->scale,
                                     nv, 1, D);
                }
        }
    } else /* a block size that is not a multiple of W (8 on AVX-512): W positions of a run at a time */
        FOR_RUNS(a, r0, P1, {
            const kv_t *kb = block_at(a, a->k_cache, &sq, blk, 0, D) + off * ps;
            for (int i0_ = 0; i0_ < n; i0_ += W) {
                const int m = n - i0_ < W ? n - i0_ : W;
                for (int h = 0; h < H; ++h) {
                    transpose_rows(kt, kb + i0_ * ps + h * D, ps, m, D);
                    decode_all_heads(qs + (int64_t)h * nv * D, D, kt, scores + (int64_t)h * nv * PART + p - P0 + i0_, m,
                                     a->scale, nv, 1, D);
                }
            }
        });
    if (a->softcap > 0) /* soft-capped scores: a pass over the scaled ones (the loop above stays plain) */
        for (int u = 0; u < H * nv; ++u)
            for (int p = r0; p < P1; ++p)
                scores[(int64_t)u * PART + p - P0] = soft_cap(scores[(int64_t)u * PART + p - P0], a->softcap);
    for (int h = 0; h < H; ++h)
        for (int i = i0; i < i1; ++i) {
            const int ctx_i = sq.ctx - R + 1 + i, lo_i = a->window > 0 && ctx_i > a->window ? ctx_i - a->window : 0;
            const int P1_i = P0 + PART < ctx_i ? P0 + PART : ctx_i;
            float *sc = scores + (int64_t)(h * nv + (i - i0) * rep) * PART;
            /* positions before the row's window (a block holding lo was scored whole) are masked */
            for (int v = 0; v < rep; ++v)
                for (int p = P0; p < lo_i; ++p) sc[(int64_t)v * PART + p - P0] = -INFINITY;
            float *maxima = partial + h * hstride + i * pstride + (int64_t)rep * D, *sums = maxima + rep;
            const int lo_rel = lo_i > P0 ? lo_i - P0 : 0;
            for (int v = 0; v < rep; ++v)
                sums[v] = softmax_numerators(sc + (int64_t)v * PART, P1_i - P0, lo_rel, maxima + v);
        }
    /* the weighted V sums, SUB positions at a time for every KV head, row and query head: those V
     * rows stay in L1 for every pass; row i's over its own positions [r0_i, P1_i), from 0 at r0_i */
    for (int s0 = r0; s0 < P1; s0 += SUB) {
        const int s1 = s0 + SUB < P1 ? s0 + SUB : P1;
        for (int h = 0; h < H; ++h)
            for (int i = i0; i < i1; ++i) {
                const int ctx_i = sq.ctx - R + 1 + i,
                          lo_i = a->window > 0 && ctx_i > a->window ? ctx_i - a->window : 0;
                const int P1_i = P0 + PART < ctx_i ? P0 + PART : ctx_i;
                const int r0_i = P0 > lo_i / bs * bs ? P0 : lo_i / bs * bs;
                const int t0 = s0 > r0_i ? s0 : r0_i, t1 = s1 < P1_i ? s1 : P1_i;
                if (t0 >= t1) continue;
                const float *sc = scores + (int64_t)(h * nv + (i - i0) * rep) * PART;
                float *pr = partial + h * hstride + i * pstride;
                /* the first group of the first row asks for the V rows ahead (once a head) */
#ifndef NO_PREFETCH
                const Seq *ask = i == i0 && N1 > 0 ? &sn : NULL;
#else
                const Seq *ask = NULL;
#endif
                int v = 0;
                for (; v + DECODE_PV_GROUP <= rep; v += DECODE_PV_GROUP)
                    decode_part_output(a, &sq, h * rep + v, sc + (int64_t)v * PART, P0, t0, t1,
                                       pr + (int64_t)v * D, t0 == r0_i, DECODE_PV_GROUP, D, v ? NULL : ask,
                                       N0 - r0, N1);
                /* the rest as one group: a single query's 4 chains of multiply-adds (head size 64)
                 * wait on their latency, a group's 12 do not */
                switch (rep - v) {
#define PV_REST(g)                                                                                             \
    case g:                                                                                                    \
        if (g < DECODE_PV_GROUP) {                                                                             \
            decode_part_output(a, &sq, h * rep + v, sc + (int64_t)v * PART, P0, t0, t1, pr + (int64_t)v * D,   \
                               t0 == r0_i, g, D, v ? NULL : ask, N0 - r0, N1);                                 \
            v += g;                                                                                            \
        }                                                                                                      \
        break;
                    PV_REST(2) PV_REST(3)
#undef PV_REST
                default: break;
                }
                for (; v < rep; ++v)
                    decode_part_output(a, &sq, h * rep + v, sc + (int64_t)v * PART, P0, t0, t1,
                                       pr + (int64_t)v * D, t0 == r0_i, 1, D, v ? NULL : ask, N0 - r0, N1);
            }
    }
}

/* A split-K row's output (query row `row` of sequence b, context its position + 1): its
 * partitions' results merged in order, then divided by the sum. */
static void merge_decode(const Args *a, int b, int h, int row, const float *partials, int D) {
    const int rep = a->num_heads / a->num_kv_heads;
    const Seq sq = seq_of(a, b);
    const int ctx = sq.ctx - sq.q_len + row + 1;
    const int lo = a->window > 0 && ctx > a->window ? ctx - a->window : 0;
    const int64_t per = (int64_t)rep * (D + 2);
    for (int v = 0; v < rep; ++v) {
        float *o = a->out + ((int64_t)(sq.start + row) * a->num_heads + h * rep + v) * D;
        float m = -FLT_MAX, l = 0.0f;
        for (int d = 0; d < D; ++d) o[d] = 0.0f;
        for (int part = lo / PART; part * PART < ctx; ++part) {
            const float *pp = partials + part * per;
            merge_partition(o, 1, &m, &l, pp + (int64_t)v * D, 1, pp[(int64_t)rep * D + v],
                            pp[(int64_t)rep * D + rep + v], D);
        }
        for (int d = 0; d < D; ++d) o[d] = o[d] / l;
    }
}

/* Positions whose scores one pass over a tile's queries computes: QP x T accumulators, each
 * query value loaded feeding QP multiply-adds and each K value broadcast T. */
#ifndef QP
#if REGS >= 32
#define QP 8
#else
#define QP 4
#endif
#endif

/* acc[i][t] = q . k (the order above: one chain over d) for the tile's lanes of vector t and the K
 * row k + i * D, i < QP (rows D apart: the partition's rows copied out of the cache). */
INLINE void tile_scores_block(const vf (*restrict qt)[T], const float *restrict k, vf acc[QP][T], const int D) {
    for (int i = 0; i < QP; ++i)
        for (int t = 0; t < T; ++t) acc[i][t] = qt[0][t] * k[i * D];
    for (int d = 1; d < D; ++d)
        for (int t = 0; t < T; ++t) {
            const vf q = qt[d][t];
            for (int i = 0; i < QP; ++i) acc[i][t] = madd_v(q, splat_v(k[i * D + d]), acc[i][t]);
        }
}

/* merge_partition for every lane of a tile at once (o, acc: D rows of TILE floats; mi, li: the
 * partition's maxima and sums): lane by lane the same operations (the same branch, exponent and
 * fused multiply-adds, fmaf), so the same bits as merge_partition gives that query as a decode. */
INLINE void merge_tile(float *restrict o, float *restrict m_run, float *restrict l_run, const float *restrict acc,
                       const vf mi[T], const vf li[T], const int D) {
    for (int t = 0; t < T; ++t) {
        const vf mo = loadv(m_run + t * W), mn = mi[t], lo = loadv(l_run + t * W);
        const vi up = mn > mo;
        const vf f = exp_np_v(select_v(up, mo - mn, mn - mo));
        storev(l_run + t * W, fma_v(select_v(up, lo, li[t]), f, select_v(up, li[t], lo)));
        storev(m_run + t * W, select_v(up, mn, mo));
        for (int d = 0; d < D; ++d) {
            const vf x = loadv(o + d * TILE + t * W), y = loadv(acc + d * TILE + t * W);
            storev(o + d * TILE + t * W, fma_v(select_v(up, x, y), f, select_v(up, y, x)));
        }
    }
}

/* The lanes that see position q (its window or from 0, up to its own): all of them where the
 * caller knows it (INSIDE: a partition wholly inside every real lane's range; a padding lane past
 * the tile's vectors then computes values no one reads, where it would have been masked). */
INLINE vi seen(int q, const vi *limit, const vi *low, int t, const int INSIDE) {
    return INSIDE ? (vi){0} - 1 : (q < limit[t]) & (q >= low[t]);
}

/* A block of QP positions' scores (acc, from position q0; qn of them real) scaled, capped and
 * masked into st[(q - P0) * T + t], their maxima into m. */
INLINE void tile_keep_scores(const Args *a, vf acc[QP][T], int q0, int qn, int P0, const vi *limit, const vi *low,
                             vf *restrict st, vf *m, const int CAP, const int INSIDE) {
    const vf neg_inf = (vf){0} - INFINITY;
    for (int j = 0; j < qn; ++j)
        for (int t = 0; t < T; ++t) {
            const int q = q0 + j;
            const vf x = select_v(seen(q, limit, low, t, INSIDE), capped_v(a, acc[j][t] * a->scale, CAP), neg_inf);
            st[(q - P0) * T + t] = x;
            m[t] = max_v(x, m[t]);
        }
}

/* softmax numerators of positions [r0, P1) in st, lane by lane, in place; a masked position's is
 * exactly 0 (ROUND: each rounded to bf16, the bf16-products build). Their sums in
 * softmax_numerators' order: W partial sums, position p into the (p % W)-th (P0 is a multiple of
 * W), then halved; the total into sum_out. */
INLINE void tile_numerators(vf *restrict st, const vf *m, const vi *limit, const vi *low, int P0, int P1, int r0,
                            vf *sum_out, const int INSIDE, const int ROUND) {
    vf part[W][T];
    for (int l = 0; l < W; ++l) { /* the positions that go to partial sum l, in order: in registers */
        vf sum[T];
        for (int t = 0; t < T; ++t) sum[t] = (vf){0};
        for (int q = r0 - r0 % W + l; q < P1; q += W) {
            if (q < r0) continue;
            for (int t = 0; t < T; ++t) {
                vf x = select_v(seen(q, limit, low, t, INSIDE), exp_np_v(st[(q - P0) * T + t] - m[t]), (vf){0});
#ifdef BF16_DOT
                if (ROUND) x = (vf)round_bf16_bits(x);
#endif
                st[(q - P0) * T + t] = x;
                sum[t] += x;
            }
        }
        for (int t = 0; t < T; ++t) part[l][t] = sum[t];
    }
    for (int w = W / 2; w > 0; w /= 2)
        for (int l = 0; l < w; ++l)
            for (int t = 0; t < T; ++t) part[l][t] += part[l + w][t];
    for (int t = 0; t < T; ++t) sum_out[t] = part[0][t];
}

/* The partition's weighted V sums into accp[d * TILE + lane], PV_ELEMS elements of every vector at
 * a time (accumulators in half the registers), CSUB positions at a time: each pass over a V row
 * reads PV_ELEMS of its elements, and CSUB rows stay in L1 for all D / PV_ELEMS passes (a whole
 * partition's did not: 1.6x on the chunk). A lane's sums still run over positions in order, the
 * accumulators kept in accp between sub-blocks. vrows: V's rows as fp32 (D apart, from P0), or
 * with PAIRS (the bf16-products build) as pairs of positions (p, p + 1) from an even p, element by
 * element (D pairs apart), taken with the numerators packed alike in st. */
INLINE void tile_weighted_v(const vf *restrict st, const void *restrict vrows, float *restrict accp, int P0, int P1,
                            int r0, const int D, const int PAIRS) {
    for (int i = 0; i < D * TILE; ++i) accp[i] = 0.0f;
    for (int s0 = r0; s0 < P1; s0 += CSUB) {
        const int s1 = s0 + CSUB < P1 ? s0 + CSUB : P1;
        for (int dc = 0; dc < D; dc += PV_ELEMS) {
            vf acc[PV_ELEMS][T];
            for (int e = 0; e < PV_ELEMS; ++e)
                for (int t = 0; t < T; ++t) acc[e][t] = loadv(accp + (dc + e) * TILE + t * W);
#ifdef BF16_DOT
            if (PAIRS)
                for (int q = s0; q < s1; q += 2) {
                    const uint32_t *vp = (const uint32_t *)vrows + (int64_t)(q - P0) / 2 * D + dc;
                    for (int t = 0; t < T; ++t) {
                        const vi w = (vi)st[(q - P0) * T + t];
                        for (int e = 0; e < PV_ELEMS; ++e) acc[e][t] = dp_v(acc[e][t], w, splat_i(vp[e]));
                    }
                }
            else
#endif
                for (int q = s0; q < s1; ++q) {
                    const float *vp = (const float *)vrows + (int64_t)(q - P0) * D + dc;
                    for (int t = 0; t < T; ++t) {
                        const vf w = st[(q - P0) * T + t];
                        for (int e = 0; e < PV_ELEMS; ++e) acc[e][t] = madd_v(w, splat_v(vp[e]), acc[e][t]);
                    }
                }
            for (int e = 0; e < PV_ELEMS; ++e)
                for (int t = 0; t < T; ++t) storev(accp + (dc + e) * TILE + t * W, acc[e][t]);
        }
    }
}

/* One tile's pass over one partition's positions [r0, P1) (K and V rows copied out to kbuf and
 * vbuf, from position P0): its scores, their maxima, the softmax numerators and their sums, the
 * weighted V sums, merged into the tile's running outputs o, maxima m_run and sums l_run. INSIDE:
 * no real lane of the tile masks any of these positions (the same bits: the masks would keep
 * every value). */
INLINE void tile_partition(const Args *a, const vf (*restrict qt)[T], const vi *limit, const vi *low,
                           float *restrict o, float *restrict m_run, float *restrict l_run, vf *restrict st,
                           float *restrict accp, const float *restrict kbuf, const float *restrict vbuf, int P0,
                           int P1, int r0, const int CAP, const int INSIDE, const int D) {
    const vf neg_inf = (vf){0} - INFINITY;
    vf m[T];
    for (int t = 0; t < T; ++t) m[t] = neg_inf;
    /* st[(p - P0) * T + t] = the tile's scores at position p (masked outside each lane's range) */
    for (int q0 = r0; q0 < P1; q0 += QP) {
        vf acc[QP][T];
        tile_scores_block(qt, kbuf + (int64_t)(q0 - P0) * D, acc, D);
        tile_keep_scores(a, acc, q0, P1 - q0 < QP ? P1 - q0 : QP, P0, limit, low, st, m, CAP, INSIDE);
    }
    vf l_sum[T];
    tile_numerators(st, m, limit, low, P0, P1, r0, l_sum, INSIDE, 0);
    tile_weighted_v(st, vbuf, accp, P0, P1, r0, D, 0);
    merge_tile(o, m_run, l_run, accp, m, l_sum, D);
}

#ifdef BF16_DOT
/* tile_partition with bf16 products: qt2[dp][t] the tile's queries' pairs (d = 2dp, 2dp + 1), kb16
 * the partition's K rows as bf16 (D apart), vb2[(p - P0) / 2][e] V's elements e of positions p, p + 1
 * as one pair; the numerators rounded to bf16 (their sums too) */
INLINE void tile_partition_dp(const Args *a, const vi (*restrict qt2)[T], const vi *limit, const vi *low,
                              float *restrict o, float *restrict m_run, float *restrict l_run, vf *restrict st,
                              float *restrict accp, const uint16_t *restrict kb16, const uint32_t *restrict vb2,
                              int P0, int P1, int r0, const int CAP, const int INSIDE, const int D) {
    const vf neg_inf = (vf){0} - INFINITY;
    vf m[T];
    for (int t = 0; t < T; ++t) m[t] = neg_inf;
    for (int q0 = r0; q0 < P1; q0 += QP) {
        vf acc[QP][T];
        for (int i = 0; i < QP; ++i)
            for (int t = 0; t < T; ++t) acc[i][t] = (vf){0};
        const uint32_t *kw = (const uint32_t *)(kb16 + (int64_t)(q0 - P0) * D);
        for (int dp = 0; dp < D / 2; ++dp) {
            vi q[T];
            for (int t = 0; t < T; ++t) q[t] = qt2[dp][t];
            for (int i = 0; i < QP; ++i) {
                const vi kp = splat_i(kw[i * (D / 2) + dp]);
                for (int t = 0; t < T; ++t) acc[i][t] = dp_v(acc[i][t], q[t], kp);
            }
        }
        tile_keep_scores(a, acc, q0, P1 - q0 < QP ? P1 - q0 : QP, P0, limit, low, st, m, CAP, INSIDE);
    }
    vf l_sum[T];
    tile_numerators(st, m, limit, low, P0, P1, r0, l_sum, INSIDE, 1);
    /* the numerators as pairs of positions (an odd end's partner 0) */
    if ((P1 - r0) & 1)
        for (int t = 0; t < T; ++t) st[(P1 - P0) * T + t] = (vf){0};
    for (int q = r0; q < P1; q += 2)
        for (int t = 0; t < T; ++t) {
            const vi e = (vi)st[(q - P0) * T + t], od = (vi)st[(q + 1 - P0) * T + t];
            st[(q - P0) * T + t] = (vf)((vi)((uint32_t __attribute__((vector_size(4 * W))))e >> 16) | od);
        }
    tile_weighted_v(st, vb2, accp, P0, P1, r0, D, 1);
    merge_tile(o, m_run, l_run, accp, m, l_sum, D);
}
#endif

/* A tile of a chunk's query vectors (rows times heads, in order, from vector v0): TILE of them,
 * the lanes of T vectors, so q . k for all of them at one position is D multiply-adds of the
 * transposed queries by that K row's broadcast values (no horizontal sums), and each output
 * element is the same over V. Partition by partition, as a decode: a lane's sums run over d, then
 * over the partition's positions, in order; a position outside a lane's causal limit or window adds
 * an exact zero, and a partition wholly outside merges as nothing: a vector's result does not
 * depend on which vectors share its tile. scratch: PART * T vectors of scores, then D * TILE
 * floats of partition sums and D * TILE of running outputs. */
INLINE void attend_tile(const Args *a, int b, int h, int v0, int tg, vf *restrict scratch, const int D, const int CAP) {
    const int rep = a->num_heads / a->num_kv_heads;
    const int bs = a->block_size;
    const int64_t ps = (int64_t)a->num_kv_heads * D;
    const Seq sq = seq_of(a, b);
    const int left = sq.q_len * rep - v0, ntiles = (left + TILE - 1) / TILE < tg ? (left + TILE - 1) / TILE : tg;
    vf *restrict st = scratch;
    float *restrict accp = (float *)(scratch + PART * T);
    vf *restrict qts = (vf *)(accp + D * TILE); /* the tiles' transposed queries, D * T vectors each */
    float *restrict os = (float *)(qts + TG * QT_VECS * T); /* their running outputs, D * TILE floats each */
    float *restrict kbuf = os + TG * D * TILE; /* the partition's K rows, D apart (PART + QP of them) */
    float *restrict vbuf = kbuf + (PART + QP) * D; /* and its V rows */
    vi limits[TG][T], lows[TG][T]; /* a lane sees positions [low, limit): its window, or from 0 */
    int nvecs[TG], longests[TG], first_poss[TG];
    float m_runs[TG][TILE], l_runs[TG][TILE];
    for (int g = 0; g < ntiles; ++g) {
        const int u0 = v0 + g * TILE;
        const int nvec = nvecs[g] = sq.q_len * rep - u0 < TILE ? sq.q_len * rep - u0 : TILE;
        vf (*qt)[T] = (vf (*)[T])(qts + (int64_t)g * QT_VECS * T);
        vi *limit = limits[g], *low = lows[g];
        for (int t = 0; t < T; ++t) limit[t] = low[t] = (vi){0};
        for (int v = 0; v < TILE; ++v) {
            const int row = (u0 + v) / rep;
            if (v < nvec) {
                const float *qv = query_at(a, &sq, row, h * rep + (u0 + v) % rep);
#ifdef BF16_DOT
                for (int d = 0; d < D; d += 2)
                    ((vi (*)[T])qt)[d / 2][v / W][v % W] = (int32_t)((uint32_t)bf16_of(qv[d]) | (uint32_t)bf16_of(qv[d + 1]) << 16);
#else
                for (int d = 0; d < D; ++d) qt[d][v / W][v % W] = qv[d];
#endif
                limit[v / W][v % W] = sq.ctx - sq.q_len + row + 1;
                if (a->window > 0 && limit[v / W][v % W] > a->window)
                    low[v / W][v % W] = limit[v / W][v % W] - a->window;
            } else {
                for (int d = 0; d < QT_VECS; ++d) qt[d][v / W][v % W] = 0.0f;
            }
        }
        longests[g] = limit[(nvec - 1) / W][(nvec - 1) % W];
        /* The tile's first query sees the earliest position (rows rise, and their windows with
         * them): blocks wholly before it are never read, as no lane sees them (a sliding-window
         * layer's cache may have released them). Their positions would add exact zeros. */
        first_poss[g] = low[0][0] / bs * bs;
        for (int v = 0; v < TILE; ++v) m_runs[g][v] = -FLT_MAX, l_runs[g][v] = 0.0f;
        float *o = os + (int64_t)g * D * TILE;
        for (int i = 0; i < D * TILE; ++i) o[i] = 0.0f;
    }
    /* partition by partition, each tile of the group in turn: the partition's K and V rows are
     * read from memory once for all of them, then from L2 */
    for (int P0 = first_poss[0] / PART * PART; P0 < longests[ntiles - 1]; P0 += PART) {
    /* the partition's K and V rows that any tile reads, copied out of the cache once (D apart: the
     * tiles' passes address them from one pointer, and read them in order from L2), then QP rows
     * of zeros after the K rows for a last pass's extra rows */
    const int c0 = P0 > first_poss[0] ? P0 : first_poss[0];
    const int c1 = P0 + PART < longests[ntiles - 1] ? P0 + PART : longests[ntiles - 1];
    FOR_RUNS(a, c0, c1, {
        const kv_t *kb = block_at(a, a->k_cache, &sq, blk, h, D) + off * ps;
        const kv_t *vb = block_at(a, a->v_cache, &sq, blk, h, D) + off * ps;
#if defined(BF16_DOT) /* K's bf16 rows as they are; V's rows of positions p, p + 1 (p even: runs start
                       * at a block or at c0, both even) interleaved element by element, the pairs
                       * the pass over V broadcasts (a lone last row's partner is 0) */
        for (int i = 0; i < n; ++i)
            memcpy((uint16_t *)kbuf + (int64_t)(p + i - P0) * D, kb + i * ps, sizeof(uint16_t) * D);
        for (int i = 0; i < n; i += 2) {
            uint32_t *vp = (uint32_t *)vbuf + (int64_t)(p + i - P0) / 2 * D;
            for (int d = 0; d < D; d += W) {
                const vi even = (vi)load_kv(vb + i * ps + d);
                const vi odd = i + 1 < n ? (vi)load_kv(vb + (i + 1) * ps + d) : (vi){0};
                *(vi *)(vp + d) = (vi)((uint32_t __attribute__((vector_size(4 * W))))even >> 16) | odd;
            }
        }
#else
        for (int i = 0; i < n; ++i) {
#if defined(KV_BF16) /* widened as they are copied: the passes read fp32 rows either way */
            for (int d = 0; d < D; d += W) {
                storev(kbuf + (int64_t)(p + i - P0) * D + d, load_kv(kb + i * ps + d));
                storev(vbuf + (int64_t)(p + i - P0) * D + d, load_kv(vb + i * ps + d));
            }
#else
            memcpy(kbuf + (int64_t)(p + i - P0) * D, kb + i * ps, sizeof(float) * D);
            memcpy(vbuf + (int64_t)(p + i - P0) * D, vb + i * ps, sizeof(float) * D);
#endif
        }
#endif
    });
#ifdef BF16_DOT
    memset((uint16_t *)kbuf + (int64_t)(c1 - P0) * D, 0, sizeof(uint16_t) * QP * D);
#else
    memset(kbuf + (int64_t)(c1 - P0) * D, 0, sizeof(float) * QP * D);
#endif
    for (int g = 0; g < ntiles; ++g) {
        const int longest = longests[g], first_pos = first_poss[g];
        if (P0 >= longest || P0 + PART <= first_pos) continue;
        const vf (*restrict qt)[T] = (const vf (*)[T])(qts + (int64_t)g * QT_VECS * T);
        const vi *limit = limits[g], *low = lows[g];
        float *restrict o = os + (int64_t)g * D * TILE, *m_run = m_runs[g], *l_run = l_runs[g];
        const int P1 = P0 + PART < longest ? P0 + PART : longest;
        const int r0 = P0 > first_pos ? P0 : first_pos; /* the partition's first position read */
        /* a partition wholly inside every real lane's range (rows rise, and their windows with
         * them: the first lane's limit is the least, the last real lane's low the greatest) */
        const int last = nvecs[g] - 1;
#ifdef BF16_DOT
        const vi (*qt2)[T] = (const vi (*)[T])qt;
        if (SPECIALIZED && r0 >= low[last / W][last % W] && P1 <= limit[0][0])
            tile_partition_dp(a, qt2, limit, low, o, m_run, l_run, st, accp, (const uint16_t *)kbuf, (const uint32_t *)vbuf, P0, P1, r0, CAP, 1, D);
        else
            tile_partition_dp(a, qt2, limit, low, o, m_run, l_run, st, accp, (const uint16_t *)kbuf, (const uint32_t *)vbuf, P0, P1, r0, CAP, 0, D);
#else
        if (SPECIALIZED && r0 >= low[last / W][last % W] && P1 <= limit[0][0])
            tile_partition(a, qt, limit, low, o, m_run, l_run, st, accp, kbuf, vbuf, P0, P1, r0, CAP, 1, D);
        else
            tile_partition(a, qt, limit, low, o, m_run, l_run, st, accp, kbuf, vbuf, P0, P1, r0, CAP, 0, D);
#endif
    }
    }
    for (int g = 0; g < ntiles; ++g) {
        const float *o = os + (int64_t)g * D * TILE;
        for (int v = 0; v < nvecs[g]; ++v) {
            const int u = v0 + g * TILE + v, row = u / rep, head = h * rep + u % rep;
            float *out = a->out + ((int64_t)(sq.start + row) * a->num_heads + head) * D;
            for (int d = 0; d < D; ++d) out[d] = o[d * TILE + v] / l_runs[g][v];
        }
    }
}

#ifdef AMX_PATH
#include <immintrin.h>

/* The tile path (AMX-BF16, TDPBF16PS), where amx.h's probe grants the tiles and the head size is a
 * multiple of 32: q . k and the pass over V of decodes and chunks alike, on exact three-part splits.
 * See the header comment ("On AMX-BF16 tiles") for the order; the softmax, the partitions and their
 * merge are the fp32 functions above (softmax_numerators, merge_partition). */
/* -1: LLMSERVE_AMX_ATTENTION decides: 1 on, 0 off; unset, off for an fp32 cache (decodes ran 0.66-0.86x
 * the FMA path there), on for a bf16 cache (no split of K/V, half the products: decodes 1.3x the
 * FMA path on the same cache, 512-row chunks 1.8x: docs/performance.md, "A bf16 KV cache on CPU"). Tests
 * switch it. */
static int attn_amx_use = -1;
static int attn_amx_listed = -1; /* CPUID's AMX-BF16 bit, read once */

static int attn_amx_on(void) {
#ifdef BF16_DOT /* the tiles' order is not dp_v's: this build never runs them */
    return 0;
#endif
    if (attn_amx_use < 0) {
        const char *env = getenv("LLMSERVE_AMX_ATTENTION");
#ifdef KV_BF16
        attn_amx_use = !(env && env[0] == '0');
#else
        attn_amx_use = env && env[0] == '1';
#endif
    }
    if (!attn_amx_use) return 0;
    if (attn_amx_listed < 0) attn_amx_listed = amx_bf16_listed();
    return attn_amx_listed && amx_active();
}

#define AG 16 /* query vectors per tile group: a B tile's columns (q . k), an A tile's rows (over V) */
#define TB 512 /* bf16 elements in a tile: 16 rows of 64 bytes */

/* Every tile 16 rows of 64 bytes: C 0, 1, 2 (the sums of the three levels), A 3, 4, 5 (the three
 * parts of K rows or of weights), B 6, 7 (a part of the queries or of V rows). */
static void attn_tiles_configure(void) {
    amx_config c;
    memset(&c, 0, sizeof c);
    c.palette_id = 1;
    for (int t = 0; t < 8; ++t) c.rows[t] = 16, c.colsb[t] = 64;
    TILE_CONFIGURE(c);
}

/* 16 floats split by truncation into three bf16 parts (each the top half of its lane, the low half
 * zero): x1 = x with its low 16 bits cleared, r = x - x1, x2 = r so truncated, x3 = r - x2 so
 * truncated (exact subtractions: x = x1 + x2 + x3 where no part is below 2^-126, which the tile
 * reads as zero). A non-finite x keeps x1 = x, parts 2 and 3 zero. */
INLINE void split3_v(__m512 v, __m512i p[3]) {
    const __m512i hi = _mm512_set1_epi32((int)0xffff0000u), expo = _mm512_set1_epi32(0x7f800000);
    const __m512i b = _mm512_castps_si512(v), b1 = _mm512_and_si512(b, hi);
    const __mmask16 fin = _mm512_cmpneq_epi32_mask(_mm512_and_si512(b, expo), expo);
    const __m512 r = _mm512_maskz_sub_ps(fin, v, _mm512_castsi512_ps(b1));
    const __m512i b2 = _mm512_and_si512(_mm512_castps_si512(r), hi);
    p[0] = b1, p[1] = b2;
    p[2] = _mm512_and_si512(_mm512_castps_si512(_mm512_sub_ps(r, _mm512_castsi512_ps(b2))), hi);
}

INLINE void store_bf16x16(uint16_t *dst, __m512i p) {
    _mm256_storeu_si256((__m256i *)dst, _mm512_cvtepi32_epi16(_mm512_srli_epi32(p, 16)));
}

INLINE __m512 load_or_zero(const float *p) { return p ? _mm512_loadu_ps(p) : _mm512_setzero_ps(); }

/* 16 cache values widened (a bf16 cache's x splits into x, 0, 0), or zeros for NULL. */
INLINE __m512 load_kv_or_zero(const kv_t *p) { return p ? (__m512)load_kv(p) : _mm512_setzero_ps(); }

/* The bf16 halves (top 16 bits of each lane) of x then y: 32 bf16 values, x's first. */
INLINE __m512i pack_bf16x32(__m512i x, __m512i y) {
    const __m512i odd = _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33, 31, 29, 27,
                                         25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    return _mm512_permutex2var_epi16(x, odd, y);
}

/* K row `rel` of a partition (src: D floats; NULL: zeros) into its parts' A tiles, kp:
 * [block of 16 positions][32 dims dt][part] tiles, row = position, 32 dims of it. */
INLINE void amx_split_k_row(const kv_t *src, uint16_t *kp, int rel, const int D) {
    const int DT = D / 32;
    uint16_t *base = kp + (int64_t)(rel / 16) * DT * 3 * TB + (rel % 16) * 32;
#ifdef KV_BF16 /* a bf16 row is its own first part, its other two zero: only the first is kept */
    for (int dt = 0; dt < DT; ++dt)
        _mm512_storeu_si512(base + dt * 3 * TB, src ? _mm512_loadu_si512(src + dt * 32) : _mm512_setzero_si512());
    return;
#endif
    for (int dt = 0; dt < DT; ++dt) {
        __m512i p[3], r[3];
        split3_v(load_kv_or_zero(src ? src + dt * 32 : NULL), p);
        split3_v(load_kv_or_zero(src ? src + dt * 32 + 16 : NULL), r);
        for (int j = 0; j < 3; ++j) _mm512_storeu_si512(base + (dt * 3 + j) * TB, pack_bf16x32(p[j], r[j]));
    }
}

/* V rows `rel` (even) and rel + 1 of a partition (NULL: zeros) into its parts' B tiles, vp:
 * [block of 32 positions][16 dims c][part] tiles, row r = the pair of positions 2r, 2r + 1 (the
 * pair interleaved in each column), column = dim 16c + column. */
INLINE void amx_split_v_pair(const kv_t *ev, const kv_t *od, uint16_t *vp, int rel, const int D) {
    const int DC = D / 16;
    uint16_t *base = vp + (int64_t)(rel / 32) * DC * 3 * TB + (rel % 32) / 2 * 32;
#ifdef KV_BF16 /* the pair interleaved, first parts only (the others are zero) */
    for (int c = 0; c < DC; ++c) {
        const __m512i e = ev ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(ev + c * 16)))
                             : _mm512_setzero_si512();
        const __m512i o = od ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(od + c * 16)))
                             : _mm512_setzero_si512();
        _mm512_storeu_si512(base + c * 3 * TB, _mm512_or_si512(e, _mm512_slli_epi32(o, 16)));
    }
    return;
#endif
    for (int c = 0; c < DC; ++c) {
        __m512i pe[3], po[3];
        split3_v(load_kv_or_zero(ev ? ev + c * 16 : NULL), pe);
        split3_v(load_kv_or_zero(od ? od + c * 16 : NULL), po);
        for (int j = 0; j < 3; ++j)
            _mm512_storeu_si512(base + (c * 3 + j) * TB, _mm512_or_si512(_mm512_srli_epi32(pe[j], 16), po[j]));
    }
}

/* G <= 16 query vectors (qv[i]: D floats) into their parts' B tiles, qp: [32 dims dt][part] tiles,
 * row r = dims 32dt + 2r, 32dt + 2r + 1 interleaved, column = query (columns from G zero): each
 * part's 16 x 16 pairs transposed. */
INLINE void amx_split_queries(const float *const *qv, int G, uint16_t *qp, const int D) {
    const int DT = D / 32;
    for (int dt = 0; dt < DT; ++dt) {
        vf rows[3][16];
        for (int i = 0; i < AG; ++i) {
            __m512i p[3], r[3];
            split3_v(load_or_zero(i < G ? qv[i] + dt * 32 : NULL), p);
            split3_v(load_or_zero(i < G ? qv[i] + dt * 32 + 16 : NULL), r);
            for (int j = 0; j < 3; ++j) rows[j][i] = (vf)_mm512_castsi512_ps(pack_bf16x32(p[j], r[j]));
        }
        for (int j = 0; j < 3; ++j) {
            transpose_w(rows[j]);
            for (int r = 0; r < 16; ++r) storev((float *)(qp + (dt * 3 + j) * TB + r * 32), rows[j][r]);
        }
    }
}

/* The weights of G <= 16 queries (rows rs apart, positions [0, 32 nb32)) into their parts' A tiles,
 * wp: [block of 32 positions][part] tiles, row = query (rows from G zero), 32 positions of it. */
INLINE void amx_split_weights(const float *w, int64_t rs, int G, int nb32, uint16_t *wp) {
    for (int blk = 0; blk < nb32; ++blk)
        for (int i = 0; i < AG; ++i) {
            __m512i p[3], r[3];
            split3_v(load_or_zero(i < G ? w + i * rs + blk * 32 : NULL), p);
            split3_v(load_or_zero(i < G ? w + i * rs + blk * 32 + 16 : NULL), r);
            for (int j = 0; j < 3; ++j) _mm512_storeu_si512(wp + (blk * 3 + j) * TB + i * 32, pack_bf16x32(p[j], r[j]));
        }
}

/* The parts' products that the tiles sum, per 32 k steps (k = dims for q . k, positions over V):
 * the three parts s1, s2, s3 of one operand stay in tiles 4, 5, 6 (K rows for q . k, V rows over
 * V) while the other's, t1, t2, t3, pass through tile 7 (a group's queries, a group's weights), up to
 * two groups per load of the s tiles; of the nine products the six with i + j <= 2 (parts 0, 1, 2)
 * go, in this order, into two sums per group, C0 (tile 0 or 2) and C1 (tile 1 or 3):
 *   C0 += t1 s1;  C1 += t1 s2;  C1 += t1 s3;  C1 += t2 s1;  C1 += t2 s2;  C1 += t3 s1
 * (the three dropped are each under 2^-24 of the whole: fp32's rounding). DP(c, s, t) is the
 * TDPBF16PS of c with s and t in the roles of A and B the caller's layout gives them. */
#define AMX_GROUP_PRODUCTS(DP, c0, c1, t)   \
    do {                                    \
        TILE_LOAD(7, (t), 64);              \
        DP(c0, 4, 7);                       \
        DP(c1, 5, 7);                       \
        DP(c1, 6, 7);                       \
        TILE_LOAD(7, (t) + TB, 64);         \
        DP(c1, 4, 7);                       \
        DP(c1, 5, 7);                       \
        TILE_LOAD(7, (t) + 2 * TB, 64);     \
        DP(c1, 4, 7);                       \
    } while (0)
/* The same where the parts that stay in tiles are a bf16 cache's (KV_BF16): s2 and s3 are zero, so
 * their products add exact zeros (each chain from +0 stays +0, and a C sum, never -0 or
 * subnormal, is unchanged by adding it) and are not run: C0 += t1 s1;  C1 += t2 s1;  C1 += t3 s1,
 * the same sums as the six on the cache's values widened, half the products, s1 in tile 4 alone. */
#define AMX_GROUP_PRODUCTS_KV16(DP, c0, c1, t) \
    do {                                        \
        TILE_LOAD(7, (t), 64);                  \
        DP(c0, 4, 7);                           \
        TILE_LOAD(7, (t) + TB, 64);             \
        DP(c1, 4, 7);                           \
        TILE_LOAD(7, (t) + 2 * TB, 64);         \
        DP(c1, 4, 7);                           \
    } while (0)
#ifdef KV_BF16
#define AMX_S_PARTS(s)      TILE_LOAD(4, (s), 64)
#define AMX_PRODUCTS        AMX_GROUP_PRODUCTS_KV16
#else
#define AMX_S_PARTS(s)               \
    do {                             \
        TILE_LOAD(4, (s), 64);       \
        TILE_LOAD(5, (s) + TB, 64);  \
        TILE_LOAD(6, (s) + 2 * TB, 64); \
    } while (0)
#define AMX_PRODUCTS        AMX_GROUP_PRODUCTS
#endif
/* q . k: K's parts the A tile (positions in rows), the queries' the B tile (queries in columns) */
#define DP_SA(c, s, t) TILE_DPBF16(c, s, t)
/* over V: the weights' parts the A tile (queries in rows), V's the B tile (dims in columns) */
#define DP_TA(c, s, t) TILE_DPBF16(c, t, s)

/* A group's share of the tile path: its query parts, lanes and buffers. */
typedef struct {
    const uint16_t *qp; /* its queries' parts (amx_split_queries) */
    int G;              /* its query vectors (<= 16) */
    const int *lo, *lim; /* query i sees positions [lo[i], lim[i]) of the partition */
    vf *st;             /* PART vectors: a position's scores, then weights, queries in lanes */
    float *rows;        /* 16 rows of PART floats: the weights by query */
    uint16_t *wp;       /* their parts (amx_split_weights) */
    float *acc, *maxima, *sums; /* the partition's results: G rows of D, G maxima, G sums */
} AmxGroup;

/* st[p] (p < 16 nb16, query i in lane i) = (C0 + C1) * scale for ng (1 or 2) groups, the C tiles of
 * K rows p (kp) against each group's queries over the D / 32 dim tiles in order. Each block's C
 * tiles are stored to one of two buffers and combined while the tiles compute the next block. */
INLINE void amx_scores_combine(float c[2][2][16][16], int blk, float scale, AmxGroup *gr, int ng) {
    for (int g = 0; g < ng; ++g)
        for (int p = 0; p < 16; ++p) gr[g].st[blk * 16 + p] = (loadv(c[g][0][p]) + loadv(c[g][1][p])) * scale;
}

INLINE void amx_scores(AmxGroup *gr, int ng, const uint16_t *kp, int nb16, float scale, const int D) {
    const int DT = D / 32;
    float c[2][2][2][16][16] __attribute__((aligned(64)));
    for (int blk = 0; blk < nb16; ++blk) {
        TILE_ZERO(0);
        TILE_ZERO(1);
        if (ng > 1) {
            TILE_ZERO(2);
            TILE_ZERO(3);
        }
        for (int dt = 0; dt < DT; ++dt) {
            const uint16_t *k = kp + ((int64_t)blk * DT + dt) * 3 * TB;
            AMX_S_PARTS(k);
            AMX_PRODUCTS(DP_SA, 0, 1, gr[0].qp + dt * 3 * TB);
            if (ng > 1) AMX_PRODUCTS(DP_SA, 2, 3, gr[1].qp + dt * 3 * TB);
        }
        if (blk) amx_scores_combine(c[(blk - 1) & 1], blk - 1, scale, gr, ng);
        TILE_STORE(0, c[blk & 1][0][0], 64);
        TILE_STORE(1, c[blk & 1][0][1], 64);
        if (ng > 1) {
            TILE_STORE(2, c[blk & 1][1][0], 64);
            TILE_STORE(3, c[blk & 1][1][1], 64);
        }
    }
    if (nb16) amx_scores_combine(c[(nb16 - 1) & 1], nb16 - 1, scale, gr, ng);
}

/* acc[i * D + d] (i < G) = C0 + C1 for ng groups, the C tiles of each group's weights (wp) against
 * V's dim d (vp) over the nb32 blocks of 32 positions in order. */
INLINE void amx_weighted_v_combine(float c[2][2][16][16], int cb, AmxGroup *gr, int ng, const int D) {
    for (int g = 0; g < ng; ++g)
        for (int i = 0; i < gr[g].G; ++i) storev(gr[g].acc + i * D + cb * 16, loadv(c[g][0][i]) + loadv(c[g][1][i]));
}

INLINE void amx_weighted_v(AmxGroup *gr, int ng, const uint16_t *vp, int nb32, const int D) {
    const int DC = D / 16;
    float c[2][2][2][16][16] __attribute__((aligned(64)));
    for (int cb = 0; cb < DC; ++cb) {
        TILE_ZERO(0);
        TILE_ZERO(1);
        if (ng > 1) {
            TILE_ZERO(2);
            TILE_ZERO(3);
        }
        for (int blk = 0; blk < nb32; ++blk) {
            const uint16_t *v = vp + ((int64_t)blk * DC + cb) * 3 * TB;
            AMX_S_PARTS(v);
            AMX_PRODUCTS(DP_TA, 0, 1, gr[0].wp + blk * 3 * TB);
            if (ng > 1) AMX_PRODUCTS(DP_TA, 2, 3, gr[1].wp + blk * 3 * TB);
        }
        if (cb) amx_weighted_v_combine(c[(cb - 1) & 1], cb - 1, gr, ng, D);
        TILE_STORE(0, c[cb & 1][0][0], 64);
        TILE_STORE(1, c[cb & 1][0][1], 64);
        if (ng > 1) {
            TILE_STORE(2, c[cb & 1][1][0], 64);
            TILE_STORE(3, c[cb & 1][1][1], 64);
        }
    }
    amx_weighted_v_combine(c[(DC - 1) & 1], DC - 1, gr, ng, D);
}

/* The softmax of a group's partition with the queries in lanes (st[p]: position p's scores),
 * lane i seeing positions [lo[i], lim[i]) of [0, n): scores soft-capped (a layer with softcap),
 * then -inf where unseen; each lane's maximum m; numerators e = exp(s - m) where seen, exactly 0
 * elsewhere, in place; their sum in W partial sums (position p into the (p % W)-th, from 0), then
 * halved (softmax_numerators' tree). Lanes from G, and lanes that see nothing, give values no one
 * reads. One out-of-line function for decodes and chunks. */
static __attribute__((noinline)) void amx_lane_softmax(const Args *a, vf *st, int n, const int *lo, const int *lim,
                                                       int G, float *maxima, float *sums) {
    vi lov = {0}, limv = {0};
    for (int l = 0; l < G; ++l) lov[l] = lo[l], limv[l] = lim[l];
    const vf neg_inf = (vf){0} - INFINITY;
    if (a->softcap > 0)
        for (int p = 0; p < n; ++p)
            for (int l = 0; l < W; ++l) st[p][l] = soft_cap(st[p][l], a->softcap);
    /* the maxima in four running maxima (a maximum is exact: any order gives the same) */
    vf m4[4] = {neg_inf, neg_inf, neg_inf, neg_inf};
    for (int p0 = 0; p0 < n; p0 += 4)
        for (int r = 0; r < 4 && p0 + r < n; ++r) {
            const int p = p0 + r;
            const vi pv = (vi){0} + p;
            const vf x = select_v((pv >= lov) & (pv < limv), st[p], neg_inf);
            st[p] = x;
            m4[r] = select_v(x > m4[r], x, m4[r]);
        }
    vf m = m4[0];
    for (int r = 1; r < 4; ++r) m = select_v(m4[r] > m, m4[r], m);
    vf part[W];
    for (int l = 0; l < W; ++l) part[l] = (vf){0};
    for (int p0 = 0; p0 < n; p0 += W) /* W positions at a time: part's index a constant */
        for (int l = 0; l < W; ++l) {
            const int p = p0 + l;
            if (p >= n) break;
            const vi pv = (vi){0} + p;
            const vf y = select_v((pv >= lov) & (pv < limv), exp_np_v(st[p] - m), (vf){0});
            st[p] = y;
            part[l] += y;
        }
    for (int w = W / 2; w > 0; w /= 2)
        for (int l = 0; l < w; ++l) part[l] += part[l + w];
    for (int l = 0; l < G; ++l) maxima[l] = m[l], sums[l] = part[0][l];
}

/* One partition for ng (1 or 2) groups of G <= 16 query vectors of one KV head, decodes and
 * chunks alike: positions [0, n) from the partition's start (kp, vp: their K and V parts, zeros
 * where no query reads them), query i of a group seeing [lo[i], lim[i]) (lim[i] <= n; none where
 * lim[i] <= lo[i]). Scores in lanes (amx_scores), their softmax (amx_lane_softmax), the weights
 * transposed to rows and split (amx_split_weights), then the weighted V sums (amx_weighted_v): acc,
 * maxima, sums. A query's values depend on its query vector, its range and the positions it sees
 * (zero weights add exact zeros: the tile's chains start from +0 and a C tile's sum stays it), never
 * on the others of its group or on the other group. Out of line, one instance per head size. */
static __attribute__((noinline)) void amx_group_partition(const Args *a, AmxGroup *gr, int ng, int n,
                                                          const uint16_t *kp, const uint16_t *vp, const int D) {
    const int nb16 = (n + 15) / 16, nb32 = (n + 31) / 32;
    amx_scores(gr, ng, kp, nb16, a->scale, D);
    for (int g = 0; g < ng; ++g) {
        vf *st = gr[g].st;
        amx_lane_softmax(a, st, n, gr[g].lo, gr[g].lim, gr[g].G, gr[g].maxima, gr[g].sums);
        for (int p = n; p < nb32 * 32; ++p) st[p] = (vf){0};
        for (int b = 0; b < nb32 * 2; ++b) {
            vf r[16];
            for (int p = 0; p < 16; ++p) r[p] = st[b * 16 + p];
            transpose_w(r);
            for (int i = 0; i < gr[g].G; ++i) storev(gr[g].rows + i * PART + b * 16, r[i]);
        }
        amx_split_weights(gr[g].rows, PART, gr[g].G, nb32, gr[g].wp);
    }
    amx_weighted_v(gr, ng, vp, nb32, D);
}

static __attribute__((noinline)) void amx_group_partition_64(const Args *a, AmxGroup *gr, int ng, int n,
                                                             const uint16_t *kp, const uint16_t *vp) {
    amx_group_partition(a, gr, ng, n, kp, vp, 64);
}

static __attribute__((noinline)) void amx_group_partition_128(const Args *a, AmxGroup *gr, int ng, int n,
                                                              const uint16_t *kp, const uint16_t *vp) {
    amx_group_partition(a, gr, ng, n, kp, vp, 128);
}

/* The one instance for D (decodes and chunks call the same one: the same instructions). */
INLINE void amx_partition(const Args *a, AmxGroup *gr, int ng, int n, const uint16_t *kp, const uint16_t *vp,
                          const int D) {
    if (D == 64)
        amx_group_partition_64(a, gr, ng, n, kp, vp);
    else if (D == 128)
        amx_group_partition_128(a, gr, ng, n, kp, vp);
    else
        amx_group_partition(a, gr, ng, n, kp, vp, D);
}

/* The tile path's buffers, carved from a thread's scratch: a partition's K and V parts, a group's
 * weights' parts and scores, its partition sums; a chunk item's query parts and running outputs. */
typedef struct {
    uint16_t *kp, *vp, *wp, *qp;
    vf *st;
    float *scores, *acc, *maxima, *sums, *o, *m_run, *l_run;
    int *lims, *lows;
} AmxBufs;

INLINE size_t amx_align(size_t b) { return (b + 63) / 64 * 64; }

/* Bytes of the buffers for head size D and `vectors` query vectors of a chunk item (0: a decode). */
static size_t amx_carve(AmxBufs *bf, char *base, int D, int vectors) {
    const int DT = D / 32, DC = D / 16, groups = vectors ? (vectors + AG - 1) / AG : 1;
    size_t off = 0;
#define CARVE(field, type, count)                                           \
    do {                                                                    \
        if (base) bf->field = (type *)(base + off);                         \
        off += amx_align(sizeof(type) * (size_t)(count));                   \
    } while (0)
    CARVE(kp, uint16_t, (PART / 16) * DT * 3 * TB);
    CARVE(vp, uint16_t, (PART / 32) * DC * 3 * TB);
    CARVE(wp, uint16_t, 2 * (PART / 32) * 3 * TB);
    CARVE(qp, uint16_t, (size_t)groups * DT * 3 * TB);
    CARVE(st, vf, 2 * PART);
    CARVE(scores, float, 2 * AG * PART);
    CARVE(acc, float, 2 * AG * D);
    CARVE(maxima, float, 2 * AG);
    CARVE(sums, float, 2 * AG);
    CARVE(o, float, (size_t)vectors * D);
    CARVE(m_run, float, vectors);
    CARVE(l_run, float, vectors);
    CARVE(lims, int, vectors);
    CARVE(lows, int, vectors);
#undef CARVE
    return off;
}

/* A partition's K and V rows [from, to) (sequence positions) into kp and vp, the rest of
 * [P0, P0 + n) rounded up to the tiles zeros. */
INLINE void amx_split_partition(const Args *a, const Seq *sq, int h, int P0, int n, int from, int to,
                                uint16_t *kp, uint16_t *vp, int fetch, const int D) {
    const kv_t *krow[PART], *vrow[PART];
    const int64_t ps = (int64_t)a->num_kv_heads * D;
    const int nb16 = (n + 15) / 16, nb32 = (n + 31) / 32;
    for (int i = 0; i < nb32 * 32; ++i) krow[i] = vrow[i] = NULL;
    FOR_RUNS(a, from, to, {
        const kv_t *kb = block_at(a, a->k_cache, sq, blk, h, D) + off * ps;
        const kv_t *vb = block_at(a, a->v_cache, sq, blk, h, D) + off * ps;
        for (int i = 0; i < n; ++i) {
            krow[p + i - P0] = kb + i * ps;
            vrow[p + i - P0] = vb + i * ps;
        }
    });
    /* fetch: the rows of KV heads h .. h + fetch (whole rows of the cache, every head's: the others'
     * passes find them in L2), AHEAD rows ahead of the split (a block's rows are one run of memory,
     * the next block anywhere) */
#define AHEAD 64
    if (fetch)
        for (int i = 0; i < AHEAD && i < n; ++i)
            if (krow[i])
                for (int e = 0; e < fetch * D; e += 64 / (int)sizeof(kv_t)) {
                    __builtin_prefetch(krow[i] + e, 0, 2);
                    __builtin_prefetch(vrow[i] + e, 0, 2);
                }
    for (int i = 0; i < nb16 * 16; ++i) {
        if (fetch && i + AHEAD < n && krow[i + AHEAD])
            for (int e = 0; e < fetch * D; e += 64 / (int)sizeof(kv_t)) {
                __builtin_prefetch(krow[i + AHEAD] + e, 0, 2);
                __builtin_prefetch(vrow[i + AHEAD] + e, 0, 2);
            }
        amx_split_k_row(krow[i], kp, i, D);
    }
#undef AHEAD
    for (int i = 0; i < nb32 * 32; i += 2) amx_split_v_pair(vrow[i], vrow[i + 1], vp, i, D);
}

/* A split-K row's partition `part` on the tiles (query row `row` of sequence b, context its
 * position + 1: a decode's one row, or one of a few rows at depth): its rep query heads of KV head
 * h in groups of 16, the same partial as attend_rows_part (rep rows of D weighted V sums, rep
 * maxima, rep sums); nothing where the row's context ends before the partition or its window
 * starts after it. A few rows split each partition's K and V once per row (the path is off by
 * default; its bits are the decode's, as the fp32 path's are). */
static void attend_decode_part_amx(const Args *a, int b, int h, int row, int part, char *scratch, float *partial,
                                   int fetch, const int D) {
    const int rep = a->num_heads / a->num_kv_heads, bs = a->block_size;
    const Seq sq = seq_of(a, b);
    const int ctx = sq.ctx - sq.q_len + row + 1, lo = a->window > 0 && ctx > a->window ? ctx - a->window : 0;
    const int P0 = part * PART, P1 = P0 + PART < ctx ? P0 + PART : ctx;
    if (P1 <= lo || P0 >= ctx) return;
    AmxBufs bf;
    amx_carve(&bf, scratch, D, 0);
    const int r0 = P0 > lo / bs * bs ? P0 : lo / bs * bs, n = P1 - P0;
    amx_split_partition(a, &sq, h, P0, n, r0, P1, bf.kp, bf.vp, fetch, D);
    int los[AG], lims[AG];
    for (int i = 0; i < AG; ++i) los[i] = lo > P0 ? lo - P0 : 0, lims[i] = n;
    float *maxima = partial + (int64_t)rep * D, *sums = maxima + rep;
    for (int g0 = 0; g0 < rep; g0 += AG) {
        const int G = rep - g0 < AG ? rep - g0 : AG;
        const float *qv[AG];
        for (int i = 0; i < G; ++i) qv[i] = query_at(a, &sq, row, h * rep + g0 + i);
        amx_split_queries(qv, G, bf.qp, D);
        AmxGroup gr = {bf.qp, G, los, lims, bf.st, bf.scores, bf.wp, partial + (int64_t)g0 * D, maxima + g0, sums + g0};
        amx_partition(a, &gr, 1, n, bf.kp, bf.vp, D);
    }
}

/* A chunk's work item on the tiles: query vectors v0 .. (rows times heads, in order; up to tg *
 * TILE of them) in groups of 16, partition by partition from the first one any of them sees (each
 * partition's K and V split once for all the groups), each vector's partition results merged in
 * order by merge_partition (the decode's function, o with stride 1), then divided by the sum. */
static void attend_chunk_amx(const Args *a, int b, int h, int v0, int tg, char *scratch, const int D) {
    const int rep = a->num_heads / a->num_kv_heads, bs = a->block_size;
    const Seq sq = seq_of(a, b);
    const int left = sq.q_len * rep - v0, nvec = left < tg * TILE ? left : tg * TILE;
    const int groups = (nvec + AG - 1) / AG, DT = D / 32;
    AmxBufs bf;
    amx_carve(&bf, scratch, D, nvec);
    for (int u = 0; u < nvec; ++u) {
        const int row = (v0 + u) / rep, lim = sq.ctx - sq.q_len + row + 1;
        bf.lims[u] = lim;
        bf.lows[u] = a->window > 0 && lim > a->window ? lim - a->window : 0;
        bf.m_run[u] = -FLT_MAX, bf.l_run[u] = 0.0f;
        for (int d = 0; d < D; ++d) bf.o[(int64_t)u * D + d] = 0.0f;
    }
    for (int g = 0; g < groups; ++g) {
        const int G = nvec - g * AG < AG ? nvec - g * AG : AG;
        const float *qv[AG];
        for (int i = 0; i < G; ++i) {
            const int u = v0 + g * AG + i;
            qv[i] = query_at(a, &sq, u / rep, h * rep + u % rep);
        }
        amx_split_queries(qv, G, bf.qp + (int64_t)g * DT * 3 * TB, D);
    }
    /* rows rise, and their windows with them: the first vector sees the earliest position (blocks
     * wholly before it are never read), the last the latest */
    const int first = bf.lows[0] / bs * bs, longest = bf.lims[nvec - 1];
    for (int P0 = first / PART * PART; P0 < longest; P0 += PART) {
        const int n = longest - P0 < PART ? longest - P0 : PART;
        amx_split_partition(a, &sq, h, P0, n, P0 > first ? P0 : first, P0 + n, bf.kp, bf.vp, 0, D);
        /* the groups that see a position of the partition, two at a time */
        AmxGroup gr[2];
        int los[2][AG], lims[2][AG], ng = 0, gn = 0, gs[2];
        for (int g = 0; g < groups; ++g) {
            const int G = nvec - g * AG < AG ? nvec - g * AG : AG;
            int any = 0;
            for (int i = 0; i < G; ++i) {
                const int u = g * AG + i;
                const int lim = bf.lims[u] - P0 < n ? bf.lims[u] - P0 : n;
                los[ng][i] = bf.lows[u] > P0 ? bf.lows[u] - P0 : 0;
                lims[ng][i] = lim > 0 ? lim : 0;
                gn = lims[ng][i] > gn ? lims[ng][i] : gn;
                any |= lims[ng][i] > los[ng][i];
            }
            if (any) {
                gr[ng] = (AmxGroup){bf.qp + (int64_t)g * DT * 3 * TB, G, los[ng], lims[ng], bf.st + ng * PART,
                                    bf.scores + ng * AG * PART, bf.wp + ng * (PART / 32) * 3 * TB,
                                    bf.acc + ng * AG * D, bf.maxima + ng * AG, bf.sums + ng * AG};
                gs[ng++] = g;
            }
            if (ng == 2 || (ng && g == groups - 1)) {
                amx_partition(a, gr, ng, gn, bf.kp, bf.vp, D);
                for (int x = 0; x < ng; ++x)
                    for (int i = 0; i < gr[x].G; ++i) {
                        const int u = gs[x] * AG + i;
                        if (lims[x][i] > los[x][i])
                            merge_partition(bf.o + (int64_t)u * D, 1, &bf.m_run[u], &bf.l_run[u],
                                            gr[x].acc + (int64_t)i * D, 1, gr[x].maxima[i], gr[x].sums[i], D);
                    }
                ng = 0, gn = 0;
            }
        }
    }
    for (int u = 0; u < nvec; ++u) {
        const int w = v0 + u, row = w / rep, head = h * rep + w % rep;
        float *out = a->out + ((int64_t)(sq.start + row) * a->num_heads + head) * D;
        for (int d = 0; d < D; ++d) out[d] = bf.o[(int64_t)u * D + d] / bf.l_run[u];
    }
}

/* Debug entries (tests): the tile path's scores and weighted V sums alone, to hold them bit-equal
 * to a numpy statement of the tile order (kernels/cpu/native_attention.py). q: G x D, k: n x D,
 * out: G x n; w: G x n, v: n x D, out: G x D (G <= 16, n <= 256, D a multiple of 32 up to 256).
 * Return -1 where the tiles are not granted or the shapes do not fit. */
static char *amx_debug_buffer(int D) {
    static char *buf;
    if (!buf) buf = aligned_alloc(64, amx_carve(&(AmxBufs){0}, NULL, 256, 0));
    (void)D;
    return buf;
}

#ifndef KV_BF16 /* the fp32 build's (its K and V are fp32) */
int32_t llmserve_attention_amx_scores(const float *q, int32_t G, const float *k, int32_t n, int32_t D, float scale,
                                      float *out) {
    if (!attn_amx_on() || G < 1 || G > AG || n < 1 || n > PART || D % 32 || D > 256) return -1;
    AmxBufs bf;
    char *buf = amx_debug_buffer(D);
    if (!buf) return -2;
    amx_carve(&bf, buf, D, 0);
    for (int i = 0; i < (n + 15) / 16 * 16; ++i) amx_split_k_row(i < n ? k + (int64_t)i * D : NULL, bf.kp, i, D);
    const float *qv[AG];
    for (int i = 0; i < G; ++i) qv[i] = q + (int64_t)i * D;
    amx_split_queries(qv, G, bf.qp, D);
    AmxGroup gr = {.qp = bf.qp, .G = G, .st = bf.st};
    attn_tiles_configure();
    amx_scores(&gr, 1, bf.kp, (n + 15) / 16, scale, D);
    TILE_RELEASE();
    for (int i = 0; i < G; ++i)
        for (int p = 0; p < n; ++p) out[(int64_t)i * n + p] = bf.st[p][i];
    return 0;
}

int32_t llmserve_attention_amx_weighted_v(const float *w, int32_t G, const float *v, int32_t n, int32_t D,
                                          float *out) {
    if (!attn_amx_on() || G < 1 || G > AG || n < 1 || n > PART || D % 32 || D > 256) return -1;
    AmxBufs bf;
    char *buf = amx_debug_buffer(D);
    if (!buf) return -2;
    amx_carve(&bf, buf, D, 0);
    const int nb32 = (n + 31) / 32;
    for (int i = 0; i < nb32 * 32; i += 2)
        amx_split_v_pair(i < n ? v + (int64_t)i * D : NULL, i + 1 < n ? v + (int64_t)(i + 1) * D : NULL, bf.vp, i, D);
    for (int i = 0; i < AG; ++i)
        for (int p = 0; p < nb32 * 32; ++p) bf.scores[i * PART + p] = i < G && p < n ? w[(int64_t)i * n + p] : 0.0f;
    amx_split_weights(bf.scores, PART, G, nb32, bf.wp);
    AmxGroup gr = {.G = G, .wp = bf.wp, .acc = bf.acc};
    attn_tiles_configure();
    amx_weighted_v(&gr, 1, bf.vp, nb32, D);
    TILE_RELEASE();
    memcpy(out, bf.acc, sizeof(float) * (size_t)G * D);
    return 0;
}
#endif /* KV_BF16 */
#endif

/* Debug entry (tests): out[i] = the softmax's e^x[i] (exp_np_v, W lanes at a time; the tail through
 * exp_np, one value at a time: the same bits), x[i] <= 0. */
void llmserve_attention_exp(const float *x, int64_t n, float *out) {
    int64_t i = 0;
    for (; i + W <= n; i += W) storev(out + i, exp_np_v(loadv(x + i)));
    for (; i < n; ++i) out[i] = exp_np(x[i]);
}

/* on: 1 run attention on the tiles where granted (head sizes a multiple of 32), 0 never, -1 leave.
 * Returns whether they run now. 0 on a build without the tile path. */
int32_t llmserve_paged_attention_amx(int32_t on) {
#ifdef AMX_PATH
    if (on == 0) attn_amx_use = 0;
    if (on == 1) attn_amx_use = 1;
    return attn_amx_on();
#else
    (void)on;
    return 0;
#endif
}

/* The step's work list: items (sequence, KV head, first query vector of a chunk's group of tiles
 * or a decode's partition, the decode's first partial slot or minus the chunk's tiles per item; a decode's item is its partition for every
 * KV head, head -1, head k's slot k * partitions after head 0's), four int32 each, in a fixed order; the
 * decodes (sequence, KV head, first slot), three each, whose partitions are merged after them; the
 * slots in all and the longest context. Every layer of a step passes the same metadata, so the
 * list is built for the first layer's call and reused by the others: it is kept per thread with a
 * copy of the metadata it was built from (query_start_loc and seq_lens, compared by content: a new
 * step's arrays may sit at the old addresses), in buffers reused across steps and grown when a
 * step needs more. The calling thread's: two threads calling at once never share one. A decode
 * has a partition item for every partition of its context, from position 0 (a sliding window's
 * layer skips those before its window: the list is the same for every layer). */
typedef struct {
    int32_t *items, *meta, *merges;
    int64_t items_cap, meta_cap, merges_cap, num_items, num_merges, num_slots, builds;
    int32_t num_seqs, num_heads, num_kv_heads, longest, threads, split_rows;
} WorkList;

/* Whether a sequence's q_len rows after ctx - q_len positions run split-K (a decode's work items,
 * all rows in each: FEW_ROWS rows at most, from FEW_ROWS_DEPTH positions of context on) rather than
 * as a chunk's tiles. The same bits either way (a chunk's row equals the decode of its position);
 * the choice is speed only. Split-K reads each partition's K/V once for all rows and computes only
 * real query vectors, at a cost that grows with the rows; the tiles cost by the lanes they fill
 * (TILE per tile, idle lanes included). Measured (Qwen2.5-0.5B's 7 query heads per KV head, 7.2k
 * of context, two threads, AVX-512: TILE 32): split-K 1.53x the tiles at 2 rows (14 of 32 lanes
 * used), 1.17x at 3 (21/32), 1.22x at 5 (35/64), 1.12x at 6 (42/64); 0.93x at 4 (28/32), 0.98x at
 * 7 (49/64), 0.89x at 8 (56/64), 0.79x at 9 (63/64), 0.82x at 16 (112/128): so split-K where the
 * tiles would leave more than a quarter of their lanes idle. */
#define FEW_ROWS 16
#define FEW_ROWS_DEPTH (2 * PART)
INLINE int split_k_rows(int q_len, int ctx, int rep) {
    const int lanes = (q_len * rep + TILE - 1) / TILE * TILE;
    return q_len == 1 || (q_len > 1 && q_len <= FEW_ROWS && ctx >= FEW_ROWS_DEPTH && 4 * q_len * rep <= 3 * lanes);
}

static _Thread_local WorkList work_list = {.num_seqs = -1};

/* Grows *buf to hold n elements of `size` bytes; 0 when memory ran out. */
static int grow(void **buf, int64_t *cap, int64_t n, size_t size) {
    if (n <= *cap) return 1;
    const int64_t c = n > 2 * *cap ? n : 2 * *cap;
    void *grown = realloc(*buf, size * (size_t)c);
    if (!grown) return 0;
    *buf = grown;
    *cap = c;
    return 1;
}

/* This thread's work list for the metadata, built if it differs from the last call's; NULL when
 * memory ran out. */
static const WorkList *work_list_for(const int32_t *seq_lens, const int32_t *query_start_loc,
                                     int32_t num_seqs, int32_t num_heads, int32_t num_kv_heads, int32_t threads) {
    WorkList *w = &work_list;
    const int64_t meta_n = 2 * (int64_t)num_seqs + 1;
    if (w->num_seqs == num_seqs && w->num_heads == num_heads && w->num_kv_heads == num_kv_heads && w->threads == threads &&
        !memcmp(w->meta, query_start_loc, sizeof(int32_t) * ((size_t)num_seqs + 1)) &&
        !memcmp(w->meta + num_seqs + 1, seq_lens, sizeof(int32_t) * (size_t)num_seqs))
        return w;
    const int rep = num_heads / num_kv_heads;
    int64_t num_items = 0, num_merges = 0;
    int32_t longest = 1;
    /* tiles per chunk item: TG, halved while the chunks would have fewer than 4 items a thread */
    int tg = TG;
    for (;; tg /= 2) {
        int64_t chunk_items = 0;
        for (int b = 0; b < num_seqs; ++b) {
            const int q_len = query_start_loc[b + 1] - query_start_loc[b];
            if (!split_k_rows(q_len, seq_lens[b], rep) && q_len > 1) chunk_items += (int64_t)num_kv_heads * ((q_len * rep + tg * TILE - 1) / (tg * TILE));
        }
        if (tg <= TG_MIN || chunk_items >= 4 * (int64_t)(threads > 1 ? threads : 1)) break;
    }
    int32_t split_rows = 0;
    for (int b = 0; b < num_seqs; ++b) {
        const int q_len = query_start_loc[b + 1] - query_start_loc[b];
        const int split = split_k_rows(q_len, seq_lens[b], rep);
        /* split-K (a decode, a few rows at depth): an item per partition, for all its KV heads and
         * rows; a chunk: per KV head and group of tiles */
        num_items += q_len == 0 ? 0 : split ? (seq_lens[b] + PART - 1) / PART
                                            : (int64_t)num_kv_heads * ((q_len * rep + tg * TILE - 1) / (tg * TILE));
        num_merges += split ? (int64_t)num_kv_heads * q_len : 0;
        if (split && q_len > split_rows) split_rows = q_len;
        longest = seq_lens[b] > longest ? seq_lens[b] : longest;
    }
    w->num_seqs = -1; /* not valid until built */
    if (!grow((void **)&w->items, &w->items_cap, 4 * num_items, sizeof(int32_t)) ||
        !grow((void **)&w->merges, &w->merges_cap, 4 * num_merges, sizeof(int32_t)) ||
        !grow((void **)&w->meta, &w->meta_cap, meta_n, sizeof(int32_t)))
        return NULL;
    int64_t n = 0, nm = 0, slot = 0;
    for (int b = 0; b < num_seqs; ++b) {
        const int q_len = query_start_loc[b + 1] - query_start_loc[b];
        const int split = split_k_rows(q_len, seq_lens[b], rep);
        if (split) { /* row r's KV head k's slots: (r * KV heads + k) * parts after the first */
            const int parts = (seq_lens[b] + PART - 1) / PART;
            for (int part = 0; part < parts; ++part) {
                int32_t *it = w->items + 4 * n++;
                it[0] = b, it[1] = -1, it[2] = part, it[3] = (int32_t)slot;
            }
            for (int r = 0; r < q_len; ++r)
                for (int h = 0; h < num_kv_heads; ++h) {
                    int32_t *mg = w->merges + 4 * nm++;
                    mg[0] = b, mg[1] = h, mg[2] = (int32_t)slot, mg[3] = r;
                    slot += parts;
                }
            continue;
        }
        for (int h = 0; h < num_kv_heads; ++h)
            for (int v0 = 0; v0 < q_len * rep; v0 += tg * TILE) {
                int32_t *it = w->items + 4 * n++;
                it[0] = b, it[1] = h, it[2] = v0, it[3] = -tg;
            }
    }
    memcpy(w->meta, query_start_loc, sizeof(int32_t) * ((size_t)num_seqs + 1));
    memcpy(w->meta + num_seqs + 1, seq_lens, sizeof(int32_t) * (size_t)num_seqs);
    w->num_items = num_items;
    w->num_merges = num_merges;
    w->num_slots = slot;
    w->longest = longest;
    w->builds += 1;
    w->num_heads = num_heads;
    w->num_kv_heads = num_kv_heads;
    w->threads = threads;
    w->split_rows = split_rows;
    w->num_seqs = num_seqs;
    return w;
}

/* How many times this thread built a work list (tests count them). */
int64_t llmserve_paged_attention_work_list_builds(void) { return work_list.builds; }

/* The most query rows of one sequence that this thread's last work list runs split-K (1: decodes
 * only; 0: none): tests see which route a few rows took (the bits are the same on both). */
int32_t llmserve_paged_attention_split_rows(void) { return work_list.split_rows; }

/* A thread's scratch buffer, kept and grown, never freed (an allocation per item cost more than
 * the item on short contexts). */
static float *thread_scores(size_t bytes) {
    static __thread float *buf;
    static __thread size_t cap;
    if (!buf || bytes > cap) {
        free(buf);
        buf = aligned_alloc(64, (bytes + 127) / 64 * 64);
        cap = buf ? bytes : 0;
    }
    return buf;
}

/* The calling thread's buffer of decode partitions' results (slots of rep * (D + 2) floats). */
static float *decode_partials(size_t bytes) {
    static _Thread_local float *buf;
    static _Thread_local size_t cap;
    if (!buf || bytes > cap) {
        free(buf);
        buf = malloc(bytes > 2 * cap ? bytes : 2 * cap);
        cap = buf ? (bytes > 2 * cap ? bytes : 2 * cap) : 0;
    }
    return buf;
}

typedef struct {
    const Args *a;
    const int32_t *items, *merges, *query_start_loc;
    int64_t num_items;
    float *partials;
    int32_t head_dim;
    size_t scratch;
    int amx; /* the tile path (AMX_PATH builds where granted) */
    _Atomic int failed;
} attention_job;

static void attention_items_run(attention_job *j, int64_t begin, int64_t end);

static void attention_items(void *ctx, int64_t begin, int64_t end) {
    FLUSH_DENORMALS_BEGIN
    attention_items_run(ctx, begin, end);
    FLUSH_DENORMALS_END
}

static void attention_items_run(attention_job *j, int64_t begin, int64_t end) {
    float *scratch = thread_scores(j->scratch);
    if (!scratch) {
        atomic_store(&j->failed, 1);
        return;
    }
    const Args *a = j->a;
    const int64_t per = (int64_t)(a->num_heads / a->num_kv_heads) * (j->head_dim + 2);
#ifdef AMX_PATH
    if (j->amx) {
        attn_tiles_configure();
        for (int64_t i = begin; i < end; ++i) {
            const int32_t *it = j->items + 4 * i;
            const int b = it[0], h = it[1], v0 = it[2];
            if (it[3] >= 0) {
                const int64_t parts = (a->seq_lens[b] + PART - 1) / PART;
                const int R = a->query_start_loc[b + 1] - a->query_start_loc[b];
                for (int r = 0; r < R; ++r)
                    for (int kh = 0; kh < a->num_kv_heads; ++kh) {
                        float *partial = j->partials + (it[3] + (r * a->num_kv_heads + kh) * parts + v0) * per;
                        const int fetch = kh == 0 && r == 0 ? a->num_kv_heads : 0;
                        switch (j->head_dim) {
                        case 64: attend_decode_part_amx(a, b, kh, r, v0, (char *)scratch, partial, fetch, 64); break;
                        case 128: attend_decode_part_amx(a, b, kh, r, v0, (char *)scratch, partial, fetch, 128); break;
                        default: attend_decode_part_amx(a, b, kh, r, v0, (char *)scratch, partial, fetch, j->head_dim);
                        }
                    }
            } else
                switch (j->head_dim) {
                case 64: attend_chunk_amx(a, b, h, v0, -it[3], (char *)scratch, 64); break;
                case 128: attend_chunk_amx(a, b, h, v0, -it[3], (char *)scratch, 128); break;
                default: attend_chunk_amx(a, b, h, v0, -it[3], (char *)scratch, j->head_dim);
                }
        }
        TILE_RELEASE();
        return;
    }
#endif
    for (int64_t i = begin; i < end; ++i) {
        const int32_t *it = j->items + 4 * i;
        const int b = it[0], h = it[1], v0 = it[2];
        if (it[3] >= 0) { /* a split-K partition v0 (a decode's, or a few rows'), every KV head in turn */
            const int64_t parts = (a->seq_lens[b] + PART - 1) / PART;
            const int R = a->query_start_loc[b + 1] - a->query_start_loc[b];
            const int64_t pstride = (int64_t)a->num_kv_heads * parts * per; /* row r's slots follow row 0's */
            float *partial = j->partials + (it[3] + v0) * per; /* KV head k's slots follow head 0's */
            /* the item `ahead` claims on, where it is split-K too (a chunk's tiles ask for nothing) */
            const int32_t *nx = i + a->ahead < j->num_items ? j->items + 4 * (i + a->ahead) : NULL;
            const int nb = nx && nx[3] >= 0 ? nx[0] : -1, np = nb >= 0 ? nx[2] : 0;
            switch (SPECIALIZED ? j->head_dim : 0) {
            case 64: attend_rows_part(a, b, v0, R, scratch, partial, parts * per, pstride, nb, np, 64); break;
            case 128: attend_rows_part(a, b, v0, R, scratch, partial, parts * per, pstride, nb, np, 128); break;
            default: attend_rows_part(a, b, v0, R, scratch, partial, parts * per, pstride, nb, np, j->head_dim);
            }
        } else { /* a chunk: tiles of TILE vectors in the lanes */
            vf *st = (vf *)scratch;
            if (a->softcap > 0) /* soft-capped scores: its own instance, the plain one untouched */
                attend_tile(a, b, h, v0, -it[3], st, j->head_dim, 1);
            else
                switch (SPECIALIZED ? j->head_dim : 0) {
                case 64: attend_tile(a, b, h, v0, -it[3], st, 64, 0); break;
                case 128: attend_tile(a, b, h, v0, -it[3], st, 128, 0); break;
                default: attend_tile(a, b, h, v0, -it[3], st, j->head_dim, 0);
                }
        }
    }
}

static void merge_items(void *ctx, int64_t begin, int64_t end) {
    FLUSH_DENORMALS_BEGIN
    attention_job *j = ctx;
    const int64_t per = (int64_t)(j->a->num_heads / j->a->num_kv_heads) * (j->head_dim + 2);
    for (int64_t i = begin; i < end; ++i) {
        const int32_t *mg = j->merges + 4 * i;
        merge_decode(j->a, mg[0], mg[1], mg[3], j->partials + mg[2] * per, j->head_dim);
    }
    FLUSH_DENORMALS_END
}

/* Attention for every sequence of the batch (one with no queries this step has no work).
 * head_dim must be a multiple of W. Returns 0, -1 for a shape this library does not take, or -2
 * when memory ran out. */
int llmserve_paged_attention_f32(const float *q, int64_t q_stride_token, int64_t q_stride_head,
                                 const kv_t *k_cache, const kv_t *v_cache,
                                 const int32_t *block_tables, int64_t block_table_stride,
                                 const int32_t *seq_lens, const int32_t *query_start_loc,
                                 int32_t num_seqs, int32_t num_heads, int32_t num_kv_heads,
                                 int32_t head_dim, int32_t block_size, float scale, float *out,
                                 int32_t num_threads, int32_t window, float softcap) {
    if (head_dim % W || num_kv_heads < 1 || num_heads % num_kv_heads || window < 0 || !(softcap >= 0))
        return -1;
#ifdef BF16_DOT
    if (block_size % 2 || head_dim % 2) return -1; /* positions and dims go in pairs */
#endif
    const Args a = {q, q_stride_token, q_stride_head, k_cache, v_cache, block_tables,
                    block_table_stride, seq_lens, query_start_loc, num_heads, num_kv_heads,
                    block_size, scale, window, softcap, out,
                    ahead_partitions(num_kv_heads, head_dim, num_threads)};
    const int rep = num_heads / num_kv_heads;
    const WorkList *w = work_list_for(seq_lens, query_start_loc, num_seqs, num_heads, num_kv_heads, num_threads);
    if (!w) return -2;
    const size_t per = sizeof(float) * (size_t)rep * (size_t)(head_dim + 2);
    float *partials = w->num_slots ? decode_partials(per * (size_t)w->num_slots) : NULL;
    if (w->num_slots && !partials) return -2;
    /* a decode's scores and transposed K rows; a chunk's scores, sums, queries, outputs and K rows */
    const size_t rows = w->split_rows > 1 ? (size_t)w->split_rows : 1;
    const size_t decode_floats = rows * num_heads * PART + 2 * (size_t)head_dim * W + rows * num_heads * head_dim;
    const size_t chunk_floats = (size_t)TILE * PART + (1 + 2 * (size_t)TG) * (size_t)head_dim * TILE +
                                (size_t)(2 * PART + QP) * (size_t)head_dim;
    size_t bytes = sizeof(float) * (decode_floats > chunk_floats ? decode_floats : chunk_floats);
    int amx = 0;
#ifdef AMX_PATH
    if (head_dim % 32 == 0 && attn_amx_on()) {
        amx = 1;
        bytes = amx_carve(&(AmxBufs){0}, NULL, head_dim, TG * TILE);
    }
#endif
    attention_job j = {&a, w->items, w->merges, query_start_loc, w->num_items, partials, head_dim, bytes, amx, 0};
    parallel_for(num_threads, 1, w->num_items, 1, attention_items, &j);
    if (atomic_load(&j.failed)) return -2;
    parallel_for(num_threads, 1, w->num_merges, 1, merge_items, &j);
    return 0;
}
