/* Reductions and ops along an axis: reduce_sum/mean/max/min/prod, argmax/argmin, topk, cumsum,
 * softmax, log_softmax, layer_norm, rms_norm (what the executor's own f32 kernel does not
 * take: half types, a broadcast scale), and matmul.
 *
 * Float storage (f32, bf16, f16) is read into f32 and reduced in double (sums, products) or
 * f32 (softmax's exponentials, the norms' elementwise part, as the registry's kernels compute
 * in f32), rounded once at the store; integers reduce in int64 with wrap-around, truncated
 * to their width at the store. f64 is not run here (NPUC_E_NO_KERNEL). An axis op views its
 * operand as [outer, n, inner] and walks each of the outer * inner lines of n elements, n
 * apart by inner; lines are split over the thread pool.
 */
#include <math.h>
#include <string.h>

#include "ops_generic.h"

#define BLK 512

static int64_t prod(const int64_t *shape, int32_t from, int32_t to) {
    int64_t p = 1;
    for (int32_t d = from; d < to; d++) p *= shape[d];
    return p;
}

/* Stores of one value, or a strided block, from the compute types. */
static inline void put_f(void *p, int dt, int64_t off, float v) { og_store_f32(p, dt, off, &v, 1); }
static inline void put_i(void *p, int dt, int64_t off, int64_t v) { og_store_i64(p, dt, off, &v, 1); }
static void store_f_strided(void *p, int dt, int64_t off, int64_t stride, const float *v, int64_t n) {
    if (stride == 1) og_store_f32(p, dt, off, v, n);
    else for (int64_t k = 0; k < n; k++) put_f(p, dt, off + k * stride, v[k]);
}
static inline float rd(float v, int dt) {
    if (dt == NPUC_BF16) return npuc_bf16_to_f32(rt_f32_to_bf16(v));
    if (dt == NPUC_F16) return rt_f16_to_f32(rt_f32_to_f16(v));
    return v;
}

/* An axis op's operand as [outer, n, inner]: st->i[0..2]. */
static void axis_view(rt_step *st, const rt_view *x, int32_t ax) {
    st->i[0] = prod(x->shape, 0, ax);
    st->i[1] = x->rank ? x->shape[ax] : 1;
    st->i[2] = x->rank ? prod(x->shape, ax + 1, x->rank) : 1;
}

/* ---- reduce_* ---------------------------------------------------------------------------- */

enum { R_SUM, R_MEAN, R_MAX, R_MIN, R_PROD };

typedef struct red_plan {
    int kind, dt;
    int32_t nk, nr;                     /* kept and reduced dims (coalesced) */
    int64_t ks[NPUC_MAX_RANK], kst[NPUC_MAX_RANK];
    int64_t rs[NPUC_MAX_RANK], rst[NPUC_MAX_RANK];
    int64_t count;                      /* elements reduced into each output */
} red_plan;

typedef struct {
    const red_plan *p;
    const void *x;
    void *out;
} red_job;

/* The dtype's extreme: a max or min over nothing (as the reference's fill). */
static int64_t int_extreme(int dt, int smallest_wanted) {
    int mx = smallest_wanted; /* min over nothing: the largest value */
    switch (dt) {
    case NPUC_I64: return mx ? INT64_MAX : INT64_MIN;
    case NPUC_I32: return mx ? INT32_MAX : INT32_MIN;
    case NPUC_I16: return mx ? INT16_MAX : INT16_MIN;
    case NPUC_I8: return mx ? INT8_MAX : INT8_MIN;
    case NPUC_U8: return mx ? UINT8_MAX : 0;
    default: return mx; /* bool */
    }
}

static double float_init(int kind) {
    return kind == R_PROD ? 1.0 : kind == R_MAX ? -INFINITY : kind == R_MIN ? INFINITY : 0.0;
}

static inline double fold_f(int kind, double a, double x) {
    switch (kind) {
    case R_SUM: case R_MEAN: return a + x;
    case R_PROD: return a * x;
    case R_MAX: return (x != x || a != a) ? NAN : x > a ? x : a;
    default: return (x != x || a != a) ? NAN : x < a ? x : a;
    }
}

static inline int64_t fold_i(int kind, int64_t a, int64_t x, int first) {
    switch (kind) {
    case R_SUM: return (int64_t)((uint64_t)a + (uint64_t)x);
    case R_PROD: return (int64_t)((uint64_t)a * (uint64_t)x);
    case R_MAX: return first || x > a ? x : a;
    default: return first || x < a ? x : a;
    }
}

/* Input offset of output o's first reduced element. */
static int64_t red_base(const red_plan *p, int64_t o) {
    int64_t base = 0;
    for (int32_t d = p->nk - 1; d >= 0; d--) {
        base += (o % p->ks[d]) * p->kst[d];
        o /= p->ks[d];
    }
    return base;
}

/* The next reduced position (an odometer over the reduced dims from `last` down). */
static inline int64_t red_next(const red_plan *p, int64_t off, int64_t *idx, int32_t last) {
    for (int32_t d = last; d >= 0; d--) {
        off += p->rst[d];
        if (++idx[d] < p->rs[d]) break;
        off -= idx[d] * p->rst[d];
        idx[d] = 0;
    }
    return off;
}

/* One output at a time, its innermost reduced dim read as a contiguous (or strided) line. */
static void red_lines(const red_job *j, int64_t lo, int64_t hi) {
    const red_plan *p = j->p;
    int isf = og_is_f32ish(p->dt);
    int64_t inner = p->nr ? p->rs[p->nr - 1] : 1, ist = p->nr ? p->rst[p->nr - 1] : 0;
    int64_t lines = inner ? p->count / inner : 0;
    for (int64_t o = lo; o < hi; o++) {
        double facc = float_init(p->kind);
        int64_t iacc = p->kind == R_PROD ? 1 : 0, idx[NPUC_MAX_RANK] = {0}, off = red_base(p, o);
        int first = 1;
        for (int64_t line = 0; line < lines; line++) {
            for (int64_t b0 = 0; b0 < inner; b0 += BLK) {
                int64_t m = og_min64(BLK, inner - b0);
                if (isf) {
                    float v[BLK];
                    og_load_f32(j->x, p->dt, off + b0 * ist, ist, m, v);
                    for (int64_t k = 0; k < m; k++) facc = fold_f(p->kind, facc, v[k]);
                } else {
                    int64_t v[BLK];
                    og_load_i64(j->x, p->dt, off + b0 * ist, ist, m, v);
                    for (int64_t k = 0; k < m; k++, first = 0) iacc = fold_i(p->kind, iacc, v[k], first);
                }
            }
            off = red_next(p, off, idx, p->nr - 2);
        }
        if (isf) {
            if (p->kind == R_MEAN) facc = facc / (double)p->count; /* 0/0: NaN, as torch's */
            put_f(j->out, p->dt, o, (float)facc);
        } else {
            if (first && (p->kind == R_MAX || p->kind == R_MIN)) iacc = int_extreme(p->dt, p->kind == R_MIN);
            put_i(j->out, p->dt, o, iacc);
        }
    }
}

/* Where the input's last dim is kept, up to BLK neighbouring outputs read neighbouring
 * elements: reduce them together, a contiguous block per reduced position. */
static void red_columns(const red_job *j, int64_t lo, int64_t hi) {
    const red_plan *p = j->p;
    int isf = og_is_f32ish(p->dt);
    int64_t L = p->ks[p->nk - 1];
    for (int64_t o = lo; o < hi;) {
        int64_t m = og_min64(og_min64(L - o % L, hi - o), BLK), idx[NPUC_MAX_RANK] = {0}, off = red_base(p, o);
        double facc[BLK];
        int64_t iacc[BLK];
        for (int64_t k = 0; k < m; k++) {
            facc[k] = float_init(p->kind);
            iacc[k] = p->kind == R_PROD ? 1 : 0;
        }
        for (int64_t t = 0; t < p->count; t++) {
            if (isf) {
                float v[BLK];
                og_load_f32(j->x, p->dt, off, 1, m, v);
                for (int64_t k = 0; k < m; k++) facc[k] = fold_f(p->kind, facc[k], v[k]);
            } else {
                int64_t v[BLK];
                og_load_i64(j->x, p->dt, off, 1, m, v);
                for (int64_t k = 0; k < m; k++) iacc[k] = fold_i(p->kind, iacc[k], v[k], t == 0);
            }
            off = red_next(p, off, idx, p->nr - 1);
        }
        if (isf) {
            float v[BLK];
            for (int64_t k = 0; k < m; k++) v[k] = (float)(p->kind == R_MEAN ? facc[k] / (double)p->count : facc[k]);
            og_store_f32(j->out, p->dt, o, v, m);
        } else {
            if (p->count == 0 && (p->kind == R_MAX || p->kind == R_MIN))
                for (int64_t k = 0; k < m; k++) iacc[k] = int_extreme(p->dt, p->kind == R_MIN);
            og_store_i64(j->out, p->dt, o, iacc, m);
        }
        o += m;
    }
}

static void red_range(const void *pj, int64_t lo, int64_t hi, int tid) {
    (void)tid;
    const red_job *j = pj;
    const red_plan *p = j->p;
    if (p->nk > 0 && p->kst[p->nk - 1] == 1 && p->nr > 0) red_columns(j, lo, hi);
    else red_lines(j, lo, hi);
}

static int red_run(const rt_step *st, struct npuc_session *s) {
    const red_plan *p = st->p[0];
    red_job j = {p, st->in[0].data, st->out[0].data};
    og_parallel(red_range, &j, st->out[0].numel, 16384 / (p->count + 1) + 1, rt_session_threads(s));
    return 0;
}

static int bind_reduce(rt_binder *b, rt_step *st) {
    static const char *const kinds[] = {"reduce_sum", "reduce_mean", "reduce_max", "reduce_min", "reduce_prod"};
    int rc, kind = 0;
    for (int k = 0; k < 5; k++)
        if (strcmp(st->op->op, kinds[k]) == 0) kind = k;
    const int64_t *axes;
    int32_t n;
    int64_t keepdim;
    if ((rc = og_check_arity(b, st, 1, 1, 1)) || (rc = og_attr_ints(b, st, "axes", &axes, &n)) ||
        (rc = og_attr_int(b, st, "keepdim", 1, 0, &keepdim)))
        return rc;
    const rt_view *x = &st->in[0];
    if (n == 0) return og_invalid(b, st, "reductions name their axes explicitly");
    int red[NPUC_MAX_RANK] = {0};
    for (int32_t k = 0; k < n; k++) {
        int32_t ax;
        if ((rc = og_norm_axis(b, st, axes[k], x->rank, &ax))) return rc;
        red[ax] = 1;
    }
    int64_t shape[NPUC_MAX_RANK];
    int32_t r = 0;
    for (int32_t d = 0; d < x->rank; d++)
        if (keepdim) shape[r++] = red[d] ? 1 : x->shape[d];
        else if (!red[d]) shape[r++] = x->shape[d];
    if ((rc = og_check_out(b, st, 0, x->dtype, r, shape))) return rc;
    if (x->dtype == NPUC_F64 || (kind == R_MEAN && !og_is_float(x->dtype)) || npuc_dtype_size(x->dtype) == 0)
        return og_no_kernel(b, st, "no kernel for %s operands", npuc_dtype_name(x->dtype));
    if (b->dry) return 0;
    red_plan *p = og_alloc(b, st, sizeof *p);
    if (!p) return NPUC_E_ARG;
    p->kind = kind;
    p->dt = x->dtype;
    p->count = 1;
    int64_t cs[NPUC_MAX_RANK], acc = 1;
    for (int32_t d = x->rank - 1; d >= 0; d--) {
        cs[d] = acc;
        acc *= x->shape[d];
    }
    for (int32_t d = 0; d < x->rank; d++) {
        if (red[d]) p->count *= x->shape[d];
        if (x->shape[d] == 1) continue;
        int64_t *sz = red[d] ? p->rs : p->ks, *sd = red[d] ? p->rst : p->kst;
        int32_t *cnt = red[d] ? &p->nr : &p->nk;
        /* merge with the previous dim of the same kind when they are adjacent in memory */
        if (*cnt > 0 && sd[*cnt - 1] == cs[d] * x->shape[d]) {
            sz[*cnt - 1] *= x->shape[d];
            sd[*cnt - 1] = cs[d];
        } else {
            sz[*cnt] = x->shape[d];
            sd[*cnt] = cs[d];
            (*cnt)++;
        }
    }
    st->p[0] = p;
    st->run = red_run;
    return 0;
}

/* ---- argmax, argmin ---------------------------------------------------------------------- */

/* st->i: [0..2] outer, n, inner; [3] argmin; [4] select_last */
static void arg_range(const void *pj, int64_t lo, int64_t hi, int tid) {
    (void)tid;
    const rt_step *st = pj;
    const rt_view *x = &st->in[0];
    int64_t n = st->i[1], inner = st->i[2];
    int mn = (int)st->i[3], last = (int)st->i[4], isf = og_is_f32ish(x->dtype);
    for (int64_t line = lo; line < hi; line++) {
        int64_t base = (line / inner) * n * inner + line % inner, best = 0;
        float bf = 0;
        int64_t bi = 0;
        for (int64_t k = 0; k < n; k++) {
            int64_t at = last ? n - 1 - k : k; /* the first best in walking order wins */
            if (isf) {
                float v;
                og_load_f32(x->data, x->dtype, base + at * inner, 0, 1, &v);
                int better = k == 0 || (bf == bf && (v != v || (mn ? v < bf : v > bf)));
                if (better) {
                    bf = v;
                    best = at;
                }
            } else {
                int64_t v;
                og_load_i64(x->data, x->dtype, base + at * inner, 0, 1, &v);
                if (k == 0 || (mn ? v < bi : v > bi)) {
                    bi = v;
                    best = at;
                }
            }
        }
        ((int64_t *)st->out[0].data)[line] = best;
    }
}

static int arg_run(const rt_step *st, struct npuc_session *s) {
    og_parallel(arg_range, st, st->i[0] * st->i[2], 16384 / (st->i[1] + 1) + 1, rt_session_threads(s));
    return 0;
}

static int bind_arg(rt_binder *b, rt_step *st) {
    int rc;
    int64_t axis, keepdim, last;
    int32_t ax;
    if ((rc = og_check_arity(b, st, 1, 1, 1)) || (rc = og_attr_int(b, st, "axis", 1, 0, &axis)) ||
        (rc = og_attr_int(b, st, "keepdim", 1, 1, &keepdim)) || (rc = og_attr_int(b, st, "select_last", 1, 0, &last)))
        return rc;
    const rt_view *x = &st->in[0];
    if ((rc = og_norm_axis(b, st, axis, x->rank, &ax))) return rc;
    int64_t shape[NPUC_MAX_RANK];
    int32_t r = 0;
    for (int32_t d = 0; d < x->rank; d++)
        if (d != ax) shape[r++] = x->shape[d];
        else if (keepdim) shape[r++] = 1;
    if ((rc = og_check_out(b, st, 0, NPUC_I64, r, shape))) return rc;
    if (x->dtype == NPUC_F64 || x->dtype == NPUC_BOOL || npuc_dtype_size(x->dtype) == 0 ||
        (x->rank && x->shape[ax] == 0))
        return og_no_kernel(b, st, "no kernel for that operand (torch's has none for bool or an empty axis)");
    if (b->dry) return 0;
    axis_view(st, x, ax);
    st->i[3] = strcmp(st->op->op, "argmin") == 0;
    st->i[4] = last != 0;
    st->run = arg_run;
    return 0;
}

/* ---- topk -------------------------------------------------------------------------------- */

/* Keys of one line in the scratch: doubles (floats, exact) or int64; the order is total:
 * by value (NaN above everything, as torch's sort), then by index, so equal values keep
 * index order whichever way the sort goes (the reference's stable sort). */
typedef struct {
    const double *fk;
    const int64_t *ik;
    int largest;
} topk_order;

static int before(const topk_order *o, int64_t a, int64_t b) {
    if (o->fk) {
        double x = o->fk[a], y = o->fk[b];
        int nx = x != x, ny = y != y;
        if (nx || ny) {
            if (nx && ny) return a < b;
            return o->largest ? nx : ny; /* NaN first when largest, last otherwise */
        }
        if (x != y) return o->largest ? x > y : x < y;
    } else {
        int64_t x = o->ik[a], y = o->ik[b];
        if (x != y) return o->largest ? x > y : x < y;
    }
    return a < b;
}

static void merge_sort(const topk_order *o, int64_t *v, int64_t *tmp, int64_t n) {
    for (int64_t w = 1; w < n; w *= 2) {
        for (int64_t lo = 0; lo < n; lo += 2 * w) {
            int64_t mid = og_min64(lo + w, n), hi = og_min64(lo + 2 * w, n), i = lo, j = mid, k = lo;
            while (i < mid && j < hi) tmp[k++] = before(o, v[j], v[i]) ? v[j++] : v[i++];
            while (i < mid) tmp[k++] = v[i++];
            while (j < hi) tmp[k++] = v[j++];
        }
        memcpy(v, tmp, (size_t)n * sizeof(int64_t));
    }
}

/* st->i: [0..2] outer, n, inner; [3] k; [4] largest */
static int topk_run(const rt_step *st, struct npuc_session *s) {
    const rt_view *x = &st->in[0];
    int64_t n = st->i[1], inner = st->i[2], k = st->i[3], es = npuc_dtype_size(x->dtype);
    float *scratch = rt_session_scratch(s);
    int64_t *keys = (int64_t *)(void *)scratch, *idx = keys + n, *tmp = idx + n;
    int isf = og_is_f32ish(x->dtype);
    topk_order o = {isf ? (const double *)(void *)keys : NULL, isf ? NULL : keys, (int)st->i[4]};
    for (int64_t line = 0; line < st->i[0] * inner; line++) {
        int64_t base = (line / inner) * n * inner + line % inner, obase = (line / inner) * k * inner + line % inner;
        for (int64_t j = 0; j < n; j++) {
            if (isf) {
                float v;
                og_load_f32(x->data, x->dtype, base + j * inner, 0, 1, &v);
                ((double *)(void *)keys)[j] = v;
            } else {
                og_load_i64(x->data, x->dtype, base + j * inner, 0, 1, &keys[j]);
            }
            idx[j] = j;
        }
        merge_sort(&o, idx, tmp, n);
        for (int64_t j = 0; j < k; j++) {
            memcpy((char *)st->out[0].data + (obase + j * inner) * es,
                   (const char *)x->data + (base + idx[j] * inner) * es, (size_t)es);
            ((int64_t *)st->out[1].data)[obase + j * inner] = idx[j];
        }
    }
    return 0;
}

static int bind_topk(rt_binder *b, rt_step *st) {
    int rc;
    int64_t k, axis, largest;
    int32_t ax;
    if ((rc = og_check_arity(b, st, 1, 1, 2)) || (rc = og_attr_int(b, st, "k", 0, 0, &k)) ||
        (rc = og_attr_int(b, st, "axis", 1, -1, &axis)) || (rc = og_attr_int(b, st, "largest", 1, 1, &largest)))
        return rc;
    const rt_view *x = &st->in[0];
    if ((rc = og_norm_axis(b, st, axis, x->rank, &ax))) return rc;
    int64_t n = x->rank ? x->shape[ax] : 1, shape[NPUC_MAX_RANK];
    if (x->dtype == NPUC_BOOL || k < 0 || k > n) return og_invalid(b, st, "topk k=%lld does not fit", (long long)k);
    memcpy(shape, x->shape, sizeof shape);
    if (x->rank) shape[ax] = k;
    if ((rc = og_check_out(b, st, 0, x->dtype, x->rank, shape)) ||
        (rc = og_check_out(b, st, 1, NPUC_I64, x->rank, shape)))
        return rc;
    if (x->dtype == NPUC_F64 || npuc_dtype_size(x->dtype) == 0 || x->rank == 0)
        return og_no_kernel(b, st, "no kernel for that operand");
    og_want_scratch(b, 6 * (uint64_t)n + 2);
    if (b->dry) return 0;
    axis_view(st, x, ax);
    st->i[3] = k;
    st->i[4] = largest != 0;
    st->run = topk_run;
    return 0;
}

/* ---- cumsum ------------------------------------------------------------------------------ */

/* torch's CPU cumsum accumulates in double for f32, f32 for the half types, int64 for
 * integers, rounding each output; exclusive is then y - x in the storage dtype.
 * st->i: [0..2] outer, n, inner; [3] exclusive; [4] reverse */
static void cumsum_range(const void *pj, int64_t lo, int64_t hi, int tid) {
    (void)tid;
    const rt_step *st = pj;
    const rt_view *x = &st->in[0];
    int dt = x->dtype;
    int64_t n = st->i[1], inner = st->i[2];
    for (int64_t line = lo; line < hi; line++) {
        int64_t base = (line / inner) * n * inner + line % inner;
        double dacc = 0;
        float facc = 0;
        int64_t iacc = 0;
        for (int64_t k = 0; k < n; k++) {
            int64_t at = base + (st->i[4] ? n - 1 - k : k) * inner;
            if (og_is_f32ish(dt)) {
                float v, y;
                og_load_f32(x->data, dt, at, 0, 1, &v);
                if (dt == NPUC_F32) y = (float)(dacc += v);
                else y = rd(facc += v, dt);
                put_f(st->out[0].data, dt, at, st->i[3] ? y - v : y);
            } else {
                int64_t v;
                og_load_i64(x->data, dt, at, 0, 1, &v);
                iacc = (int64_t)((uint64_t)iacc + (uint64_t)v);
                put_i(st->out[0].data, dt, at, st->i[3] ? (int64_t)((uint64_t)iacc - (uint64_t)v) : iacc);
            }
        }
    }
}

static int cumsum_run(const rt_step *st, struct npuc_session *s) {
    og_parallel(cumsum_range, st, st->i[0] * st->i[2], 16384 / (st->i[1] + 1) + 1, rt_session_threads(s));
    return 0;
}

static int bind_cumsum(rt_binder *b, rt_step *st) {
    int rc;
    int64_t axis, exclusive, reverse;
    int32_t ax;
    if ((rc = og_check_arity(b, st, 1, 1, 1)) || (rc = og_attr_int(b, st, "axis", 0, 0, &axis)) ||
        (rc = og_attr_int(b, st, "exclusive", 1, 0, &exclusive)) ||
        (rc = og_attr_int(b, st, "reverse", 1, 0, &reverse)))
        return rc;
    const rt_view *x = &st->in[0];
    if ((rc = og_norm_axis(b, st, axis, x->rank, &ax)) || (rc = og_check_out(b, st, 0, x->dtype, x->rank, x->shape)))
        return rc;
    if (x->dtype == NPUC_F64 || x->dtype == NPUC_BOOL || npuc_dtype_size(x->dtype) == 0) /* torch: none for bool */
        return og_no_kernel(b, st, "no kernel for %s operands", npuc_dtype_name(x->dtype));
    if (b->dry) return 0;
    axis_view(st, x, ax);
    st->i[3] = exclusive != 0;
    st->i[4] = reverse != 0;
    st->run = cumsum_run;
    return 0;
}

/* ---- softmax, log_softmax ---------------------------------------------------------------- */

/* torch: exp(x - max) * (1 / sum), and x - max - log(sum), in f32 (half types widened; but
 * torch's log_softmax of a half type along its last axis rounds the sum and its log to that
 * type). st->i: [0..2] outer, n, inner; [3] log; [4] log of a half type along the last axis */
static void softmax_range(const void *pj, int64_t lo, int64_t hi, int tid) {
    (void)tid;
    const rt_step *st = pj;
    const rt_view *x = &st->in[0];
    int64_t n = st->i[1], inner = st->i[2];
    float v[BLK];
    for (int64_t line = lo; line < hi; line++) {
        int64_t base = (line / inner) * n * inner + line % inner;
        float mx = -INFINITY;
        for (int64_t b0 = 0; b0 < n; b0 += BLK) {
            int64_t m = og_min64(BLK, n - b0);
            og_load_f32(x->data, x->dtype, base + b0 * inner, inner, m, v);
            for (int64_t k = 0; k < m; k++) mx = (v[k] > mx || v[k] != v[k]) && mx == mx ? v[k] : mx;
        }
        double sum = 0;
        float *kept = !st->i[3] && inner == 1 && st->out[0].dtype == NPUC_F32 ? (float *)st->out[0].data + base : NULL;
        for (int64_t b0 = 0; b0 < n; b0 += BLK) {
            int64_t m = og_min64(BLK, n - b0);
            og_load_f32(x->data, x->dtype, base + b0 * inner, inner, m, v);
            for (int64_t k = 0; k < m; k++) v[k] = expf(v[k] - mx);
            for (int64_t k = 0; k < m; k++) sum += v[k];
            if (kept) memcpy(kept + b0, v, (size_t)m * sizeof(float)); /* f32 rows keep their exponentials */
        }
        float inv = 1.0f / (float)sum, lse = logf((float)sum);
        if (st->i[4]) lse = rd(logf(rd((float)sum, x->dtype)), x->dtype); /* torch's half last-axis kernel */
        if (kept) {
            for (int64_t k = 0; k < n; k++) kept[k] *= inv;
            continue;
        }
        for (int64_t b0 = 0; b0 < n; b0 += BLK) {
            int64_t m = og_min64(BLK, n - b0);
            og_load_f32(x->data, x->dtype, base + b0 * inner, inner, m, v);
            if (st->i[3])
                for (int64_t k = 0; k < m; k++) v[k] = v[k] - mx - lse;
            else
                for (int64_t k = 0; k < m; k++) v[k] = expf(v[k] - mx) * inv;
            store_f_strided(st->out[0].data, st->out[0].dtype, base + b0 * inner, inner, v, m);
        }
    }
}

static int softmax_run(const rt_step *st, struct npuc_session *s) {
    og_parallel(softmax_range, st, st->i[0] * st->i[2], 16384 / (st->i[1] + 1) + 1, rt_session_threads(s));
    return 0;
}

static int bind_softmax(rt_binder *b, rt_step *st) {
    int rc;
    int64_t axis;
    int32_t ax;
    if ((rc = og_check_arity(b, st, 1, 1, 1)) || (rc = og_attr_int(b, st, "axis", 0, 0, &axis))) return rc;
    const rt_view *x = &st->in[0];
    if ((rc = og_norm_axis(b, st, axis, x->rank, &ax))) return rc;
    if (!og_is_float(x->dtype)) return og_invalid(b, st, "needs a float operand");
    if ((rc = og_check_out(b, st, 0, x->dtype, x->rank, x->shape))) return rc;
    if (!og_is_f32ish(x->dtype)) return og_no_kernel(b, st, "no kernel for %s operands", npuc_dtype_name(x->dtype));
    if (b->dry) return 0;
    axis_view(st, x, ax);
    st->i[3] = strcmp(st->op->op, "log_softmax") == 0;
    st->i[4] = st->i[3] && x->dtype != NPUC_F32 && ax == x->rank - 1;
    st->run = softmax_run;
    return 0;
}

/* ---- layer_norm, rms_norm ---------------------------------------------------------------- */

/* Rows of D = prod(shape[axis:]) elements. A scale or bias that is not a contiguous f32 of D
 * elements is widened into the scratch (D floats each) at each run, as it broadcasts.
 * st->i: [0] rows, [1] D, [2] rms, [3] normalised rank, [4..11] normalised shape; f[0] eps */
typedef struct {
    const rt_step *st;
    const float *scale, *bias;
} norm_job;

static void norm_range(const void *pj, int64_t lo, int64_t hi, int tid) {
    (void)tid;
    const norm_job *j = pj;
    const rt_step *st = j->st;
    const rt_view *x = &st->in[0];
    int64_t D = st->i[1];
    float eps = (float)st->f[0], v[BLK];
    for (int64_t row = lo; row < hi; row++) {
        int64_t base = row * D;
        double sum = 0;
        for (int64_t b0 = 0; b0 < D; b0 += BLK) {
            int64_t m = og_min64(BLK, D - b0);
            og_load_f32(x->data, x->dtype, base + b0, 1, m, v);
            if (st->i[2])
                for (int64_t k = 0; k < m; k++) sum += v[k] * v[k];
            else
                for (int64_t k = 0; k < m; k++) sum += v[k];
        }
        float mu = 0, r;
        if (st->i[2]) {
            r = 1.0f / sqrtf((float)(sum / (double)D) + eps);
        } else {
            mu = (float)(sum / (double)D);
            double var = 0;
            for (int64_t b0 = 0; b0 < D; b0 += BLK) {
                int64_t m = og_min64(BLK, D - b0);
                og_load_f32(x->data, x->dtype, base + b0, 1, m, v);
                for (int64_t k = 0; k < m; k++) {
                    float d = v[k] - mu;
                    var += d * d;
                }
            }
            r = 1.0f / sqrtf((float)(var / (double)D) + eps);
        }
        for (int64_t b0 = 0; b0 < D; b0 += BLK) {
            int64_t m = og_min64(BLK, D - b0);
            og_load_f32(x->data, x->dtype, base + b0, 1, m, v);
            const float *sc = j->scale + b0;
            if (st->i[2]) {
                for (int64_t k = 0; k < m; k++) v[k] = v[k] * r * sc[k];
            } else {
                for (int64_t k = 0; k < m; k++) v[k] = (v[k] - mu) * r * sc[k];
                if (j->bias)
                    for (int64_t k = 0; k < m; k++) v[k] += j->bias[b0 + k];
            }
            og_store_f32(st->out[0].data, st->out[0].dtype, base + b0, v, m);
        }
    }
}

/* Parameter t broadcast over the normalised shape, as D floats. */
static const float *widen_param(const rt_step *st, const rt_view *t, float *dst) {
    int64_t D = st->i[1];
    int32_t nr = (int32_t)st->i[3];
    const int64_t *ns = &st->i[4];
    if (t->dtype == NPUC_F32 && t->numel == D) return t->data;
    int64_t sd[NPUC_MAX_RANK], acc = 1, c[NPUC_MAX_RANK] = {0};
    for (int32_t d = nr - 1; d >= 0; d--) {
        int32_t jd = d - (nr - t->rank);
        sd[d] = (jd < 0 || t->shape[jd] == 1) ? 0 : acc;
        if (jd >= 0) acc *= t->shape[jd];
    }
    for (int64_t i = 0; i < D; i++) {
        int64_t off = 0;
        for (int32_t d = 0; d < nr; d++) off += c[d] * sd[d];
        og_load_f32(t->data, t->dtype, off, 0, 1, &dst[i]);
        for (int32_t d = nr - 1; d >= 0 && ++c[d] == ns[d]; d--) c[d] = 0;
    }
    return dst;
}

static int norm_run(const rt_step *st, struct npuc_session *s) {
    float *scratch = rt_session_scratch(s);
    norm_job j = {st, NULL, NULL};
    j.scale = widen_param(st, &st->in[1], scratch);
    if (st->n_in > 2) j.bias = widen_param(st, &st->in[2], scratch + st->i[1]);
    og_parallel(norm_range, &j, st->i[0], 16384 / (st->i[1] + 1) + 1, rt_session_threads(s));
    return 0;
}

static int bind_norm(rt_binder *b, rt_step *st) {
    int rc, rms = strcmp(st->op->op, "rms_norm") == 0;
    int64_t axis;
    int32_t ax;
    double eps;
    if ((rc = og_check_arity(b, st, 2, rms ? 2 : 3, 1)) || (rc = og_attr_int(b, st, "axis", 1, -1, &axis)) ||
        (rc = og_attr_num(b, st, "eps", 1, 1e-5, &eps)))
        return rc;
    const rt_view *x = &st->in[0];
    if ((rc = og_norm_axis(b, st, axis, x->rank, &ax))) return rc;
    int32_t nr = x->rank - ax;
    if (x->rank == 0) nr = 0;
    const int64_t *ns = x->shape + (x->rank ? ax : 0);
    for (int k = 1; k < st->n_in; k++) { /* broadcast(t, normalised) == normalised */
        const rt_view *t = &st->in[k];
        int fits = t->rank <= nr;
        for (int32_t d = 0; fits && d < t->rank; d++) {
            int64_t want = ns[nr - t->rank + d];
            fits = t->shape[d] == want || t->shape[d] == 1;
        }
        if (!fits) return og_invalid(b, st, "norm parameter %d does not broadcast to the normalised shape", k);
    }
    if (!og_is_float(x->dtype)) return og_invalid(b, st, "norms need float operands");
    if ((rc = og_check_out(b, st, 0, x->dtype, x->rank, x->shape))) return rc;
    if (!og_is_f32ish(x->dtype)) return og_no_kernel(b, st, "no kernel for %s operands", npuc_dtype_name(x->dtype));
    for (int k = 1; k < st->n_in; k++)
        if (npuc_dtype_size(st->in[k].dtype) == 0 || st->in[k].dtype == NPUC_F64)
            return og_no_kernel(b, st, "no kernel for %s parameters", npuc_dtype_name(st->in[k].dtype));
    int64_t D = prod(ns, 0, nr);
    og_want_scratch(b, 2 * (uint64_t)D);
    if (b->dry) return 0;
    st->i[0] = x->rank ? prod(x->shape, 0, ax) : 1;
    st->i[1] = D;
    st->i[2] = rms;
    st->i[3] = nr;
    memcpy(&st->i[4], ns, sizeof(int64_t) * (size_t)nr);
    st->f[0] = eps;
    st->run = norm_run;
    return 0;
}

/* ---- matmul ------------------------------------------------------------------------------ */

/* st->i: [0] M, [1] N, [2] K, [3] batch rank, [4..9] batch shape, [10..15] a's batch strides,
 * [16..21] b's (elements; 0: broadcast), [22] threads the scratch was sized for.
 * Scratch: a and b as f32 (or int64) where they are not already, then one row of N
 * accumulators per thread where the output is not f32 (int64). */
typedef struct {
    const rt_step *st;
    const void *a, *b;   /* f32 or int64 */
    void *acc;           /* per-thread rows */
    int ints;
} mm_job;

static void mm_rows(const void *pj, int64_t lo, int64_t hi, int tid) {
    const mm_job *j = pj;
    const rt_step *st = j->st;
    int64_t M = st->i[0], N = st->i[1], K = st->i[2];
    int32_t nb = (int32_t)st->i[3];
    int odt = st->out[0].dtype;
    for (int64_t row = lo; row < hi; row++) {
        int64_t bi = row / M, m = row % M, ao = 0, bo = 0, rem = bi;
        for (int32_t d = nb - 1; d >= 0; d--) {
            int64_t c = rem % st->i[4 + d];
            rem /= st->i[4 + d];
            ao += c * st->i[10 + d];
            bo += c * st->i[16 + d];
        }
        if (j->ints) {
            const int64_t *a = (const int64_t *)j->a + ao + m * K, *bm = (const int64_t *)j->b + bo;
            int64_t *acc = odt == NPUC_I64 ? (int64_t *)st->out[0].data + row * N : (int64_t *)j->acc + tid * N;
            memset(acc, 0, (size_t)N * sizeof(int64_t));
            for (int64_t k = 0; k < K; k++) {
                uint64_t av = (uint64_t)a[k];
                const int64_t *br = bm + k * N;
                for (int64_t n = 0; n < N; n++) acc[n] = (int64_t)((uint64_t)acc[n] + av * (uint64_t)br[n]);
            }
            if (odt != NPUC_I64) og_store_i64(st->out[0].data, odt, row * N, acc, N);
        } else {
            const float *a = (const float *)j->a + ao + m * K, *bm = (const float *)j->b + bo;
            float *acc = odt == NPUC_F32 ? (float *)st->out[0].data + row * N : (float *)j->acc + tid * N;
            memset(acc, 0, (size_t)N * sizeof(float));
            for (int64_t k = 0; k < K; k++) {
                float av = a[k];
                const float *br = bm + k * N;
                for (int64_t n = 0; n < N; n++) acc[n] += av * br[n];
            }
            if (odt != NPUC_F32) og_store_f32(st->out[0].data, odt, row * N, acc, N);
        }
    }
}

static int matmul_run(const rt_step *st, struct npuc_session *s) {
    const rt_view *a = &st->in[0], *b = &st->in[1];
    int ints = og_is_intish(a->dtype), nt = rt_session_threads(s);
    if (nt > st->i[22]) nt = (int)st->i[22];
    float *scratch = rt_session_scratch(s);
    mm_job j = {st, a->data, b->data, NULL, ints};
    int64_t w = ints ? 2 : 1, used = 0; /* floats per element */
    if (ints ? a->dtype != NPUC_I64 : a->dtype != NPUC_F32) {
        j.a = scratch;
        if (ints) og_load_i64(a->data, a->dtype, 0, 1, a->numel, (int64_t *)(void *)scratch);
        else og_load_f32(a->data, a->dtype, 0, 1, a->numel, scratch);
        used += (a->numel * w + 1) & ~(int64_t)1;
    }
    if (ints ? b->dtype != NPUC_I64 : b->dtype != NPUC_F32) {
        j.b = scratch + used;
        if (ints) og_load_i64(b->data, b->dtype, 0, 1, b->numel, (int64_t *)(void *)(scratch + used));
        else og_load_f32(b->data, b->dtype, 0, 1, b->numel, scratch + used);
        used += (b->numel * w + 1) & ~(int64_t)1;
    }
    j.acc = scratch + used;
    int64_t rows = st->out[0].numel / (st->i[1] ? st->i[1] : 1);
    if (st->i[1] == 0) return 0;
    og_parallel(mm_rows, &j, rows, 65536 / (st->i[1] * st->i[2] + 1) + 1, nt);
    return 0;
}

static int bind_matmul(rt_binder *b, rt_step *st) {
    int rc;
    if ((rc = og_check_arity(b, st, 2, 2, 1))) return rc;
    const rt_view *a = &st->in[0], *bv = &st->in[1];
    if (a->dtype != bv->dtype) return og_invalid(b, st, "operands have different dtypes");
    if (a->rank < 1 || bv->rank < 1) return og_invalid(b, st, "matmul operands must have rank >= 1");
    int64_t M = a->rank == 1 ? 1 : a->shape[a->rank - 2], K = a->shape[a->rank - 1];
    int64_t Kb = bv->rank == 1 ? bv->shape[0] : bv->shape[bv->rank - 2];
    int64_t N = bv->rank == 1 ? 1 : bv->shape[bv->rank - 1];
    if (K != Kb) return og_invalid(b, st, "matmul contraction mismatch");
    int32_t ra = a->rank > 2 ? a->rank - 2 : 0, rb = bv->rank > 2 ? bv->rank - 2 : 0, nb = ra > rb ? ra : rb;
    int64_t shape[NPUC_MAX_RANK + 2], ast[NPUC_MAX_RANK], bst[NPUC_MAX_RANK];
    int64_t aacc = M * K, bacc = K * N;
    for (int32_t d = nb - 1; d >= 0; d--) {
        int32_t ja = d - (nb - ra), jb = d - (nb - rb);
        int64_t da = ja >= 0 ? a->shape[ja] : 1, db = jb >= 0 ? bv->shape[jb] : 1;
        if (da != db && da != 1 && db != 1) return og_invalid(b, st, "matmul batch dims do not broadcast");
        shape[d] = da == 1 ? db : da;
        ast[d] = da == 1 ? 0 : aacc;
        bst[d] = db == 1 ? 0 : bacc;
        aacc *= da;
        bacc *= db;
    }
    int32_t r = nb;
    if (a->rank > 1) shape[r++] = M;
    if (bv->rank > 1) shape[r++] = N;
    if (r > NPUC_MAX_RANK) return og_invalid(b, st, "matmul output rank %d", r);
    if ((rc = og_check_out(b, st, 0, a->dtype, r, shape))) return rc;
    int ints = og_is_int(a->dtype);
    if (!ints && !og_is_f32ish(a->dtype))
        return og_no_kernel(b, st, "no kernel for %s operands", npuc_dtype_name(a->dtype));
    int nt = b->threads < 1 ? 1 : b->threads;
    uint64_t w = ints ? 2 : 1, need = 2 * w * (uint64_t)N * (uint64_t)nt + 4;
    if (ints ? a->dtype != NPUC_I64 : a->dtype != NPUC_F32) need += w * (uint64_t)(a->numel + bv->numel) + 4;
    og_want_scratch(b, need);
    if (b->dry) return 0;
    st->i[0] = M;
    st->i[1] = N;
    st->i[2] = K;
    st->i[3] = nb;
    for (int32_t d = 0; d < nb; d++) {
        st->i[4 + d] = shape[d];
        st->i[10 + d] = ast[d];
        st->i[16 + d] = bst[d];
    }
    st->i[22] = nt;
    st->run = matmul_run;
    return 0;
}

static const og_entry TABLE[] = {
    {"reduce_sum", bind_reduce},
    {"reduce_mean", bind_reduce},
    {"reduce_max", bind_reduce},
    {"reduce_min", bind_reduce},
    {"reduce_prod", bind_reduce},
    {"argmax", bind_arg},
    {"argmin", bind_arg},
    {"topk", bind_topk},
    {"cumsum", bind_cumsum},
    {"softmax", bind_softmax},
    {"log_softmax", bind_softmax},
    {"layer_norm", bind_norm},
    {"rms_norm", bind_norm},
    {"matmul", bind_matmul},
    {NULL, NULL},
};

rt_bind_fn rt_reduce_binder(const char *op) { return og_lookup(TABLE, op); }
