// AVX512 helpers shared by ridge's CPU kernels: bf16 <-> float32 conversion and a vector exp.
//
// By hand because the compiler vectorized neither: c10::BFloat16's conversions compile to scalar code,
// and glibc's scalar expf was what limited the attention kernel (three calls per token and kv head
// cost more than reading the token's K and V) and SiLU; -ffast-math did not bring in its vector variant.
#pragma once

#if defined(__AVX512F__)
#include <immintrin.h>

#include <cstdint>

namespace ridge_vec {

// 16 bf16 values -> floats: a bf16 is the top half of a float32.
inline __m512 load_bf16(const void* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// 16 floats -> bf16, rounded to nearest even as c10::BFloat16 does (NaNs aside, which ridge never makes).
inline __m256i to_bf16(__m512 v) {
#if defined(__AVX512BF16__)
  return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v));
#endif
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16));
}

inline void store_bf16(void* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), to_bf16(v));
}

// v rounded to bf16 precision, kept as floats (where torch would round an intermediate to the dtype).
inline __m512 round_bf16(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16(v)), 16));
}

// exp(x) for 16 floats, x clamped to [-87, 88]: x = n ln2 + r with |r| <= ln2 / 2, a degree-6 polynomial
// for e^r (Cephes' expf coefficients, ~1 ulp), scaled by 2^n.
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(88.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  const __m512 y = _mm512_add_ps(_mm512_fmadd_ps(_mm512_mul_ps(p, r), r, r), _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(y, n);
}

}  // namespace ridge_vec
#endif
