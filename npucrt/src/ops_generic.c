/* The generic ops: every op of npuc's registry (ir/ops.py, ir/fused_ops.py) that the executor
 * does not run natively, bound and computed on the CPU. exec.c asks rt_generic_binder() for
 * an op its own table lacks (or refused); this file gathers three families, each with its
 * own table of {op name, binder}:
 *
 *   ops_elementwise.c  unary, binary, comparisons, where, cast (one engine; ops are table rows)
 *   ops_movement.c     reshape, transpose, slice, slice_scatter, pad, concat, split, expand,
 *                      gather, gather_elements, gather_nd, index, scatter_elements, scatter_nd,
 *                      full, arange, trilu
 *   ops_reduce.c       reductions, argmax/argmin, topk, cumsum, softmax, log_softmax,
 *                      layer_norm, rms_norm, matmul
 *
 * and here the helpers they share (ops_generic.h): refusals that name the op, attribute
 * readers that apply the schema's defaults, output checks, block loads and stores between
 * storage dtypes and the compute types (f32 for float storage, int64 for integers and bool),
 * a parallel-for over index ranges, and the strided copy that data movement reduces to.
 *
 * What a binder does (exec.h's contract): check the operands and attributes exactly as the
 * op's shape rule does, and the outputs against what it infers (NPUC_E_INVALID otherwise),
 * refuse what it does not run (NPUC_E_NO_KERNEL), and, when not dry, prepare the step's run
 * (st->run, st->i/f/p, a plan in the session's pool). Runs only move and compute; the one
 * check they make is on values that address memory (an index), returning NPUC_E_KERNEL.
 *
 * Adding an op: an elementwise one is a row of ops_elementwise.c's table (its dtypes and one
 * function per compute type); any other is a binder and a run function in its family's file
 * and a row of that file's table. Its test goes in tests/test_npucrt_ops.py, against the
 * registry's torch kernel.
 */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "ops_generic.h"

rt_bind_fn og_lookup(const og_entry *table, const char *op) {
    for (const og_entry *e = table; e->name; e++)
        if (strcmp(e->name, op) == 0) return e->bind;
    return NULL;
}

rt_bind_fn rt_generic_binder(const char *op) {
    rt_bind_fn f = rt_elementwise_binder(op);
    if (!f) f = rt_movement_binder(op);
    if (!f) f = rt_reduce_binder(op);
    return f;
}

/* ---- refusals ---------------------------------------------------------------------------- */

/* As exec.c words them: NPUC_E_INVALID in full; NPUC_E_NO_KERNEL as the reason, which exec.c
 * puts after "<path>: op '<name>' (<op>) has no kernel in the native runtime: ". */
int og_invalid(rt_binder *b, const rt_step *st, const char *fmt, ...) {
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return rt_fail(b->err, NPUC_E_INVALID, HINT_DAMAGED, "%s: op '%s' (%s) does not take its operands: %s",
                   b->model ? b->model->path : "<model>", st->op->name ? st->op->name : "?", st->op->op, msg);
}

int og_no_kernel(rt_binder *b, const rt_step *st, const char *fmt, ...) {
    char msg[512];
    va_list ap;
    (void)st;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return rt_fail(b->err, NPUC_E_NO_KERNEL, "", "%s", msg);
}

/* ---- attributes -------------------------------------------------------------------------- */

int og_attr_int(rt_binder *b, const rt_step *st, const char *name, int has_dflt, int64_t dflt, int64_t *v) {
    const rt_attr *a = rt_find_attr(st->op, name);
    if (!a) {
        if (!has_dflt) return og_invalid(b, st, "attribute %s is missing", name);
        *v = dflt;
        return 0;
    }
    if (a->kind != ATTR_I && a->kind != ATTR_B) return og_invalid(b, st, "attribute %s is not an int", name);
    *v = a->i;
    return 0;
}

int og_attr_num(rt_binder *b, const rt_step *st, const char *name, int has_dflt, double dflt, double *v) {
    const rt_attr *a = rt_find_attr(st->op, name);
    if (!a) {
        if (!has_dflt) return og_invalid(b, st, "attribute %s is missing", name);
        *v = dflt;
        return 0;
    }
    if (a->kind == ATTR_F) *v = a->f;
    else if (a->kind == ATTR_I || a->kind == ATTR_B) *v = (double)a->i; /* a whole float is written as an int */
    else return og_invalid(b, st, "attribute %s is not a number", name);
    return 0;
}

int og_attr_str(rt_binder *b, const rt_step *st, const char *name, const char *dflt, const char **v) {
    const rt_attr *a = rt_find_attr(st->op, name);
    if (!a) {
        if (!dflt) return og_invalid(b, st, "attribute %s is missing", name);
        *v = dflt;
        return 0;
    }
    if (a->kind != ATTR_S || !a->s) return og_invalid(b, st, "attribute %s is not a string", name);
    *v = a->s;
    return 0;
}

int og_attr_ints(rt_binder *b, const rt_step *st, const char *name, const int64_t **v, int32_t *n) {
    const rt_attr *a = rt_find_attr(st->op, name);
    if (!a) return og_invalid(b, st, "attribute %s is missing", name);
    if (a->kind != ATTR_INTS || a->n < 0 || (a->n > 0 && !a->ints))
        return og_invalid(b, st, "attribute %s is not a list of ints", name);
    *v = a->ints;
    *n = a->n;
    return 0;
}

int og_attr_dtype(rt_binder *b, const rt_step *st, const char *name, int *v) {
    const rt_attr *a = rt_find_attr(st->op, name);
    if (!a) return og_invalid(b, st, "attribute %s is missing", name);
    if (a->kind != ATTR_DTYPE || npuc_dtype_size((int)a->i) == 0)
        return og_invalid(b, st, "attribute %s is not a dtype", name);
    *v = (int)a->i;
    return 0;
}

/* ---- checks ------------------------------------------------------------------------------ */

int og_check_arity(rt_binder *b, const rt_step *st, int min_in, int max_in, int n_out) {
    if (st->n_in < min_in || st->n_in > max_in)
        return og_invalid(b, st, "takes %d to %d operands, has %d", min_in, max_in, (int)st->n_in);
    if (st->n_out != n_out) return og_invalid(b, st, "has %d outputs, should have %d", (int)st->n_out, n_out);
    return 0;
}

static void shape_str(char *buf, size_t size, int dtype, int32_t rank, const int64_t *shape) {
    size_t used = (size_t)snprintf(buf, size, "%s[", npuc_dtype_name(dtype));
    for (int32_t d = 0; d < rank && used < size; d++)
        used += (size_t)snprintf(buf + used, size - used, d ? ",%lld" : "%lld", (long long)shape[d]);
    if (used < size) snprintf(buf + used, size - used, "]");
}

int og_check_out(rt_binder *b, const rt_step *st, int k, int dtype, int32_t rank, const int64_t *shape) {
    const rt_view *o = &st->out[k];
    int same = o->dtype == dtype && o->rank == rank;
    for (int32_t d = 0; same && d < rank; d++) same = o->shape[d] == shape[d];
    if (same) return 0;
    char want[160], got[160];
    shape_str(want, sizeof want, dtype, rank, shape);
    shape_str(got, sizeof got, o->dtype, o->rank, o->shape);
    return og_invalid(b, st, "output %d is %s, the op's rule gives %s", k, got, want);
}

int og_norm_axis(rt_binder *b, const rt_step *st, int64_t axis, int32_t rank, int32_t *out) {
    int64_t r = rank > 1 ? rank : 1;
    if (axis < -r || axis >= r) return og_invalid(b, st, "axis %lld out of range for rank %d", (long long)axis, rank);
    *out = (int32_t)(axis < 0 ? axis + r : axis);
    return 0;
}

int og_broadcast(rt_binder *b, const rt_step *st, const rt_view *const *v, int n, int32_t *rank, int64_t *shape) {
    int32_t r = 0;
    for (int k = 0; k < n; k++)
        if (v[k]->rank > r) r = v[k]->rank;
    for (int32_t d = 0; d < r; d++) {
        int64_t dim = 1;
        for (int k = 0; k < n; k++) {
            int32_t j = d - (r - v[k]->rank);
            if (j < 0 || v[k]->shape[j] == 1) continue;
            if (dim != 1 && dim != v[k]->shape[j]) return og_invalid(b, st, "operand shapes do not broadcast");
            dim = v[k]->shape[j];
        }
        shape[d] = dim;
    }
    *rank = r;
    return 0;
}

void *og_alloc(rt_binder *b, const rt_step *st, size_t n) {
    void *p = b->pool ? pool_alloc(b->pool, n) : NULL;
    if (!p) {
        rt_fail(b->err, NPUC_E_ARG, "", "op '%s' (%s): out of memory for its plan", st->op->name ? st->op->name : "?",
                st->op->op);
        return NULL;
    }
    b->extra_bytes += n;
    return p;
}

void og_want_scratch(rt_binder *b, uint64_t floats) {
    if (floats > b->scratch_floats) b->scratch_floats = floats;
}

/* ---- element conversion ------------------------------------------------------------------ */

#define LOAD_LOOP(T, EXPR)                                                                                   \
    do {                                                                                                     \
        const T *q = (const T *)p + off;                                                                     \
        for (int64_t i = 0; i < n; i++) {                                                                    \
            T x = q[i * stride];                                                                             \
            dst[i] = EXPR;                                                                                   \
        }                                                                                                    \
    } while (0)

void og_load_f32(const void *p, int dt, int64_t off, int64_t stride, int64_t n, float *dst) {
    switch (dt) {
    case NPUC_F32:
        if (stride == 1) memcpy(dst, (const float *)p + off, (size_t)n * sizeof(float));
        else LOAD_LOOP(float, x);
        break;
    case NPUC_BF16: LOAD_LOOP(uint16_t, npuc_bf16_to_f32(x)); break;
    case NPUC_F16: LOAD_LOOP(uint16_t, rt_f16_to_f32(x)); break;
    case NPUC_F64: LOAD_LOOP(double, (float)x); break;
    case NPUC_I64: LOAD_LOOP(int64_t, (float)x); break;
    case NPUC_I32: LOAD_LOOP(int32_t, (float)x); break;
    case NPUC_I16: LOAD_LOOP(int16_t, (float)x); break;
    case NPUC_I8: LOAD_LOOP(int8_t, (float)x); break;
    case NPUC_U8: LOAD_LOOP(uint8_t, (float)x); break;
    case NPUC_BOOL: LOAD_LOOP(uint8_t, x ? 1.0f : 0.0f); break;
    default: break;
    }
}

void og_load_i64(const void *p, int dt, int64_t off, int64_t stride, int64_t n, int64_t *dst) {
    switch (dt) {
    case NPUC_I64:
        if (stride == 1) memcpy(dst, (const int64_t *)p + off, (size_t)n * sizeof(int64_t));
        else LOAD_LOOP(int64_t, x);
        break;
    case NPUC_I32: LOAD_LOOP(int32_t, x); break;
    case NPUC_I16: LOAD_LOOP(int16_t, x); break;
    case NPUC_I8: LOAD_LOOP(int8_t, x); break;
    case NPUC_U8: LOAD_LOOP(uint8_t, x); break;
    case NPUC_BOOL: LOAD_LOOP(uint8_t, x != 0); break;
    case NPUC_F32: LOAD_LOOP(float, og_f2i(x, NPUC_I64)); break;
    case NPUC_BF16: LOAD_LOOP(uint16_t, og_f2i(npuc_bf16_to_f32(x), NPUC_I64)); break;
    case NPUC_F16: LOAD_LOOP(uint16_t, og_f2i(rt_f16_to_f32(x), NPUC_I64)); break;
    case NPUC_F64: LOAD_LOOP(double, og_f2i(x, NPUC_I64)); break;
    default: break;
    }
}

#define STORE_LOOP(T, EXPR)                                                                                  \
    do {                                                                                                     \
        T *q = (T *)p + off;                                                                                 \
        for (int64_t i = 0; i < n; i++) q[i] = EXPR;                                                         \
    } while (0)

void og_store_f32(void *p, int dt, int64_t off, const float *src, int64_t n) {
    switch (dt) {
    case NPUC_F32:
        if ((float *)p + off != src) memcpy((float *)p + off, src, (size_t)n * sizeof(float));
        break;
    case NPUC_BF16: STORE_LOOP(uint16_t, rt_f32_to_bf16(src[i])); break;
    case NPUC_F16: STORE_LOOP(uint16_t, rt_f32_to_f16(src[i])); break;
    case NPUC_F64: STORE_LOOP(double, (double)src[i]); break;
    case NPUC_BOOL: STORE_LOOP(uint8_t, src[i] != 0.0f); break;
    case NPUC_I64: STORE_LOOP(int64_t, og_f2i(src[i], NPUC_I64)); break;
    case NPUC_I32: STORE_LOOP(int32_t, (int32_t)og_f2i(src[i], NPUC_I32)); break;
    case NPUC_I16: STORE_LOOP(int16_t, (int16_t)og_f2i(src[i], NPUC_I16)); break;
    case NPUC_I8: STORE_LOOP(int8_t, (int8_t)og_f2i(src[i], NPUC_I8)); break;
    case NPUC_U8: STORE_LOOP(uint8_t, (uint8_t)og_f2i(src[i], NPUC_U8)); break;
    default: break;
    }
}

/* Integers keep their low bits (two's complement wrap-around, as torch's integer math). */
void og_store_i64(void *p, int dt, int64_t off, const int64_t *src, int64_t n) {
    switch (dt) {
    case NPUC_I64:
        if ((int64_t *)p + off != src) memcpy((int64_t *)p + off, src, (size_t)n * sizeof(int64_t));
        break;
    case NPUC_I32: STORE_LOOP(int32_t, (int32_t)(uint32_t)(uint64_t)src[i]); break;
    case NPUC_I16: STORE_LOOP(int16_t, (int16_t)(uint16_t)(uint64_t)src[i]); break;
    case NPUC_I8: STORE_LOOP(int8_t, (int8_t)(uint8_t)(uint64_t)src[i]); break;
    case NPUC_U8: STORE_LOOP(uint8_t, (uint8_t)(uint64_t)src[i]); break;
    case NPUC_BOOL: STORE_LOOP(uint8_t, src[i] != 0); break;
    case NPUC_F32: STORE_LOOP(float, (float)src[i]); break;
    case NPUC_BF16: STORE_LOOP(uint16_t, rt_f32_to_bf16((float)src[i])); break;
    case NPUC_F16: STORE_LOOP(uint16_t, rt_f32_to_f16((float)src[i])); break;
    case NPUC_F64: STORE_LOOP(double, (double)src[i]); break;
    default: break;
    }
}

int64_t og_f2i(double v, int dt) {
    if (dt == NPUC_I64) {
        if (!(v >= -9223372036854775808.0 && v < 9223372036854775808.0)) return INT64_MIN;
        return (int64_t)v;
    }
    if (!(v > -2147483649.0 && v < 2147483648.0)) return INT32_MIN;
    return (int32_t)v;
}

/* ---- parallel-for ------------------------------------------------------------------------ */

typedef struct {
    og_range_fn fn;
    const void *ctx;
    int64_t total, per;
} range_job;

static void range_chunk(const void *p, i64 c, int tid) {
    const range_job *j = p;
    int64_t lo = c * j->per, hi = og_min64(lo + j->per, j->total);
    if (lo < hi) j->fn(j->ctx, lo, hi, tid);
}

void og_parallel(og_range_fn fn, const void *ctx, int64_t total, int64_t grain, int nt) {
    if (total <= 0) return;
    if (grain < 1) grain = 1;
    int64_t chunks = total / grain;
    if (nt < 1) nt = 1;
    if (chunks > 4 * (int64_t)nt) chunks = 4 * (int64_t)nt;
    if (nt == 1 || chunks <= 1) {
        fn(ctx, 0, total, 0);
        return;
    }
    range_job j = {fn, ctx, total, (total + chunks - 1) / chunks};
    npuc_parallel(range_chunk, &j, (total + j.per - 1) / j.per, nt);
}

/* ---- the strided copy -------------------------------------------------------------------- */

/* st->i: [0] rank, [1] element bytes, [2] source offset (elements), [3..10] shape, [11..18] strides */
void og_copy_plan(rt_step *st, int64_t es, int32_t rank, const int64_t *shape, const int64_t *strides,
                  int64_t base) {
    int64_t sh[NPUC_MAX_RANK], sd[NPUC_MAX_RANK];
    int32_t r = 0;
    for (int32_t d = 0; d < rank; d++) {
        if (shape[d] == 1) continue;
        if (r > 0 && sd[r - 1] == strides[d] * shape[d]) { /* merge into the previous dim */
            sh[r - 1] *= shape[d];
            sd[r - 1] = strides[d];
            continue;
        }
        sh[r] = shape[d];
        sd[r] = strides[d];
        r++;
    }
    for (int32_t d = 0; d < rank; d++)
        if (shape[d] == 0) { /* nothing to copy */
            r = 1;
            sh[0] = 0;
            sd[0] = 1;
        }
    if (r == 0) {
        r = 1;
        sh[0] = 1;
        sd[0] = 1;
    }
    st->i[0] = r;
    st->i[1] = es;
    st->i[2] = base;
    for (int32_t d = 0; d < r; d++) {
        st->i[3 + d] = sh[d];
        st->i[11 + d] = sd[d];
    }
}

typedef struct {
    const char *src;
    char *dst;
    int64_t es;
    int32_t r;
    const int64_t *shape, *st;
} copy_job;

static void copy_rows(const void *p, int64_t lo, int64_t hi, int tid) {
    (void)tid;
    const copy_job *j = p;
    int32_t r = j->r;
    int64_t inner = j->shape[r - 1], is = j->st[r - 1], es = j->es;
    int64_t idx[NPUC_MAX_RANK] = {0}, off = 0, rem = lo;
    for (int32_t d = r - 2; d >= 0; d--) {
        idx[d] = rem % j->shape[d];
        rem /= j->shape[d];
        off += idx[d] * j->st[d];
    }
    for (int64_t row = lo; row < hi; row++) {
        const char *from = j->src + off * es;
        char *to = j->dst + row * inner * es;
        if (is == 1) memcpy(to, from, (size_t)(inner * es));
        else if (es == 4)
            for (int64_t k = 0; k < inner; k++) memcpy(to + 4 * k, from + 4 * k * is, 4);
        else if (es == 2)
            for (int64_t k = 0; k < inner; k++) memcpy(to + 2 * k, from + 2 * k * is, 2);
        else
            for (int64_t k = 0; k < inner; k++) memcpy(to + k * es, from + k * is * es, (size_t)es);
        for (int32_t d = r - 2; d >= 0; d--) { /* the next row: an odometer */
            off += j->st[d];
            if (++idx[d] < j->shape[d]) break;
            off -= idx[d] * j->st[d];
            idx[d] = 0;
        }
    }
}

int og_copy_run(const rt_step *st, struct npuc_session *s) {
    int32_t r = (int32_t)st->i[0];
    const int64_t *shape = &st->i[3];
    int64_t rows = 1;
    for (int32_t d = 0; d < r - 1; d++) rows *= shape[d];
    if (rows == 0 || shape[r - 1] == 0) return 0;
    copy_job j = {(const char *)st->in[0].data + st->i[2] * st->i[1], st->out[0].data, st->i[1], r, shape, &st->i[11]};
    int64_t grain = (32768 / (shape[r - 1] * st->i[1])) + 1;
    og_parallel(copy_rows, &j, rows, grain, rt_session_threads(s));
    return 0;
}
