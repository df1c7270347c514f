/* DeepSeek's fused ops for libnpucrt: mla_attention (multi-head latent attention) and
 * fused_moe / qmoe (routed mixture of experts), each a binder (the op's shape rule, as
 * ir/fused_ops.py and ir/quant.py state it) and the kernels its steps run.
 *
 * Why the kernels are shaped as they are. Decode (one token) is about bytes, not FLOPs:
 *
 *   mla_attention  computes over the latent ("absorbed", ir/fused_ops.py: mla_absorbed):
 *                  the queries move into latent space through W_UK, scores are [q_lat | q_rot]
 *                  . [c | k_rope] over the cache rows, the attended latent goes back out
 *                  through W_UV; no per-head key or value exists. Three parallel passes
 *                  (mla_attend): per head, the queries (W_UK read once); per split of the
 *                  cache rows, flash-decoding's partial softmax and weighted rows, four
 *                  queries sharing each row load and 4 x 16 sums held in registers (a decode
 *                  step reads each cache row once, whatever the threads); per head, the
 *                  splits combined and out through W_UV (read once). A long prefill, where
 *                  the reference expands (the cheaper form there), expands per-head keys and
 *                  values with the GEMM over W_UK/W_UV packed at session creation, then runs
 *                  npuc_attention_gemm (head dims multiples of 16, shared positions) or the
 *                  same passes over the expanded rows.
 *   fused_moe      routes in f32 exactly as moe_route does (torch's stable sort: of equal
 *   qmoe           scores the lower expert first, NaN first), sorts the token-slots by
 *                  expert, and runs each selected expert's rows through its weights as
 *                  stored (f32, bf16 or quantized codes), so a decode step reads the k
 *                  experts a token picks, each once, and no other. The work is one parallel
 *                  pass over (expert, slice of I) for gate and up, whose SwiGLU is applied
 *                  in the same chunk (a slice holds both halves of its columns), then one
 *                  over (expert, slice of H) for down: two hand-offs per layer, whatever k.
 *                  An expert with many rows (prefill) goes through the GEMM instead (its
 *                  weight packed per call into scratch: no f32 copy of all experts is kept).
 *                  Slots are weighed and summed in top-k order, as the reference does.
 *
 * Numerics follow the reference kernels: f32 throughout for f32 models; for bf16 operands
 * the values the reference rounds to bf16 (products with the per-head weights, an expert's
 * gate/up/down and SwiGLU) are rounded at the same points, while scores, softmax and the
 * weighted sum of the experts stay f32. f16 and f64 operands are refused (NPUC_E_NO_KERNEL).
 * qmoe reads codes as npuc_qlinear/npuc_qgemm do (scale * (codes . x - zero * sum x)), not
 * through an f32 (or, for bf16 activations, bf16) copy of the weight as the reference does:
 * the same values to f32's rounding.
 *
 * Run time allocates nothing: everything is in the session's shared scratch, sized here at
 * bind time, and per-thread regions are indexed by the pool's thread id. Run-time values
 * that index memory are checked: a position outside the cache is NPUC_E_KERNEL.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "exec.h"
#include "kernels.h"
#include "simd.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define DS_AVX2 1
#endif

#define HINT_TORCH "the Python runtime runs this op with its torch kernels (npuc.runtime.Session)"

/* ---- small helpers ------------------------------------------------------------------------ */

static inline i64 imin(i64 a, i64 b) { return a < b ? a : b; }
static inline i64 imax(i64 a, i64 b) { return a > b ? a : b; }
static inline i64 cdiv(i64 a, i64 b) { return (a + b - 1) / b; }

static inline float ld(const void *p, int bf, i64 i) {
    return bf ? npuc_bf16_to_f32(((const bf16 *)p)[i]) : ((const float *)p)[i];
}
static inline void st(void *p, int bf, i64 i, float v) {
    if (bf) ((bf16 *)p)[i] = rt_f32_to_bf16(v);
    else ((float *)p)[i] = v;
}
static inline float round_bf16(float v) { return npuc_bf16_to_f32(rt_f32_to_bf16(v)); }
static void round_bf16_n(float *v, i64 n) {
    for (i64 i = 0; i < n; i++) v[i] = round_bf16(v[i]);
}
static inline i64 pos_at(const void *p, int dtype, i64 i) {
    return dtype == NPUC_I64 ? ((const int64_t *)p)[i] : (i64)((const int32_t *)p)[i];
}
/* The worker threads a run may use: the session's, never more than bind time sized scratch for. */
static inline int run_threads(const struct npuc_session *s, int bound) {
    int nt = rt_session_threads(s);
    return nt < 1 ? 1 : nt > bound ? bound : nt;
}

static float dot_f32(const float *a, const float *b, i64 n) {
    float s = 0;
    i64 k = 0;
#ifdef DS_AVX2
    __m256 x = _mm256_setzero_ps(), y = x;
    for (; k + 16 <= n; k += 16) {
        x = _mm256_fmadd_ps(_mm256_loadu_ps(a + k), _mm256_loadu_ps(b + k), x);
        y = _mm256_fmadd_ps(_mm256_loadu_ps(a + k + 8), _mm256_loadu_ps(b + k + 8), y);
    }
    s = npuc_hsum8(_mm256_add_ps(x, y));
#endif
    for (; k < n; k++) s += a[k] * b[k];
    return s;
}

static float dot_bf16(const float *a, const bf16 *b, i64 n) {
    float s = 0;
    i64 k = 0;
#ifdef DS_AVX2
    __m256 x = _mm256_setzero_ps(), y = x;
    for (; k + 16 <= n; k += 16) {
        x = _mm256_fmadd_ps(_mm256_loadu_ps(a + k), npuc_load8_bf16(b + k), x);
        y = _mm256_fmadd_ps(_mm256_loadu_ps(a + k + 8), npuc_load8_bf16(b + k + 8), y);
    }
    s = npuc_hsum8(_mm256_add_ps(x, y));
#endif
    for (; k < n; k++) s += a[k] * npuc_bf16_to_f32(b[k]);
    return s;
}


/* v[i] = e^(v[i] - mx) in place over n; their sum. */
static float exp_sum(float *v, i64 n, float mx) {
    float sum = 0.0f;
    i64 i = 0;
#ifdef DS_AVX2
    __m256 vm = _mm256_set1_ps(mx), vs = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        __m256 e = npuc_exp8(_mm256_sub_ps(_mm256_loadu_ps(v + i), vm));
        _mm256_storeu_ps(v + i, e);
        vs = _mm256_add_ps(vs, e);
    }
    sum = npuc_hsum8(vs);
#endif
    for (; i < n; i++) {
        v[i] = expf(v[i] - mx);
        sum += v[i];
    }
    return sum;
}

/* sc[t * ss + k] = (q_t . row_k) * scale for t < nq, k < m: q_t = q + t * dq, row_k the k-th
 * of `rows` (stride floats or bf16 apart). Four queries share each load of a row. */
static void score_rows(const float *q, i64 dq, i64 nq, const void *rows, int bf, i64 stride, i64 m, float scale,
                       float *sc, i64 ss) {
    for (i64 k = 0; k < m; k++) {
        const float *rf = bf ? NULL : (const float *)rows + k * stride;
        const bf16 *rb = bf ? (const bf16 *)rows + k * stride : NULL;
        i64 t = 0;
#ifdef DS_AVX2
        for (; t + 4 <= nq; t += 4) {
            const float *q0 = q + t * dq, *q1 = q0 + dq, *q2 = q1 + dq, *q3 = q2 + dq;
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            i64 d = 0;
            for (; d + 8 <= dq; d += 8) {
                __m256 kv = bf ? npuc_load8_bf16(rb + d) : _mm256_loadu_ps(rf + d);
                a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q0 + d), kv, a0);
                a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q1 + d), kv, a1);
                a2 = _mm256_fmadd_ps(_mm256_loadu_ps(q2 + d), kv, a2);
                a3 = _mm256_fmadd_ps(_mm256_loadu_ps(q3 + d), kv, a3);
            }
            __m256 hs = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
            float s4[4];
            _mm_storeu_ps(s4, _mm_add_ps(_mm256_castps256_ps128(hs), _mm256_extractf128_ps(hs, 1)));
            for (; d < dq; d++) {
                float kd = bf ? npuc_bf16_to_f32(rb[d]) : rf[d];
                s4[0] += q0[d] * kd; s4[1] += q1[d] * kd; s4[2] += q2[d] * kd; s4[3] += q3[d] * kd;
            }
            for (int u = 0; u < 4; u++) sc[(t + u) * ss + k] = s4[u] * scale;
        }
#endif
        for (; t < nq; t++) sc[t * ss + k] = (bf ? dot_bf16(q + t * dq, rb, dq) : dot_f32(q + t * dq, rf, dq)) * scale;
    }
}

/* acc[t * da + c] = sum_{k < m} p[t * ss + k] * row_k[c] for t < nq, c < da (rows as
 * score_rows'; p holds 0 past a query's rows). Four queries by 16 columns in registers over
 * all m rows: each row's bytes are read once per four queries, and nothing is stored until
 * the sums are done. */
static void value_rows(const float *p, i64 ss, i64 nq, const void *rows, int bf, i64 stride, i64 m, i64 da,
                       float *acc) {
    i64 t = 0;
#ifdef DS_AVX2
    for (; t + 4 <= nq; t += 4) {
        const float *p0 = p + t * ss, *p1 = p0 + ss, *p2 = p1 + ss, *p3 = p2 + ss;
        i64 c = 0;
        for (; c + 16 <= da; c += 16) {
            __m256 a0 = _mm256_setzero_ps(), b0 = a0, a1 = a0, b1 = a0, a2 = a0, b2 = a0, a3 = a0, b3 = a0;
            for (i64 k = 0; k < m; k++) {
                __m256 v0, v1;
                if (bf) {
                    const bf16 *r = (const bf16 *)rows + k * stride + c;
                    v0 = npuc_load8_bf16(r);
                    v1 = npuc_load8_bf16(r + 8);
                } else {
                    const float *r = (const float *)rows + k * stride + c;
                    v0 = _mm256_loadu_ps(r);
                    v1 = _mm256_loadu_ps(r + 8);
                }
                __m256 w = _mm256_broadcast_ss(p0 + k);
                a0 = _mm256_fmadd_ps(w, v0, a0); b0 = _mm256_fmadd_ps(w, v1, b0);
                w = _mm256_broadcast_ss(p1 + k);
                a1 = _mm256_fmadd_ps(w, v0, a1); b1 = _mm256_fmadd_ps(w, v1, b1);
                w = _mm256_broadcast_ss(p2 + k);
                a2 = _mm256_fmadd_ps(w, v0, a2); b2 = _mm256_fmadd_ps(w, v1, b2);
                w = _mm256_broadcast_ss(p3 + k);
                a3 = _mm256_fmadd_ps(w, v0, a3); b3 = _mm256_fmadd_ps(w, v1, b3);
            }
            float *o = acc + t * da + c;
            _mm256_storeu_ps(o, a0); _mm256_storeu_ps(o + 8, b0);
            _mm256_storeu_ps(o + da, a1); _mm256_storeu_ps(o + da + 8, b1);
            _mm256_storeu_ps(o + 2 * da, a2); _mm256_storeu_ps(o + 2 * da + 8, b2);
            _mm256_storeu_ps(o + 3 * da, a3); _mm256_storeu_ps(o + 3 * da + 8, b3);
        }
        for (; c < da; c++)
            for (i64 u = 0; u < 4; u++) {
                float sum = 0.0f;
                for (i64 k = 0; k < m; k++) sum += p[(t + u) * ss + k] * ld(rows, bf, k * stride + c);
                acc[(t + u) * da + c] = sum;
            }
    }
#endif
    for (; t < nq; t++) {
        float *a = acc + t * da;
        for (i64 c = 0; c < da; c++) a[c] = 0.0f;
        for (i64 k = 0; k < m; k++) {
            if (bf) npuc_axpy_bf16(p[t * ss + k], (const bf16 *)rows + k * stride, a, da);
            else npuc_axpy_f32(p[t * ss + k], (const float *)rows + k * stride, a, da);
        }
    }
}

/* ---- attributes: robust to how the writer encoded a number (int, float or bool) ----------- */

static const rt_attr *attr(const rt_op *op, const char *name) {
    const rt_attr *a = rt_find_attr(op, name);
    return a && a->kind != ATTR_UNSET ? a : NULL;
}

/* 0, or -1 if present with another kind; *present says whether it was there. */
static int attr_int(const rt_op *op, const char *name, int64_t dflt, int64_t *v, int *present) {
    const rt_attr *a = attr(op, name);
    if (present) *present = a != NULL;
    *v = dflt;
    if (!a) return 0;
    if (a->kind != ATTR_I && a->kind != ATTR_B) return -1;
    *v = a->i;
    return 0;
}

static int attr_num(const rt_op *op, const char *name, double dflt, double *v, int *present) {
    const rt_attr *a = attr(op, name);
    if (present) *present = a != NULL;
    *v = dflt;
    if (!a) return 0;
    if (a->kind == ATTR_F) *v = a->f;
    else if (a->kind == ATTR_I || a->kind == ATTR_B) *v = (double)a->i;
    else return -1;
    return 0;
}

static int attr_str(const rt_op *op, const char *name, const char *dflt, const char **v) {
    const rt_attr *a = attr(op, name);
    *v = dflt;
    if (!a) return 0;
    if (a->kind != ATTR_S || !a->s) return -1;
    *v = a->s;
    return 0;
}

static int dims_are(const rt_view *v, int rank, const i64 *dims) {
    if (v->rank != rank) return 0;
    for (int i = 0; i < rank; i++)
        if (v->shape[i] != dims[i]) return 0;
    return 1;
}

static int is_float(int dtype) {
    return dtype == NPUC_F32 || dtype == NPUC_BF16 || dtype == NPUC_F16 || dtype == NPUC_F64;
}

/* A float operand as f32: its own bytes, or (another float dtype) widened once into the pool. */
static const float *as_f32(rt_binder *b, const rt_view *v) {
    if (v->dtype == NPUC_F32) return (const float *)v->data;
    float *w = pool_alloc(b->pool, (size_t)imax(v->numel, 1) * sizeof(float));
    if (!w) return NULL;
    for (i64 i = 0; i < v->numel; i++) w[i] = rt_load_f(v->data, v->dtype, i);
    b->extra_bytes += (uint64_t)v->numel * sizeof(float);
    return w;
}

/* Zero points (i8, or u8 0..15) as f32, once, into the pool: the quantized kernels' layout. */
static const float *codes_f32(rt_binder *b, const rt_view *v) {
    float *w = pool_alloc(b->pool, (size_t)imax(v->numel, 1) * sizeof(float));
    if (!w) return NULL;
    for (i64 i = 0; i < v->numel; i++)
        w[i] = v->dtype == NPUC_I8 ? (float)((const int8_t *)v->data)[i] : (float)((const uint8_t *)v->data)[i];
    b->extra_bytes += (uint64_t)v->numel * sizeof(float);
    return w;
}

static void want_scratch(rt_binder *b, i64 floats) {
    if ((uint64_t)floats > b->scratch_floats) b->scratch_floats = (uint64_t)floats;
}

/* ============================================================================================
 * mla_attention
 * ============================================================================================ */

/* Queries per block of the attention phase: 4 share each load of a row (score_rows), and a
 * block's [q_lat | q_rot] rows (16 x 288 floats here, 8 x 576 in DeepSeek-V3) stay in L1. */
#define MLA_QB 16
#define MLA_QB_BYTES (24 << 10)
/* Rows of the cache per split at least: fewer would cost more in partials than they save. */
#define MLA_MIN_SPLIT 32

typedef struct {
    i64 b, h, s, n, dn, dr, r, dv;
    int bf;            /* operands bf16 (else f32) */
    int expanded;      /* the reference's expanded form (a long prefill) */
    int causal;
    int pos_dtype;     /* NPUC_I64 / NPUC_I32, or -1: no position operand */
    i64 pstride;       /* 0: positions [s] for every sequence; s: [b, s] */
    float scale;
    int threads;       /* what the scratch was sized for */
    i64 dq, da;        /* query (= key) width and attended value width of the form */
    i64 qb, max_splits;
    i64 per_thread;    /* floats of each thread's region: a block's scores, or a row of out */
    float *uk, *uv;    /* expanded: W_UK[h], W_UV[h] packed for the GEMM, per head */
    i64 uk_stride, uv_stride;
    int64_t *rows;     /* expanded without positions: each query's last visible row */
    int fast;          /* expanded: npuc_attention_gemm takes it */
} mla_plan;

/* The attention in three parallel passes, so that every byte is read once whatever the
 * threads: (1) each head's queries, [q_nope @ W_UK | q_rot] (W_UK read once per head);
 * (2) per (group of queries, block of them, split of the rows): the split's scores, their
 * softmax numerators and sum, and the weighted rows (flash-decoding: a decode step's one
 * query block reads each cache row once, the threads taking different rows); (3) per head:
 * the splits combined, then out through W_UV (read once per head). A group is what shares
 * rows: a sequence's every head (absorbed: the latent), or one head (expanded). */
typedef struct {
    const mla_plan *P;
    const void *qn, *qr, *kv, *wuk, *wuv, *pos;
    void *out;
    const float *K, *V;      /* expanded keys [b,h,n,dq] and values [b,h,n,dv]; NULL: absorbed */
    float *qc;               /* [Q, dq] every query, f32 */
    float *pm, *psum, *pacc; /* per split: [R][Q] maxima, [R][Q] sums, [R][Q][da] weighted rows */
    float *thr;              /* per thread: a block's scores (qb x L), P->per_thread apart */
    i64 Q, qg, nqb, R, L;    /* queries; per group; blocks per group; splits; rows per split */
} mla_job;

/* Rows 0..visible-1 of the cache that query i of sequence bb sees. */
static inline i64 mla_visible(const mla_plan *P, const void *pos, i64 bb, i64 i) {
    if (P->pos_dtype >= 0) return pos_at(pos, P->pos_dtype, bb * P->pstride + i) + 1;
    return P->causal ? i + 1 : P->n;
}

/* (1) the s queries of head group g = bb * h + hh */
static void mla_queries(const void *p, i64 g, int tid) {
    const mla_job *j = p;
    const mla_plan *P = j->P;
    const i64 s = P->s, dn = P->dn, dr = P->dr, r = P->r, dq = P->dq, hh = g % P->h;
    const int bf = P->bf;
    (void)tid;
    float *q = j->qc + g * s * dq;
    if (P->expanded) {
        for (i64 i = 0; i < s; i++)
            for (i64 d = 0; d < dn; d++) q[i * dq + d] = ld(j->qn, bf, (g * s + i) * dn + d);
    } else if (!bf) { /* q_nope @ W_UK[h], W_UK as stored ([dn, r]: layout kn) */
        npuc_linear_f32((const float *)j->qn + g * s * dn, s, dn, (const float *)j->wuk + hh * dn * r, 1, r, dn,
                        NULL, q, dq, 1);
    } else {
        for (i64 i = 0; i < s; i++) {
            float *qi = q + i * dq;
            for (i64 k = 0; k < r; k++) qi[k] = 0.0f;
            for (i64 d = 0; d < dn; d++)
                npuc_axpy_bf16(ld(j->qn, 1, (g * s + i) * dn + d), (const bf16 *)j->wuk + (hh * dn + d) * r, qi, r);
            round_bf16_n(qi, r); /* the reference's einsum in bf16 */
        }
    }
    const i64 at = P->expanded ? dn : r;
    for (i64 i = 0; i < s; i++)
        for (i64 d = 0; d < dr; d++) q[i * dq + at + d] = ld(j->qr, bf, (g * s + i) * dr + d);
}

/* (2) one split of the rows for one block of a group's queries */
static void mla_split(const void *p, i64 c, int tid) {
    const mla_job *j = p;
    const mla_plan *P = j->P;
    const i64 h = P->h, s = P->s, n = P->n, dq = P->dq, da = P->da, L = j->L;
    const i64 g = c / (j->nqb * j->R), blk = (c / j->R) % j->nqb, sp = c % j->R;
    const i64 q0 = g * j->qg + blk * P->qb, nq = imin(P->qb, j->qg - blk * P->qb), k0 = sp * L;
    const i64 bb = P->expanded ? g / h : g;
    i64 vis[MLA_QB], m = 0;
    for (i64 t = 0; t < nq; t++) {
        vis[t] = imin(imax(mla_visible(P, j->pos, bb, (q0 + t) % s) - k0, 0), L);
        m = imax(m, vis[t]);
    }
    float *pm = j->pm + sp * j->Q + q0, *psum = j->psum + sp * j->Q + q0, *acc = j->pacc + (sp * j->Q + q0) * da;
    if (m == 0) { /* no row of this split is visible to the block */
        for (i64 t = 0; t < nq; t++) {
            pm[t] = -INFINITY;
            psum[t] = 0.0f;
        }
        for (i64 k = 0; k < nq * da; k++) acc[k] = 0.0f;
        return;
    }
    const void *keys, *vals;
    i64 kstride, vstride;
    int rbf = P->bf && !P->expanded;
    if (P->expanded) { /* the head's own rows: g is bb * h + hh */
        keys = j->K + (g * n + k0) * dq;
        vals = j->V + (g * n + k0) * da;
        kstride = dq;
        vstride = da;
    } else {           /* the latent rows, keys [c | k_rope] and values c */
        kstride = vstride = P->r + P->dr;
        keys = vals = (const char *)j->kv + (bb * n + k0) * kstride * (P->bf ? 2 : 4);
    }
    float *sc = j->thr + (i64)tid * P->per_thread;
    score_rows(j->qc + q0 * dq, dq, nq, keys, rbf, kstride, m, P->scale, sc, L);
    for (i64 t = 0; t < nq; t++) {
        float *ps = sc + t * L, mx = -INFINITY;
        for (i64 k = 0; k < vis[t]; k++) mx = ps[k] > mx ? ps[k] : mx;
        pm[t] = vis[t] ? mx : -INFINITY;
        psum[t] = exp_sum(ps, vis[t], mx);
        for (i64 k = vis[t]; k < m; k++) ps[k] = 0.0f;
    }
    value_rows(sc, L, nq, vals, rbf, vstride, m, da, acc);
}

/* (3) the splits of head group g's queries combined, and out */
static void mla_out(const void *p, i64 g, int tid) {
    const mla_job *j = p;
    const mla_plan *P = j->P;
    const i64 s = P->s, r = P->r, dv = P->dv, da = P->da, Q = j->Q, hh = g % P->h;
    (void)tid;
    for (i64 q = g * s; q < (g + 1) * s; q++) {
        float mx = -INFINITY, tot = 0.0f;
        for (i64 sp = 0; sp < j->R; sp++) mx = j->pm[sp * Q + q] > mx ? j->pm[sp * Q + q] : mx;
        float *a = j->pacc + q * da; /* split 0's: the result goes there */
        if (mx == -INFINITY) {       /* no rows at all (an empty cache): softmax of nothing, zeros */
            for (i64 k = 0; k < da; k++) a[k] = 0.0f;
            continue;
        }
        for (i64 sp = 0; sp < j->R; sp++) {
            float m = j->pm[sp * Q + q], w = m == -INFINITY ? 0.0f : expf(m - mx);
            tot += j->psum[sp * Q + q] * w;
            if (sp == 0) {
                for (i64 k = 0; k < da; k++) a[k] *= w;
            } else if (w != 0.0f) {
                npuc_axpy_f32(w, j->pacc + (sp * Q + q) * da, a, da);
            }
        }
        float inv = 1.0f / tot;
        for (i64 k = 0; k < da; k++) a[k] *= inv;
    }
    float *a = j->pacc + g * s * da;
    if (P->expanded) {
        for (i64 k = 0; k < s * dv; k++) st(j->out, P->bf, g * s * dv + k, a[k]);
    } else if (!P->bf) { /* o_lat @ W_UV[h], W_UV as stored ([r, dv]: layout kn) */
        npuc_linear_f32(a, s, r, (const float *)j->wuv + hh * r * dv, 1, dv, r, NULL, (float *)j->out + g * s * dv,
                        dv, 1);
    } else {
        float *tmp = j->thr + (i64)tid * P->per_thread; /* this thread's scores are done with */
        for (i64 i = 0; i < s; i++) {
            float *ai = a + i * r;
            round_bf16_n(ai, r); /* o_lat.to(bf16), then the einsum in bf16 */
            for (i64 k = 0; k < dv; k++) tmp[k] = 0.0f;
            for (i64 k = 0; k < r; k++) npuc_axpy_bf16(ai[k], (const bf16 *)j->wuv + (hh * r + k) * dv, tmp, dv);
            for (i64 k = 0; k < dv; k++) st(j->out, 1, (g * s + i) * dv + k, tmp[k]);
        }
    }
}

/* The three passes over `ws` (qc, partials, per-thread scores). `rows_seen`: the most rows any
 * query sees. */
static void mla_attend(const mla_plan *P, mla_job *j, float *ws, i64 rows_seen, int nt) {
    const i64 b = P->b, h = P->h, s = P->s, dq = P->dq, da = P->da;
    j->Q = b * h * s;
    j->qg = P->expanded ? s : h * s;
    j->nqb = cdiv(j->qg, P->qb);
    i64 groups = j->Q / j->qg, blocks = groups * j->nqb;
    /* enough chunks for the threads, each split at least MLA_MIN_SPLIT rows */
    j->R = imax(1, imin(imin(P->max_splits, cdiv(2 * (i64)nt, blocks)), cdiv(rows_seen, MLA_MIN_SPLIT)));
    j->L = imax(1, cdiv(rows_seen, j->R));
    j->qc = ws;
    j->pm = j->qc + j->Q * dq;
    j->psum = j->pm + j->R * j->Q;
    j->pacc = j->psum + j->R * j->Q;
    j->thr = j->pacc + j->R * j->Q * da;
    npuc_parallel(mla_queries, j, b * h, nt);
    npuc_parallel(mla_split, j, blocks * j->R, nt);
    npuc_parallel(mla_out, j, b * h, nt);
}

static int mla_expanded_run(const mla_plan *P, mla_job *j, float *ws, i64 rows_seen, int nt) {
    const i64 b = P->b, h = P->h, s = P->s, n = P->n, dn = P->dn, dr = P->dr, r = P->r, dv = P->dv;
    const i64 dk = dn + dr, row = r + dr, es = P->bf ? 2 : 4;
    float *K = ws, *V = K + b * h * n * dk, *rest = V + b * h * n * dv;
    for (i64 bb = 0; bb < b; bb++) {
        const char *c = (const char *)j->kv + bb * n * row * es;
        for (i64 hh = 0; hh < h; hh++) {
            float *kh = K + (bb * h + hh) * n * dk, *vh = V + (bb * h + hh) * n * dv;
            /* k_nope = c @ W_UK[h]^T and v = c @ W_UV[h], in the operands' dtype as the reference */
            npuc_gemm_f32(c, P->bf, n, row, P->uk + hh * P->uk_stride, dn, r, NULL, kh, 0, dk, rest, nt);
            npuc_gemm_f32(c, P->bf, n, row, P->uv + hh * P->uv_stride, dv, r, NULL, vh, 0, dv, rest, nt);
            for (i64 k = 0; k < n; k++) {
                if (P->bf) round_bf16_n(kh + k * dk, dn);
                for (i64 d = 0; d < dr; d++) kh[k * dk + dn + d] = ld(j->kv, P->bf, (bb * n + k) * row + r + d);
            }
            if (P->bf) round_bf16_n(vh, n * dv);
        }
    }
    if (P->fast && !(P->pos_dtype >= 0 && (P->pos_dtype != NPUC_I64 || P->pstride))) {
        float *Q = rest, *O = Q + b * h * s * dk, *sc = O + (P->bf ? b * h * s * dv : 0);
        for (i64 qrow = 0; qrow < b * h * s; qrow++) {
            for (i64 d = 0; d < dn; d++) Q[qrow * dk + d] = ld(j->qn, P->bf, qrow * dn + d);
            for (i64 d = 0; d < dr; d++) Q[qrow * dk + dn + d] = ld(j->qr, P->bf, qrow * dr + d);
        }
        const int64_t *rows = P->pos_dtype >= 0 ? (const int64_t *)j->pos : P->rows;
        float *o = P->bf ? O : (float *)j->out;
        if (npuc_attention_gemm(Q, K, V, rows, o, b, h, s, dk, h, n, dv, P->scale, sc, nt)) return NPUC_E_KERNEL;
        if (P->bf)
            for (i64 i = 0; i < b * h * s * dv; i++) st(j->out, 1, i, O[i]);
        return 0;
    }
    j->K = K;
    j->V = V;
    mla_attend(P, j, rest, rows_seen, nt);
    return 0;
}

static int mla_run(const rt_step *stp, struct npuc_session *sess) {
    const mla_plan *P = stp->p[0];
    int nt = run_threads(sess, P->threads);
    const void *pos = P->pos_dtype >= 0 ? stp->in[5].data : NULL;
    i64 rows_seen = P->pos_dtype >= 0 ? 0 : P->causal ? P->s : P->n;
    if (pos) {
        i64 count = P->pstride ? P->b * P->s : P->s;
        for (i64 i = 0; i < count; i++) {
            i64 v = pos_at(pos, P->pos_dtype, i);
            if (v < 0 || v >= P->n) return NPUC_E_KERNEL;
            rows_seen = imax(rows_seen, v + 1);
        }
    }
    if (P->b * P->h * P->s == 0) return 0;
    mla_job j = {P, stp->in[0].data, stp->in[1].data, stp->in[2].data, stp->in[3].data, stp->in[4].data, pos,
                 stp->out[0].data, NULL, NULL, NULL, NULL, NULL, NULL, NULL, 0, 0, 0, 0, 0};
    float *ws = rt_session_scratch(sess);
    if (P->expanded) return mla_expanded_run(P, &j, ws, rows_seen, nt);
    /* absorbed: a hand-off pays once the cache rows and W_UK/W_UV come to 64 KiB */
    i64 bytes = (P->b * rows_seen * (P->r + P->dr) + P->h * P->r * (P->dn + P->dv)) * (P->bf ? 2 : 4);
    mla_attend(P, &j, ws, rows_seen, bytes < (64 << 10) ? 1 : nt);
    return 0;
}

/* ir/fused_ops.py: mla_absorbed, the same arithmetic. */
static int mla_is_absorbed(i64 h, i64 s, i64 n, i64 dn, i64 dr, i64 r, i64 dv) {
    i64 absorbed = h * s * (dn * r + n * (2 * r + dr) + r * dv);
    i64 expanded = h * n * r * (dn + dv) + h * s * n * (dn + dr + dv);
    return absorbed <= expanded;
}

static int bind_mla(rt_binder *b, rt_step *stp) {
    const rt_op *op = stp->op;
    const char *name = op->name ? op->name : "?";
    if ((stp->n_in != 5 && stp->n_in != 6) || stp->n_out != 1)
        return rt_fail(b->err, NPUC_E_INVALID, HINT_DAMAGED, "mla_attention %s takes 5 or 6 operands and gives one",
                       name);
    const rt_view *qn = &stp->in[0], *qr = &stp->in[1], *kv = &stp->in[2], *wuk = &stp->in[3], *wuv = &stp->in[4];
    if (qn->rank != 4 || qr->rank != 4 || kv->rank != 4 || wuk->rank != 3 || wuv->rank != 3)
        return rt_fail(b->err, NPUC_E_INVALID, HINT_DAMAGED,
                       "mla_attention %s takes 4-D queries and latent, 3-D per-head weights", name);
    i64 B = qn->shape[0], h = qn->shape[1], s = qn->shape[2], dn = qn->shape[3];
    i64 r = wuk->shape[2], dr = qr->shape[3], n = kv->shape[2], dv = wuv->shape[2];
    if (qr->shape[0] != B || qr->shape[1] != h || qr->shape[2] != s || kv->shape[0] != B || kv->shape[1] != 1
        || kv->shape[3] != r + dr || wuk->shape[0] != h || wuk->shape[1] != dn || wuv->shape[0] != h
        || wuv->shape[1] != r)
        return rt_fail(b->err, NPUC_E_INVALID, HINT_DAMAGED, "mla_attention %s: queries, latent and weights do not fit",
                       name);
    int64_t causal = 0;
    double scale = 0;
    int has_scale = 0;
    if (attr_int(op, "causal", 0, &causal, NULL) || attr_num(op, "scale", 0, &scale, &has_scale) || !has_scale)
        return rt_fail(b->err, NPUC_E_INVALID, HINT_DAMAGED, "mla_attention %s: attributes scale/causal malformed",
                       name);
    int pos_dtype = -1;
    i64 pstride = 0;
    if (stp->n_in == 6) {
        const rt_view *pv = &stp->in[5];
        pos_dtype = pv->dtype;
        if ((pos_dtype != NPUC_I64 && pos_dtype != NPUC_I32)
            || !((pv->rank == 1 && pv->shape[0] == s) || (pv->rank == 2 && pv->shape[0] == B && pv->shape[1] == s)))
            return rt_fail(b->err, NPUC_E_INVALID, HINT_DAMAGED,
                           "mla_attention %s: position should be i64[%lld] or [%lld,%lld]", name, (long long)s,
                           (long long)B, (long long)s);
        pstride = pv->rank == 2 ? s : 0;
    } else if (causal && s != n) {
        return rt_fail(b->err, NPUC_E_INVALID, HINT_DAMAGED, "mla_attention %s: causal over its own %lld rows has "
                       "%lld queries", name, (long long)n, (long long)s);
    }
    int dt = qn->dtype;
    if (!is_float(dt) || qr->dtype != dt || kv->dtype != dt || wuk->dtype != dt || wuv->dtype != dt)
        return rt_fail(b->err, NPUC_E_INVALID, HINT_DAMAGED, "mla_attention %s: operands are not one float dtype",
                       name);
    i64 oshape[4] = {B, h, s, dv};
    if (stp->out[0].dtype != dt || !dims_are(&stp->out[0], 4, oshape))
        return rt_fail(b->err, NPUC_E_INVALID, HINT_DAMAGED, "mla_attention %s: output is not %s[%lld,%lld,%lld,%lld]",
                       name, npuc_dtype_name(dt), (long long)B, (long long)h, (long long)s, (long long)dv);
    if (dt != NPUC_F32 && dt != NPUC_BF16)
        return rt_fail(b->err, NPUC_E_NO_KERNEL, HINT_TORCH, "mla_attention %s in %s: no native kernel (f32 and bf16)",
                       name, npuc_dtype_name(dt));

    int threads = b->threads < 1 ? 1 : b->threads;
    mla_plan plan;
    memset(&plan, 0, sizeof plan);
    plan.b = B; plan.h = h; plan.s = s; plan.n = n; plan.dn = dn; plan.dr = dr; plan.r = r; plan.dv = dv;
    plan.bf = dt == NPUC_BF16;
    plan.expanded = !mla_is_absorbed(h, s, n, dn, dr, r, dv);
    plan.causal = causal != 0;
    plan.pos_dtype = pos_dtype;
    plan.pstride = pstride;
    plan.scale = (float)scale;
    plan.threads = threads;
    plan.dq = plan.expanded ? dn + dr : r + dr;
    plan.da = plan.expanded ? dv : r;
    plan.qb = plan.dq * MLA_QB * 4 <= MLA_QB_BYTES ? MLA_QB : MLA_QB / 2;
    /* splits of the rows only where the query blocks are fewer than two a thread (decode) */
    i64 blocks = (plan.expanded ? B * h : B) * cdiv(plan.expanded ? s : h * s, plan.qb);
    plan.max_splits = imax(1, cdiv(2 * (i64)threads, imax(blocks, 1)));
    plan.per_thread = imax(plan.qb * n, dv);
    /* mla_attend's: every query, the partials of every split, each thread's region */
    i64 Q = B * h * s, R = plan.max_splits, need = Q * plan.dq + R * Q * (2 + plan.da) + threads * plan.per_thread;
    if (plan.expanded) {
        i64 dk = dn + dr, kvbuf = B * h * n * (dk + dv);
        plan.uk_stride = npuc_gemm_packed_floats(dn, r);
        plan.uv_stride = npuc_gemm_packed_floats(dv, r);
        /* npuc_attention_gemm: head dims multiples of 16, one set of positions */
        plan.fast = dk % 16 == 0 && dv % 16 == 0 && n >= 1;
        i64 gemm = npuc_gemm_scratch_floats(n, imax(dn, dv), r, 0);
        i64 fast = plan.fast ? B * h * s * dk + (plan.bf ? B * h * s * dv : 0)
                                   + npuc_attention_gemm_scratch_floats(B, h, dk, n, dv, threads) : 0;
        need = kvbuf + imax(gemm, imax(fast, need));
    }
    want_scratch(b, need);
    stp->run = mla_run;
    if (b->dry) return 0;

    mla_plan *P = pool_alloc(b->pool, sizeof(mla_plan));
    if (!P) return rt_fail(b->err, NPUC_E_ARG, NULL, "mla_attention %s: out of memory", name);
    *P = plan;
    b->extra_bytes += sizeof(mla_plan);
    if (P->expanded) {
        P->uk = pool_alloc(b->pool, (size_t)(h * P->uk_stride) * sizeof(float));
        P->uv = pool_alloc(b->pool, (size_t)(h * P->uv_stride) * sizeof(float));
        P->rows = pool_alloc(b->pool, (size_t)imax(s, 1) * sizeof(int64_t));
        if (!P->uk || !P->uv || !P->rows)
            return rt_fail(b->err, NPUC_E_ARG, NULL, "mla_attention %s: out of memory", name);
        b->extra_bytes += (uint64_t)(h * (P->uk_stride + P->uv_stride)) * sizeof(float) + (uint64_t)s * 8;
        i64 es = P->bf ? 2 : 4;
        for (i64 hh = 0; hh < h; hh++) {
            npuc_gemm_pack_b((const char *)wuk->data + hh * dn * r * es, P->bf, 0, dn, r, P->uk + hh * P->uk_stride,
                             threads);
            npuc_gemm_pack_b((const char *)wuv->data + hh * r * dv * es, P->bf, 1, dv, r, P->uv + hh * P->uv_stride,
                             threads);
        }
        for (i64 i = 0; i < s; i++) P->rows[i] = P->causal ? i : n - 1;
    }
    stp->p[0] = P;
    return 0;
}

/* ============================================================================================
 * fused_moe and qmoe
 * ============================================================================================ */

/* An expert with at least this many rows runs through the GEMM (its weight packed per call);
 * below, the GEMV reads each weight row once for all of the expert's rows from L1. */
#define MOE_GEMM_ROWS 32

enum { W_F32 = 0, W_BF16 = 1, W_Q = 2 };

/* One stacked expert weight, [here, N, K] as dequantized. */
typedef struct {
    int kind;
    const void *w;     /* f32, bf16, or codes (i8 [.., K] / u8 [.., K/2]) */
    i64 N, K;
    int bits;
    i64 G;             /* group size along K */
    const float *scale, *zero; /* quantized: [here, N, K/G], widened at bind */
} moe_w;

typedef struct {
    i64 T, H, E, here, I, k, g, kg, offset;
    int softmax, top2, norm;
    float eps, rscale;
    int xbf;            /* x (and so the experts' activations) bf16 */
    const float *router, *bias;
    moe_w gu, dn;
    int threads;
    i64 gemv_rows;      /* most rows an expert can have on the GEMV path */
    /* scratch layout, float offsets */
    i64 o_xf, o_logits, o_scores, o_choice, o_gs, o_keep, o_idx, o_w, o_posn, o_cnt, o_start, o_hits, o_xg, o_h,
        o_act, o_y, o_pack, o_gemm, o_thr, per_thread;
} moe_plan;

typedef struct {
    const moe_plan *P;
    float *ws;
    const int32_t *cnt, *start, *hits;
    const float *xg;
    float *hb, *act, *y;
    i64 slice, slices;
} moe_job;

static inline int gt(float a, float b) { return a > b || (isnan(a) && !isnan(b)); }

/* The k largest of v[0..n), best first; of equal values the lower index first: the head of
 * torch's stable descending sort (which puts NaN first), as the reference's topk. */
static void topk(const float *v, i64 n, i64 k, int32_t *idx, float *val) {
    i64 cnt = 0;
    for (i64 i = 0; i < n; i++) {
        float x = v[i];
        if (cnt == k && !gt(x, val[k - 1])) continue;
        i64 p = cnt < k ? cnt : k - 1;
        while (p > 0 && gt(x, val[p - 1])) {
            val[p] = val[p - 1];
            idx[p] = idx[p - 1];
            p--;
        }
        val[p] = x;
        idx[p] = (int32_t)i;
        if (cnt < k) cnt++;
    }
}

/* One token's experts and weights from its f32 logits (moe_route). */
static void moe_route_one(const moe_plan *P, const float *lg, float *sc, float *ch, float *gs, int32_t *keep,
                          int32_t *idx, float *w) {
    const i64 E = P->E, g = P->g, kg = P->kg, k = P->k, size = E / g;
    const float fill = P->softmax ? 0.0f : -INFINITY;
    if (P->softmax) {
        float mx = -INFINITY, sum = 0.0f;
        for (i64 e = 0; e < E; e++) mx = gt(lg[e], mx) ? lg[e] : mx;
        for (i64 e = 0; e < E; e++) {
            sc[e] = expf(lg[e] - mx);
            sum += sc[e];
        }
        for (i64 e = 0; e < E; e++) sc[e] /= sum;
    } else {
        for (i64 e = 0; e < E; e++) sc[e] = 1.0f / (1.0f + expf(-lg[e]));
    }
    for (i64 e = 0; e < E; e++) ch[e] = P->bias ? sc[e] + P->bias[e] : sc[e];
    if (kg < g) { /* only the experts of the token's topk_group best groups compete */
        for (i64 gi = 0; gi < g; gi++) {
            const float *grp = ch + gi * size;
            if (P->top2) {
                int32_t ti[2];
                float tv[2];
                topk(grp, size, 2, ti, tv);
                gs[gi] = tv[0] + tv[1];
            } else {
                float mx = grp[0];
                for (i64 e = 1; e < size; e++) mx = isnan(mx) ? mx : isnan(grp[e]) || grp[e] > mx ? grp[e] : mx;
                gs[gi] = mx;
            }
            keep[gi] = 0;
        }
        topk(gs, g, kg, idx, w); /* idx/w as scratch: the kept groups */
        for (i64 t = 0; t < kg; t++) keep[idx[t]] = 1;
        for (i64 e = 0; e < E; e++)
            if (!keep[e / size]) ch[e] = fill;
    }
    topk(ch, E, k, idx, w);
    float total = 0.0f;
    for (i64 t = 0; t < k; t++) {
        /* the scores without the correction bias; a masked expert (picked only when fewer than
         * k others beat the fill) keeps the fill */
        w[t] = kg < g && !keep[idx[t] / size] ? fill : sc[idx[t]];
        total += w[t];
    }
    if (P->norm) {
        float d = P->eps != 0.0f ? total + P->eps : total;
        for (i64 t = 0; t < k; t++) w[t] = w[t] / d;
    }
    for (i64 t = 0; t < k; t++) w[t] = w[t] * P->rscale;
}

/* y[m, lo..hi) = x[m] . W_e[n] for n in [lo, hi), m < M: the expert's rows as stored, one thread. */
static int expert_rows(const moe_w *W, i64 e, i64 lo, i64 hi, const float *x, i64 M, i64 xs, float *y, i64 ys,
                       float *tscr) {
    const i64 N = W->N, K = W->K, n = hi - lo;
    if (W->kind == W_F32)
        return npuc_linear_f32(x, M, xs, (const float *)W->w + (e * N + lo) * K, 0, n, K, NULL, y + lo, ys, 1);
    if (W->kind == W_BF16)
        return npuc_linear_bf16(x, 0, M, xs, (const bf16 *)W->w + (e * N + lo) * K, n, K, NULL, 0, y + lo, 0, ys,
                                tscr, 1);
    i64 kb = W->bits == 8 ? K : K / 2, groups = K / W->G;
    return npuc_qlinear(x, 0, M, xs, (const uint8_t *)W->w + (e * N + lo) * kb, W->bits,
                        W->scale + (e * N + lo) * groups, W->zero + (e * N + lo) * groups, n, K, W->G, NULL, y + lo,
                        0, ys, tscr, 1);
}

/* y[M, N] = x[M, K] W_e^T over the GEMM (many rows), all threads. */
static int expert_gemm(const moe_w *W, i64 e, const float *x, i64 M, float *y, float *pack, float *gs, int nt) {
    const i64 N = W->N, K = W->K;
    if (W->kind == W_Q) {
        i64 kb = W->bits == 8 ? K : K / 2, groups = K / W->G;
        return npuc_qgemm(x, 0, M, K, (const uint8_t *)W->w + e * N * kb, W->bits, W->scale + e * N * groups,
                          W->zero + e * N * groups, N, K, W->G, NULL, y, 0, N, gs, nt);
    }
    const char *w = (const char *)W->w + e * N * K * (W->kind == W_BF16 ? 2 : 4);
    npuc_gemm_pack_b(w, W->kind == W_BF16, 0, N, K, pack, nt);
    return npuc_gemm_f32(x, 0, M, K, pack, N, K, NULL, y, 0, N, gs, nt);
}

static inline float silu(float v) { return v / (1.0f + expf(-v)); }

/* act[r, j] = silu(gate[r, j]) * up[r, j] for rows [0, M) and j in [lo, hi); a bf16 model
 * rounds where the reference's bf16 tensors do. */
static void swiglu_rows(const moe_plan *P, const float *hb, float *act, i64 M, i64 lo, i64 hi) {
    const i64 I = P->I;
    for (i64 r = 0; r < M; r++) {
        const float *g = hb + r * 2 * I, *u = g + I;
        float *a = act + r * I;
        if (P->xbf)
            for (i64 c = lo; c < hi; c++) a[c] = round_bf16(round_bf16(silu(round_bf16(g[c]))) * round_bf16(u[c]));
        else
            for (i64 c = lo; c < hi; c++) a[c] = silu(g[c]) * u[c];
    }
}

/* Phase 1: (expert, slice of I) -> gate and up rows of the slice, and their SwiGLU. */
static void moe_up_chunk(const void *p, i64 c, int tid) {
    const moe_job *j = p;
    const moe_plan *P = j->P;
    i64 e = j->hits[c / j->slices], M = j->cnt[e], p0 = j->start[e], I = P->I, H = P->H;
    i64 lo = (c % j->slices) * j->slice, hi = imin(lo + j->slice, I);
    if (lo >= hi) return;
    float *tscr = j->ws + P->o_thr + (i64)tid * P->per_thread;
    const float *x = j->xg + p0 * H;
    float *hb = j->hb + p0 * 2 * I;
    expert_rows(&P->gu, e, lo, hi, x, M, H, hb, 2 * I, tscr);
    expert_rows(&P->gu, e, I + lo, I + hi, x, M, H, hb, 2 * I, tscr);
    swiglu_rows(P, hb, j->act + p0 * I, M, lo, hi);
}

/* Phase 2: (expert, slice of H) -> the down projection's rows of the slice. */
static void moe_down_chunk(const void *p, i64 c, int tid) {
    const moe_job *j = p;
    const moe_plan *P = j->P;
    i64 e = j->hits[c / j->slices], M = j->cnt[e], p0 = j->start[e], I = P->I, H = P->H;
    i64 lo = (c % j->slices) * j->slice, hi = imin(lo + j->slice, H);
    if (lo >= hi) return;
    float *tscr = j->ws + P->o_thr + (i64)tid * P->per_thread;
    float *y = j->y + p0 * H;
    expert_rows(&P->dn, e, lo, hi, j->act + p0 * I, M, I, y, H, tscr);
    if (P->xbf)
        for (i64 r = 0; r < M; r++) round_bf16_n(y + r * H + lo, hi - lo);
}

/* Slices of `len` (multiples of 16) so that `hits` experts give about four chunks a thread. */
static i64 moe_slice(i64 len, i64 hits, int nt) {
    i64 per = cdiv(4 * (i64)nt, imax(hits, 1));
    i64 sl = cdiv(cdiv(len, imax(per, 1)), 16) * 16;
    return imax(sl, 16);
}

static int moe_run(const rt_step *stp, struct npuc_session *sess) {
    const moe_plan *P = stp->p[0];
    const i64 T = P->T, H = P->H, E = P->E, k = P->k, I = P->I, here = P->here;
    float *ws = rt_session_scratch(sess);
    int nt = run_threads(sess, P->threads);
    if (T == 0) return 0;
    const void *x = stp->in[0].data;
    const float *xf = P->xbf ? ws + P->o_xf : (const float *)x;
    if (P->xbf)
        for (i64 i = 0; i < T * H; i++) ws[P->o_xf + i] = npuc_bf16_to_f32(((const bf16 *)x)[i]);
    /* the router in f32, as the reference's F.linear(x.float(), router.float()) */
    float *logits = ws + P->o_logits;
    npuc_linear_f32(xf, T, H, P->router, 0, E, H, NULL, logits, E, nt);
    int32_t *idx = (int32_t *)(ws + P->o_idx), *posn = (int32_t *)(ws + P->o_posn);
    int32_t *cnt = (int32_t *)(ws + P->o_cnt), *start = (int32_t *)(ws + P->o_start);
    int32_t *hits = (int32_t *)(ws + P->o_hits), *keep = (int32_t *)(ws + P->o_keep);
    float *w = ws + P->o_w;
    for (i64 t = 0; t < T; t++)
        moe_route_one(P, logits + t * E, ws + P->o_scores, ws + P->o_choice, ws + P->o_gs, keep, idx + t * k,
                      w + t * k);
    /* the token-slots sorted by local expert (stable: slot order within an expert); a slot
     * picking another rank's expert (expert parallel) keeps a zero row */
    for (i64 e = 0; e <= here; e++) cnt[e] = 0;
    for (i64 i = 0; i < T * k; i++) {
        i64 e = idx[i];
        if (e < 0 || e >= E) return NPUC_E_KERNEL;
        e -= P->offset;
        cnt[e >= 0 && e < here ? e : here]++;
    }
    i64 acc = 0, nhits = 0;
    for (i64 e = 0; e <= here; e++) {
        start[e] = (int32_t)acc;
        acc += cnt[e];
    }
    for (i64 e = 0; e < here; e++) cnt[e] = 0; /* refilled below as the fill count */
    for (i64 i = 0; i < T * k; i++) {
        i64 e = idx[i] - P->offset;
        if (e < 0 || e >= here) {
            posn[i] = -1;
            continue;
        }
        i64 at = start[e] + cnt[e]++;
        posn[i] = (int32_t)at;
        memcpy(ws + P->o_xg + at * H, xf + (i / k) * H, (size_t)H * sizeof(float));
    }
    float *xg = ws + P->o_xg, *hb = ws + P->o_h, *act = ws + P->o_act, *y = ws + P->o_y;
    for (i64 e = 0; e < here; e++) {
        if (cnt[e] == 0) continue;
        if (cnt[e] > P->gemv_rows) { /* many rows: the GEMM, its threads inside */
            i64 M = cnt[e], p0 = start[e];
            if (expert_gemm(&P->gu, e, xg + p0 * H, M, hb + p0 * 2 * I, ws + P->o_pack, ws + P->o_gemm, nt))
                return NPUC_E_KERNEL;
            swiglu_rows(P, hb + p0 * 2 * I, act + p0 * I, M, 0, I);
            if (expert_gemm(&P->dn, e, act + p0 * I, M, y + p0 * H, ws + P->o_pack, ws + P->o_gemm, nt))
                return NPUC_E_KERNEL;
            if (P->xbf) round_bf16_n(y + p0 * H, M * H);
        } else {
            hits[nhits++] = (int32_t)e;
        }
    }
    if (nhits) {
        /* the bytes this touches decide whether a hand-off pays */
        i64 wb = P->gu.kind == W_Q ? P->gu.bits : P->gu.kind == W_BF16 ? 16 : 32;
        int pnt = nhits * 3 * I * H * wb / 8 < (64 << 10) ? 1 : nt;
        moe_job j = {P, ws, cnt, start, hits, xg, hb, act, y, 0, 0};
        j.slice = moe_slice(I, nhits, pnt);
        j.slices = cdiv(I, j.slice);
        npuc_parallel(moe_up_chunk, &j, nhits * j.slices, pnt);
        j.slice = moe_slice(H, nhits, pnt);
        j.slices = cdiv(H, j.slice);
        npuc_parallel(moe_down_chunk, &j, nhits * j.slices, pnt);
    }
    /* each token's k slots, weighed and summed in top-k order (rows * weights, then the sum) */
    void *out = stp->out[0].data;
    float *o32 = P->xbf ? xg : NULL; /* a bf16 model sums in f32 (xg is free again) and rounds once */
    for (i64 t = 0; t < T; t++) {
        float *o = P->xbf ? o32 : (float *)out + t * H;
        for (i64 c = 0; c < H; c++) o[c] = 0.0f;
        for (i64 jj = 0; jj < k; jj++) {
            i64 pp = posn[t * k + jj];
            float wt = w[t * k + jj];
            if (pp < 0) {
                float z = 0.0f * wt;
                for (i64 c = 0; c < H; c++) o[c] += z;
                continue;
            }
            const float *yr = y + pp * H;
            for (i64 c = 0; c < H; c++) {
                float term = yr[c] * wt;
                o[c] += term;
            }
        }
        if (P->xbf)
            for (i64 c = 0; c < H; c++) ((bf16 *)out)[t * H + c] = rt_f32_to_bf16(o[c]);
    }
    return 0;
}

/* ir/quant.py: _check_quantized. K of the quantized weight (q, scale, zero), or -1. */
static i64 check_quantized(const rt_view *q, const rt_view *scale, const rt_view *zero, i64 bits, i64 G) {
    int code = bits == 8 ? NPUC_I8 : NPUC_U8;
    if ((bits != 4 && bits != 8) || q->dtype != code || zero->dtype != code || !is_float(scale->dtype) || q->rank < 1)
        return -1;
    i64 K = q->shape[q->rank - 1] * (bits == 8 ? 1 : 2);
    if (G < 1 || K % G || (bits == 4 && G % 2)) return -1;
    i64 want[NPUC_MAX_RANK];
    for (int i = 0; i < q->rank - 1; i++) want[i] = q->shape[i];
    want[q->rank - 1] = K / G;
    if (!dims_are(scale, q->rank, want) || !dims_are(zero, q->rank, want)) return -1;
    return K;
}

static int bind_moe_common(rt_binder *b, rt_step *stp, int quant) {
    const rt_op *op = stp->op;
    const char *opn = quant ? "qmoe" : "fused_moe", *name = op->name ? op->name : "?";
    int nbase = quant ? 8 : 4;
    if ((stp->n_in != nbase && stp->n_in != nbase + 1) || stp->n_out != 1)
        return rt_fail(b->err, NPUC_E_INVALID, HINT_DAMAGED, "%s %s takes %d or %d operands and gives one", opn, name,
                       nbase, nbase + 1);
    const rt_view *x = &stp->in[0], *router = &stp->in[1];
    const rt_view *bias = stp->n_in > nbase ? &stp->in[nbase] : NULL;
    int64_t bits = 0, G = 0, DG = 0;
    i64 here, I, gu_n, gu_k, dn_n, dn_k;
    if (quant) {
        int p1, p2, p3;
        if (attr_int(op, "bits", 0, &bits, &p1) || attr_int(op, "group_size", 0, &G, &p2)
            || attr_int(op, "down_group_size", 0, &DG, &p3) || !p1 || !p2 || !p3)
            return rt_fail(b->err, NPUC_E_INVALID, HINT_DAMAGED, "qmoe %s: bits/group_size/down_group_size malformed",
                           name);
        const rt_view *gq = &stp->in[2], *dq = &stp->in[5];
        i64 kgu = check_quantized(gq, &stp->in[3], &stp->in[4], bits, G);
        i64 kdn = check_quantized(dq, &stp->in[6], &stp->in[7], bits, DG);
        if (kgu < 0 || kdn < 0 || gq->rank != 3 || dq->rank != 3)
            return rt_fail(b->err, NPUC_E_INVALID, HINT_DAMAGED, "qmoe %s: quantized experts do not fit their scales, "
                           "zero points and groups", name);
        here = gq->shape[0];
        gu_n = gq->shape[1];
        gu_k = kgu;
        dn_n = dq->shape[1];
        dn_k = kdn;
        if (dq->shape[0] != here)
            return rt_fail(b->err, NPUC_E_INVALID, HINT_DAMAGED, "qmoe %s: gate_up and down hold different experts",
                           name);
    } else {
        const rt_view *gu = &stp->in[2], *dn = &stp->in[3];
        if (gu->rank != 3 || dn->rank != 3)
            return rt_fail(b->err, NPUC_E_INVALID, HINT_DAMAGED,
                           "fused_moe %s takes x [T,H], router [E,H], gate_up [E,2I,H], down [E,H,I]", name);
        here = gu->shape[0];
        gu_n = gu->shape[1];
        gu_k = gu->shape[2];
        if (dn->shape[0] != here)
            return rt_fail(b->err, NPUC_E_INVALID, HINT_DAMAGED, "fused_moe %s: gate_up and down hold different "
                           "experts", name);
        dn_n = dn->shape[1];
        dn_k = dn->shape[2];
        if (!is_float(gu->dtype) || gu->dtype != x->dtype || dn->dtype != x->dtype)
            return rt_fail(b->err, NPUC_E_INVALID, HINT_DAMAGED, "fused_moe %s: experts are not floats of x's dtype",
                           name);
    }
    if (x->rank != 2 || router->rank != 2)
        return rt_fail(b->err, NPUC_E_INVALID, HINT_DAMAGED, "%s %s takes x [T,H] and router [E,H]", opn, name);
    i64 T = x->shape[0], H = x->shape[1], E = router->shape[0];
    I = dn_k;
    int64_t k = 0, g = 1, kg = 1, offset = 0, norm = 0;
    double eps = 1e-20, rscale = 1.0;
    const char *scoring, *gscore, *activation;
    int has_k;
    if (attr_int(op, "top_k", 0, &k, &has_k) || !has_k || attr_int(op, "n_group", 1, &g, NULL)
        || attr_int(op, "topk_group", 1, &kg, NULL) || attr_int(op, "expert_offset", 0, &offset, NULL)
        || attr_int(op, "norm_topk", 0, &norm, NULL) || attr_num(op, "norm_eps", 1e-20, &eps, NULL)
        || attr_num(op, "routed_scale", 1.0, &rscale, NULL) || attr_str(op, "scoring", "sigmoid", &scoring)
        || attr_str(op, "group_score", "top2_sum", &gscore) || attr_str(op, "activation", "silu", &activation))
        return rt_fail(b->err, NPUC_E_INVALID, HINT_DAMAGED, "%s %s: attributes malformed", opn, name);
    if (router->shape[1] != H || gu_n != 2 * I || gu_k != H || dn_n != H || (bias && !dims_are(bias, 1, &E))
        || offset < 0 || offset > E - here)
        return rt_fail(b->err, NPUC_E_INVALID, HINT_DAMAGED, "%s %s: x, router, experts and bias do not fit", opn,
                       name);
    if (!is_float(x->dtype) || !is_float(router->dtype) || (bias && !is_float(bias->dtype)))
        return rt_fail(b->err, NPUC_E_INVALID, HINT_DAMAGED, "%s %s: operands are not floats", opn, name);
    int softmax = !strcmp(scoring, "softmax"), top2 = !strcmp(gscore, "top2_sum");
    if ((!softmax && strcmp(scoring, "sigmoid")) || (!top2 && strcmp(gscore, "max")) || strcmp(activation, "silu"))
        return rt_fail(b->err, NPUC_E_INVALID, HINT_DAMAGED, "%s %s: scoring %s, group_score %s or activation %s is "
                       "not supported", opn, name, scoring, gscore, activation);
    if (g < 1 || E % g || kg < 1 || kg > g || k < 1 || k > kg * (E / g) || (kg < g && top2 && E / g < 2))
        return rt_fail(b->err, NPUC_E_INVALID, HINT_DAMAGED, "%s %s: top_k=%lld of %lld experts in topk_group=%lld "
                       "of n_group=%lld does not fit", opn, name, (long long)k, (long long)E, (long long)kg,
                       (long long)g);
    i64 oshape[2] = {T, H};
    if (stp->out[0].dtype != x->dtype || !dims_are(&stp->out[0], 2, oshape))
        return rt_fail(b->err, NPUC_E_INVALID, HINT_DAMAGED, "%s %s: output is not x's type", opn, name);
    if (x->dtype != NPUC_F32 && x->dtype != NPUC_BF16)
        return rt_fail(b->err, NPUC_E_NO_KERNEL, HINT_TORCH, "%s %s in %s: no native kernel (f32 and bf16)", opn,
                       name, npuc_dtype_name(x->dtype));
    if (quant && bits == 4 && (G % 16 || DG % 16))
        return rt_fail(b->err, NPUC_E_NO_KERNEL, HINT_TORCH, "qmoe %s: 4-bit groups of %lld/%lld (the native kernel "
                       "takes multiples of 16)", name, (long long)G, (long long)DG);

    moe_plan pl;
    memset(&pl, 0, sizeof(pl));
    pl.T = T; pl.H = H; pl.E = E; pl.here = here; pl.I = I; pl.k = k; pl.g = g; pl.kg = kg; pl.offset = offset;
    pl.softmax = softmax; pl.top2 = top2; pl.norm = norm != 0;
    pl.eps = (float)eps; pl.rscale = (float)rscale;
    pl.xbf = x->dtype == NPUC_BF16;
    pl.threads = b->threads < 1 ? 1 : b->threads;
    int kind = quant ? W_Q : pl.xbf ? W_BF16 : W_F32;
    pl.gu = (moe_w){kind, stp->in[2].data, 2 * I, H, (int)bits, G, NULL, NULL};
    pl.dn = (moe_w){kind, stp->in[quant ? 5 : 3].data, H, I, (int)bits, DG, NULL, NULL};
    /* an expert has at most T rows (a token picks k distinct experts) */
    pl.gemv_rows = MOE_GEMM_ROWS - 1;
    i64 gm = imin(T, pl.gemv_rows), S = T * k, KX = imax(H, I);
    i64 o = 0;
#define TAKE(field, n) do { pl.field = o; o += ((i64)(n) + 15) / 16 * 16; } while (0)
    TAKE(o_xf, pl.xbf ? T * H : 0);
    TAKE(o_logits, T * E);
    TAKE(o_scores, E);
    TAKE(o_choice, E);
    TAKE(o_gs, g);
    TAKE(o_keep, g);
    TAKE(o_idx, S + kg);
    TAKE(o_w, S + kg);
    TAKE(o_posn, S);
    TAKE(o_cnt, here + 1);
    TAKE(o_start, here + 1);
    TAKE(o_hits, here + 1);
    TAKE(o_xg, imax(S * H, H));
    TAKE(o_h, S * 2 * I);
    TAKE(o_act, S * I);
    TAKE(o_y, S * H);
    i64 pack = 0, gemm = 0;
    if (T > pl.gemv_rows) {
        if (kind == W_Q)
            gemm = imax(npuc_qgemm_scratch_floats(T, 2 * I, H, 0, pl.threads),
                        npuc_qgemm_scratch_floats(T, H, I, 0, pl.threads));
        else {
            pack = imax(npuc_gemm_packed_floats(2 * I, H), npuc_gemm_packed_floats(H, I));
            gemm = imax(npuc_gemm_scratch_floats(T, 2 * I, H, 0), npuc_gemm_scratch_floats(T, H, I, 0));
        }
    }
    TAKE(o_pack, pack);
    TAKE(o_gemm, gemm);
    pl.per_thread = kind == W_BF16 ? 2 * gm * KX
                    : kind == W_Q ? imax(npuc_qlinear_scratch_floats(gm, H, G), npuc_qlinear_scratch_floats(gm, I, DG))
                                  : 0;
    pl.per_thread = (pl.per_thread + 15) / 16 * 16;
    TAKE(o_thr, pl.threads * pl.per_thread);
#undef TAKE
    want_scratch(b, o);
    stp->run = moe_run;
    if (b->dry) return 0;

    moe_plan *P = pool_alloc(b->pool, sizeof(moe_plan));
    if (!P) return rt_fail(b->err, NPUC_E_ARG, NULL, "%s %s: out of memory", opn, name);
    *P = pl;
    b->extra_bytes += sizeof(moe_plan);
    P->router = as_f32(b, router);
    P->bias = bias ? as_f32(b, bias) : NULL;
    if (!P->router || (bias && !P->bias)) return rt_fail(b->err, NPUC_E_ARG, NULL, "%s %s: out of memory", opn, name);
    if (quant) { /* the kernels take scales and zero points as f32 (ir/quant.py's layout otherwise) */
        P->gu.scale = as_f32(b, &stp->in[3]);
        P->gu.zero = codes_f32(b, &stp->in[4]);
        P->dn.scale = as_f32(b, &stp->in[6]);
        P->dn.zero = codes_f32(b, &stp->in[7]);
        if (!P->gu.scale || !P->gu.zero || !P->dn.scale || !P->dn.zero)
            return rt_fail(b->err, NPUC_E_ARG, NULL, "qmoe %s: out of memory", name);
    }
    stp->p[0] = P;
    return 0;
}

static int bind_fused_moe(rt_binder *b, rt_step *stp) { return bind_moe_common(b, stp, 0); }
static int bind_qmoe(rt_binder *b, rt_step *stp) { return bind_moe_common(b, stp, 1); }

rt_bind_fn rt_deepseek_binder(const char *op) {
    if (!op) return NULL;
    if (!strcmp(op, "mla_attention")) return bind_mla;
    if (!strcmp(op, "fused_moe")) return bind_fused_moe;
    if (!strcmp(op, "qmoe")) return bind_qmoe;
    return NULL;
}
