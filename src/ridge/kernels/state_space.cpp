// A Mamba-2 mixer's decode token in one pass over its state (models/mamba.py's recurrence).
//
// From torch ops a decode token gathers each sequence's state ([heads, head_dim, state_size] in float32), scales
// it, adds the token's outer product, scatters it back and multiplies it by C: five passes over the state and a
// bmm (docs/notes/ssm.md has what that cost). Here each head's state is read once and written once, in place in
// its slot, with the convolution step before it. The mixer's parameters are read in the activations' dtype and
// widened as they are used, as the torch form's .float() copies would hold them, without making those copies.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <float.h>
#include <math.h>

#include <algorithm>
#include <vector>

#include "ops.h"
#include "vec.h"

namespace {

// torch's softplus (beta 1, threshold 20)
inline float softplus(float x) { return x > 20.f ? x : log1pf(expf(x)); }


template <typename T>
void mamba2_decode_rows(const torch::Tensor& xbc, const torch::Tensor& dt, torch::Tensor& conv_state,
                        torch::Tensor& ssm_state, const torch::Tensor& slots, const torch::Tensor& conv_weight,
                        const torch::Tensor& conv_bias, const torch::Tensor& dt_bias, const torch::Tensor& A_log,
                        const torch::Tensor& D, int64_t groups, float dt_min, float dt_max, torch::Tensor& y) {
  const int64_t rows = xbc.size(0), channels = xbc.size(1), taps = conv_weight.size(1);
  const int64_t heads = ssm_state.size(1), head_dim = ssm_state.size(2), state_size = ssm_state.size(3);
  const int64_t inner = heads * head_dim, per_group = heads / groups;
  const T* xbc_p = xbc.data_ptr<T>();
  const T* dt_p = dt.data_ptr<T>();
  const int64_t xbc_stride = xbc.stride(0), dt_stride = dt.stride(0);
  const int64_t* slot_p = slots.data_ptr<int64_t>();
  const T* weight = conv_weight.data_ptr<T>();
  const T* bias = conv_bias.defined() ? conv_bias.data_ptr<T>() : nullptr;
  float* conv = conv_state.data_ptr<float>();
  float* state = ssm_state.data_ptr<float>();
  // the convolution's activated output [rows, channels]: x, then B and C of every group
  std::vector<float> act(rows * channels);
  at::parallel_for(0, rows * channels, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t row = i / channels, c = i % channels;
      float* window = conv + (slot_p[row] * channels + c) * (taps - 1);  // the last taps - 1 inputs
      const T* w = weight + c * taps;
      const float input = static_cast<float>(xbc_p[row * xbc_stride + c]);
      float out = 0.f;
      for (int64_t k = 0; k < taps - 1; ++k) out += window[k] * static_cast<float>(w[k]);
      out += input * static_cast<float>(w[taps - 1]);
      for (int64_t k = 0; k + 1 < taps - 1; ++k) window[k] = window[k + 1];
      window[taps - 2] = input;
      act[i] = ridge_scalar::silu(bias != nullptr ? out + static_cast<float>(bias[c]) : out);
    }
  });
  const T* dt_bias_p = dt_bias.data_ptr<T>();
  const T* A_log_p = A_log.data_ptr<T>();
  const T* D_p = D.data_ptr<T>();
  float* y_p = y.data_ptr<float>();
  at::parallel_for(0, rows * heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t row = i / heads, h = i % heads, g = h / per_group;
      const float raw = static_cast<float>(dt_p[row * dt_stride + h]) + static_cast<float>(dt_bias_p[h]);
      const float step = std::min(std::max(softplus(raw), dt_min), dt_max);
      const float decay = expf(step * -expf(static_cast<float>(A_log_p[h])));
      const float skip = static_cast<float>(D_p[h]);
      const float* x = act.data() + row * channels + h * head_dim;
      const float* B = act.data() + row * channels + inner + g * state_size;
      const float* C = B + groups * state_size;
      float* s = state + (slot_p[row] * heads + h) * head_dim * state_size;
      for (int64_t p = 0; p < head_dim; ++p, s += state_size) {
        const float scaled = step * x[p];
        float sum = 0.f;
        for (int64_t n = 0; n < state_size; ++n) {
          const float updated = s[n] * decay + scaled * B[n];
          s[n] = updated;
          sum += updated * C[n];
        }
        y_p[(row * heads + h) * head_dim + p] = sum + skip * x[p];
      }
    }
  });
}

}  // namespace

torch::Tensor mamba2_decode_(torch::Tensor xbc, torch::Tensor dt, torch::Tensor conv_state, torch::Tensor ssm_state,
                             torch::Tensor slots, torch::Tensor conv_weight, c10::optional<torch::Tensor> conv_bias,
                             torch::Tensor dt_bias, torch::Tensor A_log, torch::Tensor D, int64_t groups,
                             double dt_min, double dt_max) {
  TORCH_CHECK(xbc.dim() == 2 && dt.dim() == 2 && xbc.stride(1) == 1 && dt.stride(1) == 1 &&
                  xbc.scalar_type() == dt.scalar_type(),
              "mamba2_decode_: xbc [rows, channels] and dt [rows, heads] of one dtype, rows of contiguous values");
  TORCH_CHECK(conv_state.is_contiguous() && ssm_state.is_contiguous() && conv_state.scalar_type() == torch::kFloat &&
                  ssm_state.scalar_type() == torch::kFloat && ssm_state.dim() == 4,
              "mamba2_decode_: float32 contiguous states [slots, channels, taps - 1], [slots, heads, head_dim, state]");
  const int64_t rows = xbc.size(0), channels = xbc.size(1), heads = ssm_state.size(1);
  const int64_t inner = heads * ssm_state.size(2);
  TORCH_CHECK(slots.scalar_type() == torch::kLong && slots.numel() == rows && dt.size(0) == rows &&
                  dt.size(1) == heads,
              "mamba2_decode_: one slot and one dt per head a row");
  TORCH_CHECK(groups > 0 && heads % groups == 0 && channels == inner + 2 * groups * ssm_state.size(3) &&
                  conv_state.size(1) == channels && conv_weight.size(0) == channels &&
                  conv_state.size(2) == conv_weight.size(1) - 1 && conv_weight.size(1) >= 2,
              "mamba2_decode_: channels = heads * head_dim + 2 * groups * state_size, conv_state [slots, channels, "
              "taps - 1]");
  const auto dtype = xbc.scalar_type();
  const auto in_dtype = [&](const torch::Tensor& t) { return t.scalar_type() == dtype && t.is_contiguous(); };
  TORCH_CHECK(in_dtype(conv_weight) && in_dtype(dt_bias) && in_dtype(A_log) && in_dtype(D) &&
                  (!conv_bias.has_value() || in_dtype(*conv_bias)),
              "mamba2_decode_: the mixer's parameters contiguous, in the activations' dtype");
  auto y = torch::empty({rows, inner}, xbc.options().dtype(torch::kFloat));
  const auto bias = conv_bias.has_value() ? *conv_bias : torch::Tensor();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::BFloat16, at::ScalarType::Half, dtype, "mamba2_decode_", [&] {
    mamba2_decode_rows<scalar_t>(xbc, dt, conv_state, ssm_state, slots.contiguous(), conv_weight, bias, dt_bias, A_log,
                                 D, groups, static_cast<float>(dt_min),
                                 static_cast<float>(std::min(dt_max, static_cast<double>(FLT_MAX))), y);
  });
  return y;
}
