/* The loaded model: the `.om`'s sections decoded into plain structs (om.c), then checked
 * (validate.c) before the executor (exec.c) sees any of it.
 *
 * Every string is a NUL-terminated copy in the model's pool; every array is the pool's too.
 * Indices into tensors[] are checked by validate.c's structure check before anything else
 * dereferences them: code that runs after npuc_validate_model() may index freely.
 */
#ifndef NPUCRT_MODEL_H
#define NPUCRT_MODEL_H

#include <stddef.h>
#include <stdint.h>

#include "npucrt.h"

enum { REGION_ARENA = 0, REGION_WEIGHTS = 1, REGION_STATE = 2 };

typedef enum {
    ATTR_UNSET = 0, /* `none`, or a value with no field set */
    ATTR_I, ATTR_F, ATTR_S, ATTR_B, ATTR_DTYPE, ATTR_INTS, ATTR_FLOATS
} rt_attr_kind;

typedef struct rt_attr {
    const char *name;
    rt_attr_kind kind;
    int64_t i;        /* ATTR_I, ATTR_B (0/1), ATTR_DTYPE (npuc_dtype) */
    double f;         /* ATTR_F */
    const char *s;    /* ATTR_S */
    int64_t *ints;    /* ATTR_INTS */
    double *floats;   /* ATTR_FLOATS */
    int32_t n;        /* ATTR_INTS / ATTR_FLOATS length */
} rt_attr;

typedef struct rt_tensor {
    const char *name;
    const char *dtype_name; /* as stored */
    int dtype;              /* npuc_dtype, -1 if unknown (validate refuses) */
    int32_t rank;           /* validate refuses rank > NPUC_MAX_RANK; shape holds min(rank, MAX) */
    int64_t shape[NPUC_MAX_RANK];
    const char *region_name;
    int region;             /* REGION_*, -1 if unknown (validate refuses) */
    uint64_t offset;
    uint64_t nbytes;
    int32_t base;           /* -1: none */
    int32_t pool;           /* 1: a prefix pool tensor (validate.c), no cache of the slots */
} rt_tensor;

typedef struct rt_op {
    const char *op;
    const char *name;
    int32_t *inputs;
    int32_t n_inputs;
    int32_t *outputs;
    int32_t n_outputs;
    rt_attr *attrs;
    int32_t n_attrs;
    int32_t workspace;      /* -1: none */
    const char *unit;       /* from the tasks section */
    uint64_t flops, bytes;
} rt_op;

typedef struct rt_buffer {
    int32_t tensor;
    int32_t first_step;
    int32_t last_step;
} rt_buffer;

typedef struct rt_plan {
    uint64_t alignment;
    uint64_t arena_bytes;
    uint64_t lower_bound_bytes;
    rt_buffer *buffers;
    int32_t n_buffers;
} rt_plan;

typedef struct rt_program {
    const char *name;
    int32_t *inputs;
    int32_t n_inputs;
    int32_t *outputs;
    int32_t n_outputs;
    rt_op *ops;
    int32_t n_ops;
    rt_plan plan;
} rt_program;

typedef struct rt_meta {
    const char *key;
    const char *value;
} rt_meta;

/* One state of the prefix pool (metadata prefix_pool, validate.c): its pool tensor holds
 * [entries, ...] of its per-slot layout, positions on `axis`. */
typedef struct rt_prefix {
    int32_t state, pool, axis;
} rt_prefix;

typedef struct rt_section {
    char name[17];
    uint64_t offset;
    uint64_t size;
    uint8_t sha256[32];
} rt_section;

/* A bump allocator: every block the model (or a session) allocates, freed together. */
typedef struct rt_pool {
    struct rt_pool_block *head;
    uint64_t bytes;
} rt_pool;

void *pool_alloc(rt_pool *p, size_t n); /* zeroed; NULL when out of memory */
char *pool_strndup(rt_pool *p, const char *s, size_t n);
void pool_free(rt_pool *p);

#define RT_MAX_SECTIONS 64

/* A recurrent state and its copies by verify row (`<state>.by_row`), tensor indices. */
typedef struct {
    int32_t state, by_row;
} rt_rollback_pair;

struct npuc_model {
    const uint8_t *data; /* the whole file */
    size_t size;
    void *mapping;       /* non-NULL: munmap(mapping, size) on free */
    char path[512];      /* for messages: the path, or "<buffer>" */

    rt_section sections[RT_MAX_SECTIONS];
    int32_t n_sections;

    rt_tensor *tensors;
    int32_t n_tensors;
    rt_program *programs;
    int32_t n_programs;
    uint64_t weights_bytes; /* as the model definition declares it */
    uint64_t state_bytes;
    rt_meta *meta;
    int32_t n_meta;
    const char *producer, *producer_version, *target;

    const uint8_t *weights; /* the weights section's payload */
    uint64_t weights_len;

    /* Derived by validate.c */
    uint64_t arena_bytes;   /* the largest program's */
    int32_t cache_rows;     /* positions a `position` input may name (position_rows); 0: no cache */
    int32_t slots;          /* batch of the 4-D state tensors (0: none) */
    rt_prefix *prefix;      /* the prefix pool's states (--prefix_cache), n_prefix of them */
    int32_t n_prefix;
    int32_t prefix_entries; /* 0: no pool */
    uint64_t prefix_bytes;  /* the pool tensors' bytes */

    /* Derived by exec.c at load (the kernel check) and for generation */
    npuc_generation_info gen;
    int has_gen;
    int64_t *eos;
    rt_rollback_pair *rollback; /* decode.c: the recurrent states kept by verify row, n_rollback */
    int32_t n_rollback;
    int64_t rollback_rows;      /* K: the rows each keeps (a verify step's but its last) */
    int32_t rollback_bad;       /* -1, or a `.by_row` state that is no such copy (rollback refused) */
    int64_t rollback_bad_rows;  /* its rows where they differ from another's K; 0: malformed */

    rt_pool pool;
};

/* The first index of the largest value (a NaN counts as the largest, as torch.argmax). */
int64_t rt_argmax(const float *x, int64_t n);

/* Fill `err` (may be NULL) and return `code`. printf-style message. */
int rt_fail(npuc_error *err, int code, const char *hint, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 4, 5)))
#endif
    ;

/* The hint every damaged-file error carries (runtime/om_validate.py's _HINT). */
#define HINT_DAMAGED "the file is damaged or was edited after compiling; recompile the model with `npuc compile`"
#define HINT_RECOMPILE "recompile the model with `npuc compile`"

int npuc_dtype_from_name(const char *name);      /* -1 if unknown */
const char *npuc_dtype_name(int dtype);          /* "?" if unknown */
int npuc_dtype_size(int dtype);                  /* 0 if unknown */

const rt_attr *rt_find_attr(const rt_op *op, const char *name);

/* om.c: container, checksums, protobuf decode of modeldef/plan/tasks/metadata.
 * `m->data/size/path` are set by the caller; fills the rest. */
int npuc_om_parse(npuc_model *m, int verify_checksums, npuc_error *err);
const rt_section *npuc_om_section(const npuc_model *m, const char *name);

/* validate.c: everything runtime/om_validate.py checks, except the per-op shape rules,
 * which exec.c's kernel binding checks for the ops it runs (and refuses the rest).
 * `cap`: bytes of arena + state allowed. */
int npuc_validate_model(npuc_model *m, uint64_t cap, npuc_error *err);
uint64_t npuc_memory_cap(void);

/* sha256.c */
void npuc_sha256(const void *data, size_t n, uint8_t out[32]);

#endif /* NPUCRT_MODEL_H */
