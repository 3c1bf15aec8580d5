// The grouped weight-only linear of quant_linear.cpp (codes [N, K] int8, a scale and optionally a minimum per
// group of G input columns) with its input quantized to int8 too, llama.cpp's way on CPUs:
//   x[m, 32 b .. 32 b + 32) ~ dx[m, b] * qx[m, ...],  dx = max |x| / 127 over the block, qx in [-127, 127]
//   y[m, n] = sum_g scale[n, g] * sum_{b in g} dx[m, b] * (sum_k qx[m, k] code[n, k])
//             + sum_g minimum[n, g] * xsum[m, g]                           (xsum: the float sum of x over g)
// The inner sums are integer dot products, 32 weights per AVX2 instruction (vpmaddubsw) where the float kernel
// widens 8 codes to float and multiplies them per instruction; on the 2-core AVX2 box that kernel is bound by
// those instructions, not by memory, and this one does a 1-row 3072 x 576 layer ~2x faster.
//
// Not exact: each input value moves by up to dx / 2 (half a step of its block's grid), so
//   |y - y_exact| <= sum_b (max_{k in b} |x_k|) / 254 * sum_{k in b} |w_nk|
// (tests/test_gguf_native.py checks that bound), 0.5-1% of a layer's output on normal random inputs. The
// minimums' term uses the float sums, so a format's offset adds no error. Off unless asked for
// (EngineConfig.int8_activations): by default the quantized formats compute the dequantized model's numbers.
//
// AVX2 only (integer ops on 256 bits; AVX512 builds have them too). vpmaddubsw multiplies an unsigned byte by a
// signed one and adds pairs into int16 with saturation: codes must be >= 0 for the unsigned operand, so signed
// codes go in as |code| with their sign moved onto qx (vpsignb); |code| <= 128 and |qx| <= 127 keep each pair
// sum within int16 (2 * 128 * 127 = 32512). 4-bit codes come two a byte (vec.h's nibble order) and are
// split into bytes in registers: half the bytes to stream, for a shift, an insert and a mask per 32 codes.
#include <torch/extension.h>

#include <algorithm>
#include <vector>

#include "vec.h"

#if defined(RIDGE_FVEC)  // AVX2 + FMA, or AVX512

namespace {

constexpr int64_t kBlock = 32;  // input values per activation scale: one 256-bit vector of int8
constexpr int64_t kRowBlock = 4;
constexpr int64_t kChannelBlock = 4;

// x [M, K] float32 -> qx [M, K] int8 and dx [M, K / 32] (one scale per 32 values), by rows in parallel
void quantize_rows(const float* x, int64_t m_dim, int64_t k_dim, int8_t* qx, float* dx) {
  const int64_t blocks = k_dim / kBlock;
  const __m256 sign_bit = _mm256_set1_ps(-0.f);
  // packs_epi32 / packs_epi16 interleave their two 128-bit lanes: this puts the 32 bytes back in order
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  // a decode step's few rows take a microsecond: waking the other threads would cost more
#pragma omp parallel for schedule(static) if (m_dim * blocks >= 1024)
  for (int64_t i = 0; i < m_dim * blocks; i++) {
    const float* xb = x + i * kBlock;
    __m256 v[4];
    __m256 amax = _mm256_setzero_ps();
    for (int j = 0; j < 4; j++) {
      v[j] = _mm256_loadu_ps(xb + 8 * j);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign_bit, v[j]));
    }
    const float a = ridge_vec::hmax8(amax);
    dx[i] = a / 127.f;
    const __m256 inv = _mm256_set1_ps(a > 0.f ? 127.f / a : 0.f);
    __m256i q[4];
    for (int j = 0; j < 4; j++) q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], inv));  // nearest, ties to even
    const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(qx + i * kBlock), _mm256_permutevar8x32_epi32(packed, order));
  }
}

// How a weight's codes are held: int8 a byte each (signed, or all >= 0), or 4-bit two a byte (>= 0)
enum class Codes { kSigned, kUnsigned, kNibbles };

template <Codes kForm>
constexpr bool kPacked = kForm == Codes::kNibbles;  // two codes a byte

// The 32 codes of a row's block b, a byte each
template <Codes kForm>
inline __m256i load_block(const int8_t* row, int64_t b) {
  if constexpr (kPacked<kForm>) return ridge_vec::load_nibble_block(reinterpret_cast<const uint8_t*>(row), b);
  else return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + b * kBlock));
}

// The 8 int32 partial sums of one block's sum_k qx[k] * code[k] (lane j: values 4 j .. 4 j + 3)
template <Codes kForm>
inline __m256i block_dot(__m256i codes, __m256i qx) {
  const __m256i pairs = kForm == Codes::kSigned
                            ? _mm256_maddubs_epi16(_mm256_sign_epi8(codes, codes), _mm256_sign_epi8(qx, codes))
                            : _mm256_maddubs_epi16(codes, qx);
  return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}

// The scale of each lane of a block in a group of 32, or for 16-column groups (GGUF's Q6_K) the first group's
// in lanes 0-3 and the second's in lanes 4-7
inline __m256 block_scales(const float* scales, int64_t block, int64_t group) {
  if (group == kBlock) return _mm256_set1_ps(scales[block]);
  return _mm256_setr_m128(_mm_set1_ps(scales[2 * block]), _mm_set1_ps(scales[2 * block + 1]));
}

// out[m, n .. n + kChannels) for kRows rows: per block and (channel, row) one integer dot, one conversion and
// one FMA; groups of up to a block scale each block (dx times the group's scale), longer ones are summed in dx
// units first and scaled once per group
template <Codes kForm, int64_t kChannels, int64_t kRows>
void dot_rows(const int8_t* qx, const float* dx, const float* xsum, int64_t k_dim, const int8_t* codes,
              const float* scales, const float* minimums, int64_t group, float* out, int64_t out_stride) {
  const int64_t blocks = k_dim / kBlock, groups = k_dim / group, stride = code_row_bytes(kPacked<kForm>, k_dim);
  const auto load_codes = [&](__m256i* w, int64_t b) {
    for (int64_t c = 0; c < kChannels; c++) {
      const int8_t* row = codes + c * stride;
      const int8_t* ahead = row + kChannels * stride + code_row_bytes(kPacked<kForm>, b * kBlock);
      _mm_prefetch(reinterpret_cast<const char*>(ahead), _MM_HINT_T0);
      w[c] = load_block<kForm>(row, b);
    }
  };
  const auto load_x = [&](int64_t r, int64_t b) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qx + r * k_dim + b * kBlock));
  };
  __m256 total[kChannels][kRows];
  for (int64_t c = 0; c < kChannels; c++)
    for (int64_t r = 0; r < kRows; r++) total[c][r] = _mm256_setzero_ps();
  if (group <= kBlock) {
    for (int64_t b = 0; b < blocks; b++) {
      __m256i w[kChannels];
      __m256 s[kChannels];
      load_codes(w, b);
      for (int64_t c = 0; c < kChannels; c++) s[c] = block_scales(scales + c * groups, b, group);
      for (int64_t r = 0; r < kRows; r++) {
        const __m256i q = load_x(r, b);
        const __m256 d = _mm256_set1_ps(dx[r * blocks + b]);
        for (int64_t c = 0; c < kChannels; c++)
          total[c][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(block_dot<kForm>(w[c], q)), _mm256_mul_ps(d, s[c]),
                                        total[c][r]);
      }
    }
  } else {
    const int64_t span = group / kBlock;  // blocks per group
    for (int64_t g = 0; g < groups; g++) {
      __m256 part[kChannels][kRows];
      for (int64_t c = 0; c < kChannels; c++)
        for (int64_t r = 0; r < kRows; r++) part[c][r] = _mm256_setzero_ps();
      for (int64_t b = g * span; b < (g + 1) * span; b++) {
        __m256i w[kChannels];
        load_codes(w, b);
        for (int64_t r = 0; r < kRows; r++) {
          const __m256i q = load_x(r, b);
          const __m256 d = _mm256_set1_ps(dx[r * blocks + b]);
          for (int64_t c = 0; c < kChannels; c++)
            part[c][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(block_dot<kForm>(w[c], q)), d, part[c][r]);
        }
      }
      for (int64_t c = 0; c < kChannels; c++) {
        const __m256 s = _mm256_set1_ps(scales[c * groups + g]);
        for (int64_t r = 0; r < kRows; r++) total[c][r] = _mm256_fmadd_ps(part[c][r], s, total[c][r]);
      }
    }
  }
  for (int64_t r = 0; r < kRows; r++)
    for (int64_t c = 0; c < kChannels; c++) {
      float offset = 0.f;  // the minimums' share, from the float sums
      if (minimums)
        for (int64_t g = 0; g < groups; g++) offset += minimums[c * groups + g] * xsum[r * groups + g];
      out[r * out_stride + c] = ridge_vec::hsum8(total[c][r]) + offset;
    }
}

template <Codes kForm, int64_t kChannels, int64_t kRows>
void dot_channels(const int8_t* qx, const float* dx, const float* xsum, int64_t k_dim, int64_t n, int64_t n_end,
                  const int8_t* codes, const float* scales, const float* minimums, int64_t group, float* out,
                  int64_t out_stride) {
  const int64_t groups = k_dim / group, stride = code_row_bytes(kPacked<kForm>, k_dim);
  for (; n < n_end; n += kChannels) {
    if (n + kChannels <= n_end) {
      dot_rows<kForm, kChannels, kRows>(qx, dx, xsum, k_dim, codes + n * stride, scales + n * groups,
                                        minimums ? minimums + n * groups : nullptr, group, out + n, out_stride);
    } else {
      for (int64_t t = n; t < n_end; t++)
        dot_rows<kForm, 1, kRows>(qx, dx, xsum, k_dim, codes + t * stride, scales + t * groups,
                                  minimums ? minimums + t * groups : nullptr, group, out + t, out_stride);
    }
  }
}

template <Codes kForm>
void dot_all(const int8_t* qx, const float* dx, const float* xsum, int64_t m_dim, int64_t n_dim, int64_t k_dim,
             const int8_t* codes, const float* scales, const float* minimums, int64_t group, float* out) {
  const int64_t blocks = k_dim / kBlock, groups = k_dim / group;
  for_channel_and_row_blocks(n_dim, m_dim, kChannelBlock, kRowBlock, [&](int64_t n, int64_t n_end, int64_t m0,
                                                                         int64_t rows) {
    const int8_t* q = qx + m0 * k_dim;
    const float* d = dx + m0 * blocks;
    const float* xs = xsum + m0 * groups;
    float* o = out + m0 * n_dim;
    switch (rows) {  // registers: 2 x channels x rows + channels + 2 <= 16
      case 1: dot_channels<kForm, 4, 1>(q, d, xs, k_dim, n, n_end, codes, scales, minimums, group, o, n_dim); break;
      case 2: dot_channels<kForm, 2, 2>(q, d, xs, k_dim, n, n_end, codes, scales, minimums, group, o, n_dim); break;
      case 3: dot_channels<kForm, 2, 3>(q, d, xs, k_dim, n, n_end, codes, scales, minimums, group, o, n_dim); break;
      default: dot_channels<kForm, 1, 4>(q, d, xs, k_dim, n, n_end, codes, scales, minimums, group, o, n_dim); break;
    }
  });
}

}  // namespace
#endif  // RIDGE_FVEC

bool int8_dot_available() {
#if defined(RIDGE_FVEC)
  return true;
#else
  return false;
#endif
}

torch::Tensor int8_dot_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, torch::Tensor minimums,
                              int64_t group, bool signed_codes) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && codes.dim() == 2, "x: float32 [M, K], codes 2-d");
  const bool packed = codes.scalar_type() == torch::kByte;
  TORCH_CHECK((codes.scalar_type() == torch::kInt8 || packed) && codes.is_contiguous(),
              "codes: contiguous int8, or uint8 (4-bit codes two a byte)");
  const int64_t m_dim = x.size(0), n_dim = codes.size(0), k_dim = x.size(1);
  TORCH_CHECK(codes.size(1) * (packed ? 2 : 1) == k_dim, "codes: [N, K] int8 or [N, K / 2] uint8");
  TORCH_CHECK(!(packed && signed_codes), "signed_codes: 4-bit codes two a byte are unsigned");
  TORCH_CHECK(k_dim % 32 == 0 && (group == 16 || (group % 32 == 0 && k_dim % group == 0)),
              "K: a multiple of 32; group: 16, or a multiple of 32 dividing K");
  TORCH_CHECK(scales.scalar_type() == torch::kFloat && scales.is_contiguous() && scales.size(0) == n_dim &&
                  scales.size(1) == k_dim / group,
              "scales: contiguous float32 [N, K / group]");
  TORCH_CHECK(minimums.numel() == 0 || (minimums.sizes() == scales.sizes() && minimums.is_contiguous() &&
                                        minimums.scalar_type() == torch::kFloat),
              "minimums: empty, or like scales");
#if defined(RIDGE_FVEC)
  const torch::Tensor xc = x.contiguous();
  const float* xp = xc.data_ptr<float>();
  std::vector<int8_t> qx(m_dim * k_dim);
  std::vector<float> dx(m_dim * k_dim / kBlock);
  quantize_rows(xp, m_dim, k_dim, qx.data(), dx.data());
  const float* mn = minimums.numel() ? minimums.data_ptr<float>() : nullptr;
  const std::vector<float> xsum = group_sums(xp, mn ? m_dim * (k_dim / group) : 0, group);
  torch::Tensor out = torch::empty({m_dim, n_dim}, xc.options());
  const auto dot = packed         ? dot_all<Codes::kNibbles>
                   : signed_codes ? dot_all<Codes::kSigned>
                                  : dot_all<Codes::kUnsigned>;
  dot(qx.data(), dx.data(), xsum.data(), m_dim, n_dim, k_dim, static_cast<const int8_t*>(codes.data_ptr()),
      scales.data_ptr<float>(), mn, group, out.data_ptr<float>());
  return out;
#else
  TORCH_CHECK(false, "int8_dot_linear: built without AVX2 + FMA");
#endif
}
