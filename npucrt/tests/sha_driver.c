/* Test driver for sha256.c (tests/test_npucrt_loader.py): reads stdin and prints two hex digests
 * of it, one from npuc_sha256 and one from the incremental interface fed in uneven pieces. */
#include <stdio.h>
#include <stdlib.h>

#include "model.h"
#include "sha256.h"

static void hex(const uint8_t d[32]) {
    for (int i = 0; i < 32; i++) printf("%02x", d[i]);
    printf("\n");
}

int main(void) {
    size_t cap = (size_t)1 << 20, n = 0, k;
    unsigned char *buf = malloc(cap);
    if (buf == NULL) return 2;
    while ((k = fread(buf + n, 1, cap - n, stdin)) > 0) {
        n += k;
        if (n == cap) {
            unsigned char *more = realloc(buf, cap * 2);
            if (more == NULL) return 2;
            buf = more, cap *= 2;
        }
    }
    uint8_t d[32];
    npuc_sha256(buf, n, d);
    hex(d);
    npuc_sha256_ctx c;
    npuc_sha256_init(&c);
    for (size_t at = 0, step = 1; at < n; step = step * 3 % 197 + 1) {
        size_t t = step < n - at ? step : n - at;
        npuc_sha256_update(&c, buf + at, t);
        at += t;
    }
    npuc_sha256_final(&c, d);
    hex(d);
    free(buf);
    return 0;
}
