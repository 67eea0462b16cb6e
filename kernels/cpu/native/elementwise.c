/* The decoder's elementwise chains, fused (fp32): RMSNorm with its residual add, rotary
 * embedding (alone, or with the layer's KV-cache write), and SiLU-and-multiply. Each is one pass
 * over its rows where torch's twins (kernels/reference/{rmsnorm,rotary,kv_write,activation}.py,
 * which define the arithmetic) make one pass
 * per operation and a temporary between each: these chains are memory-bound, so the passes are
 * the cost.
 *
 * Rows are independent and each is computed by the same code in the same order, so a token's
 * result never depends on the batch around it. Built per instruction set like paged_attention.c
 * (see native_build.py); rows are shared among threads by parallel.h's pool. */

#include <math.h>
#include <stdint.h>

#include "fast_exp.h"
#include "glu.h"
#include "parallel.h"

#define LANES 16
#define INLINE static inline __attribute__((always_inline))

/* Rows a claim: about 4096 floats of work each, so a claim costs little against its rows. */
static int64_t grain(int64_t floats_a_row) { return floats_a_row >= 4096 ? 1 : 4096 / (floats_a_row + 1) + 1; }

/* out = norm(x + residual) * weight, residual_out = x + residual (residual may be NULL: then
 * residual_out is not written and x is normed). The mean of squares: LANES partial sums, then a
 * fixed tree. As HF does, the row is scaled by rsqrt(mean + eps) before the weight multiply. */
typedef struct {
    const float *x, *residual, *weight;
    float eps;
    int64_t dim;
    float *out, *residual_out;
} norm_job;

static void norm_rows(void *ctx, int64_t begin, int64_t end) {
    const norm_job *j = ctx;
    const float *x = j->x, *residual = j->residual, *weight = j->weight;
    const float eps = j->eps;
    const int64_t dim = j->dim;
    float *out = j->out, *residual_out = j->residual_out;
    for (int64_t t = begin; t < end; ++t) {
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

void llmserve_rms_norm_f32(const float *x, const float *residual, const float *weight, float eps,
                           int64_t rows, int64_t dim, float *out, float *residual_out,
                           int32_t num_threads) {
    norm_job j = {x, residual, weight, eps, dim, out, residual_out};
    parallel_for(num_threads, rows * dim > 16384, rows, grain(dim), norm_rows, &j);
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

typedef struct {
    const float *x;
    int64_t stride_token, stride_head, heads, dim;
    const int64_t *positions;
    const float *cos_sin;
    float *out;
} rotary_job;

static void rotary_rows(void *ctx, int64_t begin, int64_t end) {
    const rotary_job *j = ctx;
    const int64_t dim = j->dim, half = dim / 2, heads = j->heads;
    for (int64_t t = begin; t < end; ++t) {
        const float *c = j->cos_sin + j->positions[t] * dim, *s = c + half;
        for (int64_t h = 0; h < heads; ++h)
            rotate_head(j->x + t * j->stride_token + h * j->stride_head, c, s, half, j->out + (t * heads + h) * dim);
    }
}

void llmserve_rotary_f32(const float *x, int64_t stride_token, int64_t stride_head, int64_t tokens,
                         int64_t heads, int64_t dim, const int64_t *positions, const float *cos_sin,
                         float *out, int32_t num_threads) {
    rotary_job j = {x, stride_token, stride_head, heads, dim, positions, cos_sin, out};
    parallel_for(num_threads, tokens * heads * dim > 16384, tokens, grain(heads * dim), rotary_rows, &j);
}

/* Attention's elementwise part of a layer in one call, on the fused QKV projection's rows (row t
 * at qkv + t * stride_token: q_heads query heads, then kv_heads keys, then kv_heads values, dim
 * floats each): the rotated queries to q_out [tokens, q_heads, dim], the rotated keys and the
 * values into slot slots[t] of the caches ([slots, kv_heads, dim] each; a negative slot stores
 * nothing). The rotation is rotate_head, as above: the cache holds the bits that rotary then a
 * cache write would leave. What torch would do in eight ops (slices, the rotation, the masked
 * scatter) with their temporaries is one pass over the row. */
typedef struct {
    const float *qkv;
    int64_t stride_token, q_heads, kv_heads, dim;
    const int64_t *positions;
    const float *cos_sin;
    const int64_t *slots;
    float *q_out;
    void *k_cache, *v_cache; /* float, or uint16_t where bf16 */
    int bf16;
} rotary_store_job;

/* x rounded to bf16 (the top half of an fp32) to nearest, ties to even, as torch's conversion:
 * a NaN becomes 0xffff (torch's CPU conversion writes that NaN), an overflow past bf16's largest
 * finite value infinity. */
static inline uint16_t bf16_round(float x) {
    union {
        float f;
        uint32_t u;
    } b = {.f = x};
    if ((b.u & 0x7fffffffu) > 0x7f800000u) return 0xffff;
    return (uint16_t)((b.u + 0x7fffu + ((b.u >> 16) & 1u)) >> 16);
}

static void rotary_store_rows(void *ctx, int64_t begin, int64_t end) {
    const rotary_store_job *j = ctx;
    const int64_t dim = j->dim, half = dim / 2, q_heads = j->q_heads, kv_heads = j->kv_heads;
    const int64_t kv_row = kv_heads * dim;
    for (int64_t t = begin; t < end; ++t) {
        const float *row = j->qkv + t * j->stride_token;
        const float *c = j->cos_sin + j->positions[t] * dim, *s = c + half;
        for (int64_t h = 0; h < q_heads; ++h)
            rotate_head(row + h * dim, c, s, half, j->q_out + (t * q_heads + h) * dim);
        if (j->slots[t] < 0) continue;
        const float *keys = row + q_heads * dim, *values = keys + kv_row;
        if (j->bf16) { /* the fp32 values, then each rounded once (what torch's copy into the cache does) */
            uint16_t *k_slot = (uint16_t *)j->k_cache + j->slots[t] * kv_row;
            uint16_t *v_slot = (uint16_t *)j->v_cache + j->slots[t] * kv_row;
            float rotated[512];
            for (int64_t h = 0; h < kv_heads; ++h) { /* dim <= 512: checked by the caller */
                rotate_head(keys + h * dim, c, s, half, rotated);
                for (int64_t i = 0; i < dim; ++i) k_slot[h * dim + i] = bf16_round(rotated[i]);
            }
            for (int64_t e = 0; e < kv_row; ++e) v_slot[e] = bf16_round(values[e]);
            continue;
        }
        float *k_slot = (float *)j->k_cache + j->slots[t] * kv_row, *v_slot = (float *)j->v_cache + j->slots[t] * kv_row;
        for (int64_t h = 0; h < kv_heads; ++h) rotate_head(keys + h * dim, c, s, half, k_slot + h * dim);
        for (int64_t e = 0; e < kv_row; ++e) v_slot[e] = values[e];
    }
}

static void rotary_store(rotary_store_job *j, int64_t tokens, int32_t num_threads) {
    const int64_t floats = (j->q_heads + j->kv_heads) * j->dim;
    parallel_for(num_threads, tokens * floats > 16384, tokens, grain(floats), rotary_store_rows, j);
}

void llmserve_rotary_store_kv_f32(const float *qkv, int64_t stride_token, int64_t tokens,
                                  int64_t q_heads, int64_t kv_heads, int64_t dim,
                                  const int64_t *positions, const float *cos_sin,
                                  const int64_t *slots, float *q_out, float *k_cache,
                                  float *v_cache, int32_t num_threads) {
    rotary_store_job j = {qkv, stride_token, q_heads, kv_heads, dim, positions, cos_sin, slots, q_out, k_cache, v_cache, 0};
    rotary_store(&j, tokens, num_threads);
}

/* The same into bf16 caches (uint16_t: the top half of an fp32): the rotated keys and the values
 * each rounded to nearest even (bf16_round); the queries as above. dim <= 512. */
void llmserve_rotary_store_kv_bf16(const float *qkv, int64_t stride_token, int64_t tokens,
                                   int64_t q_heads, int64_t kv_heads, int64_t dim,
                                   const int64_t *positions, const float *cos_sin,
                                   const int64_t *slots, float *q_out, uint16_t *k_cache,
                                   uint16_t *v_cache, int32_t num_threads) {
    rotary_store_job j = {qkv, stride_token, q_heads, kv_heads, dim, positions, cos_sin, slots, q_out, k_cache, v_cache, 1};
    rotary_store(&j, tokens, num_threads);
}

/* out[t] = silu(gate) * up for row t of x = [gate | up] (d floats each): glu.h's silu_mul (the
 * int8 down projection's fused quantization makes the same values, quant_int8act.c). */
typedef struct {
    const float *x;
    int64_t d;
    float *out;
} silu_job;

static void silu_rows(void *ctx, int64_t begin, int64_t end) {
    const silu_job *j = ctx;
    const float *x = j->x;
    const int64_t d = j->d;
    float *out = j->out;
    for (int64_t t = begin; t < end; ++t) {
        const float *g = x + t * 2 * d, *u = g + d;
        float *o = out + t * d;
        for (int64_t i = 0; i < d; ++i) o[i] = silu_mul(g[i], u[i]);
    }
}

void llmserve_silu_and_mul_f32(const float *x, int64_t rows, int64_t d, float *out, int32_t num_threads) {
    silu_job j = {x, d, out};
    parallel_for(num_threads, rows * d > 16384, rows, grain(2 * d), silu_rows, &j);
}

/* out[t] = gelu_tanh(gate) * up (Gemma's MLP; transformers' gelu_pytorch_tanh): glu.h's
 * gelu_tanh_mul. */
static void gelu_rows(void *ctx, int64_t begin, int64_t end) {
    const silu_job *j = ctx;
    const float *x = j->x;
    const int64_t d = j->d;
    float *out = j->out;
    for (int64_t t = begin; t < end; ++t) {
        const float *g = x + t * 2 * d, *u = g + d;
        float *o = out + t * d;
        for (int64_t i = 0; i < d; ++i) o[i] = gelu_tanh_mul(g[i], u[i]);
    }
}

void llmserve_gelu_tanh_and_mul_f32(const float *x, int64_t rows, int64_t d, float *out, int32_t num_threads) {
    silu_job j = {x, d, out};
    parallel_for(num_threads, rows * d > 16384, rows, grain(2 * d), gelu_rows, &j);
}
