/* The recurrences of ir/recurrent_ops.py (ops_recurrent.c): their binders, for exec.c's table
 * (each takes the pure op and its stateful form), and the same kernels as flat entry points
 * for the Python executor (runtime/launch.py), which binds nothing.
 *
 * The flat entry points take f32 operands, contiguous, shaped as the registry's rules have
 * them (the launcher checks that). `state` NULL runs the pure op from an empty state.
 * Otherwise state [slots, ...] is updated in place: without `last` (decode) sequence b steps
 * state[b] (Bt = slots); with `last` (prefill: one i64) it runs from the empty state and keeps
 * the state after row *last, in state[*slot] (Bt = 1) or, without `slot`, in state[b] (Bt =
 * slots). `scratch` holds `scratch_floats` floats, at least what the op's *_scratch_floats
 * says for the same sizes and `nt` (`in_scratch`: the pure op or a prefill). Each returns 0;
 * 1 for a last or slot out of range (nothing is written); -1 for sizes that do not fit
 * (a caller's bug). */
#ifndef NPUCRT_OPS_RECURRENT_H
#define NPUCRT_OPS_RECURRENT_H

#include <stdint.h>

#include "exec.h"

int rt_bind_selective_scan(rt_binder *b, rt_step *st);    /* selective_scan, selective_scan_state */
int rt_bind_gated_delta_rule(rt_binder *b, rt_step *st);  /* gated_delta_rule[_state], linear_attention[_state] */
int rt_bind_wkv(rt_binder *b, rt_step *st);               /* wkv, wkv_state */
int rt_bind_linear_recurrence(rt_binder *b, rt_step *st); /* linear_recurrence, linear_recurrence_state */

/* x [Bt,S,Dc], dt [Bt,S,H], A [H] (a_full 0) or [Dc,N] (a_full 1), B and C [Bt,S,G,N], D [Dc];
 * y [Bt,S,Dc]; state [slots,Dc,N] */
int64_t npuc_selective_scan_scratch_floats(int64_t Bt, int64_t Dc, int64_t N, int64_t G, int a_full, int in_scratch,
                                           int nt);
int npuc_selective_scan_f32(const float *x, const float *dt, const float *A, int a_full, const float *B,
                            const float *C, const float *D, float *y, float *state, int64_t slots,
                            const int64_t *last, const int64_t *slot, int64_t Bt, int64_t S, int64_t Dc, int64_t N,
                            int64_t H, int64_t G, float *scratch, int64_t scratch_floats, int nt);

/* q, k [Bt,S,H,K], v [Bt,S,H,V], g [Bt,S,H] (g_key 0) or [Bt,S,H,K] (g_key 1), beta [Bt,S,H]
 * (NULL: linear_attention, delta = v); o [Bt,S,H,V]; state [slots,H,K,V] */
int64_t npuc_gated_delta_rule_scratch_floats(int64_t Bt, int64_t H, int64_t K, int64_t V, int in_scratch, int nt);
int npuc_gated_delta_rule_f32(const float *q, const float *k, const float *v, const float *g, int g_key,
                              const float *beta, float *o, float *state, int64_t slots, const int64_t *last,
                              const int64_t *slot, int64_t Bt, int64_t S, int64_t H, int64_t K, int64_t V,
                              float *scratch, int64_t scratch_floats, int nt);

/* k, v [Bt,S,C], w, u [C]; y [Bt,S,C]; state [slots,3,C] (numerator, denominator, max exponent) */
int64_t npuc_wkv_scratch_floats(int64_t Bt, int64_t C, int in_scratch, int nt);
int npuc_wkv_f32(const float *k, const float *v, const float *w, const float *u, float *y, float *state,
                 int64_t slots, const int64_t *last, const int64_t *slot, int64_t Bt, int64_t S, int64_t C,
                 float *scratch, int64_t scratch_floats, int nt);

/* x, a [Bt,S,C]; y [Bt,S,C]; state [slots,C] */
int64_t npuc_linear_recurrence_scratch_floats(int64_t Bt, int64_t C, int in_scratch, int nt);
int npuc_linear_recurrence_f32(const float *x, const float *a, float *y, float *state, int64_t slots,
                               const int64_t *last, const int64_t *slot, int64_t Bt, int64_t S, int64_t C,
                               float *scratch, int64_t scratch_floats, int nt);

/* The recurrent layers' short convolution at decode, over their conv window: conv1d of x
 * [Bt,C,L] by w [C,1,K] (groups C), bias [C] or NULL, no padding, stride and dilation 1;
 * out [Bt,C,L-K+1]. 0, or -1 for sizes that do not fit. */
int npuc_conv1d_depthwise_f32(const float *x, const float *w, const float *bias, float *out, int64_t Bt, int64_t C,
                              int64_t L, int64_t K, int nt);

#endif /* NPUCRT_OPS_RECURRENT_H */
