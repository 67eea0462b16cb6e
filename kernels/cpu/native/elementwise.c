/* The decoder's elementwise chains, fused (fp32): RMSNorm with its residual add, rotary
 * embedding (alone, or with the layer's KV-cache write), and SiLU-and-multiply. Each is one pass
 * over its rows where torch's twins (kernels/reference/{rmsnorm,rotary,kv_write,activation}.py,
 * which define the arithmetic) make one pass
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
INLINE void rotate_head(const float *x1, const float *c, const float *s, int64_t half, float *o1) {
    const float *x2 = x1 + half;
    float *o2 = o1 + half;
    for (int64_t i = 0; i < half; ++i) {
        const float a = x1[i], b = x2[i];
        o1[i] = a * c[i] - b * s[i];
        o2[i] = b * c[i] + a * s[i];
    }
}

void llmserve_rotary_f32(const float *x, int64_t stride_token, int64_t stride_head, int64_t tokens,
                         int64_t heads, int64_t dim, const int64_t *positions, const float *cos_sin,
                         float *out, int32_t num_threads) {
    const int64_t half = dim / 2;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (tokens * heads * dim > 16384)
    for (int64_t t = 0; t < tokens; ++t) {
        const float *c = cos_sin + positions[t] * dim, *s = c + half;
        for (int64_t h = 0; h < heads; ++h)
            rotate_head(x + t * stride_token + h * stride_head, c, s, half, out + (t * heads + h) * dim);
    }
}

/* Attention's elementwise part of a layer in one call, on the fused QKV projection's rows (row t
 * at qkv + t * stride_token: q_heads query heads, then kv_heads keys, then kv_heads values, dim
 * floats each): the rotated queries to q_out [tokens, q_heads, dim], the rotated keys and the
 * values into slot slots[t] of the caches ([slots, kv_heads, dim] each; a negative slot stores
 * nothing). The rotation is rotate_head, as above: the cache holds the bits that rotary then a
 * cache write would leave. What torch would do in eight ops (slices, the rotation, the masked
 * scatter) with their temporaries is one pass over the row. */
void llmserve_rotary_store_kv_f32(const float *qkv, int64_t stride_token, int64_t tokens,
                                  int64_t q_heads, int64_t kv_heads, int64_t dim,
                                  const int64_t *positions, const float *cos_sin,
                                  const int64_t *slots, float *q_out, float *k_cache,
                                  float *v_cache, int32_t num_threads) {
    const int64_t half = dim / 2, kv_row = kv_heads * dim;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (tokens * (q_heads + kv_heads) * dim > 16384)
    for (int64_t t = 0; t < tokens; ++t) {
        const float *row = qkv + t * stride_token;
        const float *c = cos_sin + positions[t] * dim, *s = c + half;
        for (int64_t h = 0; h < q_heads; ++h)
            rotate_head(row + h * dim, c, s, half, q_out + (t * q_heads + h) * dim);
        if (slots[t] < 0) continue;
        const float *keys = row + q_heads * dim, *values = keys + kv_row;
        float *k_slot = k_cache + slots[t] * kv_row, *v_slot = v_cache + slots[t] * kv_row;
        for (int64_t h = 0; h < kv_heads; ++h) rotate_head(keys + h * dim, c, s, half, k_slot + h * dim);
        for (int64_t e = 0; e < kv_row; ++e) v_slot[e] = values[e];
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
