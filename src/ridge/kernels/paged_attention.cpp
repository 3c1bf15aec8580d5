// Decode attention straight from the paged KV cache (CPU), and the cache writes that fill it.
//
// Why by hand: torch has no paged attention for the CPU. Composing one from torch ops means gathering
// every sequence's K/V blocks into a padded dense copy per layer and step, then reading that copy
// again: at batch 64 that moved three times the KV bytes the math needs, and the KV reads are the
// second wall of batched decode after the weights. This kernel reads each K/V row once.
//
// Layout (attention/backend.py): K [kv_heads, num_blocks, d / 2, bs, 2] and V [kv_heads, num_blocks,
// bs / 2, d, 2], each head's block dense and the first two dims at any strides (a layer whose heads differ from
// its slot's others views part of the slot's rows); each 32-bit lane holds a pair of bf16 values, two dims of one token (K) or one dim of two
// tokens (V). One vector load then yields, after a shift and a mask, 16 tokens' values of two dims for
// the scores, or 16 dims of two tokens for the weighted sum: every lane is a different token (or dim), so
// no lane ever needs a horizontal sum. (With K rows stored whole, every score needed a 16-lane reduction;
// the shuffles, not the memory, then set the speed.)
//
// Work is split by decode_tasks.h (flash-decoding style: partitions of 256 to 1,024 keys per row and kv
// head, merged by their maxima); this file holds what a task computes. Built with -ffast-math so that the
// reductions vectorize; nothing here produces an infinity or NaN for that to break.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <math.h>
#include "decode_tasks.h"
#include "vec.h"

#include <algorithm>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

using namespace ridge_decode;

// Portable path for any dtype, block size and head_dim (float32, float16; bf16 without AVX512): the
// same math, scalar.
template <typename T>
void attend_partition(const T* q, const T* k_cache, const T* v_cache, const int64_t* table, const Task& task,
                      const Dims& dims, float scale, float* scores, Partial out) {
  const int64_t d = dims.head_dim, bs = dims.block_size, group = dims.group, n = task.num_tokens;
  for (int64_t g = 0; g < group; ++g)
    std::fill(scores + g * kPartitionTokens, scores + g * kPartitionTokens + task.num_blocks * bs, 0.f);
  for (int64_t j = 0; j < task.num_blocks; ++j) {
    const int64_t block = table[task.first_block + j];
    const T* kb = k_cache + dims.block_offset(task.head, block);
    for (int64_t g = 0; g < group; ++g) {
      const T* qg = q + g * d;
      float* s = scores + g * kPartitionTokens + j * bs;
      for (int64_t i = 0; i < d / 2; ++i) {
        const float q0 = static_cast<float>(qg[2 * i]), q1 = static_cast<float>(qg[2 * i + 1]);
        const T* pair = kb + i * bs * 2;
        for (int64_t t = 0; t < bs; ++t)
          s[t] += q0 * static_cast<float>(pair[2 * t]) + q1 * static_cast<float>(pair[2 * t + 1]);
      }
    }
  }
  for (int64_t g = 0; g < group; ++g)
    for (int64_t t = 0; t < n; ++t) scores[g * kPartitionTokens + t] *= scale;
  softmax_partial(scores, kPartitionTokens, n, task.skip, group, dims.block_size, out);
  std::fill(out.acc, out.acc + group * d, 0.f);
  for (int64_t t = 0; t < n; ++t) {
    const int64_t block = table[task.first_block + t / bs], offset = t % bs;
    const T* row = v_cache + dims.block_offset(task.head, block) + (offset / 2) * d * 2 +
                   offset % 2;
    for (int64_t g = 0; g < group; ++g) {
      const float p = scores[g * kPartitionTokens + t];
      float* a = out.acc + g * d;
      for (int64_t i = 0; i < d; ++i) a[i] += p * static_cast<float>(row[2 * i]);
    }
  }
}

#if defined(__AVX512F__)
// The two bf16 values in each 32-bit lane of v, as floats: a bf16 is the top half of a float32, so the
// low one is the lane shifted up 16 bits and the high one the lane with its low 16 bits cleared.
inline __m512 low_bf16(__m512i v) { return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)); }
inline __m512 high_bf16(__m512i v) { return _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(-65536))); }

// Scores of one K block (16 tokens) for G query heads (q already scaled, [G, d] floats), into
// scores[g * kPartitionTokens + t]. Four accumulators per head (even/odd dim of a pair, even/odd pair)
// keep independent FMA chains in flight; G is a template argument so that they stay in registers.
// `ahead` and `v_here`: lines to prefetch, the block after next's K and this block's V (read by the value
// pass); blocks sit at random addresses, out of the hardware prefetcher's sight, and a few prefetches per
// step replace the burst of 64 per block that stalled on the core's fill buffers.
template <int G>
inline void score_block(const float* q, const uint16_t* kb, int64_t d, const char* ahead, const char* v_here,
                        float* scores) {
  __m512 acc[G][4];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < 4; ++c) acc[g][c] = _mm512_setzero_ps();
  for (int64_t i = 0; i < d / 2; i += 2) {  // i: a pair of dims; two pairs per step
    if (ahead != nullptr) {  // d / 4 steps of two lines each cover the block's d / 2 lines of K and of V
      const int64_t line = i * 64;
      __builtin_prefetch(ahead + line, 0, 2);
      __builtin_prefetch(ahead + line + 64, 0, 2);
      __builtin_prefetch(v_here + line, 0, 2);
      __builtin_prefetch(v_here + line + 64, 0, 2);
    }
    const __m512i k0 = _mm512_loadu_si512(kb + i * 32), k1 = _mm512_loadu_si512(kb + (i + 1) * 32);
    const __m512 k0a = low_bf16(k0), k0b = high_bf16(k0), k1a = low_bf16(k1), k1b = high_bf16(k1);
    for (int g = 0; g < G; ++g) {
      const float* qg = q + g * d + 2 * i;
      acc[g][0] = _mm512_fmadd_ps(_mm512_set1_ps(qg[0]), k0a, acc[g][0]);
      acc[g][1] = _mm512_fmadd_ps(_mm512_set1_ps(qg[1]), k0b, acc[g][1]);
      acc[g][2] = _mm512_fmadd_ps(_mm512_set1_ps(qg[2]), k1a, acc[g][2]);
      acc[g][3] = _mm512_fmadd_ps(_mm512_set1_ps(qg[3]), k1b, acc[g][3]);
    }
  }
  for (int g = 0; g < G; ++g)
    _mm512_storeu_ps(scores + g * kPartitionTokens,
                     _mm512_add_ps(_mm512_add_ps(acc[g][0], acc[g][1]), _mm512_add_ps(acc[g][2], acc[g][3])));
}

// acc[g][c:c+64] = sum over the task's tokens of p[g][t] * V[t][c:c+64], for G query heads. A vector
// holds 16 dims of a token pair: 4 vectors x G heads of accumulators in registers.
template <int G>
inline void sum_values(const uint16_t* v_cache, const int64_t* table, const Task& task, const Dims& dims,
                       const float* probs, int64_t c, float* acc_out) {
  const int64_t d = dims.head_dim, n = task.num_tokens;
  __m512 acc[G][4];
  for (int g = 0; g < G; ++g)
    for (int v = 0; v < 4; ++v) acc[g][v] = _mm512_setzero_ps();
  for (int64_t j = 0; j < task.num_blocks; ++j) {
    const uint16_t* vb = v_cache + dims.block_offset(task.head, table[task.first_block + j]);
    const int64_t pairs = std::min<int64_t>(8, (n - j * 16 + 1) / 2);
    for (int64_t pair = 0; pair < pairs; ++pair) {
      const uint16_t* row = vb + (pair * d + c) * 2;
      __m512 even[4], odd[4];
      for (int v = 0; v < 4; ++v) {
        const __m512i x = _mm512_loadu_si512(row + 32 * v);
        even[v] = low_bf16(x);
        odd[v] = high_bf16(x);
      }
      for (int g = 0; g < G; ++g) {
        const float* p = probs + g * kPartitionTokens + j * 16 + 2 * pair;
        const __m512 pe = _mm512_set1_ps(p[0]), po = _mm512_set1_ps(p[1]);
        for (int v = 0; v < 4; ++v) acc[g][v] = _mm512_fmadd_ps(po, odd[v], _mm512_fmadd_ps(pe, even[v], acc[g][v]));
      }
    }
  }
  for (int g = 0; g < G; ++g)
    for (int v = 0; v < 4; ++v) _mm512_storeu_ps(acc_out + g * d + c + 16 * v, acc[g][v]);
}

// The fast path: bf16 cache, block size 16, head_dim a multiple of 64; float32 FMAs. (On this
// project's Sapphire Rapids box AVX512-BF16's pair dot product issues one per two cycles, the float FMA
// two per cycle: widening with one shift or mask per vector and using FMAs ran twice as fast.) Query
// heads go in chunks of up to 4.
void attend_partition_bf16(const float* q, const uint16_t* k_cache, const uint16_t* v_cache, const int64_t* table,
                           const Task& task, const Dims& dims, float* scores, Partial out) {
  const int64_t d = dims.head_dim, group = dims.group, n = task.num_tokens;
  const auto k_block = [&](int64_t j) {
    return k_cache + dims.block_offset(task.head, table[task.first_block + j]);
  };
  for (int64_t j = 0; j < task.num_blocks; ++j) {
    const uint16_t* kb = k_block(j);
    const char* ahead = reinterpret_cast<const char*>(j + 2 < task.num_blocks ? k_block(j + 2) : kb);
    const char* v_here = reinterpret_cast<const char*>(v_cache + (kb - k_cache));
    for (int64_t g0 = 0; g0 < group; g0 += 4)
      by_heads(group - g0, [&](auto heads) {
        score_block<decltype(heads)::value>(q + g0 * d, kb, d, g0 == 0 ? ahead : nullptr, v_here,
                                            scores + g0 * kPartitionTokens + j * 16);
      });
  }
  softmax_partial(scores, kPartitionTokens, n, task.skip, group, dims.block_size, out);
  for (int64_t g = 0; g < group; ++g)  // the unused half of a final token pair must add nothing
    std::fill(scores + g * kPartitionTokens + n, scores + g * kPartitionTokens + task.num_blocks * 16, 0.f);
  for (int64_t c = 0; c < d; c += 64)
    for (int64_t g0 = 0; g0 < group; g0 += 4)
      by_heads(group - g0, [&](auto heads) {
        sum_values<decltype(heads)::value>(v_cache, table, task, dims, scores + g0 * kPartitionTokens, c,
                                           out.acc + g0 * d);
      });
}
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
// The float32 fast path on AVX2 (a float32 cache, block size a multiple of 8, head_dim of 16): a vector of
// K holds two dims of four tokens, of V four dims of a token pair, so scores and values are FMAs of whole
// vectors, with one horizontal pair-add per block of scores or chunk of dims at the end. The portable loop
// above ran ~5x slower here, scalar expf included.
inline __m256 pair_sums(__m256 a, __m256 b) {  // adjacent pairs of a then of b, in order
  return _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(_mm256_hadd_ps(a, b)), 0b11011000));
}

void attend_partition_f32(const float* q, const float* k_cache, const float* v_cache, const int64_t* table,
                          const Task& task, const Dims& dims, float* scores, Partial out) {
  const int64_t d = dims.head_dim, bs = dims.block_size, group = dims.group, n = task.num_tokens;
  const auto block_offset = [&](int64_t j) {
    return dims.block_offset(task.head, table[task.first_block + j]);
  };
  for (int64_t j = 0; j < task.num_blocks; ++j) {
    const float* kb = k_cache + block_offset(j);
    for (int64_t g = 0; g < group; ++g) {
      const double* qg = reinterpret_cast<const double*>(q + g * d);  // dims (2i, 2i + 1) as one 64-bit load
      float* sg = scores + g * kPartitionTokens + j * bs;
      for (int64_t t0 = 0; t0 < bs; t0 += 8) {  // 8 tokens: two vectors of (token, dim pair)
        __m256 a = _mm256_setzero_ps(), b = _mm256_setzero_ps();
        for (int64_t i = 0; i < d / 2; ++i) {
          const __m256 qi = _mm256_castpd_ps(_mm256_broadcast_sd(qg + i));
          const float* pair = kb + (i * bs + t0) * 2;
          a = _mm256_fmadd_ps(qi, _mm256_loadu_ps(pair), a);
          if (t0 + 4 < bs) b = _mm256_fmadd_ps(qi, _mm256_loadu_ps(pair + 8), b);
        }
        const __m256 sums = pair_sums(a, b);
        if (t0 + 8 <= bs) {
          _mm256_storeu_ps(sg + t0, sums);
        } else {
          alignas(32) float tmp[8];
          _mm256_store_ps(tmp, sums);
          std::copy(tmp, tmp + (bs - t0), sg + t0);
        }
      }
    }
  }
  softmax_partial(scores, kPartitionTokens, n, task.skip, group, dims.block_size, out);
  for (int64_t g = 0; g < group; ++g)  // the unused half of a final token pair must add nothing
    std::fill(scores + g * kPartitionTokens + n, scores + g * kPartitionTokens + (n + 1) / 2 * 2, 0.f);
  for (int64_t g = 0; g < group; ++g) {
    const float* p = scores + g * kPartitionTokens;
    for (int64_t c = 0; c < d; c += 16) {  // 16 dims: four vectors of (dim, token pair)
      __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
      for (int64_t t = 0; t < n; t += 2) {
        const float* row = v_cache + block_offset(t / bs) + ((t % bs) / 2) * d * 2 + c * 2;
        const __m256 pt = _mm256_castpd_ps(_mm256_broadcast_sd(reinterpret_cast<const double*>(p + t)));
        for (int v = 0; v < 4; ++v) acc[v] = _mm256_fmadd_ps(pt, _mm256_loadu_ps(row + 8 * v), acc[v]);
      }
      _mm256_storeu_ps(out.acc + g * d + c, pair_sums(acc[0], acc[1]));
      _mm256_storeu_ps(out.acc + g * d + c + 8, pair_sums(acc[2], acc[3]));
    }
  }
}
#endif

template <typename T>
void decode(const T* q, const T* k_cache, const T* v_cache, const int64_t* tables, int64_t table_width,
            const int64_t* lens, const int64_t* starts, T* out, float* lse, int64_t batch, const Dims& dims,
            float scale, std::pair<float*, int64_t> mass) {
  const int64_t group = dims.group, d = dims.head_dim, bs = dims.block_size;
  run_decode_tasks(q, tables, table_width, lens, starts, out, lse, batch, dims,
                   [&](const T* qh, const int64_t* table, const Task& task, float* scores, float* q_scaled,
                       Partial partial) {
#if defined(__AVX512F__)
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      if (bs == 16 && d % 64 == 0) {
        for (int64_t x = 0; x < group * d; ++x) q_scaled[x] = static_cast<float>(qh[x]) * scale;
        attend_partition_bf16(q_scaled, reinterpret_cast<const uint16_t*>(k_cache),
                              reinterpret_cast<const uint16_t*>(v_cache), table, task, dims, scores, partial);
        return;
      }
    }
#elif defined(__AVX2__) && defined(__FMA__)
    if constexpr (std::is_same_v<T, float>) {
      if (bs % 8 == 0 && d % 16 == 0) {
        for (int64_t x = 0; x < group * d; ++x) q_scaled[x] = qh[x] * scale;
        attend_partition_f32(q_scaled, k_cache, v_cache, table, task, dims, scores, partial);
        return;
      }
    }
#endif
    attend_partition(qh, k_cache, v_cache, table, task, dims, scale, scores, partial);
  }, mass.first, mass.second);
}

}  // namespace

// A layer's K and V caches: 5-dim, each head's block dense (its last three dims contiguous); the head and block dims
// at any strides.
static void check_cache(const torch::Tensor& k_cache, const torch::Tensor& v_cache, const char* op) {
  for (const auto* cache : {&k_cache, &v_cache}) {
    TORCH_CHECK(cache->dim() == 5 && cache->stride(4) == 1 && cache->stride(3) == cache->size(4) &&
                    cache->stride(2) == cache->size(3) * cache->size(4),
                op, ": each head's cache block must be dense");
  }
}

// q: [B, heads, d]; k_cache, v_cache: one layer's caches (layout above); block_tables: [B, width] int64;
// context_lens: [B] int64 (the new token included); window_starts: [B] int64, each row's first key (a
// sliding window), or none: every key -> (out [B, heads, d], lse [B, heads] float32), lse the natural log of
// each query head's softmax denominator over its scaled scores, for merging this attention with another
// over more keys (cascade attention over a shared prefix). Blocks before a row's window are never read.
// mass: float32 [B, >= width] or none: each row's attention probabilities, summed over its query heads and
// the tokens of each block of its table, are added to it (decode_tasks.h).
std::tuple<torch::Tensor, torch::Tensor> paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor context_lens, double scale,
                           std::optional<torch::Tensor> window_starts, std::optional<torch::Tensor> mass) {
  TORCH_CHECK(q.device().is_cpu(), "paged_decode runs on the CPU");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 5 && v_cache.dim() == 5,
              "paged_decode: q [B, heads, d]; K [kv_heads, N, d/2, bs, 2]; V [kv_heads, N, bs/2, d, 2]");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              "paged_decode: q and the cache must share a dtype");
  check_cache(k_cache, v_cache, "paged_decode");
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  context_lens = context_lens.contiguous();
  const torch::Tensor starts = window_start_rows(window_starts, q.size(0), "paged_decode");
  auto out = torch::empty_like(q);
  auto lse = torch::empty({q.size(0), q.size(1)}, q.options().dtype(torch::kFloat32));
  const int64_t batch = q.size(0), heads = q.size(1), head_dim = q.size(2);
  const int64_t kv_heads = k_cache.size(0), num_blocks = k_cache.size(1), block_size = k_cache.size(3);
  TORCH_CHECK(heads % kv_heads == 0, "paged_decode: heads must be a multiple of kv_heads");
  TORCH_CHECK(k_cache.size(2) * 2 == head_dim, "paged_decode: q and cache disagree on head_dim");
  TORCH_CHECK(block_size % 2 == 0 && block_size <= kPartitionTokens, "paged_decode: block size must be even, <= ",
              kPartitionTokens);
  TORCH_CHECK(k_cache.stride(0) == v_cache.stride(0) && k_cache.stride(1) == v_cache.stride(1),
              "paged_decode: K and V caches' heads and blocks at different strides");
  const Dims dims{heads, kv_heads, heads / kv_heads, head_dim, num_blocks, block_size, k_cache.stride(0),
                  k_cache.stride(1)};
  const auto mass_out = mass_rows(mass, q.size(0), block_tables.size(1));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::BFloat16, at::ScalarType::Half, q.scalar_type(), "paged_decode", [&] {
    decode<scalar_t>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                     block_tables.data_ptr<int64_t>(), block_tables.size(1), context_lens.data_ptr<int64_t>(),
                     starts.defined() ? starts.data_ptr<int64_t>() : nullptr, out.data_ptr<scalar_t>(), lse.data_ptr<float>(), batch, dims, static_cast<float>(scale),
                     mass_out);
  });
  return {out, lse};
}

// k, v: [T, kv_heads, d] (rows dense) -> the caches' slots (slot = block * bs + offset), in the layout above.
void cache_write_(torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor k, torch::Tensor v,
                  torch::Tensor slots) {
  TORCH_CHECK(k.stride(2) == 1 && v.stride(2) == 1, "cache_write_: head rows must be dense");
  check_cache(k_cache, v_cache, "cache_write_");
  slots = slots.contiguous();
  const int64_t tokens = k.size(0), heads = k.size(1), d = k.size(2);
  const int64_t bs = k_cache.size(3), head_stride = k_cache.stride(0), block_stride = k_cache.stride(1);
  const int64_t* slot = slots.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::BFloat16, at::ScalarType::Half, k.scalar_type(), "cache_write_", [&] {
    scalar_t* kc = k_cache.data_ptr<scalar_t>();
    scalar_t* vc = v_cache.data_ptr<scalar_t>();
    const scalar_t* ks = k.data_ptr<scalar_t>();
    const scalar_t* vs = v.data_ptr<scalar_t>();
    for (int64_t t = 0; t < tokens; ++t) {
      const int64_t block = slot[t] / bs, offset = slot[t] % bs;
      for (int64_t h = 0; h < heads; ++h) {
        const scalar_t* krow = ks + t * k.stride(0) + h * k.stride(1);
        const scalar_t* vrow = vs + t * v.stride(0) + h * v.stride(1);
        scalar_t* kb = kc + h * head_stride + block * block_stride + offset * 2;
        scalar_t* vb = vc + h * v_cache.stride(0) + block * v_cache.stride(1) + (offset / 2) * d * 2 + offset % 2;
        for (int64_t i = 0; i < d / 2; ++i) {
          kb[i * bs * 2] = krow[2 * i];
          kb[i * bs * 2 + 1] = krow[2 * i + 1];
        }
        for (int64_t i = 0; i < d; ++i) vb[2 * i] = vrow[i];
      }
    }
  });
}

// Blocks of one layer's caches -> dense K, V rows [kv_heads, n * bs, d], for attention that wants plain
// rows (a long continuation chunk's SDPA, a shared prefix's cascade). One pass per block; torch's
// index + permute + reshape made two full copies, one of them element by element, and cost more than
// the attention it fed.
std::tuple<torch::Tensor, torch::Tensor> cache_gather(torch::Tensor k_cache, torch::Tensor v_cache,
                                                     torch::Tensor block_ids) {
  check_cache(k_cache, v_cache, "cache_gather");
  block_ids = block_ids.contiguous();
  const int64_t heads = k_cache.size(0), num_blocks = k_cache.size(1), d = k_cache.size(2) * 2;
  const int64_t bs = k_cache.size(3), n = block_ids.size(0), block_elems = bs * d;
  auto k = torch::empty({heads, n * bs, d}, k_cache.options());
  auto v = torch::empty({heads, n * bs, d}, v_cache.options());
  const int64_t* ids = block_ids.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(0 <= ids[i] && ids[i] < num_blocks, "cache_gather: block id ", ids[i], " out of range");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::BFloat16, at::ScalarType::Half, k_cache.scalar_type(), "cache_gather", [&] {
    const scalar_t* kc = k_cache.data_ptr<scalar_t>();
    const scalar_t* vc = v_cache.data_ptr<scalar_t>();
    scalar_t* ko = k.data_ptr<scalar_t>();
    scalar_t* vo = v.data_ptr<scalar_t>();
    at::parallel_for(0, heads * n, 16, [&](int64_t begin, int64_t end) {
      for (int64_t task = begin; task < end; ++task) {
        const int64_t h = task / n, j = task % n;
        const scalar_t* kb = kc + h * k_cache.stride(0) + ids[j] * k_cache.stride(1);  // [d/2, bs, 2]
        const scalar_t* vb = vc + h * v_cache.stride(0) + ids[j] * v_cache.stride(1);  // [bs/2, d, 2]
        scalar_t* kd = ko + (h * n + j) * block_elems;  // [bs, d]
        scalar_t* vd = vo + (h * n + j) * block_elems;
        for (int64_t t = 0; t < bs; ++t)
          for (int64_t i = 0; i < d / 2; ++i) {
            kd[t * d + 2 * i] = kb[(i * bs + t) * 2];
            kd[t * d + 2 * i + 1] = kb[(i * bs + t) * 2 + 1];
          }
        for (int64_t t = 0; t < bs; ++t)
          for (int64_t c = 0; c < d; ++c) vd[t * d + c] = vb[((t / 2) * d + c) * 2 + t % 2];
      }
    });
  });
  return {k, v};
}

// Merges a second attention result over other keys into `out` (cascade attention: a shared prefix's part
// into each row's suffix part), in place: the two softmaxes weighted by their share of the joint
// denominator, sigmoid(lse_part - lse). out: [N, heads, d]; lse: [N, heads] float, updated to the joint
// log-sum-exp; rows: [R] the rows of out the part is for; part: [kv_heads, R * group, d] and part_lse:
// [kv_heads, R * group] float, in the folded layout the part was computed in (query heads sharing a K/V
// head along the query axis), read as they are: no unfolding copy and no chain of small torch ops.
void merge_attention_(torch::Tensor out, torch::Tensor lse, torch::Tensor rows, torch::Tensor part,
                      torch::Tensor part_lse) {
  TORCH_CHECK(out.is_contiguous() && lse.is_contiguous() && lse.scalar_type() == torch::kFloat32,
              "merge_attention_: contiguous out, float32 lse");
  TORCH_CHECK(part.scalar_type() == out.scalar_type() && part.stride(2) == 1 &&
              part_lse.scalar_type() == torch::kFloat32, "merge_attention_: part in out's dtype, dense rows");
  rows = rows.contiguous();
  const int64_t num_rows = rows.size(0), heads = out.size(1), d = out.size(2), kv_heads = part.size(0);
  const int64_t group = heads / kv_heads;
  TORCH_CHECK(part.size(1) == num_rows * group && part.size(2) == d, "merge_attention_: part shape");
  const int64_t* row = rows.data_ptr<int64_t>();
  float* total = lse.data_ptr<float>();
  const float* plse = part_lse.data_ptr<float>();
  const int64_t ps0 = part.stride(0), ps1 = part.stride(1), ls0 = part_lse.stride(0), ls1 = part_lse.stride(1);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::BFloat16, at::ScalarType::Half, out.scalar_type(), "merge_attention_", [&] {
    scalar_t* o = out.data_ptr<scalar_t>();
    const scalar_t* pp = part.data_ptr<scalar_t>();
    at::parallel_for(0, num_rows, 16, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        for (int64_t h = 0; h < heads; ++h) {
          const int64_t folded = r * group + h % group, kv = h / group;
          const float a = plse[kv * ls0 + folded * ls1], b = total[row[r] * heads + h];
          const float diff = std::min(std::max(a - b, -80.f), 80.f);  // finite exps (-ffast-math)
          const float w = ridge_scalar::sigmoid(diff);  // of a - b
          total[row[r] * heads + h] = std::max(a, b) + log1pf(expf(-fabsf(diff)));
          scalar_t* dst = o + (row[r] * heads + h) * d;
          const scalar_t* src = pp + kv * ps0 + folded * ps1;
          for (int64_t x = 0; x < d; ++x) {
            const float mine = static_cast<float>(dst[x]);
            dst[x] = static_cast<scalar_t>(mine + w * (static_cast<float>(src[x]) - mine));
          }
        }
    });
  });
}
