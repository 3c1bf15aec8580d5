// Weight-only linear over int8 codes with a scale (and optionally a minimum) per group of G input columns:
//   y[m, n] = sum_k x[m, k] * (code[n, k] * scale[n, k / G] + minimum[n, k / G])
// the layout that GGUF's 5-, 6- and 8-bit block formats (Q5_0, Q5_1, Q5_K, Q6_K, Q8_0) unpack to. torch
// has int8 kernels for one scale per output channel only, and int4 kernels; nothing for grouped scales.
//
// Few rows (decode): every weight is read once and dequantized in registers, 16 at a time, then
// multiplied into up to kRowBlock activation rows, kChannelBlock output channels at a time; memory streams
// the codes and nothing else.
// Many rows (prefill, large batches): a tile of output channels is dequantized into a thread-local buffer
// small enough for L2 and multiplied by torch's own matmul (oneDNN, AMX in bf16), so the dequantization
// is paid once per tile and step, not once per row.
#include <torch/extension.h>
#include <omp.h>

#include <algorithm>
#include <vector>

#include "vec.h"

namespace {

constexpr int64_t kRowBlock = 4;
constexpr int64_t kChannelBlock = 4;  // output channels per register block (decode path)
constexpr int64_t kFewRows = 8;  // up to this many rows, the register path (measured against tiles: 4-16 even)
constexpr int64_t kTileBytes = 1 << 19;

void check(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scales,
           const torch::Tensor& minimums, int64_t group) {
  TORCH_CHECK(x.dim() == 2 && codes.dim() == 2 && x.size(1) == codes.size(1), "x [M, K] and codes [N, K]");
  TORCH_CHECK(codes.scalar_type() == torch::kInt8 && codes.is_contiguous(), "codes: contiguous int8");
  TORCH_CHECK(group % 16 == 0 && codes.size(1) % group == 0, "group: a multiple of 16 dividing K");
  TORCH_CHECK(scales.scalar_type() == torch::kFloat && scales.is_contiguous() &&
                  scales.size(0) == codes.size(0) && scales.size(1) == codes.size(1) / group,
              "scales: contiguous float32 [N, K / group]");
  TORCH_CHECK(minimums.numel() == 0 || (minimums.sizes() == scales.sizes() && minimums.is_contiguous() &&
                                        minimums.scalar_type() == torch::kFloat),
              "minimums: empty, or like scales");
  TORCH_CHECK(x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16, "x: float32 or bfloat16");
}

#if defined(__AVX512F__)
inline __m512 dequant16(const int8_t* codes, __m512 scale, __m512 minimum, bool has_minimum) {
  const __m512 c = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes))));
  return has_minimum ? _mm512_fmadd_ps(c, scale, minimum) : _mm512_mul_ps(c, scale);
}

// out[m, n .. n + kChannels) for rows m0 .. m0 + rows of x (float32 [M, K]). Several channels at once: each
// x vector loaded feeds kChannels FMAs, and the kChannels x rows accumulators are independent chains (one
// channel alone is a chain of K / 16 dependent FMAs, which bounds a decode step by latency, not bytes).
template <int64_t kChannels>
void dot_rows(const float* x, int64_t k_dim, int64_t rows, const int8_t* codes, const float* scales,
              const float* minimums, int64_t group, float* out, int64_t out_stride) {
  const int64_t groups = k_dim / group;
  __m512 acc[kChannels][kRowBlock];
  for (int64_t c = 0; c < kChannels; c++)
    for (int64_t r = 0; r < kRowBlock; r++) acc[c][r] = _mm512_setzero_ps();
  const __m512 zero = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; g++) {
    __m512 scale[kChannels], minimum[kChannels];
    for (int64_t c = 0; c < kChannels; c++) {
      scale[c] = _mm512_set1_ps(scales[c * groups + g]);
      minimum[c] = minimums ? _mm512_set1_ps(minimums[c * groups + g]) : zero;
    }
    for (int64_t j = g * group; j < (g + 1) * group; j += 16) {
      __m512 w[kChannels];
      for (int64_t c = 0; c < kChannels; c++) w[c] = dequant16(codes + c * k_dim + j, scale[c], minimum[c],
                                                             minimums != nullptr);
      for (int64_t r = 0; r < rows; r++) {
        const __m512 xv = _mm512_loadu_ps(x + r * k_dim + j);
        for (int64_t c = 0; c < kChannels; c++) acc[c][r] = _mm512_fmadd_ps(w[c], xv, acc[c][r]);
      }
    }
  }
  for (int64_t r = 0; r < rows; r++)
    for (int64_t c = 0; c < kChannels; c++) out[r * out_stride + c] = _mm512_reduce_add_ps(acc[c][r]);
}
#endif

void dequantize_rows(const int8_t* codes, const float* scales, const float* minimums, int64_t rows, int64_t k_dim,
                     int64_t group, float* out) {
  const int64_t groups = rows * (k_dim / group);  // rows are contiguous: groups follow one another
  for (int64_t g = 0; g < groups; g++) {
    const float scale = scales[g], minimum = minimums ? minimums[g] : 0.f;
    for (int64_t j = g * group; j < (g + 1) * group; j++) out[j] = codes[j] * scale + minimum;
  }
}

}  // namespace

torch::Tensor grouped_int8_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor scales,
                                  torch::Tensor minimums, int64_t group) {
  check(x, codes, scales, minimums, group);
  const int64_t m_dim = x.size(0), n_dim = codes.size(0), k_dim = codes.size(1);
  const int8_t* c = codes.data_ptr<int8_t>();
  const float* s = scales.data_ptr<float>();
  const float* mn = minimums.numel() ? minimums.data_ptr<float>() : nullptr;
  const int64_t groups = k_dim / group;
#if defined(__AVX512F__)
  if (m_dim <= kFewRows) {
    const torch::Tensor xf = x.to(torch::kFloat).contiguous();
    torch::Tensor out = torch::empty({m_dim, n_dim}, xf.options());
    const float* xp = xf.data_ptr<float>();
    float* op = out.data_ptr<float>();
    const int64_t blocks = n_dim / kChannelBlock;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b <= blocks; b++) {
      const int64_t n = b * kChannelBlock;
      for (int64_t m0 = 0; m0 < m_dim; m0 += kRowBlock) {
        const int64_t rows = std::min(kRowBlock, m_dim - m0);
        if (b < blocks) {
          dot_rows<kChannelBlock>(xp + m0 * k_dim, k_dim, rows, c + n * k_dim, s + n * groups,
                                  mn ? mn + n * groups : nullptr, group, op + m0 * n_dim + n, n_dim);
        } else {  // the last n_dim % kChannelBlock channels, one by one
          for (int64_t t = n; t < n_dim; t++)
            dot_rows<1>(xp + m0 * k_dim, k_dim, rows, c + t * k_dim, s + t * groups, mn ? mn + t * groups : nullptr,
                        group, op + m0 * n_dim + t, n_dim);
        }
      }
    }
    return out.to(x.scalar_type());
  }
#endif
  // tiles of output channels, dequantized per thread and multiplied by torch's matmul in x's dtype
  const torch::Tensor xc = x.contiguous();
  torch::Tensor out = torch::empty({m_dim, n_dim}, x.options());
  const int64_t tile = std::max<int64_t>(16, kTileBytes / (k_dim * 4) / 16 * 16);
  const int64_t tiles = (n_dim + tile - 1) / tile;
  // OpenMP's worker threads do not inherit the caller's inference mode: without it, writing into the
  // caller's (inference) output tensor from a worker fails
  const bool inference = c10::InferenceMode::is_enabled();
#pragma omp parallel
  {
    c10::InferenceMode guard(inference);
    std::vector<float> buffer(tile * k_dim);
#pragma omp for schedule(dynamic)
    for (int64_t t = 0; t < tiles; t++) {
      const int64_t n0 = t * tile, rows = std::min(tile, n_dim - n0);
      dequantize_rows(c + n0 * k_dim, s + n0 * groups, mn ? mn + n0 * groups : nullptr, rows, k_dim, group,
                      buffer.data());
      const torch::Tensor w = torch::from_blob(buffer.data(), {rows, k_dim}, torch::kFloat).to(x.scalar_type());
      out.narrow(1, n0, rows).copy_(torch::mm(xc, w.t()));
    }
  }
  return out;
}
