// Multi-head latent attention's decode (models/mla.py) straight from its paged cache, and the per-head
// products around it: W_UK folded into each head's query, W_UV applied to each head's weighted latent.
//
// Why by hand: built from torch ops, a decode gathers every row's blocks into a padded float32 copy per layer and
// step, and the per-head products run through bmm over non-contiguous slices of kv_b, copying them first: several
// times what reading the layer's weights takes (docs/notes/moe-mla.md).
//
// Cache layout (attention/latent.py): [num_blocks, block_size, dim], one row per token, its latent (the first
// value_dim values) then its rotary key. Every query head scores whole rows and sums their latents: one KV head
// that all query heads share, so decode_tasks.h's flash-decoding split runs it as a single group of all heads,
// each row read once for all of them. float32 and bfloat16; float32 arithmetic throughout.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <type_traits>

#include "decode_tasks.h"
#include "vec.h"

namespace {

using namespace ridge_decode;

#if defined(RIDGE_FVEC)
using ridge_vec::fvec;
using ridge_vec::kLanes;

// kLanes values of a float32 or bf16 row, as floats
template <typename T>
inline fvec vload_float(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return ridge_vec::vload(p);
  } else {
#if defined(__AVX512F__)
    return ridge_vec::load_bf16(p);
#else
    const __m128i bits = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(bits), 16));
#endif
  }
}
#else
constexpr int64_t kLanes = 1;  // no vectors: every loop below runs its scalar tail
#endif

// scores[g * kPartitionTokens + t] = q[g] . row t, for G heads of q (floats, scaled) and tokens t0, t0 + 1 of
// rows (two at a time: 2 x G independent FMA chains in flight)
template <int G, typename T>
inline void score_pair(const float* q, const T* row0, const T* row1, int64_t d, float* scores) {
  float sum0[G] = {}, sum1[G] = {};
  int64_t c = 0;
#if defined(RIDGE_FVEC)
  fvec acc0[G], acc1[G];
  for (int g = 0; g < G; ++g) acc0[g] = acc1[g] = ridge_vec::vset1(0.f);
  for (; c + kLanes <= d; c += kLanes) {
    const fvec r0 = vload_float(row0 + c), r1 = vload_float(row1 + c);
    for (int g = 0; g < G; ++g) {
      const fvec qg = ridge_vec::vload(q + g * d + c);
      acc0[g] = ridge_vec::vfmadd(qg, r0, acc0[g]);
      acc1[g] = ridge_vec::vfmadd(qg, r1, acc1[g]);
    }
  }
  for (int g = 0; g < G; ++g) {
    sum0[g] = ridge_vec::vsum(acc0[g]);
    sum1[g] = ridge_vec::vsum(acc1[g]);
  }
#endif
  for (; c < d; ++c)
    for (int g = 0; g < G; ++g) {
      sum0[g] += q[g * d + c] * static_cast<float>(row0[c]);
      sum1[g] += q[g * d + c] * static_cast<float>(row1[c]);
    }
  for (int g = 0; g < G; ++g) {
    scores[g * kPartitionTokens] = sum0[g];
    scores[g * kPartitionTokens + 1] = sum1[g];
  }
}

// acc[g][c:c + kWidth * kLanes] += sum over `tokens` rows of p[g][t] * row t's values there, for G heads
template <int G, int kWidth, typename T>
inline void sum_rows(const T* rows, int64_t d, int64_t tokens, const float* probs, int64_t c, float* acc,
                     int64_t acc_stride) {
#if defined(RIDGE_FVEC)
  fvec sums[G][kWidth];
  for (int g = 0; g < G; ++g)
    for (int v = 0; v < kWidth; ++v) sums[g][v] = ridge_vec::vload(acc + g * acc_stride + c + v * kLanes);
  for (int64_t t = 0; t < tokens; ++t) {
    fvec r[kWidth];
    for (int v = 0; v < kWidth; ++v) r[v] = vload_float(rows + t * d + c + v * kLanes);
    for (int g = 0; g < G; ++g) {
      const fvec p = ridge_vec::vset1(probs[g * kPartitionTokens + t]);
      for (int v = 0; v < kWidth; ++v) sums[g][v] = ridge_vec::vfmadd(p, r[v], sums[g][v]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int v = 0; v < kWidth; ++v) ridge_vec::vstore(acc + g * acc_stride + c + v * kLanes, sums[g][v]);
#endif
}

// One task: `group` query heads (all of them) over a partition of one row's blocks.
template <typename T>
void attend_partition(const float* q, const T* cache, const int64_t* table, const Task& task, const Dims& dims,
                      int64_t value_dim, float* scores, Partial out) {
  const int64_t d = dims.head_dim, bs = dims.block_size, group = dims.group, n = task.num_tokens;
  const auto block_rows = [&](int64_t j) { return cache + table[task.first_block + j] * bs * d; };
  for (int64_t j = 0; j < task.num_blocks; ++j) {
    const T* rows = block_rows(j);
    const int64_t tokens = std::min(bs, n - j * bs);
    for (int64_t t = 0; t < tokens; t += 2) {
      // an odd last token pairs with itself: its second score lands past the task's tokens, never read
      const T* second = rows + std::min(t + 1, tokens - 1) * d;
      for (int64_t g0 = 0; g0 < group; g0 += 4)
        by_heads(group - g0, [&](auto heads) {
          score_pair<decltype(heads)::value>(q + g0 * d, rows + t * d, second, d,
                                            scores + g0 * kPartitionTokens + j * bs + t);
        });
    }
  }
  softmax_partial(scores, kPartitionTokens, n, task.skip, group, bs, out);
  std::fill(out.acc, out.acc + group * d, 0.f);  // the rotary part's sums stay 0: only latents are summed
  for (int64_t j = 0; j < task.num_blocks; ++j) {
    const T* rows = block_rows(j);
    const int64_t tokens = std::min(bs, n - j * bs);
    const float* probs = scores + j * bs;
    int64_t c = 0;
    for (; c + 4 * kLanes <= value_dim && kLanes > 1; c += 4 * kLanes)
      for (int64_t g0 = 0; g0 < group; g0 += 4)
        by_heads(group - g0, [&](auto heads) {
          sum_rows<decltype(heads)::value, 4>(rows, d, tokens, probs + g0 * kPartitionTokens, c,
                                              out.acc + g0 * d, d);
        });
    for (; c + kLanes <= value_dim && kLanes > 1; c += kLanes)
      for (int64_t g0 = 0; g0 < group; g0 += 4)
        by_heads(group - g0, [&](auto heads) {
          sum_rows<decltype(heads)::value, 1>(rows, d, tokens, probs + g0 * kPartitionTokens, c,
                                              out.acc + g0 * d, d);
        });
    for (; c < value_dim; ++c)
      for (int64_t g = 0; g < group; ++g)
        for (int64_t t = 0; t < tokens; ++t)
          out.acc[g * d + c] += probs[g * kPartitionTokens + t] * static_cast<float>(rows[t * d + c]);
  }
}

// y[c:c + kWidth * kLanes] = x . w's columns there, for R rows of x: w [in, out] with rows `w_stride` apart
template <int R, int kWidth, typename T>
inline void times_columns(const T* x, int64_t x_stride, const T* w, int64_t w_stride, int64_t in, int64_t c,
                          T* y, int64_t y_stride) {
#if defined(RIDGE_FVEC)
  fvec acc[R][kWidth];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kWidth; ++v) acc[r][v] = ridge_vec::vset1(0.f);
  for (int64_t i = 0; i < in; ++i) {
    fvec wv[kWidth];
    for (int v = 0; v < kWidth; ++v) wv[v] = vload_float(w + i * w_stride + c + v * kLanes);
    for (int r = 0; r < R; ++r) {
      const fvec xv = ridge_vec::vset1(static_cast<float>(x[r * x_stride + i]));
      for (int v = 0; v < kWidth; ++v) acc[r][v] = ridge_vec::vfmadd(xv, wv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < kWidth; ++v) {
      T* dst = y + r * y_stride + c + v * kLanes;
      if constexpr (std::is_same_v<T, float>) {
        ridge_vec::vstore(dst, acc[r][v]);
      } else {
        ridge_vec::vstore_bf16(dst, acc[r][v]);
      }
    }
#endif
}

// y[c] = x . w's row c for R rows of x and channels c, c + 1: w [out, in] with rows `w_stride` apart
template <int R, typename T>
inline void dot_rows(const T* x, int64_t x_stride, const T* w, int64_t w_stride, int64_t in, int64_t c, T* y,
                     int64_t y_stride, int64_t channels) {
  float sums[2][R] = {};
  int64_t i = 0;
#if defined(RIDGE_FVEC)
  fvec acc[2][R];
  for (int ch = 0; ch < 2; ++ch)
    for (int r = 0; r < R; ++r) acc[ch][r] = ridge_vec::vset1(0.f);
  for (; i + kLanes <= in; i += kLanes) {
    const fvec w0 = vload_float(w + c * w_stride + i);
    const fvec w1 = channels > 1 ? vload_float(w + (c + 1) * w_stride + i) : w0;
    for (int r = 0; r < R; ++r) {
      const fvec xv = vload_float(x + r * x_stride + i);
      acc[0][r] = ridge_vec::vfmadd(w0, xv, acc[0][r]);
      acc[1][r] = ridge_vec::vfmadd(w1, xv, acc[1][r]);
    }
  }
  for (int ch = 0; ch < 2; ++ch)
    for (int r = 0; r < R; ++r) sums[ch][r] = ridge_vec::vsum(acc[ch][r]);
#endif
  for (; i < in; ++i)
    for (int ch = 0; ch < channels; ++ch)
      for (int r = 0; r < R; ++r)
        sums[ch][r] += static_cast<float>(w[(c + ch) * w_stride + i]) * static_cast<float>(x[r * x_stride + i]);
  for (int ch = 0; ch < channels; ++ch)
    for (int r = 0; r < R; ++r) y[r * y_stride + c + ch] = static_cast<T>(sums[ch][r]);
}

}  // namespace

// q: [B, heads, dim], scaled by nothing yet; cache: one layer's [num_blocks, block_size, dim]; block_tables
// [B, width], context_lens [B] (the new token included), window_starts [B] or none: as paged_decode's ->
// [B, heads, dim], each head's probability-weighted sum of the rows' first value_dim values, the rest 0.
// mass: as paged_decode's.
torch::Tensor latent_decode(torch::Tensor q, torch::Tensor cache, torch::Tensor block_tables,
                            torch::Tensor context_lens, double scale, int64_t value_dim,
                            std::optional<torch::Tensor> window_starts, std::optional<torch::Tensor> mass) {
  TORCH_CHECK(q.device().is_cpu() && q.dim() == 3 && cache.dim() == 3 && cache.is_contiguous(),
              "latent_decode: q [B, heads, dim], a contiguous cache [num_blocks, block_size, dim] on the CPU");
  TORCH_CHECK(cache.scalar_type() == q.scalar_type() &&
                  (q.scalar_type() == torch::kFloat || q.scalar_type() == torch::kBFloat16),
              "latent_decode: q and the cache both float32 or both bfloat16");
  TORCH_CHECK(cache.size(2) == q.size(2) && 0 < value_dim && value_dim <= q.size(2),
              "latent_decode: q and the cache disagree on dim, or value_dim is not within it");
  TORCH_CHECK(cache.size(1) <= kPartitionTokens, "latent_decode: block size must be <= ", kPartitionTokens);
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  context_lens = context_lens.contiguous();
  const torch::Tensor starts = window_start_rows(window_starts, q.size(0), "latent_decode");
  auto out = torch::empty_like(q);
  const int64_t batch = q.size(0), heads = q.size(1), d = q.size(2);
  const Dims dims{heads, 1, heads, d, cache.size(0), cache.size(1)};
  const auto mass_out = mass_rows(mass, batch, block_tables.size(1));
  const float scale_f = static_cast<float>(scale);
  AT_DISPATCH_FLOATING_TYPES_AND(at::ScalarType::BFloat16, q.scalar_type(), "latent_decode", [&] {
    const scalar_t* rows = cache.data_ptr<scalar_t>();
    run_decode_tasks(q.data_ptr<scalar_t>(), block_tables.data_ptr<int64_t>(), block_tables.size(1),
                     context_lens.data_ptr<int64_t>(), starts.defined() ? starts.data_ptr<int64_t>() : nullptr,
                     out.data_ptr<scalar_t>(), nullptr, batch, dims,
                     [&](const scalar_t* qh, const int64_t* table, const Task& task, float* scores, float* q_scaled,
                         Partial partial) {
                       for (int64_t x = 0; x < heads * d; ++x) q_scaled[x] = static_cast<float>(qh[x]) * scale_f;
                       attend_partition(q_scaled, rows, table, task, dims, value_dim, scores, partial);
                     },
                     mass_out.first, mass_out.second);
  });
  return out;
}

// Each head's own matrix product: x [T, heads, in] (rows dense) and weight [heads, in, out] -> x[:, h] @
// weight[h], [T, heads, out]; transposed: weight [heads, out, in] -> x[:, h] @ weight[h].T. weight's heads may
// be any stride apart (slices of kv_b), its rows dense. float32 or bfloat16, float32 sums; threads take heads
// and runs of output channels, each kernel reading its weight slice once for up to 4 rows of x.
torch::Tensor head_matmul(torch::Tensor x, torch::Tensor weight, bool transposed) {
  TORCH_CHECK(x.dim() == 3 && weight.dim() == 3 && x.size(1) == weight.size(0) && x.stride(2) == 1 &&
                  weight.stride(2) == 1 && x.scalar_type() == weight.scalar_type() &&
                  (x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16),
              "head_matmul: x [T, heads, in] and weight [heads, ...] of one dtype (float32 or bfloat16), rows dense");
  const int64_t tokens = x.size(0), heads = x.size(1), in = x.size(2);
  const int64_t out_dim = transposed ? weight.size(1) : weight.size(2);
  TORCH_CHECK((transposed ? weight.size(2) : weight.size(1)) == in, "head_matmul: x and weight disagree on in");
  auto y = torch::empty({tokens, heads, out_dim}, x.options());
  // a task: one head's run of output channels, wide enough to amortize a pass over x's rows
  const int64_t run = transposed ? 16 : 4 * kLanes, runs = (out_dim + run - 1) / run;
  AT_DISPATCH_FLOATING_TYPES_AND(at::ScalarType::BFloat16, x.scalar_type(), "head_matmul", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    at::parallel_for(0, heads * runs, 1, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t h = task / runs, c0 = (task % runs) * run, c1 = std::min(out_dim, c0 + run);
        const scalar_t* w = wp + h * weight.stride(0);
        for (int64_t t = 0; t < tokens; t += 4) {
          const scalar_t* xr = xp + t * x.stride(0) + h * x.stride(1);
          scalar_t* yr = yp + (t * heads + h) * out_dim;
          by_heads(tokens - t, [&](auto rows) {  // decode_tasks.h's split by up to 4, over rows here
            constexpr int R = decltype(rows)::value;
            if (transposed) {
              for (int64_t c = c0; c < c1; c += 2)
                dot_rows<R>(xr, x.stride(0), w, weight.stride(1), in, c, yr, heads * out_dim, std::min<int64_t>(2, c1 - c));
              return;
            }
            int64_t c = c0;
            for (; c + 4 * kLanes <= c1 && kLanes > 1; c += 4 * kLanes)
              times_columns<R, 4>(xr, x.stride(0), w, weight.stride(1), in, c, yr, heads * out_dim);
            for (; c + kLanes <= c1 && kLanes > 1; c += kLanes)
              times_columns<R, 1>(xr, x.stride(0), w, weight.stride(1), in, c, yr, heads * out_dim);
            for (; c < c1; ++c)
              for (int r = 0; r < R; ++r) {
                float sum = 0.f;
                for (int64_t i = 0; i < in; ++i)
                  sum += static_cast<float>(xr[r * x.stride(0) + i]) * static_cast<float>(w[i * weight.stride(1) + c]);
                yr[r * heads * out_dim + c] = static_cast<scalar_t>(sum);
              }
          });
        }
      }
    });
  });
  return y;
}
