/* Data movement and sources: reshape, transpose, slice, slice_scatter, pad, concat, split,
 * expand, gather, gather_elements, gather_nd, index, scatter_elements, scatter_nd, full,
 * arange, trilu.
 *
 * These move bytes and never look at values, so they take every dtype (elements of 1, 2, 4
 * or 8 bytes), except where a value addresses memory: the indices of the gathers, index and
 * the scatters, checked before they are used (negative ones count from the end, as torch's;
 * one out of range fails the run with NPUC_E_KERNEL; scatter_nd's wrap, as its reference's),
 * and the scatters' reductions, computed as the elementwise ops are. transpose, expand and slice are one
 * strided copy (ops_generic.c); a view the planner placed on its operand's bytes (reshape,
 * a transpose that moves only size-1 axes, a prefix slice: st->out_is_in0) has no run.
 */
#include <math.h>
#include <string.h>

#include "ops_generic.h"

/* Row-major element strides of a shape. */
static void contiguous(int32_t rank, const int64_t *shape, int64_t *strides) {
    int64_t acc = 1;
    for (int32_t d = rank - 1; d >= 0; d--) {
        strides[d] = acc;
        acc *= shape[d];
    }
}

static int64_t prod(const int64_t *shape, int32_t from, int32_t to) {
    int64_t p = 1;
    for (int32_t d = from; d < to; d++) p *= shape[d];
    return p;
}

static int copy_bytes_run(const rt_step *st, struct npuc_session *s) {
    (void)s;
    if (st->out[0].data != st->in[0].data) memcpy(st->out[0].data, st->in[0].data, st->out[0].nbytes);
    return 0;
}

/* ---- reshape, transpose, expand, slice ----------------------------------------------------- */

static int bind_reshape(rt_binder *b, rt_step *st) {
    int rc;
    const int64_t *shape;
    int32_t n;
    if ((rc = og_check_arity(b, st, 1, 1, 1)) || (rc = og_attr_ints(b, st, "shape", &shape, &n))) return rc;
    int64_t numel = 1;
    for (int32_t d = 0; d < n; d++) {
        if (shape[d] < 0 || (shape[d] && numel > INT64_MAX / shape[d]))
            return og_invalid(b, st, "cannot reshape to that shape");
        numel *= shape[d];
    }
    if (n > NPUC_MAX_RANK || numel != st->in[0].numel) return og_invalid(b, st, "cannot reshape to that shape");
    if ((rc = og_check_out(b, st, 0, st->in[0].dtype, n, shape))) return rc;
    if (!b->dry) st->run = st->out_is_in0 ? NULL : copy_bytes_run;
    return 0;
}

static int bind_transpose(rt_binder *b, rt_step *st) {
    int rc;
    const int64_t *perm;
    int32_t n;
    if ((rc = og_check_arity(b, st, 1, 1, 1)) || (rc = og_attr_ints(b, st, "perm", &perm, &n))) return rc;
    const rt_view *x = &st->in[0];
    int seen[NPUC_MAX_RANK] = {0};
    if (n != x->rank) return og_invalid(b, st, "perm is not a permutation of rank %d", x->rank);
    for (int32_t d = 0; d < n; d++) {
        if (perm[d] < 0 || perm[d] >= n || seen[perm[d]]++)
            return og_invalid(b, st, "perm is not a permutation of rank %d", x->rank);
    }
    int64_t shape[NPUC_MAX_RANK], cs[NPUC_MAX_RANK], sd[NPUC_MAX_RANK];
    contiguous(x->rank, x->shape, cs);
    int64_t last = -1;
    int moves = 0; /* whether an axis of size > 1 changes place: then it is no view */
    for (int32_t d = 0; d < n; d++) {
        shape[d] = x->shape[perm[d]];
        sd[d] = cs[perm[d]];
        if (shape[d] != 1) {
            if (perm[d] < last) moves = 1;
            last = perm[d];
        }
    }
    if ((rc = og_check_out(b, st, 0, x->dtype, n, shape))) return rc;
    if (st->out_is_in0 && moves) return og_invalid(b, st, "planned as a view, but it moves data");
    if (b->dry || st->out_is_in0) return 0;
    og_copy_plan(st, npuc_dtype_size(x->dtype), n, shape, sd, 0);
    st->run = og_copy_run;
    return 0;
}

static int bind_expand(rt_binder *b, rt_step *st) {
    int rc;
    const int64_t *shape;
    int32_t n;
    if ((rc = og_check_arity(b, st, 1, 1, 1)) || (rc = og_attr_ints(b, st, "shape", &shape, &n))) return rc;
    const rt_view *x = &st->in[0];
    if (n < x->rank || n > NPUC_MAX_RANK) return og_invalid(b, st, "cannot expand to that shape");
    int64_t cs[NPUC_MAX_RANK], sd[NPUC_MAX_RANK];
    contiguous(x->rank, x->shape, cs);
    for (int32_t d = 0; d < n; d++) {
        int32_t j = d - (n - x->rank);
        if (shape[d] < 0 || (j >= 0 && x->shape[j] != shape[d] && x->shape[j] != 1))
            return og_invalid(b, st, "cannot expand to that shape");
        sd[d] = (j < 0 || x->shape[j] != shape[d]) ? 0 : cs[j];
    }
    if ((rc = og_check_out(b, st, 0, x->dtype, n, shape))) return rc;
    if (b->dry) return 0;
    og_copy_plan(st, npuc_dtype_size(x->dtype), n, shape, sd, 0);
    st->run = og_copy_run;
    return 0;
}

/* Python's range(dim)[start:end:step] for step >= 1: its first index and length. */
static void slice_range(int64_t dim, int64_t start, int64_t end, int64_t step, int64_t *first, int64_t *len) {
    if (start < 0) start = start + dim < 0 ? 0 : start + dim;
    else if (start > dim) start = dim;
    if (end < 0) end = end + dim < 0 ? 0 : end + dim;
    else if (end > dim) end = dim;
    *first = start;
    *len = end > start ? (end - start - 1) / step + 1 : 0;
}

typedef struct {
    int32_t ax;
    int64_t first, len, step;
} slice_args;

static int slice_check(rt_binder *b, rt_step *st, const rt_view *x, slice_args *a) {
    int rc;
    int64_t axis, start, end;
    if ((rc = og_attr_int(b, st, "axis", 0, 0, &axis)) || (rc = og_attr_int(b, st, "start", 1, 0, &start)) ||
        (rc = og_attr_int(b, st, "end", 0, 0, &end)) || (rc = og_attr_int(b, st, "step", 1, 1, &a->step)))
        return rc;
    if ((rc = og_norm_axis(b, st, axis, x->rank, &a->ax))) return rc;
    if (x->rank == 0) return og_no_kernel(b, st, "no kernel for a slice of a scalar");
    if (a->step < 1) return og_invalid(b, st, "slice step must be positive");
    slice_range(x->shape[a->ax], start, end, a->step, &a->first, &a->len);
    return 0;
}

static int bind_slice(rt_binder *b, rt_step *st) {
    int rc;
    slice_args a;
    if ((rc = og_check_arity(b, st, 1, 1, 1))) return rc;
    const rt_view *x = &st->in[0];
    if ((rc = slice_check(b, st, x, &a))) return rc;
    int64_t shape[NPUC_MAX_RANK], cs[NPUC_MAX_RANK];
    memcpy(shape, x->shape, sizeof shape);
    shape[a.ax] = a.len;
    if ((rc = og_check_out(b, st, 0, x->dtype, x->rank, shape))) return rc;
    if (st->out_is_in0 && (prod(x->shape, 0, a.ax) != 1 || (a.len > 1 && a.step != 1) || (a.len && a.first)))
        return og_invalid(b, st, "planned as a view, but it is no prefix of its operand");
    if (b->dry || st->out_is_in0) return 0;
    contiguous(x->rank, x->shape, cs);
    int64_t base = a.first * cs[a.ax];
    cs[a.ax] *= a.step;
    og_copy_plan(st, npuc_dtype_size(x->dtype), x->rank, shape, cs, base);
    st->run = og_copy_run;
    return 0;
}

/* slice_scatter: out = x, with src written over x[..., first::step (len), ...].
 * st->i: [0] outer, [1] axis dim, [2] inner bytes, [3] first, [4] len, [5] step */
static int slice_scatter_run(const rt_step *st, struct npuc_session *s) {
    (void)s;
    char *out = st->out[0].data;
    const char *src = st->in[1].data;
    if (st->out[0].data != st->in[0].data) memcpy(out, st->in[0].data, st->out[0].nbytes);
    int64_t outer = st->i[0], dim = st->i[1], inner = st->i[2], first = st->i[3], len = st->i[4], step = st->i[5];
    for (int64_t o = 0; o < outer; o++)
        for (int64_t k = 0; k < len; k++)
            memcpy(out + (o * dim + first + k * step) * inner, src + (o * len + k) * inner, (size_t)inner);
    return 0;
}

static int bind_slice_scatter(rt_binder *b, rt_step *st) {
    int rc;
    slice_args a;
    if ((rc = og_check_arity(b, st, 2, 2, 1))) return rc;
    const rt_view *x = &st->in[0], *src = &st->in[1];
    if ((rc = slice_check(b, st, x, &a))) return rc;
    int same = src->dtype == x->dtype && src->rank == x->rank;
    for (int32_t d = 0; same && d < x->rank; d++) same = src->shape[d] == (d == a.ax ? a.len : x->shape[d]);
    if (!same) return og_invalid(b, st, "slice_scatter source does not fit the slice");
    if ((rc = og_check_out(b, st, 0, x->dtype, x->rank, x->shape))) return rc;
    if (b->dry) return 0;
    st->i[0] = prod(x->shape, 0, a.ax);
    st->i[1] = x->shape[a.ax];
    st->i[2] = prod(x->shape, a.ax + 1, x->rank) * npuc_dtype_size(x->dtype);
    st->i[3] = a.first;
    st->i[4] = a.len;
    st->i[5] = a.step;
    st->run = slice_scatter_run;
    return 0;
}

/* ---- concat, split ----------------------------------------------------------------------- */

/* Both: outer rows of the big tensor, each the pieces' rows end to end.
 * st->i: [0] outer, [1] the big row's bytes, [2 + k] piece k's row bytes */
typedef struct {
    const rt_step *st;
    int split;
} cat_job;

static void cat_rows(const void *p, int64_t lo, int64_t hi, int tid) {
    (void)tid;
    const cat_job *j = p;
    const rt_step *st = j->st;
    int n = j->split ? st->n_out : st->n_in;
    int64_t row = st->i[1];
    for (int64_t o = lo; o < hi; o++) {
        int64_t at = o * row;
        for (int k = 0; k < n; k++) {
            int64_t len = st->i[2 + k];
            if (j->split) memcpy((char *)st->out[k].data + o * len, (const char *)st->in[0].data + at, (size_t)len);
            else memcpy((char *)st->out[0].data + at, (const char *)st->in[k].data + o * len, (size_t)len);
            at += len;
        }
    }
}

static int cat_run(const rt_step *st, struct npuc_session *s) {
    cat_job j = {st, strcmp(st->op->op, "split") == 0};
    og_parallel(cat_rows, &j, st->i[0], 65536 / (st->i[1] + 1) + 1, rt_session_threads(s));
    return 0;
}

static int bind_concat(rt_binder *b, rt_step *st) {
    int rc;
    int64_t axis;
    int32_t ax;
    if ((rc = og_check_arity(b, st, 1, RT_MAX_OPERANDS, 1)) || (rc = og_attr_int(b, st, "axis", 0, 0, &axis)))
        return rc;
    const rt_view *x = &st->in[0];
    if ((rc = og_norm_axis(b, st, axis, x->rank, &ax))) return rc;
    if (x->rank == 0) return og_invalid(b, st, "concat of scalars");
    int64_t shape[NPUC_MAX_RANK];
    memcpy(shape, x->shape, sizeof shape);
    shape[ax] = 0;
    for (int k = 0; k < st->n_in; k++) {
        const rt_view *v = &st->in[k];
        int fits = v->dtype == x->dtype && v->rank == x->rank;
        for (int32_t d = 0; fits && d < x->rank; d++) fits = d == ax || v->shape[d] == x->shape[d];
        if (!fits) return og_invalid(b, st, "concat operands disagree off axis %d", ax);
        shape[ax] += v->shape[ax];
    }
    if ((rc = og_check_out(b, st, 0, x->dtype, x->rank, shape))) return rc;
    if (b->dry) return 0;
    int64_t inner = prod(shape, ax + 1, x->rank) * npuc_dtype_size(x->dtype);
    st->i[0] = prod(shape, 0, ax);
    st->i[1] = shape[ax] * inner;
    for (int k = 0; k < st->n_in; k++) st->i[2 + k] = st->in[k].shape[ax] * inner;
    st->run = cat_run;
    return 0;
}

static int bind_split(rt_binder *b, rt_step *st) {
    int rc;
    int64_t axis;
    int32_t ax, n;
    const int64_t *sizes;
    if ((rc = og_attr_ints(b, st, "sizes", &sizes, &n)) || (rc = og_attr_int(b, st, "axis", 0, 0, &axis))) return rc;
    if (n < 1 || n > 4) return og_no_kernel(b, st, "no kernel for a split into %d pieces", n);
    if ((rc = og_check_arity(b, st, 1, 1, n))) return rc;
    const rt_view *x = &st->in[0];
    if ((rc = og_norm_axis(b, st, axis, x->rank, &ax))) return rc;
    if (x->rank == 0) return og_invalid(b, st, "split of a scalar");
    int64_t sum = 0, shape[NPUC_MAX_RANK];
    for (int32_t k = 0; k < n; k++) {
        if (sizes[k] < 0 || sizes[k] > x->shape[ax]) return og_invalid(b, st, "split sizes do not fit");
        sum += sizes[k];
    }
    if (sum != x->shape[ax]) return og_invalid(b, st, "split sizes do not add up to %lld", (long long)x->shape[ax]);
    memcpy(shape, x->shape, sizeof shape);
    for (int32_t k = 0; k < n; k++) {
        shape[ax] = sizes[k];
        if ((rc = og_check_out(b, st, k, x->dtype, x->rank, shape))) return rc;
    }
    if (b->dry) return 0;
    int64_t inner = prod(x->shape, ax + 1, x->rank) * npuc_dtype_size(x->dtype);
    st->i[0] = prod(x->shape, 0, ax);
    st->i[1] = x->shape[ax] * inner;
    for (int32_t k = 0; k < n; k++) st->i[2 + k] = sizes[k] * inner;
    st->run = cat_run;
    return 0;
}

/* ---- pad --------------------------------------------------------------------------------- */

enum { PAD_CONSTANT, PAD_REFLECT, PAD_EDGE, PAD_WRAP };

typedef struct pad_plan {
    int mode;
    int32_t r;
    int64_t es;
    int64_t in_shape[NPUC_MAX_RANK], out_shape[NPUC_MAX_RANK], in_st[NPUC_MAX_RANK];
    int64_t lo[NPUC_MAX_RANK];   /* first kept source index (after cropping) */
    int64_t kept[NPUC_MAX_RANK]; /* source indices kept */
    int64_t grow[NPUC_MAX_RANK]; /* output positions before the first kept one */
} pad_plan;

/* The source index of output position i on axis d, or -1 for the constant. */
static int64_t pad_src(const pad_plan *p, int32_t d, int64_t i) {
    int64_t j = i - p->grow[d], n = p->kept[d];
    if (p->mode == PAD_CONSTANT) return j >= 0 && j < n ? p->lo[d] + j : -1;
    if (p->mode == PAD_EDGE) return p->lo[d] + (j < 0 ? 0 : j >= n ? n - 1 : j);
    if (p->mode == PAD_WRAP) return p->lo[d] + ((j % n) + n) % n;
    if (n == 1) return p->lo[d];
    int64_t m = ((j % (2 * n - 2)) + 2 * n - 2) % (2 * n - 2);
    return p->lo[d] + (m >= n ? 2 * n - 2 - m : m);
}

typedef struct {
    const pad_plan *p;
    const char *x;
    char *out;
    char fill[8];
} pad_job;

static void pad_rows(const void *pj, int64_t lo, int64_t hi, int tid) {
    (void)tid;
    const pad_job *j = pj;
    const pad_plan *p = j->p;
    int32_t r = p->r;
    int64_t es = p->es, w = p->out_shape[r - 1];
    for (int64_t row = lo; row < hi; row++) {
        char *to = j->out + row * w * es;
        int64_t rem = row, src = 0;
        int fill = 0;
        for (int32_t d = r - 2; d >= 0; d--) {
            int64_t s = pad_src(p, d, rem % p->out_shape[d]);
            rem /= p->out_shape[d];
            if (s < 0) fill = 1;
            src += s * p->in_st[d];
        }
        for (int64_t c = 0; c < w; c++) {
            int64_t s = fill ? -1 : pad_src(p, r - 1, c);
            memcpy(to + c * es, s < 0 ? j->fill : j->x + (src + s) * es, (size_t)es);
        }
    }
}

static int pad_run(const rt_step *st, struct npuc_session *s) {
    const pad_plan *p = st->p[0];
    pad_job j = {p, st->in[0].data, st->out[0].data, {0}};
    if (st->n_in > 1) memcpy(j.fill, st->in[1].data, (size_t)p->es);
    int64_t rows = prod(p->out_shape, 0, p->r - 1);
    if (rows == 0 || p->out_shape[p->r - 1] == 0) return 0;
    og_parallel(pad_rows, &j, rows, 16384 / (p->out_shape[p->r - 1] * p->es + 1) + 1, rt_session_threads(s));
    return 0;
}

static int bind_pad(rt_binder *b, rt_step *st) {
    int rc;
    const int64_t *pads;
    int32_t n;
    const char *mode;
    if ((rc = og_check_arity(b, st, 1, 2, 1)) || (rc = og_attr_ints(b, st, "pads", &pads, &n)) ||
        (rc = og_attr_str(b, st, "mode", "constant", &mode)))
        return rc;
    const rt_view *x = &st->in[0];
    pad_plan p = {0};
    static const char *const modes[] = {"constant", "reflect", "edge", "wrap"};
    p.mode = -1;
    for (int m = 0; m < 4; m++)
        if (strcmp(mode, modes[m]) == 0) p.mode = m;
    int32_t r = x->rank;
    if (n != 2 * r || p.mode < 0) return og_invalid(b, st, "pad needs 2*rank pads and a known mode");
    if (st->n_in > 1 && (st->in[1].numel != 1 || st->in[1].dtype != x->dtype))
        return og_invalid(b, st, "pad value must be one %s element", npuc_dtype_name(x->dtype));
    for (int32_t d = 0; d < r; d++) {
        int64_t pb = pads[d], pe = pads[d + r], dim = x->shape[d];
        int64_t cb = pb < 0 ? pb : 0, ce = pe < 0 ? pe : 0, out;
        if (__builtin_add_overflow(dim, pb, &out) || __builtin_add_overflow(out, pe, &out) ||
            __builtin_add_overflow(dim, cb, &p.kept[d]) || __builtin_add_overflow(p.kept[d], ce, &p.kept[d]))
            return og_invalid(b, st, "pads do not fit the operand");
        if (p.kept[d] < 0 || (p.mode != PAD_CONSTANT && p.kept[d] == 0 && out > 0))
            return og_invalid(b, st, "pads do not fit the operand");
        p.lo[d] = -cb;
        p.grow[d] = pb > 0 ? pb : 0;
        p.out_shape[d] = out;
    }
    if ((rc = og_check_out(b, st, 0, x->dtype, r, p.out_shape))) return rc;
    if (b->dry) return 0;
    if (r == 0) { /* a scalar: nothing to pad */
        st->run = copy_bytes_run;
        return 0;
    }
    p.r = r;
    p.es = npuc_dtype_size(x->dtype);
    memcpy(p.in_shape, x->shape, sizeof p.in_shape);
    contiguous(r, x->shape, p.in_st);
    pad_plan *pp = og_alloc(b, st, sizeof *pp);
    if (!pp) return NPUC_E_ARG;
    *pp = p;
    st->p[0] = pp;
    st->run = pad_run;
    return 0;
}

/* ---- gather, gather_elements, index ------------------------------------------------------ */

static inline int64_t load_index(const void *p, int dt, int64_t i) {
    return dt == NPUC_I64 ? ((const int64_t *)p)[i] : ((const int32_t *)p)[i];
}

/* Every index of an index tensor in [-dim, dim): NPUC_E_KERNEL otherwise. */
static int check_indices(const rt_view *idx, int64_t dim) {
    for (int64_t i = 0; i < idx->numel; i++) {
        int64_t v = load_index(idx->data, idx->dtype, i);
        if (v < -dim || v >= dim) return NPUC_E_KERNEL;
    }
    return 0;
}

/* gather: out[o, j, :] = x[o, idx[j], :]. st->i: [0] outer, [1] axis dim, [2] inner bytes */
typedef struct {
    const rt_step *st;
} gather_job;

static void gather_rows(const void *p, int64_t lo, int64_t hi, int tid) {
    (void)tid;
    const rt_step *st = ((const gather_job *)p)->st;
    const rt_view *idx = &st->in[1];
    int64_t n = idx->numel, dim = st->i[1], inner = st->i[2];
    for (int64_t row = lo; row < hi; row++) {
        int64_t o = row / n, v = load_index(idx->data, idx->dtype, row % n);
        if (v < 0) v += dim;
        memcpy((char *)st->out[0].data + row * inner, (const char *)st->in[0].data + (o * dim + v) * inner,
               (size_t)inner);
    }
}

static int gather_run(const rt_step *st, struct npuc_session *s) {
    if (check_indices(&st->in[1], st->i[1])) return NPUC_E_KERNEL;
    gather_job j = {st};
    og_parallel(gather_rows, &j, st->i[0] * st->in[1].numel, 16384 / (st->i[2] + 1) + 1, rt_session_threads(s));
    return 0;
}

static int index_dtype_ok(int dt) { return dt == NPUC_I64 || dt == NPUC_I32; }

static int bind_gather(rt_binder *b, rt_step *st) {
    int rc;
    int64_t axis;
    int32_t ax;
    if ((rc = og_check_arity(b, st, 2, 2, 1)) || (rc = og_attr_int(b, st, "axis", 1, 0, &axis))) return rc;
    const rt_view *x = &st->in[0], *idx = &st->in[1];
    if (!index_dtype_ok(idx->dtype)) return og_invalid(b, st, "gather indices must be i64 or i32");
    if ((rc = og_norm_axis(b, st, axis, x->rank, &ax))) return rc;
    if (x->rank == 0) return og_no_kernel(b, st, "no kernel for a gather from a scalar");
    int32_t r = x->rank - 1 + idx->rank;
    if (r > NPUC_MAX_RANK) return og_invalid(b, st, "gather's output has rank %d", r);
    int64_t shape[NPUC_MAX_RANK];
    for (int32_t d = 0; d < ax; d++) shape[d] = x->shape[d];
    for (int32_t d = 0; d < idx->rank; d++) shape[ax + d] = idx->shape[d];
    for (int32_t d = ax + 1; d < x->rank; d++) shape[idx->rank + d - 1] = x->shape[d];
    if ((rc = og_check_out(b, st, 0, x->dtype, r, shape))) return rc;
    if (b->dry) return 0;
    st->i[0] = prod(x->shape, 0, ax);
    st->i[1] = x->shape[ax];
    st->i[2] = prod(x->shape, ax + 1, x->rank) * npuc_dtype_size(x->dtype);
    st->run = gather_run;
    return 0;
}

/* gather_elements: out[p] = x[p with its axis coordinate replaced by idx[p]] */
static int gather_elements_run(const rt_step *st, struct npuc_session *s) {
    (void)s;
    const rt_view *x = &st->in[0], *idx = &st->in[1];
    int32_t r = x->rank, ax = (int32_t)st->i[0];
    int64_t es = npuc_dtype_size(x->dtype), cs[NPUC_MAX_RANK], c[NPUC_MAX_RANK] = {0};
    if (check_indices(idx, x->shape[ax])) return NPUC_E_KERNEL;
    contiguous(r, x->shape, cs);
    for (int64_t i = 0; i < idx->numel; i++) {
        int64_t v = load_index(idx->data, idx->dtype, i), off = 0;
        if (v < 0) v += x->shape[ax];
        for (int32_t d = 0; d < r; d++) off += (d == ax ? v : c[d]) * cs[d];
        memcpy((char *)st->out[0].data + i * es, (const char *)x->data + off * es, (size_t)es);
        for (int32_t d = r - 1; d >= 0 && ++c[d] == idx->shape[d]; d--) c[d] = 0;
    }
    return 0;
}

static int bind_gather_elements(rt_binder *b, rt_step *st) {
    int rc;
    int64_t axis;
    int32_t ax;
    if ((rc = og_check_arity(b, st, 2, 2, 1)) || (rc = og_attr_int(b, st, "axis", 1, 0, &axis))) return rc;
    const rt_view *x = &st->in[0], *idx = &st->in[1];
    if ((rc = og_norm_axis(b, st, axis, x->rank, &ax))) return rc;
    int fits = index_dtype_ok(idx->dtype) && idx->rank == x->rank;
    for (int32_t d = 0; fits && d < x->rank; d++) fits = d == ax || idx->shape[d] <= x->shape[d];
    if (!fits) return og_invalid(b, st, "gather_elements indices do not fit the data on axis %d", ax);
    if (x->rank == 0) return og_no_kernel(b, st, "no kernel for gather_elements of a scalar");
    if ((rc = og_check_out(b, st, 0, x->dtype, idx->rank, idx->shape))) return rc;
    if (b->dry) return 0;
    st->i[0] = ax;
    st->run = gather_elements_run;
    return 0;
}

/* index: out[p, :] = x[i0[p], i1[p], ..., :] over the broadcast positions p of the k index
 * tensors. st->i: [0] k, [1] rank of the positions, [2..9] their shape, [10] row bytes */
static int index_run(const rt_step *st, struct npuc_session *s) {
    (void)s;
    const rt_view *x = &st->in[0];
    int32_t k = (int32_t)st->i[0], br = (int32_t)st->i[1];
    const int64_t *bshape = &st->i[2];
    int64_t row = st->i[10], cs[NPUC_MAX_RANK], ist[RT_MAX_OPERANDS][NPUC_MAX_RANK];
    for (int32_t j = 0; j < k; j++)
        if (check_indices(&st->in[1 + j], x->shape[j])) return NPUC_E_KERNEL;
    contiguous(k, x->shape, cs);
    for (int32_t j = 0; j < k; j++) { /* index tensor j's strides over the positions (0: broadcast) */
        const rt_view *t = &st->in[1 + j];
        int64_t acc = 1;
        for (int32_t d = br - 1; d >= 0; d--) {
            int32_t jd = d - (br - t->rank);
            ist[j][d] = (jd < 0 || t->shape[jd] == 1) ? 0 : acc;
            if (jd >= 0) acc *= t->shape[jd];
        }
    }
    int64_t n = prod(bshape, 0, br), c[NPUC_MAX_RANK] = {0};
    for (int64_t p = 0; p < n; p++) {
        int64_t off = 0;
        for (int32_t j = 0; j < k; j++) {
            int64_t at = 0;
            for (int32_t d = 0; d < br; d++) at += c[d] * ist[j][d];
            int64_t v = load_index(st->in[1 + j].data, st->in[1 + j].dtype, at);
            off += (v < 0 ? v + x->shape[j] : v) * cs[j];
        }
        memcpy((char *)st->out[0].data + p * row, (const char *)x->data + off * row, (size_t)row);
        for (int32_t d = br - 1; d >= 0 && ++c[d] == bshape[d]; d--) c[d] = 0;
    }
    return 0;
}

static int bind_index(rt_binder *b, rt_step *st) {
    int rc;
    if ((rc = og_check_arity(b, st, 2, RT_MAX_OPERANDS, 1))) return rc;
    const rt_view *x = &st->in[0];
    int32_t k = st->n_in - 1, br;
    if (k > x->rank) return og_invalid(b, st, "index takes 1..%d index tensors", x->rank);
    const rt_view *vs[RT_MAX_OPERANDS];
    for (int32_t j = 0; j < k; j++) {
        vs[j] = &st->in[1 + j];
        if (!index_dtype_ok(vs[j]->dtype)) return og_invalid(b, st, "index tensors must be i64 or i32");
    }
    int64_t shape[NPUC_MAX_RANK];
    if ((rc = og_broadcast(b, st, vs, k, &br, shape))) return rc;
    int32_t r = br + x->rank - k;
    if (r > NPUC_MAX_RANK) return og_invalid(b, st, "index's output has rank %d", r);
    int64_t out[NPUC_MAX_RANK];
    memcpy(out, shape, sizeof(int64_t) * (size_t)br);
    for (int32_t d = k; d < x->rank; d++) out[br + d - k] = x->shape[d];
    if ((rc = og_check_out(b, st, 0, x->dtype, r, out))) return rc;
    if (b->dry) return 0;
    st->i[0] = k;
    st->i[1] = br;
    memcpy(&st->i[2], shape, sizeof(int64_t) * (size_t)br);
    st->i[10] = prod(x->shape, k, x->rank) * npuc_dtype_size(x->dtype);
    st->run = index_run;
    return 0;
}

/* ---- gather_nd, scatter_elements, scatter_nd ------------------------------------------------ */

/* gather_nd (ONNX GatherND): the last axis of `indices` (k long) addresses axes b..b+k-1 of
 * `data` within batch n (the first b axes, shared). st->i: [0] batches, [1] rows per batch,
 * [2] k, [3] row bytes, [4] a batch's data elements (in rows), [5..5+k) the addressed dims */
static int gather_nd_run(const rt_step *st, struct npuc_session *s) {
    (void)s;
    const rt_view *idx = &st->in[1];
    int64_t nb = st->i[0], rows = st->i[1], k = st->i[2], row = st->i[3], block = st->i[4];
    const int64_t *dims = &st->i[5];
    for (int64_t n = 0; n < nb; n++)
        for (int64_t j = 0; j < rows; j++) {
            int64_t at = 0;
            for (int64_t d = 0; d < k; d++) {
                int64_t v = load_index(idx->data, idx->dtype, (n * rows + j) * k + d);
                if (v < -dims[d] || v >= dims[d]) return NPUC_E_KERNEL;
                at = at * dims[d] + (v < 0 ? v + dims[d] : v);
            }
            const char *from = (const char *)st->in[0].data + (n * block + at) * row;
            memcpy((char *)st->out[0].data + (n * rows + j) * row, from, (size_t)row);
        }
    return 0;
}

static int bind_gather_nd(rt_binder *b, rt_step *st) {
    int rc;
    int64_t bd;
    if ((rc = og_check_arity(b, st, 2, 2, 1)) || (rc = og_attr_int(b, st, "batch_dims", 1, 0, &bd))) return rc;
    const rt_view *x = &st->in[0], *idx = &st->in[1];
    if (!index_dtype_ok(idx->dtype) || idx->rank < 1) return og_invalid(b, st, "gather_nd indices must be i64/i32");
    int64_t k = idx->shape[idx->rank - 1];
    int fits = bd >= 0 && bd < idx->rank && bd + k <= x->rank;
    for (int32_t d = 0; fits && d < bd; d++) fits = x->shape[d] == idx->shape[d];
    if (!fits) return og_invalid(b, st, "gather_nd indices do not fit the data");
    int32_t r = idx->rank - 1 + x->rank - (int32_t)(bd + k);
    if (r > NPUC_MAX_RANK) return og_invalid(b, st, "gather_nd's output has rank %d", r);
    int64_t shape[NPUC_MAX_RANK];
    memcpy(shape, idx->shape, sizeof(int64_t) * (size_t)(idx->rank - 1));
    for (int32_t d = (int32_t)(bd + k); d < x->rank; d++) shape[idx->rank - 1 + d - (bd + k)] = x->shape[d];
    if ((rc = og_check_out(b, st, 0, x->dtype, r, shape))) return rc;
    if (k == 0) return og_no_kernel(b, st, "no kernel for gather_nd of empty index tuples");
    if (b->dry) return 0;
    st->i[0] = prod(x->shape, 0, (int32_t)bd);
    st->i[1] = prod(idx->shape, (int32_t)bd, idx->rank - 1);
    st->i[2] = k;
    st->i[3] = prod(x->shape, (int32_t)(bd + k), x->rank) * npuc_dtype_size(x->dtype);
    st->i[4] = prod(x->shape, (int32_t)bd, (int32_t)(bd + k));
    memcpy(&st->i[5], x->shape + bd, sizeof(int64_t) * (size_t)k);
    st->run = gather_nd_run;
    return 0;
}

enum { RED_NONE, RED_ADD, RED_MUL, RED_MAX, RED_MIN };

static int scatter_reduction(rt_binder *b, rt_step *st, int dt, int *red) {
    static const char *const names[] = {"none", "add", "mul", "max", "min"};
    const char *s;
    int rc;
    if ((rc = og_attr_str(b, st, "reduction", "none", &s))) return rc;
    *red = -1;
    for (int k = 0; k < 5; k++)
        if (strcmp(s, names[k]) == 0) *red = k;
    if (*red < 0) return og_invalid(b, st, "unknown reduction '%s'", s);
    if (*red != RED_NONE && !og_is_f32ish(dt) && !og_is_int(dt))
        return og_no_kernel(b, st, "no kernel for a %s reduction of %s", s, npuc_dtype_name(dt));
    return 0;
}

/* dst[0] = dst[0] (op) src[0], one element of dtype dt, as torch's in-place ops: computed in
 * f32 (float storage) or int64 (integers, wrapping), rounded at the store. */
static void combine(char *dst, const char *src, int dt, int red, int64_t es) {
    if (red == RED_NONE) {
        memcpy(dst, src, (size_t)es);
    } else if (og_is_f32ish(dt)) {
        float a, v;
        og_load_f32(dst, dt, 0, 0, 1, &a);
        og_load_f32(src, dt, 0, 0, 1, &v);
        a = red == RED_ADD ? a + v : red == RED_MUL ? a * v : (a != a || v != v) ? a + v
            : red == RED_MAX ? (v > a ? v : a) : (v < a ? v : a);
        og_store_f32(dst, dt, 0, &a, 1);
    } else {
        int64_t a, v;
        og_load_i64(dst, dt, 0, 0, 1, &a);
        og_load_i64(src, dt, 0, 0, 1, &v);
        a = red == RED_ADD   ? (int64_t)((uint64_t)a + (uint64_t)v)
            : red == RED_MUL ? (int64_t)((uint64_t)a * (uint64_t)v)
            : red == RED_MAX ? (v > a ? v : a)
                             : (v < a ? v : a);
        og_store_i64(dst, dt, 0, &a, 1);
    }
}

/* scatter_elements: out = data; out[p with its axis coordinate = idx[p]] (op)= updates[p], in
 * the order of p. st->i: [0] axis, [1] reduction */
static int scatter_elements_run(const rt_step *st, struct npuc_session *s) {
    (void)s;
    const rt_view *x = &st->in[0], *idx = &st->in[1];
    int32_t r = x->rank, ax = (int32_t)st->i[0];
    int64_t es = npuc_dtype_size(x->dtype), cs[NPUC_MAX_RANK], c[NPUC_MAX_RANK] = {0};
    if (check_indices(idx, x->shape[ax])) return NPUC_E_KERNEL;
    if (st->out[0].data != x->data) memcpy(st->out[0].data, x->data, st->out[0].nbytes);
    contiguous(r, x->shape, cs);
    for (int64_t i = 0; i < idx->numel; i++) {
        int64_t v = load_index(idx->data, idx->dtype, i), off = 0;
        if (v < 0) v += x->shape[ax];
        for (int32_t d = 0; d < r; d++) off += (d == ax ? v : c[d]) * cs[d];
        combine((char *)st->out[0].data + off * es, (const char *)st->in[2].data + i * es, x->dtype, (int)st->i[1],
                es);
        for (int32_t d = r - 1; d >= 0 && ++c[d] == idx->shape[d]; d--) c[d] = 0;
    }
    return 0;
}

static int bind_scatter_elements(rt_binder *b, rt_step *st) {
    int rc, red;
    int64_t axis;
    int32_t ax;
    if ((rc = og_check_arity(b, st, 3, 3, 1)) || (rc = og_attr_int(b, st, "axis", 1, 0, &axis))) return rc;
    const rt_view *x = &st->in[0], *idx = &st->in[1], *upd = &st->in[2];
    if ((rc = og_norm_axis(b, st, axis, x->rank, &ax))) return rc;
    int fits = index_dtype_ok(idx->dtype) && idx->rank == x->rank && upd->rank == idx->rank;
    fits = fits && upd->dtype == x->dtype;
    for (int32_t d = 0; fits && d < x->rank; d++)
        fits = (d == ax || idx->shape[d] <= x->shape[d]) && upd->shape[d] == idx->shape[d];
    if (!fits) return og_invalid(b, st, "scatter_elements indices or updates do not fit the data on axis %d", ax);
    if ((rc = scatter_reduction(b, st, x->dtype, &red))) return rc;
    if ((rc = og_check_out(b, st, 0, x->dtype, x->rank, x->shape))) return rc;
    if (x->rank == 0) return og_no_kernel(b, st, "no kernel for scatter_elements into a scalar");
    if (b->dry) return 0;
    st->i[0] = ax;
    st->i[1] = red;
    st->run = scatter_elements_run;
    return 0;
}

/* scatter_nd: out = data; for each index tuple n (in order), out[idx[n] mod shape] (op)=
 * updates[n] (a slice of shape[k:]). Indices wrap as the reference's Python `%` does.
 * st->i: [0] tuples, [1] k, [2] slice elements, [3] reduction, [4..4+k) the addressed dims */
static int scatter_nd_run(const rt_step *st, struct npuc_session *s) {
    (void)s;
    const rt_view *x = &st->in[0], *idx = &st->in[1];
    int64_t n = st->i[0], k = st->i[1], inner = st->i[2], es = npuc_dtype_size(x->dtype);
    const int64_t *dims = &st->i[4];
    char *out = st->out[0].data;
    const char *upd = st->in[2].data;
    if (out != x->data) memcpy(out, x->data, st->out[0].nbytes);
    for (int64_t j = 0; j < n; j++) {
        int64_t at = 0;
        for (int64_t d = 0; d < k; d++) {
            if (dims[d] == 0) return NPUC_E_KERNEL;
            int64_t v = load_index(idx->data, idx->dtype, j * k + d) % dims[d];
            at = at * dims[d] + (v < 0 ? v + dims[d] : v);
        }
        for (int64_t e = 0; e < inner; e++)
            combine(out + (at * inner + e) * es, upd + (j * inner + e) * es, x->dtype, (int)st->i[3], es);
    }
    return 0;
}

static int bind_scatter_nd(rt_binder *b, rt_step *st) {
    int rc, red;
    if ((rc = og_check_arity(b, st, 3, 3, 1))) return rc;
    const rt_view *x = &st->in[0], *idx = &st->in[1], *upd = &st->in[2];
    if (!index_dtype_ok(idx->dtype) || idx->rank < 1 || idx->shape[idx->rank - 1] > x->rank)
        return og_invalid(b, st, "scatter_nd indices do not fit the data");
    int32_t k = (int32_t)idx->shape[idx->rank - 1], want = idx->rank - 1 + x->rank - k;
    int fits = upd->dtype == x->dtype && upd->rank == want;
    for (int32_t d = 0; fits && d < want; d++)
        fits = upd->shape[d] == (d < idx->rank - 1 ? idx->shape[d] : x->shape[k + d - (idx->rank - 1)]);
    if (!fits) return og_invalid(b, st, "scatter_nd updates do not fit the indices and data");
    if ((rc = scatter_reduction(b, st, x->dtype, &red))) return rc;
    if ((rc = og_check_out(b, st, 0, x->dtype, x->rank, x->shape))) return rc;
    if (b->dry) return 0;
    st->i[0] = prod(idx->shape, 0, idx->rank - 1);
    st->i[1] = k;
    st->i[2] = prod(x->shape, k, x->rank);
    st->i[3] = red;
    memcpy(&st->i[4], x->shape, sizeof(int64_t) * (size_t)k);
    st->run = scatter_nd_run;
    return 0;
}

/* ---- sources: full, arange --------------------------------------------------------------- */

/* full: st->i[0] holds the element's bytes. */
static int full_run(const rt_step *st, struct npuc_session *s) {
    (void)s;
    int64_t es = npuc_dtype_size(st->out[0].dtype);
    char *out = st->out[0].data;
    for (int64_t i = 0; i < st->out[0].numel; i++) memcpy(out + i * es, &st->i[0], (size_t)es);
    return 0;
}

static int bind_full(rt_binder *b, rt_step *st) {
    int rc, dt;
    const int64_t *shape;
    int32_t n;
    if ((rc = og_check_arity(b, st, 0, 0, 1)) || (rc = og_attr_ints(b, st, "shape", &shape, &n)) ||
        (rc = og_attr_dtype(b, st, "dtype", &dt)))
        return rc;
    const rt_attr *v = rt_find_attr(st->op, "value");
    if (!v || (v->kind != ATTR_F && v->kind != ATTR_I)) return og_invalid(b, st, "attribute value is not a number");
    if (n > NPUC_MAX_RANK) return og_invalid(b, st, "full's shape has rank %d", n);
    if ((rc = og_check_out(b, st, 0, dt, n, shape))) return rc;
    if (b->dry) return 0;
    st->i[0] = 0;
    if (v->kind == ATTR_I) { /* an integer stays exact (as a torch int Scalar) */
        float f = (float)v->i;
        if (og_is_intish(dt)) og_store_i64(&st->i[0], dt, 0, &v->i, 1);
        else if (dt == NPUC_F64) og_store_i64(&st->i[0], dt, 0, &v->i, 1);
        else og_store_f32(&st->i[0], dt, 0, &f, 1);
    } else if (dt == NPUC_F64) {
        memcpy(&st->i[0], &v->f, sizeof(double));
    } else if (og_is_int(dt)) {
        int64_t q = og_f2i(v->f, dt);
        og_store_i64(&st->i[0], dt, 0, &q, 1);
    } else {
        float f = dt == NPUC_BOOL ? (float)(v->f != 0.0) : (float)v->f;
        og_store_f32(&st->i[0], dt, 0, &f, 1);
    }
    st->run = full_run;
    return 0;
}

/* arange: torch's CPU kernel computes start + step * i in its accumulation type: double for
 * f32/f64, f32 for the half types, int64 (start and step truncated) for integers. */
static int arange_run(const rt_step *st, struct npuc_session *s) {
    (void)s;
    int dt = st->out[0].dtype;
    double start = st->f[0], step = st->f[1];
    int64_t n = st->out[0].numel;
    void *out = st->out[0].data;
    for (int64_t i = 0; i < n; i++) {
        if (og_is_int(dt)) {
            int64_t v = (int64_t)((uint64_t)st->i[0] + (uint64_t)st->i[1] * (uint64_t)i);
            og_store_i64(out, dt, i, &v, 1);
        } else if (dt == NPUC_F64) {
            ((double *)out)[i] = start + step * (double)i;
        } else if (dt == NPUC_F32) {
            ((float *)out)[i] = (float)(start + step * (double)i);
        } else {
            float v = (float)start + (float)step * (float)i;
            og_store_f32(out, dt, i, &v, 1);
        }
    }
    return 0;
}

static int bind_arange(rt_binder *b, rt_step *st) {
    int rc, dt;
    double start, end, step;
    if ((rc = og_check_arity(b, st, 0, 0, 1)) || (rc = og_attr_num(b, st, "start", 1, 0, &start)) ||
        (rc = og_attr_num(b, st, "end", 0, 0, &end)) || (rc = og_attr_num(b, st, "step", 1, 1, &step)) ||
        (rc = og_attr_dtype(b, st, "dtype", &dt)))
        return rc;
    if (step == 0 || !isfinite(start) || !isfinite(end) || !isfinite(step))
        return og_invalid(b, st, "arange needs a finite range and a nonzero step");
    double n = ceil((end - start) / step);
    if (n < 0) n = 0;
    const rt_view *o = &st->out[0];
    if (o->rank != 1 || (double)o->shape[0] != n || o->dtype != dt)
        return og_check_out(b, st, 0, dt, 1, (int64_t[]){n < 9.2e18 ? (int64_t)n : -1});
    if (dt == NPUC_BOOL) return og_no_kernel(b, st, "no kernel for a bool arange");
    if (og_is_int(dt) && (!(fabs(start) < 9.2e18) || !(fabs(step) < 9.2e18) || (int64_t)step == 0))
        return og_no_kernel(b, st, "no kernel for an integer arange with a fractional step");
    if (b->dry) return 0;
    st->f[0] = start;
    st->f[1] = step;
    if (og_is_int(dt)) {
        st->i[0] = (int64_t)start;
        st->i[1] = (int64_t)step;
    }
    st->run = arange_run;
    return 0;
}

/* ---- trilu ------------------------------------------------------------------------------- */

/* st->i: [0] matrices, [1] rows, [2] cols, [3] k (clamped), [4] upper, [5] element bytes */
static int trilu_run(const rt_step *st, struct npuc_session *s) {
    (void)s;
    int64_t mats = st->i[0], R = st->i[1], C = st->i[2], k = st->i[3], es = st->i[5];
    const char *x = st->in[0].data;
    char *out = st->out[0].data;
    for (int64_t m = 0; m < mats; m++)
        for (int64_t i = 0; i < R; i++) {
            int64_t at = (m * R + i) * C * es, cut;
            /* upper keeps j >= i + k; lower keeps j <= i + k */
            cut = st->i[4] ? i + k : i + k + 1;
            cut = cut < 0 ? 0 : cut > C ? C : cut;
            int64_t keep0 = st->i[4] ? cut : 0, keep1 = st->i[4] ? C : cut;
            if (out != x && keep1 > keep0)
                memcpy(out + at + keep0 * es, x + at + keep0 * es, (size_t)((keep1 - keep0) * es));
            if (st->i[4]) memset(out + at, 0, (size_t)(cut * es));
            else memset(out + at + cut * es, 0, (size_t)((C - cut) * es));
        }
    return 0;
}

static int bind_trilu(rt_binder *b, rt_step *st) {
    int rc;
    int64_t upper, k;
    if ((rc = og_check_arity(b, st, 1, 1, 1)) || (rc = og_attr_int(b, st, "upper", 1, 1, &upper)) ||
        (rc = og_attr_int(b, st, "k", 1, 0, &k)))
        return rc;
    const rt_view *x = &st->in[0];
    if (x->rank < 2) return og_invalid(b, st, "trilu needs rank >= 2");
    if ((rc = og_check_out(b, st, 0, x->dtype, x->rank, x->shape))) return rc;
    if (b->dry) return 0;
    int64_t R = x->shape[x->rank - 2], C = x->shape[x->rank - 1], lim = R + C + 1;
    st->i[0] = prod(x->shape, 0, x->rank - 2);
    st->i[1] = R;
    st->i[2] = C;
    st->i[3] = k < -lim ? -lim : k > lim ? lim : k;
    st->i[4] = upper != 0;
    st->i[5] = npuc_dtype_size(x->dtype);
    st->run = trilu_run;
    return 0;
}

static const og_entry TABLE[] = {
    {"reshape", bind_reshape},
    {"transpose", bind_transpose},
    {"expand", bind_expand},
    {"slice", bind_slice},
    {"slice_scatter", bind_slice_scatter},
    {"concat", bind_concat},
    {"split", bind_split},
    {"pad", bind_pad},
    {"gather", bind_gather},
    {"gather_elements", bind_gather_elements},
    {"gather_nd", bind_gather_nd},
    {"scatter_elements", bind_scatter_elements},
    {"scatter_nd", bind_scatter_nd},
    {"index", bind_index},
    {"full", bind_full},
    {"arange", bind_arange},
    {"trilu", bind_trilu},
    {NULL, NULL},
};

rt_bind_fn rt_movement_binder(const char *op) { return og_lookup(TABLE, op); }
