/* The attention variants, convolutions and rotary embeddings that exec.c's own binders
 * refuse: the binders exec.c asks last (exec.h), each the op's shape rule as ir/fused_ops.py
 * and ir/ops.py state it, and the kernels its steps run.
 *
 *   fused_attention   with a mask (additive or boolean, broadcast to [b, hq, s, l]), sinks,
 *   cached_attention  a sliding window, soft-capping, ALiBi; causal or not (fused: top-left
 *   sdpa              aligned, as torch's is_causal); GQA. One kernel (att_*) for the three:
 *                     a plan (att_plan) made at bind time says where each query's position
 *                     comes from, which keys it sees, and how a score is formed.
 *   cached_conv1d     LFM2's short convolution over the rows cached by position, and conv1d
 *   conv1d            (pads, stride, dilation, groups): one output element per inner loop.
 *   rotary_embedding  the ONNX contrib op, and rope_lut for what exec.c's does not take
 *   rope_lut          (bf16/f16 operands or tables, i32 positions).
 *
 * Attention. The rows of queries that share a kv head (G = hq / hkv heads x s queries,
 * ordered query-major) are cut into blocks of at most AT_QB; one chunk of the pool's
 * parallel-for is one (b, kv head, block). A chunk reads each key row and each value row
 * it needs once, for all its queries: decode (a few queries over a long cache) reads the
 * cache once per kv head. Scores are formed as _attention_math does, in f32: q . k * scale,
 * softcap * tanh(s / softcap), + slope_h * (j - position), then the mask (false or the
 * causal band's outside: -inf; additive: + m). Softmax as torch: exp(s - max) / sum, with a
 * sink logit in the max and the sum where sinks are given. A row that sees no key gives NaN
 * (softmax of all -inf), except where the reference runs torch's sdpa (no softcap, sinks or
 * ALiBi), whose math drops such rows to 0. bf16/f16 are computed in f32 and rounded once.
 * cached_attention's caches may hold another layout than q's dtype (--kv_cache_dtype): f32,
 * bf16, f16, or packed int8 rows of an f32 scale and d codes, read as code * scale (att_row).
 *
 * Run time allocates nothing (the shared scratch, per-thread regions by the pool's thread
 * id); every size is checked at bind time; a position outside the cache or table is
 * NPUC_E_INPUT from the run function, checked before any row is read.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "ops_generic.h"
#include "ops_recurrent.h"

#define AT_QB 32         /* query rows per chunk (decode's G * s rows up to 2 * AT_QB: one chunk) */
#define AT_MAX (INT64_C(1) << 40)

static inline i64 imax(i64 a, i64 b) { return a > b ? a : b; }
static inline i64 imin(i64 a, i64 b) { return a < b ? a : b; }

/* a * b, or -1 past AT_MAX (sizes here are products of a few checked dims). */
static i64 mul_ok(i64 a, i64 b) {
    if (a < 0 || b < 0) return -1;
    if (a != 0 && b > AT_MAX / a) return -1;
    return a * b;
}

/* A value of dtype dt after rounding f32 x to it. */
static inline float round_to(int dt, float x) {
    if (dt == NPUC_BF16) return npuc_bf16_to_f32(rt_f32_to_bf16(x));
    if (dt == NPUC_F16) return rt_f16_to_f32(rt_f32_to_f16(x));
    return x;
}

static inline i64 load_index(const void *p, int dt, i64 k) {
    return dt == NPUC_I32 ? (i64)((const int32_t *)p)[k] : ((const int64_t *)p)[k];
}

static inline float dot(const float *a, const float *b, i64 n) {
    float acc[8] = {0};
    i64 k = 0;
    for (; k + 8 <= n; k += 8)
        for (int u = 0; u < 8; u++) acc[u] += a[k + u] * b[k + u];
    float s = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for (; k < n; k++) s += a[k] * b[k];
    return s;
}

/* ---- attention -------------------------------------------------------------------------------- */

typedef struct att_plan {
    i64 B, HQ, HKV, G, S, L, D, DV; /* q [B,HQ,S,D], k [B,HKV,L,D], v [B,HKV,L,DV], out [B,HQ,S,DV] */
    int dt;                         /* q and out (and k, v but for a cache of another layout) */
    int kdt;                        /* k and v: dt, or a cache's f32, bf16, f16, or packed int8 rows */
    int cached;                     /* positions from in[3]; else query i is at position i */
    int causal;                     /* keys j <= position only (cached: always) */
    int safe;                       /* a row that sees no key gives 0 (torch's sdpa), not NaN */
    i64 window;                     /* > 0: keys position - window < j only */
    float scale, softcap;
    int mask_in, mask_dt;           /* operand of the mask (-1: none) */
    i64 mst[4];                     /* its element strides over (b, h, i, j); 0 where broadcast */
    int sinks_in, sinks_dt;         /* operand of the sinks (-1: none) */
    int pos_dt;
    i64 pstride;                    /* positions [S] (0) or [B, S] (S) */
    i64 QB, blocks, per_thread;
    const float *alibi;             /* HQ slopes, or NULL */
    int slot_in;                    /* cached, slotted: the operand of each query's slot (-1: none) */
    i64 slots;                      /* ... and the caches' slots */
} att_plan;

typedef struct att_job {
    const att_plan *P;
    const void *q, *k, *v, *mask, *sinks, *pos, *slot;
    void *out;
    float *scratch;
} att_job;

/* Row `row` of n values of k or v as f32: packed int8 rows (a KV cache of --kv_cache_dtype int8)
 * are n + 4 bytes, an f32 scale then n codes, read as code * scale (ir/fused_ops.py). */
static void att_row(const void *p, int dt, i64 row, i64 n, float *dst) {
    if (dt != NPUC_I8) {
        og_load_f32(p, dt, row * n, 1, n, dst);
        return;
    }
    const int8_t *r = (const int8_t *)p + row * (n + 4);
    float scale;
    memcpy(&scale, r, 4);
    for (i64 k = 0; k < n; k++) dst[k] = (float)r[4 + k] * scale;
}

static void att_chunk(const void *ctx, i64 c, int tid) {
    const att_job *J = ctx;
    const att_plan *P = J->P;
    i64 blk = c % P->blocks, bh = c / P->blocks, b = bh / P->HKV, hk = bh % P->HKV;
    i64 r0 = blk * P->QB, nr = imin(P->QB, P->G * P->S - r0), L = P->L, D = P->D, DV = P->DV;
    float *sc = J->scratch + (i64)tid * P->per_thread, *qf = sc + P->QB * L, *acc = qf + P->QB * D;
    float *kr = acc + P->QB * DV, *vr = kr + D;
    i64 lo[AT_QB * 2], hi[AT_QB * 2], posn[AT_QB * 2], head[AT_QB * 2], qi[AT_QB * 2];
    i64 jlo = L, jhi = 0;
    for (i64 rr = 0; rr < nr; rr++) {
        i64 r = r0 + rr, i = r / P->G, h = hk * P->G + r % P->G;
        i64 p = P->cached ? load_index(J->pos, P->pos_dt, b * P->pstride + i) : i;
        i64 h1 = (P->cached || P->causal) ? imin(p + 1, L) : L;
        i64 l0 = P->window > 0 ? imax(0, p - P->window + 1) : 0;
        lo[rr] = imin(l0, h1), hi[rr] = h1, posn[rr] = p, head[rr] = h, qi[rr] = i;
        jlo = imin(jlo, lo[rr]), jhi = imax(jhi, hi[rr]);
        og_load_f32(J->q, P->dt, ((b * P->HQ + h) * P->S + i) * D, 1, D, qf + rr * D);
    }
    /* slotted: a block is one query's G heads (QB = G), over that query's slot of the caches */
    const i64 kb = P->slot_in >= 0 ? load_index(J->slot, NPUC_I64, r0 / P->G) : b;
    const i64 kbase = (kb * P->HKV + hk) * L;
    for (i64 j = jlo; j < jhi; j++) {
        att_row(J->k, P->kdt, kbase + j, D, kr);
        for (i64 rr = 0; rr < nr; rr++) {
            float s = -INFINITY;
            if (j >= lo[rr] && j < hi[rr]) {
                s = dot(qf + rr * D, kr, D) * P->scale;
                if (P->softcap > 0.0f) s = tanhf(s / P->softcap) * P->softcap;
                if (P->alibi) s += P->alibi[head[rr]] * (float)(j - posn[rr]);
                if (P->mask_in >= 0) {
                    i64 mi = b * P->mst[0] + head[rr] * P->mst[1] + qi[rr] * P->mst[2] + j * P->mst[3];
                    if (P->mask_dt == NPUC_BOOL) {
                        if (!((const uint8_t *)J->mask)[mi]) s = -INFINITY;
                    } else {
                        s += rt_load_f(J->mask, P->mask_dt, mi);
                    }
                }
            }
            sc[rr * L + j] = s;
        }
    }
    memset(acc, 0, (size_t)(nr * DV) * sizeof(float));
    for (i64 rr = 0; rr < nr; rr++) { /* softmax over the keys the block reads: the others are -inf */
        float *row = sc + rr * L, m = -INFINITY, sum = 0.0f, sink = -INFINITY;
        if (P->sinks_in >= 0) sink = rt_load_f(J->sinks, P->sinks_dt, head[rr]);
        for (i64 j = jlo; j < jhi; j++) m = row[j] > m ? row[j] : m;
        if (sink > m) m = sink;
        if (m == -INFINITY) { /* every key hidden */
            float fill = P->safe ? 0.0f : NAN;
            for (i64 d = 0; d < DV; d++) acc[rr * DV + d] = fill;
            lo[rr] = hi[rr] = 0;
            continue;
        }
        for (i64 j = jlo; j < jhi; j++) sum += (row[j] = expf(row[j] - m));
        if (P->sinks_in >= 0) sum += expf(sink - m);
        for (i64 j = jlo; j < jhi; j++) row[j] /= sum;
    }
    for (i64 j = jlo; j < jhi; j++) {
        att_row(J->v, P->kdt, kbase + j, DV, vr);
        for (i64 rr = 0; rr < nr; rr++) {
            if (j < lo[rr] || j >= hi[rr]) continue;
            float pj = sc[rr * L + j], *a = acc + rr * DV;
            for (i64 d = 0; d < DV; d++) a[d] += pj * vr[d];
        }
    }
    for (i64 rr = 0; rr < nr; rr++)
        og_store_f32(J->out, P->dt, ((b * P->HQ + head[rr]) * P->S + qi[rr]) * DV, acc + rr * DV, DV);
}

static int att_run(const rt_step *st, struct npuc_session *s) {
    const att_plan *P = st->p[0];
    if (P->B * P->HQ * P->S == 0 || P->DV == 0) return 0;
    if (P->cached) { /* every position inside the cache, before any row is read */
        i64 n = P->pstride ? P->B * P->S : P->S;
        for (i64 k = 0; k < n; k++) {
            i64 p = load_index(st->in[3].data, P->pos_dt, k);
            if (p < 0 || p >= P->L) return NPUC_E_INPUT;
        }
    }
    for (i64 k = 0; P->slot_in >= 0 && k < P->S; k++) { /* and every slot one of the caches' */
        i64 v = load_index(st->in[P->slot_in].data, NPUC_I64, k);
        if (v < 0 || v >= P->slots) return NPUC_E_INPUT;
    }
    att_job J = {P, st->in[0].data, st->in[1].data, st->in[2].data,
                 P->mask_in >= 0 ? st->in[P->mask_in].data : NULL, P->sinks_in >= 0 ? st->in[P->sinks_in].data : NULL,
                 P->cached ? st->in[3].data : NULL, P->slot_in >= 0 ? st->in[P->slot_in].data : NULL, st->out[0].data,
                 rt_session_scratch(s)};
    npuc_parallel(att_chunk, &J, P->B * P->HKV * P->blocks, rt_session_threads(s));
    return 0;
}

/* The mask's strides over (b, h, i, j) of a [lead..., h, s, l] target of rank r (lead dims
 * flattened into b): each mask dim 1 (stride 0) or the target's; the lead dims all 1 or all
 * the target's. */
static int att_mask(rt_binder *b, rt_step *st, const rt_view *m, int32_t r, const int64_t *tgt, att_plan *P) {
    if (m->rank > r) return og_no_kernel(b, st, "a mask of rank %d over rank-%d scores", (int)m->rank, (int)r);
    if (m->dtype != NPUC_BOOL && !og_is_f32ish(m->dtype) && m->dtype != NPUC_F64)
        return og_no_kernel(b, st, "a mask of dtype %s", npuc_dtype_name(m->dtype));
    int64_t ms[NPUC_MAX_RANK], stride[NPUC_MAX_RANK];
    for (int32_t d = 0; d < r; d++) ms[d] = d < r - m->rank ? 1 : m->shape[d - (r - m->rank)];
    i64 acc = 1;
    for (int32_t d = r - 1; d >= 0; d--) {
        if (ms[d] != 1 && ms[d] != tgt[d]) return og_invalid(b, st, "the mask does not broadcast to the scores");
        stride[d] = ms[d] == 1 ? 0 : acc;
        acc *= ms[d];
    }
    memset(P->mst, 0, sizeof P->mst);
    P->mst[3] = stride[r - 1];
    if (r >= 2) P->mst[2] = stride[r - 2];
    if (r >= 3) P->mst[1] = stride[r - 3];
    if (r >= 4) {
        int ones = 1, full = 1;
        for (int32_t d = 0; d < r - 3; d++) ones &= ms[d] == 1, full &= ms[d] == tgt[d];
        if (!ones && !full) return og_no_kernel(b, st, "a mask broadcast over some of the batch dims only");
        P->mst[0] = ones ? 0 : stride[r - 4];
    }
    P->mask_dt = m->dtype;
    return 0;
}

/* The checks and plan every attention shares; kind 0 fused_attention, 1 cached_attention, 2 sdpa. */
static int att_bind(rt_binder *b, rt_step *st, int kind) {
    const rt_view *q = &st->in[0], *k = &st->in[1], *v = &st->in[2];
    int64_t slotted = 0;
    int rc;
    if (kind == 1 && (rc = og_attr_int(b, st, "slotted", 1, 0, &slotted))) return rc;
    if (slotted != 0 && slotted != 1) return og_invalid(b, st, "slotted is 0 or 1");
    int min_in = kind == 1 ? 4 + (int)slotted : 3, max_in = kind == 2 ? 4 : 5 + (int)slotted;
    if ((rc = og_check_arity(b, st, min_in, max_in, 1))) return rc;
    att_plan P;
    memset(&P, 0, sizeof P);
    P.mask_in = P.sinks_in = P.slot_in = -1;
    int32_t r = q->rank;
    if (r < 2 || k->rank != r || v->rank != r || (kind != 2 && r != 4))
        return og_invalid(b, st, "q, k and v are not [batch, heads, seq, dim]");
    /* a cache of another layout than q's dtype (cached_attention; q f32 or bf16): f32, bf16, f16,
     * or int8 rows of d + 4 bytes */
    int other = kind == 1 && k->dtype == v->dtype && (k->dtype != q->dtype || k->dtype == NPUC_I8) &&
                (q->dtype == NPUC_F32 || q->dtype == NPUC_BF16) &&
                (og_is_f32ish(k->dtype) || k->dtype == NPUC_I8);
    if (!other && (q->dtype != k->dtype || k->dtype != v->dtype))
        return og_invalid(b, st, "q, k and v differ in dtype");
    int64_t pack = k->dtype == NPUC_I8 && other ? 4 : 0;
    if (q->shape[r - 1] + pack != k->shape[r - 1] || k->shape[r - 2] != v->shape[r - 2] || v->shape[r - 1] < pack)
        return og_invalid(b, st, "q, k and v do not fit");
    for (int32_t d = 0; d + 2 < r; d++)
        if (k->shape[d] != v->shape[d]) return og_invalid(b, st, "k and v do not fit");
    P.S = q->shape[r - 2], P.D = q->shape[r - 1], P.L = k->shape[r - 2], P.DV = v->shape[r - 1] - pack;
    P.HQ = r >= 3 ? q->shape[r - 3] : 1, P.HKV = r >= 3 ? k->shape[r - 3] : 1;
    P.B = 1;
    if (slotted) { /* q [1, hq, s, d]: query i over cache slot[i] (the last operand) */
        const rt_view *sl = &st->in[st->n_in - 1];
        if (q->shape[0] != 1 || sl->rank != 1 || sl->shape[0] != P.S || sl->dtype != NPUC_I64)
            return og_invalid(b, st, "q is not [1, hq, s, d] with a slot i64 [s]");
        P.slot_in = st->n_in - 1, P.slots = k->shape[0];
    }
    for (int32_t d = 0; d + 3 < r && !slotted; d++) {
        if (q->shape[d] != k->shape[d])
            return kind == 2 ? og_no_kernel(b, st, "batch dims that broadcast") : og_invalid(b, st, "q, k differ in b");
        P.B *= q->shape[d];
    }
    if (P.HKV == 0 || P.HQ % P.HKV) return og_invalid(b, st, "query heads are not a multiple of key heads");
    P.G = P.HQ / P.HKV, P.dt = q->dtype, P.kdt = k->dtype;
    int64_t want[NPUC_MAX_RANK];
    memcpy(want, q->shape, sizeof want);
    want[r - 1] = P.DV;
    if ((rc = og_check_out(b, st, 0, q->dtype, r, want))) return rc;
    double scale, cap = 0.0;
    int64_t causal = 0, window = 0, gqa = 0;
    if (kind == 2) {
        if ((rc = og_attr_num(b, st, "scale", 1, NAN, &scale)) || (rc = og_attr_int(b, st, "causal", 1, 0, &causal)) ||
            (rc = og_attr_int(b, st, "gqa", 1, 0, &gqa)))
            return rc;
        if (isnan(scale)) scale = 1.0 / sqrt((double)P.D);
        if (!gqa && P.G != 1 && P.HKV != 1) return og_no_kernel(b, st, "heads that neither match nor broadcast");
    } else {
        if ((rc = og_attr_num(b, st, "scale", 0, 0, &scale)) || (rc = og_attr_int(b, st, "window", 1, 0, &window)) ||
            (rc = og_attr_num(b, st, "softcap", 1, 0, &cap)))
            return rc;
        if (kind == 0 && (rc = og_attr_int(b, st, "causal", 1, 0, &causal))) return rc;
        if (window < 0 || cap < 0 || (kind == 0 && window && !causal))
            return og_invalid(b, st, "a window < 0, a softcap < 0, or a window without causal");
    }
    P.scale = (float)scale, P.softcap = (float)cap, P.window = window, P.causal = causal != 0, P.cached = kind == 1;
    const rt_attr *al = kind == 2 ? NULL : rt_find_attr(st->op, "alibi");
    int32_t n_al = al && (al->kind == ATTR_FLOATS || al->kind == ATTR_INTS) ? al->n : 0;
    if (al && al->kind != ATTR_FLOATS && al->kind != ATTR_INTS) return og_invalid(b, st, "alibi is not a list");
    if (n_al && n_al != P.HQ) return og_invalid(b, st, "%d ALiBi slopes for %lld query heads", (int)n_al,
                                                 (long long)P.HQ);
    if (kind == 1) {
        const rt_view *pos = &st->in[3];
        int ok = (pos->rank == 1 && pos->shape[0] == P.S) || (pos->rank == 2 && pos->shape[0] == P.B &&
                                                               pos->shape[1] == P.S);
        if (!ok || (pos->dtype != NPUC_I64 && pos->dtype != NPUC_I32))
            return og_invalid(b, st, "the positions are not i64 [s] or [b, s]");
        P.pos_dt = pos->dtype, P.pstride = pos->rank == 2 ? P.S : 0;
    } else if (st->n_in > 3) {
        int64_t tgt[NPUC_MAX_RANK];
        memcpy(tgt, q->shape, sizeof tgt);
        tgt[r - 1] = P.L;
        if ((rc = att_mask(b, st, &st->in[3], r, tgt, &P))) return rc;
        P.mask_in = 3;
    }
    if (st->n_in > 4 + (int)slotted) {
        const rt_view *sk = &st->in[4];
        if (sk->rank != 1 || sk->shape[0] != P.HQ || !og_is_float(sk->dtype))
            return og_invalid(b, st, "the sinks are not a float [hq]");
        P.sinks_in = 4, P.sinks_dt = sk->dtype;
    }
    P.safe = P.softcap == 0.0f && P.sinks_in < 0 && n_al == 0;
    if (!og_is_f32ish(q->dtype)) return og_no_kernel(b, st, "attention of dtype %s", npuc_dtype_name(q->dtype));
    i64 rows = mul_ok(P.G, P.S);
    if (rows < 0 || mul_ok(P.B, P.HQ) < 0 || mul_ok(mul_ok(P.B, P.HQ), mul_ok(P.S, imax(P.D, P.DV))) < 0 ||
        mul_ok(mul_ok(P.B, P.HKV), mul_ok(P.L, imax(P.D, P.DV))) < 0)
        return og_no_kernel(b, st, "an attention this large");
    if (slotted && P.G > 2 * AT_QB) return og_no_kernel(b, st, "over %d query heads a key head, slotted", 2 * AT_QB);
    P.QB = slotted ? imax(P.G, 1) : rows <= 2 * AT_QB ? imax(rows, 1) : AT_QB;
    P.blocks = (imax(rows, 1) + P.QB - 1) / P.QB;
    i64 per = mul_ok(P.QB, P.L + P.D + P.DV);
    if (per < 0 || per > AT_MAX / 4) return og_no_kernel(b, st, "an attention this large");
    P.per_thread = (per + P.D + P.DV + 15) / 16 * 16;
    og_want_scratch(b, (uint64_t)P.per_thread * (uint64_t)imax(b->threads, 1));
    st->run = att_run;
    if (b->dry) return 0;
    att_plan *pp = og_alloc(b, st, sizeof(att_plan) + (size_t)n_al * sizeof(float));
    if (!pp) return NPUC_E_ARG;
    *pp = P;
    if (n_al) {
        float *sl = (float *)(pp + 1);
        for (int32_t h = 0; h < n_al; h++) sl[h] = (float)(al->kind == ATTR_FLOATS ? al->floats[h] : al->ints[h]);
        pp->alibi = sl;
    }
    st->p[0] = pp;
    return 0;
}

static int bind_fused_attention(rt_binder *b, rt_step *st) { return att_bind(b, st, 0); }
static int bind_cached_attention(rt_binder *b, rt_step *st) { return att_bind(b, st, 1); }
static int bind_sdpa(rt_binder *b, rt_step *st) { return att_bind(b, st, 2); }

/* ---- convolutions ----------------------------------------------------------------------------
 * i: 0 N (batch), 1 C, 2 L (x's length; cached: the cache's rows), 3 O, 4 Cg (channels per
 *    group), 5 K, 6 dilation, 7 Og (outputs per group), 8 x dtype, 9 w dtype, 10 bias (0/1),
 *    11 Lout, 12 stride, 13 left pad; cached: 14 positions dtype, 15 their stride (0 shared) */

static inline float ld(const void *p, int dt, i64 i) {
    switch (dt) {
    case NPUC_F32: return ((const float *)p)[i];
    case NPUC_BF16: return npuc_bf16_to_f32(((const uint16_t *)p)[i]);
    default: return rt_f16_to_f32(((const uint16_t *)p)[i]);
    }
}

typedef struct conv_job {
    const rt_step *st;
    const void *pos;
} conv_job;

/* One (n, o) row of outputs: conv1d's Lout of them, or cached_conv1d's one. */
static void conv_row(const conv_job *J, i64 c) {
    const rt_step *st = J->st;
    const i64 *a = st->i;
    i64 n = c / a[3], o = c % a[3], C = a[1], L = a[2], Cg = a[4], K = a[5], dil = a[6], g = o / a[7];
    int xdt = (int)a[8], wdt = (int)a[9];
    const void *x = st->in[0].data, *w = st->in[1].data;
    float bias = a[10] ? ld(st->in[3 - (J->pos == NULL)].data, wdt, o) : 0.0f;
    for (i64 l = 0; l < a[11]; l++) {
        i64 start = J->pos ? load_index(J->pos, (int)a[14], n * a[15]) - dil * (K - 1) : l * a[12] - a[13];
        float acc = 0.0f;
        for (i64 ci = 0; ci < Cg; ci++) {
            i64 ch = g * Cg + ci;
            for (i64 t = 0; t < K; t++) {
                i64 at = start + t * dil;
                if (at < 0 || at >= L) continue; /* padding, or rows before position 0: zeros */
                float xv = J->pos ? round_to(wdt, ld(x, xdt, (n * L + at) * C + ch))
                                  : ld(x, xdt, (n * C + ch) * L + at);
                acc += ld(w, wdt, (o * Cg + ci) * K + t) * xv;
            }
        }
        float y = acc + bias;
        og_store_f32(st->out[0].data, wdt, (n * a[3] + o) * a[11] + l, &y, 1);
    }
}

static void conv_rows(const void *ctx, i64 lo, i64 hi, int tid) {
    (void)tid;
    for (i64 c = lo; c < hi; c++) conv_row(ctx, c);
}

static int conv_run(const rt_step *st, struct npuc_session *s) {
    const i64 *a = st->i;
    conv_job J = {st, a[16] ? st->in[2].data : NULL};
    if (J.pos) {
        for (i64 k = 0; k < (a[15] ? a[0] : 1); k++) {
            i64 p = load_index(J.pos, (int)a[14], k);
            if (p < 0 || p >= a[2]) return NPUC_E_INPUT;
        }
    }
    /* f32 depthwise, unpadded, stride and dilation 1 (the short conv over a recurrent layer's
     * window): ops_recurrent.c's kernel, the same sums in the same order without the loads'
     * dtype switch */
    if (!J.pos && a[8] == NPUC_F32 && a[9] == NPUC_F32 && a[4] == 1 && a[3] == a[1] && a[6] == 1 && a[12] == 1 &&
        a[13] == 0 && a[11] == a[2] - a[5] + 1)
        return npuc_conv1d_depthwise_f32(st->in[0].data, st->in[1].data, a[10] ? st->in[2].data : NULL,
                                         st->out[0].data, a[0], a[1], a[2], a[5], rt_session_threads(s))
                   ? NPUC_E_KERNEL
                   : 0;
    /* rows of about 64K multiply-adds a chunk: a decode step's depthwise conv (a few per row)
     * runs on one thread, where a chunk per row cost more in handing out than in computing */
    i64 per_row = a[11] * a[4] * a[5];
    og_parallel(conv_rows, &J, a[0] * a[3], 65536 / (per_row > 0 ? per_row : 1) + 1, rt_session_threads(s));
    return 0;
}

/* The checks both share: w [O, C/groups, K] against C channels, the bias, the dtypes. */
static int conv_common(rt_binder *b, rt_step *st, const rt_view *x, i64 C, int bias_in, i64 *a) {
    const rt_view *w = &st->in[1];
    int64_t g, d;
    int rc;
    if ((rc = og_attr_int(b, st, "groups", 1, 1, &g)) || (rc = og_attr_int(b, st, "dilation", 1, 1, &d))) return rc;
    if (w->rank != 3 || g < 1 || d < 1 || C != w->shape[1] * g || w->shape[0] % g)
        return og_invalid(b, st, "w does not fit the channels with groups=%lld", (long long)g);
    if (st->n_in > bias_in && (st->in[bias_in].rank != 1 || st->in[bias_in].shape[0] != w->shape[0] ||
                               st->in[bias_in].dtype != w->dtype))
        return og_invalid(b, st, "the bias is not [O] of w's dtype");
    if (!og_is_f32ish(x->dtype) || !og_is_f32ish(w->dtype))
        return og_no_kernel(b, st, "a convolution of %s by %s", npuc_dtype_name(x->dtype), npuc_dtype_name(w->dtype));
    a[1] = C, a[3] = w->shape[0], a[4] = w->shape[1], a[5] = w->shape[2], a[6] = d, a[7] = w->shape[0] / g;
    a[8] = x->dtype, a[9] = w->dtype, a[10] = st->n_in > bias_in;
    if (mul_ok(mul_ok(a[3], a[4]), mul_ok(a[5], d)) < 0) return og_no_kernel(b, st, "a convolution this large");
    st->run = conv_run;
    return 0;
}

static int bind_cached_conv1d(rt_binder *b, rt_step *st) {
    const rt_view *cache = &st->in[0], *pos = &st->in[2];
    int rc;
    if ((rc = og_check_arity(b, st, 3, 4, 1))) return rc;
    if (cache->rank != 4 || cache->shape[1] != 1 || !og_is_float(cache->dtype))
        return og_invalid(b, st, "the cache is not a float [b, 1, max_len, c]");
    i64 *a = st->i, B = cache->shape[0];
    if ((rc = conv_common(b, st, cache, cache->shape[3], 3, a))) return rc;
    int ok = (pos->rank == 1 && pos->shape[0] == 1) || (pos->rank == 2 && pos->shape[0] == B && pos->shape[1] == 1);
    if (!ok || (pos->dtype != NPUC_I64 && pos->dtype != NPUC_I32))
        return og_invalid(b, st, "the position is not i64 [1] or [b, 1]");
    int64_t want[3] = {B, a[3], 1};
    if ((rc = og_check_out(b, st, 0, (int)a[9], 3, want))) return rc;
    a[0] = B, a[2] = cache->shape[2], a[11] = 1, a[14] = pos->dtype, a[15] = pos->rank == 2, a[16] = 1;
    return 0;
}

static int bind_conv1d(rt_binder *b, rt_step *st) {
    const rt_view *x = &st->in[0];
    const int64_t *pads;
    int32_t np;
    int64_t stride;
    int rc;
    if ((rc = og_check_arity(b, st, 2, 3, 1))) return rc;
    if ((rc = og_attr_ints(b, st, "pads", &pads, &np)) || (rc = og_attr_int(b, st, "stride", 1, 1, &stride))) return rc;
    if (x->rank != 3 || np != 2 || pads[0] < 0 || pads[1] < 0 || stride < 1 || x->dtype != st->in[1].dtype)
        return og_invalid(b, st, "x is not [N, C, L] of w's dtype, or the pads or stride are wrong");
    i64 *a = st->i;
    if ((rc = conv_common(b, st, x, x->shape[1], 2, a))) return rc;
    i64 span = a[6] * (a[5] - 1) + 1, padded = x->shape[2] + pads[0] + pads[1];
    if (pads[0] > AT_MAX || pads[1] > AT_MAX || padded < span)
        return og_invalid(b, st, "the kernel is longer than the padded input");
    a[0] = x->shape[0], a[2] = x->shape[2], a[11] = (padded - span) / stride + 1, a[12] = stride, a[13] = pads[0];
    int64_t want[3] = {a[0], a[3], a[11]};
    return og_check_out(b, st, 0, x->dtype, 3, want);
}

/* ---- rotary embeddings -----------------------------------------------------------------------
 * i: 0 rotary_embedding (1) or rope_lut (0), 1 S, 2 d, 3 half (rotated pairs), 4 H (heads),
 *    5 batch modulus of per-sequence positions (0: positions [s] shared), 6 layout (0 half,
 *    1 interleaved, 2 deinterleave), 7 x dtype, 8 table dtype, 9 positions dtype (-1 none),
 *    10 table rows, 11 x is [b, s, h*d], 12 vectors (numel / d) */

static void rope_range(const void *ctx, i64 lo, i64 hi, int tid) {
    (void)tid;
    const rt_step *st = ctx;
    const i64 *a = st->i;
    i64 S = a[1], d = a[2], half = a[3], H = a[4];
    int xdt = (int)a[7], tdt = (int)a[8], onnx = (int)a[0], lay = (int)a[6];
    const void *x = st->in[0].data, *ct = st->in[onnx ? 1 : 2].data, *stb = st->in[onnx ? 2 : 3].data;
    const void *pos = a[9] >= 0 ? st->in[onnx ? 3 : 1].data : NULL;
    for (i64 v = lo; v < hi; v++) {
        i64 si, bi;
        if (a[11]) si = (v / H) % S, bi = v / (H * S);
        else si = v % S, bi = onnx ? v / (H * S) : (a[5] ? (v / S / H) % a[5] : 0);
        i64 row = pos ? load_index(pos, (int)a[9], (onnx || a[5] ? bi * S : 0) + si) : bi * S + si;
        const i64 base = v * d;
        for (i64 k = 0; k < half; k++) {
            i64 i1 = lay == 0 ? k : 2 * k, i2 = lay == 0 ? k + half : 2 * k + 1;
            i64 o1 = lay == 1 ? 2 * k : k, o2 = lay == 1 ? 2 * k + 1 : k + half;
            float x1 = ld(x, xdt, base + i1), x2 = ld(x, xdt, base + i2);
            float c = ld(ct, tdt, row * half + k), sn = ld(stb, tdt, row * half + k), re, im;
            if (onnx) { /* in x's dtype, each product and sum rounded as torch's half ops are */
                re = round_to(xdt, round_to(xdt, c * x1) - round_to(xdt, sn * x2));
                im = round_to(xdt, round_to(xdt, sn * x1) + round_to(xdt, c * x2));
            } else {
                re = x1 * c - x2 * sn, im = x2 * c + x1 * sn;
            }
            og_store_f32(st->out[0].data, xdt, base + o1, &re, 1);
            og_store_f32(st->out[0].data, xdt, base + o2, &im, 1);
        }
        if (st->out[0].data != x && d > 2 * half) /* the part past the rotary dims, as it is */
            memcpy((char *)st->out[0].data + (base + 2 * half) * npuc_dtype_size(xdt),
                   (const char *)x + (base + 2 * half) * npuc_dtype_size(xdt), (size_t)(d - 2 * half) *
                   npuc_dtype_size(xdt));
    }
}

static int rope_run(const rt_step *st, struct npuc_session *s) {
    const i64 *a = st->i;
    if (a[9] >= 0) { /* every position inside the table */
        const rt_view *pv = &st->in[a[0] ? 3 : 1];
        for (i64 k = 0; k < pv->numel; k++) {
            i64 p = load_index(pv->data, (int)a[9], k);
            if (p < 0 || p >= a[10]) return NPUC_E_INPUT;
        }
    }
    og_parallel(rope_range, st, a[12], 64, rt_session_threads(s));
    return 0;
}

static int rope_finish(rt_binder *b, rt_step *st, const rt_view *x, const rt_view *c, const rt_view *sn) {
    i64 *a = st->i;
    if (!og_is_f32ish(x->dtype) || !og_is_f32ish(c->dtype))
        return og_no_kernel(b, st, "a rotary embedding of %s by %s tables", npuc_dtype_name(x->dtype),
                            npuc_dtype_name(c->dtype));
    if (c->dtype != sn->dtype || c->rank < 2 || c->shape[c->rank - 1] != a[3] || sn->shape[sn->rank - 1] != a[3])
        return og_invalid(b, st, "the cos and sin tables do not fit");
    a[7] = x->dtype, a[8] = c->dtype, a[12] = a[2] ? x->numel / a[2] : 0;
    st->run = rope_run;
    return og_check_out(b, st, 0, x->dtype, x->rank, x->shape);
}

static int bind_rope_lut(rt_binder *b, rt_step *st) {
    const rt_view *x = &st->in[0], *pos = &st->in[1], *c = &st->in[2], *sn = &st->in[3];
    const char *layout;
    int rc;
    if ((rc = og_check_arity(b, st, 4, 4, 1)) || (rc = og_attr_str(b, st, "layout", "half", &layout))) return rc;
    static const char *const LAYOUTS[] = {"half", "interleaved", "deinterleave"};
    int lay = -1;
    for (int k = 0; k < 3; k++)
        if (!strcmp(layout, LAYOUTS[k])) lay = k;
    if (lay < 0 || x->rank < 3 || pos->rank < 1 || pos->rank > 2 ||
        pos->shape[pos->rank - 1] != x->shape[x->rank - 2] ||
        (pos->dtype != NPUC_I64 && pos->dtype != NPUC_I32) || c->rank != 2 || sn->rank != 2 ||
        c->shape[0] != sn->shape[0] || c->shape[1] != sn->shape[1] || 2 * c->shape[1] > x->shape[x->rank - 1] ||
        !og_is_float(x->dtype))
        return og_invalid(b, st, "the positions or tables do not fit x");
    i64 *a = st->i, pb = pos->rank == 2 ? pos->shape[0] : 1;
    if (pb != 1 && (x->rank < 4 || x->shape[x->rank - 4] != pb))
        return og_no_kernel(b, st, "positions [b, s] that broadcast x");
    a[0] = 0, a[1] = x->shape[x->rank - 2], a[2] = x->shape[x->rank - 1], a[3] = c->shape[1];
    a[4] = x->shape[x->rank - 3], a[5] = pb != 1 ? pb : 0, a[6] = lay, a[9] = pos->dtype, a[10] = c->shape[0];
    return rope_finish(b, st, x, c, sn);
}

static int bind_rotary_embedding(rt_binder *b, rt_step *st) {
    const rt_view *x = &st->in[0], *c = &st->in[1], *sn = &st->in[2];
    int64_t inter, heads, rd;
    int rc;
    if ((rc = og_check_arity(b, st, 3, 4, 1)) || (rc = og_attr_int(b, st, "interleaved", 1, 0, &inter)) ||
        (rc = og_attr_int(b, st, "num_heads", 1, 0, &heads)) || (rc = og_attr_int(b, st, "rotary_dim", 1, 0, &rd)))
        return rc;
    i64 *a = st->i, B, S, d, H;
    if (x->rank == 4) B = x->shape[0], H = x->shape[1], S = x->shape[2], d = x->shape[3];
    else if (x->rank == 3 && heads > 0 && x->shape[2] % heads == 0)
        B = x->shape[0], S = x->shape[1], H = heads, d = x->shape[2] / heads;
    else return og_invalid(b, st, "x is not [b, h, s, d], or [b, s, h*d] with num_heads");
    rd = rd ? rd : d;
    if (rd % 2 || rd > d || rd < 0 || c->dtype != x->dtype) return og_invalid(b, st, "rotary_dim, or the dtypes");
    if (st->n_in == 4) {
        const rt_view *pos = &st->in[3];
        if (pos->rank != 2 || pos->shape[0] != B || pos->shape[1] != S || c->rank != 2 ||
            (pos->dtype != NPUC_I64 && pos->dtype != NPUC_I32))
            return og_invalid(b, st, "the positions do not fit x");
        a[9] = pos->dtype, a[10] = c->shape[0];
    } else {
        if (c->rank != 3 || c->shape[0] != B || c->shape[1] != S || sn->rank != 3 || sn->shape[0] != B ||
            sn->shape[1] != S)
            return og_invalid(b, st, "the cos cache is not [b, s, rotary_dim / 2]");
        a[9] = -1;
    }
    if (sn->rank != c->rank || sn->shape[0] != c->shape[0]) return og_invalid(b, st, "cos and sin differ");
    a[0] = 1, a[1] = S, a[2] = d, a[3] = rd / 2, a[4] = H, a[6] = inter ? 1 : 0, a[11] = x->rank == 3;
    return rope_finish(b, st, x, c, sn);
}

/* ---- the binder table ------------------------------------------------------------------------- */

static const og_entry TABLE[] = {
    {"fused_attention", bind_fused_attention},
    {"cached_attention", bind_cached_attention},
    {"sdpa", bind_sdpa},
    {"cached_conv1d", bind_cached_conv1d},
    {"conv1d", bind_conv1d},
    {"rope_lut", bind_rope_lut},
    {"rotary_embedding", bind_rotary_embedding},
    {NULL, NULL},
};

rt_bind_fn rt_attention_binder(const char *op) { return op ? og_lookup(TABLE, op) : NULL; }
