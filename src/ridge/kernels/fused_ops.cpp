// Fused elementwise ops for the CPU: a decoder layer runs a dozen small ops per token, and at batch 1
// each costs torch's dispatch and threading overhead (10-40 us) whatever its size; these do the work of
// several in one pass.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <math.h>

#include <algorithm>

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

// Rotate heads [0, rotated_heads) of x: [T, heads, d] in place: the two halves of a head are the real and
// imaginary parts, turned by the angle pos * freq; table: [max_pos, d / 2, 2] = (cos, sin).
void rotary_(torch::Tensor x, torch::Tensor positions, torch::Tensor table, int64_t rotated_heads) {
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2), "rotary_: x [T, heads, d], rows dense");
  TORCH_CHECK(table.is_contiguous() && table.scalar_type() == at::kFloat, "rotary_: float32 table");
  positions = positions.contiguous();
  const int64_t tokens = x.size(0), d = x.size(2), half = d / 2, row_stride = x.stride(0);
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* tab = table.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::BFloat16, at::ScalarType::Half, x.scalar_type(), "rotary_", [&] {
    scalar_t* base = x.data_ptr<scalar_t>();
    at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const float* cs = tab + pos[t] * half * 2;
        for (int64_t h = 0; h < rotated_heads; ++h) {
          scalar_t* head = base + t * row_stride + h * d;
          for (int64_t i = 0; i < half; ++i) {
            const float a = static_cast<float>(head[i]), b = static_cast<float>(head[i + half]);
            const float c = cs[2 * i], s = cs[2 * i + 1];
            head[i] = static_cast<scalar_t>(a * c - b * s);
            head[i + half] = static_cast<scalar_t>(b * c + a * s);
          }
        }
      }
    });
  });
}

// k, v: [T, kv_heads, d] (rows dense, any token stride) -> caches [kv_heads, blocks * block_size, d] at slots
void cache_write_(torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor k, torch::Tensor v,
                  torch::Tensor slots) {
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1, "cache_write_: head rows must be dense");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "cache_write_: contiguous caches");
  slots = slots.contiguous();
  const int64_t tokens = k.size(0), heads = k.size(1), d = k.size(2);
  const int64_t per_head = k_cache.numel() / heads;  // slots * d
  const int64_t* slot = slots.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::BFloat16, at::ScalarType::Half, k.scalar_type(), "cache_write_", [&] {
    scalar_t* kc = k_cache.data_ptr<scalar_t>();
    scalar_t* vc = v_cache.data_ptr<scalar_t>();
    const scalar_t* ks = k.data_ptr<scalar_t>();
    const scalar_t* vs = v.data_ptr<scalar_t>();
    for (int64_t t = 0; t < tokens; ++t) {
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t dst = h * per_head + slot[t] * d;
        std::copy_n(ks + t * k.stride(0) + h * k.stride(1), d, kc + dst);
        std::copy_n(vs + t * v.stride(0) + h * v.stride(1), d, vc + dst);
      }
    }
  });
}
