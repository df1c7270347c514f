/* SIMD helpers shared by the kernel files (kernels.c, ops_deepseek.c): AVX2 + FMA only. */
#ifndef NPUCRT_SIMD_H
#define NPUCRT_SIMD_H

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
#endif

#endif /* NPUCRT_SIMD_H */
