/* The CPU kernels (kernels.c): products, normalisation, RoPE, caches, attention, casts.
 * Each takes plain pointers and sizes that its binder (exec.c) has checked; `nt` threads
 * run on the process's worker pool (kernels.c, "the thread pool"). Those that return int
 * return 0, or non-zero for a run-time value out of range (a position past the cache). */
#ifndef NPUCRT_KERNELS_H
#define NPUCRT_KERNELS_H

#include <stdint.h>

typedef int64_t i64;
typedef uint16_t bf16;

int npuc_linear_f32(const float *x, i64 M, i64 xs, const float *w, int kn, i64 N, i64 K, const float *bias, float *y,
                    i64 ys, int nt);
int npuc_linear_bf16(const void *x, int xbf, i64 M, i64 xs, const bf16 *w, i64 N, i64 K, const void *bias,
                     int biasbf, void *y, int ybf, i64 ys, float *scratch, int nt);
i64 npuc_gemm_packed_floats(i64 N, i64 K);
int npuc_gemm_pack_b(const void *w, int wbf, int kn, i64 N, i64 K, float *packed, int nt);
i64 npuc_gemm_scratch_floats(i64 M, i64 N, i64 K, int ybf);
int npuc_gemm_f32(const void *x, int xbf, i64 M, i64 xs, const float *packed, i64 N, i64 K, const float *bias,
                  void *y, int ybf, i64 ys, float *scratch, int nt);
i64 npuc_qlinear_scratch_floats(i64 M, i64 K, i64 G);
int npuc_qlinear(const void *x, int xbf, i64 M, i64 xs, const uint8_t *q, int bits, const float *scale,
                 const float *zero, i64 N, i64 K, i64 G, const float *bias, void *y, int ybf, i64 ys, float *scratch,
                 int nt);
i64 npuc_qgemm_scratch_floats(i64 M, i64 N, i64 K, int ybf, int nt);
int npuc_qgemm(const void *x, int xbf, i64 M, i64 xs, const uint8_t *q, int bits, const float *scale,
               const float *zero, i64 N, i64 K, i64 G, const float *bias, void *y, int ybf, i64 ys, float *scratch,
               int nt);
/* Integer-activation products (kernels_i8.c): weights packed once at bind, activations
 * quantized to int8 per block of 32 on each call; scales f16 (their bits). */
i64 npuc_i8_packed_bytes(int bits, i64 N, i64 K);
int npuc_i8_pack(const uint8_t *q, int bits, const uint16_t *scale, const uint8_t *zero, i64 N, i64 K, i64 G,
                 uint8_t *packed);
i64 npuc_i8linear_scratch_bytes(i64 M, i64 K);
int npuc_i8linear(const void *x, int xbf, i64 M, i64 xs, const uint8_t *packed, int bits, i64 N, i64 K,
                  const float *bias, void *y, int ybf, i64 ys, void *scratch, int nt);
const char *npuc_i8_path(void);
int npuc_rms_norm_f32(const float *x, const float *scale, float eps, float *out, i64 R, i64 D, int nt);
int npuc_rope_f32(const float *x, const int64_t *pos, const float *cos_t, const float *sin_t, float *out, i64 G,
                  i64 S, i64 d, i64 half, i64 T, int layout, i64 B, int nt);
/* KV cache row layouts (kv_write, cached_attention): 0 and 1 as the other kernels' bf flag. int8:
 * rows of D + 4 bytes, an f32 scale then D codes (ir/fused_ops.py). */
enum { NPUC_KV_F32 = 0, NPUC_KV_BF16 = 1, NPUC_KV_F16 = 2, NPUC_KV_I8 = 3 };
int npuc_kv_write(void *cache, int kind, const void *src, int sbf, const int64_t *pos, i64 pstride, i64 slot, i64 B,
                  i64 H, i64 L, i64 S, i64 D);
/* Row i of new [1, H, S, D] into cache slot[i] (of `slots`) at pos[i]: a mixed step's rows. */
int npuc_kv_write_rows(void *cache, int kind, const void *src, int sbf, const int64_t *pos, const int64_t *slot,
                       i64 slots, i64 H, i64 L, i64 S, i64 D);
i64 npuc_cached_attention_scratch_floats(i64 B, i64 HQ, i64 S, i64 D, i64 HKV, i64 L, i64 DV, int nt);
int npuc_cached_attention(const void *q, int qbf, const void *kc, const void *vc, int kind, const int64_t *pos,
                          i64 pstride, void *out, int obf, i64 B, i64 HQ, i64 S, i64 D, i64 HKV, i64 L, i64 DV,
                          float scale, float *scratch, int nt);
/* q [1, HQ, N, D]: row i attends cache slot[i] (of `slots`) up to pos[i]. Scratch as
 * npuc_cached_attention's with B = N, S = 1. */
int npuc_cached_attention_rows(const void *q, int qbf, const void *kc, const void *vc, int kind, const int64_t *pos,
                               const int64_t *slot, i64 slots, void *out, int obf, i64 N, i64 HQ, i64 D, i64 HKV,
                               i64 L, i64 DV, float scale, float *scratch, int nt);
i64 npuc_attention_gemm_scratch_floats(i64 B, i64 HKV, i64 D, i64 L, i64 DV, int nt);
int npuc_attention_gemm(const float *q, const float *k, const float *v, const int64_t *pos, float *out, i64 B,
                        i64 HQ, i64 S, i64 D, i64 HKV, i64 L, i64 DV, float scale, float *scratch, int nt);
int npuc_gather_rows(const void *table, i64 rows, i64 row_bytes, const int64_t *idx, i64 n, void *out);
int npuc_dequantize(const void *q, int bits, const void *scale, int sbf, const void *zero, i64 rows, i64 K, i64 G,
                    void *out, int obf);
int npuc_pad_rows(const void *x, void *out, i64 es, i64 lead, i64 m, i64 k, i64 m2, i64 k2, i64 fill);
int npuc_swiglu_f32(const float *a, const float *b, float *out, i64 n, int nt);
int npuc_add_f32(const float *a, const float *b, float *out, i64 n, int nt);
int npuc_cast(const void *src, int sbf, void *dst, int dbf, i64 n, int nt);
int npuc_permute(const void *src, void *dst, i64 es, const int64_t *shape, const int64_t *st, int nt);
int npuc_kernels_abi(void);

/* The pool's parallel-for, for kernels in other files: fn(ctx, chunk, thread id) for chunks
 * 0..chunks-1 on nt threads. Calls from several threads are serialised. */
typedef void (*npuc_chunk_fn)(const void *ctx, i64 chunk, int tid);
void npuc_parallel(npuc_chunk_fn fn, const void *ctx, i64 chunks, int nt);

#endif /* NPUCRT_KERNELS_H */
