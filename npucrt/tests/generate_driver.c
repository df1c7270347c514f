/* Test driver for npuc_generate_speculative (tests/test_recurrent.py), built with ASan and
 * UBSan: on a model compiled with --speculative_tokens K, generates N tokens for each of six
 * prompts (repeating ones, so that n-gram drafts are found and some rejected) with npuc_generate,
 * then with speculation checking every draft (min_gain 0), and checks the tokens equal, that
 * verify steps ran and drafts were rejected (the recurrent states rolled back), and the refusals
 * of bad values. Prints "ok" and exits 0, or says what failed and exits 1.
 *
 *     generate_driver model.om N
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "npucrt.h"

#define FAIL(...) (fprintf(stderr, __VA_ARGS__), fputc('\n', stderr), 1)
#define N_SEQS 6

static const int64_t P0[] = {5, 17, 3, 99, 42, 7, 5, 17, 3, 99, 42, 7};
static const int64_t P1[] = {1, 2, 3, 1, 2, 3};
static const int64_t P2[] = {9, 9, 9, 9, 9, 9, 9, 9};
static const int64_t P3[] = {100, 50, 25, 12, 100, 50, 25, 12};
static const int64_t P4[] = {7, 7, 7, 7};
static const int64_t P5[] = {2, 3, 4, 5, 6, 2, 3, 4, 5, 6};

static int run(npuc_session *s, int32_t n, const npuc_speculation *spec, int64_t *out, npuc_speculation_stats *st,
               npuc_error *err) {
    const int64_t *prompts[N_SEQS] = {P0, P1, P2, P3, P4, P5};
    const int32_t lens[N_SEQS] = {12, 6, 8, 8, 4, 10};
    npuc_sequence seqs[N_SEQS];
    memset(seqs, 0, sizeof seqs);
    for (int q = 0; q < N_SEQS; q++) {
        seqs[q].prompt = prompts[q];
        seqs[q].prompt_len = lens[q];
        seqs[q].max_new_tokens = n - q; /* requests end apart, so queued ones reuse their slots */
        seqs[q].ignore_eos = 1;
        seqs[q].out_tokens = out + (size_t)q * (size_t)n;
    }
    int rc = npuc_generate_speculative(s, seqs, N_SEQS, spec, st, NULL, NULL, err);
    for (int q = 0; !rc && q < N_SEQS; q++)
        if (seqs[q].n_out != n - q) return FAIL("sequence %d: %d tokens, not %d", q, (int)seqs[q].n_out, n - q);
    return rc;
}

int main(int argc, char **argv) {
    if (argc != 3) return FAIL("usage: generate_driver model.om N");
    int32_t n = (int32_t)atoi(argv[2]);
    if (n < N_SEQS + 1) return FAIL("N must be above %d", N_SEQS);
    npuc_model *m = NULL;
    npuc_session *s = NULL;
    npuc_error err = {0};
    int64_t *want = calloc((size_t)(N_SEQS * n), sizeof(int64_t)), *got = calloc((size_t)(N_SEQS * n), sizeof(int64_t));
    int rc = want == NULL || got == NULL ? FAIL("out of memory") : 0;
    if (!rc && (npuc_model_load_file(argv[1], NULL, &m, &err) || npuc_session_create(m, NULL, &s, &err)))
        rc = FAIL("load: %s", err.message);
    npuc_speculation_stats plain = {0}, spec = {0};
    if (!rc && run(s, n, NULL, want, &plain, &err)) rc = FAIL("npuc_generate: %s", err.message);
    npuc_speculation every = {3, 1, 3, 0.0f};
    if (!rc && run(s, n, &every, got, &spec, &err)) rc = FAIL("npuc_generate_speculative: %s", err.message);
    for (int i = 0; !rc && i < N_SEQS * n; i++)
        if (got[i] != want[i]) rc = FAIL("token %d of sequence %d: %lld, not %lld", i % n, i / n, (long long)got[i],
                                         (long long)want[i]);
    if (!rc && (plain.verify_steps != 0 || spec.verify_steps == 0 || spec.drafted <= spec.accepted))
        rc = FAIL("counts: %lld verify steps without speculation, %lld with; %lld drafted, %lld accepted",
                  (long long)plain.verify_steps, (long long)spec.verify_steps, (long long)spec.drafted,
                  (long long)spec.accepted);
    const npuc_speculation bad[] = {{99, 1, 3, 1.0f}, {2, 0, 3, 1.0f}, {2, 3, 1, 1.0f}, {2, 1, 3, -1.0f}};
    for (size_t k = 0; !rc && k < sizeof bad / sizeof bad[0]; k++)
        if (run(s, n, &bad[k], got, NULL, &err) != NPUC_E_ARG) rc = FAIL("bad speculation %d was not refused", (int)k);
    npuc_session_free(s);
    npuc_model_free(m);
    free(want);
    free(got);
    if (!rc) printf("ok\n");
    return rc ? 1 : 0;
}
