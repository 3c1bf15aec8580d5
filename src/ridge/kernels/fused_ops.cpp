// Fused elementwise ops for the CPU: a decoder layer runs a dozen small ops per token, and at batch 1
// each costs torch's dispatch and threading overhead (10-40 us) whatever its size; these do the work of
// several in one pass.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <math.h>

#include <algorithm>
#include <type_traits>

#include "vec.h"

namespace {

#if defined(__AVX512F__)
// The bf16 rows of the two ops below, 16 values per instruction; same roundings as the scalar code.
void add_rms_norm_row_bf16(uint16_t* r, const uint16_t* a, const uint16_t* w, uint16_t* o, int64_t dim, float eps) {
  using namespace ridge_vec;
  __m512 squares = _mm512_setzero_ps();
  for (int64_t i = 0; i < dim; i += 16) {
    const __m512 v = round_bf16(_mm512_add_ps(load_bf16(r + i), load_bf16(a + i)));
    store_bf16(r + i, v);
    squares = _mm512_fmadd_ps(v, v, squares);
  }
  const __m512 inv = _mm512_set1_ps(1.f / sqrtf(_mm512_reduce_add_ps(squares) / dim + eps));
  for (int64_t i = 0; i < dim; i += 16)
    store_bf16(o + i, _mm512_mul_ps(load_bf16(w + i), round_bf16(_mm512_mul_ps(load_bf16(r + i), inv))));
}

void silu_mul_row_bf16(const uint16_t* g, const uint16_t* u, uint16_t* o, int64_t width) {
  using namespace ridge_vec;
  const __m512 one = _mm512_set1_ps(1.f);
  for (int64_t i = 0; i < width; i += 16) {
    const __m512 gate = load_bf16(g + i);
    // 1 / (1 + e^-g) by a reciprocal estimate and one Newton step (~23 bits): a vector divide costs 16
    // cycles, as much as the rest of the row's arithmetic
    const __m512 denom = _mm512_add_ps(one, vexp(_mm512_sub_ps(_mm512_setzero_ps(), gate)));
    __m512 recip = _mm512_rcp14_ps(denom);
    recip = _mm512_mul_ps(recip, _mm512_fnmadd_ps(denom, recip, _mm512_set1_ps(2.f)));
    const __m512 act = round_bf16(_mm512_mul_ps(gate, recip));
    store_bf16(o + i, _mm512_mul_ps(act, load_bf16(u + i)));
  }
}
#endif

template <typename T>
constexpr bool kVectorBf16 =
#if defined(__AVX512F__)
    std::is_same_v<T, c10::BFloat16>;
#else
    false;
#endif

template <typename T>
const uint16_t* bits(const T* p) { return reinterpret_cast<const uint16_t*>(p); }
template <typename T>
uint16_t* bits(T* p) { return reinterpret_cast<uint16_t*>(p); }

}  // namespace

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
#if defined(__AVX512F__)
        if constexpr (kVectorBf16<scalar_t>) {
          if (dim % 16 == 0) {
            add_rms_norm_row_bf16(bits(rr), bits(ar), bits(w), bits(o + row * dim), dim, static_cast<float>(eps));
            continue;
          }
        }
#endif
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
#if defined(__AVX512F__)
        if constexpr (kVectorBf16<scalar_t>) {
          if (width % 16 == 0) {
            silu_mul_row_bf16(bits(g), bits(u), bits(orow), width);
            continue;
          }
        }
#endif
        for (int64_t i = 0; i < width; ++i) {
          const float gv = static_cast<float>(g[i]);
          const scalar_t act = static_cast<scalar_t>(ridge_scalar::silu(gv));
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
  // a head's d values contiguous, heads at least d apart: a partial rotary's first dims of wider heads too
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && (x.size(1) == 1 || x.stride(1) >= x.size(2)),
              "rotary_: x [T, heads, d], each head's values dense");
  TORCH_CHECK(table.is_contiguous() && table.scalar_type() == at::kFloat, "rotary_: float32 table");
  positions = positions.contiguous();
  const int64_t tokens = x.size(0), d = x.size(2), half = d / 2, row_stride = x.stride(0);
  const int64_t head_stride = x.size(1) == 1 ? d : x.stride(1);  // one head's stride is never used
  const int64_t* pos = positions.data_ptr<int64_t>();
  const float* tab = table.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::BFloat16, at::ScalarType::Half, x.scalar_type(), "rotary_", [&] {
    scalar_t* base = x.data_ptr<scalar_t>();
    at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        const float* cs = tab + pos[t] * half * 2;
        for (int64_t h = 0; h < rotated_heads; ++h) {
          scalar_t* head = base + t * row_stride + h * head_stride;
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
