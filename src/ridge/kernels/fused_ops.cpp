// Fused elementwise ops for the CPU: a decoder layer runs a dozen small ops per token, and at batch 1
// each costs torch's dispatch and threading overhead (10-40 us) whatever its size; these do the work of
// several in one pass.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <math.h>

// residual += x (rounded to the dtype, as torch's add would), then
// out = weight * dtype(residual * rsqrt(mean(residual^2) + eps)), the HF RMSNorm formula.
torch::Tensor add_rms_norm_(torch::Tensor residual, torch::Tensor x, torch::Tensor weight, double eps) {
  TORCH_CHECK(residual.is_contiguous() && x.is_contiguous() && weight.is_contiguous(), "add_rms_norm_: contiguous");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(), "add_rms_norm_: shapes");
  auto out = torch::empty_like(residual);
  const int64_t dim = residual.size(-1), rows = residual.numel() / dim;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::BFloat16, at::ScalarType::Half, residual.scalar_type(),
                                  "add_rms_norm_", [&] {
    scalar_t* r = residual.data_ptr<scalar_t>();
    const scalar_t* a = x.data_ptr<scalar_t>();
    const scalar_t* w = weight.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t row = begin; row < end; ++row) {
        scalar_t* rr = r + row * dim;
        const scalar_t* ar = a + row * dim;
        float sum = 0.f;
        for (int64_t i = 0; i < dim; ++i) {
          const scalar_t v = static_cast<scalar_t>(static_cast<float>(rr[i]) + static_cast<float>(ar[i]));
          rr[i] = v;
          sum += static_cast<float>(v) * static_cast<float>(v);
        }
        const float inv = 1.f / sqrtf(sum / dim + static_cast<float>(eps));
        scalar_t* orow = o + row * dim;
        for (int64_t i = 0; i < dim; ++i) {
          const scalar_t normed = static_cast<scalar_t>(static_cast<float>(rr[i]) * inv);
          orow[i] = static_cast<scalar_t>(static_cast<float>(w[i]) * static_cast<float>(normed));
        }
      }
    });
  });
  return out;
}

// [rows, 2F] = [gate | up] -> silu(gate) * up, [rows, F]
torch::Tensor silu_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.is_contiguous(), "silu_mul: contiguous input");
  const int64_t width = gate_up.size(-1) / 2, rows = gate_up.numel() / (2 * width);
  auto sizes = gate_up.sizes().vec();
  sizes.back() = width;
  auto out = torch::empty(sizes, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::BFloat16, at::ScalarType::Half, gate_up.scalar_type(),
                                  "silu_mul", [&] {
    const scalar_t* in = gate_up.data_ptr<scalar_t>();
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
      for (int64_t row = begin; row < end; ++row) {
        const scalar_t* g = in + row * 2 * width;
        const scalar_t* u = g + width;
        scalar_t* orow = o + row * width;
        for (int64_t i = 0; i < width; ++i) {
          const float gv = static_cast<float>(g[i]);
          const scalar_t act = static_cast<scalar_t>(gv / (1.f + expf(-gv)));
          orow[i] = static_cast<scalar_t>(static_cast<float>(act) * static_cast<float>(u[i]));
        }
      }
    });
  });
  return out;
}
