/* The `.om` checksums (sha256.c). SHA-256: one call (npuc_sha256, declared in model.h) or
 * incremental, for data that comes in pieces; the x86 SHA extensions are used where the CPU has
 * them. XXH3-128 (the weights' chunk checksum): one call, from the vendored xxHash header. */
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

/* XXH3-128 (seed 0) of `n` bytes, in xxHash's canonical (big-endian) byte order: the bytes
 * Python's xxhash.xxh3_128(data).digest() gives. */
void npuc_xxh3_128(const void *data, size_t n, uint8_t out[16]);

#endif /* NPUCRT_SHA256_H */
