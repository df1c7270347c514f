/* npuc's native CPU kernels, compiled for the host at load time (runtime/native/__init__.py).
 *
 * Products with few rows (decode's GEMV) are about bytes: every weight is read exactly
 * once per call, N is split across threads in contiguous slices (M is too small to
 * amortise packing), and four weight rows are reduced at a time so that four streams
 * are in flight. Accumulation is f32; bf16 is widened on load (a 16-bit shift).
 *
 *   y[m, n] = sum_k x[m, k] * w(n, k) + bias[n]    w(n, k) = W[n*K + k]  (layout nk)
 *                                                           = W[k*N + n]  (layout kn)
 *
 * Threads: a small pool of our own (below), not OpenMP. A call is cut into chunks that
 * the caller and the pool's threads claim from one atomic counter; the caller waits only
 * for chunks already claimed, never for a thread to arrive. On a busy machine, where a
 * worker may not be scheduled for milliseconds, the caller then simply does the work
 * itself: an OpenMP region's closing barrier would wait for the sleeper, every call.
 */
#define _POSIX_C_SOURCE 200809L /* clock_gettime under -std=c11 */
#include <stddef.h>
#include <stdint.h>
#include <math.h>
#include <string.h>
#include <pthread.h>
#include <stdatomic.h>
#include <time.h>
#include "kernels.h"
#include "simd.h"
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define NPUC_AVX2 1
#endif


/* Prefetch about this many bytes ahead: the next rows of a slice lie end to end, one
 * stream that the hardware prefetcher, seeing four interleaved, picks up late. The weight
 * streams of the products with few rows are prefetched into L2 (PREFETCH_L2), not L1: a
 * prefetch into L1 holds one of the core's few L1 miss buffers for a whole trip to memory,
 * and so caps the bytes in flight, while L2 keeps many more trips going. On the 125M model's
 * shapes (2 cores, Zen 4) the f32 product took 16.1 -> 13.4 ms at one row, 18.6 -> 13.9 at
 * four and 22.0 -> 15.7 at eight; bf16 9.3 -> 6.9 at one row, 8-bit 7.2 -> 5.3. Data that
 * the next instructions use (the GEMM's panels) still goes to L1 (PREFETCH). */
#define PREFETCH_BYTES 32768
#ifndef KN_PREFETCH_ROWS
#define KN_PREFETCH_ROWS 8
#endif

static inline bf16 f32_to_bf16(float f) { /* round to nearest even; a NaN stays a NaN */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16)(u >> 16);
}

static inline float load_any(const void *p, int bf, i64 i) {
    return bf ? npuc_bf16_to_f32(((const bf16 *)p)[i]) : ((const float *)p)[i];
}

static inline void store_any(void *p, int bf, i64 i, float v) {
    if (bf) ((bf16 *)p)[i] = f32_to_bf16(v);
    else ((float *)p)[i] = v;
}

/* Below ~64 KiB of weights a hand-off costs more than the second thread saves. */
static inline int threads_for(i64 bytes, int nt) { return bytes < (64 << 10) ? 1 : (nt < 1 ? 1 : nt); }

/* ---- the thread pool ----------------------------------------------------------------------
 *
 * One job at a time, posted by the (single) calling thread. `state` packs the job's
 * generation (high 32 bits) and its next unclaimed chunk (low 32 bits): a thread claims
 * chunk c of generation g by a compare-and-swap from (g, c) to (g, c + 1), so a chunk runs
 * once, and only while its job is current. The caller counts finished chunks and returns
 * when all are done. Idle workers spin for SPIN_NS (decode's kernels come microseconds
 * apart), then sleep on a condition variable until the next job. */

#define MAX_WORKERS 63
#define SPIN_NS 200000

typedef npuc_chunk_fn chunk_fn;

static struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int workers;                      /* started so far */
    _Atomic uint64_t state;           /* generation << 32 | next chunk */
    _Atomic(chunk_fn) fn;
    _Atomic(const void *) ctx;
    _Atomic i64 chunks;
    _Atomic int allowed;              /* workers 1..allowed-1 may join this job */
    _Atomic i64 done;
    _Atomic int sleeping;
} pool = {.mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER};

/* The pool is the library's one piece of process-wide mutable state (docs/c-api.md): its
 * workers start on first need and live as long as the process. One job runs at a time:
 * callers from several threads (sessions used concurrently) take turns through this lock. */
static pthread_mutex_t job_lock = PTHREAD_MUTEX_INITIALIZER;

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static i64 now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (i64)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Claim and run chunks of the current job until none is left; whether any ran. */
static int run_chunks(int tid) {
    int ran = 0;
    for (;;) {
        uint64_t s = atomic_load_explicit(&pool.state, memory_order_acquire);
        i64 n = atomic_load_explicit(&pool.chunks, memory_order_relaxed);
        chunk_fn fn = atomic_load_explicit(&pool.fn, memory_order_relaxed);
        const void *ctx = atomic_load_explicit(&pool.ctx, memory_order_relaxed);
        if ((i64)(s & 0xffffffffu) >= n || tid >= atomic_load_explicit(&pool.allowed, memory_order_relaxed))
            return ran;
        /* the fields read above belong to generation s >> 32 if this claim succeeds: a new
         * job is posted only once every chunk of the current one is claimed and done */
        if (atomic_compare_exchange_weak_explicit(&pool.state, &s, s + 1, memory_order_acq_rel,
                                                  memory_order_relaxed)) {
            fn(ctx, (i64)(s & 0xffffffffu), tid);
            atomic_fetch_add_explicit(&pool.done, 1, memory_order_release);
            ran = 1;
        }
    }
}

static void *worker(void *arg) {
    int tid = (int)(intptr_t)arg;
    for (;;) {
        run_chunks(tid);
        uint64_t idle = atomic_load(&pool.state) >> 32;
        i64 until = now_ns() + SPIN_NS;
        int spins = 0;
        while ((atomic_load_explicit(&pool.state, memory_order_relaxed) >> 32) == idle) {
            cpu_relax();
            if (++spins % 256 == 0 && now_ns() > until) {
                pthread_mutex_lock(&pool.mu);
                atomic_fetch_add(&pool.sleeping, 1);
                while ((atomic_load(&pool.state) >> 32) == idle) pthread_cond_wait(&pool.cv, &pool.mu);
                atomic_fetch_sub(&pool.sleeping, 1);
                pthread_mutex_unlock(&pool.mu);
                break;
            }
        }
    }
    return NULL;
}

/* Run fn(ctx, c, tid) for c in 0..chunks-1 on up to nt threads (the caller is tid 0). */
static void parallel_locked(chunk_fn fn, const void *ctx, i64 chunks, int nt);

static void parallel(chunk_fn fn, const void *ctx, i64 chunks, int nt) {
    if (nt <= 1 || chunks <= 1) { /* no hand-off: no lock */
        for (i64 c = 0; c < chunks; c++) fn(ctx, c, 0);
        return;
    }
    pthread_mutex_lock(&job_lock);
    parallel_locked(fn, ctx, chunks, nt);
    pthread_mutex_unlock(&job_lock);
}

void npuc_parallel(npuc_chunk_fn fn, const void *ctx, i64 chunks, int nt) { parallel(fn, ctx, chunks, nt); }

static void parallel_locked(chunk_fn fn, const void *ctx, i64 chunks, int nt) {
    if (nt > MAX_WORKERS + 1) nt = MAX_WORKERS + 1;
    if (nt > chunks) nt = (int)chunks;
    while (pool.workers < nt - 1) { /* started on first need; a failed start leaves fewer */
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int ok = pthread_create(&t, &attr, worker, (void *)(intptr_t)(pool.workers + 1)) == 0;
        pthread_attr_destroy(&attr);
        if (!ok) break;
        pool.workers++;
    }
    if (nt <= 1 || pool.workers == 0) {
        for (i64 c = 0; c < chunks; c++) fn(ctx, c, 0);
        return;
    }
    atomic_store_explicit(&pool.fn, fn, memory_order_relaxed);
    atomic_store_explicit(&pool.ctx, ctx, memory_order_relaxed);
    atomic_store_explicit(&pool.chunks, chunks, memory_order_relaxed);
    atomic_store_explicit(&pool.allowed, nt, memory_order_relaxed);
    atomic_store_explicit(&pool.done, 0, memory_order_relaxed);
    uint64_t gen = (atomic_load(&pool.state) >> 32) + 1;
    atomic_store(&pool.state, gen << 32); /* seq_cst: pairs with a worker's check before it sleeps */
    if (atomic_load(&pool.sleeping)) {
        pthread_mutex_lock(&pool.mu);
        pthread_cond_broadcast(&pool.cv);
        pthread_mutex_unlock(&pool.mu);
    }
    run_chunks(0);
    while (atomic_load_explicit(&pool.done, memory_order_acquire) < chunks) cpu_relax();
}

/* Chunks of `align`-multiples over 0..n: about four per thread, so a late thread's share
 * is taken by the others. */
static inline i64 chunk_size(i64 n, i64 align, int nt) {
    i64 per = (n + 4 * nt - 1) / (4 * nt);
    per = (per + align - 1) / align * align;
    return per < align ? align : per;
}

static inline i64 prefetch_rows(i64 K, i64 size) {
    i64 rows = PREFETCH_BYTES / (K * size);
    return rows < 4 ? 4 : rows;
}

#ifdef NPUC_AVX2
#define PREFETCH(p) _mm_prefetch((const char *)(p), _MM_HINT_T0)
#define PREFETCH_L2(p) _mm_prefetch((const char *)(p), _MM_HINT_T1)

static inline __m256 load8_any(const void *p, int bf, i64 i) {
    return bf ? npuc_load8_bf16((const bf16 *)p + i) : _mm256_loadu_ps((const float *)p + i);
}
#endif

/* ---- f32 weights, layout nk -------------------------------------------------------------- */

static float dot1_f32(const float *x, const float *w, i64 K) {
    float s = 0;
    i64 k = 0;
#ifdef NPUC_AVX2
    __m256 a = _mm256_setzero_ps(), b = a;
    for (; k + 16 <= K; k += 16) {
        a = _mm256_fmadd_ps(_mm256_loadu_ps(w + k), _mm256_loadu_ps(x + k), a);
        b = _mm256_fmadd_ps(_mm256_loadu_ps(w + k + 8), _mm256_loadu_ps(x + k + 8), b);
    }
    s = npuc_hsum8(_mm256_add_ps(a, b));
#endif
    for (; k < K; k++) s += w[k] * x[k];
    return s;
}

/* Four weight rows dotted with R = 1 or 2 x rows (y rows ys apart): one accumulator per (x row,
 * weight row), 8 k at a time, so every sum runs in the same order whatever R is. A sequence
 * decoded beside others gets the logits it gets alone, bit for bit; two x rows share each
 * weight load (decode over several slots is bound by the loads, not by the bytes). */
static void dot4xr_f32(const float *x, i64 xs, int R, const float *w, i64 K, float *y, i64 ys, int part, int parts) {
    const float *w0 = w, *w1 = w + K, *w2 = w + 2 * K, *w3 = w + 3 * K, *x1 = x + (R > 1 ? xs : 0);
    float s[2][4] = {{0}};
    i64 k = 0;
#ifdef NPUC_AVX2
    const i64 pf = prefetch_rows(K, 4) * K;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, c0 = a0, c1 = a0, c2 = a0, c3 = a0;
    i64 next = 16 * (i64)part; /* the next cache line this pass prefetches */
#define NPUC_PREFETCH4                                                                            \
    if (k == next) {                                                                           \
        PREFETCH_L2(w0 + k + pf); PREFETCH_L2(w1 + k + pf);                                    \
        PREFETCH_L2(w2 + k + pf); PREFETCH_L2(w3 + k + pf);                                    \
        next += 16 * (i64)parts;                                                               \
    }
    if (R == 1)
        for (; k + 8 <= K; k += 8) {
            __m256 xa = _mm256_loadu_ps(x + k);
            NPUC_PREFETCH4
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + k), xa, a0);
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w1 + k), xa, a1);
            a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w2 + k), xa, a2);
            a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w3 + k), xa, a3);
        }
    else for (; k + 8 <= K; k += 8) {
        __m256 xa = _mm256_loadu_ps(x + k), xc = _mm256_loadu_ps(x1 + k), v;
        NPUC_PREFETCH4
        v = _mm256_loadu_ps(w0 + k); a0 = _mm256_fmadd_ps(v, xa, a0); c0 = _mm256_fmadd_ps(v, xc, c0);
        v = _mm256_loadu_ps(w1 + k); a1 = _mm256_fmadd_ps(v, xa, a1); c1 = _mm256_fmadd_ps(v, xc, c1);
        v = _mm256_loadu_ps(w2 + k); a2 = _mm256_fmadd_ps(v, xa, a2); c2 = _mm256_fmadd_ps(v, xc, c2);
        v = _mm256_loadu_ps(w3 + k); a3 = _mm256_fmadd_ps(v, xa, a3); c3 = _mm256_fmadd_ps(v, xc, c3);
    }
    s[0][0] = npuc_hsum8(a0); s[0][1] = npuc_hsum8(a1); s[0][2] = npuc_hsum8(a2); s[0][3] = npuc_hsum8(a3);
    s[1][0] = npuc_hsum8(c0); s[1][1] = npuc_hsum8(c1); s[1][2] = npuc_hsum8(c2); s[1][3] = npuc_hsum8(c3);
#undef NPUC_PREFETCH4
#else
    (void)part, (void)parts;
#endif
    for (int r = 0; r < R; r++) {
        const float *xr = r ? x1 : x;
        for (i64 t = k; t < K; t++) {
            float xv = xr[t];
            s[r][0] += w0[t] * xv; s[r][1] += w1[t] * xv; s[r][2] += w2[t] * xv; s[r][3] += w3[t] * xv;
        }
        for (int j = 0; j < 4; j++) y[r * ys + j] = s[r][j];
    }
}

/* Rows [lo, hi) for every x row: four weight rows stay in cache while the x rows go by, two at
 * a time. The prefetches of the weight rows ahead are shared out among those passes, a cache
 * line each in turn, so that memory streams while every pass computes: prefetched all in the
 * first pass, the memory stood idle while the later ones ran (8 rows cost 1.35x 4 rows' time,
 * the mixed step's 8 against decode's 4 on the 125M model; 1.2x with them shared). */
static void nk_f32(const float *x, i64 M, i64 xs, const float *w, i64 K, i64 lo, i64 hi, float *y, i64 ys) {
    i64 n = lo;
    int parts = (int)((M + 1) / 2);
    for (; n + 4 <= hi; n += 4)
        for (i64 m = 0; m < M; m += 2)
            dot4xr_f32(x + m * xs, xs, M - m > 1 ? 2 : 1, w + n * K, K, y + m * ys + n, ys, (int)(m / 2), parts);
    for (; n < hi; n++)
        for (i64 m = 0; m < M; m++) y[m * ys + n] = dot1_f32(x + m * xs, w + n * K, K);
}

/* ---- f32 weights, layout kn: 64 output columns in registers, x[k] broadcast ------------- */

static void kn_f32(const float *x, i64 M, i64 xs, const float *w, i64 K, i64 N, i64 lo, i64 hi,
                   float *y, i64 ys) {
    for (i64 m = 0; m < M; m++) {
        const float *xm = x + m * xs;
        float *ym = y + m * ys;
        i64 n = lo;
#ifdef NPUC_AVX2
        for (; n + 64 <= hi; n += 64) {
            __m256 a[8];
            for (int j = 0; j < 8; j++) a[j] = _mm256_setzero_ps();
            for (i64 k = 0; k < K; k++) {
                __m256 xv = _mm256_broadcast_ss(xm + k);
                const float *row = w + k * N + n;
                /* rows lie N apart: a stride the hardware prefetcher loses at each page */
                const float *ahead = row + KN_PREFETCH_ROWS * N;
                PREFETCH(ahead); PREFETCH(ahead + 16); PREFETCH(ahead + 32); PREFETCH(ahead + 48);
                for (int j = 0; j < 8; j++) a[j] = _mm256_fmadd_ps(_mm256_loadu_ps(row + 8 * j), xv, a[j]);
            }
            for (int j = 0; j < 8; j++) _mm256_storeu_ps(ym + n + 8 * j, a[j]);
        }
        for (; n + 8 <= hi; n += 8) {
            __m256 a = _mm256_setzero_ps();
            for (i64 k = 0; k < K; k++)
                a = _mm256_fmadd_ps(_mm256_loadu_ps(w + k * N + n), _mm256_broadcast_ss(xm + k), a);
            _mm256_storeu_ps(ym + n, a);
        }
#endif
        for (; n < hi; n++) {
            float s = 0;
            for (i64 k = 0; k < K; k++) s += w[k * N + n] * xm[k];
            ym[n] = s;
        }
    }
}

/* ---- bf16 weights, layout nk ------------------------------------------------------------- */

/* x deinterleaved per block of 16 (its 8 even elements, then its 8 odd ones): one 256-bit
 * load holds 16 bf16 weights, a shift gives the even ones as f32 and a mask the odd ones. */
static void deinterleave16(const float *x, i64 K, float *xd) {
    i64 k = 0;
    for (; k + 16 <= K; k += 16)
        for (int j = 0; j < 8; j++) {
            xd[k + j] = x[k + 2 * j];
            xd[k + 8 + j] = x[k + 2 * j + 1];
        }
    for (; k < K; k++) xd[k] = x[k];
}

static void dot4_bf16(const float *xd, const float *x, const bf16 *w, i64 K, float *out) {
    const bf16 *w0 = w, *w1 = w + K, *w2 = w + 2 * K, *w3 = w + 3 * K;
    float s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    i64 k = 0;
#ifdef NPUC_AVX2
    const i64 pf = prefetch_rows(K, 2) * K;
    const __m256i hi = _mm256_set1_epi32((int)0xffff0000u);
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, b0 = a0, b1 = a0, b2 = a0, b3 = a0;
#define NPUC_BF16_ROW(v, a, b)                                                                  \
    a = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(v, 16)), xe, a);                  \
    b = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(v, hi)), xo, b);
    for (; k + 16 <= K; k += 16) {
        __m256 xe = _mm256_loadu_ps(xd + k), xo = _mm256_loadu_ps(xd + k + 8);
        if ((k & 31) == 0) { PREFETCH_L2(w0 + k + pf); PREFETCH_L2(w1 + k + pf); PREFETCH_L2(w2 + k + pf); PREFETCH_L2(w3 + k + pf); }
        __m256i v0 = _mm256_loadu_si256((const __m256i *)(w0 + k));
        __m256i v1 = _mm256_loadu_si256((const __m256i *)(w1 + k));
        __m256i v2 = _mm256_loadu_si256((const __m256i *)(w2 + k));
        __m256i v3 = _mm256_loadu_si256((const __m256i *)(w3 + k));
        NPUC_BF16_ROW(v0, a0, b0) NPUC_BF16_ROW(v1, a1, b1) NPUC_BF16_ROW(v2, a2, b2) NPUC_BF16_ROW(v3, a3, b3)
    }
#undef NPUC_BF16_ROW
    s0 = npuc_hsum8(_mm256_add_ps(a0, b0)); s1 = npuc_hsum8(_mm256_add_ps(a1, b1));
    s2 = npuc_hsum8(_mm256_add_ps(a2, b2)); s3 = npuc_hsum8(_mm256_add_ps(a3, b3));
#else
    (void)xd;
#endif
    for (; k < K; k++) {
        float xv = x[k];
        s0 += npuc_bf16_to_f32(w0[k]) * xv; s1 += npuc_bf16_to_f32(w1[k]) * xv;
        s2 += npuc_bf16_to_f32(w2[k]) * xv; s3 += npuc_bf16_to_f32(w3[k]) * xv;
    }
    out[0] = s0; out[1] = s1; out[2] = s2; out[3] = s3;
}

/* ---- entry points ------------------------------------------------------------------------ */

static void add_bias(float *y, i64 M, i64 ys, i64 lo, i64 hi, const float *bias) {
    if (!bias) return;
    for (i64 m = 0; m < M; m++)
        for (i64 n = lo; n < hi; n++) y[m * ys + n] += bias[n];
}

/* f32: x is M rows of K (row stride xs), y M rows of N (row stride ys); bias may be NULL. */
typedef struct {
    const float *x; i64 M, xs; const float *w; int kn; i64 N, K; const float *bias; float *y; i64 ys, per;
} linear_f32_job;

static void linear_f32_chunk(const void *p, i64 c, int tid) {
    const linear_f32_job *j = p;
    (void)tid;
    i64 lo = c * j->per, hi = lo + j->per < j->N ? lo + j->per : j->N;
    if (j->kn) kn_f32(j->x, j->M, j->xs, j->w, j->K, j->N, lo, hi, j->y, j->ys);
    else nk_f32(j->x, j->M, j->xs, j->w, j->K, lo, hi, j->y, j->ys);
    add_bias(j->y, j->M, j->ys, lo, hi, j->bias);
}

int npuc_linear_f32(const float *x, i64 M, i64 xs, const float *w, int kn, i64 N, i64 K, const float *bias,
                    float *y, i64 ys, int nt) {
    nt = threads_for(N * K * 4, nt);
    linear_f32_job j = {x, M, xs, w, kn, N, K, bias, y, ys, chunk_size(N, kn ? 64 : 16, nt)};
    parallel(linear_f32_chunk, &j, (N + j.per - 1) / j.per, nt);
    return 0;
}

/* bf16 weights (layout nk). x, bias and y are each f32 (flag 0) or bf16 (flag 1); the sum
 * is f32, rounded once into a bf16 y. `scratch` holds 2*M*K floats (x widened, then
 * deinterleaved). */
typedef struct {
    const float *xf, *xd; i64 M, K, N; const bf16 *w; const void *bias; int biasbf; void *y; int ybf; i64 ys, per;
} linear_bf16_job;

static void linear_bf16_chunk(const void *p, i64 c, int tid) {
    const linear_bf16_job *j = p;
    (void)tid;
    i64 lo = c * j->per, hi = lo + j->per < j->N ? lo + j->per : j->N, K = j->K;
    for (i64 n = lo; n < hi; n += 4) {
        i64 rows = hi - n < 4 ? hi - n : 4;
        for (i64 m = 0; m < j->M; m++) {
            float acc[4];
            if (rows == 4) dot4_bf16(j->xd + m * K, j->xf + m * K, j->w + n * K, K, acc);
            else
                for (i64 r = 0; r < rows; r++) {
                    float s = 0;
                    for (i64 k = 0; k < K; k++) s += npuc_bf16_to_f32(j->w[(n + r) * K + k]) * j->xf[m * K + k];
                    acc[r] = s;
                }
            for (i64 r = 0; r < rows; r++) {
                float v = acc[r];
                if (j->bias) v += load_any(j->bias, j->biasbf, n + r);
                store_any(j->y, j->ybf, m * j->ys + n + r, v);
            }
        }
    }
}

/* bf16 weights (layout nk). x, bias and y are each f32 (flag 0) or bf16 (flag 1); the sum
 * is f32, rounded once into a bf16 y. `scratch` holds 2*M*K floats (x widened, then
 * deinterleaved). */
int npuc_linear_bf16(const void *x, int xbf, i64 M, i64 xs, const bf16 *w, i64 N, i64 K, const void *bias,
                     int biasbf, void *y, int ybf, i64 ys, float *scratch, int nt) {
    float *xf = scratch, *xd = scratch + M * K;
    for (i64 m = 0; m < M; m++) {
        for (i64 k = 0; k < K; k++) xf[m * K + k] = load_any(x, xbf, m * xs + k);
        deinterleave16(xf + m * K, K, xd + m * K);
    }
    nt = threads_for(N * K * 2, nt);
    linear_bf16_job j = {xf, xd, M, K, N, w, bias, biasbf, y, ybf, ys, chunk_size(N, 16, nt)};
    parallel(linear_bf16_chunk, &j, (N + j.per - 1) / j.per, nt);
    return 0;
}

/* ---- GEMM for products with many rows (prefill), over weights packed at load ------------
 *
 * The weight is packed once, at load, into panels of 16 output columns: panel j holds
 * w(16j + c, k) at [j][k][c], zero past N, always f32 (bf16 is widened there: this is the
 * compute-bound case, and an f32 FMA beats emulated bf16 arithmetic). Each call packs x
 * into panels of GEMM_MR rows ([p][k][r], zero past M; 6, or 8 where AVX-512 gives a row
 * of the tile one register), then a GEMM_MR x 16 register tile runs over blocks of K: the B micro-panel (kc x 16) stays in L1 while the A panels of that block,
 * in L2, go by. Threads take chunks of column panels. Accumulation is f32; a bf16 y is
 * rounded once, from f32 scratch, after the last block. */

#if defined(NPUC_AVX2) && defined(__AVX512F__)
#define NPUC_AVX512 1
#endif
#ifndef GEMM_MR
#ifdef NPUC_AVX512
#define GEMM_MR 8 /* 8 zmm accumulators: two FMA ports of 4 cycles' latency kept busy (8: 64 ms, 6: 71 ms,
                     12: 67 ms for the 125M prefill's products, measured) */
#else
#define GEMM_MR 6
#endif
#endif
#define GEMM_NR 16
#ifndef GEMM_KC
#define GEMM_KC 256
#endif
#define GEMM_PANELS_PER_CHUNK 8 /* a chunk's C columns (128 rows x 128 floats) stay in L2 */

i64 npuc_gemm_packed_floats(i64 N, i64 K) { return (N + GEMM_NR - 1) / GEMM_NR * GEMM_NR * K; }

/* w as stored (f32 or bf16; layout nk or kn) into `packed` (npuc_gemm_packed_floats). */
typedef struct { const void *w; int wbf, kn; i64 N, K; float *packed; } pack_b_job;

static void pack_b_chunk(const void *p, i64 j, int tid) {
    const pack_b_job *b = p;
    (void)tid;
    float *dst = b->packed + j * b->K * GEMM_NR;
    for (i64 k = 0; k < b->K; k++)
        for (i64 c = 0; c < GEMM_NR; c++) {
            i64 n = j * GEMM_NR + c;
            dst[k * GEMM_NR + c] = n < b->N ? load_any(b->w, b->wbf, b->kn ? k * b->N + n : n * b->K + k) : 0.0f;
        }
}

int npuc_gemm_pack_b(const void *w, int wbf, int kn, i64 N, i64 K, float *packed, int nt) {
    pack_b_job b = {w, wbf, kn, N, K, packed};
    parallel(pack_b_chunk, &b, (N + GEMM_NR - 1) / GEMM_NR, threads_for(N * K * 4, nt));
    return 0;
}

/* c[r, 0..nr) (+)= sum_k a[k][r] * b[k][c] for r < mr, over kc values of k. */
static void gemm_tile(i64 kc, const float *a, const float *b, float *c, i64 cs, int first, const float *bias,
                      int mr, int nr) {
    float tile[GEMM_MR * GEMM_NR];
#ifdef NPUC_AVX512
    /* A row of the tile is one zmm; the loops over r unroll, the accumulators stay in registers. */
    __m512 acc[GEMM_MR];
    for (int r = 0; r < GEMM_MR; r++) acc[r] = _mm512_setzero_ps();
    for (i64 k = 0; k < kc; k++, a += GEMM_MR, b += GEMM_NR) {
        __m512 bv = _mm512_loadu_ps(b);
        for (int r = 0; r < GEMM_MR; r++) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(a[r]), bv, acc[r]);
    }
    if (mr == GEMM_MR && nr == GEMM_NR) { /* a whole tile: straight from the registers (same sums) */
        for (int r = 0; r < GEMM_MR; r++) {
            float *cr = c + r * cs;
            __m512 v = acc[r];
            if (!first) v = _mm512_add_ps(v, _mm512_loadu_ps(cr));
            else if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias));
            _mm512_storeu_ps(cr, v);
        }
        return;
    }
    for (int r = 0; r < GEMM_MR; r++) _mm512_storeu_ps(tile + r * GEMM_NR, acc[r]);
#elif defined(NPUC_AVX2)
    __m256 c00 = _mm256_setzero_ps(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00, c30 = c00,
           c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
    for (i64 k = 0; k < kc; k++, a += GEMM_MR, b += GEMM_NR) {
        __m256 b0 = _mm256_loadu_ps(b), b1 = _mm256_loadu_ps(b + 8), av;
        av = _mm256_broadcast_ss(a + 0); c00 = _mm256_fmadd_ps(av, b0, c00); c01 = _mm256_fmadd_ps(av, b1, c01);
        av = _mm256_broadcast_ss(a + 1); c10 = _mm256_fmadd_ps(av, b0, c10); c11 = _mm256_fmadd_ps(av, b1, c11);
        av = _mm256_broadcast_ss(a + 2); c20 = _mm256_fmadd_ps(av, b0, c20); c21 = _mm256_fmadd_ps(av, b1, c21);
        av = _mm256_broadcast_ss(a + 3); c30 = _mm256_fmadd_ps(av, b0, c30); c31 = _mm256_fmadd_ps(av, b1, c31);
        av = _mm256_broadcast_ss(a + 4); c40 = _mm256_fmadd_ps(av, b0, c40); c41 = _mm256_fmadd_ps(av, b1, c41);
        av = _mm256_broadcast_ss(a + 5); c50 = _mm256_fmadd_ps(av, b0, c50); c51 = _mm256_fmadd_ps(av, b1, c51);
    }
    if (mr == GEMM_MR && nr == GEMM_NR) { /* a whole tile: straight from the registers (same sums) */
#define GEMM_OUT(r, v0, v1)                                                                                   \
    {                                                                                                         \
        float *cr = c + (r) * cs;                                                                             \
        if (!first) {                                                                                         \
            v0 = _mm256_add_ps(v0, _mm256_loadu_ps(cr)); v1 = _mm256_add_ps(v1, _mm256_loadu_ps(cr + 8));    \
        } else if (bias) {                                                                                    \
            v0 = _mm256_add_ps(v0, _mm256_loadu_ps(bias)); v1 = _mm256_add_ps(v1, _mm256_loadu_ps(bias + 8)); \
        }                                                                                                     \
        _mm256_storeu_ps(cr, v0); _mm256_storeu_ps(cr + 8, v1);                                              \
    }
        GEMM_OUT(0, c00, c01) GEMM_OUT(1, c10, c11) GEMM_OUT(2, c20, c21)
        GEMM_OUT(3, c30, c31) GEMM_OUT(4, c40, c41) GEMM_OUT(5, c50, c51)
#undef GEMM_OUT
        return;
    }
    _mm256_storeu_ps(tile + 0, c00); _mm256_storeu_ps(tile + 8, c01);
    _mm256_storeu_ps(tile + 16, c10); _mm256_storeu_ps(tile + 24, c11);
    _mm256_storeu_ps(tile + 32, c20); _mm256_storeu_ps(tile + 40, c21);
    _mm256_storeu_ps(tile + 48, c30); _mm256_storeu_ps(tile + 56, c31);
    _mm256_storeu_ps(tile + 64, c40); _mm256_storeu_ps(tile + 72, c41);
    _mm256_storeu_ps(tile + 80, c50); _mm256_storeu_ps(tile + 88, c51);
#else
    for (int i = 0; i < GEMM_MR * GEMM_NR; i++) tile[i] = 0.0f;
    for (i64 k = 0; k < kc; k++, a += GEMM_MR, b += GEMM_NR)
        for (int r = 0; r < GEMM_MR; r++)
            for (int q = 0; q < GEMM_NR; q++) tile[r * GEMM_NR + q] += a[r] * b[q];
#endif
    for (int r = 0; r < mr; r++) {
        float *cr = c + r * cs;
        const float *t = tile + r * GEMM_NR;
        if (first) {
            if (bias) for (int q = 0; q < nr; q++) cr[q] = t[q] + bias[q];
            else for (int q = 0; q < nr; q++) cr[q] = t[q];
        } else {
            for (int q = 0; q < nr; q++) cr[q] += t[q];
        }
    }
}

typedef struct {
    const void *x; int xbf; i64 M, xs, N, K; const float *packed, *bias; float *c; i64 cs;
    void *y; i64 ys; float *apack; i64 per;
} gemm_job;

static void gemm_pack_a_chunk(const void *p, i64 panel, int tid) {
    const gemm_job *j = p;
    (void)tid;
    float *dst = j->apack + panel * j->K * GEMM_MR;
    for (i64 k = 0; k < j->K; k++)
        for (int r = 0; r < GEMM_MR; r++) {
            i64 m = panel * GEMM_MR + r;
            dst[k * GEMM_MR + r] = m < j->M ? load_any(j->x, j->xbf, m * j->xs + k) : 0.0f;
        }
}

/* A bf16 y: the f32 sums of column panels [lo, hi), rounded once. */
static void gemm_round_chunk(const gemm_job *j, i64 lo, i64 hi) {
    if (!j->y) return;
    i64 n0 = lo * GEMM_NR, n1 = hi * GEMM_NR < j->N ? hi * GEMM_NR : j->N;
    for (i64 m = 0; m < j->M; m++)
        for (i64 n = n0; n < n1; n++) ((bf16 *)j->y)[m * j->ys + n] = f32_to_bf16(j->c[m * j->cs + n]);
}

/* Column panel jp (nr columns; its block [k0, k0 + kc) of the weight at b) against every
 * row panel of x. `next` (or NULL): the block of the weight this thread takes next, put
 * in cache a slice per row panel meanwhile, so that it is not fetched from memory by the
 * first tile that reads it (prefill's weights come from DRAM; about 10% of the GEMM). */
static void gemm_row_panels(const gemm_job *j, const float *b, i64 jp, int nr, i64 k0, i64 kc, const float *next) {
    i64 mp = (j->M + GEMM_MR - 1) / GEMM_MR;
#ifdef NPUC_AVX2
    i64 lines = kc * GEMM_NR / 16, per = (lines + mp - 1) / mp; /* 16 floats a cache line */
#else
    (void)next;
#endif
    for (i64 ip = 0; ip < mp; ip++) {
#ifdef NPUC_AVX2
        if (next)
            for (i64 l = ip * per; l < (ip + 1) * per && l < lines; l++) PREFETCH(next + l * 16);
#endif
        int mr = j->M - ip * GEMM_MR < GEMM_MR ? (int)(j->M - ip * GEMM_MR) : GEMM_MR;
        gemm_tile(kc, j->apack + ip * j->K * GEMM_MR + k0 * GEMM_MR, b, j->c + ip * GEMM_MR * j->cs + jp * GEMM_NR,
                  j->cs, k0 == 0, j->bias ? j->bias + jp * GEMM_NR : NULL, mr, nr);
    }
}

static void gemm_chunk(const void *p, i64 chunk, int tid) {
    const gemm_job *j = p;
    (void)tid;
    i64 panels = (j->N + GEMM_NR - 1) / GEMM_NR, K = j->K;
    i64 lo = chunk * j->per, hi = lo + j->per < panels ? lo + j->per : panels;
    i64 blocks = (K + GEMM_KC - 1) / GEMM_KC, kcb = (K + blocks - 1) / blocks;
    for (i64 k0 = 0; k0 < K; k0 += kcb) {
        i64 kc = K - k0 < kcb ? K - k0 : kcb;
        for (i64 jp = lo; jp < hi; jp++) {
            const float *b = j->packed + jp * K * GEMM_NR + k0 * GEMM_NR;
            int nr = j->N - jp * GEMM_NR < GEMM_NR ? (int)(j->N - jp * GEMM_NR) : GEMM_NR;
            const float *next = jp + 1 < hi ? b + K * GEMM_NR
                                : k0 + kcb < K ? j->packed + lo * K * GEMM_NR + (k0 + kcb) * GEMM_NR : NULL;
            gemm_row_panels(j, b, jp, nr, k0, kc, next);
        }
    }
    gemm_round_chunk(j, lo, hi);
}

/* y[M, N] = x[M, K] (f32 or bf16, row stride xs) times the packed weight, plus bias (f32,
 * N, or NULL; its panels' padding is never read). y is f32 or bf16 (row stride ys).
 * `scratch` holds npuc_gemm_scratch_floats(M, N, K, ybf) floats. */
i64 npuc_gemm_scratch_floats(i64 M, i64 N, i64 K, int ybf) {
    return (M + GEMM_MR - 1) / GEMM_MR * GEMM_MR * K + (ybf ? M * N : 0);
}

int npuc_gemm_f32(const void *x, int xbf, i64 M, i64 xs, const float *packed, i64 N, i64 K, const float *bias,
                  void *y, int ybf, i64 ys, float *scratch, int nt) {
    i64 mp = (M + GEMM_MR - 1) / GEMM_MR, panels = (N + GEMM_NR - 1) / GEMM_NR;
    float *apack = scratch;
    gemm_job j = {x, xbf, M, xs, N, K, packed, bias, ybf ? scratch + mp * GEMM_MR * K : (float *)y,
                  ybf ? N : ys, ybf ? y : NULL, ys, apack, 0};
    nt = threads_for(M * N * K, nt);
    parallel(gemm_pack_a_chunk, &j, mp, threads_for(M * K * 4, nt));
    i64 per = (panels + 4 * nt - 1) / (4 * nt);
    j.per = per < GEMM_PANELS_PER_CHUNK ? per : GEMM_PANELS_PER_CHUNK;
    if (j.per < 1) j.per = 1;
    parallel(gemm_chunk, &j, (panels + j.per - 1) / j.per, nt);
    return 0;
}

/* ---- quantized weights (ir/quant.py): codes i8 [N, K] (bits 8) or u8 [N, K/2] (bits 4,
 * weight 2i in the low nibble), scale and zero point per group of G along K, both given
 * here as f32 [N, K/G] (the launcher widens stored ones once, at load):
 *
 *   y[m, n] = sum_g scale[n, g] * (sum_{k in g} code(n, k) * x[m, k] - zero[n, g] * xsum[m, g]) + bias[n]
 *
 * so the inner loop is a plain dot product of codes and x, and each group's zero point
 * costs one multiply against the group's sum of x, computed once per call. */

static inline float code_at(const uint8_t *q, int bits, i64 K, i64 n, i64 k) {
    if (bits == 8) return (float)((const int8_t *)q)[n * K + k];
    uint8_t b = q[n * (K / 2) + k / 2];
    return (float)((k & 1) ? b >> 4 : b & 15);
}

#ifdef NPUC_AVX2
static inline __m256 load8_i8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
#endif

/* Sums of four int8 code rows (w, w+K, ...) against x over [k0, k1): the plain-C path
 * (an AVX2 build takes qdot4_i8 below). */
static void dot4_i8(const float *x, const int8_t *w, i64 K, i64 k0, i64 k1, float *out) {
    float s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    for (i64 k = k0; k < k1; k++) {
        float xv = x[k];
        s0 += w[k] * xv; s1 += w[K + k] * xv; s2 += w[2 * K + k] * xv; s3 += w[3 * K + k] * xv;
    }
    out[0] = s0; out[1] = s1; out[2] = s2; out[3] = s3;
}

/* The same for 4-bit rows (K/2 bytes apart) over [k0, k1), both multiples of 16: x is
 * deinterleaved per 16 (xd, see deinterleave16), so low nibbles meet the even x and high
 * nibbles the odd ones (an AVX2 build takes qdot4_u4 below). */
static void dot4_u4(const float *xd, const uint8_t *w, i64 K, i64 k0, i64 k1, float *out) {
    const i64 rb = K / 2;
    float s[4] = {0, 0, 0, 0};
    for (i64 k = k0; k < k1; k += 16)
        for (int j = 0; j < 8; j++)
            for (int r = 0; r < 4; r++) {
                uint8_t b = w[r * rb + k / 2 + j];
                s[r] += (float)(b & 15) * xd[k + j] + (float)(b >> 4) * xd[k + 8 + j];
            }
    for (int r = 0; r < 4; r++) out[r] = s[r];
}

#ifdef NPUC_AVX2
/* Four code rows n..n+3 against one x row over all of K, groups applied in the vector
 * domain: t += scale[g] * (the group's partial sums), and the zero points' part,
 * scale * zero * xsum, summed apart and taken off once; one horizontal sum per row, not
 * one per group. Even and odd accumulators keep the FMA chains short. */
static void qdot4_u4(const float *xd, const uint8_t *w, i64 K, i64 G, const float *scale, const float *zero,
                     const float *xsum, float *out) {
    const i64 rb = K / 2, groups = K / G, pf = prefetch_rows(rb, 1) * rb;
    const __m256i lo4 = _mm256_set1_epi32(15);
    __m256 t[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    float corr[4] = {0, 0, 0, 0};
    for (i64 g = 0; g < groups; g++) {
        __m256 a[4], b[4];
        for (int r = 0; r < 4; r++) a[r] = b[r] = _mm256_setzero_ps();
        for (i64 k = g * G; k < (g + 1) * G; k += 16) {
            __m256 xe = _mm256_loadu_ps(xd + k), xo = _mm256_loadu_ps(xd + k + 8);
            if ((k & 127) == 0) /* into L1: this product is bound by its unpacking, not by memory */
                for (int r = 0; r < 4; r++) PREFETCH(w + r * rb + k / 2 + pf);
            for (int r = 0; r < 4; r++) {
                __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(w + r * rb + k / 2)));
                a[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v, lo4)), xe, a[r]);
                b[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4)), xo, b[r]);
            }
        }
        for (int r = 0; r < 4; r++) {
            float sc = scale[r * groups + g];
            t[r] = _mm256_fmadd_ps(_mm256_set1_ps(sc), _mm256_add_ps(a[r], b[r]), t[r]);
            corr[r] += sc * zero[r * groups + g] * xsum[g];
        }
    }
    for (int r = 0; r < 4; r++) out[r] = npuc_hsum8(t[r]) - corr[r];
}

static void qdot4_i8(const float *x, const int8_t *w, i64 K, i64 G, const float *scale, const float *zero,
                     const float *xsum, float *out) {
    const i64 groups = K / G, pf = prefetch_rows(K, 1) * K;
    __m256 t[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    float corr[4] = {0, 0, 0, 0}, tail[4] = {0, 0, 0, 0};
    for (i64 g = 0; g < groups; g++) {
        __m256 a[4], b[4];
        for (int r = 0; r < 4; r++) a[r] = b[r] = _mm256_setzero_ps();
        i64 k = g * G, end = (g + 1) * G;
        for (; k + 16 <= end; k += 16) {
            __m256 x0 = _mm256_loadu_ps(x + k), x1 = _mm256_loadu_ps(x + k + 8);
            if ((k & 63) == 0)
                for (int r = 0; r < 4; r++) PREFETCH_L2(w + r * K + k + pf);
            for (int r = 0; r < 4; r++) {
                a[r] = _mm256_fmadd_ps(load8_i8(w + r * K + k), x0, a[r]);
                b[r] = _mm256_fmadd_ps(load8_i8(w + r * K + k + 8), x1, b[r]);
            }
        }
        float rest[4] = {0, 0, 0, 0};
        for (; k < end; k++)
            for (int r = 0; r < 4; r++) rest[r] += w[r * K + k] * x[k];
        for (int r = 0; r < 4; r++) {
            float sc = scale[r * groups + g];
            t[r] = _mm256_fmadd_ps(_mm256_set1_ps(sc), _mm256_add_ps(a[r], b[r]), t[r]);
            tail[r] += sc * rest[r];
            corr[r] += sc * zero[r * groups + g] * xsum[g];
        }
    }
    for (int r = 0; r < 4; r++) out[r] = npuc_hsum8(t[r]) + tail[r] - corr[r];
}
#endif

typedef struct {
    const float *xf, *xd, *xsum; i64 M, K, N, G; const uint8_t *q; int bits; const float *scale, *zero, *bias;
    void *y; int ybf; i64 ys, per;
} qlinear_job;

static void qlinear_chunk(const void *p, i64 c, int tid) {
    const qlinear_job *j = p;
    (void)tid;
    const i64 K = j->K, G = j->G, groups = K / G;
    i64 lo = c * j->per, hi = lo + j->per < j->N ? lo + j->per : j->N;
    for (i64 n = lo; n < hi; n += 4) {
        i64 rows = hi - n < 4 ? hi - n : 4;
        for (i64 m = 0; m < j->M; m++) {
            float acc[4] = {0, 0, 0, 0};
#ifdef NPUC_AVX2
            if (rows == 4) {
                if (j->bits == 8)
                    qdot4_i8(j->xf + m * K, (const int8_t *)j->q + n * K, K, G, j->scale + n * groups,
                             j->zero + n * groups, j->xsum + m * groups, acc);
                else
                    qdot4_u4(j->xd + m * K, j->q + n * (K / 2), K, G, j->scale + n * groups, j->zero + n * groups,
                             j->xsum + m * groups, acc);
                for (i64 r = 0; r < 4; r++)
                    store_any(j->y, j->ybf, m * j->ys + n + r, acc[r] + (j->bias ? j->bias[n + r] : 0.0f));
                continue;
            }
#endif
            for (i64 g = 0; g < groups; g++) {
                float d[4];
                if (rows == 4 && j->bits == 8)
                    dot4_i8(j->xf + m * K, (const int8_t *)j->q + n * K, K, g * G, (g + 1) * G, d);
                else if (rows == 4)
                    dot4_u4(j->xd + m * K, j->q + n * (K / 2), K, g * G, (g + 1) * G, d);
                else
                    for (i64 r = 0; r < rows; r++) {
                        float s = 0;
                        for (i64 k = g * G; k < (g + 1) * G; k++) s += code_at(j->q, j->bits, K, n + r, k) * j->xf[m * K + k];
                        d[r] = s;
                    }
                for (i64 r = 0; r < rows; r++) {
                    i64 at = (n + r) * groups + g;
                    acc[r] += j->scale[at] * (d[r] - j->zero[at] * j->xsum[m * groups + g]);
                }
            }
            for (i64 r = 0; r < rows; r++)
                store_any(j->y, j->ybf, m * j->ys + n + r, acc[r] + (j->bias ? j->bias[n + r] : 0.0f));
        }
    }
}

/* Floats of scratch npuc_qlinear needs: x widened, deinterleaved, and its group sums. */
i64 npuc_qlinear_scratch_floats(i64 M, i64 K, i64 G) { return 2 * M * K + M * (K / G); }

/* Few rows (decode): each code read once, as stored. x and y f32 or bf16 (flags); G
 * divides K, and for 4 bits is a multiple of 16. */
int npuc_qlinear(const void *x, int xbf, i64 M, i64 xs, const uint8_t *q, int bits, const float *scale,
                 const float *zero, i64 N, i64 K, i64 G, const float *bias, void *y, int ybf, i64 ys,
                 float *scratch, int nt) {
    if (G < 1 || K % G || (bits == 4 && G % 16) || (bits != 4 && bits != 8)) return 1;
    float *xf = scratch, *xd = scratch + M * K, *xsum = scratch + 2 * M * K;
    const i64 groups = K / G;
    for (i64 m = 0; m < M; m++) {
        for (i64 k = 0; k < K; k++) xf[m * K + k] = load_any(x, xbf, m * xs + k);
        if (bits == 4) deinterleave16(xf + m * K, K, xd + m * K);
        for (i64 g = 0; g < groups; g++) {
            float s = 0;
            for (i64 k = g * G; k < (g + 1) * G; k++) s += xf[m * K + k];
            xsum[m * groups + g] = s;
        }
    }
    nt = threads_for(N * K * bits / 8, nt);
    qlinear_job j = {xf, xd, xsum, M, K, N, G, q, bits, scale, zero, bias, y, ybf, ys, chunk_size(N, 16, nt)};
    parallel(qlinear_chunk, &j, (N + j.per - 1) / j.per, nt);
    return 0;
}

/* Many rows (prefill): the GEMM above, its 16-column weight panels dequantized per block
 * of K into a per-thread buffer as the chunk reaches them (each serves every row panel
 * of x), so no f32 copy of the weight is ever kept. */
typedef struct {
    gemm_job g; const uint8_t *q; int bits; const float *scale, *zero; i64 G; float *panels;
} qgemm_job;

static void qgemm_chunk(const void *p, i64 chunk, int tid) {
    const qgemm_job *qj = p;
    const gemm_job *j = &qj->g;
    i64 panels = (j->N + GEMM_NR - 1) / GEMM_NR, K = j->K;
    i64 lo = chunk * j->per, hi = lo + j->per < panels ? lo + j->per : panels;
    i64 blocks = (K + GEMM_KC - 1) / GEMM_KC, kcb = (K + blocks - 1) / blocks, groups = K / qj->G;
    float *b = qj->panels + (i64)tid * kcb * GEMM_NR;
    for (i64 k0 = 0; k0 < K; k0 += kcb) {
        i64 kc = K - k0 < kcb ? K - k0 : kcb;
        for (i64 jp = lo; jp < hi; jp++) {
            int nr = j->N - jp * GEMM_NR < GEMM_NR ? (int)(j->N - jp * GEMM_NR) : GEMM_NR;
            for (i64 k = 0; k < kc; k++) {
                i64 kk = k0 + k, g = kk / qj->G;
                for (int c = 0; c < GEMM_NR; c++) {
                    i64 n = jp * GEMM_NR + c;
                    b[k * GEMM_NR + c] = c < nr ? (code_at(qj->q, qj->bits, K, n, kk) - qj->zero[n * groups + g])
                                                  * qj->scale[n * groups + g] : 0.0f;
                }
            }
            gemm_row_panels(j, b, jp, nr, k0, kc, NULL);
        }
    }
    gemm_round_chunk(j, lo, hi);
}

i64 npuc_qgemm_scratch_floats(i64 M, i64 N, i64 K, int ybf, int nt) {
    i64 blocks = (K + GEMM_KC - 1) / GEMM_KC, kcb = (K + blocks - 1) / blocks;
    return npuc_gemm_scratch_floats(M, N, K, ybf) + (i64)(nt < 1 ? 1 : nt) * kcb * GEMM_NR;
}

int npuc_qgemm(const void *x, int xbf, i64 M, i64 xs, const uint8_t *q, int bits, const float *scale,
               const float *zero, i64 N, i64 K, i64 G, const float *bias, void *y, int ybf, i64 ys, float *scratch,
               int nt) {
    if (G < 1 || K % G || (bits == 4 && G % 2) || (bits != 4 && bits != 8)) return 1;
    if (nt < 1) nt = 1;
    if (nt > MAX_WORKERS + 1) nt = MAX_WORKERS + 1;
    i64 mp = (M + GEMM_MR - 1) / GEMM_MR, npanels = (N + GEMM_NR - 1) / GEMM_NR;
    float *apack = scratch;
    float *cbuf = scratch + mp * GEMM_MR * K;
    qgemm_job qj = {{x, xbf, M, xs, N, K, NULL, bias, ybf ? cbuf : (float *)y, ybf ? N : ys, ybf ? y : NULL, ys,
                     apack, 0},
                    q, bits, scale, zero, G, cbuf + (ybf ? M * N : 0)};
    parallel(gemm_pack_a_chunk, &qj.g, mp, threads_for(M * K * 4, nt));
    i64 per = (npanels + 4 * nt - 1) / (4 * nt);
    qj.g.per = per < GEMM_PANELS_PER_CHUNK ? per : GEMM_PANELS_PER_CHUNK;
    if (qj.g.per < 1) qj.g.per = 1;
    parallel(qgemm_chunk, &qj, (npanels + qj.g.per - 1) / qj.g.per, nt);
    return 0;
}

/* ---- decode's small ops: one call each, instead of a handful of torch calls -------------- */

/* out[r, :] = x[r, :] / sqrt(mean(x[r, :]^2) + eps) * scale, rows of D (all f32); rows
 * split over the pool at prefill sizes. */
typedef struct { const float *x, *scale; float eps; float *out; i64 R, D, per; } rms_job;

static void rms_chunk(const void *p, i64 c, int tid) {
    (void)tid;
    const rms_job *j = p;
    i64 D = j->D, end = (c + 1) * j->per < j->R ? (c + 1) * j->per : j->R;
    for (i64 r = c * j->per; r < end; r++) {
        const float *xr = j->x + r * D;
        float *o = j->out + r * D;
        float ss = 0;
        i64 k = 0;
#ifdef NPUC_AVX2
        __m256 a = _mm256_setzero_ps(), b = a;
        for (; k + 16 <= D; k += 16) {
            __m256 v0 = _mm256_loadu_ps(xr + k), v1 = _mm256_loadu_ps(xr + k + 8);
            a = _mm256_fmadd_ps(v0, v0, a);
            b = _mm256_fmadd_ps(v1, v1, b);
        }
        ss = npuc_hsum8(_mm256_add_ps(a, b));
#endif
        for (; k < D; k++) ss += xr[k] * xr[k];
        float inv = 1.0f / sqrtf(ss / (float)D + j->eps);
        for (k = 0; k < D; k++) o[k] = xr[k] * inv * j->scale[k];
    }
}

int npuc_rms_norm_f32(const float *x, const float *scale, float eps, float *out, i64 R, i64 D, int nt) {
    nt = threads_for(R * D * 4 * 4, nt);
    rms_job j = {x, scale, eps, out, R, D, 1};
    j.per = (R + 4 * nt - 1) / (4 * nt);
    if (j.per < 1) j.per = 1;
    parallel(rms_chunk, &j, (R + j.per - 1) / j.per, nt);
    return 0;
}

/* Rotary embedding from tables: x [G, S, d] (G = batch x heads), pos [S] (or [B, S], per_seq the
 * rows of one sequence), tables [T, half].
 * layout 0 "half": pairs (j, j + half) -> halves; 1 "interleaved": pairs (2j, 2j+1) -> pairs;
 * 2 "deinterleave": pairs (2j, 2j+1) -> halves. Dims past 2*half are copied. */
typedef struct { const float *x; const int64_t *pos; const float *cos_t, *sin_t; float *out;
                 i64 S, d, half, rows, per; int layout; i64 per_seq; } rope_job;

static void rope_chunk(const void *p, i64 c, int tid) {
    (void)tid;
    const rope_job *jb = p;
    i64 d = jb->d, half = jb->half, end = (c + 1) * jb->per < jb->rows ? (c + 1) * jb->per : jb->rows;
    int layout = jb->layout;
    for (i64 r = c * jb->per; r < end; r++) {
        i64 i = jb->per_seq ? (r / jb->per_seq) * jb->S + r % jb->S : r % jb->S;  /* each sequence's rows */
        const float *xr = jb->x + r * d, *cs = jb->cos_t + jb->pos[i] * half, *sn = jb->sin_t + jb->pos[i] * half;
        float *o = jb->out + r * d;
        for (i64 j = 0; j < half; j++) {
            float x1 = layout == 0 ? xr[j] : xr[2 * j], x2 = layout == 0 ? xr[j + half] : xr[2 * j + 1];
            float re = x1 * cs[j] - x2 * sn[j], im = x2 * cs[j] + x1 * sn[j];
            if (layout == 1) { o[2 * j] = re; o[2 * j + 1] = im; }
            else { o[j] = re; o[j + half] = im; }
        }
        for (i64 j = 2 * half; j < d; j++) o[j] = xr[j];
    }
}

/* x [G, S, d] rotated at pos [S]; or (B > 0) x [B, G / B, S, d] with pos [B, S], each sequence's. */
int npuc_rope_f32(const float *x, const int64_t *pos, const float *cos_t, const float *sin_t, float *out,
                  i64 G, i64 S, i64 d, i64 half, i64 T, int layout, i64 B, int nt) {
    for (i64 i = 0; i < (B > 0 ? B * S : S); i++)
        if (pos[i] < 0 || pos[i] >= T) return -1;
    i64 rows = G * S;
    nt = threads_for(rows * d * 4 * 4, nt);
    rope_job j = {x, pos, cos_t, sin_t, out, S, d, half, rows, 1, layout, B > 0 ? rows / B : 0};
    j.per = (rows + 4 * nt - 1) / (4 * nt);
    if (j.per < 1) j.per = 1;
    parallel(rope_chunk, &j, (rows + j.per - 1) / j.per, nt);
    return 0;
}

/* ---- KV caches: four row layouts ----------------------------------------------------------------
 * A cache row (one slot, kv head, position) holds D values as f32, bf16, f16, or packed int8:
 * a 4-byte f32 scale, then D codes, value = code * scale (--kv_cache_dtype's layouts: the
 * reference kernels in ir/fused_ops.py). Rows are whole bytes apart, so one row's address is
 * base + row * kv_row_bytes. */

uint16_t rt_f32_to_f16(float f); /* util.c: to nearest even, as torch */

static inline i64 kv_row_bytes(int kind, i64 D) {
    return kind == NPUC_KV_I8 ? D + 4 : D * (kind == NPUC_KV_F32 ? 4 : 2);
}

static inline float kv_scale(const char *row, int kind) {
    float s = 1.0f;
    if (kind == NPUC_KV_I8) memcpy(&s, row, 4);
    return s;
}

/* Element k of a row, int8 as its code (the caller applies the row's scale). */
static inline float kv_load1(const char *row, int kind, i64 k) {
    switch (kind) {
    case NPUC_KV_F32: return ((const float *)row)[k];
    case NPUC_KV_BF16: return npuc_bf16_to_f32(((const uint16_t *)row)[k]);
    case NPUC_KV_F16: return npuc_f16_to_f32(((const uint16_t *)row)[k]);
    default: return (float)((const int8_t *)(row + 4))[k];
    }
}

/* A row's D values as f32 into out (int8: code * scale, as the reference dequantizes). */
static void kv_row_f32(const char *row, int kind, i64 D, float *out) {
    float s = kv_scale(row, kind);
    switch (kind) {
    case NPUC_KV_F32: memcpy(out, row, (size_t)D * sizeof(float)); break;
    case NPUC_KV_BF16: for (i64 k = 0; k < D; k++) out[k] = kv_load1(row, NPUC_KV_BF16, k); break;
    case NPUC_KV_F16: for (i64 k = 0; k < D; k++) out[k] = kv_load1(row, NPUC_KV_F16, k); break;
    default: for (i64 k = 0; k < D; k++) out[k] = kv_load1(row, NPUC_KV_I8, k) * s; break;
    }
}

/* Row src[from..from+D) (f32 or bf16) into a cache row of layout `kind`. int8: scale =
 * max|x| / 127 (0 for a zero row), code = x / scale rounded half to even (nearbyintf in the
 * default rounding mode, as torch.round), clamped to [-127, 127]. */
static void kv_store_row(char *dst, int kind, const void *src, int sbf, i64 from, i64 D) {
    if (kind == NPUC_KV_F32 || kind == NPUC_KV_BF16) {
        for (i64 k = 0; k < D; k++) store_any(dst, kind == NPUC_KV_BF16, k, load_any(src, sbf, from + k));
    } else if (kind == NPUC_KV_F16) {
        for (i64 k = 0; k < D; k++) ((uint16_t *)dst)[k] = rt_f32_to_f16(load_any(src, sbf, from + k));
    } else {
        float amax = 0.0f;
        for (i64 k = 0; k < D; k++) {
            float a = fabsf(load_any(src, sbf, from + k));
            amax = a > amax ? a : amax;
        }
        float scale = amax / 127.0f;
        memcpy(dst, &scale, 4);
        int8_t *code = (int8_t *)(dst + 4);
        for (i64 k = 0; k < D; k++) {
            float c = scale > 0.0f ? nearbyintf(load_any(src, sbf, from + k) / scale) : 0.0f;
            /* a NaN or an infinite scale has no code: 0 (a C cast of NaN is undefined) */
            code[k] = c != c ? 0 : (int8_t)(c > 127.0f ? 127.0f : c < -127.0f ? -127.0f : c);
        }
    }
}

/* Cache row `row` (of rb bytes) = new's D values from element `from`, in the cache's layout. */
static void kv_put(void *cache, int kind, const void *src, int sbf, i64 rb, i64 row, i64 from, i64 D) {
    char *dst = (char *)cache + row * rb;
    if (kind == sbf) memcpy(dst, (const char *)src + from * (sbf ? 2 : 4), (size_t)rb);
    else kv_store_row(dst, kind, src, sbf, from, D);
}

/* cache[b, h, pos[i], :] = new[b, h, i, :], in place; rows f32 or bf16 (sbf), the cache in any
 * layout (kind). pos [S] for every sequence (pstride 0) or [B, S] (pstride S, each its own);
 * sequence b goes to cache slot b, or (slot >= 0, B = 1) to slot `slot`. D is new's last dim. */
int npuc_kv_write(void *cache, int kind, const void *src, int sbf, const int64_t *pos, i64 pstride, i64 slot,
                  i64 B, i64 H, i64 L, i64 S, i64 D) {
    if (kind < NPUC_KV_F32 || kind > NPUC_KV_I8 || (sbf != 0 && sbf != 1)) return -1;
    for (i64 i = 0; i < (pstride ? B * S : S); i++)
        if (pos[i] < 0 || pos[i] >= L) return -1;
    const i64 rb = kv_row_bytes(kind, D);
    for (i64 bh = 0; bh < B * H; bh++)
        for (i64 i = 0; i < S; i++) {
            i64 b = bh / H, row = ((slot >= 0 ? slot : b) * H + bh % H) * L + pos[b * pstride + i];
            kv_put(cache, kind, src, sbf, rb, row, (bh * S + i) * D, D);
        }
    return 0;
}

/* A mixed step's rows: cache[slot[i], h, pos[i], :] = new[0, h, i, :] (slot[i] of `slots`), in
 * place, as npuc_kv_write; non-zero, before any row is written, for a slot or position outside. */
int npuc_kv_write_rows(void *cache, int kind, const void *src, int sbf, const int64_t *pos, const int64_t *slot,
                       i64 slots, i64 H, i64 L, i64 S, i64 D) {
    if (kind < NPUC_KV_F32 || kind > NPUC_KV_I8 || (sbf != 0 && sbf != 1)) return -1;
    for (i64 i = 0; i < S; i++)
        if (pos[i] < 0 || pos[i] >= L || slot[i] < 0 || slot[i] >= slots) return -1;
    const i64 rb = kv_row_bytes(kind, D);
    for (i64 h = 0; h < H; h++)
        for (i64 i = 0; i < S; i++)
            kv_put(cache, kind, src, sbf, rb, (slot[i] * H + h) * L + pos[i], (h * S + i) * D, D);
    return 0;
}

/* ---- decode attention over a cache: flash-decoding -----------------------------------------
 * The queries that share a kv head (G heads x S queries, query-major) are cut into blocks of
 * DEC_QB rows; a job is one (slot, kv head, block) and, where those are too few to keep the
 * threads busy, one split of its keys. A job reads its keys in tiles of T = DEC_SC / rows: scores of the
 * tile for every row of the block (each key row loaded once for all of them: GQA's G heads),
 * then an online softmax (running max m, sum l; the accumulator rescaled by e^(m_old - m_new)
 * when the max grows), then the tile's values. A job that covers all keys writes acc / l; the
 * splits of one (slot, kv head, block) leave (m, l, acc) each, merged by a second pass. The
 * cache is read once per kv head, at whatever layout it is stored in: int8 codes are widened
 * in registers and the row's scale multiplies the dot (keys) or the weight p (values). */

/* sc[r] = exp(sc[r] - mx) for r < n, in place; their sum (softmax's numerator and denominator). */
static float exp_sum(float *sc, i64 n, float mx) {
    float sum = 0;
    i64 r = 0;
#ifdef NPUC_AVX2
    __m256 vm = _mm256_set1_ps(mx), vs = _mm256_setzero_ps();
    for (; r + 8 <= n; r += 8) {
        __m256 e = npuc_exp8(_mm256_sub_ps(_mm256_loadu_ps(sc + r), vm));
        _mm256_storeu_ps(sc + r, e);
        vs = _mm256_add_ps(vs, e);
    }
    sum = npuc_hsum8(vs);
#endif
    for (; r < n; r++) { sc[r] = expf(sc[r] - mx); sum += sc[r]; }
    return sum;
}

/* max(x[0..n)), -inf for n = 0 (a vector pass: a scalar one is a chain of dependent maxes). */
static float max_of(const float *x, i64 n) {
    float m = -INFINITY;
    i64 r = 0;
#ifdef NPUC_AVX2
    __m256 v0 = _mm256_set1_ps(-INFINITY), v1 = v0;
    for (; r + 16 <= n; r += 16) {
        v0 = _mm256_max_ps(v0, _mm256_loadu_ps(x + r));
        v1 = _mm256_max_ps(v1, _mm256_loadu_ps(x + r + 8));
    }
    float t[8];
    _mm256_storeu_ps(t, _mm256_max_ps(v0, v1));
    for (int u = 0; u < 8; u++) m = t[u] > m ? t[u] : m;
#endif
    for (; r < n; r++) m = x[r] > m ? x[r] : m;
    return m;
}

#define DEC_QB 32          /* query rows per job */
#ifndef DEC_SC
#define DEC_SC 4096        /* the score block's floats: DEC_SC / rows keys per tile, whatever the depth */
#endif
#define DEC_MIN_SPLIT 256  /* fewest keys worth a split (a split costs a (m, l, acc) merge) */

/* How many splits per (slot, kv head, block): 1 where there are 4 jobs a thread already; else
 * enough for that, but no split under DEC_MIN_SPLIT keys. n: the most keys a row sees. */
static i64 dec_splits(i64 units, i64 n, int nt) {
    if (nt <= 1 || units >= 4 * (i64)nt) return 1;
    i64 want = (4 * (i64)nt + units - 1) / units, most = n / DEC_MIN_SPLIT;
    return want < most ? want : (most < 1 ? 1 : most);
}

typedef struct {
    const void *q; int qbf; const char *kc, *vc; int kind; const int64_t *pos; i64 pstride; void *out; int obf;
    i64 HQ, S, D, HKV, L, DV, G, NR, QB, T, nblk, nsplit, chunk, krb, vrb; float scale;
    float *ws; i64 per; float *part;
    i64 qsb, qsh;         /* q's and out's rows: sequence b, head h, query i at b * qsb + h * qsh + i */
    const int64_t *slot;  /* NULL: sequence b reads cache b; else cache slot[b] (a mixed step's rows) */
} dec_job;

#ifdef NPUC_AVX2
/* 8 values of a row from element k, as f32 (int8: the codes; the scale is the caller's). */
static inline __attribute__((always_inline)) __m256 kv_load8(const char *row, int kind, i64 k) {
    switch (kind) {
    case NPUC_KV_F32: return _mm256_loadu_ps((const float *)row + k);
    case NPUC_KV_BF16: return npuc_load8_bf16((const uint16_t *)row + k);
    case NPUC_KV_F16:
#ifdef __F16C__
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + k)));
#else
    {
        float t[8];
        for (int u = 0; u < 8; u++) t[u] = npuc_f16_to_f32(((const uint16_t *)row)[k + u]);
        return _mm256_loadu_ps(t);
    }
#endif
    default: return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(row + 4 + k))));
    }
}

/* One query row (D % 8 == 0): sc[j] = scale * q . key(j0 + j) for j < n, four keys at a time
 * (one q load serves four rows, one reduction four sums). `kind` a constant where inlined. */
static inline __attribute__((always_inline)) void dec_scores1(const float *qf, const char *k, i64 krb, int kind,
                                                                i64 D, i64 n, float scale, float *sc) {
    i64 j = 0;
    for (; j + 4 <= n; j += 4) {
        const char *r0 = k + j * krb, *r1 = r0 + krb, *r2 = r1 + krb, *r3 = r2 + krb;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
        for (i64 d = 0; d < D; d += 8) {
            __m256 qv = _mm256_loadu_ps(qf + d);
            a0 = _mm256_fmadd_ps(qv, kv_load8(r0, kind, d), a0);
            a1 = _mm256_fmadd_ps(qv, kv_load8(r1, kind, d), a1);
            a2 = _mm256_fmadd_ps(qv, kv_load8(r2, kind, d), a2);
            a3 = _mm256_fmadd_ps(qv, kv_load8(r3, kind, d), a3);
        }
        __m256 hs = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
        __m128 s4 = _mm_mul_ps(_mm_add_ps(_mm256_castps256_ps128(hs), _mm256_extractf128_ps(hs, 1)),
                               _mm_set1_ps(scale));
        if (kind == NPUC_KV_I8)
            s4 = _mm_mul_ps(s4, _mm_setr_ps(kv_scale(r0, kind), kv_scale(r1, kind), kv_scale(r2, kind),
                                            kv_scale(r3, kind)));
        _mm_storeu_ps(sc + j, s4);
    }
    for (; j < n; j++) {
        const char *r = k + j * krb;
        __m256 a = _mm256_setzero_ps();
        for (i64 d = 0; d < D; d += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(qf + d), kv_load8(r, kind, d), a);
        sc[j] = npuc_hsum8(a) * scale * kv_scale(r, kind);
    }
}

/* One query row (DV % 8 == 0): acc += sum_j p[j] * value(j0 + j), four value rows per pass. */
static inline __attribute__((always_inline)) void dec_values1(const float *p, const char *v, i64 vrb, int kind,
                                                                i64 DV, i64 n, float *acc) {
    i64 j = 0;
    for (; j + 4 <= n; j += 4) {
        const char *r0 = v + j * vrb, *r1 = r0 + vrb, *r2 = r1 + vrb, *r3 = r2 + vrb;
        __m256 p0 = _mm256_set1_ps(p[j] * kv_scale(r0, kind)), p1 = _mm256_set1_ps(p[j + 1] * kv_scale(r1, kind)),
               p2 = _mm256_set1_ps(p[j + 2] * kv_scale(r2, kind)), p3 = _mm256_set1_ps(p[j + 3] * kv_scale(r3, kind));
        for (i64 d = 0; d < DV; d += 8) {
            __m256 a = _mm256_fmadd_ps(p0, kv_load8(r0, kind, d), _mm256_loadu_ps(acc + d));
            a = _mm256_fmadd_ps(p1, kv_load8(r1, kind, d), a);
            a = _mm256_fmadd_ps(p2, kv_load8(r2, kind, d), a);
            _mm256_storeu_ps(acc + d, _mm256_fmadd_ps(p3, kv_load8(r3, kind, d), a));
        }
    }
    for (; j < n; j++) {
        const char *r = v + j * vrb;
        __m256 pv = _mm256_set1_ps(p[j] * kv_scale(r, kind));
        for (i64 d = 0; d < DV; d += 8)
            _mm256_storeu_ps(acc + d, _mm256_fmadd_ps(pv, kv_load8(r, kind, d), _mm256_loadu_ps(acc + d)));
    }
}


/* Head dim 64, the common one: q (8 vectors) stays in registers over the keys, and the output
 * row over the values, so each K or V load feeds an FMA without a q or acc load beside it. One
 * key row at a time: four rows interleaved (as dec_scores1) read an f32 cache ~10% slower. */
static inline __attribute__((always_inline)) void dec_scores64(const float *qf, const char *k, i64 krb, int kind,
                                                                 i64 n, float scale, float *sc) {
    const __m256 q0 = _mm256_loadu_ps(qf), q1 = _mm256_loadu_ps(qf + 8), q2 = _mm256_loadu_ps(qf + 16),
                 q3 = _mm256_loadu_ps(qf + 24), q4 = _mm256_loadu_ps(qf + 32), q5 = _mm256_loadu_ps(qf + 40),
                 q6 = _mm256_loadu_ps(qf + 48), q7 = _mm256_loadu_ps(qf + 56);
    for (i64 j = 0; j < n; j++) {
        const char *r = k + j * krb;
        __m256 x = _mm256_mul_ps(q0, kv_load8(r, kind, 0));
        x = _mm256_fmadd_ps(q1, kv_load8(r, kind, 8), x);
        x = _mm256_fmadd_ps(q2, kv_load8(r, kind, 16), x);
        x = _mm256_fmadd_ps(q3, kv_load8(r, kind, 24), x);
        x = _mm256_fmadd_ps(q4, kv_load8(r, kind, 32), x);
        x = _mm256_fmadd_ps(q5, kv_load8(r, kind, 40), x);
        x = _mm256_fmadd_ps(q6, kv_load8(r, kind, 48), x);
        x = _mm256_fmadd_ps(q7, kv_load8(r, kind, 56), x);
        sc[j] = npuc_hsum8(x) * scale * kv_scale(r, kind);
    }
}

static inline __attribute__((always_inline)) void dec_values64(const float *p, const char *v, i64 vrb, int kind,
                                                                 i64 n, float *acc) {
    __m256 c0 = _mm256_loadu_ps(acc), c1 = _mm256_loadu_ps(acc + 8), c2 = _mm256_loadu_ps(acc + 16),
           c3 = _mm256_loadu_ps(acc + 24), c4 = _mm256_loadu_ps(acc + 32), c5 = _mm256_loadu_ps(acc + 40),
           c6 = _mm256_loadu_ps(acc + 48), c7 = _mm256_loadu_ps(acc + 56);
    for (i64 j = 0; j < n; j++) {
        const char *r = v + j * vrb;
        __m256 pv = _mm256_set1_ps(p[j] * kv_scale(r, kind));
        c0 = _mm256_fmadd_ps(pv, kv_load8(r, kind, 0), c0);
        c1 = _mm256_fmadd_ps(pv, kv_load8(r, kind, 8), c1);
        c2 = _mm256_fmadd_ps(pv, kv_load8(r, kind, 16), c2);
        c3 = _mm256_fmadd_ps(pv, kv_load8(r, kind, 24), c3);
        c4 = _mm256_fmadd_ps(pv, kv_load8(r, kind, 32), c4);
        c5 = _mm256_fmadd_ps(pv, kv_load8(r, kind, 40), c5);
        c6 = _mm256_fmadd_ps(pv, kv_load8(r, kind, 48), c6);
        c7 = _mm256_fmadd_ps(pv, kv_load8(r, kind, 56), c7);
    }
    _mm256_storeu_ps(acc, c0); _mm256_storeu_ps(acc + 8, c1); _mm256_storeu_ps(acc + 16, c2);
    _mm256_storeu_ps(acc + 24, c3); _mm256_storeu_ps(acc + 32, c4); _mm256_storeu_ps(acc + 40, c5);
    _mm256_storeu_ps(acc + 48, c6); _mm256_storeu_ps(acc + 56, c7);
}

/* NR (2..4) query rows of a GQA block over the same keys (D % 8 == 0): each 8 values of a key
 * row loaded (and widened) once for all NR rows, four keys at a time, q read from L1 as the
 * FMA's memory operand; sc[r * ss + j] = scale * q_r . key(j). `NR` and `kind` constants. */
static inline __attribute__((always_inline)) void dec_scores_g(const float *qf, i64 D, int NR, const char *k,
                                                                 i64 krb, int kind, i64 n, float scale, float *sc,
                                                                 i64 ss) {
    i64 j = 0;
    for (; j + 4 <= n; j += 4) {
        const char *r0 = k + j * krb;
        __m256 a[4][4];
        for (int r = 0; r < NR; r++)
            for (int t = 0; t < 4; t++) a[r][t] = _mm256_setzero_ps();
        for (i64 d = 0; d < D; d += 8)
            for (int t = 0; t < 4; t++) {
                __m256 kv = kv_load8(r0 + t * krb, kind, d);
                for (int r = 0; r < NR; r++) a[r][t] = _mm256_fmadd_ps(_mm256_loadu_ps(qf + r * D + d), kv, a[r][t]);
            }
        __m128 ks = _mm_set1_ps(scale);
        if (kind == NPUC_KV_I8)
            ks = _mm_mul_ps(ks, _mm_setr_ps(kv_scale(r0, kind), kv_scale(r0 + krb, kind), kv_scale(r0 + 2 * krb, kind),
                                            kv_scale(r0 + 3 * krb, kind)));
        for (int r = 0; r < NR; r++) {
            __m256 hs = _mm256_hadd_ps(_mm256_hadd_ps(a[r][0], a[r][1]), _mm256_hadd_ps(a[r][2], a[r][3]));
            _mm_storeu_ps(sc + r * ss + j,
                          _mm_mul_ps(_mm_add_ps(_mm256_castps256_ps128(hs), _mm256_extractf128_ps(hs, 1)), ks));
        }
    }
    for (int r = 0; r < NR; r++)
        if (j < n) dec_scores1(qf + r * D, k + j * krb, krb, kind, D, n - j, scale, sc + r * ss + j);
}

static void dec_scores_g_any(const float *qf, i64 D, int nr, const char *k, i64 krb, int kind, i64 n, float scale,
                             float *sc, i64 ss) {
#define DEC_G_KINDS(NR)                                                                                       \
    switch (kind) {                                                                                           \
    case NPUC_KV_F32: dec_scores_g(qf, D, NR, k, krb, NPUC_KV_F32, n, scale, sc, ss); return;                 \
    case NPUC_KV_BF16: dec_scores_g(qf, D, NR, k, krb, NPUC_KV_BF16, n, scale, sc, ss); return;               \
    case NPUC_KV_F16: dec_scores_g(qf, D, NR, k, krb, NPUC_KV_F16, n, scale, sc, ss); return;                 \
    default: dec_scores_g(qf, D, NR, k, krb, NPUC_KV_I8, n, scale, sc, ss); return;                           \
    }
    if (nr == 2) DEC_G_KINDS(2)
    if (nr == 3) DEC_G_KINDS(3)
    DEC_G_KINDS(4)
#undef DEC_G_KINDS
}

#ifdef NPUC_AVX512
/* 16 values of a row from element k as f32 (int8: the codes). */
static inline __attribute__((always_inline)) __m512 kv_load16(const char *row, int kind, i64 k) {
    switch (kind) {
    case NPUC_KV_F32: return _mm512_loadu_ps((const float *)row + k);
    case NPUC_KV_BF16:
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)((const uint16_t *)row + k))), 16));
    case NPUC_KV_F16: return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)row + k)));
    default: return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(row + 4 + k))));
    }
}

/* NR (2..4) query rows of a GQA block, DV = 64: acc_r += sum_j p_r[j] * value(j), each value row
 * loaded (and widened) once for all NR rows, the NR x 64 accumulators in 16 zmm registers at most.
 * p_r = p + r * ps. `NR` and `kind` constants. */
static inline __attribute__((always_inline)) void dec_values_g64(const float *p, i64 ps, int NR, const char *v,
                                                                   i64 vrb, int kind, i64 n, float *acc) {
    __m512 a[4][4];
    for (int r = 0; r < NR; r++)
        for (int c = 0; c < 4; c++) a[r][c] = _mm512_loadu_ps(acc + r * 64 + c * 16);
    for (i64 j = 0; j < n; j++) {
        const char *row = v + j * vrb;
        const float ks = kv_scale(row, kind);
        __m512 x0 = kv_load16(row, kind, 0), x1 = kv_load16(row, kind, 16), x2 = kv_load16(row, kind, 32),
               x3 = kv_load16(row, kind, 48);
        for (int r = 0; r < NR; r++) {
            __m512 pv = _mm512_set1_ps(p[r * ps + j] * ks);
            a[r][0] = _mm512_fmadd_ps(pv, x0, a[r][0]);
            a[r][1] = _mm512_fmadd_ps(pv, x1, a[r][1]);
            a[r][2] = _mm512_fmadd_ps(pv, x2, a[r][2]);
            a[r][3] = _mm512_fmadd_ps(pv, x3, a[r][3]);
        }
    }
    for (int r = 0; r < NR; r++)
        for (int c = 0; c < 4; c++) _mm512_storeu_ps(acc + r * 64 + c * 16, a[r][c]);
}

static void dec_values_g64_any(const float *p, i64 ps, int nr, const char *v, i64 vrb, int kind, i64 n,
                               float *acc) {
#define DEC_VG_KINDS(NR)                                                                                      \
    switch (kind) {                                                                                           \
    case NPUC_KV_F32: dec_values_g64(p, ps, NR, v, vrb, NPUC_KV_F32, n, acc); return;                         \
    case NPUC_KV_BF16: dec_values_g64(p, ps, NR, v, vrb, NPUC_KV_BF16, n, acc); return;                       \
    case NPUC_KV_F16: dec_values_g64(p, ps, NR, v, vrb, NPUC_KV_F16, n, acc); return;                         \
    default: dec_values_g64(p, ps, NR, v, vrb, NPUC_KV_I8, n, acc); return;                                   \
    }
    if (nr == 2) DEC_VG_KINDS(2)
    if (nr == 3) DEC_VG_KINDS(3)
    DEC_VG_KINDS(4)
#undef DEC_VG_KINDS
}
#endif

/* The two above for a run-time layout: each case inlines its own copy. */
static void dec_scores1_any(const float *qf, const char *k, i64 krb, int kind, i64 D, i64 n, float scale,
                            float *sc) {
    if (D == 64) {
        switch (kind) {
        case NPUC_KV_F32: dec_scores64(qf, k, krb, NPUC_KV_F32, n, scale, sc); return;
        case NPUC_KV_BF16: dec_scores64(qf, k, krb, NPUC_KV_BF16, n, scale, sc); return;
        case NPUC_KV_F16: dec_scores64(qf, k, krb, NPUC_KV_F16, n, scale, sc); return;
        default: dec_scores64(qf, k, krb, NPUC_KV_I8, n, scale, sc); return;
        }
    }
    switch (kind) {
    case NPUC_KV_F32: dec_scores1(qf, k, krb, NPUC_KV_F32, D, n, scale, sc); break;
    case NPUC_KV_BF16: dec_scores1(qf, k, krb, NPUC_KV_BF16, D, n, scale, sc); break;
    case NPUC_KV_F16: dec_scores1(qf, k, krb, NPUC_KV_F16, D, n, scale, sc); break;
    default: dec_scores1(qf, k, krb, NPUC_KV_I8, D, n, scale, sc); break;
    }
}

static void dec_values1_any(const float *p, const char *v, i64 vrb, int kind, i64 DV, i64 n, float *acc) {
    if (DV == 64) {
        switch (kind) {
        case NPUC_KV_F32: dec_values64(p, v, vrb, NPUC_KV_F32, n, acc); return;
        case NPUC_KV_BF16: dec_values64(p, v, vrb, NPUC_KV_BF16, n, acc); return;
        case NPUC_KV_F16: dec_values64(p, v, vrb, NPUC_KV_F16, n, acc); return;
        default: dec_values64(p, v, vrb, NPUC_KV_I8, n, acc); return;
        }
    }
    switch (kind) {
    case NPUC_KV_F32: dec_values1(p, v, vrb, NPUC_KV_F32, DV, n, acc); break;
    case NPUC_KV_BF16: dec_values1(p, v, vrb, NPUC_KV_BF16, DV, n, acc); break;
    case NPUC_KV_F16: dec_values1(p, v, vrb, NPUC_KV_F16, DV, n, acc); break;
    default: dec_values1(p, v, vrb, NPUC_KV_I8, DV, n, acc); break;
    }
}
#endif

static void dec_chunk(const void *p, i64 c, int tid) {
    const dec_job *j = p;
    const i64 D = j->D, DV = j->DV, QB = j->QB, sp = c % j->nsplit, blk = (c / j->nsplit) % j->nblk;
    const i64 u = c / j->nsplit / j->nblk, b = u / j->HKV, kvh = u % j->HKV;
    const i64 r0 = blk * QB, nr = j->NR - r0 < QB ? j->NR - r0 : QB;
    float *sc = j->ws + (i64)tid * j->per, *qf = sc + QB * j->T, *acc = qf + QB * D, *m = acc + QB * DV,
          *l = m + QB, *kr = l + QB, *vr = kr + D;
    i64 n[DEC_QB], nmax = 0;
    for (i64 rr = 0; rr < nr; rr++) {
        i64 r = r0 + rr, i = r / j->G, h = kvh * j->G + r % j->G;
        n[rr] = j->pos[b * j->pstride + i] + 1;
        nmax = n[rr] > nmax ? n[rr] : nmax;
        for (i64 k = 0; k < D; k++) qf[rr * D + k] = load_any(j->q, j->qbf, (b * j->qsb + h * j->qsh + i) * D + k);
        m[rr] = -INFINITY, l[rr] = 0.0f;
    }
    memset(acc, 0, (size_t)(nr * DV) * sizeof(float));
    const i64 k0 = sp * j->chunk, k1 = k0 + j->chunk < nmax ? k0 + j->chunk : nmax;
    const i64 cu = j->slot != NULL ? j->slot[b] * j->HKV + kvh : u; /* the cache rows this sequence reads */
    const char *kb = j->kc + cu * j->L * j->krb, *vb = j->vc + cu * j->L * j->vrb;
    for (i64 t0 = k0; t0 < k1; t0 += j->T) {
        const i64 nt = k1 - t0 < j->T ? k1 - t0 : j->T;
        int fast = 0;
#ifdef NPUC_AVX2
        /* row by row over the tile: the tile came from memory for the first row, from L2 for the
         * others (npuc_cached_attention sizes it so) */
        fast = D % 8 == 0 && DV % 8 == 0;
        /* decode's GQA block over a half or int8 cache (2-4 rows that all see the tile's keys): each
         * key row loaded and widened once (f32: no faster than a row at a time, measured) */
        int shared = fast && j->kind != NPUC_KV_F32 && nr >= 2 && nr <= 4;
        for (i64 rr = 0; rr < nr && shared; rr++) shared = n[rr] - t0 >= nt;
        if (shared) dec_scores_g_any(qf, D, (int)nr, kb + t0 * j->krb, j->krb, j->kind, nt, j->scale, sc, j->T);
        if (fast && !shared)
            for (i64 rr = 0; rr < nr; rr++) {
                i64 seen = n[rr] - t0 < nt ? n[rr] - t0 : nt;
                if (seen > 0) dec_scores1_any(qf + rr * D, kb + t0 * j->krb, j->krb, j->kind, D, seen, j->scale,
                                              sc + rr * j->T);
            }
#endif
        if (!fast)
            for (i64 t = 0; t < nt; t++) { /* a key row once, for every row of the block */
                const char *row = kb + (t0 + t) * j->krb;
                const float *kf = (const float *)row;
                if (j->kind != NPUC_KV_F32) kv_row_f32(row, j->kind, D, kr), kf = kr;
                for (i64 rr = 0; rr < nr; rr++)
                    sc[rr * j->T + t] = t0 + t < n[rr] ? dot1_f32(qf + rr * D, kf, D) * j->scale : -INFINITY;
            }
        for (i64 rr = 0; rr < nr; rr++) { /* the online softmax: this tile's weights, acc rescaled */
            float *row = sc + rr * j->T;
            i64 seen = n[rr] - t0 < nt ? n[rr] - t0 : nt;
            if (seen <= 0) continue;
            float mt = max_of(row, seen);
            if (mt > m[rr]) {
                float alpha = expf(m[rr] - mt); /* 0 on the first tile (m = -inf) */
                l[rr] *= alpha;
                for (i64 k = 0; k < DV; k++) acc[rr * DV + k] *= alpha;
                m[rr] = mt;
            }
            l[rr] += exp_sum(row, seen, m[rr]);
        }
        int vshared = 0;
#ifdef NPUC_AVX512
        /* the same block's values: each value row loaded once for its 2-4 rows (AVX-512: 16 zmm) */
        vshared = fast && DV == 64 && nr >= 2 && nr <= 4;
        for (i64 rr = 0; rr < nr && vshared; rr++) vshared = n[rr] - t0 >= nt;
        if (vshared) dec_values_g64_any(sc, j->T, (int)nr, vb + t0 * j->vrb, j->vrb, j->kind, nt, acc);
#endif
        if (fast && !vshared) {
#ifdef NPUC_AVX2
            for (i64 rr = 0; rr < nr; rr++) {
                i64 seen = n[rr] - t0 < nt ? n[rr] - t0 : nt;
                if (seen > 0) dec_values1_any(sc + rr * j->T, vb + t0 * j->vrb, j->vrb, j->kind, DV, seen,
                                              acc + rr * DV);
            }
#endif
        } else if (!fast) {
            for (i64 t = 0; t < nt; t++) {
                const char *row = vb + (t0 + t) * j->vrb;
                const float *vf = (const float *)row;
                if (j->kind != NPUC_KV_F32) kv_row_f32(row, j->kind, DV, vr), vf = vr;
                for (i64 rr = 0; rr < nr; rr++)
                    if (t0 + t < n[rr]) npuc_axpy_f32(sc[rr * j->T + t], vf, acc + rr * DV, DV);
            }
        }
    }
    for (i64 rr = 0; rr < nr; rr++) {
        float *a = acc + rr * DV;
        if (j->nsplit > 1) { /* this split's (m, l, acc), merged by dec_merge */
            float *o = j->part + (c * QB + rr) * (DV + 2);
            o[0] = m[rr], o[1] = l[rr];
            memcpy(o + 2, a, (size_t)DV * sizeof(float));
            continue;
        }
        i64 r = r0 + rr, i = r / j->G, h = kvh * j->G + r % j->G;
        float inv = 1.0f / l[rr];
        for (i64 k = 0; k < DV; k++) store_any(j->out, j->obf, (b * j->qsb + h * j->qsh + i) * DV + k, a[k] * inv);
    }
}

/* The splits of one (slot, kv head, block): out = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s. */
static void dec_merge(const void *p, i64 ub, int tid) {
    const dec_job *j = p;
    const i64 DV = j->DV, QB = j->QB, blk = ub % j->nblk, u = ub / j->nblk, b = u / j->HKV, kvh = u % j->HKV;
    const i64 r0 = blk * QB, nr = j->NR - r0 < QB ? j->NR - r0 : QB;
    float *acc = j->ws + (i64)tid * j->per;
    for (i64 rr = 0; rr < nr; rr++) {
        float M = -INFINITY, l = 0.0f;
        for (i64 s = 0; s < j->nsplit; s++) {
            float ms = j->part[((ub * j->nsplit + s) * QB + rr) * (DV + 2)];
            M = ms > M ? ms : M;
        }
        memset(acc, 0, (size_t)DV * sizeof(float));
        for (i64 s = 0; s < j->nsplit; s++) {
            const float *o = j->part + ((ub * j->nsplit + s) * QB + rr) * (DV + 2);
            if (o[0] == -INFINITY) continue; /* a split past this row's keys */
            float w = expf(o[0] - M);
            l += w * o[1];
            npuc_axpy_f32(w, o + 2, acc, DV);
        }
        i64 r = r0 + rr, i = r / j->G, h = kvh * j->G + r % j->G;
        float inv = 1.0f / l;
        for (i64 k = 0; k < DV; k++) store_any(j->out, j->obf, (b * j->qsb + h * j->qsh + i) * DV + k, acc[k] * inv);
    }
}

/* The job's shape from the call's: rows per block, blocks, splits for keys up to n. */
static dec_job dec_plan(i64 B, i64 HQ, i64 S, i64 D, i64 HKV, i64 L, i64 DV, i64 n, int nt) {
    dec_job j;
    memset(&j, 0, sizeof j);
    j.HQ = HQ, j.S = S, j.D = D, j.HKV = HKV, j.L = L, j.DV = DV, j.G = HQ / HKV, j.NR = j.G * S;
    j.QB = j.NR < DEC_QB ? j.NR : DEC_QB;
    j.nblk = j.QB ? (j.NR + j.QB - 1) / j.QB : 0;
    j.nsplit = dec_splits(B * HKV * j.nblk, n, nt);
    j.chunk = (n + j.nsplit - 1) / j.nsplit;
    j.T = j.QB ? DEC_SC / j.QB : DEC_SC;
    j.per = j.QB * (D + DV + j.T + 2) + D + DV;
    return j;
}

i64 npuc_cached_attention_scratch_floats(i64 B, i64 HQ, i64 S, i64 D, i64 HKV, i64 L, i64 DV, int nt) {
    if (HKV < 1 || HQ % HKV) return 0;
    nt = nt < 1 ? 1 : nt;
    dec_job j = dec_plan(B, HQ, S, D, HKV, L, DV, L, nt);
    i64 part = j.nsplit > 1 ? B * HKV * j.nblk * j.nsplit * j.QB * (DV + 2) : 0;
    return nt * j.per + part;
}

/* Causal attention over a KV cache: query i of sequence b (at pos[b * pstride + i]) attends
 * cached rows 0..pos. q [B, HQ, S, D] f32 or bf16 (qbf), caches [B, HKV, L, D] / [.., DV] in
 * layout `kind` (int8: rows of D + 4 bytes), out [B, HQ, S, DV] f32 or bf16 (obf); scores and
 * softmax in f32. scratch: npuc_cached_attention_scratch_floats with the same nt. Non-zero,
 * before any row is read, for a position outside the cache or a layout it does not know. */
static int cached_attention(const void *q, int qbf, const void *kc, const void *vc, int kind, const int64_t *pos,
                            i64 pstride, const int64_t *slot, void *out, int obf, i64 B, i64 HQ, i64 S, i64 D, i64 HKV,
                            i64 L, i64 DV, float scale, float *scratch, int nt);

int npuc_cached_attention(const void *q, int qbf, const void *kc, const void *vc, int kind, const int64_t *pos,
                          i64 pstride, void *out, int obf, i64 B, i64 HQ, i64 S, i64 D, i64 HKV, i64 L, i64 DV,
                          float scale, float *scratch, int nt) {
    return cached_attention(q, qbf, kc, vc, kind, pos, pstride, NULL, out, obf, B, HQ, S, D, HKV, L, DV, scale, scratch,
                            nt);
}

/* A mixed step's rows: q [1, HQ, N, D], row i over cache slot[i] (of `slots`) up to pos[i]; as N
 * sequences of one query each, whose q and out rows are strided by N per head. */
int npuc_cached_attention_rows(const void *q, int qbf, const void *kc, const void *vc, int kind, const int64_t *pos,
                               const int64_t *slot, i64 slots, void *out, int obf, i64 N, i64 HQ, i64 D, i64 HKV,
                               i64 L, i64 DV, float scale, float *scratch, int nt) {
    for (i64 i = 0; i < N; i++)
        if (slot[i] < 0 || slot[i] >= slots) return -1;
    return cached_attention(q, qbf, kc, vc, kind, pos, 1, slot, out, obf, N, HQ, 1, D, HKV, L, DV, scale, scratch, nt);
}

static int cached_attention(const void *q, int qbf, const void *kc, const void *vc, int kind, const int64_t *pos,
                            i64 pstride, const int64_t *slot, void *out, int obf, i64 B, i64 HQ, i64 S, i64 D, i64 HKV,
                            i64 L, i64 DV, float scale, float *scratch, int nt) {
    if (kind < NPUC_KV_F32 || kind > NPUC_KV_I8 || HKV < 1 || HQ % HKV) return -1;
    i64 n = 0;
    for (i64 i = 0; i < (pstride ? B * S : S); i++) {
        if (pos[i] < 0 || pos[i] >= L) return -1;
        n = pos[i] + 1 > n ? pos[i] + 1 : n;
    }
    if (B * HQ * S == 0 || DV == 0) return 0;
    nt = nt < 1 ? 1 : nt;
    const i64 krb = kv_row_bytes(kind, D), vrb = kv_row_bytes(kind, DV);
    int use = threads_for(B * HKV * n * (krb + vrb), nt);
    dec_job j = dec_plan(B, HQ, S, D, HKV, L, DV, n, use);
    j.q = q, j.qbf = qbf, j.kc = kc, j.vc = vc, j.kind = kind, j.pos = pos, j.pstride = pstride, j.out = out;
    j.obf = obf, j.krb = krb, j.vrb = vrb, j.scale = scale, j.ws = scratch, j.part = scratch + nt * j.per;
    j.slot = slot, j.qsb = slot != NULL ? 1 : HQ * S, j.qsh = slot != NULL ? B : S;
    if (j.QB > 1) { /* a tile's K and V rows within ~256 KiB, so the block's later rows read them from L2 */
        i64 fit = (256 << 10) / (krb + vrb);
        j.T = fit < 16 ? 16 : fit < j.T ? fit : j.T;
    }
    parallel(dec_chunk, &j, B * HKV * j.nblk * j.nsplit, use);
    if (j.nsplit > 1) parallel(dec_merge, &j, B * HKV * j.nblk, use);
    return 0;
}

/* ---- prefill attention as small GEMMs ---------------------------------------------------------
 * Many queries (prefill): per (batch, query head, block of GEMM_MR queries), the keys are taken
 * in tiles of FA_KT: the tile's scores are a GEMM_MR x FA_KT product of the block's q rows with
 * K^T, then an online softmax (running max and sum per query row; the output rows rescaled by
 * e^(m_old - m_new) when the max grows), then the tile's weights times V added into the output
 * rows, both products on the GEMM's register tile (gemm_tile). No query ever holds a score row
 * of all its keys: a thread's scratch is GEMM_MR x FA_KT, whatever S. K^T and V are packed once
 * per call into 16-wide panels (K^T: [key panel][d][16 keys]; V: [column panel][row][16
 * columns]), shared by the query heads of a KV head: that copy is the O(S) part. f32 q, k, v
 * and out; D and DV multiples of 16. Query i attends keys 0..pos[i] (< L, checked by the
 * caller). Scratch: npuc_attention_gemm_scratch_floats. */
#define FA_KT 256 /* keys per tile (a multiple of 16): 256 ran as fast as one row of all keys at S = 4096 */

typedef struct {
    const float *q, *k, *v; const int64_t *pos; float *out;
    i64 HQ, S, D, HKV, L, DV, Lp; float scale; float *kt, *vp, *ws; i64 per;
} fa_job;

static void fa_pack(const void *p, i64 g, int tid) {
    (void)tid;
    const fa_job *j = p;
    i64 L = j->L, D = j->D, DV = j->DV, Lp = j->Lp;
    float *kt = j->kt + g * Lp * D, *vp = j->vp + g * L * DV;
    const float *k = j->k + g * L * D, *v = j->v + g * L * DV;
    for (i64 r = 0; r < Lp; r++)
        for (i64 d = 0; d < D; d++) kt[(r / 16) * D * 16 + d * 16 + r % 16] = r < L ? k[r * D + d] : 0.0f;
    for (i64 c0 = 0; c0 < DV; c0 += 16)
        for (i64 r = 0; r < L; r++) memcpy(vp + c0 * L + r * 16, v + r * DV + c0, 16 * sizeof(float));
}

static void fa_chunk(const void *p, i64 job, int tid) {
    const fa_job *j = p;
    i64 S = j->S, D = j->D, DV = j->DV, Lp = j->Lp, L = j->L, nqb = (S + GEMM_MR - 1) / GEMM_MR;
    i64 bh = job / nqb, i0 = (job % nqb) * GEMM_MR, g = (bh / j->HQ) * j->HKV + (bh % j->HQ) / (j->HQ / j->HKV);
    int mr = S - i0 < GEMM_MR ? (int)(S - i0) : GEMM_MR;
    float *apack = j->ws + (i64)tid * j->per, *sc = apack + D * GEMM_MR, *ppack = sc + GEMM_MR * FA_KT;
    float m[GEMM_MR], l[GEMM_MR];
    i64 n = 0, seen[GEMM_MR];
    for (int t = 0; t < GEMM_MR; t++) {
        seen[t] = t < mr ? j->pos[i0 + t] + 1 : 0, m[t] = -INFINITY, l[t] = 0.0f;
        n = seen[t] > n ? seen[t] : n;
    }
    const float *q = j->q + (bh * S + i0) * D;
    for (i64 d = 0; d < D; d++)
        for (int t = 0; t < GEMM_MR; t++) apack[d * GEMM_MR + t] = t < mr ? q[t * D + d] : 0.0f;
    float *o = j->out + (bh * S + i0) * DV;
    for (i64 k0 = 0; k0 < n; k0 += FA_KT) {
        i64 kn = n - k0 < FA_KT ? n - k0 : FA_KT;
        for (i64 kp = 0; kp < (kn + 15) / 16; kp++)
            gemm_tile(D, apack, j->kt + g * Lp * D + (k0 / 16 + kp) * D * 16, sc + kp * 16, FA_KT, 1, NULL, GEMM_MR,
                      16);
        for (int t = 0; t < GEMM_MR; t++) {
            float *row = sc + t * FA_KT, mt = -INFINITY;
            i64 nt = seen[t] - k0 < kn ? seen[t] - k0 : kn;
            nt = nt < 0 ? 0 : nt;
            for (i64 c = 0; c < nt; c++) { row[c] *= j->scale; mt = row[c] > mt ? row[c] : mt; }
            if (nt > 0 && mt > m[t]) {
                float alpha = expf(m[t] - mt);
                l[t] *= alpha;
                if (k0 > 0) /* the first tile writes the rows; later ones add to them */
                    for (i64 c = 0; c < DV; c++) o[t * DV + c] *= alpha;
                m[t] = mt;
            }
            if (nt > 0) l[t] += exp_sum(row, nt, m[t]);
            for (i64 c = 0; c < kn; c++) ppack[c * GEMM_MR + t] = c < nt ? row[c] : 0.0f;
        }
        for (i64 c0 = 0; c0 < DV; c0 += 16)
            gemm_tile(kn, ppack, j->vp + g * L * DV + c0 * L + k0 * 16, o + c0, DV, k0 == 0, NULL, mr, 16);
    }
    for (int t = 0; t < mr; t++) {
        float inv = 1.0f / l[t];
        for (i64 c = 0; c < DV; c++) o[t * DV + c] *= inv;
    }
}

static i64 fa_per_thread(i64 D) { return D * GEMM_MR + 2 * GEMM_MR * FA_KT; }

i64 npuc_attention_gemm_scratch_floats(i64 B, i64 HKV, i64 D, i64 L, i64 DV, int nt) {
    i64 Lp = (L + 15) / 16 * 16;
    return B * HKV * (Lp * D + L * DV) + (nt < 1 ? 1 : nt) * fa_per_thread(D);
}

int npuc_attention_gemm(const float *q, const float *k, const float *v, const int64_t *pos, float *out, i64 B,
                        i64 HQ, i64 S, i64 D, i64 HKV, i64 L, i64 DV, float scale, float *scratch, int nt) {
    if (D % 16 || DV % 16 || HKV < 1 || HQ % HKV || L < 1) return 1;
    for (i64 i = 0; i < S; i++)
        if (pos[i] < 0 || pos[i] >= L) return 1;
    nt = nt < 1 ? 1 : nt;
    i64 Lp = (L + 15) / 16 * 16;
    fa_job j = {q, k, v, pos, out, HQ, S, D, HKV, L, DV, Lp, scale, scratch, scratch + B * HKV * Lp * D,
                scratch + B * HKV * (Lp * D + L * DV), fa_per_thread(D)};
    parallel(fa_pack, &j, B * HKV, threads_for(B * HKV * L * (D + DV) * 4, nt));
    parallel(fa_chunk, &j, B * HQ * ((S + GEMM_MR - 1) / GEMM_MR), nt);
    return 0;
}

/* ---- gather: rows of a table by index (an embedding lookup) --------------------------------- */

/* out[i] = row idx[i] of a table of `rows` rows of `row_bytes` each; an index may count from
 * the end (-rows..-1). Non-zero, and nothing written, if one lies outside: the caller's
 * reference kernel then refuses it. A few rows: a memcpy each, no threads. */
int npuc_gather_rows(const void *table, i64 rows, i64 row_bytes, const int64_t *idx, i64 n, void *out) {
    for (i64 i = 0; i < n; i++)
        if (idx[i] < -rows || idx[i] >= rows) return 1;
    for (i64 i = 0; i < n; i++) {
        i64 r = idx[i] < 0 ? idx[i] + rows : idx[i];
        memcpy((char *)out + i * row_bytes, (const char *)table + r * row_bytes, (size_t)row_bytes);
    }
    return 0;
}

/* ---- dequantize: rows of a quantized table (a quantized embedding's looked-up rows) ---------
 * out[r, k] = (code[r, k] - zero[r, k / G]) * scale[r, k / G], in f32 (ir/quant.py's
 * dequantize_ref, the same operations in the same order), stored f32 or bf16. Codes: i8
 * (bits 8) or two u8 nibbles a byte, low first (bits 4); zero points i8 or u8 alike; scales
 * f32 (sbf 0), bf16 (1) or f16 (2). A decode step's one row: no threads. */
int npuc_dequantize(const void *q, int bits, const void *scale, int sbf, const void *zero, i64 rows, i64 K, i64 G,
                    void *out, int obf) {
    if (G < 1 || K % G || (bits != 4 && bits != 8) || (bits == 4 && K % 2)) return 1;
    i64 ng = K / G;
    for (i64 r = 0; r < rows; r++)
        for (i64 g = 0; g < ng; g++) {
            float s = sbf == 2 ? npuc_f16_to_f32(((const uint16_t *)scale)[r * ng + g]) : load_any(scale, sbf, r * ng + g);
            float z = bits == 8 ? (float)((const int8_t *)zero)[r * ng + g] : (float)((const uint8_t *)zero)[r * ng + g];
            for (i64 k = g * G; k < (g + 1) * G; k++) {
                int c = bits == 8 ? ((const int8_t *)q)[r * K + k]
                                  : (((const uint8_t *)q)[(r * K + k) / 2] >> (4 * (k & 1))) & 0xF;
                store_any(out, obf, r * K + k, ((float)c - z) * s);
            }
        }
    return 0;
}

/* ---- pad: tile padding at the end of the last two axes --------------------------------------
 * x [lead, m, k] into out [lead, m2, k2] (m2 >= m, k2 >= k), zeros after: per leading index,
 * rows 0..fill-1 of out are written (x's row and zeros after it, or zeros past m); rows from
 * `fill` on are left as they are: the caller passes fill < m2 only where no reader looks at
 * them (a product that computes its valid rows only). A decode step's pads are a row or two:
 * a memcpy each, no threads. */
int npuc_pad_rows(const void *x, void *out, i64 es, i64 lead, i64 m, i64 k, i64 m2, i64 k2, i64 fill) {
    if (m > m2 || k > k2 || fill > m2) return 1;
    for (i64 l = 0; l < lead; l++)
        for (i64 i = 0; i < fill; i++) {
            char *to = (char *)out + ((l * m2 + i) * k2) * es;
            i64 kept = i < m ? k : 0;
            if (kept) memcpy(to, (const char *)x + ((l * m + i) * k) * es, (size_t)(kept * es));
            if (k2 > kept) memset(to + kept * es, 0, (size_t)((k2 - kept) * es));
        }
    return 0;
}

/* ---- element-wise ops and copies: one pass over memory, cut over the pool at prefill sizes -- */

#define EW_CHUNK 16384 /* elements per chunk: 64 KiB of f32, a few microseconds of work */


enum { EW_ADD, EW_SWIGLU, EW_CAST };
typedef struct { const void *a, *b; void *out; i64 n; int op, abf, obf; } ew_job;

static void ew_chunk(const void *p, i64 c, int tid) {
    (void)tid;
    const ew_job *j = p;
    i64 lo = c * EW_CHUNK, hi = lo + EW_CHUNK < j->n ? lo + EW_CHUNK : j->n, i = lo;
    const float *a = j->a, *b = j->b;
    float *o = j->out;
    if (j->op == EW_CAST) {
        if (j->abf == j->obf) memcpy((char *)j->out + lo * (j->obf ? 2 : 4), (const char *)j->a + lo * (j->abf ? 2 : 4),
                                     (size_t)(hi - lo) * (j->obf ? 2 : 4));
        else for (; i < hi; i++) store_any(j->out, j->obf, i, load_any(j->a, j->abf, i));
        return;
    }
    if (j->op == EW_ADD) {
#ifdef NPUC_AVX2
        for (; i + 8 <= hi; i += 8)
            _mm256_storeu_ps(o + i, _mm256_add_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i)));
#endif
        for (; i < hi; i++) o[i] = a[i] + b[i];
        return;
    }
#ifdef NPUC_AVX2
    const __m256 one = _mm256_set1_ps(1.0f), neg = _mm256_set1_ps(-0.0f);
    for (; i + 8 <= hi; i += 8) {
        __m256 x = _mm256_loadu_ps(a + i);
        __m256 e = npuc_exp8(_mm256_xor_ps(x, neg));
        _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_div_ps(x, _mm256_add_ps(one, e)), _mm256_loadu_ps(b + i)));
    }
#endif
    for (; i < hi; i++) o[i] = a[i] / (1.0f + expf(-a[i])) * b[i];
}

static int elementwise(int op, const void *a, int abf, const void *b, void *out, int obf, i64 n, int nt) {
    ew_job j = {a, b, out, n, op, abf, obf};
    parallel(ew_chunk, &j, (n + EW_CHUNK - 1) / EW_CHUNK, threads_for(n * 4 * 3, nt));
    return 0;
}

/* out = silu(a) * b, and out = a + b, over n f32. */
int npuc_swiglu_f32(const float *a, const float *b, float *out, i64 n, int nt) {
    return elementwise(EW_SWIGLU, a, 0, b, out, 0, n, nt);
}

int npuc_add_f32(const float *a, const float *b, float *out, i64 n, int nt) {
    return elementwise(EW_ADD, a, 0, b, out, 0, n, nt);
}

/* dst = src converted, over n values, each f32 or bf16 (round to nearest even). */
int npuc_cast(const void *src, int sbf, void *dst, int dbf, i64 n, int nt) {
    return elementwise(EW_CAST, src, sbf, NULL, dst, dbf, n, nt);
}

/* A strided copy into a contiguous out of 4 dims (a transpose): out[i0, i1, i2, i3] =
 * src[i0 * st[0] + i1 * st[1] + i2 * st[2] + i3 * st[3]], strides in elements of `es`
 * bytes; rows of out (i3 runs) split over the pool, each one memcpy when st[3] is 1. */
typedef struct { const char *src; char *dst; i64 es, s1, s2, s3, st0, st1, st2, st3, rows, per; } perm_job;

static void perm_chunk(const void *p, i64 c, int tid) {
    (void)tid;
    const perm_job *j = p;
    i64 end = (c + 1) * j->per < j->rows ? (c + 1) * j->per : j->rows, es = j->es;
    for (i64 r = c * j->per; r < end; r++) {
        i64 i0 = r / (j->s1 * j->s2), i1 = (r / j->s2) % j->s1, i2 = r % j->s2;
        const char *from = j->src + (i0 * j->st0 + i1 * j->st1 + i2 * j->st2) * es;
        char *to = j->dst + r * j->s3 * es;
        if (j->st3 == 1) memcpy(to, from, (size_t)(j->s3 * es));
        else for (i64 k = 0; k < j->s3; k++) memcpy(to + k * es, from + k * j->st3 * es, (size_t)es);
    }
}

int npuc_permute(const void *src, void *dst, i64 es, const int64_t *shape, const int64_t *st, int nt) {
    i64 rows = shape[0] * shape[1] * shape[2];
    if (rows == 0 || shape[3] == 0) return 0;
    nt = threads_for(rows * shape[3] * es * 2, nt);
    perm_job j = {src, dst, es, shape[1], shape[2], shape[3], st[0], st[1], st[2], st[3], rows, 1};
    j.per = (rows + 4 * nt - 1) / (4 * nt);
    if (j.per < 1) j.per = 1;
    parallel(perm_chunk, &j, (rows + j.per - 1) / j.per, nt);
    return 0;
}

int npuc_kernels_abi(void) { return 9; }
