/* Paged attention on the CPU, reading K/V from the cache blocks in place (fp32).
 *
 * The arithmetic is the reference's (kernels/reference/paged_attention.py): each query vector
 * attends to context positions [0, limit) of its sequence, softmax(q . k * scale) . v. What
 * differs is where the data comes from: K and V rows are read straight out of the blocks named by
 * the block table, once per work item, where the torch path first copies them out of the cache
 * and then reads the copy.
 *
 * Work items are (sequence, KV head, tile of query rows). A decode's item holds the query heads
 * that share the KV head and takes dot products, so a K/V row loaded for one is in L1 for the
 * others. A chunk's tile holds up to 16 query vectors (its rows times those heads) in the lanes
 * of one vector: q . k at a position is head_dim multiply-adds of the transposed queries by the
 * K row's broadcast values, with no horizontal sums, and the same for the output over V.
 * Every vector's result is computed by the same code in the same order whatever else is in its
 * tile, its step or its thread, so a row's output depends only on its query and its context:
 * the same alone or in a batch, and in any split of its chunk into chunks of two rows or more
 * (a decode and a chunk's row sum the same terms in another order: equal within rounding).
 *
 * The library is compiled (see native_build.py) once per instruction set: the same source with
 * -march=x86-64-v4 (AVX-512), -march=x86-64-v3 (AVX2 + FMA) or none, chosen at run time. OpenMP
 * threads are torch's own: torch's wheel loads libgomp.so.1 first, and this library's reference
 * to that soname binds to it, so there is one thread pool. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define LANES 16   /* partial sums per dot product: one AVX-512 register, two AVX2 ones */
#define MAX_VEC 16 /* query vectors per work item */

#define INLINE static inline __attribute__((always_inline))

/* GCC/Clang vector types: one source for every instruction set (a 16-float vector is one AVX-512
 * register, two AVX2 ones, four SSE ones), and reductions that stay in registers. */
/* Aligned to a float only: GCC does not realign every stack frame (OpenMP's outlined functions
 * among them) for 64-byte types when it targets AVX2, and aligned moves there fault. */
typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef float v8 __attribute__((vector_size(32), aligned(4)));
typedef float v4 __attribute__((vector_size(16), aligned(4)));

INLINE v16 load16(const float *p) {
    v16 x;
    memcpy(&x, p, sizeof x);
    return x;
}

/* The sum of a vector's lanes, in a fixed tree. */
INLINE float hsum16(v16 x) {
    v8 a = __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7) +
           __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
    v4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
    return (b[0] + b[2]) + (b[1] + b[3]);
}

/* q . k over d elements (a multiple of LANES): LANES partial sums in two chains, then a fixed
 * tree. The order never depends on the caller, so equal inputs give equal sums. */
INLINE float dot(const float *restrict a, const float *restrict b, int d) {
    v16 acc0 = load16(a) * load16(b), acc1 = {0};
    int i = LANES;
    for (; i + 2 * LANES <= d; i += 2 * LANES) {
        acc1 += load16(a + i) * load16(b + i);
        acc0 += load16(a + i + LANES) * load16(b + i + LANES);
    }
    if (i < d) acc1 += load16(a + i) * load16(b + i);
    return hsum16(acc0 + acc1);
}

/* The lane sums of four vectors, [a, b, c, d]: hsum16's tree, four at a time. */
INLINE v4 hsum4x16(v16 a, v16 b, v16 c, v16 d) {
#define HALVES(x) (__builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7) + \
                   __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15))
    const v8 a8 = HALVES(a), b8 = HALVES(b), c8 = HALVES(c), d8 = HALVES(d);
#undef HALVES
    const v8 ab = __builtin_shufflevector(a8, b8, 0, 1, 2, 3, 8, 9, 10, 11) +
                  __builtin_shufflevector(a8, b8, 4, 5, 6, 7, 12, 13, 14, 15);
    const v8 cd = __builtin_shufflevector(c8, d8, 0, 1, 2, 3, 8, 9, 10, 11) +
                  __builtin_shufflevector(c8, d8, 4, 5, 6, 7, 12, 13, 14, 15);
    const v8 x = __builtin_shufflevector(ab, cd, 0, 1, 8, 9, 4, 5, 12, 13) +
                 __builtin_shufflevector(ab, cd, 2, 3, 10, 11, 6, 7, 14, 15);
    const v4 acbd = __builtin_shufflevector(x, x, 0, 2, 4, 6) + __builtin_shufflevector(x, x, 1, 3, 5, 7);
    return __builtin_shufflevector(acbd, acbd, 0, 2, 1, 3);
}

/* e^x for x <= 0 (scores minus their maximum), to about 2 ulp: Cody-Waite reduction to
 * 2^n * e^r with |r| <= ln2/2 and a degree-6 polynomial (Cephes' coefficients). Written without
 * calls so that the compiler vectorizes the loops that use it; below -87 it returns e^-87. */
INLINE float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    float n = floorf(x * 1.44269504088896341f + 0.5f);
    float r = x - n * 0.693359375f + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union {
        int32_t i;
        float f;
    } two_n = {.i = ((int32_t)n + 127) << 23};
    return p * two_n.f;
}

/* softmax numerators of s[0, n) in place; returns their sum (LANES partial sums, fixed tree). */
INLINE float softmax_numerators(float *restrict s, int n) {
    float m = -INFINITY;
    for (int p = 0; p < n; ++p) m = s[p] > m ? s[p] : m;
    float acc[LANES] = {0};
    int p = 0;
    for (; p + LANES <= n; p += LANES)
        for (int l = 0; l < LANES; ++l) {
            float e = exp_nonpositive(s[p + l] - m);
            s[p + l] = e;
            acc[l] += e;
        }
    for (int l = 0; p + l < n; ++l) {
        float e = exp_nonpositive(s[p + l] - m);
        s[p + l] = e;
        acc[l] += e;
    }
    for (int w = LANES / 2; w > 0; w /= 2)
        for (int l = 0; l < w; ++l) acc[l] += acc[l + w];
    return acc[0];
}

typedef struct {
    const float *q;
    int64_t q_stride_token, q_stride_head;
    const float *k_cache, *v_cache; /* [num_blocks, block_size, num_kv_heads, head_dim] */
    const int32_t *block_tables;
    int64_t block_table_stride;
    const int32_t *seq_lens, *query_start_loc;
    int32_t num_heads, num_kv_heads, block_size;
    float scale;
    float *out; /* [num_tokens, num_heads, head_dim], contiguous */
} Args;

/* Where sequence b's tokens and blocks are. */
typedef struct {
    int start, q_len, ctx;      /* its first query token, its queries this step, its context */
    const int32_t *table;       /* its block table */
} Seq;

INLINE Seq seq_of(const Args *a, int b) {
    const int start = a->query_start_loc[b];
    return (Seq){start, a->query_start_loc[b + 1] - start, a->seq_lens[b],
                 a->block_tables + (int64_t)b * a->block_table_stride};
}

/* KV head h's row of position 0 of the sequence's blk-th block, in cache. */
INLINE const float *block_at(const Args *a, const float *cache, const Seq *s, int blk, int h, const int D) {
    return cache + ((int64_t)s->table[blk] * a->block_size * a->num_kv_heads + h) * D;
}

/* A decode: sequence b's one query, its rep heads that share KV head h, all seeing the whole
 * context. D is a compile-time constant where the caller can make it one (64, 128), so that q and
 * the output accumulators stay in registers. */
INLINE void attend_decode(const Args *a, int b, int h, float *scores, const int D) {
    const int rep = a->num_heads / a->num_kv_heads;
    const int bs = a->block_size;
    const int64_t pos_stride = (int64_t)a->num_kv_heads * D;
    const Seq sq = seq_of(a, b);
    const int ctx = sq.ctx;
    const float *qv[MAX_VEC];
    for (int v = 0; v < rep; ++v)
        qv[v] = a->q + (int64_t)sq.start * a->q_stride_token + (int64_t)(h * rep + v) * a->q_stride_head;
    /* scores[v * ctx + p] = q_v . k_p * scale */
    for (int blk = 0; blk * bs < ctx; ++blk) {
        const float *kb = block_at(a, a->k_cache, &sq, blk, h, D);
        const int p0 = blk * bs, n = ctx - p0 < bs ? ctx - p0 : bs;
        if (p0 + bs < ctx) { /* the next block is elsewhere in memory: ask for it now */
            const char *next = (const char *)block_at(a, a->k_cache, &sq, blk + 1, h, D);
            const char *nextv = (const char *)block_at(a, a->v_cache, &sq, blk + 1, h, D);
            for (int p = 0; p < bs; ++p)
                for (int c = 0; c < D * 4; c += 64) {
                    __builtin_prefetch(next + p * pos_stride * 4 + c);
                    __builtin_prefetch(nextv + p * pos_stride * 4 + c);
                }
        }
        int v = 0;
        if (D % (2 * LANES) == 0) /* four queries at a time, held in registers, one K row load */
            for (; v + 4 <= rep; v += 4) {
                v16 qr[4][D / LANES];
                for (int j = 0; j < 4; ++j)
                    for (int c = 0; c < D / LANES; ++c) qr[j][c] = load16(qv[v + j] + c * LANES);
                for (int p = 0; p < n; ++p) {
                    const float *kp = kb + p * pos_stride;
                    v16 acc[4];
                    for (int j = 0; j < 4; ++j) {
                        v16 even = qr[j][0] * load16(kp), odd = (v16){0};
                        for (int c = 1; c < D / LANES; c += 2) {
                            odd += qr[j][c] * load16(kp + c * LANES);
                            if (c + 1 < D / LANES) even += qr[j][c + 1] * load16(kp + (c + 1) * LANES);
                        }
                        acc[j] = even + odd;
                    }
                    const v4 s4 = hsum4x16(acc[0], acc[1], acc[2], acc[3]);
                    for (int j = 0; j < 4; ++j) scores[(int64_t)(v + j) * ctx + p0 + p] = s4[j] * a->scale;
                }
            }
        for (; v < rep; ++v) {
            float *s = scores + (int64_t)v * ctx + p0;
            for (int p = 0; p < n; ++p) s[p] = dot(qv[v], kb + p * pos_stride, D) * a->scale;
        }
    }
    for (int v = 0; v < rep; ++v) {
        const float *s = scores + (int64_t)v * ctx;
        const float sum = softmax_numerators(scores + (int64_t)v * ctx, ctx);
        v16 acc[D / LANES]; /* registers, when D is a constant */
        for (int c = 0; c < D / LANES; ++c) acc[c] = (v16){0};
        for (int blk = 0; blk * bs < ctx; ++blk) {
            const float *vb = block_at(a, a->v_cache, &sq, blk, h, D);
            const int p0 = blk * bs, n = ctx - p0 < bs ? ctx - p0 : bs;
            for (int p = 0; p < n; ++p) {
                const float w = s[p0 + p];
                const float *vp = vb + p * pos_stride;
                for (int c = 0; c < D / LANES; ++c) acc[c] += w * load16(vp + c * LANES);
            }
        }
        float *o = a->out + ((int64_t)sq.start * a->num_heads + h * rep + v) * D;
        for (int c = 0; c < D / LANES; ++c) {
            const v16 x = acc[c] / sum;
            memcpy(o + c * LANES, &x, sizeof x);
        }
    }
}

/* A chunk's rows, a tile at a time: the tile's vectors are the lanes of one 16-float vector, so
 * q . k for all of them at one position is D multiply-adds of the transposed queries by that K
 * row's broadcast values (no horizontal sums), and each output element is the same over V.
 * A lane's sums run over d, then over positions, in order, and a position past a lane's causal
 * limit adds an exact zero: a row's result does not depend on which rows share its tile. */
typedef int32_t vi16 __attribute__((vector_size(64), aligned(4)));

INLINE v16 select16(vi16 keep, v16 yes, v16 no) { return (v16)(((vi16)yes & keep) | ((vi16)no & ~keep)); }

INLINE void attend_tile(const Args *a, int b, int h, int r0, int r1, v16 *restrict st, const int D) {
    const int rep = a->num_heads / a->num_kv_heads;
    const int bs = a->block_size;
    const int64_t pos_stride = (int64_t)a->num_kv_heads * D;
    const Seq sq = seq_of(a, b);
    const int start = sq.start, q_len = sq.q_len, ctx = sq.ctx;
    const int nvec = (r1 - r0) * rep;
    v16 qt[D];
    vi16 limit = {0};
    for (int v = 0; v < nvec; ++v) {
        const int row = r0 + v / rep, head = h * rep + v % rep;
        const float *qv = a->q + (int64_t)(start + row) * a->q_stride_token + (int64_t)head * a->q_stride_head;
        for (int d = 0; d < D; ++d) qt[d][v] = qv[d];
        limit[v] = ctx - q_len + row + 1;
    }
    for (int v = nvec; v < MAX_VEC; ++v)
        for (int d = 0; d < D; ++d) qt[d][v] = 0.0f;
    const int longest = limit[nvec - 1];
    const v16 neg_inf = (v16){0} - INFINITY;
    v16 m = neg_inf;
    /* st[p] = the tile's scores at position p (masked past each lane's limit) */
    for (int blk = 0; blk * bs < longest; ++blk) {
        const float *kb = block_at(a, a->k_cache, &sq, blk, h, D);
        const int p0 = blk * bs;
        const int n = longest - p0 < bs ? longest - p0 : bs;
        int p = 0;
        for (; p + 4 <= n; p += 4) {
            const float *k0 = kb + p * pos_stride, *k1 = k0 + pos_stride, *k2 = k1 + pos_stride,
                        *k3 = k2 + pos_stride;
            v16 s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0};
            for (int d = 0; d < D; ++d) {
                const v16 qd = qt[d];
                s0 += qd * k0[d];
                s1 += qd * k1[d];
                s2 += qd * k2[d];
                s3 += qd * k3[d];
            }
            const v16 sc[4] = {s0, s1, s2, s3};
            for (int j = 0; j < 4; ++j) {
                const v16 x = select16(p0 + p + j < limit, sc[j] * a->scale, neg_inf);
                st[p0 + p + j] = x;
                m = select16(x > m, x, m);
            }
        }
        for (; p < n; ++p) {
            const float *k0 = kb + p * pos_stride;
            v16 s0 = {0};
            for (int d = 0; d < D; ++d) s0 += qt[d] * k0[d];
            const v16 x = select16(p0 + p < limit, s0 * a->scale, neg_inf);
            st[p0 + p] = x;
            m = select16(x > m, x, m);
        }
    }
    /* softmax numerators, lane by lane; a masked position's is exactly 0 */
    v16 sum = {0};
    for (int p = 0; p < longest; ++p) {
        float e[MAX_VEC];
        for (int l = 0; l < MAX_VEC; ++l) e[l] = exp_nonpositive(st[p][l] - m[l]);
        const v16 x = select16(p < limit, load16(e), (v16){0});
        st[p] = x;
        sum += x;
    }
    for (int dc = 0; dc < D; dc += LANES) {
        v16 acc[LANES];
        for (int i = 0; i < LANES; ++i) acc[i] = (v16){0};
        for (int blk = 0; blk * bs < longest; ++blk) {
            const float *vb = block_at(a, a->v_cache, &sq, blk, h, D) + dc;
            const int p0 = blk * bs;
            const int n = longest - p0 < bs ? longest - p0 : bs;
            for (int p = 0; p < n; ++p) {
                const v16 w = st[p0 + p];
                const float *vp = vb + p * pos_stride;
                for (int i = 0; i < LANES; ++i) acc[i] += w * vp[i];
            }
        }
        for (int v = 0; v < nvec; ++v) {
            const int row = r0 + v / rep, head = h * rep + v % rep;
            float *o = a->out + ((int64_t)(start + row) * a->num_heads + head) * D + dc;
            for (int i = 0; i < LANES; ++i) o[i] = acc[i][v] / sum[v];
        }
    }
}

/* Attention for every sequence of the batch (one with no queries this step has no work).
 * head_dim must be a multiple of LANES. Returns 0, or -1 for a shape this library does not take. */
int llmserve_paged_attention_f32(const float *q, int64_t q_stride_token, int64_t q_stride_head,
                                 const float *k_cache, const float *v_cache,
                                 const int32_t *block_tables, int64_t block_table_stride,
                                 const int32_t *seq_lens, const int32_t *query_start_loc,
                                 int32_t num_seqs, int32_t num_heads,
                                 int32_t num_kv_heads, int32_t head_dim, int32_t block_size,
                                 float scale, float *out, int32_t num_threads) {
    if (head_dim % LANES || num_heads % num_kv_heads || num_heads / num_kv_heads > MAX_VEC) return -1;
    const Args a = {q, q_stride_token, q_stride_head, k_cache, v_cache, block_tables,
                    block_table_stride, seq_lens, query_start_loc, num_heads, num_kv_heads,
                    block_size, scale, out};
    const int rep = num_heads / num_kv_heads;
    const int rows_per_tile = MAX_VEC / rep;
    /* Work items, in a fixed order: (sequence, KV head, tile). */
    int64_t num_items = 0;
    int32_t longest = 1;
    for (int b = 0; b < num_seqs; ++b) {
        const int q_len = query_start_loc[b + 1] - query_start_loc[b];
        num_items += (int64_t)num_kv_heads * ((q_len + rows_per_tile - 1) / rows_per_tile);
        longest = seq_lens[b] > longest ? seq_lens[b] : longest;
    }
    int32_t *items = malloc(sizeof(int32_t) * 3 * (num_items ? num_items : 1));
    if (!items) return -2;
    int64_t n = 0;
    for (int b = 0; b < num_seqs; ++b) {
        const int q_len = query_start_loc[b + 1] - query_start_loc[b];
        for (int h = 0; h < num_kv_heads; ++h)
            for (int r0 = 0; r0 < q_len; r0 += rows_per_tile) {
                items[3 * n] = b;
                items[3 * n + 1] = h;
                items[3 * n + 2] = r0;
                ++n;
            }
    }
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *scores = aligned_alloc(64, sizeof(float) * MAX_VEC * (size_t)longest);
        if (!scores) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < num_items; ++i) {
            if (!scores) continue;
            int b = items[3 * i], h = items[3 * i + 1], r0 = items[3 * i + 2];
            int q_len = query_start_loc[b + 1] - query_start_loc[b];
            int r1 = r0 + rows_per_tile < q_len ? r0 + rows_per_tile : q_len;
            if (q_len == 1) { /* a decode: rep vectors, one position each, dot products */
                switch (head_dim) {
                case 64: attend_decode(&a, b, h, scores, 64); break;
                case 128: attend_decode(&a, b, h, scores, 128); break;
                default: attend_decode(&a, b, h, scores, head_dim);
                }
            } else { /* a chunk: tiles of up to 16 vectors in the lanes */
                v16 *st = (v16 *)scores;
                switch (head_dim) {
                case 64: attend_tile(&a, b, h, r0, r1, st, 64); break;
                case 128: attend_tile(&a, b, h, r0, r1, st, 128); break;
                default: attend_tile(&a, b, h, r0, r1, st, head_dim);
                }
            }
        }
        free(scores);
    }
    free(items);
    return failed ? -2 : 0;
}
