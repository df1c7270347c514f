/* Integer-activation products (qlinear with act_bits 8: --quant_type w8a8 and w4a8).
 *
 * ir/quant.py states the arithmetic, and its torch kernel is the reference: the activations
 * are quantized per row and per block of 32 along K, symmetric int8,
 *
 *   sx[m, b] = max|x[m, b]| / 127,   qx[m, k] = round_even(x[m, k] * (127 / max|x[m, b]|))
 *
 * and each block's integer dot product is taken in int32 against the weight's codes,
 *
 *   y[m, n] = sum_b sw[n, b] * sx[m, b] * (sum_{k in b} code[n, k] * qx[m, k] - zero[n, b] * sum_{k in b} qx[m, k])
 *
 * (sw and zero are the weight group's that holds block b; groups are multiples of 32).
 *
 * Weights are laid out for the kernel once, at bind (npuc_i8_pack): row panels of 8 output
 * channels, each block of 32 as 4-byte quads of the 8 rows side by side, so that one
 * u8 x s8 dot-product instruction (VNNI's vpdpbusd: 32 products into 8 int32 lanes) takes a
 * quad of every row against one broadcast quad of x, and after a block's 8 quads the lanes
 * hold the 8 rows' block sums: one conversion and one FMA per 8 rows and block, and no
 * horizontal sums. 8-bit codes are stored offset by 128 (u8 = code ^ 0x80, its zero point
 * then 128 more); 4-bit codes two quads a byte (quad j in the low nibbles, quad j + 4 in the
 * high ones). Each (panel, block) is followed by the 8 rows' f16 scales and u8 zero points.
 * Its speed, per shape and thread count: docs/performance.md.
 *
 * Paths: AVX-512 VNNI (256-bit, EVEX), AVX-VNNI, AVX2 (vpmaddubsw, which saturates past
 * 32767: 8-bit codes go through the sign trick, 4-bit ones fit), and plain C. All are exact
 * in int32; the float sums differ from torch's only in their order.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <math.h>
#include "kernels.h"
#include "simd.h"
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define I8_AVX2 1
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define I8_DPBUSD(acc, a, b) _mm256_dpbusd_epi32(acc, a, b)
#elif defined(__AVXVNNI__)
#define I8_DPBUSD(acc, a, b) _mm256_dpbusd_avx_epi32(acc, a, b)
#endif
#endif

#define I8_ROWS 8  /* output channels a panel */
#define I8_BLOCK 32
#define I8_MR 8    /* activation rows a tile, at most */
#define I8_PREFETCH_BLOCKS 8

/* Bytes of one (panel, block): the codes, then 8 f16 scales and 8 u8 zero points. */
static i64 block_bytes(int bits) { return (bits == 8 ? 256 : 128) + I8_ROWS * 2 + I8_ROWS; }

i64 npuc_i8_packed_bytes(int bits, i64 N, i64 K) {
    return (N + I8_ROWS - 1) / I8_ROWS * (K / I8_BLOCK) * block_bytes(bits);
}

static int code_of(const uint8_t *q, int bits, i64 K, i64 n, i64 k) {
    if (bits == 8) return ((const int8_t *)q)[n * K + k];
    uint8_t b = q[n * (K / 2) + k / 2];
    return (k & 1) ? b >> 4 : b & 15;
}

int npuc_i8_pack(const uint8_t *q, int bits, const uint16_t *scale, const uint8_t *zero, i64 N, i64 K, i64 G,
                 uint8_t *packed) {
    if ((bits != 4 && bits != 8) || K % I8_BLOCK || G < I8_BLOCK || G % I8_BLOCK || K % G) return 1;
    const i64 blocks = K / I8_BLOCK, groups = K / G, bb = block_bytes(bits), cb = bits == 8 ? 256 : 128;
    for (i64 p = 0; p < (N + I8_ROWS - 1) / I8_ROWS; p++)
        for (i64 b = 0; b < blocks; b++) {
            uint8_t *dst = packed + (p * blocks + b) * bb;
            uint16_t *sc = (uint16_t *)(void *)(dst + cb);
            uint8_t *zp = dst + cb + I8_ROWS * 2;
            memset(dst, 0, (size_t)bb);
            for (int r = 0; r < I8_ROWS; r++) {
                i64 n = p * I8_ROWS + r;
                if (n >= N) { /* a padding row: zero codes, scale 0 (its results are not stored) */
                    if (bits == 8) for (int j = 0; j < 8; j++) memset(dst + j * 32 + r * 4, 0x80, 4);
                    sc[r] = 0, zp[r] = bits == 8 ? 128 : 0;
                    continue;
                }
                i64 g = b * I8_BLOCK / G;
                for (int t = 0; t < I8_BLOCK; t++) {
                    int c = code_of(q, bits, K, n, b * I8_BLOCK + t);
                    if (bits == 8) dst[(t / 4) * 32 + r * 4 + t % 4] = (uint8_t)(c + 128);
                    else if (t < 16) dst[(t / 4) * 32 + r * 4 + t % 4] |= (uint8_t)c;
                    else dst[((t - 16) / 4) * 32 + r * 4 + t % 4] |= (uint8_t)(c << 4);
                }
                sc[r] = scale[n * groups + g];
                zp[r] = bits == 8 ? (uint8_t)(((const int8_t *)zero)[n * groups + g] + 128) : zero[n * groups + g];
            }
        }
    return 0;
}

/* ---- the activations: int8 per block of 32, with each block's scale and sum ------------- */

typedef struct {
    const void *x; int xbf; i64 xs, K; int8_t *q; float *sx; int32_t *sum;
} quant_job;

static void quant_row(const quant_job *j, i64 m) {
    const i64 blocks = j->K / I8_BLOCK;
    for (i64 b = 0; b < blocks; b++) {
        float v[I8_BLOCK], amax = 0;
        for (int t = 0; t < I8_BLOCK; t++) {
            i64 at = m * j->xs + b * I8_BLOCK + t;
            v[t] = j->xbf ? npuc_bf16_to_f32(((const uint16_t *)j->x)[at]) : ((const float *)j->x)[at];
            float a = fabsf(v[t]);
            amax = a > amax ? a : amax;
        }
        float inv = amax > 0 ? 127.0f / amax : 0.0f;
        int8_t *q = j->q + m * j->K + b * I8_BLOCK;
        int32_t s = 0;
        for (int t = 0; t < I8_BLOCK; t++) {
            float r = nearbyintf(v[t] * inv);
            int c = r > 127 ? 127 : r < -127 ? -127 : (int)r;
            q[t] = (int8_t)c;
            s += c;
        }
        j->sx[m * blocks + b] = amax / 127.0f;
        j->sum[m * blocks + b] = s;
    }
}

static void quant_chunk(const void *p, i64 c, int tid) {
    (void)tid;
    quant_row(p, c);
}

/* ---- the product ------------------------------------------------------------------------- */

typedef struct {
    const int8_t *q; const float *sx; const int32_t *sum; i64 M, K, N; int bits; const uint8_t *packed;
    const float *bias; void *y; int ybf; i64 ys, per;
} i8_job;

static void store_row8(const i8_job *j, i64 m, i64 n0, const float *acc) {
    for (int r = 0; r < I8_ROWS && n0 + r < j->N; r++) {
        float v = acc[r] + (j->bias ? j->bias[n0 + r] : 0.0f);
        i64 at = m * j->ys + n0 + r;
        if (j->ybf) {
            uint32_t u;
            memcpy(&u, &v, 4);
            if ((u & 0x7fffffffu) > 0x7f800000u) ((uint16_t *)j->y)[at] = (uint16_t)((u >> 16) | 0x40);
            else ((uint16_t *)j->y)[at] = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
        } else {
            ((float *)j->y)[at] = v;
        }
    }
}

#ifdef I8_AVX2
static inline __m256i bcast4(const int8_t *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

/* The 8 quads of one block of one panel, as u8 vectors (4-bit: unpacked from nibbles). */
static inline void load_quads(const uint8_t *blk, int bits, __m256i *w) {
    if (bits == 8) {
        for (int j = 0; j < 8; j++) w[j] = _mm256_loadu_si256((const __m256i *)(blk + 32 * j));
    } else {
        const __m256i lo = _mm256_set1_epi8(15);
        for (int j = 0; j < 4; j++) {
            __m256i v = _mm256_loadu_si256((const __m256i *)(blk + 32 * j));
            w[j] = _mm256_and_si256(v, lo);
            w[j + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), lo);
        }
    }
}

/* Sum of w[j] (u8) times a broadcast quad of x (s8) into int32 lanes, j = 0..7. */
static inline __m256i block_dot(const __m256i *w, const int8_t *x, int bits) {
#ifdef I8_DPBUSD
    (void)bits;
    /* two chains of four: a block's dot waits on half as many dependent vpdpbusd */
    __m256i a0 = _mm256_setzero_si256(), a1 = _mm256_setzero_si256();
    for (int j = 0; j < 8; j += 2) {
        a0 = I8_DPBUSD(a0, w[j], bcast4(x + 4 * j));
        a1 = I8_DPBUSD(a1, w[j + 1], bcast4(x + 4 * j + 4));
    }
    return _mm256_add_epi32(a0, a1);
#else
    /* vpmaddubsw adds two u8 x s8 products into an i16 that saturates: 4-bit codes (<= 15)
     * cannot reach it; 8-bit ones are taken signed (u8 ^ 0x80) by the sign trick, |w| x
     * sign(x, w), and the zero point's 128 comes back below (block_dot_offset). */
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i acc = _mm256_setzero_si256();
    for (int j = 0; j < 8; j++) {
        __m256i xv = bcast4(x + 4 * j), p;
        if (bits == 8) {
            __m256i ws = _mm256_xor_si256(w[j], _mm256_set1_epi8((char)0x80));
            p = _mm256_maddubs_epi16(_mm256_sign_epi8(ws, ws), _mm256_sign_epi8(xv, ws));
        } else {
            p = _mm256_maddubs_epi16(w[j], xv);
        }
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(p, ones));
    }
    return acc;
#endif
}

/* What block_dot leaves out of the u8 codes' sum: 128 * sum(x) on the AVX2 path for 8 bits. */
static inline int block_dot_offset(int bits) {
#ifdef I8_DPBUSD
    (void)bits;
    return 0;
#else
    return bits == 8 ? 128 : 0;
#endif
}

/* One panel of 8 outputs against MR activation rows (MR a constant where it is inlined, so
 * that the accumulators stay in registers): the panel's codes are unpacked once a block and
 * serve all MR rows. */
static inline __attribute__((always_inline)) void i8_tile(const i8_job *j, i64 pn, i64 m0, const int MR) {
    const i64 blocks = j->K / I8_BLOCK, bb = block_bytes(j->bits), cb = j->bits == 8 ? 256 : 128;
    const uint8_t *panel = j->packed + pn * blocks * bb;
    const __m256i off = _mm256_set1_epi32(block_dot_offset(j->bits));
    __m256 acc[I8_MR];
    for (int m = 0; m < MR; m++) acc[m] = _mm256_setzero_ps();
    for (i64 b = 0; b < blocks; b++) {
        const uint8_t *blk = panel + b * bb;
        /* eight blocks ahead (into the next panel, which this thread takes next, near the end
         * of this one), into L2: see kernels.c's PREFETCH_L2 (8-bit 5.1 -> 3.2 ms at one row
         * over the 125M model's shapes, 4-bit 2.2 -> 1.9) */
        if (pn * blocks + b + I8_PREFETCH_BLOCKS < (j->N + I8_ROWS - 1) / I8_ROWS * blocks)
            _mm_prefetch((const char *)(blk + I8_PREFETCH_BLOCKS * bb), _MM_HINT_T1);
        __m256i w[8];
        load_quads(blk, j->bits, w);
        __m256 sw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(blk + cb)));
        __m256i zp = _mm256_sub_epi32(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(blk + cb + 16))), off);
#pragma GCC unroll 8
        for (int m = 0; m < MR; m++) {
            i64 row = (m0 + m) * blocks + b;
            __m256i d = block_dot(w, j->q + (m0 + m) * j->K + b * I8_BLOCK, j->bits);
            d = _mm256_sub_epi32(d, _mm256_mullo_epi32(zp, _mm256_set1_epi32(j->sum[row])));
            acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_mul_ps(sw, _mm256_set1_ps(j->sx[row])), acc[m]);
        }
    }
    for (int m = 0; m < MR; m++) {
        float out[I8_ROWS];
        _mm256_storeu_ps(out, acc[m]);
        store_row8(j, m0 + m, pn * I8_ROWS, out);
    }
}

static void i8_chunk(const void *p, i64 c, int tid) {
    (void)tid;
    const i8_job *j = p;
    const i64 panels = (j->N + I8_ROWS - 1) / I8_ROWS;
    i64 lo = c * j->per, hi = lo + j->per < panels ? lo + j->per : panels;
    for (i64 pn = lo; pn < hi; pn++) {
        i64 m0 = 0;
        for (; j->M - m0 >= 8; m0 += 8) i8_tile(j, pn, m0, 8);
        if (j->M - m0 >= 4) i8_tile(j, pn, m0, 4), m0 += 4;
        if (j->M - m0 >= 2) i8_tile(j, pn, m0, 2), m0 += 2;
        if (j->M - m0 >= 1) i8_tile(j, pn, m0, 1);
    }
}
#else
static void i8_chunk(const void *p, i64 c, int tid) {
    (void)tid;
    const i8_job *j = p;
    const i64 blocks = j->K / I8_BLOCK, bb = block_bytes(j->bits), cb = j->bits == 8 ? 256 : 128;
    const i64 panels = (j->N + I8_ROWS - 1) / I8_ROWS;
    i64 lo = c * j->per, hi = lo + j->per < panels ? lo + j->per : panels;
    for (i64 pn = lo; pn < hi; pn++)
        for (i64 m = 0; m < j->M; m++) {
            float acc[I8_ROWS] = {0};
            for (i64 b = 0; b < blocks; b++) {
                const uint8_t *blk = j->packed + (pn * blocks + b) * bb;
                const int8_t *x = j->q + m * j->K + b * I8_BLOCK;
                for (int r = 0; r < I8_ROWS; r++) {
                    int32_t d = 0;
                    for (int t = 0; t < I8_BLOCK; t++) {
                        int q = j->bits == 8 ? blk[(t / 4) * 32 + r * 4 + t % 4]
                                : t < 16 ? blk[(t / 4) * 32 + r * 4 + t % 4] & 15
                                         : blk[((t - 16) / 4) * 32 + r * 4 + t % 4] >> 4;
                        d += q * x[t];
                    }
                    uint16_t h;
                    memcpy(&h, blk + cb + 2 * r, 2);
                    d -= (int32_t)blk[cb + 16 + r] * j->sum[m * blocks + b];
                    acc[r] += (float)d * (npuc_f16_to_f32(h) * j->sx[m * blocks + b]);
                }
            }
            store_row8(j, m, pn * I8_ROWS, acc);
        }
}
#endif

i64 npuc_i8linear_scratch_bytes(i64 M, i64 K) {
    return M * K + M * (K / I8_BLOCK) * (i64)(sizeof(float) + sizeof(int32_t)) + 64;
}

int npuc_i8linear(const void *x, int xbf, i64 M, i64 xs, const uint8_t *packed, int bits, i64 N, i64 K,
                  const float *bias, void *y, int ybf, i64 ys, void *scratch, int nt) {
    if ((bits != 4 && bits != 8) || K % I8_BLOCK || M < 1 || N < 1) return 1;
    const i64 blocks = K / I8_BLOCK;
    float *sx = scratch;
    int32_t *sum = (int32_t *)(sx + M * blocks);
    int8_t *q = (int8_t *)(sum + M * blocks);
    quant_job qj = {x, xbf, xs, K, q, sx, sum};
    npuc_parallel(quant_chunk, &qj, M, M * K < (1 << 15) ? 1 : nt);
    const i64 panels = (N + I8_ROWS - 1) / I8_ROWS;
    if (nt < 1) nt = 1;
    if (N * K * bits / 8 < (64 << 10)) nt = 1;
    i64 per = (panels + 4 * nt - 1) / (4 * nt);
    i8_job j = {q, sx, sum, M, K, N, bits, packed, bias, y, ybf, ys, per < 1 ? 1 : per};
    npuc_parallel(i8_chunk, &j, (panels + j.per - 1) / j.per, nt);
    return 0;
}

#ifdef I8_AVX2
const char *npuc_i8_path(void) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return "avx512-vnni";
#elif defined(__AVXVNNI__)
    return "avx-vnni";
#else
    return "avx2";
#endif
}
#else
const char *npuc_i8_path(void) { return "c"; }
#endif
