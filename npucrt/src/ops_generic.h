/* The generic ops' private interface: what ops_generic.c shares with the family files it
 * gathers (ops_elementwise.c, ops_movement.c, ops_reduce.c). Nothing here is the executor's:
 * exec.c sees only rt_generic_binder() (exec.h).
 *
 * Every helper that checks (og_attr_*, og_check_*, og_norm_axis) writes its reason with
 * rt_fail, naming the op, and returns the binder's status, so that a binder reads
 *
 *     if ((rc = og_check_arity(b, st, 1, 1, 1))) return rc;
 */
#ifndef NPUCRT_OPS_GENERIC_H
#define NPUCRT_OPS_GENERIC_H

#include "exec.h"
#include "kernels.h"

/* One family's table: {op name, binder}, ended by {NULL, NULL}. */
typedef struct og_entry {
    const char *name;
    rt_bind_fn bind;
} og_entry;

rt_bind_fn og_lookup(const og_entry *table, const char *op);

rt_bind_fn rt_elementwise_binder(const char *op); /* ops_elementwise.c */
rt_bind_fn rt_movement_binder(const char *op);    /* ops_movement.c */
rt_bind_fn rt_reduce_binder(const char *op);      /* ops_reduce.c */

/* Refusals, naming the op: NPUC_E_INVALID (the operands break the op's rule: a damaged file)
 * and NPUC_E_NO_KERNEL (a combination this library does not run). */
int og_invalid(rt_binder *b, const rt_step *st, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;
int og_no_kernel(rt_binder *b, const rt_step *st, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;

/* Attributes as the schema declares them: an absent one takes `dflt` where the schema has a
 * default (has_dflt), else it is refused; one of the wrong kind is refused. */
int og_attr_int(rt_binder *b, const rt_step *st, const char *name, int has_dflt, int64_t dflt, int64_t *v);
int og_attr_num(rt_binder *b, const rt_step *st, const char *name, int has_dflt, double dflt, double *v);
int og_attr_str(rt_binder *b, const rt_step *st, const char *name, const char *dflt, const char **v);
int og_attr_ints(rt_binder *b, const rt_step *st, const char *name, const int64_t **v, int32_t *n);
int og_attr_dtype(rt_binder *b, const rt_step *st, const char *name, int *v);

/* Operand counts, and output k against the dtype and shape the op's rule gives. */
int og_check_arity(rt_binder *b, const rt_step *st, int min_in, int max_in, int n_out);
int og_check_out(rt_binder *b, const rt_step *st, int k, int dtype, int32_t rank, const int64_t *shape);
/* `axis` in [-max(rank,1), max(rank,1)) made non-negative, as ir/ops.py's norm_axis. */
int og_norm_axis(rt_binder *b, const rt_step *st, int64_t axis, int32_t rank, int32_t *out);
/* numpy broadcasting of n views' shapes into (rank, shape). */
int og_broadcast(rt_binder *b, const rt_step *st, const rt_view *const *v, int n, int32_t *rank, int64_t *shape);
/* A block of the session's pool for a prepared plan (counted in extra_bytes), or NULL with
 * the error written; never called dry. */
void *og_alloc(rt_binder *b, const rt_step *st, size_t n);
/* Ask for `floats` of the shared scratch (b->scratch_floats grows to the largest). */
void og_want_scratch(rt_binder *b, uint64_t floats);

static inline int og_is_float(int dt) {
    return dt == NPUC_F32 || dt == NPUC_BF16 || dt == NPUC_F16 || dt == NPUC_F64;
}
/* f32, bf16, f16: the dtypes computed in f32 and rounded once at the store. */
static inline int og_is_f32ish(int dt) { return dt == NPUC_F32 || dt == NPUC_BF16 || dt == NPUC_F16; }
static inline int og_is_int(int dt) { return dt >= NPUC_I64 && dt <= NPUC_U8; }
static inline int og_is_intish(int dt) { return og_is_int(dt) || dt == NPUC_BOOL; } /* computed in int64 */
static inline int64_t og_min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* Blocks of elements in and out of the compute types: n elements from element `off` of p,
 * `stride` elements apart (0: one element repeated). Loads take any dtype; stores convert
 * as torch does (rounding to nearest even, integers truncated to their width, bool != 0). */
void og_load_f32(const void *p, int dt, int64_t off, int64_t stride, int64_t n, float *dst);
void og_load_i64(const void *p, int dt, int64_t off, int64_t stride, int64_t n, int64_t *dst);
void og_store_f32(void *p, int dt, int64_t off, const float *src, int64_t n);
void og_store_i64(void *p, int dt, int64_t off, const int64_t *src, int64_t n);
/* float -> integer as torch's CPU casts: toward zero; NaN or out of range gives the minimum
 * of int64 (to i64) or of int32 (to the narrower ones, truncated to their width). */
int64_t og_f2i(double v, int dt);

/* Parallel-for over [0, total): fn(ctx, lo, hi, tid) on ranges of at least `grain`. */
typedef void (*og_range_fn)(const void *ctx, int64_t lo, int64_t hi, int tid);
void og_parallel(og_range_fn fn, const void *ctx, int64_t total, int64_t grain, int nt);

/* A strided copy into a contiguous output: out[i0..ir-1] = src[base + sum_d i_d * st[d]]
 * (element strides, es bytes each), coalesced and packed into st->i[]. Shared by transpose,
 * expand and slice; og_copy_run is the run function. */
void og_copy_plan(rt_step *st, int64_t es, int32_t rank, const int64_t *shape, const int64_t *strides,
                  int64_t base);
int og_copy_run(const rt_step *st, struct npuc_session *s);

#endif /* NPUCRT_OPS_GENERIC_H */
