/* Paged attention on the CPU, reading K/V from the cache blocks in place (fp32).
 *
 * The arithmetic is the reference's (kernels/reference/paged_attention.py): each query vector
 * attends to context positions [0, limit) of its sequence, softmax(q . k * scale) . v. What
 * differs is where the data comes from: K and V rows are read straight out of the blocks named by
 * the block table, once per work item, where the torch path first copies them out of the cache
 * and then reads the copy.
 *
 * The code is written at the target's own vector width W: 16 floats (one AVX-512 register), 8
 * (AVX2) or 4 (SSE2, NEON); each is its own build (native_build.py), chosen at run time. Work
 * items are (sequence, KV head, tile of query vectors). A decode's item holds the query heads
 * that share the KV head and takes dot products: queries and K rows go in groups of four dot
 * products that reduce together, as many queries per K row load as half the registers hold. A
 * chunk's tile holds 2W query vectors (its rows times those heads, in order) in the lanes of two
 * vectors: q . k at a position is head_dim multiply-adds of the transposed queries by the K row's
 * broadcast values, with no horizontal sums, and the same for the output over V.
 * Every vector's result is computed in the same order whatever else is in its group, tile, step
 * or thread, and a chunk's lane sums in a decode's order (tile_scores_at, the softmax sums), so a
 * row's output depends only on its query and its context: the same bits alone or in a batch, in
 * any split of its chunk, and as the decode of its position (what a recompute after preemption
 * meets: tokens decoded one by one come back as rows of one chunk).
 *
 * A layer with soft-capped scores (Gemma 2: `softcap` > 0) caps each scaled score, tanh(s / cap) * cap,
 * before the mask and the softmax, through one scalar function for decodes and chunks alike.
 *
 * Its (sequence, head, tile) items are shared among threads by parallel.h's pool. */

#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fast_exp.h"
#include "parallel.h"

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

/* A chunk's tile: T vectors' lanes of query vectors (TILE in all), and PV_ELEMS output elements
 * of each per pass over V, so that the accumulators fill half the registers. Two vectors per tile
 * halve the loads per multiply-add against one (a K or V value broadcast feeds both): 1.3-1.5x on
 * AVX-512 chunks; four measured no faster. */
#define T 2
#define TILE (T * W)
#define PV_ELEMS (REGS / 2 / T)

#define INLINE static inline __attribute__((always_inline))

/* GCC/Clang vector types at the target's width, so that values stay in whole registers.
 * Aligned to a float only: GCC does not realign every stack frame (OpenMP's outlined functions
 * among them) for wide types, and aligned moves there fault. */
typedef float vf __attribute__((vector_size(4 * W), aligned(4)));
/* The same type for reading and writing floats in place (any float's address, any alias). */
typedef float vf_at __attribute__((vector_size(4 * W), aligned(4), may_alias));
typedef int32_t vi __attribute__((vector_size(4 * W), aligned(4)));
typedef float v8 __attribute__((vector_size(32), aligned(4)));
typedef float v4 __attribute__((vector_size(16), aligned(4)));

INLINE vf loadv(const float *p) { return *(const vf_at *)p; }

INLINE void storev(float *p, vf x) { *(vf_at *)p = x; }

INLINE vf select_v(vi keep, vf yes, vf no) { return (vf)(((vi)yes & keep) | ((vi)no & ~keep)); }

/* The lane sums of four vectors, [a, b, c, d], each in the same fixed tree. */
#if W >= 8
#if W == 16
INLINE v8 fold(vf x) {
    return __builtin_shufflevector(x, x, 0, 1, 2, 3, 4, 5, 6, 7) +
           __builtin_shufflevector(x, x, 8, 9, 10, 11, 12, 13, 14, 15);
}
#else
INLINE v8 fold(vf x) { return x; }
#endif
INLINE v4 hsum4(vf a, vf b, vf c, vf d) {
    const v8 a8 = fold(a), b8 = fold(b), c8 = fold(c), d8 = fold(d);
    const v8 ab = __builtin_shufflevector(a8, b8, 0, 1, 2, 3, 8, 9, 10, 11) +
                  __builtin_shufflevector(a8, b8, 4, 5, 6, 7, 12, 13, 14, 15);
    const v8 cd = __builtin_shufflevector(c8, d8, 0, 1, 2, 3, 8, 9, 10, 11) +
                  __builtin_shufflevector(c8, d8, 4, 5, 6, 7, 12, 13, 14, 15);
    const v8 x = __builtin_shufflevector(ab, cd, 0, 1, 8, 9, 4, 5, 12, 13) +
                 __builtin_shufflevector(ab, cd, 2, 3, 10, 11, 6, 7, 14, 15);
    const v4 acbd = __builtin_shufflevector(x, x, 0, 2, 4, 6) + __builtin_shufflevector(x, x, 1, 3, 5, 7);
    return __builtin_shufflevector(acbd, acbd, 0, 2, 1, 3);
}
#else
INLINE v4 hsum4(vf a, vf b, vf c, vf d) {
    const v4 ab = __builtin_shufflevector(a, b, 0, 1, 4, 5) + __builtin_shufflevector(a, b, 2, 3, 6, 7);
    const v4 cd = __builtin_shufflevector(c, d, 0, 1, 4, 5) + __builtin_shufflevector(c, d, 2, 3, 6, 7);
    return __builtin_shufflevector(ab, cd, 0, 2, 4, 6) + __builtin_shufflevector(ab, cd, 1, 3, 5, 7);
}
#endif

/* q . k's lane partial sums over head size D (a multiple of W): two chains over d's vectors,
 * added. Every q . k of a decode is this, then hsum4's tree. */
INLINE vf dot_lanes(const vf *restrict q, const float *restrict k, const int D) {
    vf even = q[0] * loadv(k), odd = (vf){0};
    for (int c = 1; c < D / W; c += 2) {
        odd += q[c] * loadv(k + c * W);
        if (c + 1 < D / W) even += q[c + 1] * loadv(k + (c + 1) * W);
    }
    return even + odd;
}

/* softmax numerators of s[0, n) in place, exactly 0 before position lo (outside a sliding window;
 * their scores are -inf); returns their sum (W partial sums, fixed tree). */
INLINE float softmax_numerators(float *restrict s, int n, int lo) {
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
    float acc[W] = {0};
    p = 0;
    for (; p + W <= n; p += W)
        for (int l = 0; l < W; ++l) {
            float e = p + l < lo ? 0.0f : exp_nonpositive(s[p + l] - m);
            s[p + l] = e;
            acc[l] += e;
        }
    for (int l = 0; p + l < n; ++l) {
        float e = p + l < lo ? 0.0f : exp_nonpositive(s[p + l] - m);
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
    const float *k_cache, *v_cache; /* [num_blocks, block_size, num_kv_heads, head_dim] */
    const int32_t *block_tables;
    int64_t block_table_stride;
    const int32_t *seq_lens, *query_start_loc;
    int32_t num_heads, num_kv_heads, block_size;
    float scale;
    int32_t window; /* > 0: a query sees only the last `window` positions up to its own */
    float softcap;  /* > 0: every scaled score s becomes tanh(s / softcap) * softcap (Gemma 2) */
    float *out; /* [num_tokens, num_heads, head_dim], contiguous */
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
INLINE const float *block_at(const Args *a, const float *cache, const Seq *s, int blk, int h, const int D) {
    return cache + ((int64_t)s->table[blk] * a->block_size * a->num_kv_heads + h) * D;
}

/* Query vector `head` of the sequence's query token `row`. */
INLINE const float *query_at(const Args *a, const Seq *s, int row, int head) {
    return a->q + (int64_t)(s->start + row) * a->q_stride_token + (int64_t)head * a->q_stride_head;
}

/* Decode queries per K row load: as many as half the registers hold, at most four; a group's
 * G queries times 4 / G positions are four dot products that reduce together. */
#define DECODE_GROUP(D) (REGS / 2 * W / (D) >= 4 ? 4 : REGS / 2 * W / (D) >= 2 ? 2 : 1)

/* The scores of G queries (from `head` on) at a block's n positions, into their score rows. */
INLINE void decode_block_scores(const Args *a, const Seq *s, int head, const float *kb, int n,
                                float *const *rows, const int G, const int D) {
    const int R = 4 / G;
    const int64_t ps = (int64_t)a->num_kv_heads * D;
    vf qr[G][D / W];
    for (int j = 0; j < G; ++j)
        for (int c = 0; c < D / W; ++c) qr[j][c] = loadv(query_at(a, s, 0, head + j) + c * W);
    int p = 0;
    for (; p + R <= n; p += R) {
        vf acc[4];
        for (int j = 0; j < G; ++j)
            for (int r = 0; r < R; ++r) acc[j * R + r] = dot_lanes(qr[j], kb + (p + r) * ps, D);
        const v4 s4 = hsum4(acc[0], acc[1], acc[2], acc[3]);
        for (int j = 0; j < G; ++j)
            for (int r = 0; r < R; ++r) rows[j][p + r] = s4[j * R + r] * a->scale;
    }
    for (; p < n; ++p)
        for (int j = 0; j < G; ++j) {
            const vf x = dot_lanes(qr[j], kb + p * ps, D);
            rows[j][p] = hsum4(x, x, x, x)[0] * a->scale;
        }
}

/* The largest divisor of n that is at most `most` (a constant where n and most are). */
INLINE int largest_divisor_at_most(int n, int most) {
    int d = most < n ? most : n;
    while (n % d) --d;
    return d;
}

/* Decode queries whose outputs accumulate together over one V row load, and the most vectors of
 * each query's output held at a time: the G x SLICE accumulators fill half the registers, enough
 * independent chains to hide the multiply-add's latency. */
#define DECODE_PV_GROUP (REGS >= 32 ? 4 : 1)

/* The outputs of G queries (from `head` on; their softmax numerators in rows of ctx from w, their
 * sums in sums) over the V rows, SLICE vectors of each at a time: a query's sums run over
 * positions in order, whichever queries share its group. */
INLINE void decode_output(const Args *a, const Seq *sq, int head, const float *w, int ctx, int lo,
                          const float *sums, const int G, const int D) {
    const int bs = a->block_size, h = head / (a->num_heads / a->num_kv_heads);
    const int64_t ps = (int64_t)a->num_kv_heads * D;
    const int nv = D / W, SLICE = largest_divisor_at_most(nv, REGS / 2 / G);
    for (int c0 = 0; c0 < nv; c0 += SLICE) {
        vf acc[G][SLICE];
        for (int j = 0; j < G; ++j)
            for (int c = 0; c < SLICE; ++c) acc[j][c] = (vf){0};
        /* blocks wholly before lo have weights of exactly 0: adding them would change no bit */
        for (int blk = lo / bs; blk * bs < ctx; ++blk) {
            const float *vb = block_at(a, a->v_cache, sq, blk, h, D) + c0 * W;
            const int p0 = blk * bs, n = ctx - p0 < bs ? ctx - p0 : bs;
            for (int p = 0; p < n; ++p) {
                const float *vp = vb + p * ps;
                for (int j = 0; j < G; ++j) {
                    const float wj = w[(int64_t)j * ctx + p0 + p];
                    for (int c = 0; c < SLICE; ++c) acc[j][c] += wj * loadv(vp + c * W);
                }
            }
        }
        for (int j = 0; j < G; ++j) {
            float *o = a->out + ((int64_t)sq->start * a->num_heads + head + j) * D + c0 * W;
            for (int c = 0; c < SLICE; ++c) storev(o + c * W, acc[j][c] / sums[j]);
        }
    }
}

/* A decode: sequence b's one query, its rep heads that share KV head h, all seeing the whole
 * context. D is a compile-time constant where the caller can make it one (64, 128), so that
 * queries and accumulators stay in registers. */
INLINE void attend_decode(const Args *a, int b, int h, float *scores, const int D) {
    const int rep = a->num_heads / a->num_kv_heads;
    const int bs = a->block_size;
    const int64_t ps = (int64_t)a->num_kv_heads * D;
    const int G = DECODE_GROUP(D);
    const Seq sq = seq_of(a, b);
    const int ctx = sq.ctx;
    /* the window: positions before lo are masked (-inf scores, then exactly 0 weights) */
    const int lo = a->window > 0 && ctx > a->window ? ctx - a->window : 0;
    for (int v = 0; v < rep; ++v)
        for (int p = 0; p < lo; ++p) scores[(int64_t)v * ctx + p] = -INFINITY;
    /* scores[v * ctx + p] = q_v . k_p * scale */
    for (int blk = lo / bs; blk * bs < ctx; ++blk) {
        const float *kb = block_at(a, a->k_cache, &sq, blk, h, D);
        const int p0 = blk * bs, n = ctx - p0 < bs ? ctx - p0 : bs;
        if (p0 + bs < ctx) { /* the next block is elsewhere in memory: ask for it now */
            const char *next = (const char *)block_at(a, a->k_cache, &sq, blk + 1, h, D);
            const char *nextv = (const char *)block_at(a, a->v_cache, &sq, blk + 1, h, D);
            for (int p = 0; p < bs; ++p)
                for (int c = 0; c < D * 4; c += 64) {
                    __builtin_prefetch(next + p * ps * 4 + c);
                    __builtin_prefetch(nextv + p * ps * 4 + c);
                }
        }
        int v = 0;
        for (; v + G <= rep; v += G) {
            float *rows[4];
            for (int j = 0; j < G; ++j) rows[j] = scores + (int64_t)(v + j) * ctx + p0;
            decode_block_scores(a, &sq, h * rep + v, kb, n, rows, G, D);
        }
        for (; v < rep; ++v) {
            float *row = scores + (int64_t)v * ctx + p0;
            decode_block_scores(a, &sq, h * rep + v, kb, n, &row, 1, D);
        }
    }
    if (a->softcap > 0) /* soft-capped scores: a pass over the scaled ones (the loop above stays plain) */
        for (int v = 0; v < rep; ++v) {
            float *row = scores + (int64_t)v * ctx;
            for (int p = lo; p < ctx; ++p) row[p] = soft_cap(row[p], a->softcap);
        }
    for (int v = 0; v < rep; ++v) /* the block holding lo was scored whole: mask its head */
        for (int p = lo / bs * bs; p < lo; ++p) scores[(int64_t)v * ctx + p] = -INFINITY;
    float sums[rep];
    for (int v = 0; v < rep; ++v) sums[v] = softmax_numerators(scores + (int64_t)v * ctx, ctx, lo);
    int v = 0;
    for (; v + DECODE_PV_GROUP <= rep; v += DECODE_PV_GROUP)
        decode_output(a, &sq, h * rep + v, scores + (int64_t)v * ctx, ctx, lo, sums + v, DECODE_PV_GROUP, D);
    for (; v < rep; ++v)
        decode_output(a, &sq, h * rep + v, scores + (int64_t)v * ctx, ctx, lo, sums + v, 1, D);
}

/* Positions whose scores one pass over the tile's queries computes: each query vector loaded
 * feeds all of them (2 measured faster than 1 and 4). */
#define TILE_POSITIONS 2

/* A tile's T vectors of query lanes at TILE_POSITIONS positions. */
typedef struct {
    vf v[TILE_POSITIONS][T];
} tile_part;

INLINE tile_part tile_add(tile_part x, tile_part y) {
    for (int p = 0; p < TILE_POSITIONS; ++p)
        for (int t = 0; t < T; ++t) x.v[p][t] += y.v[p][t];
    return x;
}

/* For lanes l and l + W/2 of d: dot_lanes' two chains over d's vectors (even and odd), added,
 * then the two lanes added: the first level of hsum4's tree, for the K rows k + p * ps. */
INLINE tile_part tile_first_level(const vf (*restrict qt)[T], const float *restrict k, int64_t ps, int l,
                                  const int D) {
    const int nv = D / W;
    tile_part out;
    for (int p = 0; p < TILE_POSITIONS; ++p) {
        const float *kp = k + p * ps;
        vf lane[2][T];
        for (int u = 0; u < 2; ++u) {
            const int d = l + u * (W / 2);
            for (int t = 0; t < T; ++t) {
                vf even = qt[d][t] * kp[d], odd = (vf){0};
                for (int c = 1; c < nv; c += 2) {
                    odd += qt[c * W + d][t] * kp[c * W + d];
                    if (c + 1 < nv) even += qt[(c + 1) * W + d][t] * kp[(c + 1) * W + d];
                }
                lane[u][t] = even + odd;
            }
        }
        for (int t = 0; t < T; ++t) out.v[p][t] = lane[0][t] + lane[1][t];
    }
    return out;
}

/* The scores of a tile's query lanes at TILE_POSITIONS K rows from k (ps apart): each lane's
 * q . k summed in the order a decode of that query sums it (dot_lanes, then hsum4's tree: lane l
 * with l + W/2, then l + W/4, ...), so that a query's scores are the same bits whether its token
 * is a decode or a row of a chunk. The tree's levels are written out (not a loop over an array of
 * partial sums) so that few partial sums are alive at once and they stay in registers. */
INLINE tile_part tile_scores_at(const vf (*restrict qt)[T], const float *restrict k, int64_t ps, const int D) {
#define L1(l) tile_first_level(qt, k, ps, (l), D)
#if W == 16
#define L2(i) tile_add(L1(i), L1((i) + 4))
#define L3(i) tile_add(L2(i), L2((i) + 2))
    return tile_add(L3(0), L3(1));
#elif W == 8
#define L2(i) tile_add(L1(i), L1((i) + 2))
    return tile_add(L2(0), L2(1));
#else
    return tile_add(L1(0), L1(1));
#endif
#undef L1
#undef L2
#undef L3
}

/* A tile of a chunk's query vectors (rows times heads, in order, from vector v0): TILE of them,
 * the lanes of T vectors, so q . k for all of them at one position is D multiply-adds of the
 * transposed queries by that K row's broadcast values (no horizontal sums), and each output
 * element is the same over V. A lane's sums run over d, then over positions, in order, and a
 * position past a lane's causal limit adds an exact zero: a vector's result does not depend on
 * which vectors share its tile. */
INLINE void attend_tile(const Args *a, int b, int h, int v0, vf *restrict st, const int D, const int CAP) {
    const int rep = a->num_heads / a->num_kv_heads;
    const int bs = a->block_size;
    const int64_t ps = (int64_t)a->num_kv_heads * D;
    const Seq sq = seq_of(a, b);
    const int nvec = sq.q_len * rep - v0 < TILE ? sq.q_len * rep - v0 : TILE;
    vf qt[D][T];
    vi limit[T], low[T]; /* a lane sees positions [low, limit): its window, or from 0 */
    for (int t = 0; t < T; ++t) limit[t] = low[t] = (vi){0};
    for (int v = 0; v < TILE; ++v) {
        const int row = (v0 + v) / rep;
        if (v < nvec) {
            const float *qv = query_at(a, &sq, row, h * rep + (v0 + v) % rep);
            for (int d = 0; d < D; ++d) qt[d][v / W][v % W] = qv[d];
            limit[v / W][v % W] = sq.ctx - sq.q_len + row + 1;
            if (a->window > 0 && limit[v / W][v % W] > a->window)
                low[v / W][v % W] = limit[v / W][v % W] - a->window;
        } else
            for (int d = 0; d < D; ++d) qt[d][v / W][v % W] = 0.0f;
    }
    const int longest = limit[(nvec - 1) / W][(nvec - 1) % W];
    /* The tile's first query sees the earliest position (rows rise, and their windows with them):
     * blocks wholly before it are never read, as no lane sees them (a sliding-window layer's
     * cache may have released them). Their positions would add exact zeros to every sum. */
    const int first_blk = low[0][0] / bs, first_pos = first_blk * bs;
    const vf neg_inf = (vf){0} - INFINITY;
    vf m[T];
    for (int t = 0; t < T; ++t) m[t] = neg_inf;
    /* st[p * T + t] = the tile's scores at position p (masked past each lane's limit) */
    for (int blk = first_blk; blk * bs < longest; ++blk) {
        const float *kb = block_at(a, a->k_cache, &sq, blk, h, D);
        const int p0 = blk * bs;
        const int n = longest - p0 < bs ? longest - p0 : bs;
        int p = 0;
        for (; p + TILE_POSITIONS <= n; p += TILE_POSITIONS) {
            const tile_part s = tile_scores_at(qt, kb + p * ps, ps, D);
            for (int j = 0; j < TILE_POSITIONS; ++j)
                for (int t = 0; t < T; ++t) {
                    const int q = p0 + p + j;
                    const vf sc = capped_v(a, s.v[j][t] * a->scale, CAP);
                    const vf x = select_v((q < limit[t]) & (q >= low[t]), sc, neg_inf);
                    st[(p0 + p + j) * T + t] = x;
                    m[t] = select_v(x > m[t], x, m[t]);
                }
        }
        for (; p < n; ++p) { /* the block's last positions: each one pass (ps 0: the same row again) */
            const tile_part s = tile_scores_at(qt, kb + p * ps, 0, D);
            for (int t = 0; t < T; ++t) {
                const vf sc = capped_v(a, s.v[0][t] * a->scale, CAP);
                const vf x = select_v((p0 + p < limit[t]) & (p0 + p >= low[t]), sc, neg_inf);
                st[(p0 + p) * T + t] = x;
                m[t] = select_v(x > m[t], x, m[t]);
            }
        }
    }
    /* softmax numerators, lane by lane; a masked position's is exactly 0. Their sums in
     * softmax_numerators' order: W partial sums, position p into the (p % W)-th, then halved. */
    vf part[W][T];
    for (int l = 0; l < W; ++l)
        for (int t = 0; t < T; ++t) part[l][t] = (vf){0};
    for (int p0 = first_pos - first_pos % W; p0 < longest; p0 += W)
        for (int l = 0; l < W && p0 + l < longest; ++l) {
            const int p = p0 + l;
            if (p < first_pos) continue;
            for (int t = 0; t < T; ++t) {
                float e[W];
                for (int j = 0; j < W; ++j) e[j] = exp_nonpositive(st[p * T + t][j] - m[t][j]);
                const vf x = select_v((p < limit[t]) & (p >= low[t]), loadv(e), (vf){0});
                st[p * T + t] = x;
                part[l][t] += x;
            }
        }
    for (int w = W / 2; w > 0; w /= 2)
        for (int l = 0; l < w; ++l)
            for (int t = 0; t < T; ++t) part[l][t] += part[l + w][t];
    vf sum[T];
    for (int t = 0; t < T; ++t) sum[t] = part[0][t];
    /* the output, PV_ELEMS elements of every vector at a time (accumulators in half the registers) */
    for (int dc = 0; dc < D; dc += PV_ELEMS) {
        vf acc[PV_ELEMS][T];
        for (int i = 0; i < PV_ELEMS; ++i)
            for (int t = 0; t < T; ++t) acc[i][t] = (vf){0};
        for (int blk = first_blk; blk * bs < longest; ++blk) {
            const float *vb = block_at(a, a->v_cache, &sq, blk, h, D) + dc;
            const int p0 = blk * bs;
            const int n = longest - p0 < bs ? longest - p0 : bs;
            for (int p = 0; p < n; ++p) {
                const float *vp = vb + p * ps;
                for (int t = 0; t < T; ++t) {
                    const vf w = st[(p0 + p) * T + t];
                    for (int i = 0; i < PV_ELEMS; ++i) acc[i][t] += w * vp[i];
                }
            }
        }
        for (int v = 0; v < nvec; ++v) {
            const int row = (v0 + v) / rep, head = h * rep + (v0 + v) % rep;
            float *o = a->out + ((int64_t)(sq.start + row) * a->num_heads + head) * D + dc;
            for (int i = 0; i < PV_ELEMS; ++i) o[i] = acc[i][v / W][v % W] / sum[v / W][v % W];
        }
    }
}

/* The step's work list: items (sequence, KV head, first query vector of its tile), three int32
 * each, in a fixed order, and the longest context. Every layer of a step passes the same metadata,
 * so the list is built for the first layer's call and reused by the others: it is kept per thread
 * with a copy of the metadata it was built from (query_start_loc and seq_lens, compared by content:
 * a new step's arrays may sit at the old addresses), in buffers reused across steps and grown when
 * a step needs more. The calling thread's: two threads calling at once never share one. */
typedef struct {
    int32_t *items, *meta;
    int64_t items_cap, meta_cap, num_items, builds;
    int32_t num_seqs, num_heads, num_kv_heads, longest;
} WorkList;

static _Thread_local WorkList work_list = {.num_seqs = -1};

/* This thread's work list for the metadata, built if it differs from the last call's; NULL when
 * memory ran out. */
static const WorkList *work_list_for(const int32_t *seq_lens, const int32_t *query_start_loc,
                                     int32_t num_seqs, int32_t num_heads, int32_t num_kv_heads) {
    WorkList *w = &work_list;
    const size_t meta_bytes = sizeof(int32_t) * (2 * (size_t)num_seqs + 1);
    if (w->num_seqs == num_seqs && w->num_heads == num_heads && w->num_kv_heads == num_kv_heads &&
        !memcmp(w->meta, query_start_loc, sizeof(int32_t) * ((size_t)num_seqs + 1)) &&
        !memcmp(w->meta + num_seqs + 1, seq_lens, sizeof(int32_t) * (size_t)num_seqs))
        return w;
    const int rep = num_heads / num_kv_heads;
    int64_t num_items = 0;
    int32_t longest = 1;
    for (int b = 0; b < num_seqs; ++b) {
        const int q_len = query_start_loc[b + 1] - query_start_loc[b];
        const int tiles = q_len == 1 ? 1 : (q_len * rep + TILE - 1) / TILE;
        num_items += (int64_t)num_kv_heads * tiles;
        longest = seq_lens[b] > longest ? seq_lens[b] : longest;
    }
    w->num_seqs = -1; /* not valid until built */
    if (num_items > w->items_cap) {
        const int64_t cap = num_items > 2 * w->items_cap ? num_items : 2 * w->items_cap;
        int32_t *grown = realloc(w->items, sizeof(int32_t) * 3 * (size_t)cap);
        if (!grown) return NULL;
        w->items = grown;
        w->items_cap = cap;
    }
    if ((int64_t)meta_bytes > w->meta_cap) {
        int32_t *grown = realloc(w->meta, 2 * meta_bytes);
        if (!grown) return NULL;
        w->meta = grown;
        w->meta_cap = (int64_t)(2 * meta_bytes);
    }
    int64_t n = 0;
    for (int b = 0; b < num_seqs; ++b) {
        const int q_len = query_start_loc[b + 1] - query_start_loc[b];
        const int step = q_len == 1 ? rep : TILE;
        for (int h = 0; h < num_kv_heads; ++h)
            for (int v0 = 0; v0 < q_len * rep; v0 += step) {
                w->items[3 * n] = b;
                w->items[3 * n + 1] = h;
                w->items[3 * n + 2] = v0;
                ++n;
            }
    }
    memcpy(w->meta, query_start_loc, sizeof(int32_t) * ((size_t)num_seqs + 1));
    memcpy(w->meta + num_seqs + 1, seq_lens, sizeof(int32_t) * (size_t)num_seqs);
    w->num_items = num_items;
    w->longest = longest;
    w->builds += 1;
    w->num_heads = num_heads;
    w->num_kv_heads = num_kv_heads;
    w->num_seqs = num_seqs;
    return w;
}

/* How many times this thread built a work list (tests count them). */
int64_t llmserve_paged_attention_work_list_builds(void) { return work_list.builds; }

/* A thread's scores buffer, kept and grown, never freed (an allocation per item cost more than
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

typedef struct {
    const Args *a;
    const int32_t *items, *query_start_loc;
    int32_t head_dim;
    size_t scratch;
    _Atomic int failed;
} attention_job;

static void attention_items(void *ctx, int64_t begin, int64_t end) {
    attention_job *j = ctx;
    float *scores = thread_scores(j->scratch);
    if (!scores) {
        atomic_store(&j->failed, 1);
        return;
    }
    const Args *a = j->a;
    for (int64_t i = begin; i < end; ++i) {
        const int b = j->items[3 * i], h = j->items[3 * i + 1], v0 = j->items[3 * i + 2];
        if (j->query_start_loc[b + 1] - j->query_start_loc[b] == 1) { /* a decode: dot products */
            switch (j->head_dim) {
            case 64: attend_decode(a, b, h, scores, 64); break;
            case 128: attend_decode(a, b, h, scores, 128); break;
            default: attend_decode(a, b, h, scores, j->head_dim);
            }
        } else { /* a chunk: tiles of TILE vectors in the lanes */
            vf *st = (vf *)scores;
            if (a->softcap > 0) /* soft-capped scores: its own instance, the plain one untouched */
                attend_tile(a, b, h, v0, st, j->head_dim, 1);
            else
                switch (j->head_dim) {
                case 64: attend_tile(a, b, h, v0, st, 64, 0); break;
                case 128: attend_tile(a, b, h, v0, st, 128, 0); break;
                default: attend_tile(a, b, h, v0, st, j->head_dim, 0);
                }
        }
    }
}

/* Attention for every sequence of the batch (one with no queries this step has no work).
 * head_dim must be a multiple of W. Returns 0, -1 for a shape this library does not take, or -2
 * when memory ran out. */
int llmserve_paged_attention_f32(const float *q, int64_t q_stride_token, int64_t q_stride_head,
                                 const float *k_cache, const float *v_cache,
                                 const int32_t *block_tables, int64_t block_table_stride,
                                 const int32_t *seq_lens, const int32_t *query_start_loc,
                                 int32_t num_seqs, int32_t num_heads, int32_t num_kv_heads,
                                 int32_t head_dim, int32_t block_size, float scale, float *out,
                                 int32_t num_threads, int32_t window, float softcap) {
    if (head_dim % W || num_kv_heads < 1 || num_heads % num_kv_heads || window < 0 || !(softcap >= 0))
        return -1;
    const Args a = {q, q_stride_token, q_stride_head, k_cache, v_cache, block_tables,
                    block_table_stride, seq_lens, query_start_loc, num_heads, num_kv_heads,
                    block_size, scale, window, softcap, out};
    const int rep = num_heads / num_kv_heads;
    const WorkList *w = work_list_for(seq_lens, query_start_loc, num_seqs, num_heads, num_kv_heads);
    if (!w) return -2;
    const int32_t *items = w->items, longest = w->longest;
    const int64_t num_items = w->num_items;
    const size_t bytes = sizeof(float) * (size_t)(rep > TILE ? rep : TILE) * (size_t)longest;
    attention_job j = {&a, items, query_start_loc, head_dim, bytes, 0};
    parallel_for(num_threads, 1, num_items, 1, attention_items, &j);
    return atomic_load(&j.failed) ? -2 : 0;
}
