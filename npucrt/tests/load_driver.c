/* Test driver for the loader (tests/test_npucrt_loader.py), built with ASan and UBSan: loads
 * each file named on the command line with npuc_model_load_file (and, with -b, also from a
 * buffer read into memory), runs the model queries on what loads, frees it, and prints one line
 * per file: "<code>\t<message>". Exit status 0 unless a call misbehaves (a load that says 0
 * without a model, or codes that differ between the file and the buffer). */
#define _POSIX_C_SOURCE 200809L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "npucrt.h"

static int queries(const npuc_model *m) {
    int32_t n = 0;
    if (npuc_model_program_count(m, &n) || n < 1) return 1;
    for (int32_t p = 0; p < n; p++) {
        const char *name;
        int32_t found, ni, no;
        if (npuc_model_program_name(m, p, &name) || npuc_model_find_program(m, name, &found)) return 1;
        if (npuc_model_input_count(m, p, &ni) || npuc_model_output_count(m, p, &no)) return 1;
        for (int32_t i = 0; i < ni + no; i++) {
            npuc_tensor_info info;
            int rc = i < ni ? npuc_model_input(m, p, i, &info) : npuc_model_output(m, p, i - ni, &info);
            if (rc || info.name == NULL || info.rank < 0 || info.rank > NPUC_MAX_RANK) return 1;
        }
    }
    uint64_t a, s, w;
    const char *v;
    const void *d;
    uint64_t size;
    if (npuc_model_memory(m, &a, &s, &w)) return 1;
    if (npuc_model_metadata(m, "max_seq_len", &v) == 0 && v == NULL) return 1;
    if (npuc_model_section(m, "weights", &d, &size) || size != w) return 1;
    return 0;
}

static void *read_all(const char *path, size_t *size) {
    FILE *f = fopen(path, "rb");
    if (f == NULL) return NULL;
    size_t cap = 1 << 16, n = 0, k;
    char *buf = malloc(cap);
    while (buf != NULL && (k = fread(buf + n, 1, cap - n, f)) > 0) {
        n += k;
        if (n == cap) {
            char *more = realloc(buf, cap *= 2);
            if (more == NULL) free(buf);
            buf = more;
        }
    }
    fclose(f);
    *size = n;
    return buf;
}

int main(int argc, char **argv) {
    int status = 0, buffers = 0;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "-b") == 0) {
            buffers = 1;
            continue;
        }
        npuc_model *m = NULL;
        npuc_error err;
        memset(&err, 0, sizeof err);
        int rc = npuc_model_load_file(argv[i], NULL, &m, &err);
        if ((rc == 0) != (m != NULL) || (rc != 0 && rc != err.code)) status = 1;
        if (m != NULL && queries(m)) status = 1;
        npuc_model_free(m);
        printf("%d\t%s\n", rc, rc ? err.message : "");
        if (buffers && rc != NPUC_E_OPEN) {
            /* The same bytes from memory: the same answer (but the path in the message). */
            size_t size = 0;
            void *data = read_all(argv[i], &size);
            if (data == NULL) continue;
            npuc_model *mb = NULL;
            npuc_error eb;
            int rb = npuc_model_load_buffer(data, size, NULL, &mb, &eb);
            if (rb != rc || (mb != NULL && queries(mb))) status = 1;
            npuc_model_free(mb);
            free(data);
        }
    }
    return status;
}
