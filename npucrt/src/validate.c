/* The model-definition check: runtime/om_validate.py's `validate_model`, in the same order and
 * with the same codes and messages, so that a file the Python runtime refuses is refused here
 * with the same NPUC-E code (and, but for the cases noted below, the same words).
 *
 *   structure   a program exists; every index names a tensor                       E0404/E0405
 *   tensors     known dtype and region; rank at most NPUC_MAX_RANK; dims 0..2^40; nbytes
 *               the product of dims times the item size (no overflow); offset aligned
 *               and inside its region; a base that holds the tensor               E0404/E0405/E0410
 *   memory      state bytes = the end of the last state tensor; arena + state under
 *               the cap                                                           E0410
 *   per program name; writes (nothing written in the weights, inputs in the arena,
 *               names unique); indices stored in the weights within their table;
 *               the memory plan re-validated (backend/memory_plan.validate_plan)
 *               and every arena tensor live where it is used                      E0405/E0409/E0410
 *   metadata    the values the runtime parses; a generating model's programs,
 *               cache and prefill fit each other; the tokenizer section is a JSON
 *               object of plain file names to base64                             E0410/E0411
 *
 * Per op, first, the registry's schema (op_schema.c, generated from ir/registry.py by
 * npucrt/gen_op_schema.py): a known op (E0408), its attributes (parse, none repeated, each known
 * and of its kind, the required ones present) and its arity (E0410), as check_ops orders them.
 *
 * Not here: the rest of the per-op registry checks (output types from the op's shape rule,
 * workspace size). The executor's binders do those for the ops they run (exec.c). Python's
 * messages that name the needed workspace size cannot be matched here: a workspace outside the
 * arena is refused with the same code, other words.
 *
 * Every loop is linear or n log n in the model definition, never in the weights (but for the
 * few index tensors of at most 1 MiB that check_indices reads).
 */
#define _POSIX_C_SOURCE 200809L /* sysconf */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "model.h"
#include "op_schema.h"
#include "util.h"

#define MAX_DIM ((int64_t)1 << 40) /* an empty tensor's other dims are bounded too */
#define SMALL_INDEX ((uint64_t)1 << 20)
#define REPR 768

static const char *const REGION_NAMES[] = {"arena", "weights", "state"};

#if defined(__GNUC__)
__attribute__((format(printf, 3, 4)))
#endif
static int bad(npuc_error *err, int code, const char *fmt, ...) {
    if (err == NULL) return code;
    char msg[sizeof err->message];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return rt_fail(err, code, HINT_DAMAGED, "%s", msg);
}

static int no_memory(npuc_error *err) { return rt_fail(err, NPUC_E_ARG, NULL, "out of memory while validating"); }

/* A stored index (base, workspace): -1 in messages where the file said -1 (util.h). */
static long long shown_index(int32_t v) { return v == RT_PRESENT_MINUS_ONE ? -1 : (long long)v; }

static char *repr(char *buf, const char *s) { return rt_repr(buf, REPR, s, -1); }

/* Python's str(list(shape)): "[1, 2, 3]". */
static char *shape_str(char *buf, size_t size, const int64_t *dims, int32_t n) {
    size_t k = 0;
    buf[0] = '\0';
    k += (size_t)snprintf(buf, size, "[");
    for (int32_t i = 0; i < n && k < size; i++)
        k += (size_t)snprintf(buf + k, size - k, "%s%lld", i ? ", " : "", (long long)dims[i]);
    if (k < size) snprintf(buf + k, size - k, "]");
    return buf;
}

static char *tensor_shape(char *buf, size_t size, const rt_tensor *t) {
    return shape_str(buf, size, t->shape, t->rank < NPUC_MAX_RANK ? t->rank : NPUC_MAX_RANK);
}

/* Python's str([names...]) of some tensors' names. */
static char *names_str(char *buf, size_t size, const npuc_model *m, const int32_t *ids, int32_t n) {
    size_t k = (size_t)snprintf(buf, size, "[");
    char r[REPR];
    for (int32_t i = 0; i < n && k < size; i++)
        k += (size_t)snprintf(buf + k, size - k, "%s%s", i ? ", " : "", repr(r, m->tensors[ids[i]].name));
    if (k < size) snprintf(buf + k, size - k, "]");
    return buf;
}

static int is_region(const rt_tensor *t, int region) { return t->region == region; }

/* The value of a metadata key as the Python side's {key: value} dict has it: the last entry. */
static const char *meta_get(const npuc_model *m, const char *key) {
    for (int32_t i = m->n_meta; i-- > 0;)
        if (strcmp(m->meta[i].key, key) == 0) return m->meta[i].value;
    return NULL;
}

/* om_validate._ints: comma-separated ASCII decimals of 1..18 digits ("" is the empty list).
 * Returns the count, or -1 when it does not parse; *first gets the first value. */
static long ints_parse(const char *s, int64_t *first) {
    if (*s == '\0') return 0;
    long count = 0;
    for (;;) {
        int digits = 0;
        int64_t v = 0;
        while (s[digits] >= '0' && s[digits] <= '9') {
            if (digits == 18) return -1;
            v = v * 10 + (s[digits] - '0');
            digits++;
        }
        if (digits == 0) return -1;
        if (count == 0 && first != NULL) *first = v;
        count++;
        s += digits;
        if (*s == '\0') return count;
        if (*s != ',') return -1;
        s++;
    }
}

/* om_validate.position_rows: the KV cache's rows, and no more than the first max_seq_len entry. */
static int64_t position_rows(const npuc_model *m) {
    int64_t rows = 0;
    int any = 0;
    for (int32_t i = 0; i < m->n_tensors; i++) {
        const rt_tensor *t = &m->tensors[i];
        /* the KV and conv caches' rows; a recurrent state (passes/recurrent_state.py) has none per position */
        int recurrent = strncmp(t->name, "ssm_state.", 10) == 0 || strncmp(t->name, "delta_state.", 12) == 0 ||
                        strncmp(t->name, "linear_state.", 13) == 0 || strncmp(t->name, "conv_window.", 12) == 0;
        if (is_region(t, REGION_STATE) && t->rank == 4 && !recurrent && !t->pool && (!any || t->shape[2] < rows))
            rows = t->shape[2], any = 1;
    }
    const char *v = NULL;
    for (int32_t i = 0; i < m->n_meta && v == NULL; i++)
        if (strcmp(m->meta[i].key, "max_seq_len") == 0) v = m->meta[i].value;
    int64_t n = 0;
    if (rows && v != NULL && ints_parse(v, &n) == 1 && n > 0 && n < rows) return n;
    return rows;
}

/* ---- structure and tensors ----------------------------------------------------------------- */

static int check_structure(const npuc_model *m, npuc_error *err) {
    if (m->n_programs == 0) return bad(err, NPUC_E_PARSE, "%s: the model definition has no program", m->path);
    int32_t n = m->n_tensors;
    char r[REPR];
    for (int32_t p = 0; p < m->n_programs; p++) {
        const rt_program *g = &m->programs[p];
        long long wrong = 0;
        int found = 0;
#define REF(v, shown)                                                                                              \
    if (!found && ((v) < 0 || (v) >= n)) found = 1, wrong = (shown);
        for (int32_t i = 0; i < g->n_inputs; i++) REF(g->inputs[i], g->inputs[i]);
        for (int32_t i = 0; i < g->n_outputs; i++) REF(g->outputs[i], g->outputs[i]);
        for (int32_t i = 0; i < g->plan.n_buffers; i++) REF(g->plan.buffers[i].tensor, g->plan.buffers[i].tensor);
        for (int32_t k = 0; k < g->n_ops && !found; k++) {
            const rt_op *op = &g->ops[k];
            for (int32_t i = 0; i < op->n_inputs; i++) REF(op->inputs[i], op->inputs[i]);
            for (int32_t i = 0; i < op->n_outputs; i++) REF(op->outputs[i], op->outputs[i]);
            if (op->workspace != -1) REF(op->workspace, shown_index(op->workspace));
        }
#undef REF
        if (found)
            return bad(err, NPUC_E_BOUNDS, "%s: program %s refers to tensor %lld, but there are %d", m->path,
                       repr(r, g->name), wrong, n);
    }
    return NPUC_OK;
}

static int check_tensors(const npuc_model *m, uint64_t arena_bytes, npuc_error *err) {
    if (m->weights_bytes != m->weights_len)
        return bad(err, NPUC_E_BOUNDS, "%s: the model definition says %llu weight bytes, the 'weights' section holds "
                   "%llu", m->path, (unsigned long long)m->weights_bytes, (unsigned long long)m->weights_len);
    const uint64_t limits[3] = {arena_bytes, m->weights_len, m->state_bytes};
    char r[REPR], r2[REPR], s[REPR], a[48];
    for (int32_t i = 0; i < m->n_tensors; i++) {
        const rt_tensor *t = &m->tensors[i];
        if (t->dtype < 0)
            return bad(err, NPUC_E_PARSE, "%s: tensor %s has unknown dtype %s", m->path, repr(r, t->name),
                       repr(r2, t->dtype_name));
        if (t->region < 0)
            return bad(err, NPUC_E_PARSE, "%s: tensor %s is in unknown region %s", m->path, repr(r, t->name),
                       repr(r2, t->region_name));
        /* A rank past NPUC_MAX_RANK is refused, after the checks Python makes of every dim (so
         * that a file both sides refuse is refused alike): those read all the dims again. */
        const int64_t *dims = t->shape;
        int32_t rank = t->rank;
        int64_t *all = NULL;
        if (t->rank > NPUC_MAX_RANK) {
            all = npuc_om_tensor_dims(m, i, &rank);
            if (all == NULL) return no_memory(err);
            dims = all;
        }
        int ok = 1, zero = 0;
        for (int32_t k = 0; k < rank; k++) ok &= dims[k] >= 0 && dims[k] <= MAX_DIM, zero |= !dims[k];
        uint64_t item = (uint64_t)npuc_dtype_size(t->dtype);
        /* Python multiplies without overflow: a product past 64 bits cannot equal nbytes. */
        int same;
        if (zero) {
            same = t->nbytes == 0;
        } else {
            rt_u128 prod = item;
            for (int32_t k = 0; k < rank && prod <= UINT64_MAX; k++) prod *= (uint64_t)dims[k];
            same = prod == t->nbytes;
        }
        if (!ok || !same) {
            /* The message lists every dim (Python's str(list(shape))); cut where it is cut anyway. */
            shape_str(s, sizeof s, dims, rank);
            free(all);
            if (!ok)
                return bad(err, NPUC_E_INVALID, "%s: tensor %s has shape %s: dims must not be negative (nor above "
                           "%lld)", m->path, repr(r, t->name), s, (long long)MAX_DIM);
            return bad(err, NPUC_E_BOUNDS, "%s: tensor %s is %s%s but says it has %llu bytes", m->path,
                       repr(r, t->name), t->dtype_name, s, (unsigned long long)t->nbytes);
        }
        free(all);
        uint64_t limit = limits[t->region];
        rt_u128 end = (rt_u128)t->offset + t->nbytes;
        if (t->offset % item || end > limit)
            return bad(err, NPUC_E_BOUNDS, "%s: tensor %s (bytes %llu..%s) lies outside its %s region of %llu bytes",
                       m->path, repr(r, t->name), (unsigned long long)t->offset, rt_u128_str(a, end),
                       REGION_NAMES[t->region], (unsigned long long)limit);
        if (t->base != -1) {
            const rt_tensor *b = t->base >= 0 && t->base < m->n_tensors ? &m->tensors[t->base] : NULL;
            if (b == NULL || b->base != -1 || strcmp(b->region_name, t->region_name) != 0 || b->offset != t->offset ||
                t->nbytes > b->nbytes)
                return bad(err, NPUC_E_BOUNDS, "%s: tensor %s says it shares tensor %lld's buffer, which does not hold "
                           "it", m->path, repr(r, t->name), shown_index(t->base));
        }
        if (t->rank > NPUC_MAX_RANK)
            return bad(err, NPUC_E_INVALID, "%s: tensor %s has rank %d; this runtime takes at most %d", m->path,
                       repr(r, t->name), t->rank, NPUC_MAX_RANK);
    }
    return NPUC_OK;
}

/* ---- per program --------------------------------------------------------------------------- */

static int cmp_str_ptr(const void *a, const void *b) {
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* Whether two of these tensors share a name (sorted copy: n log n for a hostile count). */
static int names_repeat(const npuc_model *m, const int32_t *ids, int32_t n, const char **scratch) {
    for (int32_t i = 0; i < n; i++) scratch[i] = m->tensors[ids[i]].name;
    qsort(scratch, (size_t)n, sizeof *scratch, cmp_str_ptr);
    for (int32_t i = 1; i < n; i++)
        if (strcmp(scratch[i - 1], scratch[i]) == 0) return 1;
    return 0;
}

typedef struct {
    const char **names; /* program inputs/outputs, program names, an op's attribute names */
    int32_t *buffer_of; /* per tensor: its buffer in the current plan, -1 */
    int32_t *order;     /* per buffer: sweep order */
    int32_t *heap;      /* the active buffers, as Python's heapq holds them */
    int32_t *rank_of;   /* per buffer: its place in offset order */
    int32_t *by_offset; /* buffers in offset order */
    int32_t *fenwick;   /* active buffers, by offset order */
    struct event {
        int64_t time;
        rt_i128 delta;
    } *events;
} scratch;

/* ---- per op: the registry's schema (om_validate.op_def, op_attrs, the arity check) ---------- */

/* Text appended to a fixed buffer, cut at its size (a message is cut at 767 bytes anyway). */
typedef struct {
    char *p;
    size_t size, len;
} text_out;

static void put(text_out *o, const char *s) {
    for (; *s && o->len + 1 < o->size; s++) o->p[o->len++] = *s;
    if (o->size) o->p[o->len < o->size ? o->len : o->size - 1] = '\0';
}

/* Python's repr() of a float: the fewest digits that read back as `v`, in fixed notation for
 * decimal exponents -4..15 (with a ".0" when integral), else as 1.5e-05 or 1e+16. */
static void put_float(text_out *o, double v) {
    if (isnan(v)) {
        put(o, "nan");
        return;
    }
    if (isinf(v)) {
        put(o, v < 0 ? "-inf" : "inf");
        return;
    }
    char e[48];
    for (int prec = 0; prec <= 16; prec++) {
        snprintf(e, sizeof e, "%.*e", prec, v);
        if (strtod(e, NULL) == v) break;
    }
    char digits[24], buf[64];
    size_t nd = 0;
    const char *c = e;
    if (*c == '-') put(o, "-"), c++;
    for (; *c && *c != 'e'; c++)
        if (*c != '.' && nd + 1 < sizeof digits) digits[nd++] = *c;
    while (nd > 1 && digits[nd - 1] == '0') nd--;
    digits[nd] = '\0';
    long exp10 = *c == 'e' ? strtol(c + 1, NULL, 10) : 0;
    size_t k = 0;
    if (exp10 < -4 || exp10 >= 16) {
        buf[k++] = digits[0];
        if (nd > 1) {
            buf[k++] = '.';
            for (size_t i = 1; i < nd; i++) buf[k++] = digits[i];
        }
        snprintf(buf + k, sizeof buf - k, "e%c%02ld", exp10 < 0 ? '-' : '+', exp10 < 0 ? -exp10 : exp10);
    } else if (exp10 >= 0) {
        size_t whole = (size_t)exp10 + 1;
        for (size_t i = 0; i < whole; i++) buf[k++] = i < nd ? digits[i] : '0';
        buf[k++] = '.';
        if (nd > whole)
            for (size_t i = whole; i < nd; i++) buf[k++] = digits[i];
        else
            buf[k++] = '0';
        buf[k] = '\0';
    } else {
        buf[k++] = '0', buf[k++] = '.';
        for (long i = 0; i < -exp10 - 1; i++) buf[k++] = '0';
        for (size_t i = 0; i < nd; i++) buf[k++] = digits[i];
        buf[k] = '\0';
    }
    put(o, buf);
}

/* repr() of the value runtime/om_validate.attr_value makes of a stored attribute. */
static char *attr_repr(char *buf, size_t size, const rt_attr *a) {
    text_out o = {buf, size, 0};
    char t[REPR];
    if (size) buf[0] = '\0';
    switch (a->kind) {
    case ATTR_I:
        snprintf(t, sizeof t, "%lld", (long long)a->i);
        put(&o, t);
        break;
    case ATTR_F:
        put_float(&o, a->f);
        break;
    case ATTR_S:
        put(&o, rt_repr(t, sizeof t, a->s, -1));
        break;
    case ATTR_B:
        put(&o, a->i ? "True" : "False");
        break;
    case ATTR_DTYPE:
        put(&o, "DType."), put(&o, npuc_dtype_name((int)a->i));
        break;
    case ATTR_INTS:
    case ATTR_FLOATS:
        put(&o, "(");
        for (int32_t i = 0; i < a->n && o.len + 1 < o.size; i++) {
            if (i) put(&o, ", ");
            if (a->kind == ATTR_INTS) {
                snprintf(t, sizeof t, "%lld", (long long)a->ints[i]);
                put(&o, t);
            } else {
                put_float(&o, a->floats[i]);
            }
        }
        put(&o, a->n == 1 ? ",)" : ")");
        break;
    default:
        put(&o, "None");
        break;
    }
    return buf;
}

/* Attr.accepts: the registry's kinds take Python values (an int is a float too; an empty tuple
 * is ints and floats; None only where the attribute is optional). */
static int attr_accepts(const rt_attr_spec *spec, const rt_attr *a) {
    switch (a->kind) {
    case ATTR_I:
        return spec->kind == RT_AK_INT || spec->kind == RT_AK_FLOAT;
    case ATTR_F:
        return spec->kind == RT_AK_FLOAT;
    case ATTR_S:
        return spec->kind == RT_AK_STR;
    case ATTR_B:
        return spec->kind == RT_AK_BOOL;
    case ATTR_DTYPE:
        return spec->kind == RT_AK_DTYPE;
    case ATTR_INTS:
        return spec->kind == RT_AK_INTS || spec->kind == RT_AK_FLOATS;
    case ATTR_FLOATS:
        return spec->kind == RT_AK_FLOATS || (spec->kind == RT_AK_INTS && a->n == 0);
    default:
        return spec->optional;
    }
}

/* check_ops' first checks of an op: op_def, op_attrs (OpDef.check_attrs' first problem), arity. */
static int check_op_schema(const npuc_model *m, const rt_op *op, const char **scratch_names, npuc_error *err) {
    char r[REPR], r2[REPR];
    const rt_op_schema *s = rt_op_schema_find(op->op);
    if (s == NULL)
        return rt_fail(err, NPUC_E_UNKNOWN_OP, "update npuc to the version that compiled the model",
                       "%s: op %s is %s, which this runtime does not know", m->path, repr(r, op->name),
                       repr(r2, op->op));
    for (int32_t i = 0; i < op->n_attrs; i++) {
        const rt_attr *a = &op->attrs[i];
        if (a->kind == ATTR_DTYPE && a->i < 0) /* DType(name)'s ValueError */
            return bad(err, NPUC_E_INVALID, "%s: op %s has an attribute that does not parse (%s is not a valid "
                       "DType)", m->path, repr(r, op->name), repr(r2, a->s));
    }
    for (int32_t i = 0; i < op->n_attrs; i++) scratch_names[i] = op->attrs[i].name;
    qsort(scratch_names, (size_t)op->n_attrs, sizeof *scratch_names, cmp_str_ptr);
    for (int32_t i = 1; i < op->n_attrs; i++)
        if (strcmp(scratch_names[i - 1], scratch_names[i]) == 0)
            return bad(err, NPUC_E_INVALID, "%s: op %s repeats an attribute", m->path, repr(r, op->name));
    for (int32_t i = 0; i < op->n_attrs; i++) {
        const rt_attr *a = &op->attrs[i];
        const rt_attr_spec *spec = NULL;
        for (int32_t j = 0; j < s->n_attrs && spec == NULL; j++)
            if (strcmp(s->attrs[j].name, a->name) == 0) spec = &s->attrs[j];
        if (spec == NULL)
            return bad(err, NPUC_E_INVALID, "%s: op %s (%s): unknown attribute %s", m->path, repr(r, op->name), s->name,
                       repr(r2, a->name));
        if (!attr_accepts(spec, a))
            return bad(err, NPUC_E_INVALID, "%s: op %s (%s): attribute %s=%s is not a %s", m->path, repr(r, op->name),
                       s->name, a->name, attr_repr(r2, sizeof r2, a), rt_attr_kind_name(spec->kind));
    }
    for (int32_t j = 0; j < s->n_attrs; j++) {
        if (!s->attrs[j].required) continue;
        int found = 0;
        for (int32_t i = 0; i < op->n_attrs && !found; i++) found = strcmp(op->attrs[i].name, s->attrs[j].name) == 0;
        if (!found)
            return bad(err, NPUC_E_INVALID, "%s: op %s (%s): missing attribute %s", m->path, repr(r, op->name), s->name,
                       repr(r2, s->attrs[j].name));
    }
    if (!rt_op_schema_arity_ok(s, op->n_inputs)) {
        text_out o = {r2, sizeof r2, 0};
        r2[0] = '\0';
        for (int32_t i = 0; i < s->n_inputs; i++) {
            if (i) put(&o, ", ");
            put(&o, s->inputs[i]);
        }
        return bad(err, NPUC_E_INVALID, "%s: op %s (%s) has %d operands; it takes %s", m->path, repr(r, op->name),
                   s->name, (int)op->n_inputs, r2);
    }
    return NPUC_OK;
}

/* The registry's in-place ops (OpDef.inplace) and the operand each updates: runtime/om_validate.py's
 * INPLACE, which tests/test_npucrt_recurrent.py holds to the registry and tests/test_npucrt_loader.py
 * this table to the ported reference. -1: the op updates nothing in place. */
static int inplace_operand(const char *op) {
    static const struct {
        const char *op;
        int operand;
    } INPLACE[] = {{"kv_write", 0}, {"selective_scan_state", 0}, {"gated_delta_rule_state", 0}, {"wkv_state", 0},
                   {"linear_recurrence_state", 0}, {"linear_attention_state", 0}};
    for (size_t j = 0; j < sizeof INPLACE / sizeof INPLACE[0]; j++)
        if (strcmp(op, INPLACE[j].op) == 0) return INPLACE[j].operand;
    return -1;
}

/* The rest of check_ops but the shape rules: run() feeds and returns by name; per op, its schema
 * (check_op_schema), then nothing written in the weights. */
static int check_writes(const npuc_model *m, const rt_program *g, scratch *sc, npuc_error *err) {
    char r[REPR], r2[REPR], l[REPR];
    for (int kind = 0; kind < 2; kind++) {
        const int32_t *ids = kind ? g->outputs : g->inputs;
        int32_t n = kind ? g->n_outputs : g->n_inputs;
        if (names_repeat(m, ids, n, sc->names))
            return bad(err, NPUC_E_INVALID, "%s: program %s has two %ss of one name: %s", m->path, repr(r, g->name),
                       kind ? "output" : "input", names_str(l, sizeof l, m, ids, n));
    }
#define WRITABLE(id, why_fmt, ...)                                                                                 \
    do {                                                                                                           \
        const rt_tensor *t_ = &m->tensors[id];                                                                     \
        if (is_region(t_, REGION_WEIGHTS)) {                                                                       \
            char why_[REPR];                                                                                       \
            snprintf(why_, sizeof why_, why_fmt, __VA_ARGS__);                                                     \
            return bad(err, NPUC_E_INVALID, "%s: tensor %s %s in program %s but lies in the read-only weights",    \
                       m->path, repr(r, t_->name), why_, repr(r2, g->name));                                       \
        }                                                                                                          \
    } while (0)
    for (int32_t i = 0; i < g->n_inputs; i++) {
        WRITABLE(g->inputs[i], "%s", "is an input");
        const rt_tensor *t = &m->tensors[g->inputs[i]];
        if (!is_region(t, REGION_ARENA))
            return bad(err, NPUC_E_INVALID, "%s: input %s of program %s is not in the arena", m->path,
                       repr(r, t->name), repr(r2, g->name));
    }
    for (int32_t i = 0; i < g->n_outputs; i++) WRITABLE(g->outputs[i], "%s", "is an output");
    char on[REPR];
    for (int32_t k = 0; k < g->n_ops; k++) {
        const rt_op *op = &g->ops[k];
        int rc = check_op_schema(m, op, sc->names, err);
        if (rc) return rc;
        for (int32_t i = 0; i < op->n_outputs; i++) WRITABLE(op->outputs[i], "is written by op %s", repr(on, op->name));
        /* The registry's in-place operands (OpDef.inplace): a cache or a recurrent state. */
        int updated = inplace_operand(op->op);
        if (updated >= 0 && op->n_inputs > updated)
            WRITABLE(op->inputs[updated], "is updated in place by op %s", repr(on, op->name));
        if (op->workspace != -1) {
            const rt_tensor *w = &m->tensors[op->workspace];
            if (!is_region(w, REGION_ARENA))
                return bad(err, NPUC_E_INVALID, "%s: op %s has a workspace of %llu bytes in %s; it needs one in the "
                           "arena", m->path, repr(r, op->name), (unsigned long long)w->nbytes, w->region_name);
        }
    }
#undef WRITABLE
    return NPUC_OK;
}

/* The first attribute named `name`'s `i` field (AttrValue.i: 0 unless the value is an int). */
static int64_t first_attr_i(const rt_op *op, const char *name, int64_t dflt) {
    for (int32_t i = 0; i < op->n_attrs; i++)
        if (strcmp(op->attrs[i].name, name) == 0) return op->attrs[i].kind == ATTR_I ? op->attrs[i].i : 0;
    return dflt;
}

static int64_t py_mod(int64_t a, int64_t n) {
    int64_t r = a % n;
    return r < 0 ? r + n : r;
}

typedef struct {
    int idx, table, axis;
} index_check;

static int check_index(const npuc_model *m, const rt_op *op, index_check w, int32_t position, int64_t cache,
                       npuc_error *err) {
    const rt_tensor *idx = &m->tensors[op->inputs[w.idx]], *table = &m->tensors[op->inputs[w.table]];
    /* A table of too few dims: the op's shape rule (the binder) refuses it; Python's order has
     * that check first. */
    if (w.axis >= table->rank) return NPUC_OK;
    int64_t rows = table->shape[w.axis];
    int signed_ok = strcmp(op->op, "gather") == 0 || strcmp(op->op, "index") == 0;
    int64_t low = signed_ok ? -rows : 0;
    char r[REPR], r2[REPR], r3[REPR];
    int small_stored = is_region(idx, REGION_WEIGHTS) && idx->nbytes <= SMALL_INDEX;
    if (small_stored && (idx->dtype == NPUC_I64 || idx->dtype == NPUC_I32)) {
        /* check_tensors put it inside the weights, nbytes a multiple of the item size. */
        size_t item = idx->dtype == NPUC_I64 ? 8 : 4, n = (size_t)idx->nbytes / item;
        const uint8_t *p = m->weights + idx->offset;
        int64_t lo = 0, hi = 0;
        for (size_t i = 0; i < n; i++) {
            int64_t v;
            if (item == 8) {
                uint64_t u = 0;
                for (int b = 7; b >= 0; b--) u = u << 8 | p[8 * i + (size_t)b];
                v = (int64_t)u;
            } else {
                uint32_t u = 0;
                for (int b = 3; b >= 0; b--) u = u << 8 | p[4 * i + (size_t)b];
                v = (int32_t)u;
            }
            if (i == 0 || v < lo) lo = v;
            if (i == 0 || v > hi) hi = v;
        }
        if (n && !(low <= lo && hi < rows))
            return bad(err, NPUC_E_INVALID, "%s: op %s (%s) indexes %lld rows of %s with %s, which holds %lld..%lld",
                       m->path, repr(r, op->name), op->op, (long long)rows, repr(r2, table->name), repr(r3, idx->name),
                       (long long)lo, (long long)hi);
    } else if (position >= 0 && op->inputs[w.idx] == position && cache && rows < cache) {
        return bad(err, NPUC_E_INVALID, "%s: op %s (%s) indexes %lld rows of %s by position, which runs to %lld "
                   "(the KV cache's rows, up to max_seq_len)", m->path, repr(r, op->name), op->op, (long long)rows,
                   repr(r2, table->name), (long long)cache);
    }
    return NPUC_OK;
}

static int check_indices(const npuc_model *m, const rt_program *g, int64_t cache, npuc_error *err) {
    static const struct {
        const char *op;
        index_check w;
    } INDEXES[] = {{"rope_lut", {1, 2, 0}}, {"kv_write", {2, 0, 2}}, {"cached_attention", {3, 1, 2}},
                   {"cached_conv1d", {2, 0, 2}}};
    int32_t position = -1; /* the input named "position" (names are unique by now) */
    for (int32_t i = 0; i < g->n_inputs; i++)
        if (strcmp(m->tensors[g->inputs[i]].name, "position") == 0) position = g->inputs[i];
    for (int32_t k = 0; k < g->n_ops; k++) {
        const rt_op *op = &g->ops[k];
        index_check checks[NPUC_MAX_RANK + 1];
        int n = 0;
        for (size_t j = 0; j < sizeof INDEXES / sizeof INDEXES[0]; j++)
            if (strcmp(op->op, INDEXES[j].op) == 0) checks[n++] = INDEXES[j].w;
        const rt_tensor *table0 = op->n_inputs ? &m->tensors[op->inputs[0]] : NULL;
        if (strcmp(op->op, "gather") == 0 && op->n_inputs == 2 && table0->rank > 0) {
            checks[0] = (index_check){1, 0, (int)py_mod(first_attr_i(op, "axis", 0), table0->rank)};
            n = 1;
        } else if (strcmp(op->op, "index") == 0 && table0 != NULL) {
            /* x[i0, i1, ...]: operand j indexes axis j - 1 */
            int32_t top = op->n_inputs < table0->rank + 1 ? op->n_inputs : table0->rank + 1;
            n = 0;
            for (int32_t j = 1; j < top; j++) checks[n++] = (index_check){j, 0, j - 1};
        }
        for (int j = 0; j < n; j++) {
            int need = checks[j].idx > checks[j].table ? checks[j].idx : checks[j].table;
            if (op->n_inputs > need) {
                int rc = check_index(m, op, checks[j], position, cache, err);
                if (rc) return rc;
            }
        }
    }
    return NPUC_OK;
}

/* ---- the memory plan: backend/memory_plan.validate_plan, from the file ---------------------- */

static int plan_wrong(const npuc_model *m, npuc_error *err, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;

static int plan_wrong(const npuc_model *m, npuc_error *err, const char *fmt, ...) {
    if (err == NULL) return NPUC_E_PLAN;
    char reason[sizeof err->message];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(reason, sizeof reason, fmt, ap);
    va_end(ap);
    return rt_fail(err, NPUC_E_PLAN, "buffer ids are tensor indices (see `npuc dump --json`); " HINT_DAMAGED,
                   "the memory plan in %s is invalid: %s", m->path, reason);
}

static rt_u128 buf_size(const npuc_model *m, const rt_buffer *b) {
    uint64_t n = m->tensors[b->tensor].nbytes;
    return n ? n : 1;
}

static rt_u128 align_up(rt_u128 n, uint64_t a) { return (n + a - 1) / a * a; }

/* Python's heapq over (end, id) tuples, exactly: the sweep reports the first overlapping pair
 * in the heap's own order. */
static int heap_less(const rt_buffer *bs, int32_t x, int32_t y) {
    if (bs[x].last_step != bs[y].last_step) return bs[x].last_step < bs[y].last_step;
    return bs[x].tensor < bs[y].tensor;
}

static void heap_siftdown(const rt_buffer *bs, int32_t *h, int32_t start, int32_t pos) {
    int32_t item = h[pos];
    while (pos > start) {
        int32_t parent = (pos - 1) >> 1;
        if (heap_less(bs, item, h[parent])) {
            h[pos] = h[parent];
            pos = parent;
            continue;
        }
        break;
    }
    h[pos] = item;
}

static void heap_push(const rt_buffer *bs, int32_t *h, int32_t *n, int32_t item) {
    h[(*n)++] = item;
    heap_siftdown(bs, h, 0, *n - 1);
}

static int32_t heap_pop(const rt_buffer *bs, int32_t *h, int32_t *n) {
    int32_t last = h[--(*n)];
    if (*n == 0) return last;
    int32_t top = h[0];
    h[0] = last;
    int32_t end = *n, pos = 0, child = 1;
    int32_t item = h[0];
    while (child < end) {
        if (child + 1 < end && !heap_less(bs, h[child], h[child + 1])) child++;
        h[pos] = h[child];
        pos = child;
        child = 2 * pos + 1;
    }
    h[pos] = item;
    heap_siftdown(bs, h, 0, pos);
    return top;
}

/* A Fenwick tree over the buffers in offset order, marking the active ones. */
static void fw_add(int32_t *f, int32_t n, int32_t i, int32_t d) {
    for (i++; i <= n; i += i & -i) f[i - 1] += d;
}

static int32_t fw_prefix(const int32_t *f, int32_t i) { /* active among the first i */
    int32_t s = 0;
    for (; i > 0; i -= i & -i) s += f[i - 1];
    return s;
}

static int32_t fw_kth(const int32_t *f, int32_t n, int32_t k) { /* position of the k-th active (1-based k) */
    int64_t pos = 0, step = 1;
    while (step * 2 <= n) step *= 2;
    for (; step; step /= 2) {
        if (pos + step <= n && f[pos + step - 1] < k) {
            pos += step;
            k -= f[pos - 1];
        }
    }
    return (int32_t)pos;
}

/* qsort has no context argument in C11 (and a global would be shared state): a stable merge
 * sort of indices, with the comparison's context passed along. */
typedef int (*less_fn)(const void *ctx, int32_t a, int32_t b);

static void merge_sort(int32_t *a, int32_t *tmp, int32_t n, less_fn less, const void *ctx) {
    /* bottom-up, stable */
    for (int32_t width = 1; width < n; width *= 2) {
        for (int32_t lo = 0; lo < n; lo += 2 * width) {
            int32_t mid = lo + width < n ? lo + width : n, hi = lo + 2 * width < n ? lo + 2 * width : n;
            int32_t i = lo, j = mid, k = lo;
            while (i < mid && j < hi) tmp[k++] = less(ctx, a[j], a[i]) ? a[j++] : a[i++];
            while (i < mid) tmp[k++] = a[i++];
            while (j < hi) tmp[k++] = a[j++];
        }
        memcpy(a, tmp, (size_t)n * sizeof *a);
    }
}

static int by_program_name(const void *ctx, int32_t x, int32_t y) {
    const npuc_model *m = ctx;
    int c = strcmp(m->programs[x].name, m->programs[y].name);
    return c != 0 ? c < 0 : x < y;
}

static int by_start_id(const void *ctx, int32_t x, int32_t y) {
    const rt_buffer *bs = ctx;
    if (bs[x].first_step != bs[y].first_step) return bs[x].first_step < bs[y].first_step;
    return bs[x].tensor < bs[y].tensor;
}

typedef struct {
    const npuc_model *m;
    const rt_buffer *bs;
} offset_ctx;

static int by_offset(const void *ctx, int32_t x, int32_t y) {
    const offset_ctx *c = ctx;
    uint64_t ox = c->m->tensors[c->bs[x].tensor].offset, oy = c->m->tensors[c->bs[y].tensor].offset;
    return ox != oy ? ox < oy : x < y;
}

static int cmp_event(const void *a, const void *b) {
    const struct event *x = a, *y = b;
    if (x->time != y->time) return x->time < y->time ? -1 : 1;
    return x->delta < y->delta ? -1 : x->delta > y->delta;
}

static int check_plan(const npuc_model *m, const rt_program *g, scratch *sc, npuc_error *err) {
    const rt_plan *pm = &g->plan;
    const rt_buffer *bs = pm->buffers;
    int32_t n = pm->n_buffers;
    char r[REPR], x1[48], x2[48];
    if (pm->alignment == 0) return plan_wrong(m, err, "its alignment is 0");
    uint64_t a = pm->alignment;
    int rc = NPUC_OK;
    int32_t i;
    for (i = 0; i < n; i++) {
        int32_t t = bs[i].tensor;
        if (!is_region(&m->tensors[t], REGION_ARENA)) {
            rc = plan_wrong(m, err, "buffer %d is tensor %s, which is not in the arena", t,
                            repr(r, m->tensors[t].name));
            break;
        }
        if (sc->buffer_of[t] >= 0) {
            rc = plan_wrong(m, err, "buffer %d is listed twice", t);
            break;
        }
        sc->buffer_of[t] = i;
    }
    if (rc) goto out;
    for (i = 0; i < n; i++) {
        if (bs[i].first_step > bs[i].last_step) {
            rc = plan_wrong(m, err, "buffer %d: start %d is after end %d", bs[i].tensor, bs[i].first_step,
                            bs[i].last_step);
            goto out;
        }
    }
    rt_u128 top = 0;
    for (i = 0; i < n; i++) {
        uint64_t off = m->tensors[bs[i].tensor].offset;
        if (off % a) {
            rc = plan_wrong(m, err, "buffer %d: offset %llu is not a non-negative multiple of alignment %llu",
                            bs[i].tensor, (unsigned long long)off, (unsigned long long)a);
            goto out;
        }
        rt_u128 end = off + align_up(buf_size(m, &bs[i]), a);
        if (end > top) top = end;
    }

    /* The sweep in start order: each buffer against those still live when it starts. Until the
     * first overlap the live ones are disjoint in space, so the one starting last below this
     * buffer's end is the only one that can overlap it: a Fenwick tree in offset order finds it
     * in log n. When it does, the heap is scanned in Python's order for the pair it reports. */
    for (i = 0; i < n; i++) sc->order[i] = sc->by_offset[i] = i;
    merge_sort(sc->order, sc->rank_of, n, by_start_id, bs);
    offset_ctx oc = {m, bs};
    merge_sort(sc->by_offset, sc->rank_of, n, by_offset, &oc);
    for (i = 0; i < n; i++) sc->rank_of[sc->by_offset[i]] = i, sc->fenwick[i] = 0;
    int32_t hn = 0;
    for (int32_t k = 0; k < n; k++) {
        int32_t b = sc->order[k];
        while (hn && bs[sc->heap[0]].last_step < bs[b].first_step) {
            int32_t gone = heap_pop(bs, sc->heap, &hn);
            fw_add(sc->fenwick, n, sc->rank_of[gone], -1);
        }
        uint64_t lo = m->tensors[bs[b].tensor].offset;
        rt_u128 hi = lo + align_up(buf_size(m, &bs[b]), a);
        /* Active buffers whose offset is below hi: the first `below` in offset order. */
        int32_t lo_i = 0, hi_i = n;
        while (lo_i < hi_i) {
            int32_t mid = (lo_i + hi_i) / 2;
            if ((rt_u128)m->tensors[bs[sc->by_offset[mid]].tensor].offset < hi) {
                lo_i = mid + 1;
            } else {
                hi_i = mid;
            }
        }
        int32_t cnt = fw_prefix(sc->fenwick, lo_i);
        int overlap = 0;
        if (cnt) {
            int32_t j = sc->by_offset[fw_kth(sc->fenwick, n, cnt)];
            rt_u128 jhi = m->tensors[bs[j].tensor].offset + align_up(buf_size(m, &bs[j]), a);
            overlap = jhi > lo;
        }
        if (overlap) {
            for (int32_t h = 0; h < hn; h++) {
                int32_t o = sc->heap[h];
                uint64_t olo = m->tensors[bs[o].tensor].offset;
                rt_u128 ohi = olo + align_up(buf_size(m, &bs[o]), a);
                if (lo < ohi && olo < hi) {
                    rc = plan_wrong(m, err, "buffers %d (steps %d..%d, bytes %llu..%s) and %d (steps %d..%d, bytes "
                                    "%llu..%s) overlap in time and space", bs[o].tensor, bs[o].first_step,
                                    bs[o].last_step, (unsigned long long)olo, rt_u128_str(x1, ohi), bs[b].tensor,
                                    bs[b].first_step, bs[b].last_step, (unsigned long long)lo, rt_u128_str(x2, hi));
                    goto out;
                }
            }
        }
        heap_push(bs, sc->heap, &hn, b);
        fw_add(sc->fenwick, n, sc->rank_of[b], 1);
    }

    if ((rt_u128)pm->arena_bytes != top) {
        rc = plan_wrong(m, err, "memory plan arena_bytes is %llu but its buffers end at %s",
                        (unsigned long long)pm->arena_bytes, rt_u128_str(x1, top));
        goto out;
    }
    /* lower_bound: the peak over steps of the aligned bytes live; at one step frees sort first. */
    for (i = 0; i < n; i++) {
        rt_i128 sz = (rt_i128)align_up(buf_size(m, &bs[i]), a);
        sc->events[2 * i] = (struct event){bs[i].first_step, sz};
        sc->events[2 * i + 1] = (struct event){(int64_t)bs[i].last_step + 1, -sz};
    }
    qsort(sc->events, (size_t)n * 2, sizeof *sc->events, cmp_event);
    rt_i128 live = 0, peak = 0;
    for (i = 0; i < 2 * n; i++) {
        live += sc->events[i].delta;
        if (live > peak) peak = live;
    }
    if ((rt_i128)pm->lower_bound_bytes != peak) {
        rc = plan_wrong(m, err, "memory plan records lower bound %llu, actual is %s",
                        (unsigned long long)pm->lower_bound_bytes, rt_i128_str(x1, peak));
        goto out;
    }
    if ((rt_i128)pm->arena_bytes < peak) {
        rc = plan_wrong(m, err, "memory plan arena %llu is below the lower bound %s",
                        (unsigned long long)pm->arena_bytes, rt_i128_str(x1, peak));
        goto out;
    }

    /* Each arena tensor is live whenever it is touched: inputs from step 0, op i (0-based) at
     * step i+1, outputs until the copy-out after the last op. */
    {
        int64_t last = (int64_t)g->n_ops + 1;
        char why[REPR + 64];
#define USE(tid, step, ...)                                                                                        \
    do {                                                                                                           \
        const rt_tensor *t_ = &m->tensors[tid];                                                                    \
        if (!is_region(t_, REGION_ARENA)) break;                                                                   \
        int32_t key_ = t_->base != -1 ? t_->base : (tid);                                                          \
        int32_t bi_ = sc->buffer_of[key_];                                                                         \
        if (bi_ < 0 || (int64_t)bs[bi_].first_step > (step) || (int64_t)bs[bi_].last_step < (step)) {              \
            snprintf(why, sizeof why, __VA_ARGS__);                                                                \
            if (bi_ < 0) {                                                                                         \
                rc = plan_wrong(m, err, "tensor %s %s but has no buffer", repr(r, t_->name), why);                \
            } else {                                                                                               \
                rc = plan_wrong(m, err, "tensor %s %s at step %lld but its buffer %d is live only over steps %d..%d", \
                                repr(r, t_->name), why, (long long)(step), (int)(tid), bs[bi_].first_step,         \
                                bs[bi_].last_step);                                                                \
            }                                                                                                      \
            goto out;                                                                                              \
        }                                                                                                          \
    } while (0)
        char on[REPR];
        for (i = 0; i < g->n_inputs; i++) USE(g->inputs[i], 0, "is a program input");
        for (i = 0; i < g->n_outputs; i++) USE(g->outputs[i], last, "is a program output");
        for (int32_t k = 0; k < g->n_ops; k++) {
            const rt_op *op = &g->ops[k];
            int64_t step = (int64_t)k + 1;
            repr(on, op->name);
            for (i = 0; i < op->n_inputs; i++) USE(op->inputs[i], step, "is used by op %s", on);
            for (i = 0; i < op->n_outputs; i++) USE(op->outputs[i], step, "is used by op %s", on);
            if (op->workspace != -1) USE(op->workspace, step, "is the workspace of op %s", on);
        }
#undef USE
    }
out:
    for (i = 0; i < n; i++) sc->buffer_of[bs[i].tensor] = -1;
    return rc;
}

/* ---- metadata, generation, tokenizer ------------------------------------------------------- */

static int check_metadata(const npuc_model *m, const char **sorted_names, npuc_error *err) {
    char r[REPR];
#define WRONG(key, value, why)                                                                                     \
    bad(err, NPUC_E_META, "%s: metadata %s=%s %s", m->path, key, rt_repr(r, REPR, value, 80), why)
    const char *v;
    int64_t x = 0;
    if ((v = meta_get(m, "max_seq_len")) != NULL) {
        if (ints_parse(v, &x) != 1 || x < 1 || x >= ((int64_t)1 << 31))
            return WRONG("max_seq_len", v, "is not a positive integer");
    }
    if ((v = meta_get(m, "eos_token_id")) != NULL && ints_parse(v, NULL) < 0)
        return WRONG("eos_token_id", v, "is not a list of token ids");
    static const struct {
        const char *key;
        int64_t top;
    } PARALLEL[] = {{"parallel.world", 4096}, {"parallel.rank", 4095}, {"parallel.ep", 4096},
                    {"parallel.replicated_bytes", (int64_t)1 << 62}};
    for (size_t k = 0; k < sizeof PARALLEL / sizeof PARALLEL[0]; k++) {
        if ((v = meta_get(m, PARALLEL[k].key)) != NULL) {
            if (ints_parse(v, &x) != 1 || x < 0 || x > PARALLEL[k].top)
                return WRONG(PARALLEL[k].key, v, "is not a rank count or index");
        }
    }
    if ((v = meta_get(m, "parallel.rank")) != NULL) {
        int64_t rank = 0, world = 1;
        ints_parse(v, &rank);
        const char *w = meta_get(m, "parallel.world");
        if (w != NULL) ints_parse(w, &world);
        if (rank >= world) return WRONG("parallel.rank", v, "is not below parallel.world");
    }
    if ((v = meta_get(m, "programs")) != NULL) {
        /* set(value.split(",")) - set(program names): each piece looked up in the sorted names. */
        const char *p = v;
        for (;;) {
            const char *comma = strchr(p, ',');
            size_t len = comma ? (size_t)(comma - p) : strlen(p);
            int32_t lo = 0, hi = m->n_programs, found = 0;
            while (lo < hi && !found) {
                int32_t mid = (lo + hi) / 2;
                int c = strncmp(sorted_names[mid], p, len);
                if (c == 0 && sorted_names[mid][len] != '\0') c = 1;
                if (c == 0) {
                    found = 1;
                } else if (c < 0) {
                    lo = mid + 1;
                } else {
                    hi = mid;
                }
            }
            if (!found) {
                /* Python joins a set here (its order varies by run); we name them in file order. */
                char have[REPR], why[REPR + 64];
                size_t k = 0;
                have[0] = '\0';
                for (int32_t i = 0; i < m->n_programs && k < sizeof have; i++)
                    k += (size_t)snprintf(have + k, sizeof have - k, "%s%s", i ? ", " : "", m->programs[i].name);
                snprintf(why, sizeof why, "names a program the model does not have (it has %s)", have);
                return WRONG("programs", v, why);
            }
            if (comma == NULL) break;
            p = comma + 1;
        }
    }
#undef WRONG
    return NPUC_OK;
}

static const rt_program *find_program(const npuc_model *m, const char *name) {
    for (int32_t i = 0; i < m->n_programs; i++)
        if (strcmp(m->programs[i].name, name) == 0) return &m->programs[i];
    return NULL;
}

static int dims_equal(const rt_tensor *t, const int64_t *dims, int32_t n) {
    if (t->rank != n) return 0;
    for (int32_t i = 0; i < n; i++)
        if (t->shape[i] != dims[i]) return 0;
    return 1;
}

static int check_generation(const npuc_model *m, npuc_error *err) {
    const rt_program *pre = find_program(m, "prefill"), *dec = find_program(m, "decode");
    const char *msl = meta_get(m, "max_seq_len");
    if (pre == NULL || dec == NULL || msl == NULL) return NPUC_OK;
    int64_t n = 0;
    ints_parse(msl, &n); /* check_metadata made it 1..2^31-1 */
    int64_t rows = 0;
    int any = 0;
    for (int32_t i = 0; i < m->n_tensors; i++) {
        const rt_tensor *t = &m->tensors[i];
        /* the KV and conv caches' rows; a recurrent state (passes/recurrent_state.py) has none per position */
        int recurrent = strncmp(t->name, "ssm_state.", 10) == 0 || strncmp(t->name, "delta_state.", 12) == 0 ||
                        strncmp(t->name, "linear_state.", 13) == 0 || strncmp(t->name, "conv_window.", 12) == 0;
        if (is_region(t, REGION_STATE) && t->rank == 4 && !recurrent && !t->pool && (!any || t->shape[2] < rows))
            rows = t->shape[2], any = 1;
    }
    if (any && n > rows)
        return bad(err, NPUC_E_META, "%s: metadata max_seq_len=%lld is longer than the KV cache's %lld rows", m->path,
                   (long long)n, (long long)rows);
    /* ids: prefill's inputs but last_token and slot */
    const rt_tensor *ids = NULL;
    int32_t n_ids = 0;
    for (int32_t i = 0; i < pre->n_inputs; i++) {
        const rt_tensor *t = &m->tensors[pre->inputs[i]];
        if (strcmp(t->name, "last_token") != 0 && strcmp(t->name, "slot") != 0) {
            if (n_ids++ == 0) ids = t;
        }
    }
    if (ids == NULL || ids->rank != 2 || ids->shape[1] > n)
        return bad(err, NPUC_E_META, "%s: the prefill program's token input does not fit max_seq_len=%lld", m->path,
                   (long long)n);
    char r[REPR], l[REPR], s[REPR];
    const rt_program *both[2] = {pre, dec};
    for (int k = 0; k < 2; k++) {
        int has = 0;
        for (int32_t i = 0; i < both[k]->n_outputs && !has; i++)
            has = strcmp(m->tensors[both[k]->outputs[i]].name, "logits") == 0;
        if (!has)
            return bad(err, NPUC_E_INVALID, "%s: the %s program has no 'logits' output", m->path,
                       k ? "decode" : "prefill");
    }
    int ok = dec->n_inputs == 2 && n_ids == 1;
    if (ok) {
        const char *a = m->tensors[dec->inputs[0]].name, *b = m->tensors[dec->inputs[1]].name;
        ok = strcmp(a, b) != 0 && (strcmp(a, ids->name) == 0 || strcmp(b, ids->name) == 0);
    }
    if (!ok)
        return bad(err, NPUC_E_INVALID, "%s: the decode program's inputs %s are not the prefill's %s and a position",
                   m->path, names_str(l, sizeof l, m, dec->inputs, dec->n_inputs), repr(r, ids->name));
    const rt_tensor *slot = NULL;
    for (int32_t i = 0; i < pre->n_inputs && slot == NULL; i++)
        if (strcmp(m->tensors[pre->inputs[i]].name, "slot") == 0) slot = &m->tensors[pre->inputs[i]];
    const rt_tensor *d0 = &m->tensors[dec->inputs[0]], *d1 = &m->tensors[dec->inputs[1]];
    const rt_tensor *step_ids = strcmp(d0->name, ids->name) == 0 ? d0 : d1;
    const rt_tensor *position = step_ids == d0 ? d1 : d0;
    int64_t slots = 0, c = 0;
    if (step_ids->rank == 2) slots = step_ids->shape[0], c = step_ids->shape[1];
    int64_t want[2] = {slots, c};
    int32_t n_want = c == 1 ? 1 : 2;
    if (slot != NULL) {
        static const int64_t ONE[1] = {1};
        int caches_ok = 0, caches_any = 0;
        for (int32_t i = 0; i < m->n_tensors; i++) {
            const rt_tensor *t = &m->tensors[i];
            if (is_region(t, REGION_STATE) && t->rank == 4 && !t->pool) {
                caches_ok = caches_any ? caches_ok && t->shape[0] == slots : t->shape[0] == slots;
                caches_any = 1;
            }
        }
        if (!dims_equal(slot, ONE, 1) || ids->shape[0] != 1 || slots < 2 || !caches_ok ||
            !dims_equal(position, want, n_want))
            return bad(err, NPUC_E_INVALID, "%s: a prefill into a slot takes one sequence and slot [1], and decode the "
                       "tokens of each of the cache's slots at their positions %s", m->path,
                       shape_str(s, sizeof s, want, n_want));
    } else {
        int64_t one[2] = {1, c};
        if (!dims_equal(position, one, n_want))
            return bad(err, NPUC_E_INVALID, "%s: the decode program's position is %s, not %s (a model of one slot)",
                       m->path, tensor_shape(l, sizeof l, position), shape_str(s, sizeof s, one, n_want));
    }
    /* Every token the logits can choose must be one the embedding takes back in. */
    for (int k = 0; k < 2; k++) {
        const rt_program *g = both[k];
        int32_t ids_id = -1;
        for (int32_t i = 0; i < g->n_inputs && ids_id < 0; i++)
            if (strcmp(m->tensors[g->inputs[i]].name, ids->name) == 0) ids_id = g->inputs[i];
        const rt_tensor *logits = NULL;
        for (int32_t i = 0; i < g->n_outputs && logits == NULL; i++)
            if (strcmp(m->tensors[g->outputs[i]].name, "logits") == 0) logits = &m->tensors[g->outputs[i]];
        for (int32_t j = 0; j < g->n_ops; j++) {
            const rt_op *op = &g->ops[j];
            if (strcmp(op->op, "gather") != 0 || op->n_inputs != 2 || op->inputs[1] != ids_id) continue;
            const rt_tensor *table = &m->tensors[op->inputs[0]];
            int64_t vocab = 0;
            if (table->rank) vocab = table->shape[py_mod(first_attr_i(op, "axis", 0), table->rank)];
            int64_t width = logits->rank ? logits->shape[logits->rank - 1] : 0;
            if (!logits->rank || vocab < width)
                return bad(err, NPUC_E_INVALID, "%s: the %s program's logits choose among %lld tokens; its "
                           "embedding %s has %lld rows", m->path, g->name, (long long)width, repr(r, table->name),
                           (long long)vocab);
        }
    }
    return NPUC_OK;
}

/* The tokenizer section: json.loads(bytes), then {plain file name: base64 text}. Python's
 * decoding of bytes is followed (UTF-8, -16 or -32 by its BOM or zero bytes, surrogates passed),
 * and its JSON grammar (NaN, Infinity, duplicate keys: the last value, in the first one's place). */

typedef struct {
    uint32_t *cp;
    size_t n, at;
    int depth;
} json;

static int json_decode_text(const uint8_t *b, size_t n, uint32_t *out, size_t *count) {
    size_t k = 0;
    enum { U8, U16BE, U16LE, U32BE, U32LE } enc = U8;
    if (n >= 4 && b[0] == 0 && b[1] == 0 && b[2] == 0xfe && b[3] == 0xff) {
        enc = U32BE, b += 4, n -= 4;
    } else if (n >= 4 && b[0] == 0xff && b[1] == 0xfe && b[2] == 0 && b[3] == 0) {
        enc = U32LE, b += 4, n -= 4;
    } else if (n >= 2 && b[0] == 0xfe && b[1] == 0xff) {
        enc = U16BE, b += 2, n -= 2;
    } else if (n >= 2 && b[0] == 0xff && b[1] == 0xfe) {
        enc = U16LE, b += 2, n -= 2;
    } else if (n >= 3 && b[0] == 0xef && b[1] == 0xbb && b[2] == 0xbf) {
        b += 3, n -= 3;
    } else if (n >= 4) {
        if (!b[0]) {
            enc = b[1] ? U16BE : U32BE;
        } else if (!b[1]) {
            enc = b[2] || b[3] ? U16LE : U32LE;
        }
    } else if (n == 2) {
        if (!b[0]) {
            enc = U16BE;
        } else if (!b[1]) {
            enc = U16LE;
        }
    }
    size_t i = 0;
    while (i < n) {
        uint32_t c;
        if (enc == U8) {
            size_t len;
            long v = rt_utf8_decode(b + i, n - i, 1, &len);
            if (v < 0) return -1;
            c = (uint32_t)v, i += len;
        } else if (enc == U16BE || enc == U16LE) {
            if (n - i < 2) return -1;
            c = enc == U16BE ? (uint32_t)b[i] << 8 | b[i + 1] : (uint32_t)b[i + 1] << 8 | b[i];
            i += 2;
            if (c >= 0xd800 && c < 0xdc00 && n - i >= 2) {
                uint32_t lo = enc == U16BE ? (uint32_t)b[i] << 8 | b[i + 1] : (uint32_t)b[i + 1] << 8 | b[i];
                if (lo >= 0xdc00 && lo < 0xe000) c = 0x10000 + ((c - 0xd800) << 10) + (lo - 0xdc00), i += 2;
            }
        } else {
            if (n - i < 4) return -1;
            c = enc == U32BE ? (uint32_t)b[i] << 24 | (uint32_t)b[i + 1] << 16 | (uint32_t)b[i + 2] << 8 | b[i + 3]
                             : (uint32_t)b[i + 3] << 24 | (uint32_t)b[i + 2] << 16 | (uint32_t)b[i + 1] << 8 | b[i];
            i += 4;
            if (c > 0x10ffff) return -1;
        }
        out[k++] = c;
    }
    *count = k;
    return 0;
}

static void json_ws(json *j) {
    for (; j->at < j->n; j->at++) {
        uint32_t c = j->cp[j->at];
        if (c != ' ' && c != '\t' && c != '\n' && c != '\r') break;
    }
}

static int json_lit(json *j, const char *lit) {
    size_t k = strlen(lit);
    if (j->n - j->at < k) return 0;
    for (size_t i = 0; i < k; i++)
        if (j->cp[j->at + i] != (uint32_t)(unsigned char)lit[i]) return 0;
    j->at += k;
    return 1;
}

static int hexval(uint32_t c) {
    if (c >= '0' && c <= '9') return (int)(c - '0');
    if (c >= 'a' && c <= 'f') return (int)(c - 'a' + 10);
    if (c >= 'A' && c <= 'F') return (int)(c - 'A' + 10);
    return -1;
}

/* A string after its opening quote, decoded in place over the input (never longer). */
static int json_string(json *j, size_t *start, size_t *len) {
    size_t w = j->at;
    *start = w;
    while (j->at < j->n) {
        uint32_t c = j->cp[j->at++];
        if (c == '"') {
            *len = w - *start;
            return 0;
        }
        if (c < 0x20) return -1;
        if (c == '\\') {
            if (j->at >= j->n) return -1;
            uint32_t e = j->cp[j->at++];
            switch (e) {
            case '"': case '\\': case '/': c = e; break;
            case 'b': c = '\b'; break;
            case 'f': c = '\f'; break;
            case 'n': c = '\n'; break;
            case 'r': c = '\r'; break;
            case 't': c = '\t'; break;
            case 'u': {
                uint32_t v = 0;
                for (int k = 0; k < 4; k++) {
                    int h = j->at < j->n ? hexval(j->cp[j->at]) : -1;
                    if (h < 0) return -1;
                    v = v << 4 | (uint32_t)h;
                    j->at++;
                }
                /* A surrogate pair written as two escapes is one character. */
                if (v >= 0xd800 && v < 0xdc00 && j->n - j->at >= 6 && j->cp[j->at] == '\\' && j->cp[j->at + 1] == 'u') {
                    uint32_t lo = 0;
                    int okp = 1;
                    for (int k = 0; k < 4; k++) {
                        int h = hexval(j->cp[j->at + 2 + (size_t)k]);
                        if (h < 0) okp = 0;
                        lo = lo << 4 | (uint32_t)(h < 0 ? 0 : h);
                    }
                    if (okp && lo >= 0xdc00 && lo < 0xe000) {
                        v = 0x10000 + ((v - 0xd800) << 10) + (lo - 0xdc00);
                        j->at += 6;
                    }
                }
                c = v;
                break;
            }
            default:
                return -1;
            }
        }
        j->cp[w++] = c;
    }
    return -1;
}

static int json_digits(json *j) {
    size_t s = j->at;
    while (j->at < j->n && j->cp[j->at] >= '0' && j->cp[j->at] <= '9') j->at++;
    return j->at > s;
}

/* One value; *kind: 's' for a string (its decoded text at *start, *len), else another letter. */
static int json_value(json *j, int *kind, size_t *start, size_t *len) {
    if (j->at >= j->n) return -1;
    uint32_t c = j->cp[j->at];
    if (c == '"') {
        j->at++;
        *kind = 's';
        return json_string(j, start, len);
    }
    *kind = 'x';
    if (c == '{' || c == '[') {
        /* Python's scanner recurses; it would hit its recursion limit near 1000 levels. */
        if (++j->depth > 1000) return -1;
        j->at++;
        json_ws(j);
        uint32_t close = c == '{' ? '}' : ']';
        if (j->at < j->n && j->cp[j->at] == close) {
            j->at++;
            j->depth--;
            return 0;
        }
        for (;;) {
            int k;
            size_t s, l;
            if (c == '{') {
                if (j->at >= j->n || j->cp[j->at] != '"') return -1;
                j->at++;
                if (json_string(j, &s, &l)) return -1;
                json_ws(j);
                if (j->at >= j->n || j->cp[j->at] != ':') return -1;
                j->at++;
                json_ws(j);
            }
            if (json_value(j, &k, &s, &l)) return -1;
            json_ws(j);
            if (j->at >= j->n) return -1;
            if (j->cp[j->at] == close) {
                j->at++;
                j->depth--;
                return 0;
            }
            if (j->cp[j->at] != ',') return -1;
            j->at++;
            json_ws(j);
        }
    }
    if (json_lit(j, "null") || json_lit(j, "true") || json_lit(j, "false") || json_lit(j, "NaN") ||
        json_lit(j, "Infinity") || json_lit(j, "-Infinity"))
        return 0;
    /* -?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)? : a part that does not complete is left
     * for the caller to refuse as it finds it (Python's scanner backs off the same way). */
    size_t s0 = j->at;
    if (j->cp[j->at] == '-') j->at++;
    size_t digits0 = j->at;
    if (j->at < j->n && j->cp[j->at] == '0') {
        j->at++;
    } else if (!json_digits(j)) {
        j->at = s0;
        return -1;
    }
    size_t mark = j->at, int_digits = j->at - digits0;
    int is_float = 0;
    if (j->at < j->n && j->cp[j->at] == '.') {
        j->at++;
        if (!json_digits(j)) {
            j->at = mark;
        } else {
            is_float = 1;
        }
    }
    mark = j->at;
    if (j->at < j->n && (j->cp[j->at] == 'e' || j->cp[j->at] == 'E')) {
        j->at++;
        if (j->at < j->n && (j->cp[j->at] == '+' || j->cp[j->at] == '-')) j->at++;
        if (!json_digits(j)) {
            j->at = mark;
        } else {
            is_float = 1;
        }
    }
    /* Python 3.11 refuses to convert an int of more than 4300 digits (a ValueError: not JSON). */
    if (!is_float && int_digits > 4300) return -1;
    return 0;
}

/* b64decode(text, validate=True) of Python 3.11: binascii.a2b_base64 in strict mode. */
static int base64_ok(const uint32_t *s, size_t n) {
    if (n && s[0] == '=') return 0;
    int quad = 0, pads = 0, padding = 0;
    size_t data = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t c = s[i];
        if (c >= 0x80) return 0; /* not ASCII: ValueError */
        if (c == '=') {
            padding = 1;
            if (quad >= 2 && quad + ++pads >= 4) return i + 1 >= n;
            continue;
        }
        if (!((c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '+' || c == '/'))
            return 0;
        if (padding) return 0;
        pads = 0;
        quad = (quad + 1) & 3;
        data++;
    }
    return quad == 0;
}

typedef struct {
    size_t key, key_len, val, val_len;
    int kind;
    size_t order;
} json_item;

static int cmp_item_key(const void *a, const void *b, const uint32_t *cp) {
    const json_item *x = a, *y = b;
    size_t n = x->key_len < y->key_len ? x->key_len : y->key_len;
    for (size_t i = 0; i < n; i++)
        if (cp[x->key + i] != cp[y->key + i]) return cp[x->key + i] < cp[y->key + i] ? -1 : 1;
    if (x->key_len != y->key_len) return x->key_len < y->key_len ? -1 : 1;
    return x->order < y->order ? -1 : x->order > y->order;
}

/* Items sorted by (key, position) with a merge sort (qsort has no context argument). */
static void sort_items(json_item *a, json_item *tmp, size_t n, const uint32_t *cp, int by_key) {
    for (size_t width = 1; width < n; width *= 2) {
        for (size_t lo = 0; lo < n; lo += 2 * width) {
            size_t mid = lo + width < n ? lo + width : n, hi = lo + 2 * width < n ? lo + 2 * width : n;
            size_t i = lo, j = mid, k = lo;
            while (i < mid && j < hi) {
                int take_right = by_key ? cmp_item_key(&a[j], &a[i], cp) < 0 : a[j].order < a[i].order;
                tmp[k++] = take_right ? a[j++] : a[i++];
            }
            while (i < mid) tmp[k++] = a[i++];
            while (j < hi) tmp[k++] = a[j++];
        }
        memcpy(a, tmp, n * sizeof *a);
    }
}

static int check_tokenizer(const npuc_model *m, const uint8_t *data, size_t size, npuc_error *err) {
    int rc = NPUC_OK;
    uint32_t *cp = malloc((size ? size : 1) * sizeof *cp);
    json_item *items = NULL, *tmp = NULL;
    if (cp == NULL) return no_memory(err);
    size_t n = 0, n_items = 0, cap = 0;
    json j = {cp, 0, 0, 0};
    int not_json = json_decode_text(data, size, cp, &n) != 0;
    j.n = n;
    int is_object = 0;
    if (!not_json) {
        json_ws(&j);
        is_object = j.at < j.n && j.cp[j.at] == '{';
        if (is_object) {
            /* The object's items, read here (json_value checks everything nested below them). */
            j.at++;
            json_ws(&j);
            if (j.at < j.n && j.cp[j.at] == '}') {
                j.at++;
            } else {
                for (;;) {
                    json_item it = {0, 0, 0, 0, 0, n_items};
                    if (j.at >= j.n || j.cp[j.at] != '"') goto syntax;
                    j.at++;
                    if (json_string(&j, &it.key, &it.key_len)) goto syntax;
                    json_ws(&j);
                    if (j.at >= j.n || j.cp[j.at] != ':') goto syntax;
                    j.at++;
                    json_ws(&j);
                    j.depth = 1;
                    if (json_value(&j, &it.kind, &it.val, &it.val_len)) goto syntax;
                    if (n_items == cap) {
                        cap = cap ? cap * 2 : 8;
                        json_item *more = realloc(items, cap * sizeof *items);
                        if (more == NULL) {
                            rc = no_memory(err);
                            goto done;
                        }
                        items = more;
                    }
                    items[n_items++] = it;
                    json_ws(&j);
                    if (j.at < j.n && j.cp[j.at] == '}') {
                        j.at++;
                        break;
                    }
                    if (j.at >= j.n || j.cp[j.at] != ',') goto syntax;
                    j.at++;
                    json_ws(&j);
                }
            }
        } else {
            int k;
            size_t s, l;
            if (json_value(&j, &k, &s, &l)) goto syntax;
        }
        json_ws(&j);
        if (j.at != j.n) goto syntax;
    }
    if (0) {
    syntax:
        not_json = 1;
    }
    if (not_json) {
        rc = bad(err, NPUC_E_META, "%s: the tokenizer section is not JSON", m->path);
        goto done;
    }
    if (!is_object) {
        rc = bad(err, NPUC_E_META, "%s: the tokenizer section is not a JSON object of files", m->path);
        goto done;
    }
    if (n_items) {
        /* A repeated key keeps its first place and takes its last value (a dict). */
        tmp = malloc(n_items * sizeof *tmp);
        if (tmp == NULL) {
            rc = no_memory(err);
            goto done;
        }
        sort_items(items, tmp, n_items, cp, 1);
        size_t w = 0;
        for (size_t i = 0; i < n_items;) {
            size_t e = i + 1;
            while (e < n_items && items[e].key_len == items[i].key_len &&
                   memcmp(&cp[items[e].key], &cp[items[i].key], items[i].key_len * sizeof *cp) == 0)
                e++;
            json_item keep = items[e - 1];
            keep.order = items[i].order;
            items[w++] = keep;
            i = e;
        }
        n_items = w;
        sort_items(items, tmp, n_items, cp, 0);
    }
    for (size_t i = 0; i < n_items; i++) {
        const json_item *it = &items[i];
        const uint32_t *name = &cp[it->key];
        int plain = it->key_len > 0 && name[0] != '.';
        for (size_t k = 0; k < it->key_len && plain; k++) plain = name[k] != '/' && name[k] != 0;
        char r[REPR];
        if (!plain) {
            rc = bad(err, NPUC_E_META, "%s: the stored tokenizer names a file %s", m->path,
                     rt_repr_cp(r, REPR, name, it->key_len, 80));
            goto done;
        }
        if (it->kind != 's' || !base64_ok(&cp[it->val], it->val_len)) {
            rc = bad(err, NPUC_E_META, "%s: the stored tokenizer file %s is not base64", m->path,
                     rt_repr_cp(r, REPR, name, it->key_len, 80));
            goto done;
        }
    }
done:
    free(cp);
    free(items);
    free(tmp);
    return rc;
}

/* ---- the whole check ----------------------------------------------------------------------- */

uint64_t npuc_memory_cap(void) {
    const char *env = getenv("NPUC_MAX_MEMORY");
    if (env != NULL) {
        /* text.strip().upper(), then ([0-9]+)([KMGT]?)B? in full */
        const char *s = env, *e = env + strlen(env);
        while (s < e && ((*s >= '\t' && *s <= '\r') || *s == ' ' || (*s >= 0x1c && *s <= 0x1f))) s++;
        while (e > s && ((e[-1] >= '\t' && e[-1] <= '\r') || e[-1] == ' ' || (e[-1] >= 0x1c && e[-1] <= 0x1f))) e--;
        const char *p = s;
        rt_u128 v = 0;
        int over = 0;
        while (p < e && *p >= '0' && *p <= '9') {
            v = v * 10 + (unsigned)(*p - '0');
            if (v > UINT64_MAX) over = 1, v = UINT64_MAX;
            p++;
        }
        if (p > s) {
            int shift = 0;
            if (p < e) {
                const char *units = "KMGT";
                char u = *p >= 'a' && *p <= 'z' ? (char)(*p - 32) : *p;
                const char *at = strchr(units, u);
                if (at != NULL && u != '\0') shift = 10 * (int)(at - units + 1), p++;
            }
            if (p < e && (*p == 'B' || *p == 'b')) p++;
            if (p == e) {
                if (over || (shift && v > (UINT64_MAX >> shift))) return UINT64_MAX;
                return (uint64_t)v << shift;
            }
        }
    }
    long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
    if (pages <= 0 || page <= 0) return (uint64_t)1 << 40;
    return (uint64_t)pages * (uint64_t)page;
}

/* om_validate.check_prefix_pool: metadata prefix_pool ("state:axis,...", backend/om_schema.py)
 * parses; each state it names has its pool tensor "prefix_pool.<state>" [entries, ...] of its
 * layout; every other state is in it; nothing but the runtime's prefix copies touches a pool
 * tensor. Fills m->prefix and marks the pool tensors (t->pool). */
#define POOL_PREFIX "prefix_pool."

static int32_t first_state(const npuc_model *m, const char *prefix, const char *name) {
    size_t k = strlen(prefix);
    for (int32_t i = 0; i < m->n_tensors; i++) {
        const rt_tensor *t = &m->tensors[i];
        if (is_region(t, REGION_STATE) && t->base == -1 && strncmp(t->name, prefix, k) == 0 &&
            strcmp(t->name + k, name) == 0)
            return i;
    }
    return -1;
}

static int check_prefix_pool(npuc_model *m, npuc_error *err) {
    const char *v = meta_get(m, "prefix_pool");
    if (v == NULL) return NPUC_OK;
    char r[REPR], q[REPR];
    /* the entries: split at ',', each name up to its last ':' and one or two digits after it */
    int32_t n = 1;
    for (const char *c = v; *c; c++) n += *c == ',';
    const char **names = pool_alloc(&m->pool, sizeof *names * (size_t)n);
    int32_t *axes = pool_alloc(&m->pool, sizeof *axes * (size_t)n);
    m->prefix = pool_alloc(&m->pool, sizeof *m->prefix * (size_t)n);
    uint8_t *listed = calloc((size_t)m->n_tensors + 1, 1);
    if (names == NULL || axes == NULL || m->prefix == NULL || listed == NULL) {
        free(listed);
        return no_memory(err);
    }
    int ok = 1;
    const char *p = v;
    for (int32_t k = 0; k < n && ok; k++) {
        const char *comma = strchr(p, ',');
        size_t len = comma ? (size_t)(comma - p) : strlen(p);
        const char *colon = NULL;
        for (size_t i = 0; i < len; i++)
            if (p[i] == ':') colon = p + i;
        size_t digits = colon ? len - (size_t)(colon + 1 - p) : 0;
        ok = colon != NULL && colon > p && digits >= 1 && digits <= 2;
        for (size_t i = 0; ok && i < digits; i++) ok = colon[1 + i] >= '0' && colon[1 + i] <= '9';
        if (ok) {
            names[k] = pool_strndup(&m->pool, p, (size_t)(colon - p));
            if (names[k] == NULL) {
                free(listed);
                return no_memory(err);
            }
            axes[k] = digits == 1 ? colon[1] - '0' : (colon[1] - '0') * 10 + (colon[2] - '0');
            for (int32_t j = 0; j < k && ok; j++) ok = strcmp(names[j], names[k]) != 0;
        }
        p = comma ? comma + 1 : p + len;
    }
    int rc = NPUC_OK;
    if (!ok) {
        rc = bad(err, NPUC_E_META, "%s: metadata prefix_pool=%s is not a list of state:axis entries", m->path,
                 rt_repr(r, REPR, v, 80));
    } else if (meta_get(m, "max_seq_len") == NULL) {
        rc = bad(err, NPUC_E_META, "%s: metadata prefix_pool=%s comes without max_seq_len", m->path,
                 rt_repr(r, REPR, v, 80));
    }
    int64_t entries = 0;
    uint64_t nbytes = 0;
    for (int32_t k = 0; k < n && !rc; k++) {
        int32_t s = first_state(m, "", names[k]), pl = first_state(m, POOL_PREFIX, names[k]);
        int is_pool_name = 0; /* the name is another entry's pool tensor */
        for (int32_t j = 0; j < n && !is_pool_name; j++)
            is_pool_name = strncmp(names[k], POOL_PREFIX, sizeof POOL_PREFIX - 1) == 0 &&
                           strcmp(names[k] + sizeof POOL_PREFIX - 1, names[j]) == 0;
        if (s < 0 || pl < 0 || is_pool_name) {
            size_t len = strlen(names[k]) + sizeof POOL_PREFIX;
            char *pool_name = malloc(len);
            if (pool_name == NULL) {
                rc = no_memory(err);
                break;
            }
            snprintf(pool_name, len, "%s%s", POOL_PREFIX, names[k]);
            rc = bad(err, NPUC_E_INVALID, "%s: metadata prefix_pool names state %s, which has no state tensor and "
                     "pool tensor %s", m->path, repr(r, names[k]), repr(q, pool_name));
            free(pool_name);
            break;
        }
        const rt_tensor *st = &m->tensors[s], *pt = &m->tensors[pl];
        int64_t e = pt->rank ? pt->shape[0] : 0;
        int same = axes[k] >= 1 && axes[k] < st->rank && pt->dtype == st->dtype && pt->rank == st->rank &&
                   e >= 1 && e < ((int64_t)1 << 31) && (entries == 0 || e == entries);
        for (int32_t d = 1; same && d < st->rank; d++) same = pt->shape[d] == st->shape[d];
        if (!same) {
            rc = bad(err, NPUC_E_INVALID, "%s: prefix pool tensor %s is not [entries, ...] of state %s's layout with "
                     "positions on its axis %d", m->path, repr(r, pt->name), repr(q, names[k]), (int)axes[k]);
            break;
        }
        m->prefix[k] = (rt_prefix){.state = s, .pool = pl, .axis = axes[k]};
        listed[s] = 1;
        m->tensors[pl].pool = 1;
        entries = e;
        nbytes += pt->nbytes;
    }
    for (int32_t i = 0; i < m->n_tensors && !rc; i++) {
        const rt_tensor *t = &m->tensors[i];
        if (is_region(t, REGION_STATE) && t->base == -1 && !listed[i] && !t->pool)
            rc = bad(err, NPUC_E_INVALID, "%s: state %s is not in the prefix pool (metadata prefix_pool), so a prefix "
                     "could not restore it", m->path, repr(r, t->name));
        else if (t->base >= 0 && m->tensors[t->base].pool)
            rc = bad(err, NPUC_E_INVALID, "%s: tensor %s shares the buffer of prefix pool tensor %s", m->path,
                     repr(r, t->name), repr(q, m->tensors[t->base].name));
    }
    for (int32_t g = 0; g < m->n_programs && !rc; g++) {
        const rt_program *prog = &m->programs[g];
        int32_t used = -1;
        for (int32_t i = 0; i < prog->n_inputs && used < 0; i++)
            if (m->tensors[prog->inputs[i]].pool) used = prog->inputs[i];
        for (int32_t i = 0; i < prog->n_outputs && used < 0; i++)
            if (m->tensors[prog->outputs[i]].pool) used = prog->outputs[i];
        for (int32_t k = 0; k < prog->n_ops && used < 0; k++) {
            const rt_op *op = &prog->ops[k];
            for (int32_t i = 0; i < op->n_inputs && used < 0; i++)
                if (m->tensors[op->inputs[i]].pool) used = op->inputs[i];
            for (int32_t i = 0; i < op->n_outputs && used < 0; i++)
                if (m->tensors[op->outputs[i]].pool) used = op->outputs[i];
            if (used < 0 && op->workspace >= 0 && m->tensors[op->workspace].pool) used = op->workspace;
        }
        if (used >= 0)
            rc = bad(err, NPUC_E_INVALID, "%s: program %s uses prefix pool tensor %s, which only the runtime's prefix "
                     "copies may", m->path, repr(r, prog->name), repr(q, m->tensors[used].name));
    }
    free(listed);
    if (rc) return rc;
    m->n_prefix = n;
    m->prefix_entries = (int32_t)entries;
    m->prefix_bytes = nbytes;
    return NPUC_OK;
}

int npuc_validate_model(npuc_model *m, uint64_t cap, npuc_error *err) {
    int rc = check_structure(m, err);
    if (rc) return rc;
    uint64_t arena = 0;
    for (int32_t i = 0; i < m->n_programs; i++)
        if (m->programs[i].plan.arena_bytes > arena) arena = m->programs[i].plan.arena_bytes;
    if ((rc = check_tensors(m, arena, err))) return rc;
    uint64_t state_end = 0;
    for (int32_t i = 0; i < m->n_tensors; i++) {
        const rt_tensor *t = &m->tensors[i];
        if (is_region(t, REGION_STATE) && t->offset + t->nbytes > state_end) state_end = t->offset + t->nbytes;
    }
    if (m->state_bytes != state_end)
        return bad(err, NPUC_E_INVALID, "%s: the model declares %llu state bytes; its state tensors end at byte %llu",
                   m->path, (unsigned long long)m->state_bytes, (unsigned long long)state_end);
    rt_u128 need = (rt_u128)arena + m->state_bytes;
    if (need > cap) {
        char a[48];
        return rt_fail(err, NPUC_E_INVALID, "set NPUC_MAX_MEMORY to allow more, if the file is trusted",
                       "%s: the model needs %s bytes of arena and state, more than the %llu this runtime allows",
                       m->path, rt_u128_str(a, need), (unsigned long long)cap);
    }
    if ((rc = check_prefix_pool(m, err))) return rc;

    /* Scratch for the per-program checks, sized for the largest program. */
    size_t nt = (size_t)m->n_tensors, most_io = 0, most_buf = 0;
    for (int32_t i = 0; i < m->n_programs; i++) {
        const rt_program *g = &m->programs[i];
        size_t io = (size_t)(g->n_inputs > g->n_outputs ? g->n_inputs : g->n_outputs);
        if (io > most_io) most_io = io;
        if ((size_t)g->plan.n_buffers > most_buf) most_buf = (size_t)g->plan.n_buffers;
        for (int32_t k = 0; k < g->n_ops; k++)
            if ((size_t)g->ops[k].n_attrs > most_io) most_io = (size_t)g->ops[k].n_attrs;
    }
    size_t nn = most_io > (size_t)m->n_programs ? most_io : (size_t)m->n_programs;
    scratch sc = {0};
    sc.names = malloc((nn ? nn : 1) * sizeof *sc.names);
    sc.buffer_of = malloc((nt ? nt : 1) * sizeof *sc.buffer_of);
    size_t nb = most_buf ? most_buf : 1;
    sc.order = malloc(nb * sizeof(int32_t));
    sc.heap = malloc(nb * sizeof(int32_t));
    sc.rank_of = malloc(nb * sizeof(int32_t));
    sc.by_offset = malloc(nb * sizeof(int32_t));
    sc.fenwick = malloc(nb * sizeof(int32_t));
    sc.events = malloc(nb * 2 * sizeof *sc.events);
    const char **sorted = malloc((size_t)(m->n_programs ? m->n_programs : 1) * sizeof *sorted);
    uint8_t *repeated = calloc((size_t)m->n_programs + 1, 1);
    if (!sc.names || !sc.buffer_of || !sc.order || !sc.heap || !sc.rank_of || !sc.by_offset || !sc.fenwick ||
        !sc.events || !sorted || !repeated) {
        rc = no_memory(err);
        goto done;
    }
    for (size_t i = 0; i < nt; i++) sc.buffer_of[i] = -1;

    /* Which programs repeat an earlier one's name: sorted by (name, index), all but the first of
     * a run. (The order of the checks stays Python's: program by program, below.) */
    {
        int32_t np = m->n_programs;
        int32_t *idx = (int32_t *)sc.order, *tmp = (int32_t *)sc.heap;
        int32_t *pidx = NULL, *ptmp = NULL;
        if ((size_t)np > nb) {
            pidx = malloc((size_t)np * sizeof *pidx);
            ptmp = malloc((size_t)np * sizeof *ptmp);
            if (pidx == NULL || ptmp == NULL) {
                free(pidx);
                free(ptmp);
                rc = no_memory(err);
                goto done;
            }
            idx = pidx, tmp = ptmp;
        }
        for (int32_t i = 0; i < np; i++) idx[i] = i;
        merge_sort(idx, tmp, np, by_program_name, m);
        for (int32_t i = 0; i < np; i++) sorted[i] = m->programs[idx[i]].name;
        for (int32_t i = 1; i < np; i++)
            if (strcmp(sorted[i - 1], sorted[i]) == 0) repeated[idx[i]] = 1;
        free(pidx);
        free(ptmp);
    }

    int64_t cache = position_rows(m);
    char r[REPR];
    for (int32_t i = 0; i < m->n_programs; i++) {
        const rt_program *g = &m->programs[i];
        if (g->name[0] == '\0' || repeated[i]) {
            rc = bad(err, NPUC_E_PARSE, "%s: program name %s is empty or repeated", m->path, repr(r, g->name));
            goto done;
        }
        if ((rc = check_writes(m, g, &sc, err)) || (rc = check_indices(m, g, cache, err)) ||
            (rc = check_plan(m, g, &sc, err)))
            goto done;
    }
    if ((rc = check_metadata(m, sorted, err)) || (rc = check_generation(m, err))) goto done;
    const rt_section *tok = npuc_om_section(m, "tokenizer");
    if (tok != NULL && (rc = check_tokenizer(m, m->data + tok->offset, (size_t)tok->size, err))) goto done;

    m->arena_bytes = arena;
    /* Both fit an int32 in any model a session can run; a larger one (an empty cache of 2^40
     * rows) saturates, and the session's own checks refuse it. */
    m->cache_rows = (int32_t)(cache < INT32_MAX ? cache : INT32_MAX);
    int64_t slots = 0;
    for (int32_t i = 0, any = 0; i < m->n_tensors; i++) {
        const rt_tensor *t = &m->tensors[i];
        if (is_region(t, REGION_STATE) && t->rank == 4 && !t->pool && (!any || t->shape[0] < slots)) {
            slots = t->shape[0];
            any = 1;
        }
    }
    m->slots = (int32_t)(slots < INT32_MAX ? slots : INT32_MAX);
done:
    free(sc.names);
    free(sc.buffer_of);
    free(sc.order);
    free(sc.heap);
    free(sc.rank_of);
    free(sc.by_offset);
    free(sc.fenwick);
    free(sc.events);
    free(sorted);
    free(repeated);
    return rc;
}
