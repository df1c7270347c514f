/* The `.om` checksums. SHA-256 (FIPS 180-4), of every header section and the section table:
 * portable C, plus the x86 SHA extensions (SHA-NI), chosen at run time by CPUID. XXH3-128, of
 * each weights chunk: xxHash's own code (third_party/xxhash.h, BSD-2-Clause), inlined here so
 * that no symbol of it leaves the library and an application linking its own xxHash is unaffected.
 */
#include <string.h>

#include "model.h"
#include "sha256.h"

/* NPUC_NO_SHA_NI (a build macro) keeps the portable rounds only: the tests check both paths. */
#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__)) && !defined(NPUC_NO_SHA_NI)
#define NPUC_SHA_NI 1
#include <cpuid.h>
#include <immintrin.h>
#endif

static const uint32_t K[64] = {
    0x428a2f98u, 0x71374491u, 0xb5c0fbcfu, 0xe9b5dba5u, 0x3956c25bu, 0x59f111f1u, 0x923f82a4u, 0xab1c5ed5u,
    0xd807aa98u, 0x12835b01u, 0x243185beu, 0x550c7dc3u, 0x72be5d74u, 0x80deb1feu, 0x9bdc06a7u, 0xc19bf174u,
    0xe49b69c1u, 0xefbe4786u, 0x0fc19dc6u, 0x240ca1ccu, 0x2de92c6fu, 0x4a7484aau, 0x5cb0a9dcu, 0x76f988dau,
    0x983e5152u, 0xa831c66du, 0xb00327c8u, 0xbf597fc7u, 0xc6e00bf3u, 0xd5a79147u, 0x06ca6351u, 0x14292967u,
    0x27b70a85u, 0x2e1b2138u, 0x4d2c6dfcu, 0x53380d13u, 0x650a7354u, 0x766a0abbu, 0x81c2c92eu, 0x92722c85u,
    0xa2bfe8a1u, 0xa81a664bu, 0xc24b8b70u, 0xc76c51a3u, 0xd192e819u, 0xd6990624u, 0xf40e3585u, 0x106aa070u,
    0x19a4c116u, 0x1e376c08u, 0x2748774cu, 0x34b0bcb5u, 0x391c0cb3u, 0x4ed8aa4au, 0x5b9cca4fu, 0x682e6ff3u,
    0x748f82eeu, 0x78a5636fu, 0x84c87814u, 0x8cc70208u, 0x90befffau, 0xa4506cebu, 0xbef9a3f7u, 0xc67178f2u,
};

static inline uint32_t ror(uint32_t x, unsigned n) { return (x >> n) | (x << (32u - n)); }

static void blocks_portable(uint32_t h[8], const uint8_t *p, size_t nblocks) {
    for (; nblocks; nblocks--, p += 64) {
        uint32_t w[64];
        for (int i = 0; i < 16; i++)
            w[i] = (uint32_t)p[4 * i] << 24 | (uint32_t)p[4 * i + 1] << 16 | (uint32_t)p[4 * i + 2] << 8 |
                   (uint32_t)p[4 * i + 3];
        for (int i = 16; i < 64; i++) {
            uint32_t s0 = ror(w[i - 15], 7) ^ ror(w[i - 15], 18) ^ (w[i - 15] >> 3);
            uint32_t s1 = ror(w[i - 2], 17) ^ ror(w[i - 2], 19) ^ (w[i - 2] >> 10);
            w[i] = w[i - 16] + s0 + w[i - 7] + s1;
        }
        uint32_t a = h[0], b = h[1], c = h[2], d = h[3], e = h[4], f = h[5], g = h[6], hh = h[7];
        for (int i = 0; i < 64; i++) {
            uint32_t t1 = hh + (ror(e, 6) ^ ror(e, 11) ^ ror(e, 25)) + ((e & f) ^ (~e & g)) + K[i] + w[i];
            uint32_t t2 = (ror(a, 2) ^ ror(a, 13) ^ ror(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
            hh = g, g = f, f = e, e = d + t1, d = c, c = b, b = a, a = t1 + t2;
        }
        h[0] += a, h[1] += b, h[2] += c, h[3] += d, h[4] += e, h[5] += f, h[6] += g, h[7] += hh;
    }
}

#ifdef NPUC_SHA_NI
/* The state is kept as ABEF / CDGH, the order sha256rnds2 wants; each iteration of the loop does
 * four rounds, and from the fifth on computes the next four message words with msg1/msg2. */
__attribute__((target("sha,sse4.1,ssse3"))) static void blocks_ni(uint32_t h[8], const uint8_t *p, size_t nblocks) {
    const __m128i bswap = _mm_set_epi64x(0x0c0d0e0f08090a0bLL, 0x0405060700010203LL);
    __m128i tmp = _mm_loadu_si128((const __m128i *)(const void *)&h[0]);
    __m128i st1 = _mm_loadu_si128((const __m128i *)(const void *)&h[4]);
    tmp = _mm_shuffle_epi32(tmp, 0xb1);        /* CDAB */
    st1 = _mm_shuffle_epi32(st1, 0x1b);        /* EFGH */
    __m128i st0 = _mm_alignr_epi8(tmp, st1, 8); /* ABEF */
    st1 = _mm_blend_epi16(st1, tmp, 0xf0);     /* CDGH */
    for (; nblocks; nblocks--, p += 64) {
        __m128i abef = st0, cdgh = st1;
        __m128i w[4];
        for (int i = 0; i < 16; i++) {
            __m128i m;
            if (i < 4) {
                m = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)(const void *)(p + 16 * i)), bswap);
            } else {
                /* w[i&3] holds W(i-4), then W(i-3), W(i-2), W(i-1) round the ring. */
                m = _mm_sha256msg1_epu32(w[i & 3], w[(i + 1) & 3]);
                m = _mm_add_epi32(m, _mm_alignr_epi8(w[(i + 3) & 3], w[(i + 2) & 3], 4));
                m = _mm_sha256msg2_epu32(m, w[(i + 3) & 3]);
            }
            w[i & 3] = m;
            __m128i k = _mm_add_epi32(m, _mm_loadu_si128((const __m128i *)(const void *)&K[4 * i]));
            st1 = _mm_sha256rnds2_epu32(st1, st0, k);
            k = _mm_shuffle_epi32(k, 0x0e);
            st0 = _mm_sha256rnds2_epu32(st0, st1, k);
        }
        st0 = _mm_add_epi32(st0, abef);
        st1 = _mm_add_epi32(st1, cdgh);
    }
    tmp = _mm_shuffle_epi32(st0, 0x1b);        /* FEBA */
    st1 = _mm_shuffle_epi32(st1, 0xb1);        /* DCHG */
    st0 = _mm_blend_epi16(tmp, st1, 0xf0);     /* DCBA */
    st1 = _mm_alignr_epi8(st1, tmp, 8);        /* HGFE */
    _mm_storeu_si128((__m128i *)(void *)&h[0], st0);
    _mm_storeu_si128((__m128i *)(void *)&h[4], st1);
}

/* CPUID each time a hash starts (a few hundred cycles): no global state to initialise. */
static int have_sha_ni(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
    if (!(c & (1u << 19)) || !(c & (1u << 9))) return 0; /* SSE4.1, SSSE3 */
    if (__get_cpuid_max(0, NULL) < 7) return 0;
    __cpuid_count(7, 0, a, b, c, d);
    return (b >> 29) & 1u; /* SHA */
}
#endif

static void blocks(npuc_sha256_ctx *c, const uint8_t *p, size_t nblocks) {
#ifdef NPUC_SHA_NI
    if (c->ni) {
        blocks_ni(c->h, p, nblocks);
        return;
    }
#endif
    blocks_portable(c->h, p, nblocks);
}

void npuc_sha256_init(npuc_sha256_ctx *c) {
    static const uint32_t H0[8] = {0x6a09e667u, 0xbb67ae85u, 0x3c6ef372u, 0xa54ff53au,
                                   0x510e527fu, 0x9b05688cu, 0x1f83d9abu, 0x5be0cd19u};
    memcpy(c->h, H0, sizeof H0);
    c->bytes = 0;
    c->n = 0;
#ifdef NPUC_SHA_NI
    c->ni = have_sha_ni();
#else
    c->ni = 0;
#endif
}

void npuc_sha256_update(npuc_sha256_ctx *c, const void *data, size_t n) {
    const uint8_t *p = data;
    c->bytes += n;
    if (c->n) {
        size_t take = 64 - c->n < n ? 64 - c->n : n;
        memcpy(c->buf + c->n, p, take);
        c->n += take, p += take, n -= take;
        if (c->n < 64) return;
        blocks(c, c->buf, 1);
        c->n = 0;
    }
    if (n >= 64) {
        blocks(c, p, n / 64);
        p += n / 64 * 64;
        n %= 64;
    }
    if (n) {
        memcpy(c->buf, p, n);
        c->n = n;
    }
}

void npuc_sha256_final(npuc_sha256_ctx *c, uint8_t out[32]) {
    uint64_t bits = c->bytes * 8u;
    c->buf[c->n++] = 0x80;
    if (c->n > 56) {
        memset(c->buf + c->n, 0, 64 - c->n);
        blocks(c, c->buf, 1);
        c->n = 0;
    }
    memset(c->buf + c->n, 0, 56 - c->n);
    for (int i = 0; i < 8; i++) c->buf[56 + i] = (uint8_t)(bits >> (56 - 8 * i));
    blocks(c, c->buf, 1);
    for (int i = 0; i < 8; i++) {
        out[4 * i] = (uint8_t)(c->h[i] >> 24);
        out[4 * i + 1] = (uint8_t)(c->h[i] >> 16);
        out[4 * i + 2] = (uint8_t)(c->h[i] >> 8);
        out[4 * i + 3] = (uint8_t)c->h[i];
    }
    memset(c, 0, sizeof *c);
}

void npuc_sha256(const void *data, size_t n, uint8_t out[32]) {
    npuc_sha256_ctx c;
    npuc_sha256_init(&c);
    npuc_sha256_update(&c, data, n);
    npuc_sha256_final(&c, out);
}

/* ---- XXH3-128 ------------------------------------------------------------------------------ */

/* Inlined, all static: the library exports none of xxHash's names. The header builds clean
 * under the loader's warnings (-Wall -Wextra -Wpedantic -Wshadow -Wconversion -Werror). */
#define XXH_INLINE_ALL
#include "third_party/xxhash.h"

void npuc_xxh3_128(const void *data, size_t n, uint8_t out[16]) {
    XXH128_canonical_t c;
    XXH128_canonicalFromHash(&c, XXH3_128bits(data, n));
    memcpy(out, c.digest, 16);
}
