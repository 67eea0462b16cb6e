/* A fused projection whose row ranges are in different formats (a GGUF file may keep q and k in
 * Q5_0 and v in Q8_0): one packed buffer of segments, each packed by the kernel in its own format,
 * run through the same entry with the format code SEGMENTS (quant_gemm.c and quant_int8act.c).
 *
 * Layout (int64 words, then bytes): count, then per segment {format code, rows, byte offset of
 * its packed weight from the buffer's start}; segments in row order, their rows summing to n.
 * Segment s computes outputs [r_s, r_s + rows_s) of every row of x with its own kernel, written
 * where the whole projection's would be (y + r_s, rows ldy apart; bias + r_s), so an output is
 * its segment kernel's alone: bit-equal alone, in any batch, at any thread count, as that kernel.
 *
 * The including file defines its coded entry's type and passes a check of a segment's code. */

#ifndef LLMSERVE_ROW_SEGMENTS_H
#define LLMSERVE_ROW_SEGMENTS_H

#include <stdint.h>

#define SEGMENTS 64
#define MAX_SEGMENTS 16

typedef int32_t (*segment_gemm_fn)(int32_t fmt, const float *x, int64_t m, int64_t k, int64_t ldx,
                                   const uint8_t *packed, int64_t n, const float *bias, float *y, int64_t ldy,
                                   int32_t num_threads);

/* Returns 0, -1 for a bad header (a count out of 1..MAX_SEGMENTS, a code `ok` refuses, rows not
 * summing to n) before anything is written, or the first segment's refusal. */
static int32_t run_segments(segment_gemm_fn gemm, int (*ok)(int32_t fmt, int64_t k), const float *x, int64_t m,
                            int64_t k, int64_t ldx, const uint8_t *packed, int64_t n, const float *bias, float *y,
                            int64_t ldy, int32_t num_threads) {
    const int64_t *h = (const int64_t *)packed;
    const int64_t count = h[0];
    if (count < 1 || count > MAX_SEGMENTS) return -1;
    int64_t rows = 0;
    for (int64_t s = 0; s < count; ++s) {
        const int64_t code = h[1 + 3 * s], r = h[2 + 3 * s];
        if (code == SEGMENTS || code < 0 || code > INT32_MAX || !ok((int32_t)code, k) || r < 1) return -1;
        rows += r;
    }
    if (rows != n) return -1;
    int64_t r0 = 0;
    for (int64_t s = 0; s < count; ++s) {
        const int64_t r = h[2 + 3 * s];
        const int32_t rc = gemm((int32_t)h[1 + 3 * s], x, m, k, ldx, packed + h[3 + 3 * s], r,
                                bias ? bias + r0 : NULL, y + r0, ldy, num_threads);
        if (rc) return rc;
        r0 += r;
    }
    return 0;
}

#endif
