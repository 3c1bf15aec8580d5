// Decode attention straight from the paged KV cache (CPU).
//
// Why by hand: torch has no paged attention for the CPU. Composing one from torch ops means gathering
// every sequence's K/V blocks into a padded dense copy per layer and step, then reading that copy
// again: at batch 64 that moved three times the KV bytes the math needs, and the KV reads are the
// second wall of batched decode after the weights. This kernel reads each K/V row once.
//
// Layout (ridge/attention/backend.py): K and V [kv_heads, num_blocks, block_size, head_dim].
// One task per (sequence, kv head): its `group` query heads share every K/V row they read (GQA).
// Softmax is online, one rescale per block. Built with -ffast-math so that the dot products (float
// reductions) and expf vectorize; nothing here produces an infinity or NaN for that to break.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <math.h>
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <type_traits>
#include <vector>

namespace {

// Rows are widened to float into a small buffer first; for bf16 that is a 16-bit shift, written so
// the compiler vectorizes it (c10::BFloat16's own conversion goes through a call per element).
template <typename T>
inline void widen(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <>
inline void widen<c10::BFloat16>(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint32_t>(bits[i]) << 16;
}

#if defined(__AVX512BF16__)
// Horizontal sums of 16 vectors at once: out[t] = sum(v[t]). A transposing add tree (45 shuffles and
// adds) instead of 16 separate horizontal sums (~10 ops each).
inline __m512 sum16(const __m512* v) {
  __m512 t[8], u[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // per lane: the lane's totals of four vectors
    u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 w0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0b10001000),
                                  _mm512_shuffle_f32x4(u[0], u[1], 0b11011101));
  const __m512 w1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0b10001000),
                                  _mm512_shuffle_f32x4(u[2], u[3], 0b11011101));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, 0b10001000), _mm512_shuffle_f32x4(w0, w1, 0b11011101));
}

// Scores of one block's tokens for `group` bf16 queries, with AVX512-BF16 pair dot products straight
// on the bf16 cache (no widening); head_dim a multiple of 64. This path matters: at batch 64 and
// 1k-token contexts, decode attention outweighs the weight matmuls. A full 16-token block is scored
// whole (rows past n are finite: zeros or older values) and summed with one transposing add tree.
inline void block_scores_bf16(const c10::BFloat16* q, const c10::BFloat16* k_block, int64_t n, int64_t group,
                              int64_t head_dim, int64_t block_size, float scale, float* scores) {
  const int64_t rows = block_size == 16 ? 16 : n;
  for (int64_t g = 0; g < group; ++g) {
    const c10::BFloat16* qrow = q + g * head_dim;
    __m512 acc[16];
    for (int64_t t = 0; t < rows; ++t) {
      const c10::BFloat16* krow = k_block + t * head_dim;
      acc[t] = _mm512_setzero_ps();
      for (int64_t j = 0; j < head_dim; j += 32) {
        const __m512bh kv = (__m512bh)_mm512_loadu_si512(krow + j);
        const __m512bh qv = (__m512bh)_mm512_loadu_si512(qrow + j);
        acc[t] = _mm512_dpbf16_ps(acc[t], qv, kv);
      }
    }
    if (block_size == 16) {
      _mm512_storeu_ps(scores + g * block_size, _mm512_mul_ps(sum16(acc), _mm512_set1_ps(scale)));
    } else {
      for (int64_t t = 0; t < rows; ++t) scores[g * block_size + t] = _mm512_reduce_add_ps(acc[t]) * scale;
    }
  }
}

inline __m512 load_bf16x16(const c10::BFloat16* p) {
  const __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}

// acc[g][:] += sum_t p[g][t] * V[t][:] for one block; head_dim a multiple of 64. Up to 4 query heads x
// 64 dims stay in 16 registers across the block's tokens: 16 independent FMA chains, each V row widened
// once per (4 heads, 64 dims) tile.
inline void block_values_bf16(const c10::BFloat16* v_block, const float* probs, int64_t n, int64_t group,
                              int64_t head_dim, int64_t block_size, float* acc) {
  for (int64_t j = 0; j < head_dim; j += 64) {
    for (int64_t g0 = 0; g0 < group; g0 += 4) {
      const int64_t gn = std::min<int64_t>(4, group - g0);
      __m512 a[4][4];
      for (int64_t gi = 0; gi < 4; ++gi)
        for (int64_t c = 0; c < 4; ++c)
          a[gi][c] = gi < gn ? _mm512_loadu_ps(acc + (g0 + gi) * head_dim + j + 16 * c) : _mm512_setzero_ps();
      for (int64_t t = 0; t < n; ++t) {
        const c10::BFloat16* row = v_block + t * head_dim + j;
        const __m512 v0 = load_bf16x16(row), v1 = load_bf16x16(row + 16);
        const __m512 v2 = load_bf16x16(row + 32), v3 = load_bf16x16(row + 48);
        for (int64_t gi = 0; gi < 4; ++gi) {
          if (gi >= gn) break;
          const __m512 p = _mm512_set1_ps(probs[(g0 + gi) * block_size + t]);
          a[gi][0] = _mm512_fmadd_ps(p, v0, a[gi][0]);
          a[gi][1] = _mm512_fmadd_ps(p, v1, a[gi][1]);
          a[gi][2] = _mm512_fmadd_ps(p, v2, a[gi][2]);
          a[gi][3] = _mm512_fmadd_ps(p, v3, a[gi][3]);
        }
      }
      for (int64_t gi = 0; gi < gn; ++gi)
        for (int64_t c = 0; c < 4; ++c) _mm512_storeu_ps(acc + (g0 + gi) * head_dim + j + 16 * c, a[gi][c]);
    }
  }
}
#endif

template <typename scalar_t>
void decode_kernel(const scalar_t* q, const scalar_t* k_cache, const scalar_t* v_cache, const int64_t* tables,
                   const int64_t* lens, scalar_t* out, int64_t batch, int64_t heads, int64_t kv_heads,
                   int64_t head_dim, int64_t num_blocks, int64_t block_size, int64_t table_width, float scale) {
  const int64_t group = heads / kv_heads;
  // Tasks go round-robin to threads, not in contiguous runs: context lengths vary a lot between
  // sequences, and a contiguous split left one core idle while the other finished the long ones.
  const int64_t tasks = batch * kv_heads, workers = std::min<int64_t>(at::get_num_threads(), tasks);
  at::parallel_for(0, workers, 1, [&](int64_t first_worker, int64_t last_worker) {
    std::vector<float> qf(group * head_dim), acc(group * head_dim), scores(group * block_size);
    std::vector<float> m(group), l(group), kf(head_dim);
    for (int64_t worker = first_worker; worker < last_worker; ++worker)
    for (int64_t task = worker; task < tasks; task += workers) {
      const int64_t b = task / kv_heads, h = task % kv_heads;
      const int64_t ctx = lens[b];
      for (int64_t g = 0; g < group; ++g) {
        widen(q + (b * heads + h * group + g) * head_dim, qf.data() + g * head_dim, head_dim);
        for (int64_t i = 0; i < head_dim; ++i) qf[g * head_dim + i] *= scale;
        m[g] = -1e30f;  // finite on purpose: the kernel is built with -ffast-math (no infinities)
        l[g] = 0.f;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      const int64_t blocks = (ctx + block_size - 1) / block_size;
      for (int64_t j = 0; j < blocks; ++j) {
        const int64_t block = tables[b * table_width + j];
        const int64_t n = std::min(block_size, ctx - j * block_size);
        const int64_t base = ((h * num_blocks) + block) * block_size * head_dim;
        if (j + 1 < blocks) {  // blocks sit at random addresses, out of the hardware prefetcher's sight
          const int64_t next = ((h * num_blocks) + tables[b * table_width + j + 1]) * block_size * head_dim;
          const char* kn = reinterpret_cast<const char*>(k_cache + next);
          const char* vn = reinterpret_cast<const char*>(v_cache + next);
          for (int64_t off = 0; off < block_size * head_dim * static_cast<int64_t>(sizeof(scalar_t)); off += 64) {
            __builtin_prefetch(kn + off);
            __builtin_prefetch(vn + off);
          }
        }
#if defined(__AVX512BF16__)
        if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
          if (head_dim % 64 == 0 && block_size <= 16) {
            block_scores_bf16(q + (b * heads + h * group) * head_dim, k_cache + base, n, group, head_dim,
                              block_size, scale, scores.data());
            goto softmax;
          }
        }
#endif
        for (int64_t t = 0; t < n; ++t) {
          widen(k_cache + base + t * head_dim, kf.data(), head_dim);
          for (int64_t g = 0; g < group; ++g) {
            const float* qg = qf.data() + g * head_dim;
            float s = 0.f;
            for (int64_t i = 0; i < head_dim; ++i) s += qg[i] * kf[i];
            scores[g * block_size + t] = s;
          }
        }
      softmax:
        for (int64_t g = 0; g < group; ++g) {
          float* sg = scores.data() + g * block_size;
          float block_max = m[g];
          for (int64_t t = 0; t < n; ++t) block_max = std::max(block_max, sg[t]);
          const float rescale = std::exp(m[g] - block_max);
          float* ag = acc.data() + g * head_dim;
          for (int64_t i = 0; i < head_dim; ++i) ag[i] *= rescale;
          l[g] *= rescale;
          float sum = 0.f;
#pragma omp simd reduction(+ : sum)
          for (int64_t t = 0; t < n; ++t) {
            sg[t] = expf(sg[t] - block_max);  // expf, not std::exp: glibc's vector expf under -ffast-math
            sum += sg[t];
          }
          l[g] += sum;
          m[g] = block_max;
        }
#if defined(__AVX512BF16__)
        if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
          if (head_dim % 64 == 0 && block_size <= 16) {
            block_values_bf16(v_cache + base, scores.data(), n, group, head_dim, block_size, acc.data());
            continue;
          }
        }
#endif
        for (int64_t t = 0; t < n; ++t) {
          widen(v_cache + base + t * head_dim, kf.data(), head_dim);
          for (int64_t g = 0; g < group; ++g) {
            const float p = scores[g * block_size + t];
            float* ag = acc.data() + g * head_dim;
            for (int64_t i = 0; i < head_dim; ++i) ag[i] += p * kf[i];
          }
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        scalar_t* dst = out + (b * heads + h * group + g) * head_dim;
        const float inv = 1.f / l[g];
        for (int64_t i = 0; i < head_dim; ++i) dst[i] = static_cast<scalar_t>(acc[g * head_dim + i] * inv);
      }
    }
  });
}

}  // namespace

// q: [B, heads, d]; k_cache, v_cache: [kv_heads, num_blocks, block_size, d];
// block_tables: [B, width] int64; context_lens: [B] int64 (the new token included) -> [B, heads, d]
torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor context_lens, double scale) {
  TORCH_CHECK(q.device().is_cpu(), "paged_decode runs on the CPU");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4, "paged_decode: q [B, heads, d], cache [kv_heads, N, bs, d]");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              "paged_decode: q and the cache must share a dtype");
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  context_lens = context_lens.contiguous();
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "paged_decode: cache must be contiguous");
  auto out = torch::empty_like(q);
  const int64_t batch = q.size(0), heads = q.size(1), head_dim = q.size(2);
  const int64_t kv_heads = v_cache.size(0), num_blocks = v_cache.size(1), block_size = v_cache.size(2);
  TORCH_CHECK(heads % kv_heads == 0, "paged_decode: heads must be a multiple of kv_heads");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::BFloat16, at::ScalarType::Half, q.scalar_type(), "paged_decode", [&] {
    decode_kernel<scalar_t>(q.data_ptr<scalar_t>(), k_cache.data_ptr<scalar_t>(), v_cache.data_ptr<scalar_t>(),
                            block_tables.data_ptr<int64_t>(), context_lens.data_ptr<int64_t>(),
                            out.data_ptr<scalar_t>(), batch, heads, kv_heads, head_dim, num_blocks, block_size,
                            block_tables.size(1), static_cast<float>(scale));
  });
  return out;
}
