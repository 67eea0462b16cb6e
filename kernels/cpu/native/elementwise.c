/* The decoder's elementwise chains, fused (fp32): RMSNorm with its residual add, rotary
 * embedding, and SiLU-and-multiply. Each is one pass over its rows where torch's twins
 * (kernels/reference/{rmsnorm,rotary,activation}.py, which define the arithmetic) make one pass
 * per operation and a temporary between each: these chains are memory-bound, so the passes are
 * the cost.
 *
 * Rows are independent and each is computed by the same code in the same order, so a token's
 * result never depends on the batch around it. Built per instruction set like paged_attention.c
 * (see native_build.py); OpenMP threads are torch's. */

#include <math.h>
#include <stdint.h>

#include "fast_exp.h"

#define LANES 16
#define INLINE static inline __attribute__((always_inline))

/* out = norm(x + residual) * weight, residual_out = x + residual (residual may be NULL: then
 * residual_out is not written and x is normed). The mean of squares: LANES partial sums, then a
 * fixed tree. As HF does, the row is scaled by rsqrt(mean + eps) before the weight multiply. */
void llmserve_rms_norm_f32(const float *x, const float *residual, const float *weight, float eps,
                           int64_t rows, int64_t dim, float *out, float *residual_out,
                           int32_t num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * dim > 16384)
    for (int64_t t = 0; t < rows; ++t) {
        const float *xr = x + t * dim;
        float *o = out + t * dim;
        const float *h = xr;
        if (residual) {
            const float *rr = residual + t * dim;
            float *ro = residual_out + t * dim;
            for (int64_t d = 0; d < dim; ++d) ro[d] = xr[d] + rr[d];
            h = ro;
        }
        float acc[LANES] = {0};
        int64_t d = 0;
        for (; d + LANES <= dim; d += LANES)
            for (int l = 0; l < LANES; ++l) acc[l] += h[d + l] * h[d + l];
        for (int l = 0; d + l < dim; ++l) acc[l] += h[d + l] * h[d + l];
        for (int w = LANES / 2; w > 0; w /= 2)
            for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
        const float inv = 1.0f / sqrtf(acc[0] / (float)dim + eps);
        for (int64_t e = 0; e < dim; ++e) o[e] = weight[e] * (h[e] * inv);
    }
}

/* Rotary embedding, neox layout: for each head of token t, halves x1, x2 of its D values become
 * x1 * cos - x2 * sin and x2 * cos + x1 * sin, with cos, sin the two halves of
 * cos_sin[positions[t]]. x is read at its strides (a view of the fused QKV projection); out is
 * contiguous [tokens, heads, D]. */
void llmserve_rotary_f32(const float *x, int64_t stride_token, int64_t stride_head, int64_t tokens,
                         int64_t heads, int64_t dim, const int64_t *positions, const float *cos_sin,
                         float *out, int32_t num_threads) {
    const int64_t half = dim / 2;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (tokens * heads * dim > 16384)
    for (int64_t t = 0; t < tokens; ++t) {
        const float *c = cos_sin + positions[t] * dim, *s = c + half;
        for (int64_t h = 0; h < heads; ++h) {
            const float *x1 = x + t * stride_token + h * stride_head, *x2 = x1 + half;
            float *o1 = out + (t * heads + h) * dim, *o2 = o1 + half;
            for (int64_t i = 0; i < half; ++i) {
                const float a = x1[i], b = x2[i];
                o1[i] = a * c[i] - b * s[i];
                o2[i] = b * c[i] + a * s[i];
            }
        }
    }
}

/* out[t] = silu(gate) * up for row t of x = [gate | up] (d floats each), silu(g) = g * sigmoid(g)
 * with the sigmoid taken from e^-|g| (in (0, 1]: no overflow on either side), so the loop
 * vectorizes with the exp above. */
void llmserve_silu_and_mul_f32(const float *x, int64_t rows, int64_t d, float *out, int32_t num_threads) {
#pragma omp parallel for schedule(static) num_threads(num_threads) if (rows * d > 16384)
    for (int64_t t = 0; t < rows; ++t) {
        const float *g = x + t * 2 * d, *u = g + d;
        float *o = out + t * d;
        for (int64_t i = 0; i < d; ++i) {
            const float e = exp_nonpositive(-fabsf(g[i]));
            const float sigmoid = (g[i] >= 0.0f ? 1.0f : e) / (1.0f + e);
            o[i] = g[i] * sigmoid * u[i];
        }
    }
}
