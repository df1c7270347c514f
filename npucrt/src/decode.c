/* The decode loop: prefill into a slot, decode steps over every slot, the greedy choice, and
 * npuc_generate, which schedules many sequences over the slots (runtime/scheduler.py's
 * algorithm, so that each sequence gets the tokens it gets alone, as there).
 *
 * A model compiled with `--max_seq_len N --input_shape input_ids:B,S` caches B sequences.
 * Its prefill fills one slot from position 0 (the one its `slot` input names; a model of one
 * slot has no such input), padding a shorter prompt on the right: attention is causal, so
 * the padding changes neither the last prompt row's logits nor the cache rows before it, and
 * decode overwrites the rows after it before any query sees them. Its decode runs C tokens
 * (--decode_tokens) of every slot, each at its own positions.
 *
 * npuc_generate_speculative adds the scheduler's n-gram speculation (apps/speculative.py): on a
 * model with a verify program, each sequence's drafts are checked K + 1 rows a step where the
 * measured step times say it pays (each row's token is the one plain decode chooses, greedy or
 * drawn, and a draft is kept while it equals it), and a recurrent model's slots are rolled back
 * to their last kept row.
 *
 * A slot that has nothing to feed in a step still runs (static shapes). It is fed again the
 * last (token, position) it wrote, which writes the same key and value again: the same
 * computation over the same cache rows, so the same bytes. A slot that never held a sequence
 * is fed token 0 at position 0 of its own rows, which no sequence reads before a prefill
 * writes them; one loaded with a prefix of n positions (prefix.c), token 0 at position n,
 * which its next step writes before any query reads it.
 */
#define _POSIX_C_SOURCE 200809L /* clock_gettime under -std=c11 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "exec.h"

static int32_t find_program(const npuc_model *m, const char *name) {
    for (int32_t p = 0; p < m->n_programs; p++)
        if (strcmp(m->programs[p].name, name) == 0) return p;
    return -1;
}

static int32_t find_input(const npuc_model *m, int32_t prog, const char *name) {
    const rt_program *p = &m->programs[prog];
    for (int32_t i = 0; i < p->n_inputs; i++)
        if (strcmp(m->tensors[p->inputs[i]].name, name) == 0) return i;
    return -1;
}

static int32_t find_output(const npuc_model *m, int32_t prog, const char *name) {
    const rt_program *p = &m->programs[prog];
    for (int32_t i = 0; i < p->n_outputs; i++)
        if (strcmp(m->tensors[p->outputs[i]].name, name) == 0) return i;
    return -1;
}

static const char *meta(const npuc_model *m, const char *key) {
    for (int32_t i = 0; i < m->n_meta; i++)
        if (strcmp(m->meta[i].key, key) == 0) return m->meta[i].value;
    return NULL;
}

/* The ids input of prefill: its first input that is neither last_token nor slot. */
static int32_t ids_input(const npuc_model *m, int32_t prefill) {
    const rt_program *p = &m->programs[prefill];
    for (int32_t i = 0; i < p->n_inputs; i++) {
        const char *n = m->tensors[p->inputs[i]].name;
        if (strcmp(n, "last_token") && strcmp(n, "slot")) return i;
    }
    return -1;
}

static int rollback_setup(npuc_model *m, npuc_error *err);

int rt_generation_setup(npuc_model *m, npuc_error *err) {
    m->has_gen = 0;
    /* no rollback table until rollback_setup builds one */
    m->n_rollback = 0, m->rollback_rows = 0, m->rollback_bad = -1, m->rollback_bad_rows = 0;
    int32_t pf = find_program(m, "prefill"), dc = find_program(m, "decode");
    const char *msl = meta(m, "max_seq_len");
    if (pf < 0 || dc < 0 || msl == NULL) return 0;
    int32_t ids = ids_input(m, pf);
    if (ids < 0) return 0;
    const rt_tensor *t = &m->tensors[m->programs[pf].inputs[ids]];
    int32_t dids = find_input(m, dc, t->name);
    int32_t lo_p = find_output(m, pf, "logits"), lo_d = find_output(m, dc, "logits");
    if (dids < 0 || lo_p < 0 || lo_d < 0 || t->rank != 2 || m->programs[dc].n_inputs != 2) return 0;
    const rt_tensor *dt = &m->tensors[m->programs[dc].inputs[dids]];
    const rt_tensor *lp = &m->tensors[m->programs[pf].outputs[lo_p]];
    const rt_tensor *ld = &m->tensors[m->programs[dc].outputs[lo_d]];
    if (dt->rank != 2 || lp->rank < 1 || ld->rank != 3 || lp->dtype != NPUC_F32 || ld->dtype != NPUC_F32 ||
        t->dtype != NPUC_I64 || dt->dtype != NPUC_I64 || lp->shape[lp->rank - 1] != ld->shape[2] ||
        ld->shape[0] != dt->shape[0] || (ld->shape[1] != 1 && ld->shape[1] != dt->shape[1]))
        return 0; /* a layout generation does not read: the programs still run */
    npuc_generation_info *g = &m->gen;
    memset(g, 0, sizeof *g);
    g->max_seq_len = (int32_t)strtol(msl, NULL, 10); /* validate.c checked it is a positive integer */
    g->prefill_len = (int32_t)t->shape[1];
    g->slots = (int32_t)dt->shape[0];
    g->decode_tokens = (int32_t)dt->shape[1];
    g->logits_width = ld->shape[2];
    g->vocab = g->logits_width;
    const rt_program *p = &m->programs[pf];
    for (int32_t k = 0; k < p->n_ops; k++) { /* the rows of the table the ids index (Session.index_rows) */
        const rt_op *op = &p->ops[k];
        if (strcmp(op->op, "gather") == 0 && op->n_inputs > 1 && op->inputs[1] == p->inputs[ids]) {
            const rt_tensor *table = &m->tensors[op->inputs[0]];
            if (table->region == REGION_WEIGHTS && table->rank > 0) {
                int64_t axis = rt_attr_i(op, "axis", 0) % table->rank;
                g->vocab = table->shape[axis < 0 ? axis + table->rank : axis];
                break;
            }
        }
    }
    const char *eos = meta(m, "eos_token_id");
    int32_t n = 0;
    for (const char *c = eos; c != NULL && *c; c++) n += *c == ',';
    if (eos != NULL && *eos) n++;
    m->eos = n ? pool_alloc(&m->pool, sizeof(int64_t) * (size_t)n) : NULL;
    if (n && m->eos == NULL) return rt_fail(err, NPUC_E_ARG, "", "out of memory");
    const char *c = eos;
    for (int32_t k = 0; k < n; k++) {
        char *end;
        m->eos[k] = strtoll(c, &end, 10);
        c = *end == ',' ? end + 1 : end;
    }
    g->n_eos = n;
    g->eos = m->eos;
    m->has_gen = 1;
    return rollback_setup(m, err);
}

int npuc_model_generation_info(const npuc_model *m, npuc_generation_info *info, npuc_error *err) {
    if (m == NULL || info == NULL) return rt_fail(err, NPUC_E_ARG, "", "a NULL argument");
    if (!m->has_gen)
        return rt_fail(err, NPUC_E_NO_PROGRAM, "compile it with --max_seq_len N",
                       "the model has no prefill and decode programs to generate with");
    *info = m->gen;
    return NPUC_OK;
}

static int prompt_ok(const npuc_model *m, const int64_t *tokens, int32_t n, npuc_error *err) {
    const npuc_generation_info *g = &m->gen;
    if (tokens == NULL || n < 1)
        return rt_fail(err, NPUC_E_PROMPT, "give at least one token id", "the prompt is empty");
    if (n >= g->max_seq_len)
        return rt_fail(err, NPUC_E_PROMPT, "shorten the prompt or recompile with a larger --max_seq_len",
                       "the prompt has %d tokens; the model caches %d", (int)n, (int)g->max_seq_len);
    for (int32_t i = 0; i < n; i++)
        if (tokens[i] < 0 || tokens[i] >= g->vocab) {
            char hint[64];
            snprintf(hint, sizeof hint, "prompt ids are 0..%lld", (long long)g->vocab - 1);
            return rt_fail(err, NPUC_E_PROMPT, hint, "token id %lld is outside the model's vocabulary of %lld",
                           (long long)tokens[i], (long long)g->vocab);
        }
    return 0;
}

/* The decode step proper: ids/pos already laid out [slots * C]; writes each slot's row. */
static int decode_run(npuc_session *s, const int64_t *ids, const int64_t *pos, const int32_t *fed, float *logits,
                      int64_t *next, npuc_error *err) {
    const npuc_model *m = rt_session_model(s);
    const npuc_generation_info *g = &m->gen;
    int32_t dc = find_program(m, "decode");
    int32_t i_ids = find_input(m, dc, m->tensors[m->programs[find_program(m, "prefill")].inputs[
                                             ids_input(m, find_program(m, "prefill"))]].name);
    int32_t i_pos = 1 - i_ids;
    uint64_t n = (uint64_t)g->slots * (uint64_t)g->decode_tokens * sizeof(int64_t);
    const rt_tensor *pt = &m->tensors[m->programs[dc].inputs[i_pos]];
    int rc = rt_session_set_input(s, dc, i_ids, ids, n, err);
    if (!rc) rc = rt_session_set_input(s, dc, i_pos, pos, pt->nbytes == n ? n : pt->nbytes + 1, err);
    if (!rc) rc = rt_session_execute(s, dc, err);
    if (rc) return rc;
    const void *view;
    npuc_session_output_view(s, dc, find_output(m, dc, "logits"), &view);
    const rt_tensor *lt = &m->tensors[m->programs[dc].outputs[find_output(m, dc, "logits")]];
    int64_t rows = lt->shape[1], V = g->logits_width;
    for (int32_t k = 0; k < g->slots; k++) {
        int32_t f = fed[k] > 0 ? fed[k] : 1;
        const float *row = (const float *)view + ((int64_t)k * rows + (rows == g->decode_tokens ? f - 1 : rows - 1)) * V;
        if (logits != NULL) memcpy(logits + (int64_t)k * V, row, (size_t)V * sizeof(float));
        if (next != NULL) next[k] = rt_argmax(row, V);
    }
    return 0;
}

int npuc_decode_step(npuc_session *s, const int64_t *tokens, const int64_t *positions, const int32_t *n_fed,
                     float *logits, int64_t *next_tokens, npuc_error *err) {
    if (s == NULL || tokens == NULL || positions == NULL) return rt_fail(err, NPUC_E_ARG, "", "a NULL argument");
    const npuc_model *m = rt_session_model(s);
    if (!m->has_gen) return npuc_model_generation_info(m, &(npuc_generation_info){0}, err);
    const npuc_generation_info *g = &m->gen;
    int32_t C = g->decode_tokens, B = g->slots;
    int64_t *track = rt_session_slot_track(s);
    int64_t *ids = malloc(sizeof(int64_t) * 2 * (size_t)B * (size_t)C);
    int32_t *fed = malloc(sizeof(int32_t) * (size_t)B);
    if (ids == NULL || fed == NULL) {
        free(ids);
        free(fed);
        return rt_fail(err, NPUC_E_ARG, "", "out of memory");
    }
    int64_t *pos = ids + (size_t)B * (size_t)C;
    int rc = 0;
    for (int32_t k = 0; k < B && !rc; k++) {
        int32_t f = n_fed != NULL ? n_fed[k] : C;
        if (f < 0 || f > C) rc = rt_fail(err, NPUC_E_ARG, "", "n_fed[%d] = %d is not 0..%d", (int)k, (int)f, (int)C);
        fed[k] = f;
        for (int32_t i = 0; i < C && !rc; i++) {
            int32_t j = f ? (i < f ? i : f - 1) : 0;
            int64_t tok = f ? tokens[k * C + j] : (track[2 * k] >= 0 ? track[2 * k] : 0);
            int64_t p = f ? positions[k * C + j] : (track[2 * k] >= 0 ? track[2 * k + 1] : 0);
            ids[k * C + i] = tok;
            pos[k * C + i] = p;
        }
    }
    if (!rc) rc = decode_run(s, ids, pos, fed, logits, next_tokens, err);
    if (!rc)
        for (int32_t k = 0; k < B; k++)
            if (fed[k]) track[2 * k] = ids[k * C + fed[k] - 1], track[2 * k + 1] = pos[k * C + fed[k] - 1];
    free(ids);
    free(fed);
    return rc;
}

/* Prefill `n` (<= prefill_len) tokens into slot k; the last prompt row's logits into `row`. */
static int prefill_run(npuc_session *s, int32_t slot, const int64_t *tokens, int32_t n, float *row, npuc_error *err) {
    const npuc_model *m = rt_session_model(s);
    const npuc_generation_info *g = &m->gen;
    int32_t pf = find_program(m, "prefill");
    int32_t i_ids = ids_input(m, pf), i_last = find_input(m, pf, "last_token"), i_slot = find_input(m, pf, "slot");
    if (i_slot < 0 && slot != 0)
        return rt_fail(err, NPUC_E_INPUT, "", "the model's prefill fills slot 0 only (it has one slot)");
    int64_t *buf = calloc((size_t)g->prefill_len, sizeof(int64_t));
    if (buf == NULL) return rt_fail(err, NPUC_E_ARG, "", "out of memory");
    memcpy(buf, tokens, (size_t)n * sizeof(int64_t));
    int64_t last = n - 1, k = slot;
    int rc = rt_session_set_input(s, pf, i_ids, buf, (uint64_t)g->prefill_len * sizeof(int64_t), err);
    free(buf);
    if (!rc && i_last >= 0) rc = rt_session_set_input(s, pf, i_last, &last, sizeof last, err);
    if (!rc && i_slot >= 0) rc = rt_session_set_input(s, pf, i_slot, &k, sizeof k, err);
    if (!rc) rc = rt_session_execute(s, pf, err);
    if (rc) return rc;
    int32_t lo = find_output(m, pf, "logits");
    const void *view;
    npuc_session_output_view(s, pf, lo, &view);
    int64_t V = g->logits_width;
    /* One row (the one last_token names), or every row: a recurrent model's prefill takes
     * last_token for the row whose state it keeps, whatever logits it computes. */
    const rt_tensor *lt = &m->tensors[m->programs[pf].outputs[lo]];
    int64_t at = lt->rank >= 2 && lt->shape[1] == 1 ? 0 : last;
    memcpy(row, (const float *)view + at * V, (size_t)V * sizeof(float));
    int64_t *track = rt_session_slot_track(s);
    track[2 * slot] = tokens[n - 1], track[2 * slot + 1] = n - 1;
    return 0;
}

int npuc_prefill(npuc_session *s, int32_t slot, const int64_t *tokens, int32_t n, float *logits, int64_t *next_token,
                 npuc_error *err) {
    if (s == NULL) return rt_fail(err, NPUC_E_ARG, "", "a NULL argument");
    const npuc_model *m = rt_session_model(s);
    if (!m->has_gen) return npuc_model_generation_info(m, &(npuc_generation_info){0}, err);
    const npuc_generation_info *g = &m->gen;
    int rc = prompt_ok(m, tokens, n, err);
    if (rc) return rc;
    if (slot < 0 || slot >= g->slots)
        return rt_fail(err, NPUC_E_INPUT, "", "slot [%d] is outside the model's %d slots", (int)slot, (int)g->slots);
    int64_t V = g->logits_width, B = g->slots, C = g->decode_tokens;
    float *row = malloc((size_t)(V * B) * sizeof(float));
    int64_t *ids = calloc((size_t)(2 * B * C), sizeof(int64_t));
    int32_t *fed = calloc((size_t)B, sizeof(int32_t));
    if (row == NULL || ids == NULL || fed == NULL) {
        free(row), free(ids), free(fed);
        return rt_fail(err, NPUC_E_ARG, "", "out of memory");
    }
    int32_t first = n < g->prefill_len ? n : g->prefill_len;
    rc = prefill_run(s, slot, tokens, first, row, err);
    /* The rest of a long prompt: decode steps feeding this slot alone (the others repeat). */
    int64_t *pos = ids + B * C;
    for (int32_t at = first; !rc && at < n;) {
        int32_t f = (int32_t)(n - at < C ? n - at : C);
        for (int32_t i = 0; i < C; i++) {
            int32_t j = i < f ? i : f - 1;
            ids[slot * C + i] = tokens[at + j];
            pos[slot * C + i] = at + j;
        }
        fed[slot] = f;
        rc = npuc_decode_step(s, ids, pos, fed, row, NULL, err);
        if (!rc) memmove(row, row + (int64_t)slot * V, (size_t)V * sizeof(float));
        at += f;
    }
    if (!rc) {
        if (logits != NULL) memcpy(logits, row, (size_t)V * sizeof(float));
        if (next_token != NULL) *next_token = rt_argmax(row, V);
    }
    free(row), free(ids), free(fed);
    return rc;
}

/* ---- copying a slot: one prefill for many continuations -------------------------------------- */

int npuc_session_copy_slot(npuc_session *s, int32_t from, int32_t to, npuc_error *err) {
    if (s == NULL) return rt_fail(err, NPUC_E_ARG, "", "a NULL argument");
    const npuc_model *m = rt_session_model(s);
    if (!m->has_gen) return npuc_model_generation_info(m, &(npuc_generation_info){0}, err);
    const int64_t B = m->gen.slots;
    if (from < 0 || from >= B || to < 0 || to >= B) {
        char hint[64];
        snprintf(hint, sizeof hint, "slots are 0..%lld", (long long)B - 1);
        return rt_fail(err, NPUC_E_INPUT, hint, "copy from slot %d to slot %d", (int)from, (int)to);
    }
    /* every state tensor holds its slots first, [slots, ...]: checked before any byte moves (the
     * prefix pool's tensors, [entries, ...], are no slot's) */
    for (int32_t i = 0; i < m->n_tensors; i++) {
        const rt_tensor *t = &m->tensors[i];
        if (t->region == REGION_STATE && !t->pool && (t->rank < 1 || t->shape[0] != B || t->nbytes % (uint64_t)B))
            return rt_fail(err, NPUC_E_INPUT, "only a state laid out [slots, ...] can be copied by slot",
                           "state tensor %s is not one row per slot", t->name);
    }
    if (from == to) return NPUC_OK;
    uint8_t *state = rt_session_state(s);
    for (int32_t i = 0; i < m->n_tensors; i++) {
        const rt_tensor *t = &m->tensors[i];
        if (t->region != REGION_STATE || t->pool) continue;
        int seen = 0; /* a view of the same bytes (kv_write's output) is copied once */
        for (int32_t j = 0; j < i && !seen; j++)
            seen = m->tensors[j].region == REGION_STATE && m->tensors[j].offset == t->offset &&
                   m->tensors[j].nbytes == t->nbytes;
        if (seen) continue;
        uint64_t row = t->nbytes / (uint64_t)B;
        memmove(state + t->offset + row * (uint64_t)to, state + t->offset + row * (uint64_t)from, (size_t)row);
    }
    int64_t *track = rt_session_slot_track(s);
    track[2 * to] = track[2 * from], track[2 * to + 1] = track[2 * from + 1];
    return NPUC_OK;
}

/* The state tensor `name` (a state of the slots, not a view of one): its index, or -1. */
static int32_t state_named(const npuc_model *m, const char *name, size_t n) {
    for (int32_t i = 0; i < m->n_tensors; i++) {
        const rt_tensor *t = &m->tensors[i];
        if (t->region == REGION_STATE && !t->pool && t->base == -1 && strlen(t->name) == n &&
            strncmp(t->name, name, n) == 0)
            return i;
    }
    return -1;
}

/* A recurrent state's copies by verify row: `<state>.by_row` (backend/om_schema.ROLLBACK_SUFFIX). */
static const char BY_ROW[] = ".by_row";

static int ends_with(const char *s, const char *tail) {
    size_t a = strlen(s), b = strlen(tail);
    return a >= b && strcmp(s + a - b, tail) == 0;
}

static int is_by_row(const rt_tensor *r) {
    return r->region == REGION_STATE && !r->pool && r->base == -1 && ends_with(r->name, BY_ROW);
}

/* npuc_session_rollback's table, built once at load: each <name>.by_row [B, 1, K, n] beside
 * <name> [B, ...] of n values a slot, the same dtype (K: the verify step's rows but its last,
 * whose state is the state's own), every pair with the same K. A `.by_row` state that is not
 * such a copy leaves the table empty and is named in m->rollback_bad: the model's programs
 * still run, and npuc_session_rollback refuses. */
static int rollback_setup(npuc_model *m, npuc_error *err) {
    const int64_t B = m->gen.slots;
    int32_t n = 0;
    for (int32_t i = 0; i < m->n_tensors; i++) n += is_by_row(&m->tensors[i]);
    m->rollback = n ? pool_alloc(&m->pool, sizeof(rt_rollback_pair) * (size_t)n) : NULL;
    if (n && m->rollback == NULL) return rt_fail(err, NPUC_E_ARG, "", "out of memory");
    for (int32_t i = 0; i < m->n_tensors; i++) {
        const rt_tensor *r = &m->tensors[i];
        if (!is_by_row(r)) continue;
        int32_t j = state_named(m, r->name, strlen(r->name) - (sizeof BY_ROW - 1));
        const rt_tensor *t = j >= 0 ? &m->tensors[j] : NULL;
        int bad = t == NULL || t->dtype != r->dtype || r->rank != 4 || r->shape[0] != B || r->shape[1] != 1 ||
                  r->shape[2] < 1 || t->rank < 1 || t->shape[0] != B || t->nbytes % (uint64_t)B ||
                  r->nbytes / (uint64_t)B / (uint64_t)r->shape[2] != t->nbytes / (uint64_t)B ||
                  r->nbytes % ((uint64_t)B * (uint64_t)r->shape[2]);
        if (bad || (m->rollback_rows != 0 && r->shape[2] != m->rollback_rows)) {
            m->rollback_bad = i, m->rollback_bad_rows = bad ? 0 : r->shape[2], m->n_rollback = 0;
            return 0;
        }
        m->rollback_rows = r->shape[2];
        m->rollback[m->n_rollback++] = (rt_rollback_pair){j, i};
    }
    return 0;
}

int npuc_session_rollback(npuc_session *s, int32_t slot, int32_t row, npuc_error *err) {
    if (s == NULL) return rt_fail(err, NPUC_E_ARG, "", "a NULL argument");
    const npuc_model *m = rt_session_model(s);
    if (!m->has_gen) return npuc_model_generation_info(m, &(npuc_generation_info){0}, err);
    const int64_t B = m->gen.slots, K = m->rollback_rows;
    if (m->rollback_bad >= 0) { /* nothing is copied from a model whose copies are not all well formed */
        const char *name = m->tensors[m->rollback_bad].name;
        if (m->rollback_bad_rows)
            return rt_fail(err, NPUC_E_INVALID, "recompile the model with this npuc",
                           "state %s keeps %lld rows, another %lld", name, (long long)m->rollback_bad_rows,
                           (long long)K);
        return rt_fail(err, NPUC_E_INVALID, "recompile the model with this npuc",
                       "state %s does not hold one copy of its state per slot and verify row", name);
    }
    if (m->n_rollback == 0)
        return rt_fail(err, NPUC_E_INPUT, "compile the model with --speculative_tokens K",
                       "the model keeps no recurrent state by verify row: there is nothing to roll back");
    if (slot < 0 || slot >= B || row < 0 || row > K) {
        char hint[96];
        snprintf(hint, sizeof hint, "slots are 0..%lld, rows 0..%lld", (long long)B - 1, (long long)K);
        return rt_fail(err, NPUC_E_INPUT, hint, "roll slot %d back to row %d", (int)slot, (int)row);
    }
    if (row == K) return NPUC_OK; /* every row kept: the states are the step's own */
    uint8_t *state = rt_session_state(s);
    for (int32_t p = 0; p < m->n_rollback; p++) {
        const rt_tensor *t = &m->tensors[m->rollback[p].state], *r = &m->tensors[m->rollback[p].by_row];
        uint64_t per = t->nbytes / (uint64_t)B;
        memcpy(state + t->offset + per * (uint64_t)slot,
               state + r->offset + per * ((uint64_t)slot * (uint64_t)K + (uint64_t)row), (size_t)per);
    }
    return NPUC_OK;
}

/* ---- npuc_generate: runtime/scheduler.py's Scheduler, in C ----------------------------------- */

typedef struct {
    int64_t *out;       /* the sequence's tokens so far (its out_tokens, else the slot's own) */
    int32_t seq;        /* index in seqs, -1 free */
    int64_t pos;        /* the position the next fed token is written at */
    int32_t next;       /* the prompt's next token to feed */
    int64_t pending;    /* the last chosen token, to feed; -1 none */
    double alpha;       /* speculation: the estimated chance that a draft token is kept */
    int64_t shadow;     /* speculation: the first token drafted on a plain step, checked after it; -1 none */
} slot_state;

static int is_eos(const npuc_generation_info *g, int64_t t) {
    for (int32_t i = 0; i < g->n_eos; i++)
        if (g->eos[i] == t) return 1;
    return 0;
}

/* The next token of sequence q from its logits row: the greedy one the step computed, or its
 * own sampling's. Records it, calls back, and says whether the sequence ends. */
static int choose(const npuc_generation_info *g, npuc_sequence *q, int32_t qi, slot_state *st, const float *row,
                  int64_t greedy, void *work, size_t work_bytes, npuc_token_callback cb, void *user, npuc_error *err) {
    int64_t token = greedy;
    if (q->sampling != NULL) {
        int rc = npuc_sample(row, g->vocab, q->sampling, q->prompt, q->prompt_len, st->out, q->n_out, work,
                             work_bytes, &token, err);
        if (rc) return rc;
    }
    if (q->n_out < q->max_new_tokens) st->out[q->n_out] = token;
    q->n_out++;
    int stop = cb != NULL ? cb(user, qi, token) : 0;
    if (is_eos(g, token) && !q->ignore_eos) q->finish_reason = NPUC_FINISH_STOP;
    else if (q->n_out >= q->max_new_tokens) q->finish_reason = NPUC_FINISH_LENGTH;
    else if (st->pos >= g->max_seq_len) q->finish_reason = NPUC_FINISH_CACHE_FULL;
    else if (stop) q->finish_reason = NPUC_FINISH_CALLBACK;
    else st->pending = token;
    if (q->finish_reason) st->seq = -1;
    return 0;
}

static int32_t longest_output(const npuc_sequence *seqs, int32_t n) {
    int32_t most = 1;
    for (int32_t q = 0; q < n; q++)
        if (seqs[q].out_tokens == NULL && seqs[q].max_new_tokens > most) most = seqs[q].max_new_tokens;
    return most;
}

/* ---- speculation (apps/speculative.py's, for greedy sequences and n-gram drafts) --------- */

typedef struct {
    int32_t prog, i_ids, i_pos, o_logits; /* the verify program, -1 none */
    int32_t rows;                         /* its K + 1 tokens of each slot */
    int rollback;                         /* recurrent state kept by row (npuc_session_rollback) */
} verify_prog;

/* The verify program where it has decode's inputs at K + 1 tokens of each slot and every row's
 * logits; prog -1 otherwise. */
static verify_prog find_verify(const npuc_model *m) {
    verify_prog v = {-1, -1, -1, -1, 0, 0};
    const npuc_generation_info *g = &m->gen;
    int32_t vp = find_program(m, "verify"), pf = find_program(m, "prefill");
    if (vp < 0 || pf < 0 || m->programs[vp].n_inputs != 2) return v;
    int32_t ids = find_input(m, vp, m->tensors[m->programs[pf].inputs[ids_input(m, pf)]].name);
    int32_t lo = find_output(m, vp, "logits");
    if (ids < 0 || lo < 0) return v;
    const rt_tensor *it = &m->tensors[m->programs[vp].inputs[ids]];
    const rt_tensor *pt = &m->tensors[m->programs[vp].inputs[1 - ids]];
    const rt_tensor *lt = &m->tensors[m->programs[vp].outputs[lo]];
    if (it->rank != 2 || it->dtype != NPUC_I64 || it->shape[0] != g->slots || it->shape[1] < 2 ||
        pt->dtype != NPUC_I64 || pt->nbytes != it->nbytes || lt->rank != 3 || lt->dtype != NPUC_F32 ||
        lt->shape[0] != g->slots || lt->shape[1] != it->shape[1] || lt->shape[2] != g->logits_width)
        return v;
    v.prog = vp, v.i_ids = ids, v.i_pos = 1 - ids, v.o_logits = lo, v.rows = (int32_t)it->shape[1];
    v.rollback = m->n_rollback > 0 || m->rollback_bad >= 0; /* a bad table: refused at the first rollback */
    return v;
}

/* The sequence's token i: its prompt's, then its output's. */
static int64_t token_at(const npuc_sequence *q, const int64_t *out, int64_t i) {
    return i < q->prompt_len ? q->prompt[i] : out[i - q->prompt_len];
}

/* Up to k tokens that followed the latest earlier occurrence of the sequence's last n tokens, n
 * from ngram_max down to ngram_min (NgramIndex.draft): a copy that runs past the sequence's end
 * goes on with its own tokens (a repeating stretch is drafted as repeating on). A scan back over
 * the sequence: O(length x n) a call, microseconds beside a step. */
static int32_t ngram_draft(const npuc_sequence *q, const int64_t *out, const npuc_speculation *sp, int32_t k,
                           int64_t *draft) {
    int64_t L = (int64_t)q->prompt_len + q->n_out;
    for (int64_t n = L - 1 < sp->ngram_max ? L - 1 : sp->ngram_max; n >= sp->ngram_min; n--)
        for (int64_t at = L - n - 1; at >= 0; at--) {
            int64_t i = 0;
            while (i < n && token_at(q, out, at + i) == token_at(q, out, L - n + i)) i++;
            if (i < n) continue;
            for (int32_t j = 0; j < k; j++) {
                int64_t from = at + n + j;
                draft[j] = from < L ? token_at(q, out, from) : draft[from - L];
            }
            return k;
        }
    return 0;
}

/* A draft token checked (kept or not) moves the slot's estimate (RequestSpeculation.observe). */
static void observe(slot_state *st, int kept) { st->alpha += 0.15 * ((kept ? 1.0 : 0.0) - st->alpha); }

/* Expected kept tokens of an m-token draft: each in turn while all before it were kept. */
static double expected_kept(double alpha, int32_t m) {
    double total = 0, p = 1;
    for (int32_t i = 0; i < m; i++) p *= alpha, total += p;
    return total;
}

/* The two programs' step times (apps/speculative.StepTimes): moving averages that follow a
 * faster step at once and a slower one slowly, each program's first two runs not counted; and
 * the probes that re-measure verify after PROBE_EVERY plain steps with drafts (doubling, up to
 * PROBE_MOST, while probes fail). */
enum { WARM_RUNS = 2, PROBE_EVERY = 64, PROBE_MOST = 1024 };
typedef struct {
    double decode, verify; /* seconds; < 0 unknown */
    int32_t ran_decode, ran_verify;
    int64_t since_verify, probe_every;
    int probed;
} step_times;

static double cost_average(double old, double seconds) {
    return old < 0 ? seconds : old + (seconds < old ? 0.5 : 0.2) * (seconds - old);
}

static void times_add(step_times *t, int verify, double seconds) {
    t->since_verify = verify ? 0 : t->since_verify + 1;
    int32_t *ran = verify ? &t->ran_verify : &t->ran_decode;
    double *avg = verify ? &t->verify : &t->decode;
    if (++*ran > WARM_RUNS) *avg = cost_average(*avg, seconds);
}

static double seconds_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int spec_check(const npuc_speculation *sp, const verify_prog *v, npuc_error *err) {
    if (sp == NULL || sp->tokens == 0) return 0;
    if (v->prog < 0)
        return rt_fail(err, NPUC_E_NO_PROGRAM, "compile the model with --speculative_tokens K",
                       "the model has no verify program to check drafts with");
    if (sp->tokens < 0 || sp->tokens > v->rows - 1)
        return rt_fail(err, NPUC_E_ARG, "", "speculation.tokens is %d; the verify program checks 1..%d",
                       (int)sp->tokens, (int)v->rows - 1);
    if (sp->ngram_min < 1 || sp->ngram_max < sp->ngram_min || sp->ngram_max > 32)
        return rt_fail(err, NPUC_E_ARG, "", "n-gram sizes %d..%d are not 1 <= min <= max <= 32",
                       (int)sp->ngram_min, (int)sp->ngram_max);
    if (!(sp->min_gain >= 0) || !isfinite(sp->min_gain))
        return rt_fail(err, NPUC_E_ARG, "", "speculation.min_gain is not a finite number >= 0");
    return 0;
}

/* One verify step: each slot's rows are its pending token, then its drafts (drafts + k * R,
 * n_draft[k] of them), then padding: the last real row again (its key and value rewritten), or,
 * on a model with recurrent state, the last token at the positions after it, so that the state
 * kept after the last real row is the one rolled back to. Slots without a sequence repeat the
 * last (token, position) they wrote. Every row's logits stay in the program's output. */
static int verify_run(npuc_session *s, const verify_prog *v, const slot_state *sl, const int64_t *drafts,
                      const int32_t *n_draft, int64_t *ids, const float **logits, npuc_error *err) {
    const npuc_model *m = rt_session_model(s);
    const npuc_generation_info *g = &m->gen;
    const int32_t B = g->slots, R = v->rows;
    int64_t *pos = ids + (int64_t)B * R, *track = rt_session_slot_track(s);
    for (int32_t k = 0; k < B; k++) {
        int64_t *ik = ids + (int64_t)k * R, *pk = pos + (int64_t)k * R;
        int32_t real = 0;
        if (sl[k].seq >= 0) {
            ik[0] = sl[k].pending, pk[0] = sl[k].pos, real = 1;
            for (int32_t i = 0; i < n_draft[k]; i++, real++)
                ik[real] = drafts[(int64_t)k * R + i], pk[real] = sl[k].pos + real;
        } else {
            ik[0] = track[2 * k] >= 0 ? track[2 * k] : 0;
            pk[0] = track[2 * k] >= 0 ? track[2 * k + 1] : 0;
            real = 1;
        }
        for (int32_t i = real; i < R; i++) {
            int64_t after = pk[real - 1] + (i - real + 1);
            ik[i] = ik[real - 1];
            pk[i] = v->rollback && sl[k].seq >= 0 ? (after < g->max_seq_len ? after : g->max_seq_len - 1)
                                                   : pk[real - 1];
        }
    }
    uint64_t n = (uint64_t)B * (uint64_t)R * sizeof(int64_t);
    int rc = rt_session_set_input(s, v->prog, v->i_ids, ids, n, err);
    if (!rc) rc = rt_session_set_input(s, v->prog, v->i_pos, pos, n, err);
    if (!rc) rc = rt_session_execute(s, v->prog, err);
    if (rc) return rc;
    const void *view;
    npuc_session_output_view(s, v->prog, v->o_logits, &view);
    *logits = view;
    return 0;
}

int npuc_generate_speculative(npuc_session *s, npuc_sequence *seqs, int32_t n_seqs, const npuc_speculation *spec,
                              npuc_speculation_stats *stats, npuc_token_callback cb, void *user, npuc_error *err) {
    if (s == NULL || (n_seqs > 0 && seqs == NULL)) return rt_fail(err, NPUC_E_ARG, "", "a NULL argument");
    const npuc_model *m = rt_session_model(s);
    if (!m->has_gen) return npuc_model_generation_info(m, &(npuc_generation_info){0}, err);
    const npuc_generation_info *g = &m->gen;
    const verify_prog vp = find_verify(m);
    int rc = spec_check(spec, &vp, err);
    if (rc) return rc;
    const npuc_speculation *sp = spec != NULL && spec->tokens > 0 ? spec : NULL;
    for (int32_t q = 0; q < n_seqs; q++) { /* every prompt before any runs */
        rc = prompt_ok(m, seqs[q].prompt, seqs[q].prompt_len, err);
        if (rc) return rc;
        if (seqs[q].max_new_tokens < 1)
            return rt_fail(err, NPUC_E_PROMPT, "ask for at least one token", "max_new_tokens is %d",
                           (int)seqs[q].max_new_tokens);
        if (seqs[q].sampling != NULL) {
            rc = npuc_sampling_check(seqs[q].sampling, m->gen.vocab, err);
            if (rc) return rc;
        }
        seqs[q].n_out = 0, seqs[q].finish_reason = 0;
    }
    npuc_speculation_stats st0 = {0};
    int32_t B = g->slots, C = g->decode_tokens, R = sp != NULL ? vp.rows : 1;
    int64_t V = g->logits_width;
    int32_t W = C > R ? C : R; /* ids and positions of the widest step */
    slot_state *sl = calloc((size_t)B, sizeof *sl);
    int64_t *ids = calloc((size_t)(2 * B * W), sizeof(int64_t));
    int32_t *fed = calloc((size_t)B, sizeof(int32_t));
    float *row = malloc((size_t)(V * B) * sizeof(float));
    int64_t *next = calloc((size_t)B, sizeof(int64_t));
    int64_t *drafts = calloc((size_t)(B * R), sizeof(int64_t));
    int32_t *n_draft = calloc((size_t)B, sizeof(int32_t));
    /* each slot's own record of its sequence's tokens, where the caller keeps none */
    int32_t most = longest_output(seqs, n_seqs);
    int64_t *outs = calloc((size_t)B * (size_t)most, sizeof(int64_t));
    size_t work_bytes = npuc_sample_work_bytes(V);
    void *work = malloc(work_bytes);
    if (sl == NULL || ids == NULL || fed == NULL || row == NULL || next == NULL || outs == NULL || work == NULL ||
        drafts == NULL || n_draft == NULL)
        rc = rt_fail(err, NPUC_E_ARG, "", "out of memory");
    step_times times = {-1, -1, 0, 0, 0, PROBE_EVERY, 0};
    int64_t *pos = ids + (int64_t)B * C;
    for (int32_t k = 0; k < B && !rc; k++) sl[k].seq = -1;
    int32_t queued = 0;
    while (!rc) {
        int active = 0;
        for (int32_t k = 0; k < B; k++) active += sl[k].seq >= 0;
        /* admit queued sequences into free slots */
        for (int32_t k = 0; k < B && !rc && queued < n_seqs; k++) {
            if (sl[k].seq >= 0) continue;
            npuc_sequence *q = &seqs[queued];
            slot_state *st = &sl[k];
            st->seq = queued++;
            st->pending = -1, st->alpha = 0.7, st->shadow = -1;
            st->out = q->out_tokens != NULL ? q->out_tokens : outs + (size_t)k * (size_t)most;
            if (sp != NULL) times.probe_every = PROBE_EVERY; /* a new sequence's drafts may pay */
            if (C > 1 && active) { /* slots are decoding: the prompt goes through decode steps (chunked prefill) */
                st->pos = 0, st->next = 0;
                active++;
                continue;
            }
            int32_t n = q->prompt_len < g->prefill_len ? q->prompt_len : g->prefill_len;
            rc = prefill_run(s, k, q->prompt, n, row, err);
            if (rc) break;
            st->pos = n, st->next = n;
            active++;
            if (st->next == q->prompt_len)
                rc = choose(g, q, st->seq, st, row, rt_argmax(row, V), work, work_bytes, cb, user, err);
        }
        if (rc) break;
        active = 0;
        for (int32_t k = 0; k < B; k++) active += sl[k].seq >= 0;
        if (!active) {
            if (queued >= n_seqs) break;
            continue;
        }
        /* the plan (Scheduler._plan): verify where the drafts found are expected to pay */
        int verify = 0, found = 0;
        if (sp != NULL) {
            double plain = 0, speculated = 0;
            int feeding = 0;
            for (int32_t k = 0; k < B; k++) {
                slot_state *st = &sl[k];
                n_draft[k] = 0;
                if (st->seq < 0) continue;
                const npuc_sequence *q = &seqs[st->seq];
                feeding |= st->next < q->prompt_len || st->pending < 0;
                plain += 1, speculated += 1;
                if (times.decode < 0) continue; /* drafts once decode's cost is known */
                int64_t room = sp->tokens;
                if (q->max_new_tokens - q->n_out - 1 < room) room = q->max_new_tokens - q->n_out - 1;
                if (g->max_seq_len - 1 - st->pos < room) room = g->max_seq_len - 1 - st->pos;
                if (room <= 0) continue;
                n_draft[k] = ngram_draft(q, st->out, sp, (int32_t)room, drafts + (int64_t)k * R);
                speculated += expected_kept(st->alpha, n_draft[k]);
                found |= n_draft[k] > 0;
            }
            if (found && !feeding) { /* a prompt still fed goes through decode steps first */
                int probe = times.since_verify >= times.probe_every;
                double ratio = times.decode > 0 && times.verify >= 0 ? times.verify / times.decode : 1.5;
                int pays = speculated > plain && speculated / ratio >= plain * sp->min_gain;
                if (pays) times.probe_every = PROBE_EVERY;
                else if (!probe && times.probed && times.probe_every < PROBE_MOST) times.probe_every *= 2;
                times.probed = !pays && probe;
                verify = pays || probe;
            }
            if (!verify)
                for (int32_t k = 0; k < B; k++) /* checked against the token the plain step chooses */
                    if (sl[k].seq >= 0) sl[k].shadow = n_draft[k] > 0 && !feeding ? drafts[(int64_t)k * R] : -1;
        }
        if (verify) {
            const float *lg = NULL;
            double t0 = seconds_now();
            rc = verify_run(s, &vp, sl, drafts, n_draft, ids, &lg, err);
            if (rc) break;
            times_add(&times, 1, seconds_now() - t0);
            st0.steps++, st0.verify_steps++;
            int64_t *track = rt_session_slot_track(s), *vpos = ids + (int64_t)B * R;
            for (int32_t k = 0; k < B && !rc; k++) {
                slot_state *st = &sl[k];
                if (st->seq < 0) continue;
                npuc_sequence *q = &seqs[st->seq];
                int64_t at = st->pos;
                int32_t kept = 0; /* the rows whose tokens the cache keeps, but the first */
                for (int32_t i = 0; i <= n_draft[k] && !rc; i++) {
                    const float *r = lg + ((int64_t)k * R + i) * V;
                    st->pos = at + i + 1;
                    rc = choose(g, q, st->seq, st, r, rt_argmax(r, V), work, work_bytes, cb, user, err);
                    st0.tokens++;
                    if (rc || st->seq < 0 || i == n_draft[k]) break;
                    int ok = st->out[q->n_out - 1] == drafts[(int64_t)k * R + i];
                    st0.drafted++;
                    observe(st, ok);
                    if (!ok) break;
                    st0.accepted++, kept++;
                }
                if (rc) break;
                track[2 * k] = ids[(int64_t)k * R + kept], track[2 * k + 1] = vpos[(int64_t)k * R + kept];
                if (vp.rollback && st->seq >= 0 && kept < R - 1) rc = npuc_session_rollback(s, k, kept, err);
            }
            continue;
        }
        for (int32_t k = 0; k < B; k++) {
            slot_state *st = &sl[k];
            fed[k] = 0;
            if (st->seq < 0) continue;
            const npuc_sequence *q = &seqs[st->seq];
            int32_t left = q->prompt_len - st->next, f = 0;
            for (int32_t i = 0; i < C; i++) {
                if (i < left) ids[k * C + i] = q->prompt[st->next + i], f++;
                else if (i == left && st->pending >= 0) ids[k * C + i] = st->pending, f++;
                else break;
                pos[k * C + i] = st->pos + i;
            }
            fed[k] = f;
        }
        double t0 = seconds_now();
        rc = npuc_decode_step(s, ids, pos, fed, row, next, err);
        if (rc) break;
        if (sp != NULL) times_add(&times, 0, seconds_now() - t0);
        st0.steps++;
        for (int32_t k = 0; k < B; k++) {
            slot_state *st = &sl[k];
            if (st->seq < 0 || fed[k] == 0) continue;
            npuc_sequence *q = &seqs[st->seq];
            int32_t left = q->prompt_len - st->next;
            int32_t from_prompt = fed[k] < left ? fed[k] : left;
            st->next += from_prompt;
            if (fed[k] > from_prompt) st->pending = -1;
            st->pos += fed[k];
            if (st->next == q->prompt_len && st->pending < 0 && !rc) {
                rc = choose(g, q, st->seq, st, row + (size_t)k * (size_t)V, next[k], work, work_bytes, cb, user, err);
                st0.tokens++;
                if (st->shadow >= 0) /* what the draft's acceptance would have been */
                    observe(st, q->n_out > 0 && st->out[q->n_out - 1] == st->shadow);
                st->shadow = -1;
            }
        }
    }
    free(sl), free(ids), free(fed), free(row), free(next), free(outs), free(work), free(drafts), free(n_draft);
    if (stats != NULL) *stats = st0;
    return rc;
}

int npuc_generate(npuc_session *s, npuc_sequence *seqs, int32_t n_seqs, npuc_token_callback cb, void *user,
                  npuc_error *err) {
    return npuc_generate_speculative(s, seqs, n_seqs, NULL, NULL, cb, user, err);
}
