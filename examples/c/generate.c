/* Greedy generation with libnpucrt: load a .om, make a session, generate with a callback that
 * prints each token as it comes, in the form `npuc generate --prompt-ids` prints them.
 *
 *   generate [MODEL.om [MAX_NEW_TOKENS [ID ...]]]    (default: the bundled tiny Llama, 16, 1 15 27 300 42)
 */
#include <stdio.h>
#include <stdlib.h>

#include <npucrt.h>

#ifndef DEFAULT_MODEL
#define DEFAULT_MODEL "build/tiny-llama.om"
#endif

/* Called once per new token; returning non-zero would end the sequence early. */
static int print_token(void *user, int32_t sequence, int64_t token) {
    int *printed = user;
    (void)sequence; /* one prompt here; with several, each token says whose it is */
    printf(*printed ? " %lld" : "%lld", (long long)token);
    fflush(stdout);
    *printed += 1;
    return 0;
}

/* Every npuc_* call returns 0 or an NPUC-E code, with npuc's message and hint in `err`. */
static int fail(int code, const npuc_error *err) {
    char name[16];
    npuc_code_string(code, name, sizeof name);
    fprintf(stderr, "generate: error %s: %s\n  hint: %s\n", name, err->message, err->hint);
    return 1;
}

int main(int argc, char **argv) {
    const char *path = argc > 1 ? argv[1] : DEFAULT_MODEL;
    int max_new = argc > 2 ? atoi(argv[2]) : 16;
    int64_t fallback[] = {1, 15, 27, 300, 42}, prompt[256];
    int n = 0;
    for (int i = 3; i < argc && n < 256; i++) {
        prompt[n++] = strtoll(argv[i], NULL, 10);
    }
    if (n == 0) {
        for (n = 0; n < 5; n++) {
            prompt[n] = fallback[n];
        }
    }

    npuc_error err = {0};
    npuc_load_options load_opts; /* checksums verified, memory capped at physical memory */
    npuc_load_options_default(&load_opts);
    npuc_model *model = NULL;
    int rc = npuc_model_load_file(path, &load_opts, &model, &err);
    if (rc != NPUC_OK) {
        return fail(rc, &err);
    }
    npuc_session_options session_opts; /* a thread per online CPU, prefill's weights packed */
    npuc_session_options_default(&session_opts);
    npuc_session *session = NULL;
    rc = npuc_session_create(model, &session_opts, &session, &err);
    if (rc != NPUC_OK) {
        npuc_model_free(model);
        return fail(rc, &err);
    }

    npuc_sequence seq = {.prompt = prompt, .prompt_len = n, .max_new_tokens = max_new};
    int printed = 0;
    rc = npuc_generate(session, &seq, 1, print_token, &printed, &err);
    printf("\n");
    npuc_session_free(session);
    npuc_model_free(model);
    return rc == NPUC_OK ? 0 : fail(rc, &err);
}
