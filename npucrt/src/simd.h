/* SIMD helpers shared by the kernel files (kernels.c, ops_deepseek.c): exp, horizontal sums and bf16 loads
 * on AVX2 + FMA; the axpy loops of attention with a portable tail; the scalar bf16 and f16 -> f32. */
#ifndef NPUCRT_SIMD_H
#define NPUCRT_SIMD_H

#include <stdint.h>

/* A bf16's value as f32 (its 16 bits are the top half of the f32's). */
static inline float npuc_bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } v = {.u = (uint32_t)h << 16};
    return v.f;
}

/* An IEEE half's value as f32 (subnormals, infinities and NaN included). */
static inline float npuc_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    union { uint32_t u; float f; } v;
    if (e == 0) { /* zero or subnormal: m * 2^-24, exact in f32 */
        v.f = (float)m * 5.9604644775390625e-8f;
        v.u |= sign;
        return v.f;
    }
    v.u = sign | (e == 31 ? 0x7f800000u | (m << 13) : ((e + 112) << 23) | (m << 13));
    return v.f;
}

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#include <math.h>

/* e^x for 8 floats (Cephes' expf: range reduction by ln 2, a degree-5 polynomial; about
 * 1 ulp). Past the range, +inf above and 0 below, as expf; min/max take the constant
 * first so that a NaN stays NaN. */
static inline __m256 npuc_exp8(__m256 x) {
    __m256 hi = _mm256_cmp_ps(x, _mm256_set1_ps(88.3762626647949f), _CMP_GT_OQ);
    __m256 lo = _mm256_cmp_ps(x, _mm256_set1_ps(-87.3365478515625f), _CMP_LT_OQ);
    x = _mm256_min_ps(_mm256_set1_ps(88.3762626647949f), x);
    x = _mm256_max_ps(_mm256_set1_ps(-87.3365478515625f), x);
    __m256 fx = _mm256_round_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)),
                                _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(fx, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 z = _mm256_mul_ps(x, x), y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_add_ps(_mm256_fmadd_ps(y, z, x), _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(fx), _mm256_set1_epi32(127)), 23);
    y = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
    return _mm256_andnot_ps(lo, _mm256_blendv_ps(y, _mm256_set1_ps(INFINITY), hi));
}
/* The horizontal sum of 8 floats, and 8 bf16 widened to f32 (a 16-bit shift). */
static inline float npuc_hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

static inline __m256 npuc_load8_bf16(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}
#endif

/* acc[0..n) += p * v[0..n), v f32 or bf16: attention's inner loops (kernels.c, ops_deepseek.c). */
static inline void npuc_axpy_f32(float p, const float *v, float *acc, int64_t n) {
    int64_t k = 0;
#if defined(__AVX2__) && defined(__FMA__)
    __m256 pv = _mm256_set1_ps(p);
    for (; k + 8 <= n; k += 8)
        _mm256_storeu_ps(acc + k, _mm256_fmadd_ps(pv, _mm256_loadu_ps(v + k), _mm256_loadu_ps(acc + k)));
#endif
    for (; k < n; k++) acc[k] += p * v[k];
}

static inline void npuc_axpy_bf16(float p, const uint16_t *v, float *acc, int64_t n) {
    int64_t k = 0;
#if defined(__AVX2__) && defined(__FMA__)
    __m256 pv = _mm256_set1_ps(p);
    for (; k + 8 <= n; k += 8)
        _mm256_storeu_ps(acc + k, _mm256_fmadd_ps(pv, npuc_load8_bf16(v + k), _mm256_loadu_ps(acc + k)));
#endif
    for (; k < n; k++) acc[k] += p * npuc_bf16_to_f32(v[k]);
}

#endif /* NPUCRT_SIMD_H */
