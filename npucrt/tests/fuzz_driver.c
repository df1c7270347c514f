/* Execution driver for the sanitized `.om` fuzz run (tests/fuzz/om_fuzz_c.py), built with
 * -fsanitize=address,undefined -fno-sanitize-recover=all from every C file of npucrt/src.
 *
 * Reads a stream of buffers on stdin, each a u64 little-endian length then that many bytes
 * (a length over 256 MiB is a protocol error: exit 3, but for the checkpoint below), and for each:
 *
 *   npuc_model_load_buffer (max_memory 1 GiB: what the file may ask a session for);
 *   if it loads, npuc_session_create with one thread, one npuc_session_run of every program
 *   on zeroed inputs (every index-like input, position, slot, last_token and ids, is then 0:
 *   in range), and, when npuc_model_generation_info succeeds, npuc_generate of one 2-token
 *   prompt for 4 tokens; then everything is freed.
 *
 * and writes one line to stdout: "<load code> <run code> <generate code>", where the run code
 * is the first non-zero code of the session's creation and runs (0 when all succeed; -1 when
 * the model did not load) and the generate code is -1 when generation was not attempted.
 * A broken API contract (a status of 0 without a model, a code that is not err.code) is
 * written to stderr as "CONTRACT: ..." and exits 90. A crash or a sanitizer report ends the
 * process: the caller notices the missing line.
 *
 * Leaks: a length of 2^64 - 1 is a checkpoint, answered "L" once LeakSanitizer has found no
 * leak since the start (a leak is reported on stderr, "LEAK: ..." follows, and exit is 91);
 * without LeakSanitizer, "L" at once. The same check runs at end of input.
 */
#define _POSIX_C_SOURCE 200809L
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "npucrt.h"

#if defined(__SANITIZE_ADDRESS__)
#define FUZZ_LSAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define FUZZ_LSAN 1
#endif
#endif
#ifdef FUZZ_LSAN
int __lsan_do_recoverable_leak_check(void);
#endif

#define MAX_BUFFER ((uint64_t)256 << 20)

static void contract(const char *what, int code) {
    fprintf(stderr, "CONTRACT: %s (code %d)\n", what, code);
    fflush(stderr);
    exit(90);
}

/* The code a call returned, checked against what it wrote to err. */
static int checked(const char *what, int rc, const npuc_error *err) {
    if (rc < 0 || (rc != 0 && rc != err->code)) contract(what, rc);
    return rc;
}

static int run_programs(const npuc_model *m, npuc_session *s) {
    int32_t n = 0;
    if (npuc_model_program_count(m, &n) || n < 1) contract("program_count", n);
    int first = 0;
    for (int32_t p = 0; p < n; p++) {
        int32_t ni = 0, no = 0;
        if (npuc_model_input_count(m, p, &ni) || npuc_model_output_count(m, p, &no) || ni < 0 || no < 0)
            contract("input_count/output_count", p);
        void **in = calloc((size_t)ni + 1, sizeof *in), **out = calloc((size_t)no + 1, sizeof *out);
        uint64_t *in_bytes = calloc((size_t)ni + 1, sizeof *in_bytes),
                 *out_bytes = calloc((size_t)no + 1, sizeof *out_bytes);
        int rc = in == NULL || out == NULL || in_bytes == NULL || out_bytes == NULL ? NPUC_E_ARG : 0;
        for (int32_t i = 0; i < ni + no && !rc; i++) {
            npuc_tensor_info info;
            int q = i < ni ? npuc_model_input(m, p, i, &info) : npuc_model_output(m, p, i - ni, &info);
            if (q || info.name == NULL || info.rank < 0 || info.rank > NPUC_MAX_RANK) contract("tensor info", q);
            /* zeroed: ids, positions, slots and last_token are all 0 */
            void *buf = info.nbytes <= MAX_BUFFER * 4 ? calloc((size_t)info.nbytes + 1, 1) : NULL;
            if (buf == NULL) rc = NPUC_E_ARG;
            if (i < ni) in[i] = buf, in_bytes[i] = info.nbytes;
            else out[i - ni] = buf, out_bytes[i - ni] = info.nbytes;
        }
        if (!rc) {
            npuc_error err;
            memset(&err, 0, sizeof err);
            rc = checked("npuc_session_run", npuc_session_run(s, p, (const void *const *)in, in_bytes, ni, out,
                                                              out_bytes, no, &err), &err);
            const void *view;
            if (!rc && no > 0 && (npuc_session_output_view(s, p, 0, &view) || view == NULL))
                contract("npuc_session_output_view after a run", p);
        }
        for (int32_t i = 0; in != NULL && i < ni; i++) free(in[i]);
        for (int32_t i = 0; out != NULL && i < no; i++) free(out[i]);
        free(in), free(out), free(in_bytes), free(out_bytes);
        if (rc && !first) first = rc;
    }
    return first;
}

static int generate(const npuc_model *m, npuc_session *s) {
    npuc_generation_info g;
    npuc_error err;
    memset(&err, 0, sizeof err);
    int rc = checked("npuc_model_generation_info", npuc_model_generation_info(m, &g, &err), &err);
    if (rc) return -1;
    int64_t prompt[2] = {0, 0}, tokens[4] = {0};
    npuc_sequence q = {.prompt = prompt, .prompt_len = 2, .max_new_tokens = 4, .ignore_eos = 1,
                       .out_tokens = tokens};
    memset(&err, 0, sizeof err);
    rc = checked("npuc_generate", npuc_generate(s, &q, 1, NULL, NULL, &err), &err);
    if (!rc && (q.n_out < 1 || q.n_out > 4 || q.finish_reason < NPUC_FINISH_STOP ||
                q.finish_reason > NPUC_FINISH_CALLBACK))
        contract("npuc_generate: tokens or finish reason", q.n_out);
    for (int32_t i = 0; !rc && i < q.n_out && i < 4; i++)
        if (tokens[i] < 0 || tokens[i] >= g.logits_width) contract("npuc_generate: a token past the logits", i);
    return rc;
}

static void execute(const void *data, size_t size) {
    npuc_load_options lo;
    npuc_load_options_default(&lo);
    lo.max_memory = (uint64_t)1 << 30;
    npuc_model *m = NULL;
    npuc_error err;
    memset(&err, 0, sizeof err);
    int load = checked("npuc_model_load_buffer", npuc_model_load_buffer(data, size, &lo, &m, &err), &err);
    if ((load == 0) != (m != NULL)) contract("load status and model disagree", load);
    int run = -1, gen = -1;
    if (m != NULL) {
        npuc_session_options so;
        npuc_session_options_default(&so);
        so.threads = 1;
        npuc_session *s = NULL;
        memset(&err, 0, sizeof err);
        run = checked("npuc_session_create", npuc_session_create(m, &so, &s, &err), &err);
        if ((run == 0) != (s != NULL)) contract("session status and session disagree", run);
        if (s != NULL) {
            run = run_programs(m, s);
            gen = generate(m, s);
            npuc_session_free(s);
        }
        npuc_model_free(m);
    }
    printf("%d %d %d\n", load, run, gen);
    fflush(stdout);
}

int main(void) {
    size_t cap = 0;
    unsigned char *buf = NULL;
    for (long count = 1;; count++) {
        unsigned char len[8];
        size_t got = fread(len, 1, sizeof len, stdin);
        if (got == 0 && feof(stdin)) break;
        if (got != sizeof len) {
            fprintf(stderr, "PROTOCOL: a length of %zu bytes\n", got);
            return 3;
        }
        uint64_t n = 0;
        for (int i = 7; i >= 0; i--) n = n << 8 | len[i];
        if (n == UINT64_MAX) {
#ifdef FUZZ_LSAN
            if (__lsan_do_recoverable_leak_check()) {
                fprintf(stderr, "LEAK: found by the checkpoint after buffer %ld\n", count - 1);
                return 91;
            }
#endif
            printf("L\n");
            fflush(stdout);
            count--;
            continue;
        }
        if (n > MAX_BUFFER) {
            fprintf(stderr, "PROTOCOL: a buffer of %llu bytes\n", (unsigned long long)n);
            return 3;
        }
        /* exactly n bytes, in a block of its own, so that an overread past the end is ASan's */
        free(buf);
        cap = (size_t)n;
        buf = malloc(cap ? cap : 1);
        if (buf == NULL || fread(buf, 1, cap, stdin) != cap) {
            fprintf(stderr, "PROTOCOL: a buffer cut short\n");
            return 3;
        }
        execute(buf, cap);
    }
    free(buf);
#ifdef FUZZ_LSAN
    if (__lsan_do_recoverable_leak_check()) {
        fprintf(stderr, "LEAK: found at exit\n");
        return 91;
    }
#endif
    return 0;
}
