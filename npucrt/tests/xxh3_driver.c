/* Test driver for sha256.c's XXH3-128 (tests/test_npucrt_loader.py): reads stdin and prints the
 * hex digest of all of it (canonical byte order, as Python's xxhash hexdigest()). */
#include <stdio.h>
#include <stdlib.h>

#include "sha256.h"

static void hex(const uint8_t d[16]) {
    for (int i = 0; i < 16; i++) printf("%02x", d[i]);
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
    uint8_t d[16];
    npuc_xxh3_128(buf, n, d);
    hex(d);
    free(buf);
    return 0;
}
