/* Elementwise ops: unary math and activations, binary arithmetic with numpy broadcasting,
 * comparisons, where, swiglu (for what the executor's own f32 kernel does not take), and cast.
 *
 * One engine runs them all. An op is a row of `OPS`: the operand dtypes its shape rule takes
 * (ir/ops.py), whether it returns bool, and one function per compute type: `f` over f32 for
 * f32/bf16/f16 storage (torch's CPU kernels compute half types in f32 and round once, at the
 * store), `i` over int64 for the integers and bool (values truncated to their width at the
 * store: torch's wrap-around). A NULL function: that class of dtype is not run here
 * (NPUC_E_NO_KERNEL); f64 math is not run at all. The engine walks the output in rows of its
 * innermost (coalesced) dimension, loads blocks of each operand into the compute type (f32
 * operands with unit stride are read in place, an f32 output written in place), calls the
 * function and stores; large outputs are split over the thread pool.
 *
 * Where an op's reference kernel is several torch ops (selu, hard_sigmoid, thresholded_relu,
 * softsign, swiglu), each intermediate is rounded to the storage dtype (rd()) as torch rounds
 * it, and so is a Python scalar that is added or compared (torch casts it to the tensor's
 * dtype there; a product takes it in f32).
 */
#include <math.h>
#include <string.h>

#include "ops_generic.h"

#define BLK 512
#define GRAIN 16384

typedef struct ew_ctx {
    double a, b; /* the op's parameters (alpha, beta, ...) */
    int dt;      /* the operands' storage dtype */
} ew_ctx;

typedef void (*ew_ffn)(float *o, const float *const *x, int64_t n, const ew_ctx *c);
typedef void (*ew_ifn)(int64_t *o, const int64_t *const *x, int64_t n, const ew_ctx *c);

typedef struct ew_param {
    const char *name; /* NULL: none */
    int has_dflt;
    double dflt;
} ew_param;

typedef struct ew_op {
    const char *name;
    int arity;      /* 1, 2, or 3 (where) */
    unsigned rule;  /* operand dtypes the shape rule takes (bit per npuc_dtype) */
    int out_bool;
    ew_ffn f;
    ew_ifn i;
    ew_param pa, pb;
} ew_op;

#define BIT(d) (1u << (d))
#define R_FLOAT (BIT(NPUC_F32) | BIT(NPUC_BF16) | BIT(NPUC_F16) | BIT(NPUC_F64))
#define R_INT (BIT(NPUC_I64) | BIT(NPUC_I32) | BIT(NPUC_I16) | BIT(NPUC_I8) | BIT(NPUC_U8))
#define R_ALL (R_FLOAT | R_INT | BIT(NPUC_BOOL))
#define R_NUM (R_FLOAT | R_INT)
#define R_BITS (R_INT | BIT(NPUC_BOOL))

/* Round to the storage dtype: an intermediate that torch stores between two ops. */
static inline float rd(float v, int dt) {
    if (dt == NPUC_BF16) return npuc_bf16_to_f32(rt_f32_to_bf16(v));
    if (dt == NPUC_F16) return rt_f16_to_f32(rt_f32_to_f16(v));
    return v;
}

/* Integer arithmetic wraps (as torch's), without C's undefined overflow. */
static inline int64_t wrap_add(int64_t a, int64_t b) { return (int64_t)((uint64_t)a + (uint64_t)b); }
static inline int64_t wrap_sub(int64_t a, int64_t b) { return (int64_t)((uint64_t)a - (uint64_t)b); }
static inline int64_t wrap_mul(int64_t a, int64_t b) { return (int64_t)((uint64_t)a * (uint64_t)b); }

/* ---- functions --------------------------------------------------------------------------- */

#define F1(NAME, EXPR)                                                                                       \
    static void NAME(float *o, const float *const *xs, int64_t n, const ew_ctx *c) {                        \
        const float *x0 = xs[0];                                                                             \
        (void)c;                                                                                             \
        for (int64_t k = 0; k < n; k++) {                                                                    \
            float x = x0[k];                                                                                 \
            o[k] = (EXPR);                                                                                   \
        }                                                                                                    \
    }
#define F2(NAME, EXPR)                                                                                       \
    static void NAME(float *o, const float *const *xs, int64_t n, const ew_ctx *c) {                        \
        const float *x0 = xs[0], *x1 = xs[1];                                                                \
        (void)c;                                                                                             \
        for (int64_t k = 0; k < n; k++) {                                                                    \
            float a = x0[k], b = x1[k];                                                                      \
            o[k] = (EXPR);                                                                                   \
        }                                                                                                    \
    }
#define I1(NAME, EXPR)                                                                                       \
    static void NAME(int64_t *o, const int64_t *const *xs, int64_t n, const ew_ctx *c) {                    \
        const int64_t *x0 = xs[0];                                                                           \
        (void)c;                                                                                             \
        for (int64_t k = 0; k < n; k++) {                                                                    \
            int64_t x = x0[k];                                                                               \
            o[k] = (EXPR);                                                                                   \
        }                                                                                                    \
    }
#define I2(NAME, EXPR)                                                                                       \
    static void NAME(int64_t *o, const int64_t *const *xs, int64_t n, const ew_ctx *c) {                    \
        const int64_t *x0 = xs[0], *x1 = xs[1];                                                              \
        (void)c;                                                                                             \
        for (int64_t k = 0; k < n; k++) {                                                                    \
            int64_t a = x0[k], b = x1[k];                                                                    \
            o[k] = (EXPR);                                                                                   \
        }                                                                                                    \
    }

static inline float softplus1(float x) { return x > 20.0f ? x : log1pf(expf(x)); } /* F.softplus's threshold */

F1(f_neg, -x)
F1(f_abs, fabsf(x))
F1(f_relu, x < 0.0f ? 0.0f : x) /* keeps NaN, as clamp_min */
F1(f_sign, (float)((0.0f < x) - (x < 0.0f)))
F1(f_rsqrt, 1.0f / sqrtf(x))
F1(f_sqrt, sqrtf(x))
F1(f_exp, expf(x))
F1(f_log, logf(x))
F1(f_cos, cosf(x))
F1(f_sin, sinf(x))
F1(f_tan, tanf(x))
F1(f_tanh, tanhf(x))
F1(f_sinh, sinhf(x))
F1(f_cosh, coshf(x))
F1(f_asin, asinf(x))
F1(f_acos, acosf(x))
F1(f_atan, atanf(x))
F1(f_asinh, asinhf(x))
F1(f_acosh, acoshf(x))
F1(f_atanh, atanhf(x))
F1(f_sigmoid, 1.0f / (1.0f + expf(-x)))
F1(f_silu, x / (1.0f + expf(-x)))
F1(f_reciprocal, 1.0f / x)
F1(f_erf, erff(x))
F1(f_floor, floorf(x))
F1(f_ceil, ceilf(x))
F1(f_round, nearbyintf(x)) /* half to even in the default rounding mode */
F1(f_softplus, softplus1(x))
F1(f_softsign, x / rd(fabsf(x) + 1.0f, c->dt)) /* F.softsign: input / (input.abs() + 1) */
F1(f_mish, x * tanhf(log1pf(expf(x))))
F1(f_hardswish, x * fminf(fmaxf(x + 3.0f, 0.0f), 6.0f) / 6.0f)
F1(f_expm1, expm1f(x))
F1(f_log1p, log1pf(x))
F1(f_gelu, x * 0.5f * (1.0f + erff(x * 0.70710678118654752440f)))
F1(f_gelu_tanh, 0.5f * x * (1.0f + tanhf(0.7978845608028654f * (x + 0.044715f * x * x * x))))
F1(f_elu, x <= 0.0f ? expm1f(x) * (float)c->a : x)
F1(f_celu, x <= 0.0f ? expm1f(x * (float)(1.0 / c->a)) * (float)c->a : x)
F1(f_selu, (float)c->b * (x > 0.0f ? x : rd((float)c->a * rd(expm1f(x), c->dt), c->dt)))
F1(f_leaky_relu, x > 0.0f ? x : x * (float)c->a)
F1(f_hard_sigmoid, fminf(fmaxf(rd(rd(x * (float)c->a, c->dt) + rd((float)c->b, c->dt), c->dt), 0.0f), 1.0f))
F1(f_thresholded_relu, x > rd((float)c->a, c->dt) ? x : 0.0f)
F1(f_logical_not, x == 0.0f)
F1(f_is_nan, x != x)
F1(f_is_inf, (c->a != 0 && x == -INFINITY) || (c->b != 0 && x == INFINITY)) /* a: negative, b: positive */

I1(i_neg, wrap_sub(0, x))
I1(i_abs, x < 0 ? wrap_sub(0, x) : x)
I1(i_relu, x < 0 ? 0 : x)
I1(i_sign, (x > 0) - (x < 0))
I1(i_logical_not, x == 0)
I1(i_bitwise_not, c->dt == NPUC_BOOL ? !x : ~x)

/* torch's floor division and remainder of floats (div_floor_floating, remainder). */
static inline float floordiv_f(float a, float b) {
    if (b == 0.0f) return a / b;
    float mod = fmodf(a, b);
    float div = (a - mod) / b;
    if (mod != 0.0f && (b < 0.0f) != (mod < 0.0f)) div -= 1.0f;
    if (div == 0.0f) return copysignf(0.0f, a / b);
    float fl = floorf(div);
    if (div - fl > 0.5f) fl += 1.0f;
    return fl;
}
static inline float remainder_f(float a, float b) {
    float m = fmodf(a, b);
    if (m != 0.0f && (b < 0.0f) != (m < 0.0f)) m += b;
    return m;
}
/* Integers: a division by zero gives 0 (the reference's rule); INT64_MIN / -1 wraps. */
static inline int64_t floordiv_i(int64_t a, int64_t b) {
    if (b == 0) return 0;
    if (b == -1) return wrap_sub(0, a);
    int64_t q = a / b;
    if (a % b != 0 && ((a < 0) != (b < 0))) q--;
    return q;
}
static inline int64_t fmod_i(int64_t a, int64_t b) { return b == 0 || b == -1 ? 0 : a % b; }
static inline int64_t remainder_i(int64_t a, int64_t b) {
    int64_t m = fmod_i(a, b);
    if (m != 0 && ((m < 0) != (b < 0))) m += b;
    return m;
}
/* torch's powi: a negative exponent gives 0 except for a base of 1 or -1. */
static inline int64_t pow_i(int64_t a, int64_t b) {
    if (b < 0) return a == 1 ? 1 : a == -1 ? ((-(b % 2)) ? -1 : 1) : 0;
    int64_t r = 1;
    while (b) {
        if (b & 1) r = wrap_mul(r, a);
        b /= 2;
        a = wrap_mul(a, a);
    }
    return r;
}
static inline float max_f(float a, float b) { return a != a ? a : b != b ? b : a > b ? a : b; }
static inline float min_f(float a, float b) { return a != a ? a : b != b ? b : a < b ? a : b; }

F2(f_add, a + b)
F2(f_sub, a - b)
F2(f_mul, a * b)
F2(f_div, a / b)
F2(f_pow, powf(a, b))
F2(f_maximum, max_f(a, b))
F2(f_minimum, min_f(a, b))
F2(f_floor_div, floordiv_f(a, b))
F2(f_remainder, remainder_f(a, b))
F2(f_fmod, fmodf(a, b))
F2(f_eq, a == b)
F2(f_ne, a != b)
F2(f_lt, a < b)
F2(f_le, a <= b)
F2(f_gt, a > b)
F2(f_ge, a >= b)
F2(f_swiglu, rd(a / (1.0f + expf(-a)), c->dt) * b) /* F.silu(gate) * up: two torch ops */

I2(i_add, wrap_add(a, b))
I2(i_sub, wrap_sub(a, b))
I2(i_mul, wrap_mul(a, b))
I2(i_pow, pow_i(a, b))
I2(i_maximum, a > b ? a : b)
I2(i_minimum, a < b ? a : b)
I2(i_floor_div, floordiv_i(a, b))
I2(i_remainder, remainder_i(a, b))
I2(i_fmod, fmod_i(a, b))
I2(i_and, a & b)
I2(i_or, a | b)
I2(i_xor, a ^ b)
I2(i_eq, a == b)
I2(i_ne, a != b)
I2(i_lt, a < b)
I2(i_le, a <= b)
I2(i_gt, a > b)
I2(i_ge, a >= b)

static void f_where(float *o, const float *const *xs, int64_t n, const ew_ctx *c) {
    (void)c;
    for (int64_t k = 0; k < n; k++) o[k] = xs[0][k] != 0.0f ? xs[1][k] : xs[2][k];
}
static void i_where(int64_t *o, const int64_t *const *xs, int64_t n, const ew_ctx *c) {
    (void)c;
    for (int64_t k = 0; k < n; k++) o[k] = xs[0][k] ? xs[1][k] : xs[2][k];
}

/* ---- the table --------------------------------------------------------------------------- */

#define NOP {NULL, 0, 0}
#define U(name, rule, f, i) {name, 1, rule, 0, f, i, NOP, NOP}
#define B(name, rule, f, i) {name, 2, rule, 0, f, i, NOP, NOP}
#define C(name, f, i) {name, 2, R_ALL, 1, f, i, NOP, NOP}

static const ew_op OPS[] = {
    U("neg", R_NUM, f_neg, i_neg), U("abs", R_NUM, f_abs, i_abs), U("relu", R_NUM, f_relu, i_relu),
    U("sign", R_NUM, f_sign, i_sign),
    U("rsqrt", R_FLOAT, f_rsqrt, NULL), U("sqrt", R_FLOAT, f_sqrt, NULL), U("exp", R_FLOAT, f_exp, NULL),
    U("log", R_FLOAT, f_log, NULL), U("cos", R_FLOAT, f_cos, NULL), U("sin", R_FLOAT, f_sin, NULL),
    U("tan", R_FLOAT, f_tan, NULL), U("tanh", R_FLOAT, f_tanh, NULL), U("sinh", R_FLOAT, f_sinh, NULL),
    U("cosh", R_FLOAT, f_cosh, NULL), U("asin", R_FLOAT, f_asin, NULL), U("acos", R_FLOAT, f_acos, NULL),
    U("atan", R_FLOAT, f_atan, NULL), U("asinh", R_FLOAT, f_asinh, NULL), U("acosh", R_FLOAT, f_acosh, NULL),
    U("atanh", R_FLOAT, f_atanh, NULL), U("sigmoid", R_FLOAT, f_sigmoid, NULL), U("silu", R_FLOAT, f_silu, NULL),
    U("reciprocal", R_FLOAT, f_reciprocal, NULL), U("erf", R_FLOAT, f_erf, NULL),
    U("floor", R_FLOAT, f_floor, NULL), U("ceil", R_FLOAT, f_ceil, NULL), U("round", R_FLOAT, f_round, NULL),
    U("softplus", R_FLOAT, f_softplus, NULL), U("softsign", R_FLOAT, f_softsign, NULL),
    U("mish", R_FLOAT, f_mish, NULL), U("hardswish", R_FLOAT, f_hardswish, NULL),
    U("expm1", R_FLOAT, f_expm1, NULL), U("log1p", R_FLOAT, f_log1p, NULL),
    U("gelu", R_FLOAT, f_gelu, NULL), /* approximate="tanh": gelu_tanh (bind_unary) */
    U("@gelu_tanh", R_FLOAT, f_gelu_tanh, NULL),
    {"elu", 1, R_FLOAT, 0, f_elu, NULL, {"alpha", 1, 1.0}, NOP},
    {"celu", 1, R_FLOAT, 0, f_celu, NULL, {"alpha", 1, 1.0}, NOP},
    {"selu", 1, R_FLOAT, 0, f_selu, NULL, {"alpha", 0, 0}, {"gamma", 0, 0}},
    {"leaky_relu", 1, R_FLOAT, 0, f_leaky_relu, NULL, {"alpha", 1, 0.01}, NOP},
    {"hard_sigmoid", 1, R_FLOAT, 0, f_hard_sigmoid, NULL, {"alpha", 1, 0.2}, {"beta", 1, 0.5}},
    {"thresholded_relu", 1, R_FLOAT, 0, f_thresholded_relu, NULL, {"alpha", 1, 1.0}, NOP},
    {"logical_not", 1, R_ALL, 1, f_logical_not, i_logical_not, NOP, NOP},
    {"is_nan", 1, R_FLOAT, 1, f_is_nan, NULL, NOP, NOP},
    {"is_inf", 1, R_FLOAT, 1, f_is_inf, NULL, {"detect_negative", 1, 1}, {"detect_positive", 1, 1}},
    U("bitwise_not", R_BITS, NULL, i_bitwise_not),

    B("add", R_ALL, f_add, i_add), B("sub", R_NUM, f_sub, i_sub), B("mul", R_ALL, f_mul, i_mul),
    B("div", R_FLOAT, f_div, NULL), B("pow", R_NUM, f_pow, i_pow),
    B("maximum", R_ALL, f_maximum, i_maximum), B("minimum", R_ALL, f_minimum, i_minimum),
    B("bitwise_and", R_BITS, NULL, i_and), B("bitwise_or", R_BITS, NULL, i_or),
    B("bitwise_xor", R_BITS, NULL, i_xor),
    B("floor_div", R_NUM, f_floor_div, i_floor_div),
    B("mod", R_NUM, f_remainder, i_remainder), /* fmod=true: @fmod (bind_binary) */
    B("@fmod", R_NUM, f_fmod, i_fmod),
    B("swiglu", R_FLOAT, f_swiglu, NULL),
    C("eq", f_eq, i_eq), C("ne", f_ne, i_ne), C("lt", f_lt, i_lt), C("le", f_le, i_le), C("gt", f_gt, i_gt),
    C("ge", f_ge, i_ge),
    {"where", 3, R_ALL, 0, f_where, i_where, NOP, NOP},
    {NULL, 0, 0, 0, NULL, NULL, NOP, NOP},
};

static const ew_op *find_op(const char *name) {
    for (const ew_op *e = OPS; e->name; e++)
        if (strcmp(e->name, name) == 0) return e;
    return NULL;
}

/* ---- the engine -------------------------------------------------------------------------- */

typedef struct ew_plan {
    const ew_op *op;
    ew_ctx c;
    int nin, f32dom, out_dt;
    int in_dt[3];
    int32_t r;               /* coalesced rank, >= 1 */
    int64_t shape[NPUC_MAX_RANK];
    int64_t st[3][NPUC_MAX_RANK]; /* element strides of each operand (0: broadcast) */
    int64_t total;
} ew_plan;

typedef struct {
    const ew_plan *p;
    const void *in[3];
    void *out;
} ew_job;

/* Elements [pos, pos + n) of the output, operand k's first at offset off[k], stride s[k]. */
static void ew_span(const ew_job *j, int64_t pos, int64_t n, const int64_t *off) {
    const ew_plan *p = j->p;
    int32_t r = p->r;
    if (p->f32dom) {
        float buf[3][BLK], obuf[BLK];
        const float *xs[3];
        for (int64_t b0 = 0; b0 < n; b0 += BLK) {
            int64_t m = og_min64(BLK, n - b0);
            for (int k = 0; k < p->nin; k++) {
                int64_t s = p->st[k][r - 1], o = off[k] + b0 * s;
                if (p->in_dt[k] == NPUC_F32 && s == 1) {
                    xs[k] = (const float *)j->in[k] + o;
                } else {
                    og_load_f32(j->in[k], p->in_dt[k], o, s, m, buf[k]);
                    xs[k] = buf[k];
                }
            }
            float *out = p->out_dt == NPUC_F32 ? (float *)j->out + pos + b0 : obuf;
            p->op->f(out, xs, m, &p->c);
            if (out == obuf) og_store_f32(j->out, p->out_dt, pos + b0, obuf, m);
        }
    } else {
        int64_t buf[3][BLK], obuf[BLK];
        const int64_t *xs[3];
        for (int64_t b0 = 0; b0 < n; b0 += BLK) {
            int64_t m = og_min64(BLK, n - b0);
            for (int k = 0; k < p->nin; k++) {
                int64_t s = p->st[k][r - 1], o = off[k] + b0 * s;
                if (p->in_dt[k] == NPUC_I64 && s == 1) {
                    xs[k] = (const int64_t *)j->in[k] + o;
                } else {
                    og_load_i64(j->in[k], p->in_dt[k], o, s, m, buf[k]);
                    xs[k] = buf[k];
                }
            }
            int64_t *out = p->out_dt == NPUC_I64 ? (int64_t *)j->out + pos + b0 : obuf;
            p->op->i(out, xs, m, &p->c);
            if (out == obuf) og_store_i64(j->out, p->out_dt, pos + b0, obuf, m);
        }
    }
}

static void ew_range(const void *pj, int64_t lo, int64_t hi, int tid) {
    (void)tid;
    const ew_job *j = pj;
    const ew_plan *p = j->p;
    int32_t r = p->r;
    int64_t inner = p->shape[r - 1], idx[NPUC_MAX_RANK] = {0}, row[3] = {0, 0, 0}, off[3];
    int64_t rem = lo / inner, col = lo % inner;
    for (int32_t d = r - 2; d >= 0; d--) {
        idx[d] = rem % p->shape[d];
        rem /= p->shape[d];
        for (int k = 0; k < p->nin; k++) row[k] += idx[d] * p->st[k][d];
    }
    for (int64_t pos = lo; pos < hi;) {
        int64_t n = og_min64(inner - col, hi - pos);
        for (int k = 0; k < p->nin; k++) off[k] = row[k] + col * p->st[k][r - 1];
        ew_span(j, pos, n, off);
        pos += n;
        col = 0;
        for (int32_t d = r - 2; d >= 0; d--) {
            for (int k = 0; k < p->nin; k++) row[k] += p->st[k][d];
            if (++idx[d] < p->shape[d]) break;
            for (int k = 0; k < p->nin; k++) row[k] -= idx[d] * p->st[k][d];
            idx[d] = 0;
        }
    }
}

static int ew_run(const rt_step *st, struct npuc_session *s) {
    const ew_plan *p = st->p[0];
    ew_job j = {p, {NULL, NULL, NULL}, st->out[0].data};
    for (int k = 0; k < p->nin; k++) j.in[k] = st->in[k].data;
    og_parallel(ew_range, &j, p->total, GRAIN, rt_session_threads(s));
    return 0;
}

/* The plan: each operand's strides against the output's shape, size-1 dims dropped and
 * dims that every operand walks contiguously merged. */
static void ew_plan_shape(ew_plan *p, const rt_step *st, int32_t rank, const int64_t *shape) {
    int64_t sd[3][NPUC_MAX_RANK];
    for (int k = 0; k < p->nin; k++) {
        const rt_view *v = &st->in[k];
        int64_t acc = 1;
        for (int32_t d = rank - 1; d >= 0; d--) {
            int32_t jd = d - (rank - v->rank);
            if (jd < 0 || v->shape[jd] == 1) {
                sd[k][d] = 0;
            } else {
                sd[k][d] = acc;
                acc *= v->shape[jd];
            }
        }
    }
    int32_t r = 0;
    p->total = 1;
    for (int32_t d = 0; d < rank; d++) {
        p->total *= shape[d];
        if (shape[d] == 1) continue;
        int merge = r > 0;
        for (int k = 0; merge && k < p->nin; k++) merge = p->st[k][r - 1] == sd[k][d] * shape[d];
        if (merge) {
            p->shape[r - 1] *= shape[d];
            for (int k = 0; k < p->nin; k++) p->st[k][r - 1] = sd[k][d];
            continue;
        }
        p->shape[r] = shape[d];
        for (int k = 0; k < p->nin; k++) p->st[k][r] = sd[k][d];
        r++;
    }
    if (r == 0) {
        p->shape[0] = 1;
        for (int k = 0; k < p->nin; k++) p->st[k][0] = 0;
        r = 1;
    }
    p->r = r;
}

static int bind_op(rt_binder *b, rt_step *st, const ew_op *op) {
    int rc;
    if ((rc = og_check_arity(b, st, op->arity, op->arity, 1))) return rc;
    int first = op->arity == 3 ? 1 : 0; /* where's condition is not a data operand */
    int dt = st->in[first].dtype;
    for (int k = first + 1; k < op->arity; k++)
        if (st->in[k].dtype != dt)
            return og_invalid(b, st, "operands have different dtypes %s and %s", npuc_dtype_name(dt),
                              npuc_dtype_name(st->in[k].dtype));
    if (first && st->in[0].dtype != NPUC_BOOL) return og_invalid(b, st, "where's condition must be bool");
    if (dt < 0 || dt > NPUC_BOOL || !(op->rule & BIT(dt)))
        return og_invalid(b, st, "does not take %s operands", npuc_dtype_name(dt));
    int f32dom = og_is_f32ish(dt);
    if (f32dom ? !op->f : (!og_is_intish(dt) || !op->i))
        return og_no_kernel(b, st, "no kernel for %s operands", npuc_dtype_name(dt));
    if (strcmp(op->name, "swiglu") == 0) {
        int same = st->in[0].rank == st->in[1].rank;
        for (int32_t d = 0; same && d < st->in[0].rank; d++) same = st->in[0].shape[d] == st->in[1].shape[d];
        if (!same) return og_invalid(b, st, "swiglu operands differ in shape");
    }
    const rt_view *vs[3] = {&st->in[0], &st->in[1], &st->in[2]};
    int32_t rank;
    int64_t shape[NPUC_MAX_RANK];
    if ((rc = og_broadcast(b, st, vs, op->arity, &rank, shape))) return rc;
    if ((rc = og_check_out(b, st, 0, op->out_bool ? NPUC_BOOL : dt, rank, shape))) return rc;
    ew_ctx c = {0, 0, dt};
    if (op->pa.name && (rc = og_attr_num(b, st, op->pa.name, op->pa.has_dflt, op->pa.dflt, &c.a))) return rc;
    if (op->pb.name && (rc = og_attr_num(b, st, op->pb.name, op->pb.has_dflt, op->pb.dflt, &c.b))) return rc;
    if (b->dry) return 0;
    ew_plan *p = og_alloc(b, st, sizeof *p);
    if (!p) return NPUC_E_ARG;
    p->op = op;
    p->c = c;
    p->nin = op->arity;
    p->f32dom = f32dom;
    p->out_dt = st->out[0].dtype;
    for (int k = 0; k < op->arity; k++) p->in_dt[k] = st->in[k].dtype;
    ew_plan_shape(p, st, rank, shape);
    st->p[0] = p;
    st->run = ew_run;
    return 0;
}

static int bind_generic(rt_binder *b, rt_step *st) {
    const ew_op *op = find_op(st->op->op);
    int rc;
    if (strcmp(st->op->op, "gelu") == 0) {
        const char *approx;
        if ((rc = og_attr_str(b, st, "approximate", "none", &approx))) return rc;
        if (strcmp(approx, "tanh") == 0) op = find_op("@gelu_tanh");
        else if (strcmp(approx, "none") != 0) return og_invalid(b, st, "unknown gelu approximation '%s'", approx);
    } else if (strcmp(st->op->op, "mod") == 0) {
        int64_t fm;
        if ((rc = og_attr_int(b, st, "fmod", 1, 0, &fm))) return rc;
        if (fm) op = find_op("@fmod");
    }
    return bind_op(b, st, op);
}

/* ---- cast -------------------------------------------------------------------------------- */

typedef struct {
    const void *src;
    void *dst;
    int sdt, ddt;
} cast_job;

static void cast_range(const void *pj, int64_t lo, int64_t hi, int tid) {
    (void)tid;
    const cast_job *j = pj;
    for (int64_t b0 = lo; b0 < hi; b0 += BLK) {
        int64_t m = og_min64(BLK, hi - b0);
        if (og_is_f32ish(j->sdt) && og_is_f32ish(j->ddt)) { /* exact in f32, rounded once */
            float f[BLK];
            og_load_f32(j->src, j->sdt, b0, 1, m, f);
            og_store_f32(j->dst, j->ddt, b0, f, m);
            continue;
        }
        if (og_is_intish(j->sdt)) { /* integers and bool: exact in int64 */
            int64_t v[BLK];
            og_load_i64(j->src, j->sdt, b0, 1, m, v);
            og_store_i64(j->dst, j->ddt, b0, v, m);
            continue;
        }
        double v[BLK]; /* every float dtype widens exactly to double */
        if (j->sdt == NPUC_F64) {
            memcpy(v, (const double *)j->src + b0, (size_t)m * sizeof(double));
        } else {
            float f[BLK];
            og_load_f32(j->src, j->sdt, b0, 1, m, f);
            for (int64_t k = 0; k < m; k++) v[k] = f[k];
        }
        switch (j->ddt) {
        case NPUC_F64: memcpy((double *)j->dst + b0, v, (size_t)m * sizeof(double)); break;
        case NPUC_I64: case NPUC_I32: case NPUC_I16: case NPUC_I8: case NPUC_U8: {
            int64_t w[BLK];
            for (int64_t k = 0; k < m; k++) w[k] = og_f2i(v[k], j->ddt);
            og_store_i64(j->dst, j->ddt, b0, w, m);
            break;
        }
        default: { /* f32, bf16, f16 (through f32, as c10's conversions), bool (!= 0) */
            float f[BLK];
            for (int64_t k = 0; k < m; k++) f[k] = j->ddt == NPUC_BOOL ? (float)(v[k] != 0.0) : (float)v[k];
            og_store_f32(j->dst, j->ddt, b0, f, m);
        }
        }
    }
}

static int cast_run(const rt_step *st, struct npuc_session *s) {
    cast_job j = {st->in[0].data, st->out[0].data, st->in[0].dtype, st->out[0].dtype};
    if (j.sdt == j.ddt) {
        if (st->out[0].data != st->in[0].data) memcpy(st->out[0].data, st->in[0].data, st->out[0].nbytes);
        return 0;
    }
    og_parallel(cast_range, &j, st->out[0].numel, GRAIN, rt_session_threads(s));
    return 0;
}

static int bind_cast(rt_binder *b, rt_step *st) {
    int rc, dt;
    if ((rc = og_check_arity(b, st, 1, 1, 1))) return rc;
    if ((rc = og_attr_dtype(b, st, "dtype", &dt))) return rc;
    if ((rc = og_check_out(b, st, 0, dt, st->in[0].rank, st->in[0].shape))) return rc;
    if (npuc_dtype_size(st->in[0].dtype) == 0) return og_no_kernel(b, st, "no kernel for its operand's dtype");
    if (!b->dry) st->run = cast_run;
    return 0;
}

static const og_entry TABLE[] = {
    {"cast", bind_cast},
    {NULL, NULL},
};

rt_bind_fn rt_elementwise_binder(const char *op) {
    rt_bind_fn f = og_lookup(TABLE, op);
    if (f) return f;
    if (op[0] == '@') return NULL; /* internal variants are not ops */
    return find_op(op) ? bind_generic : NULL;
}
