/* The executor: sessions, the binding of each op to a kernel, and a run.
 *
 * A session binds every tensor of every program to its planned bytes once (arena, state, or
 * the mapped weights), then turns each op into a step through its binder (exec.h): a run is
 * then a loop of calls with nothing left to decide, as runtime/launch.py does for the Python
 * executor. Binders are asked in order: this file's (the transformer block's hot ops on the
 * tuned kernels of kernels.c), then ops_generic.c's, then ops_deepseek.c's. The first that
 * does not answer NPUC_E_NO_KERNEL decides.
 *
 * Run-time values that index memory are checked where they enter: a program's inputs (token
 * ids against the table they index, positions against the cache, slots against the slots,
 * last_token against the rows it picks) before any op runs, and by the kernels themselves
 * for values the model computes.
 */
#define _POSIX_C_SOURCE 200809L
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "exec.h"
#include "kernels.h"
#include "ops_recurrent.h"

#define GEMV_MAX_ROWS 8

typedef struct rt_input_check {
    int kind;       /* 0 none, 1 table rows (low..rows-1), 2 position, 3 slot */
    int64_t low, rows;
    int table;      /* a weight table: the message says so */
} rt_input_check;

typedef struct rt_sprog {
    rt_step *steps;
    uint64_t *step_ns;      /* per step, summed while profiling */
    int32_t n_steps;
    rt_input_check *checks; /* per input */
    uint64_t kernel_ns, runs;
} rt_sprog;

struct npuc_session {
    const npuc_model *m;
    uint8_t *arena;
    uint8_t *state;
    float *scratch;
    uint64_t scratch_floats;
    int threads;
    int profile;
    rt_sprog *progs;
    rt_pool pool;
    uint64_t extra_bytes;
    int64_t *track;      /* per slot: the last (token, position) written, -1 when none (decode.c) */
};

float *rt_session_scratch(struct npuc_session *s) { return s->scratch; }
int rt_session_threads(const struct npuc_session *s) { return s->threads; }

/* ---- views and checks -------------------------------------------------------------------- */

static void view_of(const npuc_model *m, npuc_session *s, int32_t t, rt_view *v) {
    const rt_tensor *d = &m->tensors[t];
    memset(v, 0, sizeof *v);
    v->dtype = d->dtype;
    v->rank = d->rank;
    v->numel = 1;
    for (int32_t i = 0; i < d->rank; i++) {
        v->shape[i] = d->shape[i];
        v->numel *= d->shape[i];
    }
    v->nbytes = d->nbytes;
    v->region = d->region;
    v->tensor = t;
    if (s != NULL) {
        uint8_t *base = d->region == REGION_ARENA ? s->arena
                        : d->region == REGION_STATE ? s->state
                                                    : (uint8_t *)(uintptr_t)m->weights;
        v->data = base != NULL ? base + d->offset : NULL;
    }
}

static int same_shape(const rt_view *a, const rt_view *b) {
    if (a->rank != b->rank) return 0;
    for (int32_t i = 0; i < a->rank; i++)
        if (a->shape[i] != b->shape[i]) return 0;
    return 1;
}

static int64_t prod(const int64_t *d, int32_t from, int32_t to) {
    int64_t p = 1;
    for (int32_t i = from; i < to; i++) p *= d[i];
    return p;
}

static int no_kernel(rt_binder *b, const rt_step *st, const char *why) {
    return rt_fail(b->err, NPUC_E_NO_KERNEL, "", "%s", why != NULL ? why : st->op->op);
}

static int does_not_fit(rt_binder *b, const rt_step *st, const char *why) {
    return rt_fail(b->err, NPUC_E_INVALID, HINT_DAMAGED, "%s: op '%s' (%s) does not take its operands: %s",
                   b->model->path, st->op->name, st->op->op, why);
}

/* The output the op's shape rule makes: out[k] must be dtype with in[from]'s shape. */
static int out_like(const rt_step *st, int k, const rt_view *like, int dtype) {
    return k < st->n_out && st->out[k].dtype == dtype && same_shape(&st->out[k], like);
}

static void *pool_or_null(rt_binder *b, size_t n) {
    if (b->dry) return NULL;
    void *p = pool_alloc(b->pool, n);
    if (p != NULL) b->extra_bytes += n;
    return p;
}

static void want_scratch(rt_binder *b, int64_t floats) {
    if (floats > 0 && (uint64_t)floats > b->scratch_floats) b->scratch_floats = (uint64_t)floats;
}

static int is_float(int dt) { return dt == NPUC_F32 || dt == NPUC_BF16; }

/* ---- linear -------------------------------------------------------------------------------
 * i: 0 mode (0 gemv f32, 1 gemv bf16, 2 gemm), 1 lead, 2 S, 3 valid rows, 4 K, 5 N, 6 kn,
 *    7 x bf16, 8 y bf16, 9 bias bf16
 * p: 0 packed weights (gemm), 1 bias as f32 (gemm) */

static void row_calls_init(const rt_view *x, int64_t valid_attr, int64_t *lead, int64_t *S, int64_t *valid) {
    *S = x->rank >= 2 ? x->shape[x->rank - 2] : 1;
    *lead = x->rank >= 2 ? prod(x->shape, 0, x->rank - 2) : 1;
    *valid = (valid_attr < 1 || valid_attr > *S) ? *S : valid_attr;
}

static int64_t rows_computed(int64_t lead, int64_t S, int64_t valid) {
    return valid == S ? lead * S : lead * valid;
}

/* Call f(row0, rows, stride in rows) for each product call (runtime/launch.py _row_calls). */
#define FOR_ROW_CALLS(lead, S, valid, BODY)                                                      \
    do {                                                                                           \
        if ((valid) == (S)) {                                                                      \
            int64_t row0 = 0, rows = (lead) * (S), stride = 1;                                     \
            BODY;                                                                                  \
        } else if ((valid) == 1) {                                                                 \
            int64_t row0 = 0, rows = (lead), stride = (S);                                         \
            BODY;                                                                                  \
        } else {                                                                                   \
            for (int64_t l_ = 0; l_ < (lead); l_++) {                                              \
                int64_t row0 = l_ * (S), rows = (valid), stride = 1;                               \
                BODY;                                                                              \
            }                                                                                      \
        }                                                                                          \
    } while (0)

static int run_linear(const rt_step *st, npuc_session *s) {
    const int64_t *i = st->i;
    int64_t lead = i[1], S = i[2], valid = i[3], K = i[4], N = i[5];
    int xbf = (int)i[7], ybf = (int)i[8];
    size_t xe = xbf ? 2 : 4, ye = ybf ? 2 : 4;
    const char *x = st->in[0].data;
    char *y = st->out[0].data;
    const void *bias = st->n_in > 2 ? st->in[2].data : NULL;
    int nt = s->threads;
    FOR_ROW_CALLS(lead, S, valid, {
        const char *xr = x + (size_t)(row0 * K) * xe;
        char *yr = y + (size_t)(row0 * N) * ye;
        if (i[0] == 0)
            npuc_linear_f32((const float *)xr, rows, stride * K, st->in[1].data, (int)i[6], N, K, bias, (float *)yr,
                            stride * N, nt);
        else if (i[0] == 1)
            npuc_linear_bf16(xr, xbf, rows, stride * K, st->in[1].data, N, K, bias, (int)i[9], yr, ybf, stride * N,
                             s->scratch, nt);
        else
            npuc_gemm_f32(xr, xbf, rows, stride * K, st->p[0], N, K, st->p[1], yr, ybf, stride * N, s->scratch, nt);
    });
    return 0;
}

static int bind_linear(rt_binder *b, rt_step *st) {
    const rt_view *x = &st->in[0], *w = &st->in[1];
    const rt_view *bias = st->n_in > 2 ? &st->in[2] : NULL;
    const char *layout = rt_attr_s(st->op, "weight_layout", "nk");
    int kn = strcmp(layout, "kn") == 0;
    if ((!kn && strcmp(layout, "nk") != 0) || w->rank != 2 || x->rank < 1)
        return does_not_fit(b, st, "a linear weight is 2-D, in layout nk or kn");
    int64_t N = kn ? w->shape[1] : w->shape[0], K = kn ? w->shape[0] : w->shape[1];
    int64_t va = rt_attr_i(st->op, "valid_rows", 0);
    if (x->shape[x->rank - 1] != K || (bias != NULL && (bias->rank != 1 || bias->shape[0] != N)))
        return does_not_fit(b, st, "the weight does not fit the input");
    if (va != 0 && (x->rank < 2 || va < 1 || va > x->shape[x->rank - 2]))
        return does_not_fit(b, st, "valid_rows does not fit the input");
    if (x->dtype != w->dtype || (bias != NULL && bias->dtype != x->dtype))
        return does_not_fit(b, st, "operands of different dtypes");
    rt_view want = *x;
    want.shape[x->rank - 1] = N;
    if (!out_like(st, 0, &want, x->dtype)) return does_not_fit(b, st, "the output is not x[..., N]");
    if (!is_float(x->dtype)) return no_kernel(b, st, "a linear of this dtype");
    int64_t lead, S, valid;
    row_calls_init(x, va, &lead, &S, &valid);
    int bf = x->dtype == NPUC_BF16;
    int64_t rows = rows_computed(lead, S, valid);
    int64_t *i = st->i;
    i[1] = lead, i[2] = S, i[3] = valid, i[4] = K, i[5] = N, i[6] = kn, i[7] = bf, i[8] = bf, i[9] = bf;
    st->run = run_linear;
    if (rows <= GEMV_MAX_ROWS && (!bf || !kn)) {
        i[0] = bf ? 1 : 0;
        if (bf) {
            int64_t most = valid == S ? lead * S : (valid == 1 ? lead : valid);
            want_scratch(b, 2 * most * K);
        }
        return 0;
    }
    i[0] = 2;
    int64_t most = valid == S ? lead * S : (valid == 1 ? lead : valid);
    want_scratch(b, npuc_gemm_scratch_floats(most, N, K, bf));
    if (!b->dry) {
        int64_t nf = npuc_gemm_packed_floats(N, K);
        st->p[0] = pool_or_null(b, (size_t)nf * sizeof(float));
        if (st->p[0] == NULL) return rt_fail(b->err, NPUC_E_ARG, "", "out of memory packing a weight");
        npuc_gemm_pack_b(w->data, bf, kn, N, K, st->p[0], b->threads);
        if (bias != NULL) {
            float *bf32 = pool_or_null(b, (size_t)N * sizeof(float));
            if (bf32 == NULL) return rt_fail(b->err, NPUC_E_ARG, "", "out of memory");
            for (int64_t n = 0; n < N; n++) bf32[n] = rt_load_f(bias->data, bias->dtype, n);
            st->p[1] = bf32;
        }
    }
    return 0;
}

/* ---- qlinear ------------------------------------------------------------------------------
 * i: 0 gemv (1) or gemm (0), 1 lead, 2 S, 3 valid, 4 K, 5 N, 6 bits, 7 G, 8 x bf16, 9 int8
 *    activations (act_bits 8: kernels_i8.c)
 * p: 0 scale f32 (int8 activations: the packed weight), 1 zero f32, 2 bias f32 */

static int run_qlinear(const rt_step *st, npuc_session *s) {
    const int64_t *i = st->i;
    int64_t lead = i[1], S = i[2], valid = i[3], K = i[4], N = i[5];
    int bf = (int)i[8];
    size_t e = bf ? 2 : 4;
    const char *x = st->in[0].data;
    char *y = st->out[0].data;
    int rc = 0;
    FOR_ROW_CALLS(lead, S, valid, {
        int r = i[9] ? npuc_i8linear(x + (size_t)(row0 * K) * e, bf, rows, stride * K, st->p[0], (int)i[6], N, K,
                                     st->p[2], y + (size_t)(row0 * N) * e, bf, stride * N, s->scratch, s->threads)
              : (i[0] ? npuc_qlinear : npuc_qgemm)(x + (size_t)(row0 * K) * e, bf, rows, stride * K, st->in[1].data,
                                                   (int)i[6], st->p[0], st->p[1], N, K, i[7], st->p[2],
                                                   y + (size_t)(row0 * N) * e, bf, stride * N, s->scratch, s->threads);
        if (r) rc = NPUC_E_KERNEL;
    });
    return rc;
}

static int check_quantized(const rt_view *q, const rt_view *scale, const rt_view *zero, int64_t bits, int64_t g,
                           int64_t *k_out) {
    int code = bits == 8 ? NPUC_I8 : NPUC_U8;
    if ((bits != 4 && bits != 8) || q->dtype != code || zero->dtype != code || q->rank < 1) return 0;
    if (scale->dtype != NPUC_F32 && scale->dtype != NPUC_BF16 && scale->dtype != NPUC_F16) return 0;
    int64_t k = q->shape[q->rank - 1] * (bits == 8 ? 1 : 2);
    if (g < 1 || k % g || (bits == 4 && g % 2)) return 0;
    if (scale->rank != q->rank || zero->rank != q->rank) return 0;
    for (int32_t d = 0; d + 1 < q->rank; d++)
        if (scale->shape[d] != q->shape[d] || zero->shape[d] != q->shape[d]) return 0;
    if (scale->shape[q->rank - 1] != k / g || zero->shape[q->rank - 1] != k / g) return 0;
    *k_out = k;
    return 1;
}

static float *widen(rt_binder *b, const rt_view *v, int is_code) {
    float *f = pool_or_null(b, (size_t)v->numel * sizeof(float));
    if (f == NULL) return NULL;
    for (int64_t n = 0; n < v->numel; n++)
        f[n] = !is_code ? rt_load_f(v->data, v->dtype, n)
               : v->dtype == NPUC_I8 ? (float)((const int8_t *)v->data)[n]
                                     : (float)((const uint8_t *)v->data)[n];
    return f;
}

static int bind_qlinear(rt_binder *b, rt_step *st) {
    const rt_view *x = &st->in[0], *q = &st->in[1], *scale = &st->in[2], *zero = &st->in[3];
    const rt_view *bias = st->n_in > 4 ? &st->in[4] : NULL;
    int64_t bits = rt_attr_i(st->op, "bits", 0), g = rt_attr_i(st->op, "group_size", 0), k = 0;
    if (!check_quantized(q, scale, zero, bits, g, &k) || q->rank != 2)
        return does_not_fit(b, st, "the quantized weight's codes, scales and zero points do not fit");
    if (!is_float(x->dtype) && x->dtype != NPUC_F16) return does_not_fit(b, st, "a float input is needed");
    if (x->rank < 1 || x->shape[x->rank - 1] != k) return does_not_fit(b, st, "the weight does not fit the input");
    int64_t N = q->shape[0], va = rt_attr_i(st->op, "valid_rows", 0);
    if (va != 0 && (x->rank < 2 || va < 1 || va > x->shape[x->rank - 2]))
        return does_not_fit(b, st, "valid_rows does not fit the input");
    if (bias != NULL && (bias->rank != 1 || bias->shape[0] != N || bias->dtype != x->dtype))
        return does_not_fit(b, st, "the bias does not fit");
    rt_view want = *x;
    want.shape[x->rank - 1] = N;
    if (!out_like(st, 0, &want, x->dtype)) return does_not_fit(b, st, "the output is not x[..., N]");
    if (!is_float(x->dtype)) return no_kernel(b, st, "qlinear over f16 activations");
    int64_t lead, S, valid;
    row_calls_init(x, va, &lead, &S, &valid);
    int64_t rows = rows_computed(lead, S, valid), most = valid == S ? lead * S : (valid == 1 ? lead : valid);
    int gemv = rows <= GEMV_MAX_ROWS && !(bits == 4 && g % 16);
    int bf = x->dtype == NPUC_BF16;
    int64_t act = rt_attr_i(st->op, "act_bits", 0);
    if (act != 0 && (act != 8 || k % 32 || g % 32 || scale->dtype != NPUC_F16))
        return does_not_fit(b, st, "int8 activations (act_bits 8) take f16 scales in groups of a multiple of 32");
    int64_t *i = st->i;
    i[0] = gemv, i[1] = lead, i[2] = S, i[3] = valid, i[4] = k, i[5] = N, i[6] = bits, i[7] = g, i[8] = bf;
    i[9] = act == 8;
    st->run = run_qlinear;
    if (act == 8) {
        want_scratch(b, npuc_i8linear_scratch_bytes(most, k) / (int64_t)sizeof(float) + 1);
        if (b->dry) return 0;
        st->p[0] = pool_or_null(b, (size_t)npuc_i8_packed_bytes((int)bits, N, k));
        st->p[2] = bias != NULL ? widen(b, bias, 0) : NULL;
        if (st->p[0] == NULL || (bias != NULL && st->p[2] == NULL))
            return rt_fail(b->err, NPUC_E_ARG, "", "out of memory");
        if (npuc_i8_pack(q->data, (int)bits, scale->data, zero->data, N, k, g, st->p[0]))
            return does_not_fit(b, st, "the weight cannot be laid out for int8 activations");
        return 0;
    }
    want_scratch(b, gemv ? npuc_qlinear_scratch_floats(most, k, g)
                         : npuc_qgemm_scratch_floats(most, N, k, bf, b->threads));
    if (!b->dry) {
        st->p[0] = widen(b, scale, 0);
        st->p[1] = widen(b, zero, 1);
        st->p[2] = bias != NULL ? widen(b, bias, 0) : NULL;
        if (st->p[0] == NULL || st->p[1] == NULL || (bias != NULL && st->p[2] == NULL))
            return rt_fail(b->err, NPUC_E_ARG, "", "out of memory");
    }
    return 0;
}

/* ---- rms_norm f32 (a same-shape scale) ------------------------------------------------------ */

static int run_rms_norm(const rt_step *st, npuc_session *s) {
    npuc_rms_norm_f32(st->in[0].data, st->in[1].data, (float)st->f[0], st->out[0].data, st->i[0], st->i[1],
                      s->threads);
    return 0;
}

static int bind_rms_norm(rt_binder *b, rt_step *st) {
    const rt_view *x = &st->in[0], *scale = &st->in[1];
    if (x->dtype != NPUC_F32 || scale->dtype != NPUC_F32 || x->rank == 0 || !out_like(st, 0, x, NPUC_F32))
        return no_kernel(b, st, "rms_norm other than f32");
    int64_t axis = rt_attr_i(st->op, "axis", -1);
    if (axis < -x->rank || axis >= x->rank) return does_not_fit(b, st, "axis out of range");
    int32_t ax = (int32_t)(axis < 0 ? axis + x->rank : axis);
    int64_t d = prod(x->shape, ax, x->rank);
    if (scale->rank > x->rank - ax || scale->numel != d) return no_kernel(b, st, "rms_norm with a broadcast scale");
    for (int32_t j = 0; j < scale->rank; j++)
        if (scale->shape[j] != x->shape[x->rank - scale->rank + j]) return no_kernel(b, st, "a broadcast scale");
    st->i[0] = prod(x->shape, 0, ax), st->i[1] = d;
    st->f[0] = rt_attr_f(st->op, "eps", 1e-5);
    st->run = run_rms_norm;
    return 0;
}

/* ---- rope_lut f32 ---------------------------------------------------------------------------- */

static int run_rope(const rt_step *st, npuc_session *s) {
    const int64_t *i = st->i;
    return npuc_rope_f32(st->in[0].data, st->in[1].data, st->in[2].data, st->in[3].data, st->out[0].data, i[0], i[1],
                         i[2], i[3], i[4], (int)i[5], i[6], s->threads)
               ? NPUC_E_INPUT
               : 0;
}

static int bind_rope(rt_binder *b, rt_step *st) {
    const rt_view *x = &st->in[0], *pos = &st->in[1], *c = &st->in[2], *sn = &st->in[3];
    const char *layout = rt_attr_s(st->op, "layout", "half");
    int lay = strcmp(layout, "half") == 0 ? 0 : strcmp(layout, "interleaved") == 0 ? 1
              : strcmp(layout, "deinterleave") == 0 ? 2 : -1;
    if (lay < 0 || x->rank < 3 || (pos->dtype != NPUC_I64 && pos->dtype != NPUC_I32) || pos->rank < 1 ||
        pos->rank > 2 || pos->shape[pos->rank - 1] != x->shape[x->rank - 2] || c->rank != 2 || !same_shape(c, sn) ||
        c->dtype != sn->dtype || 2 * c->shape[1] > x->shape[x->rank - 1] || !out_like(st, 0, x, x->dtype))
        return does_not_fit(b, st, "the positions or tables do not fit x");
    if (x->dtype != NPUC_F32 || c->dtype != NPUC_F32 || pos->dtype != NPUC_I64)
        return no_kernel(b, st, "rope_lut other than f32 with i64 positions");
    int64_t S = x->shape[x->rank - 2], d = x->shape[x->rank - 1];
    int per_seq = pos->rank == 2 && pos->shape[0] == x->shape[0] && pos->shape[0] != 1;
    if (pos->rank == 2 && !per_seq && pos->shape[0] != 1) return no_kernel(b, st, "positions that broadcast");
    int64_t *i = st->i;
    i[0] = x->numel / (S * d > 0 ? S * d : 1), i[1] = S, i[2] = d, i[3] = c->shape[1], i[4] = c->shape[0];
    i[5] = lay, i[6] = per_seq ? x->shape[0] : 0;
    st->run = run_rope;
    return 0;
}

/* ---- kv_write -------------------------------------------------------------------------------- */

static int run_kv_write(const rt_step *st, npuc_session *s) {
    (void)s;
    const int64_t *i = st->i;
    int64_t slot = -1;
    if (i[9]) /* each row into its own slot (a mixed step) */
        return npuc_kv_write_rows(st->in[0].data, (int)i[0], st->in[1].data, (int)i[1], st->in[2].data,
                                  st->in[3].data, i[8], i[4], i[5], i[6], i[7])
                   ? NPUC_E_INPUT
                   : 0;
    if (st->n_in > 3) {
        slot = *(const int64_t *)st->in[3].data;
        if (slot < 0 || slot >= i[8]) return NPUC_E_INPUT;
    }
    return npuc_kv_write(st->in[0].data, (int)i[0], st->in[1].data, (int)i[1], st->in[2].data, i[2], slot, i[3], i[4],
                         i[5], i[6], i[7])
               ? NPUC_E_INPUT
               : 0;
}

/* The layout of a K/V cache of dtype dt (kernels.h's NPUC_KV_*), or -1: f32, bf16, f16, or
 * i8 (rows of an f32 scale and D codes, D + 4 bytes; ir/fused_ops.py). */
static int kv_kind(int dt) {
    return dt == NPUC_F32 ? NPUC_KV_F32 : dt == NPUC_BF16 ? NPUC_KV_BF16 : dt == NPUC_F16 ? NPUC_KV_F16
           : dt == NPUC_I8 ? NPUC_KV_I8 : -1;
}

/* A cache row's last dim for rows of d values: d, or d + 4 for int8's scale. */
static int64_t kv_last(int kind, int64_t d) { return kind == NPUC_KV_I8 ? d + 4 : d; }

static int bind_kv_write(rt_binder *b, rt_step *st) {
    const rt_view *cache = &st->in[0], *nw = &st->in[1], *pos = &st->in[2];
    const rt_view *slot = st->n_in > 3 ? &st->in[3] : NULL;
    int kind = kv_kind(cache->dtype);
    if (cache->rank != 4 || nw->rank != 4 || cache->shape[1] != nw->shape[1] ||
        (kind >= 0 && cache->shape[3] != kv_last(kind, nw->shape[3])) || nw->shape[2] > cache->shape[2] ||
        nw->shape[0] != (slot != NULL ? 1 : cache->shape[0]))
        return does_not_fit(b, st, "the rows do not fit the cache");
    int64_t S = nw->shape[2];
    int ok_pos = (pos->rank == 1 && pos->shape[0] == S) || (pos->rank == 2 && pos->shape[0] == nw->shape[0] &&
                                                             pos->shape[1] == S);
    if (!ok_pos || (pos->dtype != NPUC_I64 && pos->dtype != NPUC_I32))
        return does_not_fit(b, st, "the positions do not fit");
    int rows = slot != NULL && slot->rank == 1 && slot->shape[0] == S && S > 1; /* slot [S]: each row's */
    if (slot != NULL && (slot->rank != 1 || (slot->shape[0] != 1 && !rows) ||
                         (slot->dtype != NPUC_I64 && slot->dtype != NPUC_I32)))
        return does_not_fit(b, st, "the slot is not i64[1] or one per row");
    if (!out_like(st, 0, cache, cache->dtype) || !st->out_is_in0)
        return does_not_fit(b, st, "kv_write's result is its cache, in place");
    if (kind < 0 || !is_float(nw->dtype) || pos->dtype != NPUC_I64 || (slot != NULL && slot->dtype != NPUC_I64))
        return no_kernel(b, st, "kv_write other than f32/bf16 rows into an f32, bf16, f16 or int8 cache with i64 "
                                "positions");
    int64_t *i = st->i;
    i[0] = kind, i[1] = nw->dtype == NPUC_BF16, i[2] = pos->rank == 2 ? S : 0, i[3] = nw->shape[0];
    i[4] = nw->shape[1], i[5] = cache->shape[2], i[6] = S, i[7] = nw->shape[3], i[8] = cache->shape[0], i[9] = rows;
    st->run = run_kv_write;
    return 0;
}

/* ---- attention ------------------------------------------------------------------------------
 * cached: i 0 qbf, 1 the caches' layout (NPUC_KV_*), 2 pstride, 3 obf, 4 B, 5 HQ, 6 S, 7 D, 8 HKV, 9 L, 10 DV; f 0 scale
 * fused (prefill, f32 GEMM form): i 11 = 1, p 0 the positions table */

static int run_cached_attention(const rt_step *st, npuc_session *s) {
    const int64_t *i = st->i;
    const int64_t *pos = st->p[0] != NULL ? st->p[0] : st->in[3].data;
    if (i[12]) /* a mixed step's rows, each over its own slot's cache */
        return npuc_cached_attention_rows(st->in[0].data, (int)i[0], st->in[1].data, st->in[2].data, (int)i[1], pos,
                                          st->in[4].data, i[12], st->out[0].data, (int)i[3], i[6], i[5], i[7], i[8],
                                          i[9], i[10], (float)st->f[0], s->scratch, s->threads)
                   ? NPUC_E_INPUT
                   : 0;
    if (i[11])
        return npuc_attention_gemm(st->in[0].data, st->in[1].data, st->in[2].data, pos, st->out[0].data, i[4], i[5],
                                   i[6], i[7], i[8], i[9], i[10], (float)st->f[0], s->scratch, s->threads)
                   ? NPUC_E_KERNEL
                   : 0;
    return npuc_cached_attention(st->in[0].data, (int)i[0], st->in[1].data, st->in[2].data, (int)i[1], pos, i[2],
                                 st->out[0].data, (int)i[3], i[4], i[5], i[6], i[7], i[8], i[9], i[10], (float)st->f[0],
                                 s->scratch, s->threads)
               ? NPUC_E_INPUT
               : 0;
}

/* q [b, hq, s, d], k [b, hkv, l, d], v [b, hkv, l, dv]; a cache (cached) may hold another layout
 * than q's dtype (kv_kind), int8 rows 4 bytes longer. */
static int attention_dims(rt_binder *b, rt_step *st, const rt_view *q, const rt_view *k, const rt_view *v,
                          int cached) {
    int kind = cached ? kv_kind(k->dtype) : (q->dtype == NPUC_BF16 ? NPUC_KV_BF16 : NPUC_KV_F32);
    int64_t d = q->rank == 4 ? q->shape[3] : 0, dv = v->rank == 4 ? v->shape[3] - (kind == NPUC_KV_I8 ? 4 : 0) : 0;
    if (q->rank != 4 || k->rank != 4 || v->rank != 4 || q->shape[0] != k->shape[0] || k->shape[0] != v->shape[0] ||
        k->shape[1] != v->shape[1] || k->shape[2] != v->shape[2] || k->shape[1] == 0 || q->shape[1] % k->shape[1] ||
        (kind >= 0 && k->shape[3] != kv_last(kind, d)) || dv < 0)
        return does_not_fit(b, st, "q, k and v do not fit");
    if (cached ? k->dtype != v->dtype : (q->dtype != k->dtype || k->dtype != v->dtype))
        return does_not_fit(b, st, "q, k and v differ in dtype");
    rt_view want = *q;
    want.shape[3] = dv;
    if (!out_like(st, 0, &want, q->dtype)) return does_not_fit(b, st, "the output is not [b, hq, s, dv]");
    if (kind < 0 || !is_float(q->dtype)) return no_kernel(b, st, "attention of this dtype");
    int64_t *i = st->i;
    int bf = q->dtype == NPUC_BF16;
    i[0] = bf, i[1] = kind, i[3] = bf, i[4] = q->shape[0], i[5] = q->shape[1], i[6] = q->shape[2], i[7] = d;
    i[8] = k->shape[1], i[9] = k->shape[2], i[10] = dv, i[11] = 0, i[12] = 0;
    st->f[0] = rt_attr_f(st->op, "scale", 1.0);
    return 0;
}

static int plain_attention(const rt_op *op) {
    const rt_attr *al = rt_find_attr(op, "alibi");
    return rt_attr_i(op, "window", 0) == 0 && rt_attr_f(op, "softcap", 0.0) == 0.0 &&
           (al == NULL || al->kind != ATTR_FLOATS || al->n == 0);
}

/* cached_attention[slotted=1](q [1, hq, n, d], caches [slots, hkv, l, ..], position [n] or [1, n], slot [n]) */
static int bind_cached_attention_rows(rt_binder *b, rt_step *st) {
    const rt_view *q = &st->in[0], *kc = &st->in[1], *vc = &st->in[2], *pos = &st->in[3];
    const rt_view *slot = &st->in[st->n_in - 1];
    if (st->n_in != 5) return no_kernel(b, st, "cached_attention over rows of several slots, with sinks");
    if (q->rank != 4 || q->shape[0] != 1 || kc->rank != 4 || kc->shape[0] < 1)
        return does_not_fit(b, st, "q is not [1, hq, n, d] over caches of slots");
    int64_t N = q->shape[2];
    if (slot->rank != 1 || slot->shape[0] != N || slot->dtype != NPUC_I64)
        return does_not_fit(b, st, "the slot is not i64 [n], one per row");
    if (!((pos->rank == 1 && pos->shape[0] == N) || (pos->rank == 2 && pos->shape[0] == 1 && pos->shape[1] == N)) ||
        pos->dtype != NPUC_I64)
        return does_not_fit(b, st, "the positions are not i64 [n] or [1, n]");
    int64_t *i = st->i;
    int kind = kv_kind(kc->dtype);
    int64_t d = q->shape[3], dv = vc->rank == 4 ? vc->shape[3] - (kind == NPUC_KV_I8 ? 4 : 0) : 0;
    if (vc->rank != 4 || kc->shape[0] != vc->shape[0] || kc->shape[1] != vc->shape[1] || kc->shape[2] != vc->shape[2] ||
        kc->shape[1] == 0 || q->shape[1] % kc->shape[1] || (kind >= 0 && kc->shape[3] != kv_last(kind, d)) || dv < 0)
        return does_not_fit(b, st, "q, k and v do not fit");
    if (kc->dtype != vc->dtype) return does_not_fit(b, st, "q, k and v differ in dtype");
    rt_view want = *q;
    want.shape[3] = dv;
    if (!out_like(st, 0, &want, q->dtype)) return does_not_fit(b, st, "the output is not [1, hq, n, dv]");
    if (kind < 0 || !is_float(q->dtype)) return no_kernel(b, st, "attention of this dtype");
    if (!plain_attention(st->op)) return no_kernel(b, st, "cached_attention with a sliding window, soft-capping or ALiBi");
    int bf = q->dtype == NPUC_BF16;
    i[0] = bf, i[1] = kind, i[2] = 1, i[3] = bf, i[4] = N, i[5] = q->shape[1], i[6] = N, i[7] = d;
    i[8] = kc->shape[1], i[9] = kc->shape[2], i[10] = dv, i[11] = 0, i[12] = kc->shape[0];
    st->f[0] = rt_attr_f(st->op, "scale", 1.0);
    want_scratch(b, npuc_cached_attention_scratch_floats(N, q->shape[1], 1, d, kc->shape[1], kc->shape[2], dv,
                                                         b->threads));
    st->run = run_cached_attention;
    return 0;
}

static int bind_cached_attention(rt_binder *b, rt_step *st) {
    const rt_view *q = &st->in[0], *kc = &st->in[1], *vc = &st->in[2], *pos = &st->in[3];
    int64_t slotted = rt_attr_i(st->op, "slotted", 0);
    if (slotted != 0 && slotted != 1) return does_not_fit(b, st, "slotted is 0 or 1");
    if (slotted) /* q [1, hq, n, d], row i over cache slot[i]: the last operand */
        return bind_cached_attention_rows(b, st);
    int rc = attention_dims(b, st, q, kc, vc, 1);
    if (rc) return rc;
    int64_t S = q->shape[2];
    if (!((pos->rank == 1 && pos->shape[0] == S) || (pos->rank == 2 && pos->shape[0] == q->shape[0] &&
                                                     pos->shape[1] == S)) ||
        (pos->dtype != NPUC_I64 && pos->dtype != NPUC_I32))
        return does_not_fit(b, st, "the positions do not fit");
    if (st->n_in > 4 || !plain_attention(st->op))
        return no_kernel(b, st, "cached_attention with a sliding window, soft-capping, ALiBi or sinks");
    if (pos->dtype != NPUC_I64) return no_kernel(b, st, "cached_attention with i32 positions");
    st->i[2] = pos->rank == 2 ? S : 0;
    const int64_t *i = st->i;
    want_scratch(b, npuc_cached_attention_scratch_floats(i[4], i[5], i[6], i[7], i[8], i[9], i[10], b->threads));
    st->run = run_cached_attention;
    return 0;
}

static int bind_fused_attention(rt_binder *b, rt_step *st) {
    const rt_view *q = &st->in[0], *k = &st->in[1], *v = &st->in[2];
    int rc = attention_dims(b, st, q, k, v, 0);
    if (rc) return rc;
    if (st->n_in > 3 || !plain_attention(st->op))
        return no_kernel(b, st, "fused_attention with a mask, sliding window, soft-capping, ALiBi or sinks");
    int64_t S = q->shape[2], L = k->shape[2], D = q->shape[3], DV = v->shape[3];
    if (S == 0 || L == 0) return no_kernel(b, st, "an empty attention");
    int causal = (int)rt_attr_i(st->op, "causal", 0);
    st->i[2] = 0;
    if (!b->dry) {
        int64_t *pos = pool_or_null(b, (size_t)S * sizeof(int64_t));
        if (pos == NULL) return rt_fail(b->err, NPUC_E_ARG, "", "out of memory");
        for (int64_t j = 0; j < S; j++) pos[j] = causal ? (j < L - 1 ? j : L - 1) : L - 1;
        st->p[0] = pos;
    }
    if (S > GEMV_MAX_ROWS && q->dtype == NPUC_F32 && D % 16 == 0 && DV % 16 == 0) {
        st->i[11] = 1;
        want_scratch(b, npuc_attention_gemm_scratch_floats(q->shape[0], k->shape[1], D, L, DV, b->threads));
    } else {
        want_scratch(b, npuc_cached_attention_scratch_floats(q->shape[0], q->shape[1], S, D, k->shape[1], L, DV,
                                                             b->threads));
    }
    st->run = run_cached_attention;
    return 0;
}

/* ---- elementwise, casts, copies -------------------------------------------------------------- */

static int run_swiglu(const rt_step *st, npuc_session *s) {
    return npuc_swiglu_f32(st->in[0].data, st->in[1].data, st->out[0].data, st->out[0].numel, s->threads) ? NPUC_E_KERNEL
                                                                                                          : 0;
}

static int run_add(const rt_step *st, npuc_session *s) {
    return npuc_add_f32(st->in[0].data, st->in[1].data, st->out[0].data, st->out[0].numel, s->threads) ? NPUC_E_KERNEL
                                                                                                        : 0;
}

static int bind_same_shape_f32(rt_binder *b, rt_step *st, rt_run_fn run) {
    if (st->n_in != 2 || st->in[0].dtype != NPUC_F32 || st->in[1].dtype != NPUC_F32 ||
        !same_shape(&st->in[0], &st->in[1]) || !out_like(st, 0, &st->in[0], NPUC_F32))
        return no_kernel(b, st, NULL);
    st->run = run;
    return 0;
}

static int bind_swiglu(rt_binder *b, rt_step *st) { return bind_same_shape_f32(b, st, run_swiglu); }
static int bind_add(rt_binder *b, rt_step *st) { return bind_same_shape_f32(b, st, run_add); }

static int run_cast(const rt_step *st, npuc_session *s) {
    return npuc_cast(st->in[0].data, (int)st->i[0], st->out[0].data, (int)st->i[1], st->out[0].numel, s->threads)
               ? NPUC_E_KERNEL
               : 0;
}

static int bind_cast(rt_binder *b, rt_step *st) {
    const rt_view *x = &st->in[0];
    int64_t to = rt_attr_i(st->op, "dtype", -1);
    if (st->n_out != 1 || !same_shape(x, &st->out[0]) || st->out[0].dtype != to)
        return does_not_fit(b, st, "the output is not x in the cast's dtype");
    if (!is_float(x->dtype) || !is_float((int)to)) return no_kernel(b, st, NULL);
    st->i[0] = x->dtype == NPUC_BF16, st->i[1] = to == NPUC_BF16;
    st->run = run_cast;
    return 0;
}

static int run_copy(const rt_step *st, npuc_session *s) {
    (void)s;
    memmove(st->out[0].data, st->in[0].data, st->out[0].nbytes);
    return 0;
}

static int bind_reshape(rt_binder *b, rt_step *st) {
    const rt_attr *shape = rt_attr_ints(st->op, "shape");
    const rt_view *x = &st->in[0], *o = &st->out[0];
    if (shape == NULL || st->n_out != 1 || shape->n != o->rank || o->dtype != x->dtype || o->numel != x->numel)
        return does_not_fit(b, st, "cannot reshape");
    for (int32_t j = 0; j < o->rank; j++)
        if (shape->ints[j] != o->shape[j]) return does_not_fit(b, st, "the output is not the shape asked for");
    st->run = st->out_is_in0 ? NULL : run_copy;
    return 0;
}

/* The length of range(dim)[start:end:step] (step >= 1), as Python computes it. */
static int64_t slice_len(int64_t dim, int64_t start, int64_t end, int64_t step) {
    if (start < 0) start = start + dim < 0 ? 0 : start + dim;
    else if (start > dim) start = dim;
    if (end < 0) end = end + dim < 0 ? 0 : end + dim;
    else if (end > dim) end = dim;
    return end > start ? (end - start + step - 1) / step : 0;
}

/* A slice whose output is its operand's first bytes (the planner placed it there): nothing to
 * move. Any other slice is ops_generic.c's. */
static int bind_slice(rt_binder *b, rt_step *st) {
    const rt_view *x = &st->in[0];
    const rt_attr *end_attr = rt_find_attr(st->op, "end");
    if (!st->out_is_in0 || x->rank == 0 || st->n_in != 1 || end_attr == NULL) return no_kernel(b, st, NULL);
    int64_t axis = rt_attr_i(st->op, "axis", 0), start = rt_attr_i(st->op, "start", 0);
    int64_t step = rt_attr_i(st->op, "step", 1), end = rt_attr_i(st->op, "end", 0);
    if (axis < -x->rank || axis >= x->rank || step < 1) return no_kernel(b, st, NULL);
    int32_t ax = (int32_t)(axis < 0 ? axis + x->rank : axis);
    int64_t dim = x->shape[ax], n = slice_len(dim, start, end, step);
    const rt_view *o = &st->out[0];
    if (st->n_out != 1 || o->dtype != x->dtype || o->rank != x->rank || o->shape[ax] != n)
        return no_kernel(b, st, NULL); /* the generic binder words the refusal */
    for (int32_t j = 0; j < x->rank; j++)
        if (j != ax && o->shape[j] != x->shape[j]) return no_kernel(b, st, NULL);
    int64_t first = start < 0 ? (start + dim < 0 ? 0 : start + dim) : start;
    /* contiguous from byte 0: every axis before `ax` of size 1, from row 0, step 1 (or one row) */
    if (prod(x->shape, 0, ax) != 1 || (first != 0 && n > 0) || (step != 1 && n > 1)) return no_kernel(b, st, NULL);
    st->run = NULL;
    return 0;
}

static int run_permute(const rt_step *st, npuc_session *s) {
    return npuc_permute(st->in[0].data, st->out[0].data, st->i[0], &st->i[1], &st->i[5], s->threads) ? NPUC_E_KERNEL
                                                                                                       : 0;
}

static int bind_transpose(rt_binder *b, rt_step *st) {
    const rt_view *x = &st->in[0];
    const rt_attr *perm = rt_attr_ints(st->op, "perm");
    if (perm == NULL || perm->n != x->rank) return does_not_fit(b, st, "perm is not a permutation of the rank");
    int seen[NPUC_MAX_RANK] = {0};
    rt_view want = *x;
    for (int32_t j = 0; j < x->rank; j++) {
        int64_t p = perm->ints[j];
        if (p < 0 || p >= x->rank || seen[p]) return does_not_fit(b, st, "perm is not a permutation of the rank");
        seen[p] = 1;
        want.shape[j] = x->shape[p];
    }
    if (!out_like(st, 0, &want, x->dtype)) return does_not_fit(b, st, "the output is not x permuted");
    int64_t strides[NPUC_MAX_RANK];
    int64_t acc = 1;
    for (int32_t j = x->rank - 1; j >= 0; j--) strides[j] = acc, acc *= x->shape[j];
    /* A permutation that moves only dims of size 1 keeps the bytes: a view. */
    int64_t last = -1;
    int moves = 0;
    for (int32_t j = 0; j < x->rank; j++) {
        if (x->shape[perm->ints[j]] == 1) continue;
        if (perm->ints[j] < last) moves = 1;
        last = perm->ints[j];
    }
    if (!moves) {
        st->run = st->out_is_in0 ? NULL : run_copy;
        return 0;
    }
    if (st->out_is_in0) return does_not_fit(b, st, "a transpose that moves bytes is planned onto its operand");
    if (x->rank > 4) return no_kernel(b, st, NULL);
    int pad = 4 - x->rank;
    int64_t *i = st->i;
    i[0] = npuc_dtype_size(x->dtype);
    for (int j = 0; j < 4; j++) {
        i[1 + j] = j < pad ? 1 : x->shape[perm->ints[j - pad]];
        i[5 + j] = j < pad ? 0 : strides[perm->ints[j - pad]];
    }
    st->run = run_permute;
    return 0;
}

static int run_gather_rows(const rt_step *st, npuc_session *s) {
    (void)s;
    return npuc_gather_rows(st->in[0].data, st->i[0], st->i[1], st->in[1].data, st->in[1].numel, st->out[0].data)
               ? NPUC_E_KERNEL
               : 0;
}

static int bind_gather(rt_binder *b, rt_step *st) {
    const rt_view *x = &st->in[0], *idx = &st->in[1];
    if (st->n_in != 2 || x->rank < 1 || rt_attr_i(st->op, "axis", 0) % x->rank != 0 || idx->dtype != NPUC_I64)
        return no_kernel(b, st, NULL);
    rt_view want = *x;
    want.rank = x->rank - 1 + idx->rank;
    if (want.rank > NPUC_MAX_RANK) return no_kernel(b, st, NULL);
    for (int32_t j = 0; j < idx->rank; j++) want.shape[j] = idx->shape[j];
    for (int32_t j = 1; j < x->rank; j++) want.shape[idx->rank + j - 1] = x->shape[j];
    if (!out_like(st, 0, &want, x->dtype)) return does_not_fit(b, st, "the output is not the gathered rows");
    st->i[0] = x->shape[0], st->i[1] = (int64_t)npuc_dtype_size(x->dtype) * prod(x->shape, 1, x->rank);
    st->run = run_gather_rows;
    return 0;
}

static int run_pad_rows(const rt_step *st, npuc_session *s) {
    (void)s;
    const int64_t *i = st->i;
    return npuc_pad_rows(st->in[0].data, st->out[0].data, i[0], i[1], i[2], i[3], i[4], i[5], i[6]) ? NPUC_E_KERNEL : 0;
}

/* Rows of a pad's output that a later step reads (runtime/launch.py tail_rows_read): a pad
 * read only as the input of products with valid_rows need write only those rows. */
static int64_t pad_rows_read(const rt_binder *b, const rt_step *st) {
    const rt_program *p = b->program;
    int32_t o = st->out[0].tensor;
    for (int32_t j = 0; j < p->n_outputs; j++)
        if (p->outputs[j] == o) return -1;
    if (b->model->tensors[o].region != REGION_ARENA) return -1;
    int64_t most = 0;
    for (int32_t k = 0; k < p->n_ops; k++) {
        const rt_op *r = &p->ops[k];
        int reads = 0;
        for (int32_t j = 0; j < r->n_inputs; j++) reads |= r->inputs[j] == o;
        if (!reads) continue;
        if ((strcmp(r->op, "linear") && strcmp(r->op, "qlinear")) || r->inputs[0] != o) return -1;
        for (int32_t j = 1; j < r->n_inputs; j++)
            if (r->inputs[j] == o) return -1;
        const rt_attr *v = rt_find_attr(r, "valid_rows");
        if (v == NULL || v->kind != ATTR_I) return -1;
        if (v->i > most) most = v->i;
    }
    return most > 0 ? most : -1;
}

static int bind_pad(rt_binder *b, rt_step *st) {
    const rt_view *x = &st->in[0];
    const rt_attr *pads = rt_attr_ints(st->op, "pads");
    int32_t r = x->rank;
    if (st->n_in != 1 || pads == NULL || pads->n != 2 * r || r < 2 || strcmp(rt_attr_s(st->op, "mode", "constant"),
                                                                             "constant"))
        return no_kernel(b, st, NULL);
    for (int32_t j = 0; j < 2 * r; j++) {
        if (pads->ints[j] < 0) return no_kernel(b, st, NULL);
        if ((j < r || j < 2 * r - 2) && pads->ints[j]) return no_kernel(b, st, NULL);
    }
    rt_view want = *x;
    want.shape[r - 2] += pads->ints[2 * r - 2];
    want.shape[r - 1] += pads->ints[2 * r - 1];
    if (!out_like(st, 0, &want, x->dtype)) return does_not_fit(b, st, "the output is not x padded");
    int64_t m2 = want.shape[r - 2], fill = pad_rows_read(b, st);
    int64_t *i = st->i;
    i[0] = npuc_dtype_size(x->dtype), i[1] = prod(x->shape, 0, r - 2), i[2] = x->shape[r - 2];
    i[3] = x->shape[r - 1], i[4] = m2, i[5] = want.shape[r - 1], i[6] = fill < 0 || fill > m2 ? m2 : fill;
    st->run = run_pad_rows;
    return 0;
}

static int run_dequantize(const rt_step *st, npuc_session *s) {
    (void)s;
    const int64_t *i = st->i;
    return npuc_dequantize(st->in[0].data, (int)i[0], st->in[1].data, (int)i[1], st->in[2].data, i[2], i[3], i[4],
                           st->out[0].data, (int)i[5])
               ? NPUC_E_KERNEL
               : 0;
}

static int bind_dequantize(rt_binder *b, rt_step *st) {
    const rt_view *q = &st->in[0], *scale = &st->in[1], *zero = &st->in[2];
    int64_t bits = rt_attr_i(st->op, "bits", 0), g = rt_attr_i(st->op, "group_size", 0), k = 0;
    int64_t to = rt_attr_i(st->op, "dtype", NPUC_F32);
    if (!check_quantized(q, scale, zero, bits, g, &k)) return does_not_fit(b, st, "codes, scales and zeros differ");
    rt_view want = *q;
    want.shape[q->rank - 1] = k;
    want.numel = q->rank ? prod(want.shape, 0, q->rank) : 1;
    if (!out_like(st, 0, &want, (int)to)) return does_not_fit(b, st, "the output is not the dequantized weight");
    if (!is_float((int)to) || !(is_float(scale->dtype) || scale->dtype == NPUC_F16)) return no_kernel(b, st, NULL);
    int64_t *i = st->i;
    i[0] = bits, i[1] = scale->dtype == NPUC_BF16 ? 1 : scale->dtype == NPUC_F16 ? 2 : 0, i[2] = want.numel / (k ? k : 1), i[3] = k, i[4] = g;
    i[5] = to == NPUC_BF16;
    st->run = run_dequantize;
    return 0;
}

/* ---- the binder table ------------------------------------------------------------------------- */

static const struct {
    const char *op;
    rt_bind_fn bind;
} CORE[] = {
    {"linear", bind_linear},         {"qlinear", bind_qlinear},
    {"rms_norm", bind_rms_norm},     {"rope_lut", bind_rope},
    {"kv_write", bind_kv_write},     {"cached_attention", bind_cached_attention},
    {"fused_attention", bind_fused_attention}, {"swiglu", bind_swiglu},
    {"add", bind_add},               {"cast", bind_cast},
    {"reshape", bind_reshape},       {"slice", bind_slice},
    {"transpose", bind_transpose},   {"gather", bind_gather},
    {"pad", bind_pad},               {"dequantize", bind_dequantize},
    {"selective_scan", rt_bind_selective_scan}, {"selective_scan_state", rt_bind_selective_scan},
    {"gated_delta_rule", rt_bind_gated_delta_rule}, {"gated_delta_rule_state", rt_bind_gated_delta_rule},
    {"wkv", rt_bind_wkv},            {"wkv_state", rt_bind_wkv},
    {"linear_recurrence", rt_bind_linear_recurrence}, {"linear_recurrence_state", rt_bind_linear_recurrence},
    {"linear_attention", rt_bind_gated_delta_rule}, {"linear_attention_state", rt_bind_gated_delta_rule},
};

rt_bind_fn rt_find_binder(const char *op) {
    for (size_t k = 0; k < sizeof CORE / sizeof CORE[0]; k++)
        if (strcmp(CORE[k].op, op) == 0) return CORE[k].bind;
    return NULL;
}

/* Bind one op: each table that has a binder for it, in order, until one takes it. */
static int bind_step(rt_binder *b, rt_step *st) {
    rt_bind_fn found[4] = {rt_find_binder(st->op->op), rt_generic_binder(st->op->op), rt_deepseek_binder(st->op->op),
                           rt_attention_binder(st->op->op)};
    npuc_error why;
    int any = 0;
    why.message[0] = 0;
    for (int k = 0; k < 4; k++) {
        if (found[k] == NULL) continue;
        any = 1;
        npuc_error *outer = b->err;
        npuc_error mine;
        b->err = &mine;
        mine.message[0] = 0;
        st->run = NULL;
        memset(st->i, 0, sizeof st->i);
        memset(st->f, 0, sizeof st->f);
        memset(st->p, 0, sizeof st->p);
        int rc = found[k](b, st);
        b->err = outer;
        if (rc == 0) return 0;
        if (rc != NPUC_E_NO_KERNEL) {
            if (outer != NULL) *outer = mine;
            return rc;
        }
        if (mine.message[0]) why = mine;
    }
    return rt_fail(b->err, NPUC_E_NO_KERNEL, "run it with the Python runtime (npuc run/generate use it for such a model)",
                   "%s: op '%s' (%s) has no kernel in the native runtime%s%s", b->model->path, st->op->name,
                   st->op->op, any && why.message[0] ? ": " : "", any && why.message[0] ? why.message : "");
}

static void fill_step(const npuc_model *m, npuc_session *s, const rt_op *op, rt_step *st) {
    memset(st, 0, sizeof *st);
    st->op = op;
    st->n_in = op->n_inputs;
    st->n_out = op->n_outputs;
    for (int32_t j = 0; j < op->n_inputs; j++) view_of(m, s, op->inputs[j], &st->in[j]);
    for (int32_t j = 0; j < op->n_outputs; j++) view_of(m, s, op->outputs[j], &st->out[j]);
    if (op->workspace >= 0) view_of(m, s, op->workspace, &st->ws);
    if (op->n_inputs > 0 && op->n_outputs > 0) {
        const rt_tensor *a = &m->tensors[op->inputs[0]], *o = &m->tensors[op->outputs[0]];
        st->out_is_in0 = a->region == o->region && a->offset == o->offset;
    }
}

static int operand_counts(const npuc_model *m, const rt_op *op, npuc_error *err) {
    if (op->n_inputs > RT_MAX_OPERANDS || op->n_outputs > 4)
        return rt_fail(err, NPUC_E_NO_KERNEL, "", "%s: op '%s' (%s) has %d operands and %d results; the native "
                       "runtime takes at most %d and 4", m->path, op->name, op->op, (int)op->n_inputs,
                       (int)op->n_outputs, RT_MAX_OPERANDS);
    return 0;
}

int npuc_exec_check(npuc_model *m, npuc_error *err) {
    int rc0 = rt_generation_setup(m, err);
    if (rc0) return rc0;
    for (int32_t p = 0; p < m->n_programs; p++) {
        rt_binder b = {.dry = 1, .threads = 1, .prepack = 1, .model = m, .program = &m->programs[p], .err = err};
        for (int32_t k = 0; k < m->programs[p].n_ops; k++) {
            const rt_op *op = &m->programs[p].ops[k];
            int rc = operand_counts(m, op, err);
            if (rc) return rc;
            rt_step st;
            fill_step(m, NULL, op, &st);
            rc = bind_step(&b, &st);
            if (rc) return rc;
        }
    }
    return 0;
}

/* ---- input checks (runtime/session.py's Session.run and _tables) ---------------------------- */

static void input_checks(const npuc_model *m, const rt_program *p, rt_input_check *checks) {
    for (int32_t j = 0; j < p->n_inputs; j++) {
        int32_t t = p->inputs[j];
        const char *name = m->tensors[t].name;
        rt_input_check *c = &checks[j];
        if (strcmp(name, "position") == 0 && m->cache_rows > 0) {
            c->kind = 2, c->low = 0, c->rows = m->cache_rows;
            continue;
        }
        if (strcmp(name, "slot") == 0 && m->slots > 0) {
            c->kind = 3, c->low = 0, c->rows = m->slots;
            continue;
        }
        for (int32_t k = 0; k < p->n_ops && c->kind == 0; k++) {
            const rt_op *op = &p->ops[k];
            if (strcmp(op->op, "gather") == 0 && op->n_inputs > 1 && op->inputs[1] == t) {
                const rt_tensor *table = &m->tensors[op->inputs[0]];
                if (table->region == REGION_WEIGHTS && table->rank > 0) {
                    int64_t axis = rt_attr_i(op, "axis", 0) % table->rank;
                    if (axis < 0) axis += table->rank;
                    c->kind = 1, c->rows = table->shape[axis], c->low = -c->rows, c->table = 1;
                }
            } else if (strcmp(op->op, "index") == 0) {
                const rt_tensor *x = &m->tensors[op->inputs[0]];
                for (int32_t a = 1; a < op->n_inputs && a <= x->rank; a++)
                    if (op->inputs[a] == t) {
                        c->kind = 1, c->rows = x->shape[a - 1], c->table = x->region == REGION_WEIGHTS;
                        c->low = strcmp(name, "last_token") == 0 ? 0 : -c->rows;
                        break;
                    }
            }
        }
    }
}

static int64_t int_at(const void *data, int dtype, int64_t i) {
    switch (dtype) {
    case NPUC_I64: return ((const int64_t *)data)[i];
    case NPUC_I32: return ((const int32_t *)data)[i];
    case NPUC_I16: return ((const int16_t *)data)[i];
    case NPUC_I8: return ((const int8_t *)data)[i];
    case NPUC_U8: return ((const uint8_t *)data)[i];
    default: return 0;
    }
}

static int is_int(int dt) { return dt == NPUC_I64 || dt == NPUC_I32 || dt == NPUC_I16 || dt == NPUC_I8 || dt == NPUC_U8; }

static void list_values(char *buf, size_t size, const void *data, int dtype, int64_t n) {
    size_t used = 0;
    buf[0] = 0;
    used += (size_t)snprintf(buf, size, "[");
    for (int64_t i = 0; i < n && used + 24 < size; i++)
        used += (size_t)snprintf(buf + used, size - used, "%s%lld", i ? ", " : "", (long long)int_at(data, dtype, i));
    if (used + 2 < size) snprintf(buf + used, size - used, "]");
}

static int check_input(const npuc_model *m, const rt_tensor *t, const rt_input_check *c, const void *data,
                       npuc_error *err) {
    if (c->kind == 0 || !is_int(t->dtype)) return 0;
    int64_t n = 1;
    for (int32_t d = 0; d < t->rank; d++) n *= t->shape[d];
    char vals[160];
    for (int64_t i = 0; i < n; i++) {
        int64_t v = int_at(data, t->dtype, i);
        if (v >= c->low && v < c->rows) continue;
        if (c->kind == 2) {
            list_values(vals, sizeof vals, data, t->dtype, n);
            return rt_fail(err, NPUC_E_INPUT, "positions run from 0 to --max_seq_len - 1",
                           "position %s is outside the %lld positions the model caches", vals, (long long)c->rows);
        }
        if (c->kind == 3) {
            list_values(vals, sizeof vals, data, t->dtype, n);
            char hint[96];
            snprintf(hint, sizeof hint, "slots run from 0 to %lld (the --input_shape batch - 1)",
                     (long long)c->rows - 1);
            return rt_fail(err, NPUC_E_INPUT, hint, "slot %s is outside the model's %lld slots", vals,
                           (long long)c->rows);
        }
        char hint[160];
        if (c->table) {
            snprintf(hint, sizeof hint, "its values index an embedding: 0..%lld", (long long)c->rows - 1);
            return rt_fail(err, NPUC_E_INPUT, hint, "input '%s' holds %lld, outside the %lld rows of the table it "
                           "indexes", t->name, (long long)v, (long long)c->rows);
        }
        snprintf(hint, sizeof hint, "its values are rows %lld..%lld%s", (long long)c->low, (long long)c->rows - 1,
                 strcmp(t->name, "last_token") == 0 ? " (the prompt's last position: its length - 1)" : "");
        return rt_fail(err, NPUC_E_INPUT, hint, "input '%s' holds %lld, outside the %lld rows it picks from",
                       t->name, (long long)v, (long long)c->rows);
    }
    (void)m;
    return 0;
}

/* ---- sessions ---------------------------------------------------------------------------------- */

void npuc_session_options_default(npuc_session_options *o) {
    if (o == NULL) return;
    memset(o, 0, sizeof *o);
    o->struct_size = sizeof *o;
    o->threads = 0;
    o->prepack = 1;
}

static void *aligned_zeroed(uint64_t n) {
    void *p = NULL;
    size_t size = (size_t)(n ? (n + 63) / 64 * 64 : 64);
    if (posix_memalign(&p, 64, size)) return NULL;
    memset(p, 0, size);
    return p;
}

int npuc_session_free(npuc_session *s) {
    if (s == NULL) return NPUC_OK;
    free(s->arena);
    free(s->state);
    free(s->scratch);
    pool_free(&s->pool);
    free(s);
    return NPUC_OK;
}

int npuc_session_create(const npuc_model *m, const npuc_session_options *opts, npuc_session **out, npuc_error *err) {
    if (m == NULL || out == NULL) return rt_fail(err, NPUC_E_ARG, "", "npuc_session_create: a NULL argument");
    *out = NULL;
    npuc_session_options o;
    npuc_session_options_default(&o);
    if (opts != NULL) {
        if (opts->struct_size < sizeof(uint32_t) + sizeof(int32_t))
            return rt_fail(err, NPUC_E_ARG, "", "npuc_session_create: options.struct_size is not set");
        memcpy(&o, opts, opts->struct_size < sizeof o ? opts->struct_size : sizeof o);
    }
    npuc_session *s = calloc(1, sizeof *s);
    if (s == NULL) return rt_fail(err, NPUC_E_ARG, "", "out of memory");
    s->m = m;
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    s->threads = o.threads > 0 ? o.threads : (int)(cpus > 0 ? cpus : 1);
    if (s->threads > 64) s->threads = 64;
    s->arena = aligned_zeroed(m->arena_bytes);
    s->state = aligned_zeroed(m->state_bytes);
    s->progs = pool_alloc(&s->pool, sizeof(rt_sprog) * (size_t)(m->n_programs ? m->n_programs : 1));
    int64_t slots = m->has_gen ? m->gen.slots : 1;
    s->track = pool_alloc(&s->pool, sizeof(int64_t) * 2 * (size_t)(slots > 0 ? slots : 1));
    if (s->track != NULL)
        for (int64_t k = 0; k < 2 * slots; k++) s->track[k] = -1;
    if (s->arena == NULL || s->state == NULL || s->progs == NULL || s->track == NULL) {
        npuc_session_free(s);
        return rt_fail(err, NPUC_E_ARG, "", "out of memory allocating the arena and state (%llu bytes)",
                       (unsigned long long)(m->arena_bytes + m->state_bytes));
    }
    uint64_t scratch = 0, extra = 0;
    for (int32_t p = 0; p < m->n_programs; p++) {
        const rt_program *prog = &m->programs[p];
        rt_sprog *sp = &s->progs[p];
        sp->steps = pool_alloc(&s->pool, sizeof(rt_step) * (size_t)(prog->n_ops ? prog->n_ops : 1));
        sp->step_ns = pool_alloc(&s->pool, sizeof(uint64_t) * (size_t)(prog->n_ops ? prog->n_ops : 1));
        sp->checks = pool_alloc(&s->pool, sizeof(rt_input_check) * (size_t)(prog->n_inputs ? prog->n_inputs : 1));
        if (sp->steps == NULL || sp->checks == NULL || sp->step_ns == NULL) {
            npuc_session_free(s);
            return rt_fail(err, NPUC_E_ARG, "", "out of memory");
        }
        input_checks(m, prog, sp->checks);
        rt_binder b = {.dry = 0, .threads = s->threads, .prepack = o.prepack, .model = m, .program = prog,
                       .pool = &s->pool, .err = err};
        int32_t n = 0;
        for (int32_t k = 0; k < prog->n_ops; k++) {
            rt_step *st = &sp->steps[n];
            int rc = operand_counts(m, &prog->ops[k], err);
            if (!rc) {
                fill_step(m, s, &prog->ops[k], st);
                rc = bind_step(&b, st);
            }
            if (rc) {
                npuc_session_free(s);
                return rc;
            }
            if (st->run != NULL) n++; /* views drop out of the run */
        }
        sp->n_steps = n;
        if (b.scratch_floats > scratch) scratch = b.scratch_floats;
        extra += b.extra_bytes;
    }
    s->scratch_floats = scratch;
    s->scratch = aligned_zeroed((scratch ? scratch : 1) * sizeof(float));
    if (s->scratch == NULL) {
        npuc_session_free(s);
        return rt_fail(err, NPUC_E_ARG, "", "out of memory allocating %llu floats of scratch",
                       (unsigned long long)scratch);
    }
    s->extra_bytes = extra + scratch * sizeof(float);
    *out = s;
    return NPUC_OK;
}

int npuc_session_reset(npuc_session *s) {
    if (s == NULL) return NPUC_E_ARG;
    if (s->m->state_bytes) memset(s->state, 0, (size_t)s->m->state_bytes);
    int64_t slots = s->m->has_gen ? s->m->gen.slots : 1;
    for (int64_t k = 0; k < 2 * slots; k++) s->track[k] = -1;
    return NPUC_OK;
}

int npuc_session_extra_bytes(const npuc_session *s, uint64_t *bytes) {
    if (s == NULL || bytes == NULL) return NPUC_E_ARG;
    *bytes = s->extra_bytes;
    return NPUC_OK;
}

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

int npuc_session_profile(npuc_session *s, int32_t enable) {
    if (s == NULL) return NPUC_E_ARG;
    s->profile = enable != 0;
    for (int32_t p = 0; p < s->m->n_programs; p++) {
        s->progs[p].kernel_ns = s->progs[p].runs = 0;
        memset(s->progs[p].step_ns, 0, sizeof(uint64_t) * (size_t)(s->progs[p].n_steps ? s->progs[p].n_steps : 1));
    }
    return NPUC_OK;
}

int npuc_session_profile_step(const npuc_session *s, int32_t program, int32_t step, const char **op,
                              const char **name, uint64_t *ns) {
    if (s == NULL || program < 0 || program >= s->m->n_programs || step < 0 || step >= s->progs[program].n_steps)
        return NPUC_E_ARG;
    const rt_step *st = &s->progs[program].steps[step];
    if (op) *op = st->op->op;
    if (name) *name = st->op->name;
    if (ns) *ns = s->progs[program].step_ns[step];
    return NPUC_OK;
}

int npuc_session_profile_read(const npuc_session *s, int32_t program, uint64_t *kernel_ns, uint64_t *runs) {
    if (s == NULL || program < 0 || program >= s->m->n_programs) return NPUC_E_ARG;
    if (kernel_ns) *kernel_ns = s->progs[program].kernel_ns;
    if (runs) *runs = s->progs[program].runs;
    return NPUC_OK;
}

int rt_session_execute(npuc_session *s, int32_t program, npuc_error *err) {
    rt_sprog *sp = &s->progs[program];
    const rt_program *prog = &s->m->programs[program];
    uint64_t spent = 0;
    for (int32_t k = 0; k < sp->n_steps; k++) {
        const rt_step *st = &sp->steps[k];
        uint64_t t0 = s->profile ? now_ns() : 0;
        int rc = st->run(st, s);
        if (s->profile) {
            uint64_t dt = now_ns() - t0;
            spent += dt;
            sp->step_ns[k] += dt;
        }
        if (rc == NPUC_E_INPUT)
            return rt_fail(err, NPUC_E_INPUT, "positions run from 0 to --max_seq_len - 1",
                           "%s: a position lies outside the table or cache it indexes", st->op->op);
        if (rc)
            return rt_fail(err, NPUC_E_KERNEL, "the file may be damaged (recompile it); if it was just compiled, this "
                           "is a bug in npuc: rerun with --debug and report it",
                           "program '%s' failed in a kernel: op '%s' (%s) refused the values it was given", prog->name,
                           st->op->name, st->op->op);
    }
    if (s->profile) {
        s->progs[program].kernel_ns += spent;
        s->progs[program].runs++;
    }
    return NPUC_OK;
}

int rt_session_set_input(npuc_session *s, int32_t program, int32_t i, const void *data, uint64_t bytes,
                         npuc_error *err) {
    const npuc_model *m = s->m;
    const rt_program *prog = &m->programs[program];
    const rt_tensor *t = &m->tensors[prog->inputs[i]];
    if (data == NULL || bytes != t->nbytes)
        return rt_fail(err, NPUC_E_INPUT, "npuc models have static shapes; recompile with the --input_shape you need",
                       "input '%s' has %llu bytes, the model was compiled for %s of %llu bytes", t->name,
                       (unsigned long long)bytes, t->dtype_name, (unsigned long long)t->nbytes);
    int rc = check_input(m, t, &s->progs[program].checks[i], data, err);
    if (rc) return rc;
    memcpy(s->arena + t->offset, data, (size_t)t->nbytes);
    return NPUC_OK;
}

int npuc_session_run(npuc_session *s, int32_t program, const void *const *inputs, const uint64_t *input_bytes,
                     int32_t n_inputs, void *const *outputs, const uint64_t *output_bytes, int32_t n_outputs,
                     npuc_error *err) {
    if (s == NULL) return rt_fail(err, NPUC_E_ARG, "", "npuc_session_run: no session");
    const npuc_model *m = s->m;
    if (program < 0 || program >= m->n_programs)
        return rt_fail(err, NPUC_E_NO_PROGRAM, "", "the model has no program %d", (int)program);
    const rt_program *prog = &m->programs[program];
    if (n_inputs != prog->n_inputs || (prog->n_inputs && (inputs == NULL || input_bytes == NULL)))
        return rt_fail(err, NPUC_E_INPUTS, "", "program '%s' takes %d inputs, %d were given", prog->name,
                       (int)prog->n_inputs, (int)n_inputs);
    if (n_outputs != 0 && (n_outputs != prog->n_outputs || outputs == NULL || output_bytes == NULL))
        return rt_fail(err, NPUC_E_ARG, "", "program '%s' has %d outputs, %d buffers were given", prog->name,
                       (int)prog->n_outputs, (int)n_outputs);
    for (int32_t i = 0; i < n_outputs; i++)
        if (outputs[i] == NULL || output_bytes[i] != m->tensors[prog->outputs[i]].nbytes)
            return rt_fail(err, NPUC_E_ARG, "", "output '%s' needs a buffer of %llu bytes",
                           m->tensors[prog->outputs[i]].name,
                           (unsigned long long)m->tensors[prog->outputs[i]].nbytes);
    /* Every input is checked before any is copied: a refused run changes nothing. */
    for (int32_t i = 0; i < n_inputs; i++) {
        const rt_tensor *t = &m->tensors[prog->inputs[i]];
        if (inputs[i] == NULL || input_bytes[i] != t->nbytes)
            return rt_fail(err, NPUC_E_INPUT, "npuc models have static shapes; recompile with the --input_shape you "
                           "need", "input '%s' has %llu bytes, the model was compiled for %s of %llu bytes", t->name,
                           (unsigned long long)input_bytes[i], t->dtype_name, (unsigned long long)t->nbytes);
        int rc = check_input(m, t, &s->progs[program].checks[i], inputs[i], err);
        if (rc) return rc;
    }
    for (int32_t i = 0; i < n_inputs; i++) {
        const rt_tensor *t = &m->tensors[prog->inputs[i]];
        memcpy(s->arena + t->offset, inputs[i], (size_t)t->nbytes);
    }
    int rc = rt_session_execute(s, program, err);
    if (rc) return rc;
    for (int32_t i = 0; i < n_outputs; i++) {
        const rt_tensor *t = &m->tensors[prog->outputs[i]];
        const uint8_t *src = t->region == REGION_STATE ? s->state : t->region == REGION_ARENA ? s->arena : m->weights;
        memcpy(outputs[i], src + t->offset, (size_t)t->nbytes);
    }
    return NPUC_OK;
}

int npuc_session_output_view(npuc_session *s, int32_t program, int32_t index, const void **data) {
    if (s == NULL || data == NULL || program < 0 || program >= s->m->n_programs) return NPUC_E_ARG;
    const rt_program *prog = &s->m->programs[program];
    if (index < 0 || index >= prog->n_outputs) return NPUC_E_ARG;
    const rt_tensor *t = &s->m->tensors[prog->outputs[index]];
    const uint8_t *src = t->region == REGION_STATE ? s->state : t->region == REGION_ARENA ? s->arena : s->m->weights;
    *data = src + t->offset;
    return NPUC_OK;
}

const npuc_model *rt_session_model(const npuc_session *s) { return s->m; }
int64_t *rt_session_slot_track(npuc_session *s) { return s->track; }

uint8_t *rt_session_state(npuc_session *s) { return s->state; }
