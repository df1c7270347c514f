/* Test driver for the prefix pool (tests/test_prefix_pool.py), built with ASan and UBSan: on a
 * model of two or more slots compiled with --prefix_cache, prefills a prompt into slot 0 and
 * decodes two tokens (the reference), then again: the prompt into slot 0, its first n positions
 * saved to the last pool entry, other prompts over it and into slot 1, the entry loaded into
 * slot 1, which idles a step (and must not write the row its last prompt ended at), the rest
 * of the prompt and the same two tokens decoded there. Checks every
 * logit equal where the whole prompt was saved and close where the rest went through decode,
 * the refusals of bad arguments, and copy_slot beside the pool. Prints "ok" and exits 0, or
 * says what failed and exits 1.
 *
 *     prefix_driver model.om N ATOL    (N: the positions saved, at most the prompt's 10; ATOL:
 *                                       the logits' tolerance where N < 10)
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "npucrt.h"

#define FAIL(...) (fprintf(stderr, __VA_ARGS__), fputc('\n', stderr), 1)

static const int64_t PROMPT[10] = {5, 17, 3, 99, 42, 7, 64, 11, 2, 3};
static const int64_t OTHER[12] = {9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9};

/* One decode step of slot k alone (the others idle); its logits row into row. */
static int step(npuc_session *s, const npuc_generation_info *g, int32_t k, int64_t token, int64_t pos, float *row,
                npuc_error *err) {
    int32_t B = g->slots, C = g->decode_tokens;
    int64_t *ids = calloc((size_t)(2 * B * C), sizeof(int64_t));
    int32_t *fed = calloc((size_t)B, sizeof(int32_t));
    float *all = malloc((size_t)(B * g->logits_width) * sizeof(float));
    int rc = NPUC_E_ARG;
    if (ids != NULL && fed != NULL && all != NULL) {
        for (int32_t i = 0; i < C; i++) ids[k * C + i] = token, ids[B * C + k * C + i] = pos;
        fed[k] = 1;
        rc = npuc_decode_step(s, ids, ids + B * C, fed, all, NULL, err);
        if (!rc) memcpy(row, all + (int64_t)k * g->logits_width, (size_t)g->logits_width * sizeof(float));
    }
    free(ids), free(fed), free(all);
    return rc;
}

int main(int argc, char **argv) {
    if (argc != 4) return FAIL("usage: prefix_driver model.om N ATOL");
    int64_t n = strtoll(argv[2], NULL, 10);
    float atol = strtof(argv[3], NULL);
    npuc_model *m = NULL;
    npuc_session *s = NULL;
    npuc_error err;
    memset(&err, 0, sizeof err);
    if (npuc_model_load_file(argv[1], NULL, &m, &err) || npuc_session_create(m, NULL, &s, &err))
        return FAIL("load: %s", err.message);
    npuc_generation_info g;
    int32_t entries = 0;
    uint64_t pool = 0, arena = 0, state = 0;
    if (npuc_model_generation_info(m, &g, &err) || npuc_model_prefix_pool(m, &entries, &pool, &err) ||
        npuc_model_memory(m, &arena, &state, NULL))
        return FAIL("queries: %s", err.message);
    if (g.slots < 2 || entries < 1 || pool == 0 || pool >= state || n < 1 || n > 10)
        return FAIL("slots %d, entries %d, pool %llu of %llu state bytes, n %lld", (int)g.slots, (int)entries,
                    (unsigned long long)pool, (unsigned long long)state, (long long)n);
    int64_t V = g.logits_width;
    float *want = malloc((size_t)(3 * V) * sizeof(float)), *got = want + V, *row = want + 2 * V;
    if (want == NULL) return FAIL("out of memory");
    int status = 0;
    /* the reference: the prompt, then tokens 1 and 2 */
    int rc = npuc_prefill(s, 0, PROMPT, 10, row, NULL, &err);
    if (!rc) rc = step(s, &g, 0, 1, 10, row, &err);
    if (!rc) rc = step(s, &g, 0, 2, 11, want, &err);
    /* through the pool, into slot 1 */
    npuc_session_reset(s);
    int32_t e = entries - 1;
    if (!rc) rc = npuc_prefill(s, 0, PROMPT, 10, row, NULL, &err);
    if (!rc) rc = npuc_session_prefix_save(s, 0, e, n, &err);
    if (!rc) rc = npuc_prefill(s, 0, OTHER, 12, row, NULL, &err);
    if (!rc) rc = npuc_prefill(s, 1, OTHER, 3, row, NULL, &err); /* shorter: its last row lies in the prefix */
    if (!rc) rc = npuc_session_prefix_load(s, e, 1, n, &err);
    if (!rc) rc = step(s, &g, 0, 4, 12, row, &err); /* slot 1 idles once after its load */
    for (int64_t i = n; i < 10 && !rc; i++) rc = step(s, &g, 1, PROMPT[i], i, row, &err);
    if (!rc) rc = step(s, &g, 1, 1, 10, row, &err);
    if (!rc) rc = step(s, &g, 1, 2, 11, got, &err);
    if (rc) status = FAIL("run: %s", err.message);
    for (int64_t i = 0; i < V && !status; i++) {
        float d = fabsf(want[i] - got[i]);
        if (n == 10 ? want[i] != got[i] : !(d <= atol))
            status = FAIL("logit %lld: %g through the pool, %g straight", (long long)i, (double)got[i],
                          (double)want[i]);
    }
    /* refusals: each the input code, nothing copied */
    struct { int32_t slot, entry; int64_t n; } bad[] = {
        {0, entries, 1}, {0, -1, 1}, {g.slots, 0, 1}, {-1, 0, 1}, {0, 0, 0}, {0, 0, (int64_t)g.max_seq_len + 1},
        {0, 0, INT64_MAX}, {0, 0, INT64_MIN}};
    for (size_t k = 0; k < sizeof bad / sizeof bad[0] && !status; k++) {
        memset(&err, 0, sizeof err);
        if (npuc_session_prefix_save(s, bad[k].slot, bad[k].entry, bad[k].n, &err) != NPUC_E_INPUT ||
            err.code != NPUC_E_INPUT || npuc_session_prefix_load(s, bad[k].entry, bad[k].slot, bad[k].n, NULL) !=
                                            NPUC_E_INPUT)
            status = FAIL("bad arguments %zu: %d %s", k, err.code, err.message);
    }
    if (!status && (npuc_session_prefix_save(NULL, 0, 0, 1, &err) != NPUC_E_ARG ||
                    npuc_session_prefix_load(NULL, 0, 0, 1, NULL) != NPUC_E_ARG ||
                    npuc_model_prefix_pool(NULL, NULL, NULL, NULL) != NPUC_E_ARG ||
                    npuc_model_prefix_pool(m, NULL, NULL, NULL) != NPUC_OK))
        status = FAIL("NULL arguments");
    /* the whole cache, both ways, and copy_slot beside the pool */
    if (!status && (npuc_session_prefix_save(s, 1, 0, g.max_seq_len, &err) ||
                    npuc_session_prefix_load(s, 0, 0, g.max_seq_len, &err) || npuc_session_copy_slot(s, 0, 1, &err) ||
                    step(s, &g, 0, 4, g.max_seq_len - 1, row, &err)))
        status = FAIL("full prefix and copy_slot: %s", err.message);
    free(want);
    npuc_session_free(s);
    npuc_model_free(m);
    if (!status) puts("ok");
    return status;
}
