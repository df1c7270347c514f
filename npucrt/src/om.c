/* The `.om` container and its model sections (docs/om-format.md).
 *
 * npuc_om_parse checks the container exactly as backend/om_format.py's `_parse` does, in the
 * same order and with the same codes and messages (the header, the table and its SHA-256, each
 * entry's name, place and alignment, zero padding, nothing after the last section, then every
 * payload's SHA-256), decodes the modeldef, plan, tasks and metadata sections and joins them as
 * backend/om_sections.py's `join_model` does.
 *
 * The protobuf decoder is written for this schema only and follows what the Python side's
 * decoder (upb) accepts: varints of at most 10 bytes, tags of at most 32 bits and never field 0,
 * wire types 0..5 (groups skipped, nested at most 100 deep together with messages), every length
 * checked against the bytes left, proto3 strings valid UTF-8, a field whose wire type is not its
 * declared one skipped as an unknown field, repeated ints packed or not, a singular message
 * that appears twice merged, a scalar that appears twice: the last one. Where we are stricter:
 * a string the model keeps must not hold a NUL byte (C strings), and a repeated field may not
 * hold 2^31 or more entries.
 */
#define _POSIX_C_SOURCE 200809L /* posix_madvise */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "model.h"
#include "sha256.h"
#include "util.h"

#define HEADER_SIZE 64u
#define ENTRY_SIZE 64u
#define OM_VERSION 2u
/* The weights' chunk digests (docs/om-format.md): chunk size u64, chunk count u64, then one
 * 16-byte XXH3-128 per chunk. backend/om_format.py's _CHUNK_MIN/_CHUNK_MAX bound the size. */
#define WEIGHTS_DIGESTS "weights.xxh3"
#define CHUNKS_HEAD 16u
#define CHUNK_MIN 4096u
#define CHUNK_MAX (1ull << 30)
#define HINT_CONTAINER "the file is damaged or incomplete; recompile the model with `npuc compile`"

static const uint8_t MAGIC[8] = {'N', 'P', 'U', 'C', 'O', 'M', 0, 1};
static const char EMPTY[] = "";

static uint32_t rd32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static uint64_t rd64(const uint8_t *p) { return (uint64_t)rd32(p) | (uint64_t)rd32(p + 4) << 32; }

/* ---- protobuf wire format ------------------------------------------------------------------ */

enum { WT_VARINT = 0, WT_I64 = 1, WT_LEN = 2, WT_SGROUP = 3, WT_EGROUP = 4, WT_I32 = 5 };
enum { PB_OK = 0, PB_BAD = -1, PB_NOMEM = -2 };
#define PB_MAX_DEPTH 100

typedef struct {
    rt_pool *pool;
    int depth; /* messages and groups we may still enter */
} pb;

static int rd_varint(const uint8_t **pp, const uint8_t *end, uint64_t *v) {
    const uint8_t *p = *pp;
    uint64_t x = 0;
    for (unsigned i = 0; i < 10; i++) {
        if (p >= end) return PB_BAD;
        uint8_t b = *p++;
        x |= (uint64_t)(b & 0x7fu) << (7 * i); /* bits past 64 of a 10th byte are dropped, as upb does */
        if (!(b & 0x80u)) {
            *pp = p;
            *v = x;
            return PB_OK;
        }
    }
    return PB_BAD;
}

static int rd_tag(const uint8_t **pp, const uint8_t *end, uint32_t *field, int *wt) {
    const uint8_t *p = *pp;
    uint64_t x = 0;
    for (unsigned i = 0;; i++) {
        if (i == 5 || p >= end) return PB_BAD;
        uint8_t b = *p++;
        x |= (uint64_t)(b & 0x7fu) << (7 * i);
        if (!(b & 0x80u)) break;
    }
    if (x > 0xffffffffu || (x >> 3) == 0) return PB_BAD;
    *wt = (int)(x & 7u);
    *field = (uint32_t)(x >> 3);
    if (*wt > WT_I32) return PB_BAD;
    *pp = p;
    return PB_OK;
}

/* A length-delimited payload: [*sub, *sub_end). */
static int rd_len(const uint8_t **pp, const uint8_t *end, const uint8_t **sub, const uint8_t **sub_end) {
    uint64_t n;
    if (rd_varint(pp, end, &n)) return PB_BAD;
    if (n > (uint64_t)(end - *pp)) return PB_BAD;
    *sub = *pp;
    *sub_end = *pp + n;
    *pp = *sub_end;
    return PB_OK;
}

/* Skip one field whose tag was read (an unknown field, or a known one of another wire type). */
static int skip_field(pb *c, const uint8_t **pp, const uint8_t *end, uint32_t field, int wt) {
    uint64_t v;
    const uint8_t *s, *e;
    switch (wt) {
    case WT_VARINT:
        return rd_varint(pp, end, &v);
    case WT_I64:
        if (end - *pp < 8) return PB_BAD;
        *pp += 8;
        return PB_OK;
    case WT_I32:
        if (end - *pp < 4) return PB_BAD;
        *pp += 4;
        return PB_OK;
    case WT_LEN:
        return rd_len(pp, end, &s, &e);
    case WT_SGROUP:
        if (--c->depth < 0) return PB_BAD;
        for (;;) {
            uint32_t f;
            int w;
            if (rd_tag(pp, end, &f, &w)) return PB_BAD;
            if (w == WT_EGROUP) {
                if (f != field) return PB_BAD;
                c->depth++;
                return PB_OK;
            }
            if (skip_field(c, pp, end, f, w)) return PB_BAD;
        }
    default: /* an end-group without its start */
        return PB_BAD;
    }
}

/* Arrays grow in the pool to the next power of two (at least 4): the capacity follows from the
 * count alone, so a message parsed in two pieces (a singular field merged) appends in place. */
static size_t cap_of(size_t n) {
    if (n == 0) return 0;
    size_t c = 4;
    while (c < n) c *= 2;
    return c;
}

static int reserve(pb *c, void **arr, int32_t n, size_t extra, size_t elem) {
    if (extra > (size_t)(INT32_MAX - 1 - n)) return PB_BAD; /* 2^31 entries: refused */
    size_t want = (size_t)n + extra;
    if (want <= cap_of((size_t)n)) return PB_OK;
    size_t cap = cap_of(want);
    if (cap > SIZE_MAX / elem) return PB_NOMEM;
    void *a = pool_alloc(c->pool, cap * elem);
    if (a == NULL) return PB_NOMEM;
    if (n) memcpy(a, *arr, (size_t)n * elem);
    *arr = a;
    return PB_OK;
}

/* A new zeroed element at the end of a repeated message field. */
static void *push(pb *c, void **arr, int32_t *n, size_t elem, int *rc) {
    *rc = reserve(c, arr, *n, 1, elem);
    if (*rc) return NULL;
    return (char *)*arr + (size_t)(*n)++ * elem;
}

/* A proto3 string: valid UTF-8. `out` NULL: checked and dropped. `keep`: also refuse a NUL
 * (the model's strings are C strings) and copy it into the pool. */
static int rd_string(pb *c, const uint8_t **pp, const uint8_t *end, const char **out) {
    const uint8_t *s, *e;
    if (rd_len(pp, end, &s, &e)) return PB_BAD;
    for (const uint8_t *q = s; q < e;) {
        if (*q < 0x80) {
            if (*q == 0 && out != NULL) return PB_BAD;
            q++;
            continue;
        }
        size_t len;
        if (rt_utf8_decode(q, (size_t)(e - q), 0, &len) < 0) return PB_BAD;
        q += len;
    }
    if (out == NULL) return PB_OK;
    char *str = pool_strndup(c->pool, (const char *)s, (size_t)(e - s));
    if (str == NULL) return PB_NOMEM;
    *out = str;
    return PB_OK;
}

/* Repeated int32/int64 fields: one varint (wire type 0) or a packed run (wire type 2). An int32
 * keeps the low 32 bits of the varint, as upb does. */
static int rd_rep_varints(pb *c, const uint8_t **pp, const uint8_t *end, int wt, void **arr, int32_t *n,
                          int is64) {
    size_t elem = is64 ? sizeof(int64_t) : sizeof(int32_t);
    const uint8_t *s = *pp, *e = end;
    size_t count = 1;
    if (wt == WT_LEN) {
        if (rd_len(pp, end, &s, &e)) return PB_BAD;
        count = 0;
        for (const uint8_t *q = s; q < e; q++) count += !(*q & 0x80u);
    }
    int rc = reserve(c, arr, *n, count, elem);
    if (rc) return rc;
    const uint8_t **q = wt == WT_LEN ? &s : pp;
    for (size_t k = 0; k < count; k++) {
        uint64_t v;
        if (rd_varint(q, e, &v)) return PB_BAD;
        if (is64) {
            ((int64_t *)*arr)[(*n)++] = (int64_t)v;
        } else {
            ((int32_t *)*arr)[(*n)++] = (int32_t)(uint32_t)v;
        }
    }
    if (wt == WT_LEN && s != e) return PB_BAD; /* a varint cut off by the end of the run */
    return PB_OK;
}

static int rd_rep_doubles(pb *c, const uint8_t **pp, const uint8_t *end, int wt, double **arr, int32_t *n) {
    const uint8_t *s = *pp, *e;
    if (wt == WT_LEN) {
        if (rd_len(pp, end, &s, &e)) return PB_BAD;
        if ((e - s) % 8) return PB_BAD;
    } else {
        if (end - s < 8) return PB_BAD;
        e = s + 8;
        *pp = e;
    }
    size_t count = (size_t)(e - s) / 8;
    int rc = reserve(c, (void **)arr, *n, count, sizeof(double));
    if (rc) return rc;
    for (; s < e; s += 8) {
        uint64_t u = rd64(s);
        double d;
        memcpy(&d, &u, sizeof d);
        (*arr)[(*n)++] = d;
    }
    return PB_OK;
}

static int rd_u64(const uint8_t **pp, const uint8_t *end, uint64_t *v) { return rd_varint(pp, end, v); }

static int rd_i32(const uint8_t **pp, const uint8_t *end, int32_t *v) {
    uint64_t x;
    if (rd_varint(pp, end, &x)) return PB_BAD;
    *v = (int32_t)(uint32_t)x;
    return PB_OK;
}

/* An `optional int32` that the model keeps with -1 for "absent" (base, workspace): a present -1 is
 * stored as INT32_MIN, so that check_structure/check_tensors still refuse it (util.h). */
static int rd_opt_index(const uint8_t **pp, const uint8_t *end, int32_t *v) {
    if (rd_i32(pp, end, v)) return PB_BAD;
    if (*v == -1) *v = RT_PRESENT_MINUS_ONE;
    return PB_OK;
}

typedef int (*msg_fn)(pb *c, const uint8_t *p, const uint8_t *end, void *out);

/* A submessage's payload parsed into `out` (merged into what it holds already). */
static int rd_msg(pb *c, const uint8_t **pp, const uint8_t *end, msg_fn fn, void *out) {
    const uint8_t *s, *e;
    if (rd_len(pp, end, &s, &e)) return PB_BAD;
    if (--c->depth < 0) return PB_BAD;
    int rc = fn(c, s, e, out);
    c->depth++;
    return rc;
}

/* The loop every message shares: `FIELD(n, wt)` cases handle a field and `continue`; anything
 * else falls through to skip_field. */
#define PB_LOOP_BEGIN                                                                                              \
    while (p < end) {                                                                                              \
        uint32_t field_;                                                                                           \
        int wt_;                                                                                                   \
        if (rd_tag(&p, end, &field_, &wt_)) return PB_BAD;                                                         \
        int rc_ = PB_OK;                                                                                           \
        (void)rc_;
#define FIELD(n, w) if (field_ == (n) && wt_ == (w))
#define FIELD_INTS(n) if (field_ == (n) && (wt_ == WT_VARINT || wt_ == WT_LEN))
#define TRY(x)                                                                                                     \
    do {                                                                                                           \
        int r__ = (x);                                                                                             \
        if (r__) return r__;                                                                                       \
    } while (0)
#define PB_LOOP_END                                                                                                \
    TRY(skip_field(c, &p, end, field_, wt_));                                                                      \
    }                                                                                                              \
    return PB_OK;

/* ---- the schema (docs/om-format.md) -------------------------------------------------------- */

/* AttrValue, with which fields are present: the attribute's kind is its first present field. */
typedef struct {
    unsigned present; /* bit k: field k */
    int64_t i;
    double f;
    const char *s;
    int b;
    const char *dtype;
    int64_t *ints;
    int32_t n_ints;
    double *floats;
    int32_t n_floats;
} attr_value;

static int pb_int_list(pb *c, const uint8_t *p, const uint8_t *end, void *out) {
    attr_value *v = out;
    PB_LOOP_BEGIN
    FIELD_INTS(1) {
        TRY(rd_rep_varints(c, &p, end, wt_, (void **)&v->ints, &v->n_ints, 1));
        continue;
    }
    PB_LOOP_END
}

static int pb_float_list(pb *c, const uint8_t *p, const uint8_t *end, void *out) {
    attr_value *v = out;
    PB_LOOP_BEGIN
    if (field_ == 1 && (wt_ == WT_I64 || wt_ == WT_LEN)) {
        TRY(rd_rep_doubles(c, &p, end, wt_, &v->floats, &v->n_floats));
        continue;
    }
    PB_LOOP_END
}

static int pb_attr_value(pb *c, const uint8_t *p, const uint8_t *end, void *out) {
    attr_value *v = out;
    uint64_t x;
    PB_LOOP_BEGIN
    FIELD(1, WT_VARINT) {
        TRY(rd_varint(&p, end, &x));
        v->i = (int64_t)x;
        v->present |= 1u << 1;
        continue;
    }
    FIELD(2, WT_I64) {
        if (end - p < 8) return PB_BAD;
        x = rd64(p);
        p += 8;
        memcpy(&v->f, &x, sizeof v->f);
        v->present |= 1u << 2;
        continue;
    }
    FIELD(3, WT_LEN) {
        TRY(rd_string(c, &p, end, &v->s));
        v->present |= 1u << 3;
        continue;
    }
    FIELD(4, WT_VARINT) {
        TRY(rd_varint(&p, end, &x));
        v->b = x != 0;
        v->present |= 1u << 4;
        continue;
    }
    FIELD(5, WT_LEN) {
        TRY(rd_string(c, &p, end, &v->dtype));
        v->present |= 1u << 5;
        continue;
    }
    FIELD(6, WT_LEN) {
        TRY(rd_msg(c, &p, end, pb_int_list, v));
        v->present |= 1u << 6;
        continue;
    }
    FIELD(7, WT_LEN) {
        TRY(rd_msg(c, &p, end, pb_float_list, v));
        v->present |= 1u << 7;
        continue;
    }
    FIELD(8, WT_VARINT) {
        TRY(rd_varint(&p, end, &x));
        v->present |= 1u << 8;
        continue;
    }
    PB_LOOP_END
}

typedef struct {
    const char *name;
    attr_value v;
} attr_msg;

static int pb_attr(pb *c, const uint8_t *p, const uint8_t *end, void *out) {
    attr_msg *a = out;
    PB_LOOP_BEGIN
    FIELD(1, WT_LEN) {
        TRY(rd_string(c, &p, end, &a->name));
        continue;
    }
    FIELD(2, WT_LEN) {
        TRY(rd_msg(c, &p, end, pb_attr_value, &a->v));
        continue;
    }
    PB_LOOP_END
}

/* The attribute as the runtime sees it (runtime/om_validate.attr_value: the first field set). */
static void attr_finish(const attr_msg *a, rt_attr *out) {
    const attr_value *v = &a->v;
    out->name = a->name != NULL ? a->name : EMPTY;
    int first = 0;
    for (int k = 1; k <= 8; k++) {
        if (v->present & (1u << k)) {
            first = k;
            break;
        }
    }
    out->kind = ATTR_UNSET;
    switch (first) {
    case 1:
        out->kind = ATTR_I, out->i = v->i;
        break;
    case 2:
        out->kind = ATTR_F, out->f = v->f;
        break;
    case 3:
        out->kind = ATTR_S, out->s = v->s;
        break;
    case 4:
        out->kind = ATTR_B, out->i = v->b;
        break;
    case 5: /* an unknown name is kept (i = -1) for the binder's attribute check to refuse */
        out->kind = ATTR_DTYPE, out->s = v->dtype, out->i = npuc_dtype_from_name(v->dtype);
        break;
    case 6:
        out->kind = ATTR_INTS, out->ints = v->ints, out->n = v->n_ints;
        break;
    case 7:
        out->kind = ATTR_FLOATS, out->floats = v->floats, out->n = v->n_floats;
        break;
    default: /* 8 (`none`) or nothing set */
        break;
    }
}

/* Attrs are collected raw, then finished, so that a value given in two pieces merges. */
typedef struct {
    rt_op op;
    attr_msg *attrs;
} op_msg;

static int pb_op(pb *c, const uint8_t *p, const uint8_t *end, void *out) {
    op_msg *o = out;
    uint64_t x;
    PB_LOOP_BEGIN
    FIELD(1, WT_LEN) {
        TRY(rd_string(c, &p, end, &o->op.op));
        continue;
    }
    FIELD(2, WT_LEN) {
        TRY(rd_string(c, &p, end, &o->op.name));
        continue;
    }
    FIELD_INTS(3) {
        TRY(rd_rep_varints(c, &p, end, wt_, (void **)&o->op.inputs, &o->op.n_inputs, 0));
        continue;
    }
    FIELD_INTS(4) {
        TRY(rd_rep_varints(c, &p, end, wt_, (void **)&o->op.outputs, &o->op.n_outputs, 0));
        continue;
    }
    FIELD(5, WT_LEN) {
        attr_msg *a = push(c, (void **)&o->attrs, &o->op.n_attrs, sizeof *a, &rc_);
        if (a == NULL) return rc_;
        TRY(rd_msg(c, &p, end, pb_attr, a));
        continue;
    }
    FIELD(6, WT_LEN) { /* the tasks section's unit replaces it */
        TRY(rd_string(c, &p, end, NULL));
        continue;
    }
    FIELD(7, WT_VARINT) {
        TRY(rd_varint(&p, end, &x));
        continue;
    }
    FIELD(8, WT_VARINT) {
        TRY(rd_varint(&p, end, &x));
        continue;
    }
    FIELD(9, WT_VARINT) {
        TRY(rd_opt_index(&p, end, &o->op.workspace));
        continue;
    }
    PB_LOOP_END
}

static int pb_buffer(pb *c, const uint8_t *p, const uint8_t *end, void *out) {
    rt_buffer *b = out;
    PB_LOOP_BEGIN
    FIELD(1, WT_VARINT) {
        TRY(rd_i32(&p, end, &b->tensor));
        continue;
    }
    FIELD(2, WT_VARINT) {
        TRY(rd_i32(&p, end, &b->first_step));
        continue;
    }
    FIELD(3, WT_VARINT) {
        TRY(rd_i32(&p, end, &b->last_step));
        continue;
    }
    PB_LOOP_END
}

typedef struct {
    rt_plan plan;
    const char *program;
    int keep_program; /* the plans section's names are compared; modeldef's are dropped */
} plan_msg;

static int pb_plan(pb *c, const uint8_t *p, const uint8_t *end, void *out) {
    plan_msg *m = out;
    PB_LOOP_BEGIN
    FIELD(1, WT_VARINT) {
        TRY(rd_u64(&p, end, &m->plan.alignment));
        continue;
    }
    FIELD(2, WT_VARINT) {
        TRY(rd_u64(&p, end, &m->plan.arena_bytes));
        continue;
    }
    FIELD(3, WT_VARINT) {
        TRY(rd_u64(&p, end, &m->plan.lower_bound_bytes));
        continue;
    }
    FIELD(4, WT_LEN) {
        rt_buffer *b = push(c, (void **)&m->plan.buffers, &m->plan.n_buffers, sizeof *b, &rc_);
        if (b == NULL) return rc_;
        TRY(rd_msg(c, &p, end, pb_buffer, b));
        continue;
    }
    FIELD(5, WT_LEN) {
        TRY(rd_string(c, &p, end, m->keep_program ? &m->program : NULL));
        continue;
    }
    PB_LOOP_END
}

typedef struct {
    rt_program prog;
    op_msg *ops;
    plan_msg plan; /* modeldef's copy: checked, then replaced by the plan section's */
} program_msg;

static int pb_program(pb *c, const uint8_t *p, const uint8_t *end, void *out) {
    program_msg *g = out;
    PB_LOOP_BEGIN
    FIELD(1, WT_LEN) {
        TRY(rd_string(c, &p, end, &g->prog.name));
        continue;
    }
    FIELD_INTS(2) {
        TRY(rd_rep_varints(c, &p, end, wt_, (void **)&g->prog.inputs, &g->prog.n_inputs, 0));
        continue;
    }
    FIELD_INTS(3) {
        TRY(rd_rep_varints(c, &p, end, wt_, (void **)&g->prog.outputs, &g->prog.n_outputs, 0));
        continue;
    }
    FIELD(4, WT_LEN) {
        op_msg *o = push(c, (void **)&g->ops, &g->prog.n_ops, sizeof *o, &rc_);
        if (o == NULL) return rc_;
        o->op.workspace = -1;
        TRY(rd_msg(c, &p, end, pb_op, o));
        continue;
    }
    FIELD(5, WT_LEN) {
        TRY(rd_msg(c, &p, end, pb_plan, &g->plan));
        continue;
    }
    PB_LOOP_END
}

static int pb_tensor(pb *c, const uint8_t *p, const uint8_t *end, void *out) {
    rt_tensor *t = out;
    PB_LOOP_BEGIN
    FIELD(1, WT_LEN) {
        TRY(rd_string(c, &p, end, &t->name));
        continue;
    }
    FIELD(2, WT_LEN) {
        TRY(rd_string(c, &p, end, &t->dtype_name));
        continue;
    }
    FIELD_INTS(3) {
        /* Dims past NPUC_MAX_RANK are counted, not kept: validate refuses such a rank. */
        const uint8_t *s = p, *e = end;
        int one = wt_ == WT_VARINT;
        if (!one && rd_len(&p, end, &s, &e)) return PB_BAD;
        const uint8_t **q = one ? &p : &s;
        while (one || s < e) {
            uint64_t v;
            if (rd_varint(q, e, &v)) return PB_BAD;
            if (t->rank == INT32_MAX) return PB_BAD;
            if (t->rank < NPUC_MAX_RANK) t->shape[t->rank] = (int64_t)v;
            t->rank++;
            if (one) break;
        }
        continue;
    }
    FIELD(4, WT_LEN) {
        TRY(rd_string(c, &p, end, &t->region_name));
        continue;
    }
    FIELD(5, WT_VARINT) {
        TRY(rd_u64(&p, end, &t->offset));
        continue;
    }
    FIELD(6, WT_VARINT) {
        TRY(rd_u64(&p, end, &t->nbytes));
        continue;
    }
    FIELD(7, WT_LEN) {
        TRY(rd_string(c, &p, end, NULL));
        continue;
    }
    FIELD(8, WT_VARINT) {
        TRY(rd_opt_index(&p, end, &t->base));
        continue;
    }
    PB_LOOP_END
}

static int pb_meta_entry(pb *c, const uint8_t *p, const uint8_t *end, void *out) {
    rt_meta *e = out;
    PB_LOOP_BEGIN
    FIELD(1, WT_LEN) {
        TRY(rd_string(c, &p, end, &e->key));
        continue;
    }
    FIELD(2, WT_LEN) {
        TRY(rd_string(c, &p, end, &e->value));
        continue;
    }
    PB_LOOP_END
}

typedef struct {
    npuc_model *m;
    program_msg *progs;
    rt_meta *meta;
    int32_t n_meta;
} modeldef_msg;

static int pb_modeldef(pb *c, const uint8_t *p, const uint8_t *end, void *out) {
    modeldef_msg *d = out;
    npuc_model *m = d->m;
    PB_LOOP_BEGIN
    FIELD(1, WT_LEN) {
        TRY(rd_string(c, &p, end, &m->producer));
        continue;
    }
    FIELD(2, WT_LEN) {
        TRY(rd_string(c, &p, end, &m->producer_version));
        continue;
    }
    FIELD(3, WT_LEN) {
        TRY(rd_string(c, &p, end, &m->target));
        continue;
    }
    FIELD(4, WT_LEN) {
        rt_tensor *t = push(c, (void **)&m->tensors, &m->n_tensors, sizeof *t, &rc_);
        if (t == NULL) return rc_;
        t->base = -1;
        TRY(rd_msg(c, &p, end, pb_tensor, t));
        continue;
    }
    FIELD(5, WT_LEN) {
        program_msg *g = push(c, (void **)&d->progs, &m->n_programs, sizeof *g, &rc_);
        if (g == NULL) return rc_;
        TRY(rd_msg(c, &p, end, pb_program, g));
        continue;
    }
    FIELD(6, WT_VARINT) {
        TRY(rd_u64(&p, end, &m->weights_bytes));
        continue;
    }
    FIELD(7, WT_LEN) {
        rt_meta *e = push(c, (void **)&d->meta, &d->n_meta, sizeof *e, &rc_);
        if (e == NULL) return rc_;
        TRY(rd_msg(c, &p, end, pb_meta_entry, e));
        continue;
    }
    FIELD(8, WT_VARINT) {
        TRY(rd_u64(&p, end, &m->state_bytes));
        continue;
    }
    PB_LOOP_END
}

typedef struct {
    plan_msg *plans;
    int32_t n;
} plans_msg;

static int pb_plans(pb *c, const uint8_t *p, const uint8_t *end, void *out) {
    plans_msg *d = out;
    PB_LOOP_BEGIN
    FIELD(1, WT_LEN) {
        plan_msg *g = push(c, (void **)&d->plans, &d->n, sizeof *g, &rc_);
        if (g == NULL) return rc_;
        g->keep_program = 1;
        TRY(rd_msg(c, &p, end, pb_plan, g));
        continue;
    }
    PB_LOOP_END
}

typedef struct {
    int32_t op;
    const char *unit;
    uint64_t flops, bytes;
} task_msg;

static int pb_task(pb *c, const uint8_t *p, const uint8_t *end, void *out) {
    task_msg *t = out;
    PB_LOOP_BEGIN
    FIELD(1, WT_VARINT) {
        TRY(rd_i32(&p, end, &t->op));
        continue;
    }
    FIELD(2, WT_LEN) {
        TRY(rd_string(c, &p, end, &t->unit));
        continue;
    }
    FIELD(3, WT_VARINT) {
        TRY(rd_u64(&p, end, &t->flops));
        continue;
    }
    FIELD(4, WT_VARINT) {
        TRY(rd_u64(&p, end, &t->bytes));
        continue;
    }
    PB_LOOP_END
}

typedef struct {
    const char *program;
    task_msg *tasks;
    int32_t n;
} program_tasks_msg;

static int pb_program_tasks(pb *c, const uint8_t *p, const uint8_t *end, void *out) {
    program_tasks_msg *g = out;
    PB_LOOP_BEGIN
    FIELD(1, WT_LEN) {
        TRY(rd_string(c, &p, end, &g->program));
        continue;
    }
    FIELD(2, WT_LEN) {
        task_msg *t = push(c, (void **)&g->tasks, &g->n, sizeof *t, &rc_);
        if (t == NULL) return rc_;
        TRY(rd_msg(c, &p, end, pb_task, t));
        continue;
    }
    PB_LOOP_END
}

typedef struct {
    program_tasks_msg *progs;
    int32_t n;
} tasks_msg;

static int pb_tasks(pb *c, const uint8_t *p, const uint8_t *end, void *out) {
    tasks_msg *d = out;
    PB_LOOP_BEGIN
    FIELD(1, WT_LEN) {
        program_tasks_msg *g = push(c, (void **)&d->progs, &d->n, sizeof *g, &rc_);
        if (g == NULL) return rc_;
        TRY(rd_msg(c, &p, end, pb_program_tasks, g));
        continue;
    }
    PB_LOOP_END
}

typedef struct {
    rt_meta *entries;
    int32_t n;
} metadata_msg;

static int pb_metadata(pb *c, const uint8_t *p, const uint8_t *end, void *out) {
    metadata_msg *d = out;
    PB_LOOP_BEGIN
    FIELD(1, WT_LEN) {
        rt_meta *e = push(c, (void **)&d->entries, &d->n, sizeof *e, &rc_);
        if (e == NULL) return rc_;
        TRY(rd_msg(c, &p, end, pb_meta_entry, e));
        continue;
    }
    PB_LOOP_END
}

/* All the dims of tensor `index` (a file may give more than the NPUC_MAX_RANK that rt_tensor
 * keeps): the modeldef section read again, up to that tensor. Only for the first tensor of a
 * larger rank, which the validation refuses in any case, so that it refuses it with the same
 * code and words as the Python side. A malloc'd array of *rank dims, NULL if out of memory. */
int64_t *npuc_om_tensor_dims(const npuc_model *m, int32_t index, int32_t *rank) {
    const rt_section *sec = npuc_om_section(m, "modeldef");
    if (sec == NULL) return NULL;
    const uint8_t *p = m->data + sec->offset, *end = p + sec->size;
    pb c = {NULL, PB_MAX_DEPTH};
    int32_t seen = 0;
    while (p < end) {
        uint32_t f;
        int wt;
        if (rd_tag(&p, end, &f, &wt)) return NULL;
        if (!(f == 4 && wt == WT_LEN)) {
            if (skip_field(&c, &p, end, f, wt)) return NULL;
            continue;
        }
        const uint8_t *s, *e;
        if (rd_len(&p, end, &s, &e)) return NULL;
        if (seen++ != index) continue;
        size_t n = 0, cap = 16;
        int64_t *dims = malloc(cap * sizeof *dims);
        while (dims != NULL && s < e) {
            if (rd_tag(&s, e, &f, &wt)) break;
            if (f == 3 && (wt == WT_VARINT || wt == WT_LEN)) {
                const uint8_t *q = s, *qe = e;
                if (wt == WT_LEN && rd_len(&s, e, &q, &qe)) break;
                const uint8_t **at = wt == WT_LEN ? &q : &s;
                do {
                    uint64_t v;
                    if (rd_varint(at, qe, &v)) break;
                    if (n == cap) {
                        int64_t *more = realloc(dims, (cap *= 2) * sizeof *dims);
                        if (more == NULL) {
                            free(dims);
                            return NULL;
                        }
                        dims = more;
                    }
                    dims[n++] = (int64_t)v;
                } while (wt == WT_LEN && q < qe);
            } else if (skip_field(&c, &s, e, f, wt)) {
                break;
            }
        }
        if (dims != NULL) *rank = (int32_t)n;
        return dims;
    }
    return NULL;
}

/* ---- the container ------------------------------------------------------------------------- */

#if defined(__GNUC__)
__attribute__((format(printf, 2, 3)))
#endif
static int corrupt(npuc_error *err, const char *fmt, ...) {
    char what[700];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    return rt_fail(err, NPUC_E_BOUNDS, HINT_CONTAINER, "file is truncated or corrupt: %s", what);
}

static int checksum(npuc_error *err, const char *what) {
    return rt_fail(err, NPUC_E_PARSE, HINT_CONTAINER, "%s fails its checksum: the file is corrupt", what);
}

static int bad_magic(const npuc_model *m, npuc_error *err) {
    return rt_fail(err, NPUC_E_MAGIC, "pass a model compiled with `npuc compile`",
                   "'%s' is not an npuc .om file (bad magic bytes)", m->path);
}

static int valid_name(const uint8_t *s, size_t n) {
    if (n == 0 || n > 16) return 0;
    for (size_t i = 0; i < n; i++) {
        uint8_t ch = s[i];
        if (!((ch >= 'A' && ch <= 'Z') || (ch >= 'a' && ch <= 'z') || (ch >= '0' && ch <= '9') || ch == '_' ||
              ch == '.' || ch == '-'))
            return 0;
    }
    return 1;
}

const rt_section *npuc_om_section(const npuc_model *m, const char *name) {
    if (m == NULL || name == NULL) return NULL;
    for (int32_t i = 0; i < m->n_sections; i++)
        if (strcmp(m->sections[i].name, name) == 0) return &m->sections[i];
    return NULL;
}

static int no_section(const npuc_model *m, const char *name, npuc_error *err) {
    char have[RT_MAX_SECTIONS * 18 + 8];
    size_t n = 0;
    have[0] = '\0';
    for (int32_t i = 0; i < m->n_sections && n < sizeof have; i++)
        n += (size_t)snprintf(have + n, sizeof have - n, "%s%s", i ? ", " : "", m->sections[i].name);
    return rt_fail(err, NPUC_E_BOUNDS, HINT_CONTAINER, "file is truncated or corrupt: it has no section '%s' "
                   "(sections: %s)", name, m->n_sections ? have : "none");
}

/* backend/om_format.py `_check_chunk_table`: the chunk digests and the weights come together,
 * one digest per chunk of a size in CHUNK_MIN..CHUNK_MAX (a power of two), and the weights
 * entry's digest is the XXH3-128 of that list followed by 16 zero bytes. */
static int check_chunk_table(const npuc_model *m, const rt_section *w, const rt_section *t, uint64_t *chunk,
                             npuc_error *err) {
    if (t == NULL) return corrupt(err, "section 'weights' has no chunk digests (no section '" WEIGHTS_DIGESTS "')");
    if (w == NULL) return corrupt(err, "section '" WEIGHTS_DIGESTS "' is there without a 'weights' section");
    if (t->size < CHUNKS_HEAD)
        return corrupt(err, "section '" WEIGHTS_DIGESTS "' has %llu bytes, less than its %u-byte head",
                       (unsigned long long)t->size, CHUNKS_HEAD);
    const uint8_t *p = m->data + t->offset;
    uint64_t size = rd64(p), count = rd64(p + 8);
    if (size < CHUNK_MIN || size > CHUNK_MAX || (size & (size - 1)))
        return corrupt(err, "section '" WEIGHTS_DIGESTS "' has chunk size %llu, not a power of two in %u..%llu",
                       (unsigned long long)size, CHUNK_MIN, (unsigned long long)CHUNK_MAX);
    uint64_t want = w->size / size + (w->size % size != 0); /* size >= 4096: no overflow below */
    if (count != want || t->size != CHUNKS_HEAD + 16u * want)
        return corrupt(err, "section '" WEIGHTS_DIGESTS "' lists %llu chunks in %llu bytes; %llu bytes of weights "
                       "in chunks of %llu need %llu in %llu bytes", (unsigned long long)count,
                       (unsigned long long)t->size, (unsigned long long)w->size, (unsigned long long)size,
                       (unsigned long long)want, (unsigned long long)(CHUNKS_HEAD + 16u * want));
#ifndef NPUC_FUZZ_NO_CHECKSUMS
    uint8_t digest[32] = {0};
    npuc_xxh3_128(p, (size_t)t->size, digest);
    if (memcmp(digest, w->sha256, 32) != 0) return checksum(err, "the chunk digests of section 'weights'");
#endif
    *chunk = size;
    return NPUC_OK;
}

#ifndef NPUC_FUZZ_NO_CHECKSUMS
/* Bytes of weights asked for ahead of the hashing (POSIX_MADV_WILLNEED): enough outstanding reads
 * to keep a disk busy, little enough not to evict what a model larger than memory needs. */
#define READ_AHEAD (128ull << 20)

/* The chunks [from, to) of the weights asked for now (a mapped file only: a caller's buffer is
 * in memory already). The start is page-aligned where pages are 4096 bytes (the weights' and
 * the chunks' alignment); elsewhere the advice is refused, and it is only advice. */
static void want_chunks(const npuc_model *m, const uint8_t *base, uint64_t size, uint64_t chunk, uint64_t from,
                        uint64_t to) {
    if (m->mapping == NULL || from * chunk >= size) return;
    uint64_t end = to * chunk < size ? to * chunk : size;
    (void)posix_madvise((void *)(uintptr_t)(base + from * chunk), (size_t)(end - from * chunk),
                        POSIX_MADV_WILLNEED);
}

/* Every weights chunk against its XXH3-128, read through the mapping the run then uses: the
 * pages read here are the ones the first run would have faulted in, so a cold load reads the
 * file once either way; the reads are asked for READ_AHEAD ahead of the hashing, so the disk
 * works while xxh3 (tens of GB/s) hashes, instead of one page fault's readahead at a time. */
static int verify_weights(const npuc_model *m, const rt_section *w, const rt_section *t, uint64_t chunk,
                          npuc_error *err) {
    const uint8_t *base = m->data + w->offset, *want = m->data + t->offset + CHUNKS_HEAD;
    uint64_t n_chunks = (t->size - CHUNKS_HEAD) / 16u, ahead = READ_AHEAD / chunk ? READ_AHEAD / chunk : 1;
    want_chunks(m, base, w->size, chunk, 0, ahead);
    for (uint64_t k = 0; k < n_chunks; k++) {
        want_chunks(m, base, w->size, chunk, k + ahead, k + ahead + 1);
        uint64_t start = k * chunk, n = w->size - start < chunk ? w->size - start : chunk;
        uint8_t digest[16];
        npuc_xxh3_128(base + start, (size_t)n, digest);
        if (memcmp(digest, want + 16u * k, 16) != 0) {
            char what[128];
            snprintf(what, sizeof what, "section 'weights' (chunk %llu, bytes %llu..%llu)", (unsigned long long)k,
                     (unsigned long long)start, (unsigned long long)(start + n));
            return checksum(err, what);
        }
    }
    return NPUC_OK;
}
#endif

/* backend/om_format.py `_parse`, check for check. */
static int parse_container(npuc_model *m, int verify, npuc_error *err) {
    const uint8_t *d = m->data;
    size_t size = m->size;
    if (size < HEADER_SIZE) {
        /* A short prefix of the magic is a truncated .om file, not a foreign one. */
        if (size && memcmp(d, MAGIC, size < 8 ? size : 8) != 0) return bad_magic(m, err);
        return corrupt(err, "it has %zu bytes, less than the 64-byte header", size);
    }
    if (memcmp(d, MAGIC, 8) != 0) return bad_magic(m, err);
    uint32_t version = rd32(d + 8), flags = rd32(d + 12), count = rd32(d + 16), reserved = rd32(d + 20);
    /* Version 1 (SHA-256 over every weight byte) is not read: a recompile writes version 2. */
    if (version != OM_VERSION)
        return rt_fail(err, NPUC_E_VERSION, "recompile the model with `npuc compile` from this npuc release",
                       "'%s' has .om format version %u; this npuc reads version %u", m->path, version,
                       (unsigned)OM_VERSION);
    if (flags != 0)
        return rt_fail(err, NPUC_E_VERSION, "recompile the model with `npuc compile` from this npuc release",
                       "'%s' uses .om format flags %#x, which this npuc does not support", m->path, flags);
    int pad_zero = 1;
    for (int i = 56; i < 64; i++) pad_zero &= d[i] == 0;
    if (reserved != 0 || !pad_zero) return corrupt(err, "reserved header fields are not zero");
    uint64_t table_end = HEADER_SIZE + (uint64_t)ENTRY_SIZE * count;
    if (table_end > size)
        return corrupt(err, "the section table spans bytes 64..%llu but the file has %zu bytes",
                       (unsigned long long)table_end, size);
#ifndef NPUC_FUZZ_NO_CHECKSUMS
    uint8_t digest[32];
    npuc_sha256(d + HEADER_SIZE, (size_t)(table_end - HEADER_SIZE), digest);
    if (memcmp(digest, d + 24, 32) != 0) return checksum(err, "the section table");
#endif
    uint64_t prev_end = table_end;
    for (uint32_t i = 0; i < count; i++) {
        const uint8_t *e = d + HEADER_SIZE + (size_t)ENTRY_SIZE * i;
        size_t nlen = 16;
        while (nlen > 0 && e[nlen - 1] == 0) nlen--;
        if (!valid_name(e, nlen)) {
            char r[80];
            return corrupt(err, "section %u has an invalid name %s", i, rt_repr_bytes(r, sizeof r, e, nlen));
        }
        char name[17];
        memcpy(name, e, nlen);
        name[nlen] = '\0';
        for (int32_t j = 0; j < m->n_sections; j++)
            if (strcmp(m->sections[j].name, name) == 0) return corrupt(err, "section '%s' appears twice", name);
        uint64_t offset = rd64(e + 16), length = rd64(e + 24);
        rt_u128 end = (rt_u128)offset + length; /* Python ints: the sum never wraps */
        if (end > size) {
            char big[48];
            return corrupt(err, "section '%s' spans bytes %llu..%s but the file has %zu bytes", name,
                           (unsigned long long)offset, rt_u128_str(big, end), size);
        }
        if (offset < prev_end)
            return corrupt(err, "section '%s' starts at byte %llu, before the end of the previous data at %llu", name,
                           (unsigned long long)offset, (unsigned long long)prev_end);
        uint64_t align = strcmp(name, "weights") == 0 ? 4096u : 64u;
        if (offset % align)
            return corrupt(err, "section '%s' starts at byte %llu, not a multiple of %llu", name,
                           (unsigned long long)offset, (unsigned long long)align);
        /* Padding is not covered by any hash; it must be zero so that no byte goes unchecked. */
        for (uint64_t k = prev_end; k < offset; k++) {
            if (d[k] != 0) {
                char what[64];
                snprintf(what, sizeof what, "the padding before section '%s'", name);
                return checksum(err, what);
            }
        }
        /* The model holds RT_MAX_SECTIONS entries (a writer makes seven at most): a file of more is
         * refused here, once all before it have passed the checks Python makes of them. */
        if (m->n_sections == RT_MAX_SECTIONS)
            return corrupt(err, "it has %u sections; this runtime reads at most %d", count, RT_MAX_SECTIONS);
        rt_section *s = &m->sections[m->n_sections++];
        memcpy(s->name, name, sizeof name);
        s->offset = offset;
        s->size = length;
        memcpy(s->sha256, e + 32, 32);
        prev_end = (uint64_t)end;
    }
    if (prev_end != size) return corrupt(err, "%llu unexpected bytes after the last section",
                                         (unsigned long long)(size - prev_end));
    /* Every section but the weights: its SHA-256, always (the model definition, the chunk
     * digests, a tokenizer: small). */
#ifndef NPUC_FUZZ_NO_CHECKSUMS
    for (int32_t i = 0; i < m->n_sections; i++) {
        const rt_section *s = &m->sections[i];
        if (strcmp(s->name, "weights") == 0) continue;
        npuc_sha256(d + s->offset, (size_t)s->size, digest);
        if (memcmp(digest, s->sha256, 32) != 0) {
            char what[64];
            snprintf(what, sizeof what, "section '%s'", s->name);
            return checksum(err, what);
        }
    }
#endif
    const rt_section *w = npuc_om_section(m, "weights"), *t = npuc_om_section(m, WEIGHTS_DIGESTS);
    if (w == NULL && t == NULL) return NPUC_OK;
    uint64_t chunk = 0;
    int rc = check_chunk_table(m, w, t, &chunk, err);
    if (rc) return rc;
#ifndef NPUC_FUZZ_NO_CHECKSUMS
    if (verify) return verify_weights(m, w, t, chunk, err);
#else
    (void)verify; /* the fuzz build only: a fuzzer cannot forge the checksums, so none is checked */
#endif
    return NPUC_OK;
}

/* ---- join_model ---------------------------------------------------------------------------- */

static int damaged(const npuc_model *m, npuc_error *err, const char *what) {
    return rt_fail(err, NPUC_E_PARSE, HINT_DAMAGED, "%s: %s", m->path, what);
}

static int no_memory(npuc_error *err) {
    return rt_fail(err, NPUC_E_ARG, NULL, "out of memory while reading the model definition");
}

static int parse_section(npuc_model *m, const char *name, msg_fn fn, void *out, npuc_error *err) {
    const rt_section *s = npuc_om_section(m, name);
    pb c = {&m->pool, PB_MAX_DEPTH};
    int rc = fn(&c, m->data + s->offset, m->data + s->offset + s->size, out);
    if (rc == PB_NOMEM) return no_memory(err);
    if (rc) {
        char what[64];
        snprintf(what, sizeof what, "the %s section does not parse", name);
        return damaged(m, err, what);
    }
    return NPUC_OK;
}

static const char *str_or_empty(const char *s) { return s != NULL ? s : EMPTY; }

int npuc_om_parse(npuc_model *m, int verify_checksums, npuc_error *err) {
    m->n_sections = 0;
    int rc = parse_container(m, verify_checksums, err);
    if (rc) return rc;
    /* A tensor-parallel compile's manifest (backend/manifest.py) names one file per rank, for
     * `torchrun`; the Python side refuses it in a process of one rank too (NPUC-E0150). */
    if (npuc_om_section(m, "manifest") != NULL)
        return rt_fail(err, 150, "load one of its rank files with the Python runtime (`torchrun ... -m npuc`), or "
                       "compile without --tp for this library", "%s is the manifest of a tensor-parallel model; this "
                       "library loads single-device models", m->path);
    static const char *const MODEL_SECTIONS[] = {"modeldef", "plan", "tasks", "metadata"};
    for (int i = 0; i < 4; i++)
        if (npuc_om_section(m, MODEL_SECTIONS[i]) == NULL) return no_section(m, MODEL_SECTIONS[i], err);

    modeldef_msg def = {m, NULL, NULL, 0};
    plans_msg plans = {NULL, 0};
    tasks_msg tasks = {NULL, 0};
    metadata_msg meta = {NULL, 0};
    if ((rc = parse_section(m, "modeldef", pb_modeldef, &def, err)) ||
        (rc = parse_section(m, "plan", pb_plans, &plans, err)) ||
        (rc = parse_section(m, "tasks", pb_tasks, &tasks, err)) ||
        (rc = parse_section(m, "metadata", pb_metadata, &meta, err)))
        return rc;

    /* Unset strings read as "", as in Python. */
    m->producer = str_or_empty(m->producer);
    m->producer_version = str_or_empty(m->producer_version);
    m->target = str_or_empty(m->target);
    for (int32_t i = 0; i < m->n_tensors; i++) {
        rt_tensor *t = &m->tensors[i];
        t->name = str_or_empty(t->name);
        t->dtype_name = str_or_empty(t->dtype_name);
        t->region_name = str_or_empty(t->region_name);
        t->dtype = npuc_dtype_from_name(t->dtype_name);
        t->region = strcmp(t->region_name, "arena") == 0     ? REGION_ARENA
                    : strcmp(t->region_name, "weights") == 0 ? REGION_WEIGHTS
                    : strcmp(t->region_name, "state") == 0   ? REGION_STATE
                                                              : -1;
    }

    /* join_model's cross-checks: one plan and one task list per program, in order, one task per op. */
    int32_t np = m->n_programs;
    int same = plans.n == np && tasks.n == np;
    for (int32_t i = 0; same && i < np; i++) {
        const char *name = str_or_empty(def.progs[i].prog.name);
        same = strcmp(str_or_empty(plans.plans[i].program), name) == 0 &&
               strcmp(str_or_empty(tasks.progs[i].program), name) == 0;
    }
    if (!same) return damaged(m, err, "the plan and tasks sections do not list the model's programs");
    if (np) {
        m->programs = pool_alloc(&m->pool, (size_t)np * sizeof *m->programs);
        if (m->programs == NULL) return no_memory(err);
    }
    for (int32_t i = 0; i < np; i++) {
        program_msg *g = &def.progs[i];
        rt_program *prog = &m->programs[i];
        *prog = g->prog;
        prog->name = str_or_empty(prog->name);
        const program_tasks_msg *pt = &tasks.progs[i];
        int match = pt->n == prog->n_ops;
        for (int32_t j = 0; match && j < pt->n; j++) match = pt->tasks[j].op == j;
        if (!match) {
            char r[600], what[700];
            rt_repr(r, sizeof r, prog->name, -1);
            snprintf(what, sizeof what, "the tasks of program %s do not match its ops", r);
            return damaged(m, err, what);
        }
        prog->plan = plans.plans[i].plan;
        prog->ops = NULL;
        if (prog->n_ops) {
            prog->ops = pool_alloc(&m->pool, (size_t)prog->n_ops * sizeof *prog->ops);
            if (prog->ops == NULL) return no_memory(err);
        }
        for (int32_t j = 0; j < prog->n_ops; j++) {
            op_msg *o = &g->ops[j];
            rt_op *op = &prog->ops[j];
            *op = o->op;
            op->op = str_or_empty(op->op);
            op->name = str_or_empty(op->name);
            op->attrs = NULL;
            if (op->n_attrs) {
                op->attrs = pool_alloc(&m->pool, (size_t)op->n_attrs * sizeof *op->attrs);
                if (op->attrs == NULL) return no_memory(err);
            }
            for (int32_t k = 0; k < op->n_attrs; k++) attr_finish(&o->attrs[k], &op->attrs[k]);
            op->unit = str_or_empty(pt->tasks[j].unit);
            op->flops = pt->tasks[j].flops;
            op->bytes = pt->tasks[j].bytes;
        }
    }
    /* The model's own entries first, then the metadata section's (model.metadata.extend). */
    int32_t nm = def.n_meta + meta.n;
    if (nm < def.n_meta) return damaged(m, err, "the metadata section does not parse");
    if (nm) {
        m->meta = pool_alloc(&m->pool, (size_t)nm * sizeof *m->meta);
        if (m->meta == NULL) return no_memory(err);
        if (def.n_meta) memcpy(m->meta, def.meta, (size_t)def.n_meta * sizeof *m->meta);
        if (meta.n) memcpy(m->meta + def.n_meta, meta.entries, (size_t)meta.n * sizeof *m->meta);
    }
    m->n_meta = nm;
    for (int32_t i = 0; i < nm; i++) {
        m->meta[i].key = str_or_empty(m->meta[i].key);
        m->meta[i].value = str_or_empty(m->meta[i].value);
    }

    /* The Python session takes the weights section next (om.section("weights")): a file without
     * one is refused there, before validation. */
    const rt_section *w = npuc_om_section(m, "weights");
    if (w == NULL) return no_section(m, "weights", err);
    m->weights = m->data + w->offset;
    m->weights_len = w->size;
    return NPUC_OK;
}
