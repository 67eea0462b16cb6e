/* y = x . W^T (+ bias) with W in quantized blocks and x quantized per call to int8: integer block
 * dot products (vpdpbusd where the CPU has AVX-512 VNNI or AVX-VNNI, else maddubs), as llama.cpp does. The
 * weight forms are quant_gemm.c's (Q8_0, Q4_0, Q4_1, the U8_1 form of Q5_K and the I8_16 form of Q6_K:
 * int8 quants -32..31 with a scale per 16 weights; Q4_K runs as Q4_1), Q5_0 / Q5_1 as nibbles plus
 * a fifth-bit plane, and the K forms (FMT_K, below): Q3_K..Q6_K served from their super-blocks with
 * the math of those expanded forms.
 *
 * Activations: each row of x, per block b of 32 k steps (all fp32, IEEE-rounded, every ISA alike):
 *
 *   dx[b] = max|x| / 127      q = rint(x * (1 / dx))   (ties to even, within -127..127; all 0
 *                                                       where dx is below the smallest normal)
 *   sx[b] = sum of the block's q (an integer)                   dxs[b] = dx * sx
 *
 * An output is then, over the blocks in order from 0.0f (each step rounded on its own, no fused
 * multiply-add anywhere), with isum = sum of q_w * q_x over the block, exact in int32:
 *
 *   Q8_0, Q4_0:  acc += (dw * dx) * isum                 (Q4_0: isum of (q_w - 8) * q_x)
 *   Q4_1, U8_1:  acc += (dw * dx) * isum + mw * dxs
 *   I8_16:       acc += (dw0 * dx) * isum0 + (dw1 * dx) * isum1
 *
 * where I8_16's isum0, isum1 are the sums over the block's first and second 16 k steps and dw0, dw1
 * their scales (a 32-step block of activations meets two weight sub-blocks);
 * and y = acc + bias. Integer sums are exact in any order, and every ISA path does the same float
 * operations in the same order, so a row's result is bit-equal alone, in any batch, at any thread
 * count and across the avx512 and avx2 builds (VNNI or not) and the generic one.
 *
 * Weights are packed at load, the same bytes for every ISA: panels of NC = 32 output columns; per
 * block the panel's scales dw[32] (fp32, or fp16 where every one is an fp16 value, as a GGUF file's
 * Q8_0 / Q4_0 / Q4_1 scales are: 12-17% fewer bytes to stream), minimums mw[32] where the format
 * has them, then the quants
 * in 4-byte k groups, a group's 32 columns side by side (an int32 lane of a vector is one column's
 * 4 k steps, as vpdpbusd wants them):
 *
 *   byte forms (Q8_0, U8_1, I8_16): [group g 0..7][column][4]     Q8_0 stored as q + 128 (unsigned),
 *                                                                 I8_16 as q + 32 (0..63)
 *   nibble forms (Q4_0, Q4_1): [g 0..3][column][4], group g in the low nibbles, g + 4 in the high
 *
 * vpdpbusd multiplies unsigned by signed bytes: the stored weight (0..255) by q_x (-127..127); the
 * offset (128 for Q8_0, 8 for Q4_0) comes back out as offset * sx (I8_16: 32 times each half's sum of
 * q_x, made once per call). I8_16's two scale rows sit where the minimums do. maddubs (AVX2, AVX-512 without
 * VNNI) adds two such products in int16 with saturation, so Q8_0 there takes the signed weight's
 * magnitude times q_x with its sign (at most 2 * 128 * 127, no saturation), the same integer.
 *
 * Built per instruction set by native_build.py; OpenMP threads are torch's. */

#define _DEFAULT_SOURCE /* syscall (amx.h) under -std=c11 */
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include "glu.h"
#include "parallel.h"
#include "row_segments.h"

#define INLINE static inline __attribute__((always_inline))
#define QK 32
#define NC 32
#ifndef MC
#define MC 256 /* rows per work item: an item is (rows, panel) */
#endif
/* Software prefetch of the weight: PREFETCH_BLOCKS blocks ahead (Q4_K 4 KB, Q5_0 5.5 KB) into the
 * L2 (locality 2: prefetcht1) and PREFETCH_NEAR blocks ahead into the L1 (prefetcht0). On the AVX-512
 * Xeon a batch-1 GEMV streamed from memory ran 1.02-1.26x the L1 prefetch 4 blocks ahead alone
 * (docs/performance.md). */
#ifndef PREFETCH_BLOCKS
#define PREFETCH_BLOCKS 8
#endif
#ifndef PREFETCH_LOCALITY
#define PREFETCH_LOCALITY 2
#endif
#ifndef PREFETCH_NEAR
#define PREFETCH_NEAR 4
#endif
/* MRK: the nibble K forms' rows a pass (rows_k, one vector of the panel at a time). */
#ifndef MRK
#define MRK 4
#endif
#if defined(__AVX512F__)
#define MR 4 /* 4 rows x 2 vectors of int32 sums and of fp32 sums: 16 of the 32 registers */
/* MRW: the rows of a pass over one vector of the panel at a time (rows_wide, VNNI, calls of 16 rows
 * or more): the panel's unpacked quants and scales serve twice the rows. MRW2: the same for the
 * forms with two int32 sums a row (I8_16, Q6_K, Q3_K, Q2_K). */
#ifndef MRW
#define MRW 8
#endif
#ifndef MRW2
#define MRW2 6
#endif
#define RMAX (MRW > MRW2 ? (MRW > MR ? MRW : MR) : (MRW2 > MR ? MRW2 : MR))
#elif defined(__AVX2__)
#define MR 2
#define RMAX MR
#else
#define MR 4
#define RMAX MR
#endif

/* A format code is the weight form, + FMT_HALF where its scales (and minimums) are fp16 values
 * (a GGUF file's Q8_0 / Q4_0 / Q4_1 blocks): stored as fp16, read back exactly, fewer bytes to stream. */
enum { FMT_Q8_0 = 0, FMT_Q4_0 = 1, FMT_Q4_1 = 2, FMT_U8_1 = 3, FMT_I8_16 = 4, FMT_Q5_0 = 5, FMT_Q5_1 = 6,
       FMT_Q2 = 7, FMT_HALF = 8, FMT_K = 16, FMT_COUNT = 32 };
/* The K-quants served from their super-blocks (FMT_K + the form whose math they share):
 *   Q4_K = FMT_K | FMT_Q4_1   Q5_K = FMT_K | FMT_Q5_1   Q6_K = FMT_K | FMT_I8_16
 *   Q3_K = FMT_K | FMT_HALF | FMT_I8_16 (I8_16's math with quants -4..3 stored + 4, offset 4)
 *   Q2_K = FMT_K | FMT_Q2     (quants 0..3, a scale and a minimum per 16 k steps; the math below)
 *   IQ4_XS = FMT_K | FMT_Q8_0 (Q8_0's math: the quant is IQ4_NL's table value, a scale per 32)
 * Per panel and super-block of 256 k steps (8 blocks of 32): a header, then the 8 blocks' quants,
 *   Q4_K, Q5_K: d[NC], dmin[NC] (fp16), sc[8][NC], mn[8][NC] (the 6-bit integers, a byte each)
 *   Q6_K:       d[NC] (fp16), sc[16][NC] (int8)
 *   Q2_K:       d[NC], dmin[NC] (fp16), sm[16][NC] (the file's byte: scale | min << 4, 4 bits each)
 *   IQ4_XS:     d[NC] (fp16), sc[8][NC] (int8: the file's 6-bit scale - 32)
 * and each block's quants as the nibble forms hold theirs (Q5_K: + the fifth-bit plane; Q6_K: the
 * quant + 32, 0..63, as nibbles + a fifth-bit and a sixth-bit plane; IQ4_XS: the table index, the
 * kernel looks the value up). Q2_K's are 2-bit crumbs, 8 bytes a column and block: [slot s 0..1]
 * [column][4], slot s holding groups s, s + 2, s + 4, s + 6 at bits 0-1, 2-3, 4-5, 6-7 (the file's
 * 0.33 bytes a weight, headers included). Block j's scales are made in
 * the kernel: dw = d * sc[j], mw = -(dmin * mn[j]) (Q6_K: dw0, dw1 = d * sc[2j], d * sc[2j + 1];
 * Q2_K: dw_h = d * (sm[2j + h] & 15), mw_h = -(dmin * (sm[2j + h] >> 4)); IQ4_XS: dw = d * sc[j]),
 * fp32 products of an fp16 value and an integer below 256: exact, so they are the gguf package's
 * fp32 scales bit for bit and the math is the expanded forms' (Q4_1, Q5_1, I8_16, Q8_0) unchanged.
 *
 * Q2_K's block term, a scale and a minimum per half h of the block (sh_h: the half's sum of q_x):
 *   t_h = (dw_h * dx) * isum_h + mw_h * (dx * sh_h)      acc += t_0 + t_1 */
#define KB 8 /* blocks of QK a super-block */

INLINE int form(int fmt) { return fmt & 7; }
INLINE int is_k(int fmt) { return (fmt & FMT_K) != 0; }
INLINE int known(int fmt) {
    if (fmt < 0 || fmt >= FMT_COUNT) return 0;
    if (is_k(fmt))
        return fmt == (FMT_K | FMT_Q4_1) || fmt == (FMT_K | FMT_Q5_1) || fmt == (FMT_K | FMT_I8_16) ||
               fmt == (FMT_K | FMT_HALF | FMT_I8_16) || fmt == (FMT_K | FMT_Q2) || fmt == (FMT_K | FMT_Q8_0);
    return form(fmt) <= FMT_Q5_1;
}
INLINE int half_scales(int fmt) { return (fmt & FMT_HALF) != 0; }
INLINE int q2k(int fmt) { return form(fmt) == FMT_Q2; } /* Q2_K (only a K form) */
INLINE int iq4xs(int fmt) { return fmt == (FMT_K | FMT_Q8_0); }
INLINE int byte_q8(int fmt) { return fmt == FMT_Q8_0 || fmt == (FMT_Q8_0 | FMT_HALF); } /* Q8_0 itself */
INLINE int has_min(int fmt) {
    return form(fmt) == FMT_Q4_1 || form(fmt) == FMT_U8_1 || form(fmt) == FMT_Q5_1 || q2k(fmt);
}
INLINE int two_scales(int fmt) { return form(fmt) == FMT_I8_16 || q2k(fmt); } /* a scale per 16: two a block */
INLINE int fifth_bits(int fmt) { return form(fmt) == FMT_Q5_0 || form(fmt) == FMT_Q5_1; }
INLINE int high_pairs(int fmt) { return fmt == (FMT_K | FMT_I8_16); } /* Q6_K: 2 high bits a quant */
INLINE int q3k(int fmt) { return fmt == (FMT_K | FMT_HALF | FMT_I8_16); }
INLINE int nibbles(int fmt) {
    return form(fmt) == FMT_Q4_0 || form(fmt) == FMT_Q4_1 || fifth_bits(fmt) || (is_k(fmt) && !q2k(fmt));
}
/* IQ4_NL's table (ggml's kvalues_iq4nl) + 128, as the kernel stores a Q8_0 quant: IQ4_XS's nibble
 * indexes it. */
static const uint8_t IQ4_STORED[16] = {1, 24, 45, 63, 79, 93, 106, 118, 129, 141, 153, 166, 181, 197, 217, 241};
INLINE int offset(int fmt) {
    return form(fmt) == FMT_Q8_0    ? 128
           : form(fmt) == FMT_Q4_0  ? 8
           : form(fmt) == FMT_I8_16 ? (q3k(fmt) ? 4 : 32)
           : form(fmt) == FMT_Q5_0  ? 16
                                    : 0;
}
INLINE int64_t scale_row(int fmt) { return (int64_t)NC * (half_scales(fmt) ? 2 : 4); } /* dw (or mw) bytes */
INLINE int64_t scale_bytes(int fmt) { return scale_row(fmt) * (has_min(fmt) || two_scales(fmt) ? 2 : 1); }
/* Scale c of a block's row of NC (fp32, or fp16 bits). */
INLINE float scale_at(int fmt, const uint8_t *p, int c) {
    if (half_scales(fmt)) {
        _Float16 h;
        memcpy(&h, p + 2 * c, 2);
        return (float)h;
    }
    float f;
    memcpy(&f, p + 4 * c, 4);
    return f;
}
/* Nibble forms: QK / 2 bytes a column; the 5-bit forms add a column's 32 fifth bits (4 bytes), Q6_K
 * two planes of the high bit pairs (8 bytes): byte e of plane h holds groups 4h..4h+3's pair, group
 * 4h + t's at bits 2t, 2t + 1. */
INLINE int64_t nibble_bytes(void) { return (int64_t)NC * (QK / 2); }
INLINE int64_t quant_bytes(int fmt) {
    if (q2k(fmt)) return (int64_t)NC * 8; /* crumbs */
    return nibbles(fmt) ? nibble_bytes() + (fifth_bits(fmt) ? NC * 4 : 0) + (high_pairs(fmt) ? NC * 8 : 0)
                        : (int64_t)NC * QK;
}
INLINE int64_t block_stride(int fmt) { return scale_bytes(fmt) + quant_bytes(fmt); }
/* K forms: the super-block header (above) and a super-block's bytes, per panel. */
/* Bytes a column: d (+ dmin), then the scale rows (Q4_K, Q5_K: + their min rows). */
INLINE int64_t k_scale_rows(int fmt) { return two_scales(fmt) ? 2 * KB : KB; }
INLINE int64_t k_scales_at_byte(int fmt) { return has_min(fmt) ? NC * 4 : NC * 2; }
INLINE int64_t k_header(int fmt) {
    return k_scales_at_byte(fmt) + k_scale_rows(fmt) * NC + (has_min(fmt) && !q2k(fmt) ? KB * NC : 0);
}
INLINE int64_t k_stride(int fmt) { return k_header(fmt) + KB * quant_bytes(fmt); }
/* A panel's bytes for nb blocks of k. */
INLINE int64_t panel_bytes(int fmt, int64_t nb) { return is_k(fmt) ? nb / KB * k_stride(fmt) : nb * block_stride(fmt); }
/* Block b's quants in a panel. */
INLINE const uint8_t *block_qs(int fmt, const uint8_t *panel, int64_t b) {
    if (is_k(fmt)) return panel + (b / KB) * k_stride(fmt) + k_header(fmt) + (b % KB) * quant_bytes(fmt);
    return panel + b * block_stride(fmt) + scale_bytes(fmt);
}
INLINE float half_at(const uint8_t *p, int c) {
    _Float16 h;
    memcpy(&h, p + 2 * c, 2);
    return (float)h;
}
/* A K form's block b scales for column c (the header comment's products): dw, and mw (Q4_K, Q5_K)
 * or dw1 (Q6_K, Q3_K; Q2_K's are k_q2_scales_at's); IQ4_XS: dw only. */
INLINE void k_scales_at(int fmt, const uint8_t *panel, int64_t b, int c, float *dw, float *second) {
    const uint8_t *h = panel + (b / KB) * k_stride(fmt);
    const int j = (int)(b % KB);
    const float d = half_at(h, c);
    if (iq4xs(fmt)) {
        *dw = d * (float)((const int8_t *)(h + NC * 2))[j * NC + c];
        *second = 0.0f;
    } else if (two_scales(fmt)) {
        const int8_t *sc = (const int8_t *)(h + NC * 2);
        *dw = d * (float)sc[(2 * j) * NC + c];
        *second = d * (float)sc[(2 * j + 1) * NC + c];
    } else {
        const uint8_t *sc = h + NC * 4, *mn = sc + KB * NC;
        const float dmin = half_at(h + NC * 2, c);
        *dw = d * (float)sc[j * NC + c];
        *second = -(dmin * (float)mn[j * NC + c]);
    }
}

/* Q2_K's block b scales and minimums for column c: dw[h], mw[h] for the block's halves h. */
INLINE void k_q2_scales_at(const uint8_t *panel, int64_t b, int c, float dw[2], float mw[2]) {
    const int fmt = FMT_K | FMT_Q2;
    const uint8_t *h = panel + (b / KB) * k_stride(fmt);
    const int j = (int)(b % KB);
    const float d = half_at(h, c), dmin = half_at(h + NC * 2, c);
    for (int s = 0; s < 2; ++s) {
        const uint8_t sm = h[NC * 4 + (2 * j + s) * NC + c];
        dw[s] = d * (float)(sm & 15);
        mw[s] = -(dmin * (float)(sm >> 4));
    }
}

/* A float that must be rounded on its own: the empty asm hides it from -ffp-contract=fast. */
#if defined(__x86_64__) || defined(__i386__)
#define KEEP(x) __asm__("" : "+x"(x))
#elif defined(__aarch64__)
#define KEEP(x) __asm__("" : "+w"(x))
#else
#define KEEP(x) ((void)0)
#endif

int32_t llmserve_qi8_panel_width(void) { return NC; }

int64_t llmserve_qi8_packed_bytes(int32_t fmt, int64_t n, int64_t k) {
    if (!known(fmt) || (is_k(fmt) && k % (QK * KB))) return -1;
    return ((n + NC - 1) / NC) * panel_bytes(fmt, k / QK);
}

/* One block's quants of column c into the panel's block at qs: src the column's 32 quants (NULL:
 * a padding column, zeros), one byte each as llmserve_qi8_pack takes them. */
static int iq4_index(uint8_t stored) { /* the table entry of a value (+ 128); -1 if none */
    for (int t = 0; t < 16; ++t)
        if (IQ4_STORED[t] == stored) return t;
    return -1;
}

static void pack_block_quants(int fmt, const uint8_t *src, uint8_t *qs, int c) {
    for (int e = 0; e < 4; ++e) {
        if (q2k(fmt)) { /* crumbs: slot s holds groups s, s + 2, s + 4, s + 6 */
            for (int s = 0; s < 2; ++s) {
                uint8_t v = 0;
                for (int t = 0; t < 4; ++t) v |= (uint8_t)((src ? src[4 * (s + 2 * t) + e] & 3 : 0) << (2 * t));
                qs[(s * NC + c) * 4 + e] = v;
            }
        } else if (iq4xs(fmt)) { /* the table index of the value (checked by the caller) */
            for (int g = 0; g < 4; ++g)
                qs[(g * NC + c) * 4 + e] =
                    !src ? 0
                         : (uint8_t)(iq4_index(src[4 * g + e] ^ 0x80) | (iq4_index(src[4 * (g + 4) + e] ^ 0x80) << 4));
        } else if (fifth_bits(fmt) || high_pairs(fmt)) { /* Q5_0 int8 -16..15 stored + 16; Q5_1, Q5_K 0..31
                                                   * as is; Q6_K -32..31 + 32 */
            uint8_t v[8], hb = 0, hp[2] = {0, 0};
            for (int g = 0; g < 8; ++g) {
                const int8_t s = src ? (int8_t)src[4 * g + e] : 0;
                v[g] = src ? (uint8_t)(form(fmt) == FMT_Q5_0 ? s + 16 : high_pairs(fmt) ? s + 32 : src[4 * g + e]) : 0;
                hb |= (uint8_t)(((v[g] >> 4) & 1) << g);
                hp[g / 4] |= (uint8_t)(((v[g] >> 4) & 3) << (2 * (g % 4)));
            }
            for (int g = 0; g < 4; ++g) qs[(g * NC + c) * 4 + e] = (uint8_t)((v[g] & 15) | ((v[g + 4] & 15) << 4));
            if (high_pairs(fmt)) {
                qs[nibble_bytes() + c * 4 + e] = hp[0];
                qs[nibble_bytes() + NC * 4 + c * 4 + e] = hp[1];
            } else {
                qs[nibble_bytes() + c * 4 + e] = hb;
            }
        } else if (nibbles(fmt))
            for (int g = 0; g < 4; ++g)
                qs[(g * NC + c) * 4 + e] =
                    !src     ? 0
                    : q3k(fmt) ? (uint8_t)(((int8_t)src[4 * g + e] + 4) | (((int8_t)src[4 * (g + 4) + e] + 4) << 4))
                             : (uint8_t)((src[4 * g + e] & 15) | (src[4 * (g + 4) + e] << 4));
        else
            for (int g = 0; g < 8; ++g)
                qs[(g * NC + c) * 4 + e] = src ? (uint8_t)(form(fmt) == FMT_Q8_0    ? src[4 * g + e] ^ 0x80
                                                           : form(fmt) == FMT_I8_16 ? (int8_t)src[4 * g + e] + 32
                                                                                    : src[4 * g + e])
                                               : 0;
    }
}

/* The K forms from a file's super-blocks, unpacked one value a byte: q n x k quants (Q4_K 0..15,
 * Q5_K 0..31, Q6_K int8 bits -32..31, Q3_K -4..3, Q2_K 0..3, IQ4_XS int8 bits of IQ4_NL's table
 * values); dsup n x k/256 x 2 fp16 bits (d, dmin; Q6_K's, Q3_K's and IQ4_XS's dmin unused); sc
 * n x k/32 (Q6_K, Q3_K, Q2_K: k/16; int8 bits for Q6_K, Q3_K, IQ4_XS) and mn (Q4_K, Q5_K: n x k/32,
 * Q2_K: n x k/16; NULL for the others) the sub-blocks' integer scales and mins (Q2_K's both 0..15).
 * Returns 0, or -1 (not a K form, k not whole super-blocks, a quant or Q2_K scale out of range). */
int32_t llmserve_qi8_pack_k(int32_t fmt, const uint8_t *q, const uint16_t *dsup, const uint8_t *sc,
                            const uint8_t *mn, int64_t n, int64_t k, uint8_t *packed) {
    if (!known(fmt) || !is_k(fmt) || k % (QK * KB) || (has_min(fmt) && !mn)) return -1;
    const int64_t panels = (n + NC - 1) / NC, supers = k / (QK * KB), nsc = k_scale_rows(fmt);
    if (q2k(fmt) || iq4xs(fmt)) /* values the packed form cannot hold are refused, nothing written */
        for (int64_t i = 0; i < n * k; ++i)
            if (q2k(fmt) ? q[i] > 3 : iq4_index(q[i] ^ 0x80) < 0) return -1;
    if (q2k(fmt))
        for (int64_t i = 0; i < n * supers * nsc; ++i)
            if (sc[i] > 15 || mn[i] > 15) return -1;
    uint8_t *out = packed;
    for (int64_t p = 0; p < panels; ++p)
        for (int64_t s = 0; s < supers; ++s) {
            memset(out, 0, k_header(fmt));
            uint16_t *d = (uint16_t *)out;
            uint8_t *scs = out + k_scales_at_byte(fmt), *mns = scs + KB * NC;
            for (int c = 0; c < NC; ++c) {
                const int64_t j = p * NC + c;
                if (j < n) {
                    d[c] = dsup[2 * (j * supers + s)];
                    if (has_min(fmt)) d[NC + c] = dsup[2 * (j * supers + s) + 1];
                    for (int t = 0; t < nsc; ++t) {
                        const int64_t at = j * supers * nsc + s * nsc + t;
                        if (q2k(fmt))
                            scs[t * NC + c] = (uint8_t)(sc[at] | (mn[at] << 4));
                        else
                            scs[t * NC + c] = sc[at];
                        if (has_min(fmt) && !q2k(fmt)) mns[t * NC + c] = mn[j * supers * KB + s * KB + t];
                    }
                }
                for (int b = 0; b < KB; ++b)
                    pack_block_quants(fmt, j < n ? q + j * k + (s * KB + b) * QK : NULL,
                                      out + k_header(fmt) + b * quant_bytes(fmt), c);
            }
            out += k_stride(fmt);
        }
    return 0;
}

/* q: n x k quants, one byte each (int8 bits for Q8_0 and I8_16, 0..15 for Q4, 0..31 for U8_1); d, m:
 * n x k/32 fp32, or fp16 bits with FMT_HALF (m only where the format has minimums; I8_16: d is
 * n x k/16, m unused). Returns 0, or -1 (unknown format, partial block). */
int32_t llmserve_qi8_pack(int32_t fmt, const uint8_t *q, const void *d, const void *m, int64_t n, int64_t k,
                          uint8_t *packed) {
    if (!known(fmt) || is_k(fmt) || k % QK) return -1;
    const int64_t panels = (n + NC - 1) / NC, blocks = k / QK, sb = scale_bytes(fmt);
    uint8_t *out = packed;
    for (int64_t p = 0; p < panels; ++p)
        for (int64_t b = 0; b < blocks; ++b) {
            uint8_t *ds = out, *ms = out + scale_row(fmt), *qs = out + sb;
            const int64_t es = half_scales(fmt) ? 2 : 4; /* bytes a scale */
            for (int c = 0; c < NC; ++c) {
                const int64_t j = p * NC + c;
                memset(ds + es * c, 0, es);
                if (two_scales(fmt)) { /* the block's two sub-block scales: rows 0 and 1 */
                    memset(ms + es * c, 0, es);
                    if (j < n) {
                        memcpy(ds + es * c, (const uint8_t *)d + es * (2 * (j * blocks + b)), es);
                        memcpy(ms + es * c, (const uint8_t *)d + es * (2 * (j * blocks + b) + 1), es);
                    }
                } else if (j < n) {
                    memcpy(ds + es * c, (const uint8_t *)d + es * (j * blocks + b), es);
                }
                if (has_min(fmt)) {
                    memset(ms + es * c, 0, es);
                    if (j < n) memcpy(ms + es * c, (const uint8_t *)m + es * (j * blocks + b), es);
                }
                pack_block_quants(fmt, j < n ? q + j * k + b * QK : NULL, qs, c);
            }
            out += block_stride(fmt);
        }
    return 0;
}

/* Block b of a row to int8 quants, SIMD where the build has it: the same operations as the scalar
 * loop below, lane by lane (the max ignores NaN as its comparison does; max is exact in any order),
 * so every build gives the same bytes. A call quantizes k/32 blocks; scalar, that was 2 us of a
 * 5 us call at k = 576, M = 1, paid by each of a decode step's GEMMs. */
#if defined(__AVX512F__)
INLINE float block_amax(const float *xb) {
    /* max_ps(a, b) is b where a is NaN: a NaN value never wins, as in the scalar comparison. */
    __m512 m = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(xb)), _mm512_setzero_ps());
    m = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(xb + 16)), m);
    return _mm512_reduce_max_ps(m);
}
INLINE int32_t block_quants(const float *xb, float id, int8_t *xq, int32_t *sh) {
    __m512i i[2];
    for (int h = 0; h < 2; ++h) {
        const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(xb + 16 * h), _mm512_set1_ps(id));
        const __m512 r = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __mmask16 nan = _mm512_cmp_ps_mask(r, r, _CMP_UNORD_Q);
        const __m512 c = _mm512_min_ps(_mm512_max_ps(r, _mm512_set1_ps(-127.0f)), _mm512_set1_ps(127.0f));
        i[h] = _mm512_maskz_cvtps_epi32((__mmask16)~nan, c);
        _mm_storeu_si128((__m128i *)(xq + 16 * h), _mm512_cvtepi32_epi8(i[h]));
    }
    if (!sh) return _mm512_reduce_add_epi32(_mm512_add_epi32(i[0], i[1]));
    /* the two halves' sums side by side: 128-bit lanes [0+1, 2+3] of each half, then within them */
    __m512i t = _mm512_add_epi32(_mm512_shuffle_i32x4(i[0], i[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_i32x4(i[0], i[1], _MM_SHUFFLE(3, 1, 3, 1)));
    t = _mm512_add_epi32(t, _mm512_shuffle_i32x4(t, t, _MM_SHUFFLE(2, 3, 0, 1)));
    t = _mm512_add_epi32(t, _mm512_shuffle_epi32(t, (_MM_PERM_ENUM)0x4e));
    t = _mm512_add_epi32(t, _mm512_shuffle_epi32(t, (_MM_PERM_ENUM)0xb1));
    sh[0] = _mm_cvtsi128_si32(_mm512_castsi512_si128(t));
    sh[1] = _mm_cvtsi128_si32(_mm512_extracti32x4_epi32(t, 2));
    return sh[0] + sh[1];
}
#elif defined(__AVX2__)
INLINE float block_amax(const float *xb) {
    const __m256 abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 m = _mm256_setzero_ps();
    for (int e = 0; e < QK; e += 8) m = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(xb + e), abs), m);
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    return _mm_cvtss_f32(h);
}
INLINE int32_t block_quants(const float *xb, float id, int8_t *xq, int32_t *sh) {
    __m256i q[4], sum = _mm256_setzero_si256();
    for (int g = 0; g < 4; ++g) {
        const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(xb + 8 * g), _mm256_set1_ps(id));
        const __m256 r = _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m256 ok = _mm256_cmp_ps(r, r, _CMP_ORD_Q);
        const __m256 c = _mm256_min_ps(_mm256_max_ps(r, _mm256_set1_ps(-127.0f)), _mm256_set1_ps(127.0f));
        q[g] = _mm256_cvtps_epi32(_mm256_and_ps(c, ok)); /* NaN lanes: +0.0 */
        sum = _mm256_add_epi32(sum, q[g]);
    }
    /* int32 -> int8 (no saturation: all within -127..127); the packs interleave 128-bit lanes,
     * the permute puts the 32 bytes back in order. */
    const __m256i w = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256((__m256i *)xq, _mm256_permutevar8x32_epi32(w, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    if (sh) { /* the halves' sums: lanes 0, 1 of [h0, h1, h0, h1] after two pairwise adds and the lanes' */
        __m256i t = _mm256_hadd_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
        t = _mm256_hadd_epi32(t, t);
        const __m128i u = _mm_add_epi32(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
        sh[0] = _mm_cvtsi128_si32(u);
        sh[1] = _mm_extract_epi32(u, 1);
        return sh[0] + sh[1];
    }
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}
#else
INLINE float block_amax(const float *xb) {
    float amax = 0.0f;
    for (int e = 0; e < QK; ++e) {
        const float a = __builtin_fabsf(xb[e]);
        amax = a > amax ? a : amax;
    }
    return amax;
}
INLINE int32_t block_quants(const float *xb, float id, int8_t *xq, int32_t *sh) {
    int32_t s[2] = {0, 0};
    for (int e = 0; e < QK; ++e) {
        float v = __builtin_rintf(xb[e] * id);
        v = v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v;
        if (v != v) v = 0.0f; /* NaN in, defined out */
        xq[e] = (int8_t)v;
        s[e / (QK / 2)] += (int8_t)v;
    }
    if (sh) sh[0] = s[0], sh[1] = s[1];
    return s[0] + s[1];
}
#endif

/* One block of 32 floats to int8 quants xq, its dx, sx and dxs (the documented rounding), and where
 * sh is not NULL its two 16-step sums of q (sh[0], sh[1]; sx their sum). */
INLINE void quantize_block(const float *xb, int8_t *xq, float *dx, int32_t *sx, float *dxs, int32_t *sh) {
    const float amax = block_amax(xb);
    /* A scale below the smallest normal float (a block of zeros or subnormals) quantizes the
     * block to zeros: its reciprocal would overflow. */
    const float d = amax / 127.0f, id = d >= 0x1p-126f ? 1.0f / d : 0.0f;
    const int32_t s = block_quants(xb, id, xq, sh);
    *dx = d;
    *sx = s;
    float ds = d * (float)s;
    KEEP(ds);
    *dxs = ds;
}

/* Row r of x (k floats) to int8 quants xq, per block dx, sx and dxs, and where sh is not NULL each
 * block's two 16-step sums of q (sh[2b], sh[2b + 1]). */
INLINE void quantize_row(const float *x, int64_t k, int8_t *xq, float *dx, int32_t *sx, float *dxs, int32_t *sh) {
    for (int64_t b = 0; b < k / QK; ++b)
        quantize_block(x + b * QK, xq + b * QK, dx + b, sx + b, dxs + b, sh ? sh + 2 * b : NULL);
}

/* The gated activations a down projection's rows are (GLU_*: glu.h's functions), made in its
 * quantization: a row of x is [gate | up] (k floats each) and quantize_glu_row quantizes
 * act(gate) * up, a block of 32 at a time through a local array, as quantize_row quantizes the rows
 * elementwise.c's kernel writes (the same function of the same inputs: the same values, so the
 * same quants and scales), without the k fp32 values a row going out to memory and back (40 MB a
 * layer for a 2,048-row prefill step of Qwen2.5-0.5B). */
enum { GLU_NONE = 0, GLU_SILU = 1, GLU_GELU_TANH = 2 };
INLINE void glu_block(int glu, const float *g, const float *u, float *out) {
    if (glu == GLU_SILU)
        for (int e = 0; e < QK; ++e) out[e] = silu_mul(g[e], u[e]);
    else
        for (int e = 0; e < QK; ++e) out[e] = gelu_tanh_mul(g[e], u[e]);
}
INLINE void quantize_glu_row(int glu, const float *x, int64_t k, int8_t *xq, float *dx, int32_t *sx, float *dxs,
                             int32_t *sh) {
    for (int64_t b = 0; b < k / QK; ++b) {
        float a[QK] __attribute__((aligned(64)));
        glu_block(glu, x + b * QK, x + k + b * QK, a);
        quantize_block(a, xq + b * QK, dx + b, sx + b, dxs + b, sh ? sh + 2 * b : NULL);
    }
}
/* The quantized rows of one call: quants m x k, then per row and block dx, sx, dxs (m x k/32 each);
 * for I8_16 also sh, each block's two 16-step sums of q (m x k/16), else NULL. */
typedef struct {
    const int8_t *q;
    const float *dx, *dxs;
    const int32_t *sx, *sh;
    int64_t k, nb;
    /* The AMX rows' copies of dx and dxs, by group of 16 rows and block: row r's of block b at
     * ((r / 16) * nb + b) * 16 + r % 16 (a tile's 16 rows side by side, so the float steps read them
     * at fixed offsets); NULL off that path. */
    const float *dxt, *dxst;
    /* -offset * sx per row and block (m x k/32) where the format's one sum a row has an offset to
     * take out: the SIMD rows start each block's sum from it (a broadcast from memory) in place of
     * a subtraction per row and vector after (the same integer). */
    const int32_t *ncorr;
} qrows;

/* A thread's scratch buffers, kept and grown (their contents not kept), 64-byte aligned, never
 * freed: slot 0 the quantized activations, 1 and 2 the fused MLP's, 3 a panel's unpacked quants
 * (the VNNI items), 4 the AMX items' weight tiles. */
static void *scratch_in(int slot, size_t bytes) {
    static __thread void *buf[5];
    static __thread size_t cap[5];
    if (bytes > cap[slot]) {
        void *grown = NULL;
        if (posix_memalign(&grown, 64, bytes)) return NULL;
        free(buf[slot]);
        buf[slot] = grown;
        cap[slot] = bytes;
    }
    return buf[slot];
}
static void *scratch(size_t bytes) { return scratch_in(0, bytes); }
/* (the fused MLP's: its gate/up projection's quantized rows, and the act blocks' scales staged) */
static void *scratch_gate_up(size_t bytes) { return scratch_in(1, bytes); }
static void *scratch_staged(size_t bytes) { return scratch_in(2, bytes); }

/* The block's fp32 contribution to one output (the generic path, and the reference order). */
INLINE float block_term(float dw, float mw, float dx, float dxs, int32_t isum, int min) {
    float a = dw * dx;
    KEEP(a);
    float t = a * (float)isum;
    KEEP(t);
    if (min) {
        float u = mw * dxs;
        KEEP(u);
        t = t + u;
        KEEP(t);
    }
    return t;
}

/* I8_16's: the two sub-blocks' terms, each rounded, then their sum (the reference order). */
INLINE float block_term2(float dw0, float dw1, float dx, int32_t isum0, int32_t isum1) {
    float a = dw0 * dx;
    KEEP(a);
    float t = a * (float)isum0;
    KEEP(t);
    float b = dw1 * dx;
    KEEP(b);
    float u = b * (float)isum1;
    KEEP(u);
    t = t + u;
    KEEP(t);
    return t;
}

/* Q2_K's: each half's term with its minimum's, each rounded, then their sum (the reference order). */
INLINE float block_term2m(const float dw[2], const float mw[2], float dx, const int32_t sh[2], int32_t isum0,
                          int32_t isum1) {
    float t[2];
    for (int h = 0; h < 2; ++h) {
        float a = dw[h] * dx;
        KEEP(a);
        float u = a * (float)(h ? isum1 : isum0);
        KEEP(u);
        float dxs = dx * (float)sh[h];
        KEEP(dxs);
        float v = mw[h] * dxs;
        KEEP(v);
        u = u + v;
        KEEP(u);
        t[h] = u;
    }
    float sum = t[0] + t[1];
    KEEP(sum);
    return sum;
}

INLINE void store_rows(float acc[][NC], int m, const float *bias, float *y, int64_t ldy, int cols) {
    for (int i = 0; i < m; ++i)
        for (int c = 0; c < cols; ++c) {
            float v = acc[i][c];
            if (bias) v = v + bias[c];
            y[i * ldy + c] = v;
        }
}

/* Columns [c0, c1) of rows [0, m): + bias, stored. */
INLINE void store_cols(float acc[][NC], int m, const float *bias, float *y, int64_t ldy, int c0, int c1) {
    for (int i = 0; i < m; ++i)
        for (int c = c0; c < c1; ++c) {
            float v = acc[i][c];
            if (bias) v = v + bias[c];
            y[i * ldy + c] = v;
        }
}

/* Generic C: rows [0, m) against one panel. */
static void rows_generic(const int fmt, const qrows *x, int64_t r0, int m, const uint8_t *panel,
                         const float *bias, float *y, int64_t ldy, int cols) {
    float acc[MR][NC];
    for (int i = 0; i < m; ++i)
        for (int c = 0; c < NC; ++c) acc[i][c] = 0.0f;
    const int off = offset(fmt), min = has_min(fmt);
    for (int64_t b = 0; b < x->nb; ++b) {
        const uint8_t *blk = panel + b * block_stride(fmt), *qs = block_qs(fmt, panel, b);
        for (int i = 0; i < m; ++i) {
            const int64_t r = r0 + i;
            const int8_t *xq = x->q + r * x->k + b * QK;
            int32_t isum[2][NC]; /* [half of the block: I8_16's sub-blocks; the others sum both] */
            for (int c = 0; c < NC; ++c) isum[0][c] = isum[1][c] = 0;
            for (int g = 0; g < 8; ++g)
                for (int c = 0; c < NC; ++c)
                    for (int e = 0; e < 4; ++e) {
                        int w;
                        if (q2k(fmt)) {
                            w = (qs[((g & 1) * NC + c) * 4 + e] >> (2 * (g >> 1))) & 3;
                        } else if (nibbles(fmt)) {
                            const uint8_t v = qs[((g & 3) * NC + c) * 4 + e];
                            w = g < 4 ? v & 15 : v >> 4;
                            if (iq4xs(fmt)) w = IQ4_STORED[w];
                            if (fifth_bits(fmt)) w |= ((qs[nibble_bytes() + c * 4 + e] >> g) & 1) << 4;
                            if (high_pairs(fmt))
                                w |= ((qs[nibble_bytes() + (g / 4) * NC * 4 + c * 4 + e] >> (2 * (g % 4))) & 3) << 4;
                        } else {
                            w = qs[(g * NC + c) * 4 + e];
                        }
                        isum[g >= 4][c] += w * xq[4 * g + e];
                    }
            const float dx = x->dx[r * x->nb + b], dxs = x->dxs[r * x->nb + b];
            if (q2k(fmt)) {
                const int32_t *sh = x->sh + 2 * (r * x->nb + b);
                for (int c = 0; c < NC; ++c) {
                    float dw[2], mw[2];
                    k_q2_scales_at(panel, b, c, dw, mw);
                    acc[i][c] = acc[i][c] + block_term2m(dw, mw, dx, sh, isum[0][c], isum[1][c]);
                }
                continue;
            }
            if (two_scales(fmt)) {
                const int32_t c0 = off * x->sh[2 * (r * x->nb + b)], c1 = off * x->sh[2 * (r * x->nb + b) + 1];
                for (int c = 0; c < NC; ++c) {
                    float dw0, dw1;
                    if (is_k(fmt))
                        k_scales_at(fmt, panel, b, c, &dw0, &dw1);
                    else
                        dw0 = scale_at(fmt, blk, c), dw1 = scale_at(fmt, blk + scale_row(fmt), c);
                    acc[i][c] = acc[i][c] + block_term2(dw0, dw1, dx, isum[0][c] - c0, isum[1][c] - c1);
                }
                continue;
            }
            const int32_t corr = off * x->sx[r * x->nb + b];
            for (int c = 0; c < NC; ++c) {
                float dw, mw;
                if (is_k(fmt))
                    k_scales_at(fmt, panel, b, c, &dw, &mw);
                else
                    dw = scale_at(fmt, blk, c), mw = min ? scale_at(fmt, blk + scale_row(fmt), c) : 0.0f;
                const float t = block_term(dw, mw, dx, dxs, isum[0][c] + isum[1][c] - corr, min);
                acc[i][c] = acc[i][c] + t;
            }
        }
    }
    store_rows(acc, m, bias, y, ldy, cols);
}

#if defined(__AVX512F__)
#define V 2 /* vectors of 16 int32 lanes per panel */
typedef __m512i vi;
typedef __m512 vfl;
INLINE vfl keepv(vfl v) {
    __asm__("" : "+v"(v));
    return v;
}
/* acc + the 4-byte dot products of unsigned w and signed x, per int32 lane. VNNI: one instruction
 * (assembled directly: the avx512 build's -march does not include VNNI; the caller checks the CPU). */
INLINE vi dot_vnni(vi acc, vi w, vi x) {
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(w), "v"(x));
    return acc;
}
/* The same with x's 4 bytes at p broadcast by the instruction itself (one instruction, no register
 * for the broadcast: rows_wide, where each broadcast serves one dot). */
INLINE vi dot_vnni_at(vi acc, vi w, const int8_t *p) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const int32_t *)p));
    return acc;
}
INLINE vi dot_bw(vi acc, vi w, vi x) {
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(w, x), _mm512_set1_epi16(1)));
}
/* Q8_0 without VNNI: the signed weight (stored ^ 0x80) as magnitude and sign. */
INLINE vi dot_bw_signed(vi acc, vi stored, vi x) {
    const vi ws = _mm512_xor_si512(stored, _mm512_set1_epi8((char)0x80));
    const __mmask64 neg = _mm512_movepi8_mask(ws);
    const vi sx = _mm512_mask_sub_epi8(x, neg, _mm512_setzero_si512(), x);
    return dot_bw(acc, _mm512_abs_epi8(ws), sx);
}
INLINE vi loadi(const uint8_t *p) { return _mm512_loadu_si512((const void *)p); }
INLINE vi bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}
INLINE vi lo_nib(vi v) { return _mm512_and_si512(v, _mm512_set1_epi8(15)); }
INLINE vi hi_nib(vi v) { return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(15)); }
/* A byte's fifth bits (bit g: group g's) to 16 or 0 for groups g (up, 4 - g) and g + 4 (down, g):
 * the 16-bit shifts move no bit across a byte into bit 4. */
INLINE vi fifth_lo(vi h, int g) { return _mm512_and_si512(_mm512_slli_epi16(h, 4 - g), _mm512_set1_epi8(16)); }
INLINE vi fifth_hi(vi h, int g) { return _mm512_and_si512(_mm512_srli_epi16(h, g), _mm512_set1_epi8(16)); }
/* nib (0..15) + 16 where bit `bit` of h's byte is set: a byte test into a mask register and a
 * masked add, no shift (the 512-bit shifts share port 0 with vpdpbusd and the conversions). */
INLINE vi with_bit(vi nib, vi h, int bit) {
    return _mm512_mask_add_epi8(nib, _mm512_test_epi8_mask(h, _mm512_set1_epi8((char)(1 << bit))), nib,
                                _mm512_set1_epi8(16));
}
/* Q6_K: a plane byte's pair t (bits 2t, 2t + 1) to bits 4, 5 (no bit of the other byte lands there). */
INLINE vi pair_bits(vi h, int t) {
    const vi s = t < 2 ? _mm512_slli_epi16(h, 4 - 2 * t) : t == 2 ? h : _mm512_srli_epi16(h, 2);
    return _mm512_and_si512(s, _mm512_set1_epi8(0x30));
}
/* maddubs products summed in int16 (exact while the caller keeps the sum in range), then to int32. */
INLINE vi mul16(vi w, vi x) { return _mm512_maddubs_epi16(w, x); }
INLINE vi add16(vi a, vi b) { return _mm512_add_epi16(a, b); }
INLINE vi fold16(vi acc, vi p) { return _mm512_add_epi32(acc, _mm512_madd_epi16(p, _mm512_set1_epi16(1))); }
INLINE vi ori(vi a, vi b) { return _mm512_or_si512(a, b); }
INLINE vfl cvt_u8(const uint8_t *p) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p))); }
INLINE vfl cvt_s8(const uint8_t *p) { return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p))); }
/* Q2_K: a byte's low and high nibbles (its scale and minimum) as floats. */
INLINE vfl cvt_lo4(const uint8_t *p) {
    const vi v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(15)));
}
INLINE vfl cvt_hi4(const uint8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_srli_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)), 4));
}
/* Q2_K: bits 2t, 2t + 1 of each byte (the 16-bit shift moves no bit of the other byte there). */
INLINE vi crumb(vi v, int t) { return _mm512_and_si512(_mm512_srli_epi16(v, 2 * t), _mm512_set1_epi8(3)); }
/* IQ4_XS: each byte's index (0..15) to the table entry, per 128-bit lane. */
INLINE vi iq4_table(void) { return _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)IQ4_STORED)); }
INLINE vi lookup(vi table, vi idx) { return _mm512_shuffle_epi8(table, idx); }
INLINE vfl loadf(const float *p) { return _mm512_loadu_ps(p); }
INLINE vfl loadh(const uint8_t *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
INLINE vfl setf(float f) { return _mm512_set1_ps(f); }
INLINE vfl cvt(vi v) { return _mm512_cvtepi32_ps(v); }
INLINE vi subi(vi a, int32_t c) { return _mm512_sub_epi32(a, _mm512_set1_epi32(c)); }
INLINE vi zeroi(void) { return _mm512_setzero_si512(); }
INLINE vi seti(const int32_t *p) { return _mm512_set1_epi32(*p); }
INLINE vfl zerof(void) { return _mm512_setzero_ps(); }
INLINE void storef(float *p, vfl v) { _mm512_storeu_ps(p, v); }
#define VW 16
#elif defined(__AVX2__)
#define V 4
typedef __m256i vi;
typedef __m256 vfl;
INLINE vfl keepv(vfl v) {
    __asm__("" : "+x"(v));
    return v;
}
INLINE vi dot_bw(vi acc, vi w, vi x) {
    return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
}
INLINE vi dot_bw_signed(vi acc, vi stored, vi x) {
    const vi ws = _mm256_xor_si256(stored, _mm256_set1_epi8((char)0x80));
    return dot_bw(acc, _mm256_abs_epi8(ws), _mm256_sign_epi8(x, ws));
}
/* AVX-VNNI (the VEX form, on CPUs with AVX2 and no AVX-512 as well): the caller checks the CPU. */
INLINE vi dot_vnni(vi acc, vi w, vi x) {
    __asm__("%{vex%} vpdpbusd %2, %1, %0" : "+x"(acc) : "x"(w), "x"(x));
    return acc;
}
INLINE vi loadi(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }
INLINE vi bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}
INLINE vi lo_nib(vi v) { return _mm256_and_si256(v, _mm256_set1_epi8(15)); }
INLINE vi hi_nib(vi v) { return _mm256_and_si256(_mm256_srli_epi16(v, 4), _mm256_set1_epi8(15)); }
INLINE vi fifth_lo(vi h, int g) { return _mm256_and_si256(_mm256_slli_epi16(h, 4 - g), _mm256_set1_epi8(16)); }
INLINE vi fifth_hi(vi h, int g) { return _mm256_and_si256(_mm256_srli_epi16(h, g), _mm256_set1_epi8(16)); }
INLINE vi pair_bits(vi h, int t) {
    const vi s = t < 2 ? _mm256_slli_epi16(h, 4 - 2 * t) : t == 2 ? h : _mm256_srli_epi16(h, 2);
    return _mm256_and_si256(s, _mm256_set1_epi8(0x30));
}
INLINE vi mul16(vi w, vi x) { return _mm256_maddubs_epi16(w, x); }
INLINE vi add16(vi a, vi b) { return _mm256_add_epi16(a, b); }
INLINE vi fold16(vi acc, vi p) { return _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1))); }
INLINE vi ori(vi a, vi b) { return _mm256_or_si256(a, b); }
INLINE vi with_bit(vi nib, vi h, int bit) { return ori(nib, bit < 4 ? fifth_lo(h, bit) : fifth_hi(h, bit - 4)); }
INLINE vfl cvt_u8(const uint8_t *p) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p))); }
INLINE vfl cvt_s8(const uint8_t *p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p))); }
INLINE vfl cvt_lo4(const uint8_t *p) {
    const vi v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    return _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15)));
}
INLINE vfl cvt_hi4(const uint8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_srli_epi32(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)), 4));
}
INLINE vi crumb(vi v, int t) { return _mm256_and_si256(_mm256_srli_epi16(v, 2 * t), _mm256_set1_epi8(3)); }
INLINE vi iq4_table(void) { return _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)IQ4_STORED)); }
INLINE vi lookup(vi table, vi idx) { return _mm256_shuffle_epi8(table, idx); }
INLINE vfl loadf(const float *p) { return _mm256_loadu_ps(p); }
INLINE vfl loadh(const uint8_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }
INLINE vfl setf(float f) { return _mm256_set1_ps(f); }
INLINE vfl cvt(vi v) { return _mm256_cvtepi32_ps(v); }
INLINE vi subi(vi a, int32_t c) { return _mm256_sub_epi32(a, _mm256_set1_epi32(c)); }
INLINE vi zeroi(void) { return _mm256_setzero_si256(); }
INLINE vi seti(const int32_t *p) { return _mm256_set1_epi32(*p); }
INLINE vfl zerof(void) { return _mm256_setzero_ps(); }
INLINE void storef(float *p, vfl v) { _mm256_storeu_ps(p, v); }
#define VW 8
#endif

/* From how many rows an item of a nibble form unpacks its panel (the AVX-512 build, VNNI; below,
 * every pass of rows unpacks its own, or rows_wide's passes run): [0] Q4_0 / Q4_1 / Q3_K, [1] the
 * forms with a fifth bit, [2] Q4_K, [3] Q6_K at K <= 4096 (the attention's V, an LM head), [4] Q6_K
 * at longer K (a down projection). As measured on the AVX-512 Xeons; on an AMD CPU (measured on a
 * Zen 4, whose 512-bit operations take two passes through 256-bit units) Q4_K from 128 rows and a
 * short-K Q6_K from 32. The bits are the same either way; llmserve_qi8_unpack_from moves them (tests,
 * benchmarks). Measured: below. */
static int unpack_from[5] = {32, 16, 32, 6, 6};
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
__attribute__((constructor)) static void unpack_from_this_cpu(void) {
    __builtin_cpu_init();
    if (__builtin_cpu_is("amd")) {
        unpack_from[2] = 128;
        unpack_from[3] = 32;
    }
}
#endif
int32_t llmserve_qi8_unpack_from(int32_t which, int32_t rows) {
    if (which < 0 || which > 4) return -1;
    const int32_t old = unpack_from[which];
    if (rows > 0) unpack_from[which] = rows;
    return old;
}

#ifdef VW

#ifdef VW
/* A nibble block's vector v: its planes (the fifth bits of Q5_0, Q5_1, Q5_K; Q6_K's two planes of high
 * pairs), then group g's quants (low nibbles; the high ones are group g + 4's) with their bits from
 * them: the stored values. */
INLINE void nibble_planes(const int fmt, const uint8_t *qs, int v, vi *h5, vi *h6) {
    *h5 = *h6 = zeroi();
    if (fifth_bits(fmt) || high_pairs(fmt)) *h5 = loadi(qs + nibble_bytes() + v * VW * 4);
    if (high_pairs(fmt)) *h6 = loadi(qs + nibble_bytes() + NC * 4 + v * VW * 4);
}
INLINE void nibble_group(const int fmt, const uint8_t *qs, int v, int g, vi h5, vi h6, vi *lo, vi *hi) {
    const vi raw = loadi(qs + (g * NC + v * VW) * 4);
    *lo = lo_nib(raw);
    *hi = hi_nib(raw);
    if (fifth_bits(fmt)) {
        *lo = with_bit(*lo, h5, g);
        *hi = with_bit(*hi, h5, g + 4);
    }
    if (high_pairs(fmt)) {
        *lo = ori(*lo, pair_bits(h5, g));
        *hi = ori(*hi, pair_bits(h6, g));
    }
}
#endif

#if defined(__AVX512F__)
/* Prefill-sized items of a nibble form, on VNNI, unpack their panel once (unpack_block) and run every
 * pass of rows over its bytes: the byte forms' inner loop, whose integer sums are the same integers,
 * so the same bits. Unpacking in each pass of MR rows was up to a third of a Q5_0 or Q6_K pass's
 * time (benchmarks.qi8_amx_ab at 490 rows, the AVX-512 VNNI Xeon without AMX, two threads: Q5_0
 * 1.13-1.32x, Q6_K 1.25-1.27x, Q4_K 1.12-1.21x, Q4_1 1.07-1.15x). From how many rows: the more a
 * pass spends unpacking, the sooner (Q6_K 1.18-1.29x at 8 rows; Q5_0 0.88-0.94x at 8, 1.02-1.05x at
 * 12, 1.05-1.11x at 16; Q4_1 / Q4_K 0.90-1.00x at 16, 1.04-1.25x at 64). Passes over one vector of
 * the panel at a time (rows_wide's 8 or 6 rows) measured 0.58-0.81x of these. Only in the AVX-512
 * build, where it was measured: the AVX2 build's AVX-VNNI rows keep unpacking per pass. On a Zen 4
 * (unpack_from's AMD values; two threads, whole decode steps of Qwen2.5-Coder-1.5B / 0.5B Q4_K_M,
 * the weights from memory) Q4_K ran faster on rows_wide's passes below 128 rows (steps of 32 rows 1.09x / 1.11x, 64 rows 1.05x /
 * 1.03x), and a Q6_K LM head on rows_k's below 32 (the 1.5B's steps of 8-16 rows 1.05x; the head
 * alone 1.28x at 8 rows, 1.07-1.10x at 16-24); a Q6_K down projection (K 8,960) still unpacks from 6. */
INLINE int unpack_rows(int fmt, int64_t k) {
    if (high_pairs(fmt)) return unpack_from[k <= 4096 ? 3 : 4];
    return unpack_from[fifth_bits(fmt) ? 1 : is_k(fmt) && !q3k(fmt) ? 2 : 0];
}
static uint8_t *unpacked_buffer(size_t bytes) { return scratch_in(3, bytes); }
/* Block b of a nibble form's panel (not IQ4_XS) as the byte forms hold theirs, [group g 0..7]
 * [column][4]: the stored values the nibble path's dots take (lo: groups 0-3, hi: 4-7), less `off`
 * (0 for the VNNI rows; the format's offset for the AMX tiles' signed bytes). */
INLINE void unpack_block(const int fmt, const uint8_t *panel, int64_t b, uint8_t *dst, const int off) {
    const uint8_t *qs = is_k(fmt) ? block_qs(fmt, panel, b) : panel + b * block_stride(fmt) + scale_bytes(fmt);
    const vi o = _mm512_set1_epi8((char)off);
    for (int v = 0; v < V; ++v) {
        vi h5, h6;
        nibble_planes(fmt, qs, v, &h5, &h6);
        for (int g = 0; g < 4; ++g) {
            vi lo, hi;
            nibble_group(fmt, qs, v, g, h5, h6, &lo, &hi);
            _mm512_storeu_si512((void *)(dst + (g * NC + v * VW) * 4), _mm512_sub_epi8(lo, o));
            _mm512_storeu_si512((void *)(dst + ((g + 4) * NC + v * VW) * 4), _mm512_sub_epi8(hi, o));
        }
    }
}
/* Block b's scales as the float steps read them, fp32 [2][NC]: dw, then mw (the minimums, or I8_16's
 * second scales; 0 where the form has neither). The same values rows_simd_cols forms in each pass
 * (exact products of the header's values), made once per item beside the unpacked quants, where
 * each pass of MR rows had converted and multiplied them again (the K forms: Q4_K 1.03-1.06x, Q6_K
 * 1.02-1.04x at 64-512 rows, Zen 4; the 32-weight forms, whose scales are a load, unchanged). */
INLINE void unpack_scales(const int fmt, const uint8_t *panel, int64_t b, float *dst) {
    for (int v = 0; v < V; ++v) {
        vfl dw, mw = zerof();
        if (is_k(fmt)) {
            const uint8_t *h = panel + (b / KB) * k_stride(fmt);
            const int j = (int)(b % KB);
            const vfl kd = loadh(h + 2 * v * VW);
            if (two_scales(fmt)) {
                dw = kd * cvt_s8(h + NC * 2 + 2 * j * NC + v * VW);
                mw = kd * cvt_s8(h + NC * 2 + (2 * j + 1) * NC + v * VW);
            } else {
                dw = kd * cvt_u8(h + NC * 4 + j * NC + v * VW);
                if (has_min(fmt))
                    mw = -(loadh(h + NC * 2 + 2 * v * VW) * cvt_u8(h + NC * 4 + KB * NC + j * NC + v * VW));
            }
        } else {
            const uint8_t *blk = panel + b * block_stride(fmt);
            const int64_t at = half_scales(fmt) ? 2 * v * VW : 4 * v * VW;
            dw = half_scales(fmt) ? loadh(blk + at) : loadf((const float *)(blk + at));
            if (has_min(fmt) || two_scales(fmt))
                mw = half_scales(fmt) ? loadh(blk + scale_row(fmt) + at)
                                      : loadf((const float *)(blk + scale_row(fmt) + at));
        }
        storef(dst + v * VW, dw);
        storef(dst + NC + v * VW, mw);
    }
}
#endif

/* Rows [0, m) (m <= RMAX, a constant at each call site) against vectors v0 .. v0 + nv - 1 of one
 * panel (the columns v0 * VW .. (v0 + nv) * VW - 1), SIMD. vnni: the dot is vpdpbusd (unsigned
 * stored weights, offset corrected after); else maddubs (Q8_0 signed). Every step is per lane, so
 * a column's result does not depend on which vectors or rows share its pass. */
INLINE void rows_simd_cols(const int fmt, const int vnni, const qrows *x, int64_t r0, const int m, const int v0,
                           const int nv, const uint8_t *panel, const float *bias, float *y, int64_t ldy,
                           int cols, const int pf, const int U, const uint8_t *unp) {
    vfl acc[RMAX][V];
    for (int i = 0; i < m; ++i)
        for (int v = v0; v < v0 + nv; ++v) acc[i][v] = zerof();
    const int min = has_min(fmt);
    const int signed_dot = !vnni && form(fmt) == FMT_Q8_0;
    const int off = signed_dot ? 0 : offset(fmt);
    const int nc = off && !two_scales(fmt) && !q2k(fmt); /* the sums start from -off * sx */
    const int two_off = off && two_scales(fmt); /* I8_16's: from -off * sh, per half (Q2_K: off 0) */
    const int64_t stride = block_stride(fmt), sb = scale_bytes(fmt);
    const int8_t *xr[RMAX];
    for (int i = 0; i < m; ++i) xr[i] = x->q + (r0 + i) * x->k;
    vfl kd[V], kdm[V]; /* K forms: the current super-block's d and dmin */
    for (int v = v0; v < v0 + nv; ++v) kd[v] = kdm[v] = zerof();
    for (int64_t b = 0; b < x->nb; ++b) {
        const uint8_t *blk = panel + b * stride;
        const uint8_t *qs = U ? unp + b * (int64_t)(QK * NC) : is_k(fmt) ? block_qs(fmt, panel, b) : blk + sb;
        if (v0 > 0 || !pf) { /* rows_wide's second pass, or an item's later rows: the panel's bytes came in
                              * with its first pass (in L1: the prefetches measured as a third of the time
                              * at 32 rows) */
        } else
        if (is_k(fmt)) { /* the next super-block's header at its start, the quants PREFETCH_BLOCKS ahead */
            if (b % KB == 0)
                for (int64_t o = 0; o < k_header(fmt); o += 64)
                    __builtin_prefetch(panel + (b / KB + 1) * k_stride(fmt) + o, 0, PREFETCH_LOCALITY);
            for (int64_t o = 0; o < quant_bytes(fmt); o += 64) {
                __builtin_prefetch(qs + PREFETCH_BLOCKS * quant_bytes(fmt) + o, 0, PREFETCH_LOCALITY);
                if (PREFETCH_NEAR) __builtin_prefetch(qs + PREFETCH_NEAR * quant_bytes(fmt) + o, 0, 3);
            }
        } else {
            for (int64_t o = 0; o < stride; o += 64) {
                __builtin_prefetch(blk + PREFETCH_BLOCKS * stride + o, 0, PREFETCH_LOCALITY);
                if (PREFETCH_NEAR) __builtin_prefetch(blk + PREFETCH_NEAR * stride + o, 0, 3);
            }
        }
        vi isum[RMAX][V], isum1[RMAX][V]; /* isum1: I8_16's second sub-block (k steps 16..31) */
        for (int i = 0; i < m; ++i) {
            vi z = nc ? seti(x->ncorr + (r0 + i) * x->nb + b) : zeroi(), z1 = zeroi();
            if (two_off) { /* the halves' offsets, -off * sh, taken out up front (the same integers) */
                const int64_t at = (r0 + i) * x->nb + b;
                const int32_t c0 = -off * x->sh[2 * at], c1 = -off * x->sh[2 * at + 1];
                z = seti(&c0);
                z1 = seti(&c1);
            }
            for (int v = v0; v < v0 + nv; ++v) {
                isum[i][v] = z;
                isum1[i][v] = z1;
            }
        }
        if (!U && q2k(fmt)) { /* crumbs 0..3: maddubs pairs at most 2 * 3 * 127, folded at once */
            for (int sl = 0; sl < 2; ++sl) {
                vi raw[V];
                for (int v = v0; v < v0 + nv; ++v) raw[v] = loadi(qs + (sl * NC + v * VW) * 4);
                for (int t = 0; t < 4; ++t) {
                    const int g = sl + 2 * t;
                    vi w[V];
                    for (int v = v0; v < v0 + nv; ++v) w[v] = crumb(raw[v], t);
                    for (int i = 0; i < m; ++i) {
                        const vi xb = bcast4(xr[i] + b * QK + 4 * g);
                        for (int v = v0; v < v0 + nv; ++v) {
                            vi *s = g < 4 ? &isum[i][v] : &isum1[i][v];
                            *s = vnni ? dot_vnni(*s, w[v], xb) : dot_bw(*s, w[v], xb);
                        }
                    }
                }
            }
        } else if (!U && iq4xs(fmt)) { /* nibble indices to Q8_0's stored bytes, then Q8_0's dot */
            const vi table = iq4_table();
            for (int g = 0; g < 4; ++g) {
                vi lo[V], hi[V];
                for (int v = v0; v < v0 + nv; ++v) {
                    const vi raw = loadi(qs + (g * NC + v * VW) * 4);
                    lo[v] = lookup(table, lo_nib(raw));
                    hi[v] = lookup(table, hi_nib(raw));
                }
                for (int i = 0; i < m; ++i) {
                    const vi xl = bcast4(xr[i] + b * QK + 4 * g), xh = bcast4(xr[i] + b * QK + 4 * (g + 4));
                    for (int v = v0; v < v0 + nv; ++v) {
                        if (vnni) {
                            isum[i][v] = dot_vnni(isum[i][v], lo[v], xl);
                            isum[i][v] = dot_vnni(isum[i][v], hi[v], xh);
                        } else {
                            isum[i][v] = dot_bw_signed(isum[i][v], lo[v], xl);
                            isum[i][v] = dot_bw_signed(isum[i][v], hi[v], xh);
                        }
                    }
                }
            }
        } else if (!U && nibbles(fmt)) {
            vi h5[V], h6[V]; /* fifth bits (bit g of byte e: group g's), or Q6_K's two pair planes */
            if (fifth_bits(fmt) || high_pairs(fmt))
                for (int v = v0; v < v0 + nv; ++v) h5[v] = loadi(qs + nibble_bytes() + v * VW * 4);
            if (high_pairs(fmt))
                for (int v = v0; v < v0 + nv; ++v) h6[v] = loadi(qs + nibble_bytes() + NC * 4 + v * VW * 4);
            /* maddubs without VNNI: its int16 products summed in int16 before widening, exact while
             * |sum| <= 32767: a product pair is at most 2 * 127 * (15, 31, 63) for 4-, 5-, 6-bit
             * quants, so an int16 sum takes 8, 4 or 2 of them; folded into int32 every `every` groups. */
            const int per_group = two_scales(fmt) ? 1 : 2;
            const int terms = (high_pairs(fmt) ? 2 : fifth_bits(fmt) ? 4 : 8) / per_group;
            const int every = terms < 4 ? terms : 4; /* a block's 4 groups at most */
            vi p0[RMAX][V], p1[RMAX][V];
            for (int i = 0; i < m; ++i)
                for (int v = v0; v < v0 + nv; ++v) p0[i][v] = p1[i][v] = zeroi(); /* (set before use below) */
            for (int g = 0; g < 4; ++g) {
                vi lo[V], hi[V];
                for (int v = v0; v < v0 + nv; ++v) {
                    const vi raw = loadi(qs + (g * NC + v * VW) * 4);
                    lo[v] = lo_nib(raw);
                    hi[v] = hi_nib(raw);
                    if (fifth_bits(fmt)) {
                        lo[v] = with_bit(lo[v], h5[v], g);
                        hi[v] = with_bit(hi[v], h5[v], g + 4);
                    }
                    if (high_pairs(fmt)) {
                        lo[v] = ori(lo[v], pair_bits(h5[v], g));
                        hi[v] = ori(hi[v], pair_bits(h6[v], g));
                    }
                }
                for (int i = 0; i < m; ++i) {
#if defined(__AVX512F__)
                    if (vnni && nv == 1) { /* rows_wide: the broadcasts inside the dots */
                        const int8_t *xp = xr[i] + b * QK + 4 * g;
                        isum[i][v0] = dot_vnni_at(isum[i][v0], lo[v0], xp);
                        if (two_scales(fmt))
                            isum1[i][v0] = dot_vnni_at(isum1[i][v0], hi[v0], xp + 16);
                        else
                            isum[i][v0] = dot_vnni_at(isum[i][v0], hi[v0], xp + 16);
                        continue;
                    }
#endif
                    const vi xl = bcast4(xr[i] + b * QK + 4 * g), xh = bcast4(xr[i] + b * QK + 4 * (g + 4));
                    for (int v = v0; v < v0 + nv; ++v) {
                        if (vnni) {
                            isum[i][v] = dot_vnni(isum[i][v], lo[v], xl);
                            if (two_scales(fmt)) /* Q6_K: groups g + 4 are the block's second 16 */
                                isum1[i][v] = dot_vnni(isum1[i][v], hi[v], xh);
                            else
                                isum[i][v] = dot_vnni(isum[i][v], hi[v], xh);
                            continue;
                        }
                        const vi a = mul16(lo[v], xl), c = mul16(hi[v], xh);
                        const int first = g % every == 0;
                        if (two_scales(fmt)) {
                            p0[i][v] = first ? a : add16(p0[i][v], a);
                            p1[i][v] = first ? c : add16(p1[i][v], c);
                        } else {
                            p0[i][v] = first ? add16(a, c) : add16(p0[i][v], add16(a, c));
                        }
                        if (g % every == every - 1) {
                            isum[i][v] = fold16(isum[i][v], p0[i][v]);
                            if (two_scales(fmt)) isum1[i][v] = fold16(isum1[i][v], p1[i][v]);
                        }
                    }
                }
            }
        } else if (two_scales(fmt)) {
            for (int g = 0; g < 8; ++g) {
                vi w[V];
                for (int v = v0; v < v0 + nv; ++v) w[v] = loadi(qs + (g * NC + v * VW) * 4);
                for (int i = 0; i < m; ++i) {
                    const vi xb = bcast4(xr[i] + b * QK + 4 * g);
                    for (int v = v0; v < v0 + nv; ++v)
                        if (g < 4)
                            isum[i][v] = vnni ? dot_vnni(isum[i][v], w[v], xb) : dot_bw(isum[i][v], w[v], xb);
                        else
                            isum1[i][v] = vnni ? dot_vnni(isum1[i][v], w[v], xb) : dot_bw(isum1[i][v], w[v], xb);
                }
            }
        } else {
            for (int g = 0; g < 8; ++g) {
                vi w[V];
                for (int v = v0; v < v0 + nv; ++v) w[v] = loadi(qs + (g * NC + v * VW) * 4);
                for (int i = 0; i < m; ++i) {
                    const vi xb = bcast4(xr[i] + b * QK + 4 * g);
                    for (int v = v0; v < v0 + nv; ++v)
                        isum[i][v] = vnni         ? dot_vnni(isum[i][v], w[v], xb)
                                     : signed_dot ? dot_bw_signed(isum[i][v], w[v], xb)
                                                  : dot_bw(isum[i][v], w[v], xb);
                }
            }
        }
        vfl dw[V], mw[V], dw1[V], mw1[V]; /* dw1, mw1: Q2_K's second half */
        if (U) { /* made with the unpacked quants (unpack_scales) */
            const float *us = (const float *)(unp + x->nb * (int64_t)(QK * NC)) + b * 2 * NC;
            for (int v = v0; v < v0 + nv; ++v) {
                dw[v] = loadf(us + v * VW);
                mw[v] = loadf(us + NC + v * VW);
            }
        } else if (is_k(fmt)) { /* block b's scales from its super-block's (exact products) */
            const uint8_t *h = panel + (b / KB) * k_stride(fmt);
            const int j = (int)(b % KB);
            if (j == 0) /* the super-block's d (and dmin), once */
                for (int v = v0; v < v0 + nv; ++v) {
                    kd[v] = loadh(h + 2 * v * VW);
                    if (has_min(fmt)) kdm[v] = loadh(h + NC * 2 + 2 * v * VW);
                }
            for (int v = v0; v < v0 + nv; ++v) {
                if (q2k(fmt)) {
                    const uint8_t *sm = h + NC * 4 + 2 * j * NC + v * VW;
                    dw[v] = kd[v] * cvt_lo4(sm);
                    mw[v] = -(kdm[v] * cvt_hi4(sm));
                    dw1[v] = kd[v] * cvt_lo4(sm + NC);
                    mw1[v] = -(kdm[v] * cvt_hi4(sm + NC));
                } else if (iq4xs(fmt)) {
                    dw[v] = kd[v] * cvt_s8(h + NC * 2 + j * NC + v * VW);
                } else if (two_scales(fmt)) {
                    dw[v] = kd[v] * cvt_s8(h + NC * 2 + 2 * j * NC + v * VW);
                    mw[v] = kd[v] * cvt_s8(h + NC * 2 + (2 * j + 1) * NC + v * VW);
                } else {
                    dw[v] = kd[v] * cvt_u8(h + NC * 4 + j * NC + v * VW);
                    mw[v] = -(kdm[v] * cvt_u8(h + NC * 4 + KB * NC + j * NC + v * VW));
                }
            }
        } else
        for (int v = v0; v < v0 + nv; ++v) {
            const int64_t at = half_scales(fmt) ? 2 * v * VW : 4 * v * VW;
            dw[v] = half_scales(fmt) ? loadh(blk + at) : loadf((const float *)(blk + at));
            if (min || two_scales(fmt)) /* the second row: minimums, or I8_16's second scales */
                mw[v] = half_scales(fmt) ? loadh(blk + scale_row(fmt) + at)
                                         : loadf((const float *)(blk + scale_row(fmt) + at));
        }
        for (int i = 0; i < m; ++i) {
            const int64_t at = (r0 + i) * x->nb + b;
            const vfl dx = setf(x->dx[at]);
            const vfl dxs = setf(x->dxs[at]);
            if (q2k(fmt)) { /* block_term2m's order, lane by lane */
                float s0 = x->dx[at] * (float)x->sh[2 * at], s1 = x->dx[at] * (float)x->sh[2 * at + 1];
                KEEP(s0);
                KEEP(s1);
                const vfl dxs0 = setf(s0), dxs1 = setf(s1);
                for (int v = v0; v < v0 + nv; ++v) {
                    vfl t = keepv(keepv(dw[v] * dx) * cvt(isum[i][v]));
                    t = keepv(t + keepv(mw[v] * dxs0));
                    vfl u = keepv(keepv(dw1[v] * dx) * cvt(isum1[i][v]));
                    u = keepv(u + keepv(mw1[v] * dxs1));
                    t = keepv(t + u);
                    acc[i][v] = acc[i][v] + t;
                }
                continue;
            }
            if (two_scales(fmt)) { /* (the offsets are in the sums already: two_off) */
                for (int v = v0; v < v0 + nv; ++v) {
                    vfl t = keepv(keepv(dw[v] * dx) * cvt(isum[i][v]));
                    const vfl u = keepv(keepv(mw[v] * dx) * cvt(isum1[i][v]));
                    t = keepv(t + u);
                    acc[i][v] = acc[i][v] + t;
                }
                continue;
            }
            const int32_t corr = off * x->sx[at];
            for (int v = v0; v < v0 + nv; ++v) {
                const vi s = off && !nc ? subi(isum[i][v], corr) : isum[i][v];
                vfl t = keepv(keepv(dw[v] * dx) * cvt(s));
                if (min) t = keepv(t + keepv(mw[v] * dxs));
                acc[i][v] = acc[i][v] + t;
            }
        }
    }
    float out[RMAX][NC];
    for (int i = 0; i < m; ++i)
        for (int v = v0; v < v0 + nv; ++v) storef(out[i] + v * VW, acc[i][v]);
    store_cols(out, m, bias, y, ldy, v0 * VW, cols < (v0 + nv) * VW ? cols : (v0 + nv) * VW);
}

/* rows_simd: rows [0, m) (m <= MR) against the whole panel. */
INLINE void rows_simd(const int fmt, const int vnni, const qrows *x, int64_t r0, const int m, const uint8_t *panel,
                      const float *bias, float *y, int64_t ldy, int cols, const int pf) {
    rows_simd_cols(fmt, vnni, x, r0, m, 0, V, panel, bias, y, ldy, cols, pf, 0, NULL);
}

/* rows_wide: rows [0, m) (m: MRW, or MRW2 for the forms with two sums a row) one vector of the
 * panel at a time (VNNI): a vector's sums for m rows take 2m (3m) registers, so twice MR's rows fit
 * and the unpacked quants, the block's scales and the prefetches serve them all; the float steps
 * per row are the same. For calls of 16 rows or more (prefill chunks, batched decodes); the
 * panel's bytes are read twice, from L1. */
#if defined(__AVX512F__)
INLINE void rows_wide(const int fmt, const int vnni, const qrows *x, int64_t r0, const int m, const uint8_t *panel,
                      const float *bias, float *y, int64_t ldy, int cols, const int pf) {
    /* (each v a constant: the sums' arrays stay in registers) */
    rows_simd_cols(fmt, vnni, x, r0, m, 0, 1, panel, bias, y, ldy, cols, pf, 0, NULL);
    if (cols > VW) rows_simd_cols(fmt, vnni, x, r0, m, 1, 1, panel, bias, y, ldy, cols, 0, 0, NULL);
#if V != 2
#error "rows_wide is written for two vectors a panel"
#endif
}
#endif

/* Rows [0, m) (m <= MRK, a constant at each call site) against one panel of a nibble K form (Q4_K,
 * Q5_K, Q6_K, Q3_K): a decode step's GEMV (m = 1) and a prefill's GEMM. rows_simd keeps every vector
 * of the panel live through a block (for Q6_K: two pair planes and, per row, two int16 and two
 * int32 sums, V of each), more than AVX2's 16 registers; here each vector v of the panel (VW
 * columns) runs the block's 4 groups for all m rows before the next v, so only its own sums are
 * live, and its unpacked quants serve the m rows. The integer sums are the same integers and the
 * float steps the same operations in the same order, lane by lane: bit-equal to rows_simd and to
 * rows_generic. */
INLINE void rows_k(const int fmt, const int vnni, const qrows *x, int64_t r0, const int m, const uint8_t *panel,
                   const float *bias, float *y, int64_t ldy, int cols, const int pf) {
    vfl acc[MRK][V];
    for (int i = 0; i < m; ++i)
        for (int v = 0; v < V; ++v) acc[i][v] = zerof();
    const int off = offset(fmt), min = has_min(fmt), two = two_scales(fmt);
    const int per_group = two ? 1 : 2;
    const int terms = (high_pairs(fmt) ? 2 : fifth_bits(fmt) ? 4 : 8) / per_group;
    const int every = terms < 4 ? terms : 4;
    const int8_t *xr[MRK];
    for (int i = 0; i < m; ++i) xr[i] = x->q + (r0 + i) * x->k;
    const int64_t qb = quant_bytes(fmt), ks = k_stride(fmt), kh = k_header(fmt);
    for (int64_t s = 0; s < x->nb / KB; ++s) {
        const uint8_t *h = panel + s * ks;
        if (pf)
            for (int64_t o = 0; o < kh; o += 64) __builtin_prefetch(h + ks + o, 0, PREFETCH_LOCALITY);
        for (int j = 0; j < KB; ++j) {
            const int64_t b = s * KB + j;
            const uint8_t *qs = h + kh + j * qb;
            for (int64_t o = 0; pf && o < qb; o += 64) {
                __builtin_prefetch(qs + PREFETCH_BLOCKS * qb + o, 0, PREFETCH_LOCALITY);
                if (PREFETCH_NEAR) __builtin_prefetch(qs + PREFETCH_NEAR * qb + o, 0, 3);
            }
#pragma GCC unroll 1
            for (int v = 0; v < V; ++v) {
                vi isum[MRK], isum1[MRK], p0[MRK], p1[MRK];
                for (int i = 0; i < m; ++i) isum[i] = isum1[i] = p0[i] = p1[i] = zeroi();
                vi h5, h6;
                nibble_planes(fmt, qs, v, &h5, &h6);
                for (int g = 0; g < 4; ++g) {
                    vi lo, hi;
                    nibble_group(fmt, qs, v, g, h5, h6, &lo, &hi);
                    for (int i = 0; i < m; ++i) {
                        const vi xl = bcast4(xr[i] + b * QK + 4 * g), xh = bcast4(xr[i] + b * QK + 4 * (g + 4));
                        if (vnni) {
                            isum[i] = dot_vnni(isum[i], lo, xl);
                            if (two)
                                isum1[i] = dot_vnni(isum1[i], hi, xh);
                            else
                                isum[i] = dot_vnni(isum[i], hi, xh);
                            continue;
                        }
                        const vi a = mul16(lo, xl), c = mul16(hi, xh);
                        const int first = g % every == 0;
                        if (two) {
                            p0[i] = first ? a : add16(p0[i], a);
                            p1[i] = first ? c : add16(p1[i], c);
                        } else {
                            p0[i] = first ? add16(a, c) : add16(p0[i], add16(a, c));
                        }
                        if (g % every == every - 1) {
                            isum[i] = fold16(isum[i], p0[i]);
                            if (two) isum1[i] = fold16(isum1[i], p1[i]);
                        }
                    }
                }
                /* block b's scales for these VW columns (exact products of the header's values) */
                const vfl kd = loadh(h + 2 * v * VW);
                vfl dw, second;
                if (two) {
                    dw = kd * cvt_s8(h + NC * 2 + 2 * j * NC + v * VW);
                    second = kd * cvt_s8(h + NC * 2 + (2 * j + 1) * NC + v * VW);
                } else {
                    dw = kd * cvt_u8(h + NC * 4 + j * NC + v * VW);
                    second = zerof();
                    if (min) second = -(loadh(h + NC * 2 + 2 * v * VW) * cvt_u8(h + NC * 4 + KB * NC + j * NC + v * VW));
                }
                for (int i = 0; i < m; ++i) {
                    const int64_t at = (r0 + i) * x->nb + b;
                    const vfl dx = setf(x->dx[at]);
                    if (two) {
                        const int32_t c0 = off * x->sh[2 * at], c1 = off * x->sh[2 * at + 1];
                        vfl t = keepv(keepv(dw * dx) * cvt(subi(isum[i], c0)));
                        const vfl u = keepv(keepv(second * dx) * cvt(subi(isum1[i], c1)));
                        t = keepv(t + u);
                        acc[i][v] = acc[i][v] + t;
                    } else {
                        const vi si = off ? subi(isum[i], off * x->sx[at]) : isum[i];
                        vfl t = keepv(keepv(dw * dx) * cvt(si));
                        if (min) t = keepv(t + keepv(second * setf(x->dxs[at])));
                        acc[i][v] = acc[i][v] + t;
                    }
                }
            }
        }
    }
    float out[MRK][NC];
    for (int i = 0; i < m; ++i)
        for (int v = 0; v < V; ++v) storef(out[i] + v * VW, acc[i][v]);
    store_rows(out, m, bias, y, ldy, cols);
}
#endif

/* rows_k runs a single row of a nibble K form, and Q6_K's rows KROWS at a time (AVX2: its 4 sums a
 * row allow 2 in 16 registers); Q4_K's, Q5_K's, Q3_K's pairs of rows stay on rows_simd, which
 * measured faster there (kquant_gemv: rows_k at 4 rows 0.9x). */
#define NIBBLE_K(FMT) (is_k(FMT) && nibbles(FMT) && !iq4xs(FMT))
#define ON_ROWS_K(FMT, M) (NIBBLE_K(FMT) && (high_pairs(FMT) || (M) == 1))
#if defined(__AVX2__) && !defined(__AVX512F__)
#define KROWS 2
#else
#define KROWS MRK
#endif

typedef void (*item_fn)(const qrows *x, int64_t r0, int64_t rows, const uint8_t *panel, const float *bias,
                        float *y, int64_t ldy, int cols);

/* A format's work item: its rows MR at a time, then the rest (each count its own loop). */
#ifdef VW
#define ROWS(FMT, VNNI, M)                                                                        \
    (ON_ROWS_K(FMT, M) ? rows_k(FMT, VNNI, x, r0 + i, M, panel, bias, y + i * ldy, ldy, cols, i == 0) \
                       : rows_simd(FMT, VNNI, x, r0 + i, M, panel, bias, y + i * ldy, ldy, cols, i == 0))
#else
#define ROWS(FMT, VNNI, M) rows_generic(FMT, x, r0 + i, M, panel, bias, y + i * ldy, ldy, cols)
#endif
#if defined(__AVX512F__)
#define WIDE_ROWS(FMT) (two_scales(FMT) ? MRW2 : MRW)
/* VNNI, a K form and a call of 16 rows or more: rows_wide's passes first, then the rest as below.
 * (The 32-weight-block forms, Q5_0 the most used of them, measured no faster on rows_wide: 0.93-1.03x
 * of rows_simd at 512 rows.) */
#define WIDE(FMT, VNNI)                                                                                  \
    if ((VNNI) && is_k(FMT) && rows >= 16)                                                               \
        for (; i + WIDE_ROWS(FMT) <= rows; i += WIDE_ROWS(FMT))                                          \
            rows_wide(FMT, VNNI, x, r0 + i, WIDE_ROWS(FMT), panel, bias, y + i * ldy, ldy, cols, i == 0);
#else
#define WIDE(FMT, VNNI)
#endif
/* An item's rows from i on through R (ROWS or ROWS_U), STEP (at most 4, a constant) a pass, then the
 * rest (each count its own loop). */
#define PASSES(R, FMT, VNNI, STEP)                                                                       \
    for (; i + (STEP) <= rows; i += (STEP)) R(FMT, VNNI, STEP);                                          \
    switch (rows - i) {                                                                                  \
        case 1: R(FMT, VNNI, 1); break;                                                                  \
        case 2: R(FMT, VNNI, 2 % (STEP)); break;                                                         \
        case 3: R(FMT, VNNI, 3 % (STEP)); break;                                                         \
        default: break;                                                                                  \
    }
#if defined(__AVX512F__)
#define UNPACKS(FMT) (nibbles(FMT) && !iq4xs(FMT))
#define ROWS_U(FMT, VNNI, M) \
    rows_simd_cols(FMT, VNNI, x, r0 + i, M, 0, V, panel, bias, y + i * ldy, ldy, cols, 0, 1, u)
/* VNNI, a nibble form and unpack_rows or more: the panel unpacked once (its quants and its blocks'
 * scales), then MR rows a pass. */
#define UNPACKED(FMT, VNNI)                                                                              \
    if ((VNNI) && UNPACKS(FMT) && rows >= unpack_rows(FMT, x->k)) {                                  \
        uint8_t *u = unpacked_buffer((size_t)x->nb * (QK * NC + 2 * NC * sizeof(float)));                \
        if (u) {                                                                                         \
            float *us = (float *)(u + x->nb * (int64_t)(QK * NC));                                       \
            for (int64_t b = 0; b < x->nb; ++b) {                                                        \
                unpack_block(FMT, panel, b, u + b * (QK * NC), 0);                                       \
                unpack_scales(FMT, panel, b, us + b * 2 * NC);                                           \
            }                                                                                            \
            PASSES(ROWS_U, FMT, VNNI, MR)                                                                \
            return;                                                                                      \
        }                                                                                                \
    }
#else
#define UNPACKED(FMT, VNNI)
#endif
#define DEFINE_ITEM(NAME, FMT, VNNI)                                                                     \
    static void NAME(const qrows *x, int64_t r0, int64_t rows, const uint8_t *panel, const float *bias, \
                     float *y, int64_t ldy, int cols) {                                                  \
        int64_t i = 0;                                                                                   \
        UNPACKED(FMT, VNNI)                                                                              \
        WIDE(FMT, VNNI)                                                                                  \
        if (high_pairs(FMT)) { /* Q6_K: KROWS rows a pass (at most 4) */                                  \
            PASSES(ROWS, FMT, VNNI, KROWS)                                                               \
            return;                                                                                      \
        }                                                                                                \
        PASSES(ROWS, FMT, VNNI, MR)                                                                      \
    }
#define DEFINE_ITEMS(PREFIX, VNNI)                                                                       \
    DEFINE_ITEM(PREFIX##q8_0, FMT_Q8_0, VNNI)                                                            \
    DEFINE_ITEM(PREFIX##q4_0, FMT_Q4_0, VNNI)                                                            \
    DEFINE_ITEM(PREFIX##q4_1, FMT_Q4_1, VNNI)                                                            \
    DEFINE_ITEM(PREFIX##u8_1, FMT_U8_1, VNNI)                                                            \
    DEFINE_ITEM(PREFIX##q8_0_h, FMT_Q8_0 | FMT_HALF, VNNI)                                               \
    DEFINE_ITEM(PREFIX##q4_0_h, FMT_Q4_0 | FMT_HALF, VNNI)                                               \
    DEFINE_ITEM(PREFIX##q4_1_h, FMT_Q4_1 | FMT_HALF, VNNI)                                               \
    DEFINE_ITEM(PREFIX##u8_1_h, FMT_U8_1 | FMT_HALF, VNNI)                                               \
    DEFINE_ITEM(PREFIX##i8_16, FMT_I8_16, VNNI)                                                          \
    DEFINE_ITEM(PREFIX##i8_16_h, FMT_I8_16 | FMT_HALF, VNNI)                                             \
    DEFINE_ITEM(PREFIX##q5_0, FMT_Q5_0, VNNI)                                                            \
    DEFINE_ITEM(PREFIX##q5_1, FMT_Q5_1, VNNI)                                                            \
    DEFINE_ITEM(PREFIX##q5_0_h, FMT_Q5_0 | FMT_HALF, VNNI)                                               \
    DEFINE_ITEM(PREFIX##q5_1_h, FMT_Q5_1 | FMT_HALF, VNNI)                                               \
    DEFINE_ITEM(PREFIX##q4_k, FMT_Q4_1 | FMT_K, VNNI)                                                    \
    DEFINE_ITEM(PREFIX##q5_k, FMT_Q5_1 | FMT_K, VNNI)                                                    \
    DEFINE_ITEM(PREFIX##q6_k, FMT_I8_16 | FMT_K, VNNI)                                                   \
    DEFINE_ITEM(PREFIX##q3_k, FMT_I8_16 | FMT_K | FMT_HALF, VNNI)                                        \
    DEFINE_ITEM(PREFIX##q2_k, FMT_Q2 | FMT_K, VNNI)                                                      \
    DEFINE_ITEM(PREFIX##iq4_xs, FMT_Q8_0 | FMT_K, VNNI)                                                  \
    static const item_fn PREFIX##items[FMT_COUNT] = {                                                    \
        [FMT_Q8_0] = PREFIX##q8_0,                                                                       \
        [FMT_Q4_0] = PREFIX##q4_0,                                                                       \
        [FMT_Q4_1] = PREFIX##q4_1,                                                                       \
        [FMT_U8_1] = PREFIX##u8_1,                                                                       \
        [FMT_I8_16] = PREFIX##i8_16,                                                                     \
        [FMT_Q5_0] = PREFIX##q5_0,                                                                       \
        [FMT_Q5_1] = PREFIX##q5_1,                                                                       \
        [FMT_Q8_0 | FMT_HALF] = PREFIX##q8_0_h,                                                          \
        [FMT_Q4_0 | FMT_HALF] = PREFIX##q4_0_h,                                                          \
        [FMT_Q4_1 | FMT_HALF] = PREFIX##q4_1_h,                                                          \
        [FMT_U8_1 | FMT_HALF] = PREFIX##u8_1_h,                                                          \
        [FMT_I8_16 | FMT_HALF] = PREFIX##i8_16_h,                                                        \
        [FMT_Q5_0 | FMT_HALF] = PREFIX##q5_0_h,                                                          \
        [FMT_Q5_1 | FMT_HALF] = PREFIX##q5_1_h,                                                          \
        [FMT_Q4_1 | FMT_K] = PREFIX##q4_k,                                                               \
        [FMT_Q5_1 | FMT_K] = PREFIX##q5_k,                                                               \
        [FMT_I8_16 | FMT_K] = PREFIX##q6_k,                                                              \
        [FMT_I8_16 | FMT_K | FMT_HALF] = PREFIX##q3_k,                                                   \
        [FMT_Q2 | FMT_K] = PREFIX##q2_k,                                                                 \
        [FMT_Q8_0 | FMT_K] = PREFIX##iq4_xs};
DEFINE_ITEMS(plain_, 0)
#ifdef VW
DEFINE_ITEMS(vnni_, 1)
#endif

/* VNNI where the CPU has it (AVX-512 VNNI for the avx512 build, AVX-VNNI for avx2); tests may turn
 * it off to check the other path. */
static int use_vnni = -1;
static int vnni_active(void) {
#if defined(__x86_64__) && defined(__AVX512F__)
    if (use_vnni < 0) use_vnni = __builtin_cpu_supports("avx512vnni") != 0;
    return use_vnni;
#elif defined(__x86_64__) && defined(__AVX2__)
    if (use_vnni < 0) use_vnni = __builtin_cpu_supports("avxvnni") != 0;
    return use_vnni;
#else
    return 0;
#endif
}

/* on: 1 use VNNI where available, 0 never, -1 leave. Returns whether VNNI runs now. */
int32_t llmserve_qi8_vnni(int32_t on) {
    if (on == 0) use_vnni = 0;
    if (on == 1) use_vnni = -1;
    return vnni_active();
}

/* AMX (Intel's tile matrix unit), where the OS grants it: the same integer block sums as vpdpbusd,
 * 16 rows x 16 columns x 32 (or 16) k steps an instruction (TDPBSSD: signed activation bytes times
 * the weight's quants less the format's offset, signed bytes, summed exactly in int32: vpdpbusd's
 * isum - offset * sx), then the float steps of rows_simd in the same order, lane by lane; so a row's result is the same bits as on every other path. A work item's
 * rows go 16 at a time (the rest through the VNNI rows); its panel's blocks are unpacked once into the
 * weight tile's layout, [group of 4 k][column][4] bytes, which is the packed byte forms' own layout.
 * Whether the OS grants the tiles is found by trying, never assumed: a forked child asks for them
 * (arch_prctl ARCH_REQ_XCOMP_PERM), runs one product and checks it; a machine that faults on them
 * loses only the child. LLMSERVE_AMX=0 turns the path off. */
#include "amx.h"
#ifdef AMX_PATH

/* Tiles: 0 the first (or only) k range's sums for 16 rows x 16 columns, 1 the second half's (formats
 * with a scale per 16 k steps); 4 the activations (16 rows x kbytes), 5 the 16 columns' weights; 2, 3,
 * 6, 7 the same for a second block in flight. */
static void amx_configure(int kbytes) {
    amx_config c;
    memset(&c, 0, sizeof c);
    c.palette_id = 1;
    for (int t = 0; t < 4; ++t) c.rows[t] = 16, c.colsb[t] = 64;
    for (int t = 4; t < 8; t += 2) {
        c.rows[t] = 16, c.colsb[t] = (uint16_t)kbytes;
        c.rows[t + 1] = (uint8_t)(kbytes / 4), c.colsb[t + 1] = 64;
    }
    __asm__ volatile("ldtilecfg %0" ::"m"(c));
}
/* A thread's buffer for a panel's unpacked weight bytes (a block: 8 groups x NC columns x 4). */
static uint8_t *amx_weights(size_t bytes) { return scratch_in(4, bytes); }

/* Block b of the panel as the weight tile reads it: [group g 0..7][column][4] signed bytes, the
 * stored quant less the format's offset (TDPBSSD's sum is then rows_simd's isum - offset * sx, the
 * same integer), groups 0-3 the block's first 16 k steps; unpacked once for all the item's rows.
 * Q8_0 (its stored byte less 128) runs here from 64 rows: an LM head's GEMM (Qwen2.5-Coder-0.5B's,
 * 151,936 x 896) measured 1.10-1.15x over VNNI at 64-128 rows, 0.95-1.02x at 32. The other byte forms
 * (I8_16, U8_1: K-quants without their super-blocks) stay on VNNI: read in place, the tiles measured
 * no faster on them (1.00-1.06x at 64-512 rows, slower below), the float steps being most of their
 * work; so do Q4_1 and Q5_1, whose blocks each carry a minimum
 * (two more float steps: 0.88-1.16x at SmolLM2's shapes, 0.97x on its 64-request run). */
INLINE void amx_unpack(const int fmt, const uint8_t *panel, int64_t b, uint8_t *dst) {
    const uint8_t *qs = is_k(fmt) ? block_qs(fmt, panel, b) : panel + b * block_stride(fmt) + scale_bytes(fmt);
    const vi off = _mm512_set1_epi8((char)offset(fmt));
#define PUT(g, v, val) _mm512_storeu_si512((void *)(dst + (g) * NC * 4 + (v) * VW * 4), _mm512_sub_epi8((val), off))
    if (q2k(fmt)) {
        for (int sl = 0; sl < 2; ++sl)
            for (int v = 0; v < V; ++v) {
                const vi raw = loadi(qs + (sl * NC + v * VW) * 4);
                for (int t = 0; t < 4; ++t) PUT(sl + 2 * t, v, crumb(raw, t));
            }
        return;
    }
    if (byte_q8(fmt)) { /* the stored q + 128 less 128: q, a signed byte */
        for (int g = 0; g < 8; ++g)
            for (int v = 0; v < V; ++v) PUT(g, v, loadi(qs + (g * NC + v * VW) * 4));
        return;
    }
    if (iq4xs(fmt)) {
        const vi table = iq4_table();
        for (int g = 0; g < 4; ++g)
            for (int v = 0; v < V; ++v) {
                const vi raw = loadi(qs + (g * NC + v * VW) * 4);
                PUT(g, v, lookup(table, lo_nib(raw)));
                PUT(g + 4, v, lookup(table, hi_nib(raw)));
            }
        return;
    }
    unpack_block(fmt, panel, b, dst, offset(fmt));
#undef PUT
}

/* Block b's scales for the panel's vector v (rows_simd's loads and exact products). */
INLINE void amx_scales(const int fmt, const uint8_t *panel, int64_t b, int v, vfl *kd, vfl *kdm, vfl *dw, vfl *mw,
                       vfl *dw1, vfl *mw1) {
    if (is_k(fmt)) {
        const uint8_t *hd = panel + (b / KB) * k_stride(fmt);
        const int j = (int)(b % KB);
        if (j == 0) {
            *kd = loadh(hd + 2 * v * VW);
            if (has_min(fmt)) *kdm = loadh(hd + NC * 2 + 2 * v * VW);
        }
        if (q2k(fmt)) {
            const uint8_t *sm = hd + NC * 4 + 2 * j * NC + v * VW;
            *dw = *kd * cvt_lo4(sm);
            *mw = -(*kdm * cvt_hi4(sm));
            *dw1 = *kd * cvt_lo4(sm + NC);
            *mw1 = -(*kdm * cvt_hi4(sm + NC));
        } else if (iq4xs(fmt)) {
            *dw = *kd * cvt_s8(hd + NC * 2 + j * NC + v * VW);
        } else if (two_scales(fmt)) {
            *dw = *kd * cvt_s8(hd + NC * 2 + 2 * j * NC + v * VW);
            *mw = *kd * cvt_s8(hd + NC * 2 + (2 * j + 1) * NC + v * VW);
        } else {
            *dw = *kd * cvt_u8(hd + NC * 4 + j * NC + v * VW);
            *mw = -(*kdm * cvt_u8(hd + NC * 4 + KB * NC + j * NC + v * VW));
        }
        return;
    }
    const uint8_t *blk = panel + b * block_stride(fmt);
    const int64_t at = half_scales(fmt) ? 2 * v * VW : 4 * v * VW;
    *dw = half_scales(fmt) ? loadh(blk + at) : loadf((const float *)(blk + at));
    if (has_min(fmt) || two_scales(fmt))
        *mw = half_scales(fmt) ? loadh(blk + scale_row(fmt) + at) : loadf((const float *)(blk + scale_row(fmt) + at));
}

/* Block b's products for 16 rows and the panel's vector v into sums[slot] (two slots, so that the
 * tiles of block b + 1 run while block b's float steps do): C tiles 0, 1 (slot 0) or 2, 3 (slot 1)
 * for the block's first and second 16 k steps, activations in tile 4 or 6, weights in 5 or 7. */
/* With a scale per 16 k steps: block n's operands for its two halves, activations (16 rows x 16 k
 * steps) in tiles 4 and 6, weights (16 k steps x 16 columns) in 5 and 7; the sums in 0, 1 (n even)
 * or 2, 3. */
#define AMX_HALVES_OPERANDS(n)                                                   \
    do {                                                                         \
        const int8_t *xa = x->q + rg * x->k + (n) * QK;                          \
        const uint8_t *w = wq + (n) * 8 * NC * 4 + v * VW * 4;                   \
        TILE_LOAD(4, xa, x->k);                                                  \
        TILE_LOAD(5, w, NC * 4);                                                 \
        TILE_LOAD(6, xa + 16, x->k);                                             \
        TILE_LOAD(7, w + 4 * NC * 4, NC * 4);                                    \
    } while (0)

/* Rows [0, 16 * groups) of an item against one panel on the tiles: per group of 16 rows and vector v
 * of the panel (16 columns), the blocks in order, the 16 rows' sums kept in registers; the float
 * steps are rows_simd's, in its order. A tile store holds back every load after it until it has
 * written (and it waits for its product's latency), so the order per block b is: block b + 1's
 * product(s) (operands loaded one block before), b's float steps (reading b's sums and the rows'
 * dx, dxs at fixed offsets of the call's copy by group), block b + 2's operands, then b + 1's sums
 * stored: the loads are issued before the store, not behind it. Measured at 512 rows, two threads,
 * against the product, store and float steps in that order: Q4_K 1.02-1.14x with the scales by
 * group, 1.06-1.14x more with the order (a standalone loop of the same: 34 -> 27 ns a 16 x 16 x 32
 * block); Q6_K (two sum tiles a block, its halves' operands in one set of four tiles) 1.08-1.09x. */
/* Block b's float steps for 16 rows and the panel's vector v (rows_simd's, in its order), from the
 * block's stored sums s0 (and s1: the second 16 k steps' where a scale covers 16), into acc. */
INLINE void amx_float_steps(const int fmt, const qrows *x, const uint8_t *panel, int64_t rg, int64_t b, int v,
                            int32_t s0p[16][VW], int32_t s1p[16][VW], vfl *kd, vfl *kdm, vfl acc[16]) {
    const int halves = two_scales(fmt), min = has_min(fmt);
    vfl dw = zerof(), mw = zerof(), dw1 = zerof(), mw1 = zerof();
    amx_scales(fmt, panel, b, v, kd, kdm, &dw, &mw, &dw1, &mw1);
    const float *dxb = x->dxt + ((rg >> 4) * x->nb + b) * 16, *dxsb = x->dxst + ((rg >> 4) * x->nb + b) * 16;
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) {
        const int64_t at = (rg + i) * x->nb + b;
        const vfl dx = setf(dxb[i]);
        const vi s0 = _mm512_load_si512((const void *)s0p[i]);
        vfl t;
        if (q2k(fmt)) {
            float e0 = x->dx[at] * (float)x->sh[2 * at], e1 = x->dx[at] * (float)x->sh[2 * at + 1];
            KEEP(e0);
            KEEP(e1);
            const vi s1 = _mm512_load_si512((const void *)s1p[i]);
            t = keepv(keepv(dw * dx) * cvt(s0));
            t = keepv(t + keepv(mw * setf(e0)));
            vfl u = keepv(keepv(dw1 * dx) * cvt(s1));
            u = keepv(u + keepv(mw1 * setf(e1)));
            t = keepv(t + u);
        } else if (halves) {
            const vi s1 = _mm512_load_si512((const void *)s1p[i]);
            t = keepv(keepv(dw * dx) * cvt(s0));
            const vfl u = keepv(keepv(mw * dx) * cvt(s1));
            t = keepv(t + u);
        } else {
            t = keepv(keepv(dw * dx) * cvt(s0));
            if (min) t = keepv(t + keepv(mw * setf(dxsb[i])));
        }
        acc[i] = acc[i] + t;
    }
}

/* A row of a group's output (its panel's 32 columns, two lines where the row is 64-byte aligned), asked
 * for with intent to write: PREFETCHW, which every AMX CPU has. */
#define PREFETCHW_ROW(p)                                                                    \
    do {                                                                                    \
        __asm__ volatile("prefetchw %0" ::"m"(*(const char *)(p)));                         \
        if (cols > 16) __asm__ volatile("prefetchw %0" ::"m"(*((const char *)(p) + 64))); \
    } while (0)
#ifndef AMX_PF
#define AMX_PF 4
#endif
/* The activations' line holding block n for the group's 16 rows, into L1, AMX_PF blocks ahead, on each
 * vector's pass (a 16-row strip of K = 4864 is past the L1). Measured on the 0.5B's GEMMs, two threads,
 * RT, 64-2048 rows: on the first pass only over none, Q5_0 1.09-1.11x at 512-2048 rows; on each pass
 * over the first only, Q5_0 1.07-1.18x, Q6_K 0.96-1.04x. -DAMX_PF=0: none. */
#define AMX_PREFETCH_X(n)                                                                                    \
    do {                                                                                                     \
        for (int i_ = 0; i_ < 16; ++i_) _mm_prefetch((const char *)(x->q + (rg + i_) * x->k + (n) * QK), _MM_HINT_T0); \
    } while (0)
/* The formats with a scale per 16 k steps (Q6_K, Q3_K, Q2_K: two sum tiles a block); the one-scale
 * formats take rows_amx_pairs. */
INLINE void rows_amx(const int fmt, const qrows *x, int64_t r0, int groups, const uint8_t *wq,
                     const uint8_t *panel, const float *bias, float *y, int64_t ldy, int cols) {
    amx_configure(16);
    int32_t sums[2][2][16][VW] __attribute__((aligned(64)));
    float out[16][NC] __attribute__((aligned(64)));
    for (int grp = 0; grp < groups; ++grp) {
        const int64_t rg = r0 + 16 * grp;
        /* The output rows' lines, asked for with intent to write a group ahead (the first group its
         * own): a prompt's output (rows x N floats, N up to an LM head's) is past the L2, and the
         * group's 32 stores missing it sat in the store buffer ahead of the next tile store, which
         * held back every load behind it. */
        if (grp == 0)
            for (int i = 0; i < 16; ++i) PREFETCHW_ROW(y + i * ldy);
        for (int v = 0; v < V; ++v) {
            vfl acc[16];
#pragma GCC unroll 16
            for (int i = 0; i < 16; ++i) acc[i] = zerof();
            vfl kd = zerof(), kdm = zerof();
            AMX_HALVES_OPERANDS(0); /* block 0's operands before the loop (then each block's two ahead) */
            for (int64_t b = -1; b < x->nb; ++b) {
                if (b + 1 < x->nb) { /* the next block's products, operands loaded before */
                    if (((b + 1) & 1) == 0) {
                        TILE_ZERO(0);
                        TILE_DP(0, 4, 5);
                        TILE_ZERO(1);
                        TILE_DP(1, 6, 7);
                    } else {
                        TILE_ZERO(2);
                        TILE_DP(2, 4, 5);
                        TILE_ZERO(3);
                        TILE_DP(3, 6, 7);
                    }
                }
                if (b >= 0) {
                    const int slot = (int)(b & 1);
                    if (v == 0 && b < 16 && grp + 1 < groups) /* the next group's output, a row a block */
                        PREFETCHW_ROW(y + (16 * (grp + 1) + b) * ldy);
                    if (AMX_PF && ((b + AMX_PF) & 1) == 0 && b + AMX_PF < x->nb)
                        AMX_PREFETCH_X(b + AMX_PF);
                    amx_float_steps(fmt, x, panel, rg, b, v, sums[slot][0], sums[slot][1], &kd, &kdm, acc);
                }
                /* A tile store holds back every later load until it completes (and it waits for its
                 * product): block b + 2's operands (both halves' in one set of four tiles) are loaded
                 * first, then block b + 1's sums stored, after this block's float steps read theirs. */
                if (b + 2 < x->nb) AMX_HALVES_OPERANDS(b + 2);
                if (b + 1 < x->nb) {
                    if (((b + 1) & 1) == 0) {
                        TILE_STORE(0, &sums[0][0][0][0], VW * 4);
                        TILE_STORE(1, &sums[0][1][0][0], VW * 4);
                    } else {
                        TILE_STORE(2, &sums[1][0][0][0], VW * 4);
                        TILE_STORE(3, &sums[1][1][0][0], VW * 4);
                    }
                }
            }
#pragma GCC unroll 16
            for (int i = 0; i < 16; ++i) _mm512_store_ps(&out[i][v * VW], acc[i]);
        }
        store_rows(out, 16, bias, y + 16 * grp * ldy, ldy, cols);
    }
    TILE_RELEASE();
}

/* The formats with one scale a block (one sum tile a block) take their blocks two at a time: per pair
 * of blocks, the next pair's two products (operands loaded a pair before), this pair's float steps
 * (block 2p, then 2p + 1: rows_simd's order), the pair after next's operands loaded, then the next
 * pair's two sum tiles stored. A tile store holds back every load after it until it has written, and
 * the float steps' loads wait on it: a pair meets that wait once for two blocks' float steps. Tiles:
 * 0, 1 the pair's sums, 4, 5 and 6, 7 its blocks' activations and weights. */
INLINE void rows_amx_pairs(const int fmt, const qrows *x, int64_t r0, int groups, const uint8_t *wq,
                           const uint8_t *panel, const float *bias, float *y, int64_t ldy, int cols) {
    amx_configure(32);
    int32_t sums[2][16][VW] __attribute__((aligned(64)));
    float out[16][NC] __attribute__((aligned(64)));
    const int64_t nb = x->nb, np = (nb + 1) / 2;
#define PAIR_OPERANDS(n)                                                  \
    do {                                                                  \
        const int8_t *xa = x->q + rg * x->k + 2 * (n) * QK;               \
        const uint8_t *w = wq + 2 * (n) * 8 * NC * 4 + v * VW * 4;        \
        TILE_LOAD(4, xa, x->k);                                           \
        TILE_LOAD(5, w, NC * 4);                                          \
        if (2 * (n) + 1 < nb) {                                           \
            TILE_LOAD(6, xa + QK, x->k);                                  \
            TILE_LOAD(7, w + 8 * NC * 4, NC * 4);                         \
        }                                                                 \
    } while (0)
    for (int grp = 0; grp < groups; ++grp) {
        const int64_t rg = r0 + 16 * grp;
        if (grp == 0)
            for (int i = 0; i < 16; ++i) PREFETCHW_ROW(y + i * ldy);
        for (int v = 0; v < V; ++v) {
            vfl acc[16];
#pragma GCC unroll 16
            for (int i = 0; i < 16; ++i) acc[i] = zerof();
            vfl kd = zerof(), kdm = zerof();
            PAIR_OPERANDS(0);
            for (int64_t p = -1; p < np; ++p) {
                if (p + 1 < np) { /* the next pair's products, operands loaded before */
                    TILE_ZERO(0);
                    TILE_DP(0, 4, 5);
                    if (2 * p + 3 < nb) {
                        TILE_ZERO(1);
                        TILE_DP(1, 6, 7);
                    }
                }
                if (p >= 0) {
                    if (v == 0 && p < 16 && grp + 1 < groups) /* the next group's output, a row a pair */
                        PREFETCHW_ROW(y + (16 * (grp + 1) + p) * ldy);
                    if (AMX_PF && 2 * (p + AMX_PF / 2) < nb)
                        AMX_PREFETCH_X(2 * (p + AMX_PF / 2));
                    amx_float_steps(fmt, x, panel, rg, 2 * p, v, sums[0], sums[0], &kd, &kdm, acc);
                    if (2 * p + 1 < nb)
                        amx_float_steps(fmt, x, panel, rg, 2 * p + 1, v, sums[1], sums[1], &kd, &kdm, acc);
                }
                if (p + 2 < np) PAIR_OPERANDS(p + 2);
                if (p + 1 < np) {
                    TILE_STORE(0, &sums[0][0][0], VW * 4);
                    if (2 * p + 3 < nb) TILE_STORE(1, &sums[1][0][0], VW * 4);
                }
            }
#pragma GCC unroll 16
            for (int i = 0; i < 16; ++i) _mm512_store_ps(&out[i][v * VW], acc[i]);
        }
        store_rows(out, 16, bias, y + 16 * grp * ldy, ldy, cols);
    }
#undef PAIR_OPERANDS
    TILE_RELEASE();
}

#define DEFINE_AMX_ITEM(NAME, FMT)                                                                        \
    __attribute__((aligned(64))) static void amx_##NAME(const qrows *x, int64_t r0, int64_t rows,             \
                                                        const uint8_t *panel, const float *bias,          \
                           float *y, int64_t ldy, int cols) {                                              \
        const int groups = (int)(rows / 16);                                                               \
        uint8_t *wq = groups ? amx_weights((size_t)x->nb * 8 * NC * 4) : NULL; /* block b at b KiB */      \
        if (wq) {                                                                                          \
            for (int64_t b = 0; b < x->nb; ++b) amx_unpack(FMT, panel, b, wq + b * 8 * NC * 4);            \
            if (two_scales(FMT)) rows_amx(FMT, x, r0, groups, wq, panel, bias, y, ldy, cols);              \
            else rows_amx_pairs(FMT, x, r0, groups, wq, panel, bias, y, ldy, cols);                       \
        }                                                                                                  \
        const int64_t done = wq ? 16 * (int64_t)groups : 0;                                                \
        if (done < rows) vnni_##NAME(x, r0 + done, rows - done, panel, bias, y + done * ldy, ldy, cols);   \
    }
DEFINE_AMX_ITEM(q8_0, FMT_Q8_0)
DEFINE_AMX_ITEM(q8_0_h, FMT_Q8_0 | FMT_HALF)
DEFINE_AMX_ITEM(q4_0, FMT_Q4_0)
DEFINE_AMX_ITEM(q4_0_h, FMT_Q4_0 | FMT_HALF)
DEFINE_AMX_ITEM(q5_0, FMT_Q5_0)
DEFINE_AMX_ITEM(q5_0_h, FMT_Q5_0 | FMT_HALF)
DEFINE_AMX_ITEM(q4_k, FMT_Q4_1 | FMT_K)
DEFINE_AMX_ITEM(q5_k, FMT_Q5_1 | FMT_K)
DEFINE_AMX_ITEM(q6_k, FMT_I8_16 | FMT_K)
DEFINE_AMX_ITEM(q3_k, FMT_I8_16 | FMT_K | FMT_HALF)
DEFINE_AMX_ITEM(q2_k, FMT_Q2 | FMT_K)
DEFINE_AMX_ITEM(iq4_xs, FMT_Q8_0 | FMT_K)
static const item_fn amx_items[FMT_COUNT] = {
    [FMT_Q8_0] = amx_q8_0,
    [FMT_Q4_0] = amx_q4_0,
    [FMT_Q4_1] = vnni_q4_1, /* minimums on every block: VNNI */
    [FMT_U8_1] = vnni_u8_1, /* a byte form: VNNI */
    [FMT_I8_16] = vnni_i8_16, /* a byte form: VNNI */
    [FMT_Q5_0] = amx_q5_0,
    [FMT_Q5_1] = vnni_q5_1, /* minimums on every block: VNNI */
    [FMT_Q8_0 | FMT_HALF] = amx_q8_0_h,
    [FMT_Q4_0 | FMT_HALF] = amx_q4_0_h,
    [FMT_Q4_1 | FMT_HALF] = vnni_q4_1_h, /* minimums on every block: VNNI */
    [FMT_U8_1 | FMT_HALF] = vnni_u8_1_h, /* a byte form: VNNI */
    [FMT_I8_16 | FMT_HALF] = vnni_i8_16_h, /* a byte form: VNNI */
    [FMT_Q5_0 | FMT_HALF] = amx_q5_0_h,
    [FMT_Q5_1 | FMT_HALF] = vnni_q5_1_h, /* minimums on every block: VNNI */
    [FMT_Q4_1 | FMT_K] = amx_q4_k,
    [FMT_Q5_1 | FMT_K] = amx_q5_k,
    [FMT_I8_16 | FMT_K] = amx_q6_k,
    [FMT_I8_16 | FMT_K | FMT_HALF] = amx_q3_k,
    [FMT_Q2 | FMT_K] = amx_q2_k,
    [FMT_Q8_0 | FMT_K] = amx_iq4_xs};
#endif

/* on: 1 use AMX where the OS grants it, 0 never, -1 leave. Returns whether AMX runs now (a GEMM of
 * 16 rows or more; it needs VNNI's rows for the rest, so VNNI off turns it off too). */
int32_t llmserve_qi8_amx(int32_t on) {
#ifdef AMX_PATH
    if (on == 0) use_amx = 0;
    if (on == 1) use_amx = 1;
    return amx_active() && vnni_active();
#else
    (void)on;
    return 0;
#endif
}


/* One call's GEMM (llmserve_qi8_gemm): its rows quantized, then its (row chunk, panel) items. */
typedef struct {
    qrows xs;
    const float *x;
    int64_t ldx;
    const float *bias;
    float *y;
    int64_t ldy;
    const uint8_t *packed;
    int64_t m, n;
    item_fn item;
    int64_t panels, pb;
    int64_t mc; /* rows a work item */
    int32_t off; /* the format's offset, where xs.ncorr is made */
    int32_t glu; /* GLU_*: x's rows are [gate | up], the activations glu(gate) * up (made here) */
    struct qi8_argmax *am; /* not NULL: each row's argmax is the result, y is not written */
    int32_t big, tiles;    /* the call is shared among threads; the AMX rows run it */
} qi8_job;

/* A greedy head's call (llmserve_qi8_gemm_argmax): its outputs go a panel at a time into a
 * thread's tile of rows x NC floats (in L1 / L2), whose rows are scanned at once; an item is a row
 * chunk and a group of `group` panels, and keeps per row its group's first maximum (a NaN counting
 * as the maximum, the first NaN winning for good): best value, column, NaN seen, [groups][m] each.
 * The groups are then merged in column order under the same rule, so the index is the first
 * maximum of the whole row (sampler.argmax_rows' rule, numpy's argmax), whichever thread ran what. */
typedef struct qi8_argmax {
    int64_t group, groups;
    float *v;
    int64_t *i;
    uint8_t *nan;
    int failed; /* a thread's tile could not be allocated */
} qi8_argmax;

/* Row r's copies of its scales that some rows read: by group of 16 rows (the AMX rows), and
 * -offset * sx (qrows.ncorr). */
INLINE void row_copies(const qi8_job *j, int64_t r) {
    const int64_t nb = j->xs.nb;
    if (j->xs.dxt) /* the AMX rows' copies by group of 16 rows */
        for (int64_t b = 0; b < nb; ++b) {
            const int64_t at = ((r >> 4) * nb + b) * 16 + (r & 15);
            ((float *)j->xs.dxt)[at] = j->xs.dx[r * nb + b];
            ((float *)j->xs.dxst)[at] = j->xs.dxs[r * nb + b];
        }
    if (j->xs.ncorr)
        for (int64_t b = 0; b < nb; ++b) ((int32_t *)j->xs.ncorr)[r * nb + b] = -j->off * j->xs.sx[r * nb + b];
}

static void qi8_quantize_rows(void *ctx, int64_t begin, int64_t end) {
    const qi8_job *j = ctx;
    const int64_t k = j->xs.k, nb = j->xs.nb;
    int8_t *q = (int8_t *)j->xs.q;
    for (int64_t r = begin; r < end; ++r) {
        /* each block's two 16-step sums where the format has a scale per 16 (I8_16's offset
         * correction, Q2_K's minimums), made with the quants */
        int32_t *sh = j->xs.sh ? (int32_t *)j->xs.sh + r * 2 * nb : NULL;
        float *dx = (float *)j->xs.dx + r * nb, *dxs = (float *)j->xs.dxs + r * nb;
        int32_t *sx = (int32_t *)j->xs.sx + r * nb;
        if (j->glu)
            quantize_glu_row(j->glu, j->x + r * j->ldx, k, q + r * k, dx, sx, dxs, sh);
        else if (sh)
            quantize_row(j->x + r * j->ldx, k, q + r * k, dx, sx, dxs, sh);
        else
            quantize_row(j->x + r * j->ldx, k, q + r * k, dx, sx, dxs, NULL);
        row_copies(j, r);
    }
}

static void qi8_items(void *ctx, int64_t begin, int64_t end) {
    const qi8_job *j = ctx;
    for (int64_t it = begin; it < end; ++it) {
        const int64_t c = it / j->panels, p = it % j->panels, r0 = c * j->mc;
        const int64_t rows = j->m - r0 < j->mc ? j->m - r0 : j->mc;
        const int cols = (int)(j->n - p * NC < NC ? j->n - p * NC : NC);
        float pad[NC];
        const float *bp = j->bias ? j->bias + p * NC : NULL;
        if (bp && cols < NC) {
            memset(pad, 0, sizeof pad);
            memcpy(pad, bp, sizeof(float) * cols);
            bp = pad;
        }
        j->item(&j->xs, r0, rows, j->packed + p * j->pb, bp, j->y + r0 * j->ldy + p * NC, j->ldy, cols);
    }
}

/* A thread's tile of a greedy head's outputs, kept and grown, never freed (not scratch(): the
 * caller's holds its call's quantized rows). */
static float *tile_scratch(size_t floats) {
    static __thread float *buf;
    static __thread size_t cap;
    if (floats > cap) {
        float *grown = realloc(buf, floats * sizeof(float));
        if (!grown) return NULL;
        buf = grown;
        cap = floats;
    }
    return buf;
}

/* One row of a tile (cols outputs from column base) into the row's best so far: nothing to do
 * unless a value is above the best or a NaN (one compare a value, vectorized); then the first NaN
 * ends the row, else each strictly greater value is taken (equal values keep the first). */
INLINE void argmax_scan(const float *row, int cols, int64_t base, float *bv, int64_t *bi, uint8_t *bn) {
    if (*bn) return;
    const float best = *bv;
    int above = 0;
    for (int c = 0; c < cols; ++c) above |= !(row[c] <= best);
    if (!above) return;
    for (int c = 0; c < cols; ++c) {
        const float v = row[c];
        if (v != v) {
            *bi = base + c;
            *bn = 1;
            return;
        }
        if (v > *bv) {
            *bv = v;
            *bi = base + c;
        }
    }
}

static void qi8_items_argmax(void *ctx, int64_t begin, int64_t end) {
    const qi8_job *j = ctx;
    qi8_argmax *a = j->am;
    float *tile = tile_scratch((size_t)j->mc * NC);
    if (!tile) {
        __atomic_store_n(&a->failed, 1, __ATOMIC_RELAXED);
        return;
    }
    for (int64_t it = begin; it < end; ++it) {
        const int64_t c = it / a->groups, g = it % a->groups, r0 = c * j->mc;
        const int64_t rows = j->m - r0 < j->mc ? j->m - r0 : j->mc;
        float *bv = a->v + g * j->m + r0;
        int64_t *bi = a->i + g * j->m + r0;
        uint8_t *bn = a->nan + g * j->m + r0;
        for (int64_t i = 0; i < rows; ++i) bv[i] = -__builtin_inff(), bi[i] = 0, bn[i] = 0;
        const int64_t p1 = (g + 1) * a->group < j->panels ? (g + 1) * a->group : j->panels;
        for (int64_t p = g * a->group; p < p1; ++p) {
            const int cols = (int)(j->n - p * NC < NC ? j->n - p * NC : NC);
            float pad[NC];
            const float *bp = j->bias ? j->bias + p * NC : NULL;
            if (bp && cols < NC) {
                memset(pad, 0, sizeof pad);
                memcpy(pad, bp, sizeof(float) * cols);
                bp = pad;
            }
            j->item(&j->xs, r0, rows, j->packed + p * j->pb, bp, tile, NC, cols);
            for (int64_t i = 0; i < rows; ++i) argmax_scan(tile + i * NC, cols, p * NC, bv + i, bi + i, bn + i);
        }
    }
}

/* x [m, k] (rows ldx apart) to the call's int8 form: q [m, k], dx, sx, dxs [m, k/32] (for tests and
 * the kernel alike). */
void llmserve_qi8_quantize(const float *x, int64_t m, int64_t k, int64_t ldx, int8_t *q, float *dx, int32_t *sx,
                           float *dxs) {
    const int64_t nb = k / QK;
    for (int64_t r = 0; r < m; ++r)
        quantize_row(x + r * ldx, k, q + r * k, dx + r * nb, sx + r * nb, dxs + r * nb, NULL);
}

/* The same of glu(gate) * up, x's rows [gate | up] (2k floats, ldx apart; glu GLU_SILU or
 * GLU_GELU_TANH): what the fused down projections below quantize (for tests). Returns -1 for an
 * unknown glu. */
int32_t llmserve_qi8_quantize_glu(int32_t glu, const float *x, int64_t m, int64_t k, int64_t ldx, int8_t *q,
                                  float *dx, int32_t *sx, float *dxs) {
    if (glu != GLU_SILU && glu != GLU_GELU_TANH) return -1;
    const int64_t nb = k / QK;
    for (int64_t r = 0; r < m; ++r)
        quantize_glu_row(glu, x + r * ldx, k, q + r * k, dx + r * nb, sx + r * nb, dxs + r * nb, NULL);
    return 0;
}

/* y[m, n] (rows ldy apart) = x[m, k] (rows ldx apart) . W^T + bias (may be NULL). Returns 0, -1 for
 * an unknown format or k not a multiple of 32, -2 when out of memory (nothing written). fmt
 * SEGMENTS: a projection of row ranges in different formats (row_segments.h). */
static int runs(int32_t fmt, int64_t k) { return known(fmt) && k % (is_k(fmt) ? QK * KB : QK) == 0 && k > 0; }

/* A call's job: its quantized rows' buffers laid out in get(bytes) (a scratch), its item chosen,
 * nothing quantized yet (x may be NULL where the caller makes the quants itself). */
static int32_t qi8_setup(qi8_job *jp, void *(*get)(size_t), int32_t glu, int32_t fmt, const float *x, int64_t m,
                         int64_t k, int64_t ldx, const uint8_t *packed, int64_t n, const float *bias, float *y,
                         int64_t ldy, qi8_argmax *am) {
    if (!runs(fmt, k)) return -1;
    const int64_t nb = k / QK;
    const size_t qbytes = ((size_t)(m * k) + 63) & ~(size_t)63;
    int tiles = 0; /* the AMX rows run this call (they read dx and dxs by block too) */
#ifdef AMX_PATH
    /* the tiles from 32 rows (16 for a scale per 16 k steps; 64 for Q8_0, whose VNNI rows unpack
     * nothing: the tiles measured 0.95-1.02x at 32 rows, 1.10-1.15x at 64-128 on the 0.5B's head):
     * below, their sums stored and reloaded cost more than VNNI's (measured 0.92-0.97x at 16-24 rows
     * on Q5_0; Q6_K 1.09-1.26x) */
    tiles = m >= (two_scales(fmt) ? 16 : byte_q8(fmt) ? 64 : 32) && vnni_active() && amx_active() &&
            amx_items[fmt] != vnni_items[fmt];
#endif
    const int64_t mt = tiles ? (m + 15) / 16 * 16 : 0; /* rows of the copies by group */
    const int with_nc = offset(fmt) && !two_scales(fmt) && !q2k(fmt); /* (qrows.ncorr) */
    uint8_t *buf = get(qbytes + (size_t)(m * nb) * ((two_scales(fmt) ? 20 : 12) + (with_nc ? 4 : 0)) +
                       (size_t)(mt * nb) * 8);
    if (!buf) return -2;
    int8_t *q = (int8_t *)buf;
    float *dx = (float *)(buf + qbytes), *dxs = dx + m * nb;
    int32_t *sx = (int32_t *)(dxs + m * nb), *sh = two_scales(fmt) ? sx + m * nb : NULL;
    float *dxt = tiles ? (float *)(sx + m * nb * (two_scales(fmt) ? 3 : 1)) : NULL;
    float *dxst = tiles ? dxt + mt * nb : NULL;
    const int big = m * n * k > 262144;
    int32_t *ncorr = with_nc ? (int32_t *)(buf + qbytes) + m * nb * (two_scales(fmt) ? 5 : 3) + mt * nb * 2 : NULL;
    qi8_job j = {{q, dx, dxs, sx, sh, k, nb, dxt, dxst, ncorr}, x, ldx, bias, y, ldy, packed, m, n, plain_items[fmt],
                 0, 0, 0, offset(fmt), glu, am, big, tiles};
#ifdef VW
    if (vnni_active()) j.item = vnni_items[fmt];
#endif
#ifdef AMX_PATH
    if (tiles) j.item = amx_items[fmt];
#endif
    j.panels = (n + NC - 1) / NC;
    j.pb = panel_bytes(fmt, nb);
    /* the tiles' items twice the rows: a panel's blocks unpacked once for 512 rows (a 512-token
     * prefill's GEMMs measured 1.03-1.07x over 256) */
    j.mc = tiles ? 2 * MC : MC;
    *jp = j;
    return 0;
}

/* The rows quantized: (the tiles' copies by group: a group's rows on one thread, no line written by
 * two). */
static void qi8_quantize(qi8_job *j, int32_t num_threads) {
    parallel_for(num_threads, j->big && j->m > 1, j->m, j->tiles ? 16 : 1, qi8_quantize_rows, j);
}

/* The call's items, once its rows are quantized. */
static int32_t qi8_run(qi8_job *j, int32_t num_threads) {
    const int64_t m = j->m;
    if (j->am) { /* a greedy head: items of a group of panels, one a claim */
        qi8_argmax *am = j->am;
        am->groups = (j->panels + am->group - 1) / am->group;
        parallel_for(num_threads, j->big, (m + j->mc - 1) / j->mc * am->groups, 1, qi8_items_argmax, j);
        return am->failed ? -2 : 0;
    }
    /* A decode's GEMV (one chunk of rows): its panels are equal items of a microsecond or so, claimed
     * in shrinking ranges (parallel.h); a prefill's (rows, panel) items take long enough to go one
     * a claim. */
    if (m <= j->mc)
        parallel_for_guided(num_threads, j->big, j->panels, 1, qi8_items, j);
    else
        parallel_for(num_threads, j->big, (m + j->mc - 1) / j->mc * j->panels, 1, qi8_items, j);
    return 0;
}

static int32_t qi8_gemm(int32_t glu, int32_t fmt, const float *x, int64_t m, int64_t k, int64_t ldx,
                        const uint8_t *packed, int64_t n, const float *bias, float *y, int64_t ldy,
                        int32_t num_threads, qi8_argmax *am) {
    qi8_job j;
    const int32_t rc = qi8_setup(&j, scratch, glu, fmt, x, m, k, ldx, packed, n, bias, y, ldy, am);
    if (rc) return rc;
    qi8_quantize(&j, num_threads);
    return qi8_run(&j, num_threads);
}

int32_t llmserve_qi8_gemm(int32_t fmt, const float *x, int64_t m, int64_t k, int64_t ldx, const uint8_t *packed,
                          int64_t n, const float *bias, float *y, int64_t ldy, int32_t num_threads) {
    if (fmt == SEGMENTS) /* row ranges in different formats (row_segments.h) */
        return run_segments(llmserve_qi8_gemm, runs, x, m, k, ldx, packed, n, bias, y, ldy, num_threads);
    return qi8_gemm(GLU_NONE, fmt, x, m, k, ldx, packed, n, bias, y, ldy, num_threads, NULL);
}

/* A down projection fused with its MLP's gated activation: y = glu(gate) * up . W^T + bias, x's rows
 * [gate | up] (2k floats, ldx apart), bit for bit llmserve_qi8_gemm of elementwise.c's SiLU- (GELU-)
 * and-multiply rows, which are never written (quantize_glu_row). A projection of row segments
 * quantizes them again for each segment. Returns as llmserve_qi8_gemm. */
int32_t llmserve_qi8_gemm_silu(int32_t fmt, const float *x, int64_t m, int64_t k, int64_t ldx,
                               const uint8_t *packed, int64_t n, const float *bias, float *y, int64_t ldy,
                               int32_t num_threads) {
    if (fmt == SEGMENTS)
        return run_segments(llmserve_qi8_gemm_silu, runs, x, m, k, ldx, packed, n, bias, y, ldy, num_threads);
    return qi8_gemm(GLU_SILU, fmt, x, m, k, ldx, packed, n, bias, y, ldy, num_threads, NULL);
}

int32_t llmserve_qi8_gemm_gelu_tanh(int32_t fmt, const float *x, int64_t m, int64_t k, int64_t ldx,
                                    const uint8_t *packed, int64_t n, const float *bias, float *y, int64_t ldy,
                                    int32_t num_threads) {
    if (fmt == SEGMENTS)
        return run_segments(llmserve_qi8_gemm_gelu_tanh, runs, x, m, k, ldx, packed, n, bias, y, ldy,
                            num_threads);
    return qi8_gemm(GLU_GELU_TANH, fmt, x, m, k, ldx, packed, n, bias, y, ldy, num_threads, NULL);
}

/* A greedy LM head: best[r] = the index of row r's first maximum over y = x . W^T + bias (a NaN
 * counting as the maximum: the first NaN), the outputs each llmserve_qi8_gemm's bits but never
 * stored (qi8_argmax above); the activations quantized once for the whole vocabulary. `group`:
 * panels (of llmserve_qi8_panel_width columns) an item scans (>= 1; tests make it 1 to put ties
 * and NaNs across items). Returns as llmserve_qi8_gemm; a SEGMENTS head is refused (-1). */
int32_t llmserve_qi8_gemm_argmax(int32_t fmt, const float *x, int64_t m, int64_t k, int64_t ldx,
                                 const uint8_t *packed, int64_t n, const float *bias, int64_t group, int64_t *best,
                                 int32_t num_threads) {
    if (fmt == SEGMENTS || group < 1 || n < 1 || !runs(fmt, k)) return -1;
    if (m < 1) return 0;
    const int64_t groups = ((n + NC - 1) / NC + group - 1) / group;
    const size_t entries = (size_t)(groups * m);
    uint8_t *mem = malloc(entries * (sizeof(float) + sizeof(int64_t) + 1));
    if (!mem) return -2;
    qi8_argmax a = {group, groups, NULL, NULL, NULL, 0};
    a.i = (int64_t *)mem;
    a.v = (float *)(a.i + entries);
    a.nan = (uint8_t *)(a.v + entries);
    const int32_t rc = qi8_gemm(GLU_NONE, fmt, x, m, k, ldx, packed, n, bias, NULL, 0, num_threads, &a);
    if (rc == 0)
        for (int64_t r = 0; r < m; ++r) { /* the groups in column order, argmax_scan's rule */
            float bv = -__builtin_inff();
            int64_t bi = 0;
            for (int64_t g = 0; g < groups; ++g) {
                const size_t e = (size_t)(g * m + r);
                if (a.nan[e]) {
                    bi = a.i[e];
                    break;
                }
                if (a.v[e] > bv) bv = a.v[e], bi = a.i[e];
            }
            best[r] = bi;
        }
    free(mem);
    return rc;
}

/* A layer's MLP in one call (the native layer loop's, where gate/up and down both run here):
 * y = glu(x . Wg^T) * (x . Wu^T) . Wd^T (+ each one's bias), the gate/up projection's outputs never
 * stored. gate/up is one packed weight of 2 * inter rows (gate, then up); inter a multiple of 64.
 * Its rows are quantized as llmserve_qi8_gemm quantizes them; a work item (a row chunk and a pair
 * of gate panels) computes gate panel p and up panel p + inter / 32 into a thread's tile of rows x
 * 64 floats (each output the GEMM's bits), makes each row's 32 products glu(gate) * up there and
 * quantizes them as the down projection's block p (the quants into its rows, one 64-byte line a
 * row for the pair: no line written by two threads; the scales staged by pair, then laid out by
 * row with the copies its rows read); then the down projection's items. So y is bit for bit
 * llmserve_qi8_gemm_silu of llmserve_qi8_gemm's gate/up rows (the separate kernels' result).
 * Returns 0, -1 for an unknown glu, format, SEGMENTS, k or inter; -2 when out of memory. */
typedef struct {
    const qi8_job *g, *d;
    int32_t glu;
    int64_t inter, pairs;
    int32_t *staged; /* per (pair, row, half): dx, dxs (float bits), sx, sh[2] */
    int failed;
} qi8_mlp;
#define STAGED 5

static void mlp_items(void *ctx, int64_t begin, int64_t end) {
    qi8_mlp *mj = ctx;
    const qi8_job *g = mj->g, *d = mj->d;
    const int64_t inter = mj->inter, up = inter / NC, m = g->m;
    float *tile = tile_scratch((size_t)g->mc * 2 * NC);
    if (!tile) {
        __atomic_store_n(&mj->failed, 1, __ATOMIC_RELAXED);
        return;
    }
    int8_t *q = (int8_t *)d->xs.q;
    const int two = d->xs.sh != NULL;
    for (int64_t it = begin; it < end; ++it) {
        const int64_t c = it / mj->pairs, pp = it % mj->pairs, r0 = c * g->mc;
        const int64_t rows = m - r0 < g->mc ? m - r0 : g->mc;
        for (int t = 0; t < 2; ++t) {
            const int64_t p = 2 * pp + t;
            g->item(&g->xs, r0, rows, g->packed + p * g->pb, g->bias ? g->bias + p * NC : NULL, tile, 2 * NC, NC);
            g->item(&g->xs, r0, rows, g->packed + (p + up) * g->pb, g->bias ? g->bias + (p + up) * NC : NULL,
                    tile + NC, 2 * NC, NC);
            for (int64_t i = 0; i < rows; ++i) {
                float a[QK] __attribute__((aligned(64)));
                glu_block(mj->glu, tile + i * 2 * NC, tile + i * 2 * NC + NC, a);
                float dx, dxs;
                int32_t sx, sh[2] = {0, 0};
                quantize_block(a, q + (r0 + i) * inter + p * QK, &dx, &sx, &dxs, two ? sh : NULL);
                int32_t *st = mj->staged + ((pp * m + r0 + i) * 2 + t) * STAGED;
                memcpy(st, &dx, 4);
                memcpy(st + 1, &dxs, 4);
                st[2] = sx, st[3] = sh[0], st[4] = sh[1];
            }
        }
    }
}

static void mlp_rows(void *ctx, int64_t begin, int64_t end) {
    const qi8_mlp *mj = ctx;
    const qi8_job *d = mj->d;
    const int64_t nb = d->xs.nb, m = d->m;
    for (int64_t r = begin; r < end; ++r) {
        for (int64_t b = 0; b < nb; ++b) {
            const int32_t *st = mj->staged + (((b >> 1) * m + r) * 2 + (b & 1)) * STAGED;
            memcpy((float *)d->xs.dx + r * nb + b, st, 4);
            memcpy((float *)d->xs.dxs + r * nb + b, st + 1, 4);
            ((int32_t *)d->xs.sx)[r * nb + b] = st[2];
            if (d->xs.sh) {
                ((int32_t *)d->xs.sh)[(r * nb + b) * 2] = st[3];
                ((int32_t *)d->xs.sh)[(r * nb + b) * 2 + 1] = st[4];
            }
        }
        row_copies(d, r);
    }
}

int32_t llmserve_qi8_mlp(int32_t glu, int32_t gu_fmt, const float *x, int64_t m, int64_t k, int64_t ldx,
                         const uint8_t *gu_packed, const float *gu_bias, int64_t inter, int32_t dn_fmt,
                         const uint8_t *dn_packed, int64_t n, const float *dn_bias, float *y, int64_t ldy,
                         int32_t num_threads) {
    if ((glu != GLU_SILU && glu != GLU_GELU_TANH) || gu_fmt == SEGMENTS || dn_fmt == SEGMENTS || inter < 1 ||
        inter % (2 * NC) || !runs(gu_fmt, k) || !runs(dn_fmt, inter))
        return -1;
    if (m < 1) return 0;
    qi8_job d, g;
    int32_t rc = qi8_setup(&d, scratch, GLU_NONE, dn_fmt, NULL, m, inter, inter, dn_packed, n, dn_bias, y, ldy, NULL);
    if (rc) return rc;
    rc = qi8_setup(&g, scratch_gate_up, GLU_NONE, gu_fmt, x, m, k, ldx, gu_packed, 2 * inter, gu_bias, NULL, 0,
                   NULL);
    if (rc) return rc;
    int32_t *staged = scratch_staged((size_t)(m * d.xs.nb) * STAGED * sizeof(int32_t));
    if (!staged) return -2;
    qi8_quantize(&g, num_threads);
    qi8_mlp mj = {&g, &d, glu, inter, inter / (2 * NC), staged, 0};
    parallel_for(num_threads, g.big, (m + g.mc - 1) / g.mc * mj.pairs, 1, mlp_items, &mj);
    if (mj.failed) return -2;
    parallel_for(num_threads, d.big && m > 1, m, d.tiles ? 16 : 1, mlp_rows, &mj);
    return qi8_run(&d, num_threads);
}
