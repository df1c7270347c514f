/* The recurrent token mixers of ir/recurrent_ops.py for libnpucrt: the selective scan of
 * state-space layers (Mamba, Mamba2), the gated delta rule of linear-attention layers (Gated
 * DeltaNet; Kimi's per-key gate) and its decayed linear attention without the delta, RWKV's WKV
 * and RG-LRU's diagonal linear recurrence, each pure and stateful. A binder per recurrence (the
 * registry's shape rule: _check_scan, _check_delta, _check_lin_attn, _check_wkv, _check_linear,
 * _check_tail), the kernel its steps run, and the same kernel as a flat entry point
 * (ops_recurrent.h) for the Python executor.
 *
 *   selective_scan[_state]    one chunk of the pool's parallel-for is (sequence, block of at
 *                             most RC_CB channels of one B/C group). It steps the block's rows
 *                             of h [Dc,N] through the S tokens: exp(dt A) once per (token, dt
 *                             head) where A is [H] (Mamba2), per element where it is [Dc,N]
 *                             (Mamba); each channel's update and C . h in one pass over N.
 *   gated_delta_rule[_state]  one chunk is (sequence, head, block of at most RC_VB value
 *                             columns). The rule is independent column by column (k^T h, delta
 *                             and the update of a column of h [K,V] read only that column), so
 *                             a strip of 32 columns runs both passes over the K rows with its
 *                             sums in registers:
 *                                 h = exp(g) h, kv = k^T h       (one pass)
 *                                 delta = beta (v - kv)
 *                                 h += k delta^T, o = q^T h      (the other)
 *   linear_attention[_state]  the same without beta: delta = v, no k^T h (MiniMax's lightning
 *                             attention, a decay per head).
 *   wkv[_state],              one chunk is (sequence, block of at most RC_EB channels), eight
 *   linear_recurrence[_state] channels a vector (the exponentials npuc_exp8's). WKV's state is
 *                             (numerator, denominator, max exponent) per channel, its empty
 *                             state (0, 0, WKV_EMPTY_MAX), not zeros.
 *
 * State. A stateful op updates its state [slots, ...] (f32, output 0) in place, on the state's
 * very bytes. Decode (no `last`) steps state[b] itself. Prefill (`last`) steps an empty state in
 * the chunk's scratch and copies it out after row `last`, into state[slot + b] (slot 0 without
 * a slot operand); the rows after `last` (a shorter prompt's right padding) still give y. A
 * `last` outside [0, S) or a slot outside [0, slots) is NPUC_E_INPUT, found before anything is
 * written (the reference kernels would keep the empty state, or write nothing).
 *
 * Numerics follow the reference kernels: every operand is read as f32 (bf16, f16 and f64
 * converted as torch's .float()), the sums are f32 and the output is rounded once to its
 * dtype. Fused multiply-adds, the exponentials and the order of the sums over N and K differ
 * from torch's: the results agree to f32's rounding.
 *
 * Run time allocates nothing: each thread's region of the session's shared scratch (the
 * caller's, for a flat entry point), sized at bind time, indexed by the pool's thread id.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "ops_generic.h"
#include "ops_recurrent.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define RC_AVX2 1
#endif

#define RC_CB 64                      /* channels per scan chunk, at most */
#define RC_VB 128                     /* value columns per delta-rule chunk, at most */
#define RC_EB 256                     /* channels per wkv / linear-recurrence chunk, at most */
#define RC_MAX (INT64_C(1) << 40)     /* sizes here are products of a few checked dims */
#define WKV_EMPTY_MAX (-1e38f)        /* the empty WKV state's max exponent (ir/recurrent_ops.py) */

static inline i64 imin(i64 a, i64 b) { return a < b ? a : b; }
static inline i64 imax(i64 a, i64 b) { return a > b ? a : b; }
static inline i64 cdiv(i64 a, i64 b) { return b > 0 ? (a + b - 1) / b : 0; }

/* a * b, or -1 past RC_MAX. */
static i64 mul_ok(i64 a, i64 b) {
    if (a < 0 || b < 0) return -1;
    if (a != 0 && b > RC_MAX / a) return -1;
    return a * b;
}

static int same_dims(const rt_view *a, const rt_view *b) {
    if (a->rank != b->rank) return 0;
    for (int32_t d = 0; d < a->rank; d++)
        if (a->shape[d] != b->shape[d]) return 0;
    return 1;
}

/* v's leading dims are `dims` (n of them). */
static int lead_is(const rt_view *v, const int64_t *dims, int32_t n) {
    if (v->rank < n) return 0;
    for (int32_t d = 0; d < n; d++)
        if (v->shape[d] != dims[d]) return 0;
    return 1;
}

/* The worker threads a run may use: the session's, never more than bind time sized scratch for. */
static inline int run_threads(const struct npuc_session *s, i64 bound) {
    int nt = rt_session_threads(s);
    return nt < 1 ? 1 : nt > bound ? (int)bound : nt;
}

/* n elements of v from element off as f32: v's own where it is f32, else converted into buf. */
static inline const float *as_f32(const rt_view *v, i64 off, i64 n, float *buf) {
    if (v->dtype == NPUC_F32) return (const float *)v->data + off;
    og_load_f32(v->data, v->dtype, off, 1, n, buf);
    return buf;
}

static inline i64 index_at(const rt_view *v) {
    return v->dtype == NPUC_I32 ? (i64)((const int32_t *)v->data)[0] : ((const int64_t *)v->data)[0];
}

/* A stateful op's tail from operand `at`: *last (-1: decode) and the first state row a prefill
 * writes; NPUC_E_INPUT when either is out of range. */
static int prefill_tail(const rt_step *st, int at, i64 S, i64 slots, i64 *last, i64 *row0) {
    *last = -1, *row0 = 0;
    if (st->n_in <= at) return 0;
    *last = index_at(&st->in[at]);
    if (*last < 0 || *last >= S) return NPUC_E_INPUT;
    if (st->n_in > at + 1) {
        *row0 = index_at(&st->in[at + 1]);
        if (*row0 < 0 || *row0 >= slots) return NPUC_E_INPUT;
    }
    return 0;
}

/* The stateful forms' shared rule (_check_tail): state f32[slots, want...], last and slot i64[1]
 * or i32[1], one sequence into a slot or as many sequences as slots; output 0 the state, in
 * place. */
static int check_tail(rt_binder *b, const rt_step *st, int n_ops, i64 rows, const int64_t *want, int32_t n_want) {
    const rt_view *state = &st->in[0];
    for (int32_t j = 1 + n_ops; j < st->n_in; j++) {
        const rt_view *t = &st->in[j];
        if (t->rank != 1 || t->shape[0] != 1 || (t->dtype != NPUC_I64 && t->dtype != NPUC_I32))
            return og_invalid(b, st, "its last and slot should be i64[1]");
    }
    int ok = state->rank == n_want + 1 && state->dtype == NPUC_F32;
    for (int32_t d = 0; ok && d < n_want; d++) ok = state->shape[d + 1] == want[d];
    if (!ok) return og_invalid(b, st, "its state should be f32[slots, %lld, ...]", (long long)want[0]);
    if (st->n_in == 1 + n_ops + 2 && rows != 1)
        return og_invalid(b, st, "it fills one slot from one sequence, not %lld", (long long)rows);
    if (st->n_in < 1 + n_ops + 2 && rows != state->shape[0])
        return og_invalid(b, st, "it runs %lld sequences over a state of %lld", (long long)rows,
                          (long long)state->shape[0]);
    int rc = og_check_out(b, st, 0, NPUC_F32, state->rank, state->shape);
    if (rc) return rc;
    if (!st->out_is_in0 || state->region == REGION_WEIGHTS)
        return og_invalid(b, st, "its result is its state, updated in place");
    return 0;
}

/* The chunks' threads, and the scratch they need (per_thread floats each). */
static int want_threads(rt_binder *b, const rt_step *st, i64 per_thread, i64 *bound) {
    i64 nt = imax(b->threads, 1), total = mul_ok(per_thread, nt);
    if (per_thread < 0 || total < 0)
        return og_no_kernel(b, st, "%s: a recurrence too large for the scratch", st->op->op);
    og_want_scratch(b, (uint64_t)total);
    *bound = nt;
    return 0;
}

/* ---- the flat entry points' checks (ops_recurrent.h) ---------------------------------------- */

/* n sizes, none negative, their product within RC_MAX. */
static int dims_ok(const i64 *d, int n) {
    i64 p = 1;
    for (int j = 0; j < n; j++)
        if ((p = mul_ok(p, d[j])) < 0) return 0;
    return 1;
}

/* A view of f32 bytes, for a flat entry point's job (the kernels read its data and dtype). */
static rt_view f32_view(const float *p) {
    rt_view v;
    memset(&v, 0, sizeof v);
    v.data = (void *)(uintptr_t)p;
    v.dtype = NPUC_F32;
    return v;
}

/* A flat call's state and tail: *last (-1: decode, or the pure op) and the first state row a
 * prefill writes. 1: last or slot out of range; -1: `rows` sequences that do not fit the state
 * (one into a slot; else one per slot), or a slot without a last. */
static int flat_tail(const float *state, i64 slots, const int64_t *last, const int64_t *slot, i64 rows, i64 S,
                     i64 *l, i64 *row0) {
    *l = -1, *row0 = 0;
    if (state == NULL) return last == NULL && slot == NULL ? 0 : -1;
    if (slots < 1 || (slot != NULL && last == NULL) || rows != (slot != NULL ? 1 : slots)) return -1;
    if (last == NULL) return 0;
    *l = *last;
    if (*l < 0 || *l >= S) return 1;
    if (slot != NULL) {
        *row0 = *slot;
        if (*row0 < 0 || *row0 >= slots) return 1;
    }
    return 0;
}

/* Whether a plan of per_thread floats a thread fits the caller's scratch on nt threads. */
static int flat_scratch_ok(i64 per_thread, int nt, i64 have) {
    i64 need = mul_ok(per_thread, imax(nt, 1));
    return per_thread >= 0 && need >= 0 && need <= have;
}

static inline int flat_threads(int nt) { return nt < 1 ? 1 : nt; }

/* ---- selective scan ---------------------------------------------------------------------------
 * i: 0 stateful, 1 batch, 2 S, 3 Dc, 4 N, 5 H, 6 G, 7 A per channel and state ([Dc,N]),
 *    8 channels per chunk, 9 chunks per group, 10 scratch floats per thread, 11 threads,
 *    12 h in scratch (not decode) */

typedef struct scan_job {
    const rt_view *x, *dt, *a, *bm, *cm, *d;
    void *y;
    int ydt, a_full, in_scratch;
    float *state;                 /* NULL: the pure op */
    float *scratch;
    i64 S, Dc, N, H, G, P, Ph;    /* P channels per group, Ph per dt head */
    i64 cb, nb, per_thread;
    i64 last, row0;               /* last -1: no state kept from a row (decode, or the pure op) */
} scan_job;

/* One channel's step with A [H]: h = da h + dtx B; returns C . h. */
static inline float scan_row(float *h, const float *bv, const float *cv, float da, float dtx, i64 N) {
    i64 n = 0;
    float sum = 0.0f;
#ifdef RC_AVX2
    __m256 va = _mm256_set1_ps(da), vx = _mm256_set1_ps(dtx), s0 = _mm256_setzero_ps(), s1 = s0;
    for (; n + 16 <= N; n += 16) {
        __m256 h0 = _mm256_fmadd_ps(va, _mm256_loadu_ps(h + n), _mm256_mul_ps(vx, _mm256_loadu_ps(bv + n)));
        __m256 h1 = _mm256_fmadd_ps(va, _mm256_loadu_ps(h + n + 8), _mm256_mul_ps(vx, _mm256_loadu_ps(bv + n + 8)));
        _mm256_storeu_ps(h + n, h0);
        _mm256_storeu_ps(h + n + 8, h1);
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(cv + n), h0, s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(cv + n + 8), h1, s1);
    }
    for (; n + 8 <= N; n += 8) {
        __m256 h0 = _mm256_fmadd_ps(va, _mm256_loadu_ps(h + n), _mm256_mul_ps(vx, _mm256_loadu_ps(bv + n)));
        _mm256_storeu_ps(h + n, h0);
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(cv + n), h0, s0);
    }
    sum = npuc_hsum8(_mm256_add_ps(s0, s1));
#endif
    for (; n < N; n++) {
        float hv = da * h[n] + dtx * bv[n];
        h[n] = hv;
        sum += cv[n] * hv;
    }
    return sum;
}

/* One channel's step with A [Dc,N] (its row av): h = exp(dt av) h + dtx B; returns C . h. */
static inline float scan_row_full(float *h, const float *av, const float *bv, const float *cv, float dtv, float dtx,
                                  i64 N) {
    i64 n = 0;
    float sum = 0.0f;
#ifdef RC_AVX2
    __m256 vt = _mm256_set1_ps(dtv), vx = _mm256_set1_ps(dtx), s0 = _mm256_setzero_ps();
    for (; n + 8 <= N; n += 8) {
        __m256 da = npuc_exp8(_mm256_mul_ps(vt, _mm256_loadu_ps(av + n)));
        __m256 h0 = _mm256_fmadd_ps(da, _mm256_loadu_ps(h + n), _mm256_mul_ps(vx, _mm256_loadu_ps(bv + n)));
        _mm256_storeu_ps(h + n, h0);
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(cv + n), h0, s0);
    }
    sum = npuc_hsum8(s0);
#endif
    for (; n < N; n++) {
        float hv = expf(dtv * av[n]) * h[n] + dtx * bv[n];
        h[n] = hv;
        sum += cv[n] * hv;
    }
    return sum;
}

static void scan_chunk(const void *ctx, i64 c, int tid) {
    const scan_job *J = ctx;
    i64 N = J->N, cb = J->cb;
    i64 b = c / (J->G * J->nb), g = c / J->nb % J->G, d0 = g * J->P + c % J->nb * cb;
    i64 nc = imin(cb, (g + 1) * J->P - d0), h0 = d0 / J->Ph, h1 = (d0 + nc - 1) / J->Ph;
    /* this thread's scratch: [h cb*N (prefill, pure)] [B N] [C N] [x cb] [y cb] [A cb*N or cb] [D cb] */
    float *w = J->scratch + (i64)tid * J->per_thread;
    float *hb = w, *bq = hb + (J->in_scratch ? cb * N : 0), *cq = bq + N, *xq = cq + N, *yq = xq + cb;
    float *aq = yq + cb, *dq = aq + (J->a_full ? cb * N : cb);
    float *h = J->in_scratch ? hb : J->state + (b * J->Dc + d0) * N;
    if (J->in_scratch) memset(h, 0, (size_t)(nc * N) * sizeof(float));
    const float *A = J->a_full ? as_f32(J->a, d0 * N, nc * N, aq) : as_f32(J->a, h0, h1 - h0 + 1, aq);
    const float *D = as_f32(J->d, d0, nc, dq);
    for (i64 s = 0; s < J->S; s++) {
        i64 t = b * J->S + s;
        const float *x = as_f32(J->x, t * J->Dc + d0, nc, xq);
        const float *bv = as_f32(J->bm, (t * J->G + g) * N, N, bq);
        const float *cv = as_f32(J->cm, (t * J->G + g) * N, N, cq);
        float *y = J->ydt == NPUC_F32 ? (float *)J->y + t * J->Dc + d0 : yq;
        for (i64 hh = h0; hh <= h1; hh++) { /* the channels of dt head hh */
            i64 lo = imax(d0, hh * J->Ph) - d0, hi = imin(d0 + nc, (hh + 1) * J->Ph) - d0;
            float dtv = rt_load_f(J->dt->data, J->dt->dtype, t * J->H + hh);
            if (J->a_full) {
                for (i64 j = lo; j < hi; j++)
                    y[j] = scan_row_full(h + j * N, A + j * N, bv, cv, dtv, dtv * x[j], N) + D[j] * x[j];
            } else {
                float da = expf(dtv * A[hh - h0]);
                for (i64 j = lo; j < hi; j++) y[j] = scan_row(h + j * N, bv, cv, da, dtv * x[j], N) + D[j] * x[j];
            }
        }
        if (y == yq) og_store_f32(J->y, J->ydt, t * J->Dc + d0, yq, nc);
        if (s == J->last) memcpy(J->state + ((J->row0 + b) * J->Dc + d0) * N, h, (size_t)(nc * N) * sizeof(float));
    }
}

/* Channel blocks within a group: at most RC_CB, fewer when that leaves nt threads idle; 0, or
 * -1 for sizes past RC_MAX. */
static int scan_plan(i64 Bt, i64 Dc, i64 N, i64 G, int a_full, int in_scratch, int nt, i64 *cb_out,
                     i64 *per_thread) {
    i64 P = Dc / G, cb = imax(imin(RC_CB, P), 1), groups = mul_ok(Bt, G), per;
    if (groups < 0 || mul_ok(groups, P) < 0) return -1;
    while (cb > 8 && groups * cdiv(P, cb) < 2 * (i64)imax(nt, 1)) cb = (cb + 1) / 2;
    if ((per = mul_ok(cb, N)) < 0) return -1;
    *cb_out = cb;
    *per_thread = (in_scratch ? per : 0) + 2 * N + 3 * cb + (a_full ? per : cb);
    return 0;
}

static void scan_launch(scan_job *J, i64 Bt, int nt) {
    J->P = J->Dc / J->G, J->Ph = J->Dc / J->H;
    i64 chunks = J->S > 0 ? Bt * J->G * J->nb : 0;
    if (chunks > 0) npuc_parallel(scan_chunk, J, chunks, nt);
}

static int run_scan(const rt_step *st, npuc_session *s) {
    const i64 *i = st->i;
    int at = (int)i[0];
    scan_job J = {.x = &st->in[at], .dt = &st->in[at + 1], .a = &st->in[at + 2], .bm = &st->in[at + 3],
                  .cm = &st->in[at + 4], .d = &st->in[at + 5], .y = st->out[at].data, .ydt = st->out[at].dtype,
                  .a_full = (int)i[7], .in_scratch = (int)i[12], .state = at ? st->in[0].data : NULL,
                  .scratch = rt_session_scratch(s), .S = i[2], .Dc = i[3], .N = i[4], .H = i[5], .G = i[6],
                  .cb = i[8], .nb = i[9], .per_thread = i[10], .last = -1};
    if (at && prefill_tail(st, 7, J.S, st->in[0].shape[0], &J.last, &J.row0)) return NPUC_E_INPUT;
    scan_launch(&J, i[1], run_threads(s, i[11]));
    return 0;
}

int rt_bind_selective_scan(rt_binder *b, rt_step *st) {
    int stateful = strcmp(st->op->op, "selective_scan_state") == 0, at = stateful, rc;
    if ((rc = og_check_arity(b, st, 6 + at, stateful ? 9 : 6, 1 + at))) return rc;
    const rt_view *x = &st->in[at], *dt = &st->in[at + 1], *a = &st->in[at + 2], *bm = &st->in[at + 3];
    const rt_view *cm = &st->in[at + 4], *d = &st->in[at + 5];
    if (x->rank != 3 || dt->rank != 3 || bm->rank != 4)
        return og_invalid(b, st, "x [b,S,Dc], dt [b,S,H], A [H] or [Dc,N], B and C [b,S,G,N], D [Dc], with H and G "
                          "dividing Dc");
    i64 Bt = x->shape[0], S = x->shape[1], Dc = x->shape[2], H = dt->shape[2], G = bm->shape[2], N = bm->shape[3];
    int a_full = a->rank == 2;
    int ok = lead_is(dt, x->shape, 2) && H > 0 && Dc % H == 0 && lead_is(bm, x->shape, 2) && G > 0 && Dc % G == 0 &&
             same_dims(cm, bm) && ((a->rank == 1 && a->shape[0] == H) || (a_full && a->shape[0] == Dc &&
                                                                           a->shape[1] == N)) &&
             d->rank == 1 && d->shape[0] == Dc;
    for (int k = 0; ok && k < 6; k++) ok = og_is_float(st->in[at + k].dtype);
    if (!ok)
        return og_invalid(b, st, "x [b,S,Dc], dt [b,S,H], A [H] or [Dc,N], B and C [b,S,G,N], D [Dc] (floats), with "
                          "H and G dividing Dc");
    if ((rc = og_check_out(b, st, at, x->dtype, 3, x->shape))) return rc;
    if (stateful) {
        const int64_t want[2] = {Dc, N};
        if ((rc = check_tail(b, st, 6, Bt, want, 2))) return rc;
    }
    int in_scratch = !stateful || st->n_in > 7;
    i64 cb, per_thread, *i = st->i;
    if (scan_plan(Bt, Dc, N, G, a_full, in_scratch, b->threads, &cb, &per_thread))
        return og_no_kernel(b, st, "selective_scan: too many channels");
    if ((rc = want_threads(b, st, per_thread, &i[11]))) return rc;
    i[0] = at, i[1] = Bt, i[2] = S, i[3] = Dc, i[4] = N, i[5] = H, i[6] = G, i[7] = a_full, i[8] = cb;
    i[9] = cdiv(Dc / G, cb), i[10] = per_thread, i[12] = in_scratch;
    st->run = run_scan;
    return 0;
}

int64_t npuc_selective_scan_scratch_floats(int64_t Bt, int64_t Dc, int64_t N, int64_t G, int a_full, int in_scratch,
                                           int nt) {
    i64 cb, per;
    const i64 dims[3] = {Bt, Dc, N};
    if (!dims_ok(dims, 3) || G < 1 || Dc % G || scan_plan(Bt, Dc, N, G, a_full, in_scratch, nt, &cb, &per)) return -1;
    return mul_ok(per, imax(nt, 1));
}

int npuc_selective_scan_f32(const float *x, const float *dt, const float *A, int a_full, const float *B,
                            const float *C, const float *D, float *y, float *state, int64_t slots,
                            const int64_t *last, const int64_t *slot, int64_t Bt, int64_t S, int64_t Dc, int64_t N,
                            int64_t H, int64_t G, float *scratch, int64_t scratch_floats, int nt) {
    const i64 xs[3] = {Bt, S, Dc}, bs[4] = {Bt, S, G, N}, hs[3] = {slots, Dc, N};
    i64 cb, per, l, row0;
    int in_scratch = state == NULL || last != NULL, rc;
    if (!dims_ok(xs, 3) || !dims_ok(bs, 4) || !dims_ok(hs, 3) || H < 1 || G < 1 || Dc % H || Dc % G ||
        scan_plan(Bt, Dc, N, G, a_full, in_scratch, nt, &cb, &per) || !flat_scratch_ok(per, nt, scratch_floats))
        return -1;
    if ((rc = flat_tail(state, slots, last, slot, Bt, S, &l, &row0))) return rc;
    rt_view vx = f32_view(x), vdt = f32_view(dt), va = f32_view(A), vb = f32_view(B), vc = f32_view(C);
    rt_view vd = f32_view(D);
    scan_job J = {.x = &vx, .dt = &vdt, .a = &va, .bm = &vb, .cm = &vc, .d = &vd, .y = y, .ydt = NPUC_F32,
                  .a_full = a_full != 0, .in_scratch = in_scratch, .state = state, .scratch = scratch, .S = S,
                  .Dc = Dc, .N = N, .H = H, .G = G, .cb = cb, .nb = cdiv(Dc / G, cb), .per_thread = per, .last = l,
                  .row0 = row0};
    scan_launch(&J, Bt, flat_threads(nt));
    return 0;
}

/* ---- gated delta rule, and linear attention (the rule without beta: delta = v) --------------------
 * i: 0 stateful, 1 batch, 2 S, 3 H, 4 K, 5 V, 6 g per key ([b,S,H,K]), 7 columns per chunk,
 *    8 chunks per head, 9 scratch floats per thread, 10 threads, 11 h in scratch (not decode),
 *    12 the operands but the state (5; 4: linear attention) */

typedef struct delta_job {
    const rt_view *q, *k, *v, *g, *beta; /* beta NULL: linear attention */
    void *o;
    int odt, g_key, in_scratch;
    float *state;                 /* NULL: the pure op */
    float *scratch;
    i64 S, H, K, V, vb, nvb, per_thread;
    i64 last, row0;
} delta_job;

/* Columns [0, w) of one token (w <= 32) in plain C: the rule as the header states it; with beta
 * NULL, linear attention's (delta = v: no k^T h). */
static void delta_strip(float *h, i64 ld, i64 K, i64 w, const float *q, const float *k, const float *v,
                        const float *dec, const float *beta, float *o) {
    float kv[32] = {0}, dl[32], acc[32] = {0};
    for (i64 r = 0; r < K; r++) {
        float *row = h + r * ld;
        float e = dec[r], kr = k[r];
        if (beta == NULL) {
            for (i64 j = 0; j < w; j++) row[j] *= e;
            continue;
        }
        for (i64 j = 0; j < w; j++) {
            float x = row[j] * e;
            row[j] = x;
            kv[j] += kr * x;
        }
    }
    for (i64 j = 0; j < w; j++) dl[j] = beta != NULL ? (v[j] - kv[j]) * *beta : v[j];
    for (i64 r = 0; r < K; r++) {
        float *row = h + r * ld;
        float kr = k[r], qr = q[r];
        for (i64 j = 0; j < w; j++) {
            float x = row[j] + kr * dl[j];
            row[j] = x;
            acc[j] += qr * x;
        }
    }
    memcpy(o, acc, (size_t)w * sizeof(float));
}

#ifdef RC_AVX2
/* Columns [0, 8m) of one token (m = 1 or 4): the sums of 8m columns in m registers. */
static inline void delta_strip8(float *h, i64 ld, i64 K, int m, const float *q, const float *k, const float *v,
                                const float *dec, const float *beta, float *o) {
    __m256 acc[4], dl[4];
    for (int u = 0; u < m; u++) acc[u] = _mm256_setzero_ps();
    for (i64 r = 0; r < K; r++) {
        float *row = h + r * ld;
        __m256 e = _mm256_set1_ps(dec[r]), kr = _mm256_set1_ps(k[r]);
        for (int u = 0; u < m; u++) {
            __m256 x = _mm256_mul_ps(_mm256_loadu_ps(row + 8 * u), e);
            _mm256_storeu_ps(row + 8 * u, x);
            if (beta != NULL) acc[u] = _mm256_fmadd_ps(kr, x, acc[u]);
        }
    }
    for (int u = 0; u < m; u++) {
        dl[u] = beta != NULL ? _mm256_mul_ps(_mm256_sub_ps(_mm256_loadu_ps(v + 8 * u), acc[u]), _mm256_set1_ps(*beta))
                             : _mm256_loadu_ps(v + 8 * u);
        acc[u] = _mm256_setzero_ps();
    }
    for (i64 r = 0; r < K; r++) {
        float *row = h + r * ld;
        __m256 kr = _mm256_set1_ps(k[r]), qr = _mm256_set1_ps(q[r]);
        for (int u = 0; u < m; u++) {
            __m256 x = _mm256_fmadd_ps(kr, dl[u], _mm256_loadu_ps(row + 8 * u));
            _mm256_storeu_ps(row + 8 * u, x);
            acc[u] = _mm256_fmadd_ps(qr, x, acc[u]);
        }
    }
    for (int u = 0; u < m; u++) _mm256_storeu_ps(o + 8 * u, acc[u]);
}
#endif

/* One token over n columns of a head's state (K rows, ld floats apart); beta NULL: linear
 * attention. */
static void delta_token(float *h, i64 ld, i64 K, i64 n, const float *q, const float *k, const float *v,
                        const float *dec, const float *beta, float *o) {
    i64 c = 0;
#ifdef RC_AVX2
    for (; c + 32 <= n; c += 32) delta_strip8(h + c, ld, K, 4, q, k, v + c, dec, beta, o + c);
    for (; c + 8 <= n; c += 8) delta_strip8(h + c, ld, K, 1, q, k, v + c, dec, beta, o + c);
#endif
    for (; c < n; c += 32) delta_strip(h + c, ld, K, imin(32, n - c), q, k, v + c, dec, beta, o + c);
}

static void delta_chunk(const void *ctx, i64 c, int tid) {
    const delta_job *J = ctx;
    i64 K = J->K, V = J->V, H = J->H, vb = J->vb;
    i64 b = c / (H * J->nvb), hd = c / J->nvb % H, v0 = c % J->nvb * vb, nv = imin(vb, V - v0);
    /* this thread's scratch: [h K*vb (prefill, pure)] [q K] [k K] [decay K] [v vb] [o vb] */
    float *w = J->scratch + (i64)tid * J->per_thread;
    float *hb = w, *qq = hb + (J->in_scratch ? K * vb : 0), *kq = qq + K, *dec = kq + K, *vq = dec + K, *oq = vq + vb;
    float *h = J->in_scratch ? hb : J->state + (b * H + hd) * K * V + v0;
    i64 ld = J->in_scratch ? nv : V;
    if (J->in_scratch) memset(h, 0, (size_t)(K * nv) * sizeof(float));
    for (i64 s = 0; s < J->S; s++) {
        i64 t = (b * J->S + s) * H + hd; /* the (sequence, token, head) row */
        const float *q = as_f32(J->q, t * K, K, qq), *k = as_f32(J->k, t * K, K, kq);
        const float *v = as_f32(J->v, t * V + v0, nv, vq);
        if (J->g_key) {
            const float *gk = as_f32(J->g, t * K, K, dec);
            for (i64 r = 0; r < K; r++) dec[r] = expf(gk[r]);
        } else {
            float e = expf(rt_load_f(J->g->data, J->g->dtype, t));
            for (i64 r = 0; r < K; r++) dec[r] = e;
        }
        float *o = J->odt == NPUC_F32 ? (float *)J->o + t * V + v0 : oq;
        float bt = J->beta != NULL ? rt_load_f(J->beta->data, J->beta->dtype, t) : 0.0f;
        delta_token(h, ld, K, nv, q, k, v, dec, J->beta != NULL ? &bt : NULL, o);
        if (o == oq) og_store_f32(J->o, J->odt, t * V + v0, oq, nv);
        if (s == J->last) {
            float *dst = J->state + ((J->row0 + b) * H + hd) * K * V + v0;
            for (i64 r = 0; r < K; r++) memcpy(dst + r * V, h + r * ld, (size_t)nv * sizeof(float));
        }
    }
}

/* Value columns per chunk: at most RC_VB, fewer (multiples of 8) when that leaves nt threads
 * idle; 0, or -1 for sizes past RC_MAX. */
static int delta_plan(i64 Bt, i64 H, i64 K, i64 V, int in_scratch, int nt, i64 *vb_out, i64 *per_thread) {
    i64 heads = mul_ok(Bt, H), vb = imax(imin(RC_VB, V), 1), per;
    if (heads < 0 || mul_ok(heads, V) < 0) return -1;
    while (vb > 32 && heads * cdiv(V, vb) < 2 * (i64)imax(nt, 1)) vb = (vb / 2 + 7) / 8 * 8;
    if ((per = mul_ok(K, vb)) < 0) return -1;
    *vb_out = vb;
    *per_thread = (in_scratch ? per : 0) + 3 * K + 2 * vb;
    return 0;
}

static void delta_launch(const delta_job *J, i64 Bt, int nt) {
    i64 chunks = J->S > 0 ? Bt * J->H * J->nvb : 0;
    if (chunks > 0) npuc_parallel(delta_chunk, J, chunks, nt);
}

static int run_delta(const rt_step *st, npuc_session *s) {
    const i64 *i = st->i;
    int at = (int)i[0];
    int n_ops = (int)i[12];
    delta_job J = {.q = &st->in[at], .k = &st->in[at + 1], .v = &st->in[at + 2], .g = &st->in[at + 3],
                   .beta = n_ops > 4 ? &st->in[at + 4] : NULL, .o = st->out[at].data, .odt = st->out[at].dtype,
                   .g_key = (int)i[6], .in_scratch = (int)i[11], .state = at ? st->in[0].data : NULL,
                   .scratch = rt_session_scratch(s), .S = i[2], .H = i[3], .K = i[4], .V = i[5], .vb = i[7],
                   .nvb = i[8], .per_thread = i[9], .last = -1};
    if (at && prefill_tail(st, at + n_ops, J.S, st->in[0].shape[0], &J.last, &J.row0)) return NPUC_E_INPUT;
    delta_launch(&J, i[1], run_threads(s, i[10]));
    return 0;
}

int rt_bind_gated_delta_rule(rt_binder *b, rt_step *st) {
    int plain = strncmp(st->op->op, "linear_attention", 16) == 0, n_ops = plain ? 4 : 5;
    int stateful = strcmp(st->op->op, plain ? "linear_attention_state" : "gated_delta_rule_state") == 0;
    int at = stateful, rc;
    if ((rc = og_check_arity(b, st, n_ops + at, n_ops + (stateful ? 3 : 0), 1 + at))) return rc;
    const rt_view *q = &st->in[at], *k = &st->in[at + 1], *v = &st->in[at + 2], *g = &st->in[at + 3];
    const rt_view *beta = plain ? NULL : &st->in[at + 4];
    int g_key = g->rank == 4;
    int ok = q->rank == 4 && same_dims(k, q) && v->rank == 4 && lead_is(v, q->shape, 3) &&
             ((g->rank == 3 && lead_is(g, q->shape, 3)) || (g_key && !plain && same_dims(g, q))) &&
             (plain || (beta->rank == 3 && lead_is(beta, q->shape, 3)));
    for (int j = 0; ok && j < n_ops; j++) ok = og_is_float(st->in[at + j].dtype);
    if (!ok)
        return og_invalid(b, st, plain ? "q and k [b,S,H,K], v [b,S,H,V], g [b,S,H] (floats)"
                                       : "q and k [b,S,H,K], v [b,S,H,V], g [b,S,H] or [b,S,H,K], beta [b,S,H] "
                                         "(floats)");
    i64 Bt = q->shape[0], S = q->shape[1], H = q->shape[2], K = q->shape[3], V = v->shape[3];
    const int64_t oshape[4] = {Bt, S, H, V};
    if ((rc = og_check_out(b, st, at, v->dtype, 4, oshape))) return rc;
    if (stateful) {
        const int64_t want[3] = {H, K, V};
        if ((rc = check_tail(b, st, n_ops, Bt, want, 3))) return rc;
    }
    int in_scratch = !stateful || st->n_in > 1 + n_ops;
    i64 vb, per_thread, *i = st->i;
    if (delta_plan(Bt, H, K, V, in_scratch, b->threads, &vb, &per_thread))
        return og_no_kernel(b, st, "%s: too many heads", st->op->op);
    if ((rc = want_threads(b, st, per_thread, &i[10]))) return rc;
    i[0] = at, i[1] = Bt, i[2] = S, i[3] = H, i[4] = K, i[5] = V, i[6] = g_key, i[7] = vb, i[8] = cdiv(V, vb);
    i[9] = per_thread, i[11] = in_scratch, i[12] = n_ops;
    st->run = run_delta;
    return 0;
}

int64_t npuc_gated_delta_rule_scratch_floats(int64_t Bt, int64_t H, int64_t K, int64_t V, int in_scratch, int nt) {
    i64 vb, per;
    const i64 dims[4] = {Bt, H, K, V};
    if (!dims_ok(dims, 4) || delta_plan(Bt, H, K, V, in_scratch, nt, &vb, &per)) return -1;
    return mul_ok(per, imax(nt, 1));
}

int npuc_gated_delta_rule_f32(const float *q, const float *k, const float *v, const float *g, int g_key,
                              const float *beta, float *o, float *state, int64_t slots, const int64_t *last,
                              const int64_t *slot, int64_t Bt, int64_t S, int64_t H, int64_t K, int64_t V,
                              float *scratch, int64_t scratch_floats, int nt) {
    const i64 qs[4] = {Bt, S, H, K}, vs[4] = {Bt, S, H, V}, hs[4] = {slots, H, K, V};
    i64 vb, per, l, row0;
    int in_scratch = state == NULL || last != NULL, rc;
    if (!dims_ok(qs, 4) || !dims_ok(vs, 4) || !dims_ok(hs, 4) ||
        delta_plan(Bt, H, K, V, in_scratch, nt, &vb, &per) || !flat_scratch_ok(per, nt, scratch_floats))
        return -1;
    if ((rc = flat_tail(state, slots, last, slot, Bt, S, &l, &row0))) return rc;
    rt_view vq = f32_view(q), vk = f32_view(k), vv = f32_view(v), vg = f32_view(g), vbeta = f32_view(beta);
    delta_job J = {.q = &vq, .k = &vk, .v = &vv, .g = &vg, .beta = beta != NULL ? &vbeta : NULL, .o = o,
                   .odt = NPUC_F32, .g_key = g_key != 0, .in_scratch = in_scratch, .state = state,
                   .scratch = scratch, .S = S, .H = H, .K = K, .V = V, .vb = vb, .nvb = cdiv(V, vb), .per_thread = per,
                   .last = l, .row0 = row0};
    delta_launch(&J, Bt, flat_threads(nt));
    return 0;
}

/* ---- the elementwise recurrences: WKV and the linear recurrence ----------------------------------
 * Channel blocks: at most RC_EB, fewer (multiples of 8) when that leaves nt threads idle. A
 * thread's scratch: h_cb floats a channel for the state (prefill, the pure op) and io_cb for the
 * operands converted to f32 and the output before its rounding. */
static int ew_plan(i64 Bt, i64 C, i64 h_cb, i64 io_cb, int in_scratch, int nt, i64 *cb_out, i64 *per_thread) {
    i64 cb = imax(imin(RC_EB, C), 1);
    if (mul_ok(Bt, C) < 0) return -1;
    while (cb > 16 && Bt * cdiv(C, cb) < 2 * (i64)imax(nt, 1)) cb = (cb / 2 + 7) / 8 * 8;
    *cb_out = cb;
    *per_thread = ((in_scratch ? h_cb : 0) + io_cb) * cb;
    return 0;
}

/* ---- WKV --------------------------------------------------------------------------------------
 * i: 0 stateful, 1 batch, 2 S, 3 C, 4 channels per chunk, 5 scratch floats per thread, 6 threads,
 *    7 the state in scratch (not decode) */

typedef struct wkv_job {
    const rt_view *k, *v, *w, *u;
    void *y;
    int ydt, in_scratch;
    float *state;                 /* NULL: the pure op */
    float *scratch;
    i64 S, C, cb, nb, per_thread;
    i64 last, row0;
} wkv_job;

/* One token over n channels: y from the state before it, then the state after it. */
static void wkv_token(float *num, float *den, float *mx, const float *k, const float *v, const float *w,
                      const float *u, float *y, i64 n) {
    i64 c = 0;
#ifdef RC_AVX2
    for (; c + 8 <= n; c += 8) {
        __m256 kk = _mm256_loadu_ps(k + c), vv = _mm256_loadu_ps(v + c), m0 = _mm256_loadu_ps(mx + c);
        __m256 nm = _mm256_loadu_ps(num + c), dn = _mm256_loadu_ps(den + c);
        __m256 ku = _mm256_add_ps(kk, _mm256_loadu_ps(u + c)), m = _mm256_max_ps(m0, ku);
        __m256 e1 = npuc_exp8(_mm256_sub_ps(m0, m)), e2 = npuc_exp8(_mm256_sub_ps(ku, m));
        __m256 a = _mm256_add_ps(_mm256_mul_ps(e1, nm), _mm256_mul_ps(e2, vv));
        _mm256_storeu_ps(y + c, _mm256_div_ps(a, _mm256_add_ps(_mm256_mul_ps(e1, dn), e2)));
        __m256 mw = _mm256_add_ps(m0, _mm256_loadu_ps(w + c));
        m = _mm256_max_ps(mw, kk);
        e1 = npuc_exp8(_mm256_sub_ps(mw, m)), e2 = npuc_exp8(_mm256_sub_ps(kk, m));
        _mm256_storeu_ps(num + c, _mm256_add_ps(_mm256_mul_ps(e1, nm), _mm256_mul_ps(e2, vv)));
        _mm256_storeu_ps(den + c, _mm256_add_ps(_mm256_mul_ps(e1, dn), e2));
        _mm256_storeu_ps(mx + c, m);
    }
#endif
    for (; c < n; c++) {
        float ku = k[c] + u[c], m = fmaxf(mx[c], ku);
        float e1 = expf(mx[c] - m), e2 = expf(ku - m);
        y[c] = (e1 * num[c] + e2 * v[c]) / (e1 * den[c] + e2);
        float mw = mx[c] + w[c];
        m = fmaxf(mw, k[c]);
        e1 = expf(mw - m), e2 = expf(k[c] - m);
        num[c] = e1 * num[c] + e2 * v[c];
        den[c] = e1 * den[c] + e2;
        mx[c] = m;
    }
}

static void wkv_chunk(const void *ctx, i64 c, int tid) {
    const wkv_job *J = ctx;
    i64 C = J->C, cb = J->cb, b = c / J->nb, c0 = c % J->nb * cb, n = imin(cb, C - c0);
    /* this thread's scratch: [num den max: 3 cb (prefill, pure)] [k cb] [v cb] [w cb] [u cb] [y cb] */
    float *wk = J->scratch + (i64)tid * J->per_thread;
    float *kq = wk + (J->in_scratch ? 3 * cb : 0), *vq = kq + cb, *wq = vq + cb, *uq = wq + cb, *yq = uq + cb;
    float *num = J->in_scratch ? wk : J->state + b * 3 * C + c0;
    float *den = J->in_scratch ? wk + cb : num + C, *mx = J->in_scratch ? wk + 2 * cb : num + 2 * C;
    if (J->in_scratch)
        for (i64 j = 0; j < n; j++) num[j] = 0.0f, den[j] = 0.0f, mx[j] = WKV_EMPTY_MAX;
    const float *w = as_f32(J->w, c0, n, wq), *u = as_f32(J->u, c0, n, uq);
    for (i64 s = 0; s < J->S; s++) {
        i64 t = b * J->S + s;
        const float *k = as_f32(J->k, t * C + c0, n, kq), *v = as_f32(J->v, t * C + c0, n, vq);
        float *y = J->ydt == NPUC_F32 ? (float *)J->y + t * C + c0 : yq;
        wkv_token(num, den, mx, k, v, w, u, y, n);
        if (y == yq) og_store_f32(J->y, J->ydt, t * C + c0, yq, n);
        if (s == J->last) {
            float *dst = J->state + (J->row0 + b) * 3 * C + c0;
            memcpy(dst, num, (size_t)n * sizeof(float));
            memcpy(dst + C, den, (size_t)n * sizeof(float));
            memcpy(dst + 2 * C, mx, (size_t)n * sizeof(float));
        }
    }
}

static void wkv_launch(const wkv_job *J, i64 Bt, int nt) {
    i64 chunks = J->S > 0 ? Bt * J->nb : 0;
    if (chunks > 0) npuc_parallel(wkv_chunk, J, chunks, nt);
}

static int run_wkv(const rt_step *st, npuc_session *s) {
    const i64 *i = st->i;
    int at = (int)i[0];
    wkv_job J = {.k = &st->in[at], .v = &st->in[at + 1], .w = &st->in[at + 2], .u = &st->in[at + 3],
                 .y = st->out[at].data, .ydt = st->out[at].dtype, .in_scratch = (int)i[7],
                 .state = at ? st->in[0].data : NULL, .scratch = rt_session_scratch(s), .S = i[2], .C = i[3],
                 .cb = i[4], .nb = cdiv(i[3], i[4]), .per_thread = i[5], .last = -1};
    if (at && prefill_tail(st, 5, J.S, st->in[0].shape[0], &J.last, &J.row0)) return NPUC_E_INPUT;
    wkv_launch(&J, i[1], run_threads(s, i[6]));
    return 0;
}

int rt_bind_wkv(rt_binder *b, rt_step *st) {
    int stateful = strcmp(st->op->op, "wkv_state") == 0, at = stateful, rc;
    if ((rc = og_check_arity(b, st, 4 + at, stateful ? 7 : 4, 1 + at))) return rc;
    const rt_view *k = &st->in[at], *v = &st->in[at + 1], *w = &st->in[at + 2], *u = &st->in[at + 3];
    int ok = k->rank == 3 && same_dims(v, k) && w->rank == 1 && w->shape[0] == k->shape[2] && same_dims(u, w);
    for (int j = 0; ok && j < 4; j++) ok = og_is_float(st->in[at + j].dtype);
    if (!ok) return og_invalid(b, st, "k and v [b,S,C], w and u [C] (floats)");
    i64 Bt = k->shape[0], S = k->shape[1], C = k->shape[2];
    if ((rc = og_check_out(b, st, at, v->dtype, 3, k->shape))) return rc;
    if (stateful) {
        const int64_t want[2] = {3, C};
        if ((rc = check_tail(b, st, 4, Bt, want, 2))) return rc;
    }
    int in_scratch = !stateful || st->n_in > 5;
    i64 cb, per_thread, *i = st->i;
    if (ew_plan(Bt, C, 3, 5, in_scratch, b->threads, &cb, &per_thread))
        return og_no_kernel(b, st, "wkv: too many channels");
    if ((rc = want_threads(b, st, per_thread, &i[6]))) return rc;
    i[0] = at, i[1] = Bt, i[2] = S, i[3] = C, i[4] = cb, i[5] = per_thread, i[7] = in_scratch;
    st->run = run_wkv;
    return 0;
}

int64_t npuc_wkv_scratch_floats(int64_t Bt, int64_t C, int in_scratch, int nt) {
    i64 cb, per;
    const i64 dims[2] = {Bt, C};
    if (!dims_ok(dims, 2) || ew_plan(Bt, C, 3, 5, in_scratch, nt, &cb, &per)) return -1;
    return mul_ok(per, imax(nt, 1));
}

int npuc_wkv_f32(const float *k, const float *v, const float *w, const float *u, float *y, float *state,
                 int64_t slots, const int64_t *last, const int64_t *slot, int64_t Bt, int64_t S, int64_t C,
                 float *scratch, int64_t scratch_floats, int nt) {
    const i64 ks[3] = {Bt, S, C}, hs[3] = {slots, 3, C};
    i64 cb, per, l, row0;
    int in_scratch = state == NULL || last != NULL, rc;
    if (!dims_ok(ks, 3) || !dims_ok(hs, 3) || ew_plan(Bt, C, 3, 5, in_scratch, nt, &cb, &per) ||
        !flat_scratch_ok(per, nt, scratch_floats))
        return -1;
    if ((rc = flat_tail(state, slots, last, slot, Bt, S, &l, &row0))) return rc;
    rt_view vk = f32_view(k), vv = f32_view(v), vw = f32_view(w), vu = f32_view(u);
    wkv_job J = {.k = &vk, .v = &vv, .w = &vw, .u = &vu, .y = y, .ydt = NPUC_F32, .in_scratch = in_scratch,
                 .state = state, .scratch = scratch, .S = S, .C = C, .cb = cb, .nb = cdiv(C, cb), .per_thread = per,
                 .last = l, .row0 = row0};
    wkv_launch(&J, Bt, flat_threads(nt));
    return 0;
}

/* ---- the linear recurrence (RG-LRU's): h = a h + x, y = h ---------------------------------------
 * i: 0 stateful, 1 batch, 2 S, 3 C, 4 channels per chunk, 5 scratch floats per thread, 6 threads,
 *    7 the state in scratch (not decode) */

typedef struct lin_job {
    const rt_view *x, *a;
    void *y;
    int ydt, in_scratch;
    float *state;                 /* NULL: the pure op */
    float *scratch;
    i64 S, C, cb, nb, per_thread;
    i64 last, row0;
} lin_job;

static void lin_chunk(const void *ctx, i64 c, int tid) {
    const lin_job *J = ctx;
    i64 C = J->C, cb = J->cb, b = c / J->nb, c0 = c % J->nb * cb, n = imin(cb, C - c0);
    /* this thread's scratch: [h cb (prefill, pure)] [x cb] [a cb] [y cb] */
    float *wk = J->scratch + (i64)tid * J->per_thread;
    float *xq = wk + (J->in_scratch ? cb : 0), *aq = xq + cb, *yq = aq + cb;
    float *h = J->in_scratch ? wk : J->state + b * C + c0;
    if (J->in_scratch) memset(h, 0, (size_t)n * sizeof(float));
    for (i64 s = 0; s < J->S; s++) {
        i64 t = b * J->S + s;
        const float *x = as_f32(J->x, t * C + c0, n, xq), *a = as_f32(J->a, t * C + c0, n, aq);
        float *y = J->ydt == NPUC_F32 ? (float *)J->y + t * C + c0 : yq;
        for (i64 j = 0; j < n; j++) {
            float hv = a[j] * h[j] + x[j];
            h[j] = hv;
            y[j] = hv;
        }
        if (y == yq) og_store_f32(J->y, J->ydt, t * C + c0, yq, n);
        if (s == J->last) memcpy(J->state + (J->row0 + b) * C + c0, h, (size_t)n * sizeof(float));
    }
}

static void lin_launch(const lin_job *J, i64 Bt, int nt) {
    i64 chunks = J->S > 0 ? Bt * J->nb : 0;
    if (chunks > 0) npuc_parallel(lin_chunk, J, chunks, nt);
}

static int run_lin(const rt_step *st, npuc_session *s) {
    const i64 *i = st->i;
    int at = (int)i[0];
    lin_job J = {.x = &st->in[at], .a = &st->in[at + 1], .y = st->out[at].data, .ydt = st->out[at].dtype,
                 .in_scratch = (int)i[7], .state = at ? st->in[0].data : NULL, .scratch = rt_session_scratch(s),
                 .S = i[2], .C = i[3], .cb = i[4], .nb = cdiv(i[3], i[4]), .per_thread = i[5], .last = -1};
    if (at && prefill_tail(st, 3, J.S, st->in[0].shape[0], &J.last, &J.row0)) return NPUC_E_INPUT;
    lin_launch(&J, i[1], run_threads(s, i[6]));
    return 0;
}

int rt_bind_linear_recurrence(rt_binder *b, rt_step *st) {
    int stateful = strcmp(st->op->op, "linear_recurrence_state") == 0, at = stateful, rc;
    if ((rc = og_check_arity(b, st, 2 + at, stateful ? 5 : 2, 1 + at))) return rc;
    const rt_view *x = &st->in[at], *a = &st->in[at + 1];
    if (x->rank != 3 || !same_dims(a, x) || !og_is_float(x->dtype) || !og_is_float(a->dtype))
        return og_invalid(b, st, "x and a [b,S,C] (floats)");
    i64 Bt = x->shape[0], S = x->shape[1], C = x->shape[2];
    if ((rc = og_check_out(b, st, at, x->dtype, 3, x->shape))) return rc;
    if (stateful) {
        const int64_t want[1] = {C};
        if ((rc = check_tail(b, st, 2, Bt, want, 1))) return rc;
    }
    int in_scratch = !stateful || st->n_in > 3;
    i64 cb, per_thread, *i = st->i;
    if (ew_plan(Bt, C, 1, 3, in_scratch, b->threads, &cb, &per_thread))
        return og_no_kernel(b, st, "linear_recurrence: too many channels");
    if ((rc = want_threads(b, st, per_thread, &i[6]))) return rc;
    i[0] = at, i[1] = Bt, i[2] = S, i[3] = C, i[4] = cb, i[5] = per_thread, i[7] = in_scratch;
    st->run = run_lin;
    return 0;
}

int64_t npuc_linear_recurrence_scratch_floats(int64_t Bt, int64_t C, int in_scratch, int nt) {
    i64 cb, per;
    const i64 dims[2] = {Bt, C};
    if (!dims_ok(dims, 2) || ew_plan(Bt, C, 1, 3, in_scratch, nt, &cb, &per)) return -1;
    return mul_ok(per, imax(nt, 1));
}

int npuc_linear_recurrence_f32(const float *x, const float *a, float *y, float *state, int64_t slots,
                               const int64_t *last, const int64_t *slot, int64_t Bt, int64_t S, int64_t C,
                               float *scratch, int64_t scratch_floats, int nt) {
    const i64 xs[3] = {Bt, S, C}, hs[2] = {slots, C};
    i64 cb, per, l, row0;
    int in_scratch = state == NULL || last != NULL, rc;
    if (!dims_ok(xs, 3) || !dims_ok(hs, 2) || ew_plan(Bt, C, 1, 3, in_scratch, nt, &cb, &per) ||
        !flat_scratch_ok(per, nt, scratch_floats))
        return -1;
    if ((rc = flat_tail(state, slots, last, slot, Bt, S, &l, &row0))) return rc;
    rt_view vx = f32_view(x), va = f32_view(a);
    lin_job J = {.x = &vx, .a = &va, .y = y, .ydt = NPUC_F32, .in_scratch = in_scratch, .state = state,
                 .scratch = scratch, .S = S, .C = C, .cb = cb, .nb = cdiv(C, cb), .per_thread = per, .last = l,
                 .row0 = row0};
    lin_launch(&J, Bt, flat_threads(nt));
    return 0;
}

/* ---- the short convolution over a conv window (flat entry point only; exec runs conv1d through
 * ops_attention.c's binder) ---------------------------------------------------------------------- */

typedef struct dwconv_job {
    const float *x, *w, *bias;
    float *out;
    i64 C, L, K, Lo, cb, nb;
} dwconv_job;

static void dwconv_chunk(const void *ctx, i64 c, int tid) {
    const dwconv_job *J = ctx;
    (void)tid;
    i64 b = c / J->nb, c0 = c % J->nb * J->cb, c1 = imin(c0 + J->cb, J->C);
    for (i64 ch = c0; ch < c1; ch++) {
        const float *xr = J->x + (b * J->C + ch) * J->L, *wr = J->w + ch * J->K;
        float *o = J->out + (b * J->C + ch) * J->Lo;
        for (i64 j = 0; j < J->Lo; j++) {
            float acc = 0.0f;
            for (i64 k = 0; k < J->K; k++) acc += xr[j + k] * wr[k];
            o[j] = J->bias != NULL ? acc + J->bias[ch] : acc;
        }
    }
}

int npuc_conv1d_depthwise_f32(const float *x, const float *w, const float *bias, float *out, int64_t Bt, int64_t C,
                              int64_t L, int64_t K, int nt) {
    const i64 xs[3] = {Bt, C, L}, ws[2] = {C, K};
    if (!dims_ok(xs, 3) || !dims_ok(ws, 2) || K < 1 || L < K - 1) return -1;
    dwconv_job J = {.x = x, .w = w, .bias = bias, .out = out, .C = C, .L = L, .K = K, .Lo = L - K + 1,
                    .cb = RC_EB, .nb = cdiv(C, RC_EB)};
    i64 chunks = Bt * J.nb, work = mul_ok(mul_ok(Bt * C, J.Lo), K);
    /* a decode step's window (a few MACs a channel): on one thread unless there is work to share */
    if (chunks > 0) npuc_parallel(dwconv_chunk, &J, chunks, work >= 0 && work < (1 << 16) ? 1 : flat_threads(nt));
    return 0;
}
