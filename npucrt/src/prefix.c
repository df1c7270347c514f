/* The prefix pool (--prefix_cache): prompt prefixes kept in the state region beside the slots'
 * caches, for a request whose prompt starts with one already computed.
 *
 * A model compiled with `--prefix_cache P` has, for every state cached by position (the KV,
 * latent and conv caches), a pool tensor of P entries in that state's per-slot layout
 * (validate.c's check_prefix_pool reads them from metadata prefix_pool into m->prefix). No
 * program touches the pool: these copies are its only readers and writers, so a prefix of n
 * tokens moves n positions of every cache between a slot and an entry, whatever max_seq_len.
 * Which prompt an entry holds, and which entry to reuse or evict, is the caller's to keep.
 */
#include <stdio.h>
#include <string.h>

#include "exec.h"

int npuc_model_prefix_pool(const npuc_model *m, int32_t *entries, uint64_t *bytes, npuc_error *err) {
    if (m == NULL) return rt_fail(err, NPUC_E_ARG, "", "a NULL argument");
    if (entries != NULL) *entries = m->prefix_entries;
    if (bytes != NULL) *bytes = m->prefix_bytes;
    return NPUC_OK;
}

/* The arguments' checks (runtime/session.py's check_prefix_args words them alike), then every
 * state's own: the slot, the entry and n positions inside it, before any byte moves. */
static int prefix_args(const npuc_model *m, int32_t slot, int32_t entry, int64_t n, npuc_error *err) {
    char hint[64];
    if (m->prefix_entries == 0)
        return rt_fail(err, NPUC_E_INPUT, "compile it with --prefix_cache P (and --max_seq_len N)",
                       "the model has no prefix pool");
    if (entry < 0 || entry >= m->prefix_entries) {
        snprintf(hint, sizeof hint, "entries are 0..%d", (int)m->prefix_entries - 1);
        return rt_fail(err, NPUC_E_INPUT, hint, "prefix entry %d is outside the model's %d entries", (int)entry,
                       (int)m->prefix_entries);
    }
    if (slot < 0 || slot >= m->slots) {
        snprintf(hint, sizeof hint, "slots are 0..%d", (int)m->slots - 1);
        return rt_fail(err, NPUC_E_INPUT, hint, "slot %d is outside the model's %d slots", (int)slot, (int)m->slots);
    }
    if (n < 1 || n > m->cache_rows)
        return rt_fail(err, NPUC_E_INPUT, "a prefix is 1 to --max_seq_len positions",
                       "a prefix of %lld positions: the model caches 1 to %d", (long long)n, (int)m->cache_rows);
    for (int32_t k = 0; k < m->n_prefix; k++) {
        const rt_prefix *p = &m->prefix[k];
        const rt_tensor *t = &m->tensors[p->state], *q = &m->tensors[p->pool];
        if (slot >= t->shape[0] || entry >= q->shape[0] || n > t->shape[p->axis])
            return rt_fail(err, NPUC_E_INPUT, "", "state %s holds %lld slots of %lld positions; its pool %lld entries",
                           t->name, (long long)t->shape[0], (long long)t->shape[p->axis], (long long)q->shape[0]);
    }
    return NPUC_OK;
}

/* Positions 0..n-1 of one state between slot `slot` and pool entry `entry`. The state is
 * [slots, outer..., positions, inner...]: per slot, `outer` runs of the positions, each of
 * `span` bytes, of which the first n * inner move. validate.c checked that every product
 * here is at most the tensor's bytes, and the tensors lie inside the state region. */
static void copy_positions(uint8_t *state, const npuc_model *m, const rt_prefix *p, int32_t slot, int32_t entry,
                           int64_t n, int to_pool) {
    const rt_tensor *t = &m->tensors[p->state], *q = &m->tensors[p->pool];
    uint64_t inner = (uint64_t)npuc_dtype_size(t->dtype), outer = 1;
    for (int32_t d = p->axis + 1; d < t->rank; d++) inner *= (uint64_t)t->shape[d];
    for (int32_t d = 1; d < p->axis; d++) outer *= (uint64_t)t->shape[d];
    uint64_t span = (uint64_t)t->shape[p->axis] * inner, row = outer * span;
    uint8_t *a = state + t->offset + row * (uint64_t)slot, *b = state + q->offset + row * (uint64_t)entry;
    uint8_t *dst = to_pool ? b : a;
    const uint8_t *src = to_pool ? a : b;
    for (uint64_t o = 0; o < outer; o++) memmove(dst + o * span, src + o * span, (size_t)((uint64_t)n * inner));
}

int npuc_session_prefix_save(npuc_session *s, int32_t slot, int32_t entry, int64_t n_positions, npuc_error *err) {
    if (s == NULL) return rt_fail(err, NPUC_E_ARG, "", "a NULL argument");
    const npuc_model *m = rt_session_model(s);
    int rc = prefix_args(m, slot, entry, n_positions, err);
    if (rc) return rc;
    for (int32_t k = 0; k < m->n_prefix; k++)
        copy_positions(rt_session_state(s), m, &m->prefix[k], slot, entry, n_positions, 1);
    return NPUC_OK;
}

int npuc_session_prefix_load(npuc_session *s, int32_t entry, int32_t slot, int64_t n_positions, npuc_error *err) {
    if (s == NULL) return rt_fail(err, NPUC_E_ARG, "", "a NULL argument");
    const npuc_model *m = rt_session_model(s);
    int rc = prefix_args(m, slot, entry, n_positions, err);
    if (rc) return rc;
    for (int32_t k = 0; k < m->n_prefix; k++)
        copy_positions(rt_session_state(s), m, &m->prefix[k], slot, entry, n_positions, 0);
    /* What an idle decode step feeds this slot (decode.c): the rows before n are the prefix's,
     * whose last token the pool does not keep, so token 0 at position n, a row the slot's next
     * step writes before any query reads it (the last row where n fills the cache). */
    if (m->has_gen && slot < m->gen.slots) {
        int64_t *track = rt_session_slot_track(s);
        track[2 * slot] = 0;
        track[2 * slot + 1] = n_positions < m->cache_rows ? n_positions : m->cache_rows - 1;
    }
    return NPUC_OK;
}
