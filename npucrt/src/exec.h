/* The executor's internal interface: how an op becomes a step.
 *
 * Each op the library runs has one binder (ops table in exec.c). A binder is the op's shape
 * rule and kernel choice in one: it checks the operands' dtypes and shapes and the attributes
 * exactly as the registry's shape rule would (so a file that lies about a shape is refused,
 * never trusted by a kernel that writes by pointer), then fills the step's run function and
 * its prepared arguments. Binders run twice:
 *   - at model load, "dry" (b->dry = 1, every view's data NULL): the check that the library
 *     has a kernel for every op of every program; nothing may be allocated or read;
 *   - at session creation, with real pointers: per-step preparation (weights packed for the
 *     GEMM, tables widened) happens here, once. A run then only calls steps.
 *
 * A binder returns 0; NPUC_E_NO_KERNEL (an op or operand combination this library does not
 * run: the model is refused at load, naming it, and the Python side falls back to its torch
 * interpreter); or NPUC_E_INVALID (the operands do not fit the op's rule: a damaged file).
 * It writes its reason with rt_fail(b->err, ...).
 */
#ifndef NPUCRT_EXEC_H
#define NPUCRT_EXEC_H

#include "model.h"
#include "simd.h"

#define RT_MAX_OPERANDS 16

/* A planned tensor: contiguous, row-major, static shape. */
typedef struct rt_view {
    void *data;          /* NULL while binding dry */
    int dtype;           /* npuc_dtype */
    int32_t rank;
    int64_t shape[NPUC_MAX_RANK];
    int64_t numel;
    uint64_t nbytes;
    int region;          /* REGION_* */
    int32_t tensor;      /* index in the model */
} rt_view;

struct rt_step;
struct npuc_session;
typedef int (*rt_run_fn)(const struct rt_step *st, struct npuc_session *s);

typedef struct rt_step {
    rt_run_fn run;       /* NULL: nothing to do (a view whose bytes are its operand's) */
    const rt_op *op;
    int32_t n_in, n_out;
    rt_view in[RT_MAX_OPERANDS];
    rt_view out[4];
    rt_view ws;          /* the op's planned workspace, if any (ws.data NULL otherwise) */
    int32_t out_is_in0;  /* out[0] lies on in[0]'s very bytes (same region and offset): a view
                            or an in-place op, whose run may then have nothing to move */
    int64_t i[24];       /* prepared integer arguments */
    double f[8];         /* prepared float arguments */
    void *p[8];          /* prepared pointers (packed weights, tables: the session's pool) */
} rt_step;

typedef struct rt_binder {
    int dry;
    int threads;
    int prepack;
    const npuc_model *model;
    const rt_program *program;
    rt_pool *pool;       /* the session's: per-step allocations (NULL when dry) */
    uint64_t extra_bytes;/* what binders allocated */
    uint64_t scratch_floats; /* the largest scratch any step asked for (shared: steps run one at a time) */
    npuc_error *err;
} rt_binder;

typedef int (*rt_bind_fn)(rt_binder *b, rt_step *st);

/* Attribute helpers: the value or the default when absent. */
int64_t rt_attr_i(const rt_op *op, const char *name, int64_t dflt);
double rt_attr_f(const rt_op *op, const char *name, double dflt);
const char *rt_attr_s(const rt_op *op, const char *name, const char *dflt);
const rt_attr *rt_attr_ints(const rt_op *op, const char *name); /* NULL if absent or not ints */

/* The scratch every step shares (floats, grown by binders through scratch_floats). */
float *rt_session_scratch(struct npuc_session *s);
int rt_session_threads(const struct npuc_session *s);

/* Binder registry lookup (exec.c's table). NULL: the op has no kernel here. */
rt_bind_fn rt_find_binder(const char *op);

/* Binders by family, each file's own table; exec.c asks them in this order. NULL: not there.
 *   ops_generic.c   elementwise, reductions, softmax, norms, data movement, matmul
 *   ops_deepseek.c  mla_attention, fused_moe, qmoe
 *   ops_attention.c the attention variants exec.c's binders refuse (masks, sliding windows,
 *                   soft-capping, sinks, ALiBi), sdpa, convolutions, einsum */
rt_bind_fn rt_generic_binder(const char *op);
rt_bind_fn rt_deepseek_binder(const char *op);
rt_bind_fn rt_attention_binder(const char *op);

/* Shared element conversions. */
static inline uint16_t rt_f32_to_bf16(float f) { /* round to nearest even; NaN stays NaN */
    union { uint32_t u; float f; } v = {.f = f};
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40);
    v.u += 0x7fffu + ((v.u >> 16) & 1u);
    return (uint16_t)(v.u >> 16);
}
float rt_f16_to_f32(uint16_t h);
uint16_t rt_f32_to_f16(float f);  /* round to nearest even, as torch */
/* Element i of a float-typed view as f32 (f32, bf16, f16, f64), and the store back. */
float rt_load_f(const void *p, int dtype, int64_t i);
void rt_store_f(void *p, int dtype, int64_t i, float v);

/* exec.c: bind every op of every program dry (the load-time kernel check); also fills the
 * model's generation info (decode.c's rt_generation_setup). */
int npuc_exec_check(npuc_model *m, npuc_error *err);

/* exec.c, for decode.c */
int rt_session_set_input(struct npuc_session *s, int32_t program, int32_t i, const void *data, uint64_t bytes,
                         npuc_error *err);          /* check input i and copy it into the arena */
int rt_session_execute(struct npuc_session *s, int32_t program, npuc_error *err); /* the steps */
const npuc_model *rt_session_model(const struct npuc_session *s);
int64_t *rt_session_slot_track(struct npuc_session *s); /* [slots][2]: last token, position; -1 none */
uint8_t *rt_session_state(struct npuc_session *s);     /* the state region (KV caches) */

/* decode.c: m->gen, m->has_gen and m->eos from the programs and metadata (0 when the model
 * does not generate: has_gen stays 0). */
int rt_generation_setup(npuc_model *m, npuc_error *err);

#endif /* NPUCRT_EXEC_H */
