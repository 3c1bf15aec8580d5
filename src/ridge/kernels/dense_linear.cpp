// y = x @ W.T (+ bias) for a few rows (decode), float32 or bf16: every weight is read once and multiplied into
// up to kRowBlock rows, kChannels output channels at a time, the channels split between all threads. bf16
// weights are widened to float32 as they are read and the sums kept in float32 (rounded once, at the end).
//
// torch's float32 linear at these shapes is MKL's sgemv on one thread: measured on the 2-core AVX2 box,
// 14 GB/s on a 3072 x 576 layer and 9.4 GB/s on SmolLM2's 49152 x 576 head, where both threads read
// 40 and 20 GB/s. In float32, the dtype a CPU without bf16 arithmetic decodes in, that was most of a step.
// bf16 weights come here only where oneDNN cannot pack them (CPUs without AVX512: linear/dense.py), where
// torch's bf16 matmul is an emulated loop.
#include <torch/extension.h>
#include <omp.h>

#include <algorithm>

#include "vec.h"

namespace {

constexpr int64_t kRowBlock = 4;

inline float widen(float v) { return v; }
inline float widen(c10::BFloat16 v) { return static_cast<float>(v); }

#if defined(RIDGE_FVEC)
inline ridge_vec::fvec vload_weights(const float* p) { return ridge_vec::vload(p); }
inline ridge_vec::fvec vload_weights(const c10::BFloat16* p) { return ridge_vec::vload_bf16(p); }
#endif

template <int64_t kChannels, int64_t kRows, typename W>
void dense_rows(const float* x, int64_t k_dim, const W* w, float* out, int64_t out_stride) {
  float tail[kChannels][kRows] = {};
  int64_t j = 0;
#if defined(RIDGE_FVEC)
  using ridge_vec::fvec;
  fvec acc[kChannels][kRows];
  for (int64_t c = 0; c < kChannels; c++)
    for (int64_t r = 0; r < kRows; r++) acc[c][r] = ridge_vec::vset1(0.f);
  for (; j + ridge_vec::kLanes <= k_dim; j += ridge_vec::kLanes) {
    fvec wv[kChannels];
    for (int64_t c = 0; c < kChannels; c++) wv[c] = vload_weights(w + c * k_dim + j);
    for (int64_t r = 0; r < kRows; r++) {
      const fvec xv = ridge_vec::vload(x + r * k_dim + j);
      for (int64_t c = 0; c < kChannels; c++) acc[c][r] = ridge_vec::vfmadd(wv[c], xv, acc[c][r]);
    }
  }
  for (int64_t c = 0; c < kChannels; c++)
    for (int64_t r = 0; r < kRows; r++) tail[c][r] = ridge_vec::vsum(acc[c][r]);
#endif
  for (; j < k_dim; j++)  // K not a multiple of the vector width (or no vectors at all)
    for (int64_t c = 0; c < kChannels; c++)
      for (int64_t r = 0; r < kRows; r++) tail[c][r] += widen(w[c * k_dim + j]) * x[r * k_dim + j];
  for (int64_t r = 0; r < kRows; r++)
    for (int64_t c = 0; c < kChannels; c++) out[r * out_stride + c] = tail[c][r];
}

// rows [m0, m0 + kRows) of channels [n, n_end): kChannels at a time, the rest one by one
template <int64_t kChannels, int64_t kRows, typename W>
void dense_channels(const float* x, int64_t k_dim, int64_t n, int64_t n_end, const W* w, float* out,
                    int64_t out_stride) {
  for (; n + kChannels <= n_end; n += kChannels) dense_rows<kChannels, kRows>(x, k_dim, w + n * k_dim, out + n, out_stride);
  for (; n < n_end; n++) dense_rows<1, kRows>(x, k_dim, w + n * k_dim, out + n, out_stride);
}

template <typename W>
void dense_linear_into(const float* xp, const W* wp, float* op, int64_t m_dim, int64_t n_dim, int64_t k_dim) {
  constexpr int64_t kChannelBlock = 16;  // channels a thread takes at a time
  for_channel_and_row_blocks(n_dim, m_dim, kChannelBlock, kRowBlock, [&](int64_t n, int64_t n_end, int64_t m0,
                                                                         int64_t rows) {
    const float* xm = xp + m0 * k_dim;
    float* om = op + m0 * n_dim;
    switch (rows) {  // accumulators: channels x rows <= 8 of 16 registers
      case 1: dense_channels<4, 1>(xm, k_dim, n, n_end, wp, om, n_dim); break;
      case 2: dense_channels<4, 2>(xm, k_dim, n, n_end, wp, om, n_dim); break;
      case 3: dense_channels<2, 3>(xm, k_dim, n, n_end, wp, om, n_dim); break;
      default: dense_channels<2, 4>(xm, k_dim, n, n_end, wp, om, n_dim); break;
    }
  });
}

}  // namespace

torch::Tensor dense_linear(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2 && x.size(1) == weight.size(1), "x [M, K] and weight [N, K]");
  const auto dtype = weight.scalar_type();
  TORCH_CHECK((dtype == torch::kFloat || dtype == torch::kBFloat16) && x.scalar_type() == dtype,
              "x and weight both float32 or both bfloat16");
  // bf16 rows widened once here: a few rows of x are nothing beside the weight
  const torch::Tensor xc = x.to(torch::kFloat).contiguous(), wc = weight.contiguous();
  const int64_t m_dim = x.size(0), n_dim = weight.size(0), k_dim = x.size(1);
  torch::Tensor out = torch::empty({m_dim, n_dim}, xc.options());
  if (dtype == torch::kFloat) {
    dense_linear_into(xc.data_ptr<float>(), wc.data_ptr<float>(), out.data_ptr<float>(), m_dim, n_dim, k_dim);
  } else {
    dense_linear_into(xc.data_ptr<float>(), wc.data_ptr<c10::BFloat16>(), out.data_ptr<float>(), m_dim, n_dim,
                      k_dim);
  }
  if (bias.has_value()) out.add_(*bias);
  return out.to(dtype);
}
