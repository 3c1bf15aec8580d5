// Vector helpers shared by ridge's CPU kernels: the few-row linear kernels' split of work, bf16 <-> float32
// conversion, a vector exp, and `fvec`, a float vector of the widest width the build targets (AVX512:
// 16 lanes, AVX2 + FMA: 8), for kernels written once for both.
//
// By hand because the compiler vectorized neither: c10::BFloat16's conversions compile to scalar code,
// and glibc's scalar expf was what limited the attention kernel (three calls per token and kv head
// cost more than reading the token's K and V) and SiLU; -ffast-math did not bring in its vector variant.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <vector>

// Scalar sigmoid and SiLU whose e^-x cannot overflow: the kernels build with -ffast-math, which assumes no
// infinities, and an exp that overflows there gives NaN (SiLU of a gate below -88.7) where the value is 0
namespace ridge_scalar {
inline float sigmoid(float x) { return 1.f / (1.f + expf(std::min(-x, 88.f))); }
inline float silu(float x) { return x / (1.f + expf(std::min(-x, 88.f))); }
}  // namespace ridge_scalar

// The float sum of each of `count` consecutive runs of `group` values of x (float32 or bf16), in order: the
// grouped linear kernels' minimums term, sum_g minimum[n, g] * (sum of x over group g), shares these among all
// output channels
template <typename T>
std::vector<float> group_sums(const T* x, int64_t count, int64_t group) {
  std::vector<float> sums(count);
  for (int64_t i = 0; i < count; i++)
    sums[i] = std::accumulate(x + i * group, x + (i + 1) * group, 0.f,
                              [](float sum, T value) { return sum + static_cast<float>(value); });
  return sums;
}

// 4-bit codes two a byte, as ridge holds 4-bit grouped weights in float32 (linear/layouts.py's pack_nibbles):
// a row of K codes is K / 2 bytes, 16 per 32 columns, byte i of a 32-column block holding column i in its
// low nibble and column i + 16 in its high one (llama.cpp's Q4_0 order: a block's codes come out of one
// 16-byte load in column order). The vector readers of this order are below (vload_nibbles,
// load_nibble_block); this is its scalar one.
inline int nibble_at(const uint8_t* row, int64_t j) {
  return (row[j / 32 * 16 + j % 16] >> (j % 32 >= 16 ? 4 : 0)) & 0x0F;
}

// The bytes of a row of K codes: K a byte each, K / 2 two a byte
constexpr int64_t code_row_bytes(bool nibbles, int64_t k_dim) { return nibbles ? k_dim / 2 : k_dim; }

// The few-row linear kernels' split of work: threads take `channel_block` output channels at a time and
// walk the rows `row_block` at a time, calling body(n, n_end, m0, rows) for each piece.
template <typename Body>
inline void for_channel_and_row_blocks(int64_t n_dim, int64_t m_dim, int64_t channel_block, int64_t row_block,
                                       Body body) {
  const int64_t blocks = (n_dim + channel_block - 1) / channel_block;
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < blocks; b++) {
    const int64_t n = b * channel_block, n_end = std::min(n_dim, n + channel_block);
    for (int64_t m0 = 0; m0 < m_dim; m0 += row_block) body(n, n_end, m0, std::min(row_block, m_dim - m0));
  }
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define RIDGE_FVEC 1
#include <immintrin.h>

#include <cstdint>

namespace ridge_vec {

// Horizontal sum and maximum of 8 floats (AVX2 registers, in either build)
inline float hsum8(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}
inline float hmax8(__m256 v) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_max_ss(x, _mm_movehdup_ps(x)));
}

#if defined(__AVX512F__)

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

#endif  // __AVX512F__

// fvec: kernels written once for 16 lanes (AVX512) and 8 (AVX2)
#if defined(__AVX512F__)
using fvec = __m512;
constexpr int kLanes = 16;
inline fvec vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, fvec v) { _mm512_storeu_ps(p, v); }
inline fvec vset1(float x) { return _mm512_set1_ps(x); }
inline fvec vfmadd(fvec a, fvec b, fvec c) { return _mm512_fmadd_ps(a, b, c); }
inline fvec vmul(fvec a, fvec b) { return _mm512_mul_ps(a, b); }
inline fvec vadd(fvec a, fvec b) { return _mm512_add_ps(a, b); }
inline fvec vfnmadd(fvec a, fvec b, fvec c) { return _mm512_fnmadd_ps(a, b, c); }
inline fvec vclamp(fvec x, float lo, float hi) { return _mm512_min_ps(_mm512_max_ps(x, vset1(lo)), vset1(hi)); }
inline fvec vround(fvec x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline fvec vscale_pow2(fvec y, fvec n) { return _mm512_scalef_ps(y, n); }  // y * 2^n, n integral
inline float vsum(fvec v) { return _mm512_reduce_add_ps(v); }
// kLanes int8 values -> floats
inline fvec vload_i8(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
// kLanes 4-bit codes, the low (high = false) or high nibbles of kLanes bytes -> floats (a byte widened to 32
// bits and shifted right by 4 is its high nibble: no mask)
inline fvec vload_u4(const uint8_t* p, bool high) {
  const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm512_cvtepi32_ps(high ? _mm512_srli_epi32(v, 4) : _mm512_and_si512(v, _mm512_set1_epi32(0x0F)));
}
// kLanes 4-bit codes as vload_u4 reads them, each looked up in `levels` (16 int8 values) -> floats
inline fvec vload_u4_levels(const uint8_t* p, bool high, __m128i levels) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m128i codes = _mm_and_si128(high ? _mm_srli_epi16(bytes, 4) : bytes, _mm_set1_epi8(0x0F));
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_shuffle_epi8(levels, codes)));
}
// kLanes 32-bit words, each two bf16 values: the low halves -> lo, the high halves -> hi
inline void vload_bf16_pairs(const void* p, fvec& lo, fvec& hi) {
  const __m512i w = _mm512_loadu_si512(p);
  lo = _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  hi = _mm512_castsi512_ps(_mm512_and_si512(w, _mm512_set1_epi32(0xFFFF0000)));
}
inline void vstore_bf16(void* p, fvec v) { store_bf16(p, v); }
// kLanes consecutive bf16 values -> floats
inline fvec vload_bf16(const void* p) { return load_bf16(p); }
#else
using fvec = __m256;
constexpr int kLanes = 8;
inline fvec vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, fvec v) { _mm256_storeu_ps(p, v); }
inline fvec vset1(float x) { return _mm256_set1_ps(x); }
inline fvec vfmadd(fvec a, fvec b, fvec c) { return _mm256_fmadd_ps(a, b, c); }
inline fvec vmul(fvec a, fvec b) { return _mm256_mul_ps(a, b); }
inline fvec vadd(fvec a, fvec b) { return _mm256_add_ps(a, b); }
inline fvec vfnmadd(fvec a, fvec b, fvec c) { return _mm256_fnmadd_ps(a, b, c); }
inline fvec vclamp(fvec x, float lo, float hi) { return _mm256_min_ps(_mm256_max_ps(x, vset1(lo)), vset1(hi)); }
inline fvec vround(fvec x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline fvec vscale_pow2(fvec y, fvec n) {  // y * 2^n, n integral in [-126, 127]: 2^n built in the exponent bits
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
}
inline float vsum(fvec v) { return hsum8(v); }
inline fvec vload_i8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline fvec vload_u4(const uint8_t* p, bool high) {
  const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_cvtepi32_ps(high ? _mm256_srli_epi32(v, 4) : _mm256_and_si256(v, _mm256_set1_epi32(0x0F)));
}
inline fvec vload_u4_levels(const uint8_t* p, bool high, __m128i levels) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m128i codes = _mm_and_si128(high ? _mm_srli_epi16(bytes, 4) : bytes, _mm_set1_epi8(0x0F));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_shuffle_epi8(levels, codes)));
}
inline void vload_bf16_pairs(const void* p, fvec& lo, fvec& hi) {
  const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  lo = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  hi = _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32(static_cast<int>(0xFFFF0000))));
}
inline fvec vload_bf16(const void* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
// floats -> bf16 bits, rounded to nearest even as c10::BFloat16 does (NaNs aside, which ridge never makes)
inline void vstore_bf16(void* p, fvec v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i top = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  // packus works within 128-bit lanes: 16-bit results land in 64-bit words 0 and 2, gathered by the permute
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(top, top), 0b1000);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}
#endif  // fvec

// kLanes codes of a nibble row (nibble_at's order) from column j + h -> floats: j a multiple of 32, h of kLanes
// below 32 (a constant where the loop over h unrolls, so that the choice of nibble costs nothing)
inline fvec vload_nibbles(const uint8_t* row, int64_t j, int64_t h) {
  return vload_u4(row + j / 2 + h % 16, h >= 16);
}
// the same codes looked up in `levels`, 16 int8 values (a table of levels: MXFP4's doubled e2m1 numbers)
inline fvec vload_nibble_levels(const uint8_t* row, int64_t j, int64_t h, __m128i levels) {
  return vload_u4_levels(row + j / 2 + h % 16, h >= 16, levels);
}
// the 32 codes of a nibble row's block b, in column order, a byte each
inline __m256i load_nibble_block(const uint8_t* row, int64_t b) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b * 16));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(bytes, 4), bytes), _mm256_set1_epi8(0x0F));
}

// exp(x) for kLanes floats, x clamped to [-87, 88]: x = n ln2 + r with |r| <= ln2 / 2, a degree-6
// polynomial for e^r (Cephes' expf coefficients, ~1 ulp), scaled by 2^n.
inline fvec vexp(fvec x) {
  x = vclamp(x, -87.f, 88.f);
  const fvec n = vround(vmul(x, vset1(1.44269504f)));
  fvec r = vfnmadd(n, vset1(0.693359375f), x);
  r = vfnmadd(n, vset1(-2.12194440e-4f), r);
  fvec p = vset1(1.9875691500e-4f);
  p = vfmadd(p, r, vset1(1.3981999507e-3f));
  p = vfmadd(p, r, vset1(8.3334519073e-3f));
  p = vfmadd(p, r, vset1(4.1665795894e-2f));
  p = vfmadd(p, r, vset1(1.6666665459e-1f));
  p = vfmadd(p, r, vset1(5.0000001201e-1f));
  return vscale_pow2(vadd(vfmadd(vmul(p, r), r, r), vset1(1.f)), n);
}
}  // namespace ridge_vec
#endif  // RIDGE_FVEC
