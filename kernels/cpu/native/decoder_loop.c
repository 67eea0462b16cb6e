/* The decoder's layer loop for the native CPU path, in one call per forward pass.
 *
 * At batch 1 the kernels of a layer take microseconds each, and the Python around them (one ctypes
 * call, its argument conversions, the output tensors) cost as much again: this loop calls the same
 * kernels, in the same order, with the same arguments, through function pointers taken from their
 * already-loaded libraries (each keeps its own per-instruction-set build), so its result is the
 * Python loop's bit for bit (engine_svc/models/decoder.py; kernels/cpu/native_decoder.py builds
 * the descriptors below and checks, once per step, every index the kernels read unchecked).
 *
 * Per layer: RMSNorm (+ residual) -> QKV GEMM -> rotary + KV-cache store -> paged attention ->
 * O GEMM (+ O bias) -> RMSNorm (+ residual) -> gate/up GEMM -> SiLU-and-multiply -> down GEMM
 * (an int8-activation down takes SiLU into its activation quantization: Layer.down_glu);
 * then the final RMSNorm. Intermediate rows live in the caller's scratch buffers; the residual
 * is updated in place (each element of a row is read before its own slot is written, so this is
 * the kernel's arithmetic on separate buffers). No OpenMP here: each kernel opens its own
 * parallel region with the thread count it is given, as from Python. */

#include <stddef.h>
#include <stdint.h>

typedef void (*gemm_fn)(const float *x, int64_t m, int64_t k, int64_t ldx, const void *packed, int64_t n,
                        const float *bias, float *y, int64_t ldy, int32_t num_threads);
typedef int32_t (*coded_gemm_fn)(int32_t fmt, const float *x, int64_t m, int64_t k, int64_t ldx,
                                 const void *packed, int64_t n, const float *bias, float *y, int64_t ldy,
                                 int32_t num_threads);
typedef void (*rms_norm_fn)(const float *x, const float *residual, const float *weight, float eps, int64_t rows,
                            int64_t dim, float *out, float *residual_out, int32_t num_threads);
typedef void (*rotary_store_fn)(const float *qkv, int64_t stride_token, int64_t tokens, int64_t q_heads,
                                int64_t kv_heads, int64_t dim, const int64_t *positions, const float *cos_sin,
                                const int64_t *slots, float *q_out, float *k_cache, float *v_cache,
                                int32_t num_threads);
typedef int (*attention_fn)(const float *q, int64_t q_stride_token, int64_t q_stride_head, const float *k_cache,
                            const float *v_cache, const int32_t *block_tables, int64_t block_table_stride,
                            const int32_t *seq_lens, const int32_t *query_start_loc, int32_t num_seqs,
                            int32_t num_heads, int32_t num_kv_heads, int32_t head_dim, int32_t block_size,
                            float scale, float *out, int32_t num_threads, int32_t window, float softcap);
typedef int32_t (*mlp_fn)(int32_t glu, int32_t gu_fmt, const float *x, int64_t m, int64_t k, int64_t ldx,
                          const void *gu_packed, const float *gu_bias, int64_t inter, int32_t dn_fmt,
                          const void *dn_packed, int64_t n, const float *dn_bias, float *y, int64_t ldy,
                          int32_t num_threads);
typedef void (*silu_fn)(const float *x, int64_t rows, int64_t d, float *out, int32_t num_threads);
/* (the GELU-tanh-and-multiply kernel has the same signature) */

/* The structs below are mirrored by ctypes in kernels/cpu/native_decoder.py, which checks its
 * mirrors against LAYOUT (further down) at load: a field changed here is changed in all three. */

/* One linear: y[m, n] = x[m, k] . W^T + bias through its own GEMM. `coded`: the entry takes the
 * weight's format code first and returns nonzero to refuse (quant_gemm.c, quant_int8act.c);
 * otherwise it is small_gemm.c's fp32 or bf16-weight entry. */
typedef struct {
    void *fn;
    const void *packed;
    const float *bias; /* NULL: none */
    int64_t n, k;
    int32_t code, coded;
} Linear;

typedef struct {
    Linear qkv, o, gate_up, down;
    const float *input_norm, *post_norm, *o_bias; /* o_bias NULL: none */
    float *k_cache, *v_cache;                    /* [slots, kv_heads, head_dim] each */
    /* The declaration's optional parts (NULL / 0: none): per-head q/k norms, the norms on the
     * attention's and the MLP's outputs (sandwich norms), this layer's rotary table (NULL: the
     * model's), its sliding window. */
    const float *q_norm, *k_norm, *attn_out_norm, *mlp_out_norm, *cos_sin;
    int64_t window;
    int64_t group; /* its KV cache group: which of the step's slot rows and block tables it uses */
    float softcap; /* > 0: its attention scores soft-capped (paged_attention.c) */
    /* NULL, or the down projection fused with the MLP's activation (quant_int8act.c's
     * llmserve_qi8_gemm_silu / _gelu_tanh: down's coded entry taking the [gate | up] rows, the
     * product made in its activation quantization, never written): the same bits as the
     * activation kernel then down's entry. */
    void *down_glu;
    /* NULL, or the whole MLP in one call (quant_int8act.c's llmserve_qi8_mlp: the gate/up outputs
     * made a panel pair at a time into a thread's tile, the products quantized there as down's
     * rows, never stored): the same bits; taken at Model.mlp_min_rows rows and more. */
    void *mlp;
} Layer;

typedef struct {
    void *rms_norm, *rotary_store_kv, *attention, *silu_and_mul;
    const float *cos_sin, *final_norm;
    int64_t hidden, q_heads, kv_heads, head_dim, inter, block_size;
    int64_t rotary_rows, num_blocks; /* rows of cos_sin; blocks of each cache */
    float eps, scale;
    void *gelu_and_mul; /* non-NULL: the MLP's activation is GELU-tanh (else SiLU) */
    int64_t mlp_min_rows; /* the rows from which a layer's fused MLP (Layer.mlp) runs */
} Model;

/* One forward pass: its tokens' metadata (checked by the caller) and the buffers, each rows of
 * tokens x its width: residual, normed (hidden), qkv, q and attn (q_heads * head_dim), hidden,
 * gate_up (2 * inter), act (inter); x (the embedded tokens) is read only, out gets the final norm. */
typedef struct {
    int64_t tokens;
    const int64_t *positions, *slots;
    const int32_t *block_tables, *seq_lens, *query_start_loc;
    int64_t block_table_stride, block_table_width;
    /* KV cache groups (sliding-window layers keep tables of their own): group g's slots start at
     * slots + g * slot_group_stride, its tables at block_tables + g * table_group_stride */
    int64_t num_groups, slot_group_stride, table_group_stride;
    int32_t num_seqs, num_threads;
    const float *x;
    float *out, *residual, *normed, *qkv, *q, *attn, *hidden, *gate_up, *act;
    int64_t *progress; /* NULL, or a counter another thread reads: one added per layer completed */
} Step;

/* The structs' layout as this compiler laid them out: each struct's size (field NULL) and each
 * field's offset and size, for kernels/cpu/native_decoder.py to check its ctypes mirrors against
 * when it loads this library (a mismatch keeps the loop off, naming the struct and field). A field
 * added above must be added here too: the check names a mirror field missing from this table. */
typedef struct {
    const char *type, *field;
    int64_t offset, size;
} LayoutEntry;

#define STRUCT(S) {#S, 0, 0, sizeof(S)}
#define FIELD(S, f) {#S, #f, offsetof(S, f), sizeof(((S *)0)->f)}
static const LayoutEntry LAYOUT[] = {
    STRUCT(Linear),
    FIELD(Linear, fn),
    FIELD(Linear, packed),
    FIELD(Linear, bias),
    FIELD(Linear, n),
    FIELD(Linear, k),
    FIELD(Linear, code),
    FIELD(Linear, coded),
    STRUCT(Layer),
    FIELD(Layer, qkv),
    FIELD(Layer, o),
    FIELD(Layer, gate_up),
    FIELD(Layer, down),
    FIELD(Layer, input_norm),
    FIELD(Layer, post_norm),
    FIELD(Layer, o_bias),
    FIELD(Layer, k_cache),
    FIELD(Layer, v_cache),
    FIELD(Layer, q_norm),
    FIELD(Layer, k_norm),
    FIELD(Layer, attn_out_norm),
    FIELD(Layer, mlp_out_norm),
    FIELD(Layer, cos_sin),
    FIELD(Layer, window),
    FIELD(Layer, group),
    FIELD(Layer, softcap),
    FIELD(Layer, down_glu),
    FIELD(Layer, mlp),
    STRUCT(Model),
    FIELD(Model, rms_norm),
    FIELD(Model, rotary_store_kv),
    FIELD(Model, attention),
    FIELD(Model, silu_and_mul),
    FIELD(Model, cos_sin),
    FIELD(Model, final_norm),
    FIELD(Model, hidden),
    FIELD(Model, q_heads),
    FIELD(Model, kv_heads),
    FIELD(Model, head_dim),
    FIELD(Model, inter),
    FIELD(Model, block_size),
    FIELD(Model, rotary_rows),
    FIELD(Model, num_blocks),
    FIELD(Model, eps),
    FIELD(Model, scale),
    FIELD(Model, gelu_and_mul),
    FIELD(Model, mlp_min_rows),
    STRUCT(Step),
    FIELD(Step, tokens),
    FIELD(Step, positions),
    FIELD(Step, slots),
    FIELD(Step, block_tables),
    FIELD(Step, seq_lens),
    FIELD(Step, query_start_loc),
    FIELD(Step, block_table_stride),
    FIELD(Step, block_table_width),
    FIELD(Step, num_groups),
    FIELD(Step, slot_group_stride),
    FIELD(Step, table_group_stride),
    FIELD(Step, num_seqs),
    FIELD(Step, num_threads),
    FIELD(Step, x),
    FIELD(Step, out),
    FIELD(Step, residual),
    FIELD(Step, normed),
    FIELD(Step, qkv),
    FIELD(Step, q),
    FIELD(Step, attn),
    FIELD(Step, hidden),
    FIELD(Step, gate_up),
    FIELD(Step, act),
    FIELD(Step, progress),
    {0, 0, 0, 0},
};
#undef STRUCT
#undef FIELD

/* The table above, ended by an entry whose type is NULL. */
const LayoutEntry *llmserve_decoder_loop_layout(void) { return LAYOUT; }

/* Where a kernel refused (the caller raises with these). */
enum { STAGE_QKV = 1, STAGE_ATTENTION = 2, STAGE_O = 3, STAGE_GATE_UP = 4, STAGE_DOWN = 5 };
/* What the step check found (failure[1]; failure[2]: the offending value). */
enum {
    BAD_POSITION = -1,
    BAD_SLOT = -2,
    BAD_CONTEXT = -3,     /* a context longer than its block table */
    BAD_BLOCK = -4,       /* a block table entry outside the cache */
    BAD_QUERY_START = -5, /* query_start_loc not rising from 0 to the step's tokens */
};
#define CHECK_FAILED (-100)

/* Everything the kernels index unchecked, checked before any runs (the Python wrappers' checks,
 * kernels/cpu/native_elementwise.py and native_attention.py, once a step): each position a row of
 * the rotary table, each slot inside the cache (a negative one stores nothing), query_start_loc
 * rising from 0 to the tokens, each context inside its block table, and each block entry a
 * context reads inside the cache. Integer compares over a step's metadata: a decode's are a
 * handful, where torch's reductions cost tens of microseconds each. */
static int32_t check_step(const Model *md, const Step *s, int64_t *failure) {
    const int64_t capacity = md->num_blocks * md->block_size, bs = md->block_size;
    for (int64_t t = 0; t < s->tokens; ++t) {
        if (s->positions[t] < 0 || s->positions[t] >= md->rotary_rows) {
            failure[1] = BAD_POSITION, failure[2] = s->positions[t];
            return CHECK_FAILED;
        }
        for (int64_t g = 0; g < s->num_groups; ++g)
            if (s->slots[g * s->slot_group_stride + t] >= capacity) {
                failure[1] = BAD_SLOT, failure[2] = s->slots[g * s->slot_group_stride + t];
                return CHECK_FAILED;
            }
    }
    const int32_t *qsl = s->query_start_loc;
    for (int32_t b = 0; b <= s->num_seqs; ++b) {
        const int rises = b == 0 ? qsl[0] == 0 : qsl[b] >= qsl[b - 1];
        if (!rises || (b == s->num_seqs && qsl[b] != s->tokens)) {
            failure[1] = BAD_QUERY_START, failure[2] = b;
            return CHECK_FAILED;
        }
    }
    for (int32_t b = 0; b < s->num_seqs; ++b) {
        const int64_t ctx = s->seq_lens[b];
        if (ctx > s->block_table_width * bs) {
            failure[1] = BAD_CONTEXT, failure[2] = ctx;
            return CHECK_FAILED;
        }
        for (int64_t g = 0; g < s->num_groups; ++g) {
            const int32_t *row = s->block_tables + g * s->table_group_stride + b * s->block_table_stride;
            for (int64_t j = 0; j * bs < ctx; ++j)
                if (row[j] < 0 || row[j] >= md->num_blocks) {
                    failure[1] = BAD_BLOCK, failure[2] = row[j];
                    return CHECK_FAILED;
                }
        }
    }
    return 0;
}

static int32_t linear(const Linear *l, const float *x, int64_t m, float *y, int32_t threads) {
    if (l->coded)
        return ((coded_gemm_fn)l->fn)(l->code, x, m, l->k, l->k, l->packed, l->n, l->bias, y, l->n, threads);
    ((gemm_fn)l->fn)(x, m, l->k, l->k, l->packed, l->n, l->bias, y, l->n, threads);
    return 0;
}

/* Returns 0; CHECK_FAILED with failure[] = {0, what, value} for bad metadata (nothing run); or
 * the refusing kernel's code with failure[] = {layer, stage, code}. */
int32_t llmserve_decoder_loop(const Model *md, const Layer *layers, int64_t num_layers, const Step *s,
                              int64_t *failure) {
    if (check_step(md, s, failure)) return CHECK_FAILED;
    const rms_norm_fn norm = (rms_norm_fn)md->rms_norm;
    const int64_t t = s->tokens, h = md->hidden, d = md->head_dim, hq = md->q_heads, hk = md->kv_heads;
    const int32_t threads = s->num_threads;
    /* The first layer's norm has no residual: its input becomes the residual (the Python loop's
     * `rms_norm(x, w, eps)` returns x itself). */
    const float *residual = 0, *x = s->x;
    int32_t rc = 0, stage = 0;
    int64_t i = 0;
    for (; i < num_layers; ++i) {
        const Layer *L = &layers[i];
        norm(x, residual, L->input_norm, md->eps, t, h, s->normed, residual ? s->residual : 0, threads);
        residual = residual ? s->residual : x;
        stage = STAGE_QKV;
        if ((rc = linear(&L->qkv, s->normed, t, s->qkv, threads))) break;
        if (L->q_norm) /* each head's q and k rows normed in place, as the Python loop does */
            for (int64_t r = 0; r < t; ++r) {
                float *row = s->qkv + r * L->qkv.n;
                norm(row, 0, L->q_norm, md->eps, hq, d, row, 0, threads);
                norm(row + hq * d, 0, L->k_norm, md->eps, hk, d, row + hq * d, 0, threads);
            }
        const int64_t *slots = s->slots + L->group * s->slot_group_stride;
        const int32_t *tables = s->block_tables + L->group * s->table_group_stride;
        ((rotary_store_fn)md->rotary_store_kv)(s->qkv, L->qkv.n, t, hq, hk, d, s->positions,
                                               L->cos_sin ? L->cos_sin : md->cos_sin, slots, s->q,
                                               L->k_cache, L->v_cache, threads);
        stage = STAGE_ATTENTION;
        rc = ((attention_fn)md->attention)(s->q, hq * d, d, L->k_cache, L->v_cache, tables,
                                           s->block_table_stride, s->seq_lens, s->query_start_loc, s->num_seqs,
                                           (int32_t)hq, (int32_t)hk, (int32_t)d, (int32_t)md->block_size,
                                           md->scale, s->attn, threads, (int32_t)L->window, L->softcap);
        if (rc) break;
        stage = STAGE_O;
        if ((rc = linear(&L->o, s->attn, t, s->hidden, threads))) break;
        if (L->o_bias) /* the Python loop's `out + o_bias`: one rounding per element either way */
            for (int64_t r = 0; r < t; ++r)
                for (int64_t e = 0; e < h; ++e) s->hidden[r * h + e] += L->o_bias[e];
        if (L->attn_out_norm) norm(s->hidden, 0, L->attn_out_norm, md->eps, t, h, s->hidden, 0, threads);
        norm(s->hidden, residual, L->post_norm, md->eps, t, h, s->normed, s->residual, threads);
        residual = s->residual;
        stage = STAGE_GATE_UP;
        if (L->mlp && t >= md->mlp_min_rows) {
            const Linear *gu = &L->gate_up, *dn = &L->down;
            rc = ((mlp_fn)L->mlp)(md->gelu_and_mul ? 2 : 1, gu->code, s->normed, t, h, h, gu->packed, gu->bias,
                                  md->inter, dn->code, dn->packed, dn->n, dn->bias, s->hidden, dn->n, threads);
            if (rc) break;
        } else if ((rc = linear(&L->gate_up, s->normed, t, s->gate_up, threads))) {
            break;
        } else if (L->down_glu) {
            stage = STAGE_DOWN;
            const Linear *dn = &L->down;
            rc = ((coded_gemm_fn)L->down_glu)(dn->code, s->gate_up, t, dn->k, 2 * md->inter, dn->packed, dn->n,
                                               dn->bias, s->hidden, dn->n, threads);
            if (rc) break;
        } else {
            stage = STAGE_DOWN;
            ((silu_fn)(md->gelu_and_mul ? md->gelu_and_mul : md->silu_and_mul))(s->gate_up, t, md->inter, s->act,
                                                                                 threads);
            if ((rc = linear(&L->down, s->act, t, s->hidden, threads))) break;
        }
        if (L->mlp_out_norm) norm(s->hidden, 0, L->mlp_out_norm, md->eps, t, h, s->hidden, 0, threads);
        x = s->hidden;
        if (s->progress) __atomic_fetch_add(s->progress, 1, __ATOMIC_RELAXED);
    }
    if (rc) {
        failure[0] = i;
        failure[1] = stage;
        failure[2] = rc;
        return rc;
    }
    /* The final norm's residual sum is not kept (the Python loop drops it too). */
    norm(x, residual, md->final_norm, md->eps, t, h, s->out, residual ? s->residual : 0, threads);
    return 0;
}
