/* The op registry's schemas (ir/registry.py's OpDef: operands and attributes), as a static table
 * generated into op_schema.c by npucrt/gen_op_schema.py, for validate.c's per-op checks. */
#ifndef NPUCRT_OP_SCHEMA_H
#define NPUCRT_OP_SCHEMA_H

#include <stdint.h>

/* Attr.kind */
typedef enum {
    RT_AK_INT, RT_AK_FLOAT, RT_AK_STR, RT_AK_BOOL, RT_AK_DTYPE, RT_AK_INTS, RT_AK_FLOATS
} rt_attr_spec_kind;

typedef struct rt_attr_spec {
    const char *name;
    rt_attr_spec_kind kind;
    int required; /* no default: the op must have it */
    int optional; /* None (an unset value) is accepted */
} rt_attr_spec;

typedef struct rt_op_schema {
    const char *name;
    const char *const *inputs; /* OpDef.inputs: `x?` optional, `*xs` variadic (last) */
    int32_t n_inputs;
    const rt_attr_spec *attrs; /* in the registry's order */
    int32_t n_attrs;
} rt_op_schema;

/* The op named `name`; NULL when the registry has none. */
const rt_op_schema *rt_op_schema_find(const char *name);
/* OpDef.arity_ok: whether the op takes `n` operands. */
int rt_op_schema_arity_ok(const rt_op_schema *s, int32_t n);
/* Attr.kind as the registry spells it ("int", "floats", ...). */
const char *rt_attr_kind_name(rt_attr_spec_kind kind);

#endif /* NPUCRT_OP_SCHEMA_H */
