/* SHA-256 (sha256.c): one call (npuc_sha256, declared in model.h) or incremental, for data
 * that comes in pieces. The x86 SHA extensions are used where the CPU has them. */
#ifndef NPUCRT_SHA256_H
#define NPUCRT_SHA256_H

#include <stddef.h>
#include <stdint.h>

typedef struct npuc_sha256_ctx {
    uint32_t h[8];
    uint64_t bytes;     /* hashed so far */
    uint8_t buf[64];    /* a partial block */
    size_t n;           /* bytes in buf */
    int ni;             /* 1: the SHA-NI block function */
} npuc_sha256_ctx;

void npuc_sha256_init(npuc_sha256_ctx *c);
void npuc_sha256_update(npuc_sha256_ctx *c, const void *data, size_t n);
void npuc_sha256_final(npuc_sha256_ctx *c, uint8_t out[32]);

#endif /* NPUCRT_SHA256_H */
