// The work split of decode attention over the paged KV cache, shared by paged_attention.cpp (bf16 / float
// caches) and quantized_attention.cpp (int8 / fp8 codes): flash-decoding style, one task per (row, kv head,
// partition of 256 to 1,024 keys), so that a single long sequence still keeps every core busy. A task scores
// its partition, takes a softmax against its own maximum and sums probability-weighted values; a second
// pass merges the partitions of each (row, head) by their maxima. The `group` query heads that share a K/V
// head (GQA) read every K/V row together.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <math.h>
#include "vec.h"

#include <algorithm>
#include <numeric>
#include <optional>
#include <type_traits>
#include <utility>
#include <vector>

namespace ridge_decode {

// The longest partition, and the stride of a task's score rows. Longer partitions cost less per key (a task's
// first blocks are fetched with nothing yet in flight, and each task adds a partial to merge; measured in
// docs/notes/kv-compression.md); shorter ones spread a short context over more threads. run_decode_tasks gives a
// row the longest partition that still makes kTasksPerThread tasks a thread of that row alone.
constexpr int64_t kPartitionTokens = 1024;
constexpr int64_t kShortestPartition = 256;
constexpr int64_t kTasksPerThread = 4;

struct Dims {
  int64_t heads, kv_heads, group, head_dim, num_blocks, block_size;
  // where one head's block starts, in elements: head * head_stride + block * block_stride (paged_attention.cpp's
  // caches, whose layers may be views of a shared slot: attention/backend.py)
  int64_t head_stride = 0, block_stride = 0;
  int64_t block_elems() const { return block_size * head_dim; }  // one block of one head, K or V
  int64_t block_offset(int64_t head, int64_t block) const { return head * head_stride + block * block_stride; }
};

// One task's slice of work and where its partial result goes.
struct Task {
  int64_t seq, head, first_block, num_blocks, num_tokens;  // tokens in [first_block * bs, + num_tokens)
  int64_t skip;  // the first `skip` of them lie before the row's window: scored, then masked out
};

// Partial softmax state of one task: per query head, the running max, the sum of exp(score - max) and
// the unnormalized weighted sum of values; and, when the caller asks for the attention mass of each block,
// the sum of exp(score - max) over each of the task's blocks.
struct Partial {
  float* max;         // [group]
  float* denom;       // [group]
  float* acc;         // [group, d]
  float* block_mass;  // [group, kPartitionTokens / block_size], or nullptr: not asked for
};

// s[t] = exp(s[t] - m) for t < n; returns their sum.
inline float exp_shifted(float* s, int64_t n, float m) {
  int64_t t = 0;
  float sum = 0.f;
#if defined(__AVX512F__)
  const __m512 shift = _mm512_set1_ps(m);
  __m512 total = _mm512_setzero_ps();
  for (; t < n; t += 16) {
    const __mmask16 live = t + 16 <= n ? 0xFFFF : static_cast<__mmask16>((1u << (n - t)) - 1);
    const __m512 e = ridge_vec::vexp(_mm512_sub_ps(_mm512_maskz_loadu_ps(live, s + t), shift));
    _mm512_mask_storeu_ps(s + t, live, e);
    total = _mm512_add_ps(total, _mm512_maskz_mov_ps(live, e));
  }
  sum = _mm512_reduce_add_ps(total);
#elif defined(RIDGE_FVEC)
  using namespace ridge_vec;
  const fvec shift = vset1(-m);
  fvec total = vset1(0.f);
  for (; t + kLanes <= n; t += kLanes) {
    const fvec e = vexp(vadd(vload(s + t), shift));
    vstore(s + t, e);
    total = vadd(total, e);
  }
  sum = vsum(total);
#endif
  for (; t < n; ++t) {
    s[t] = expf(s[t] - m);
    sum += s[t];
  }
  return sum;
}

// exp(score - max) in place over each query head's `n` scores, the first `skip` masked to 0; records
// max and sum, and each block's sum where out.block_mass asks for it.
inline void softmax_partial(float* scores, int64_t stride, int64_t n, int64_t skip, int64_t group,
                            int64_t block_size, Partial out) {
  for (int64_t g = 0; g < group; ++g) {
    float* s = scores + g * stride;
    // finite on purpose: the kernel is built with -ffast-math (no infinities); exp of it is 0
    std::fill(s, s + skip, -1e30f);
    float m = -1e30f;
    int64_t t = 0;
#if defined(__AVX512F__)
    __m512 top = _mm512_set1_ps(m);
    for (; t + 16 <= n; t += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(s + t));
    m = _mm512_reduce_max_ps(top);
#endif
    for (; t < n; ++t) m = std::max(m, s[t]);
    out.max[g] = m;
    out.denom[g] = exp_shifted(s, n, m);
    if (out.block_mass == nullptr) continue;
    float* mass = out.block_mass + g * (kPartitionTokens / block_size);
    for (int64_t first = 0, j = 0; first < n; first += block_size, ++j)
      mass[j] = std::accumulate(s + first, s + std::min(n, first + block_size), 0.f);
  }
}

// f(std::integral_constant<int, G>) for the next G of `heads` query heads, up to 4 (what the kernels hold
// in registers)
template <typename F>
inline void by_heads(int64_t heads, const F& f) {
  switch (std::min<int64_t>(4, heads)) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    default: f(std::integral_constant<int, 4>{}); break;
  }
}

// Split B rows' attention into tasks of one (row, kv head, partition of up to kPartitionTokens keys), run
// attend(q_heads, table, task, scores, q_scratch, partial) on each across the threads, and merge each
// (row, kv head)'s partials into out [B, heads, d] and lse [B, heads] (or nullptr). q_heads: the task's `group` query
// heads, [group, d]; scores: [group, kPartitionTokens] floats of scratch, q_scratch: [group, d].
// mass (or nullptr): [B, mass_stride] floats, to which row b's attention probabilities over the tokens of
// block j of its table, summed over its query heads, are added at [b, j] (what heavy-hitter eviction ranks
// blocks by, kv/eviction.py).
template <typename T, typename Attend>
void run_decode_tasks(const T* q, const int64_t* tables, int64_t table_width, const int64_t* lens,
                      const int64_t* starts, T* out, float* lse, int64_t batch, const Dims& dims,
                      const Attend& attend, float* mass = nullptr, int64_t mass_stride = 0) {
  const int64_t group = dims.group, d = dims.head_dim, bs = dims.block_size;
  const int64_t threads = at::get_num_threads();
  const int64_t longest = std::max<int64_t>(1, kPartitionTokens / bs);  // blocks; a task's mass stride too
  // A row's partition follows from its own length alone, never from the step's other rows, so that a row's
  // rounding is the same in any batch (kernels/batch_invariance.py).
  const auto partition_blocks = [&](int64_t blocks) {
    int64_t part = longest;
    while (part * bs > kShortestPartition && part > 1 &&
           dims.kv_heads * ((blocks + part - 1) / part) < kTasksPerThread * threads)
      part /= 2;
    return part;
  };
  std::vector<Task> tasks;
  std::vector<int64_t> first_task(batch + 1);  // tasks of sequence b: [first_task[b], first_task[b + 1])
  std::vector<int64_t> start_block(batch);  // the block of each row's first key: blocks before it are not read
  for (int64_t b = 0; b < batch; ++b) {
    first_task[b] = tasks.size();
    const int64_t blocks = (lens[b] + bs - 1) / bs, start = starts == nullptr ? 0 : starts[b];
    start_block[b] = start / bs;
    const int64_t part_blocks = partition_blocks(blocks - start_block[b]);
    for (int64_t h = 0; h < dims.kv_heads; ++h)
      for (int64_t first = start_block[b]; first < blocks; first += part_blocks) {
        const int64_t nb = std::min(part_blocks, blocks - first);
        tasks.push_back({b, h, first, nb, std::min(nb * bs, lens[b] - first * bs),
                         first == start_block[b] ? start % bs : 0});
      }
  }
  first_task[batch] = tasks.size();
  const int64_t num_tasks = tasks.size();
  std::vector<float> maxes(num_tasks * group), denoms(num_tasks * group), accs(num_tasks * group * d);
  std::vector<float> block_masses(mass == nullptr ? 0 : num_tasks * group * longest);
  const int64_t workers = std::min<int64_t>(threads, num_tasks);
  // Tasks run in the order of the physical block their partition starts at, so that sequences sharing
  // a prefix (a prefix-cache hit, n > 1 samples, beams, the rows of a prefill chunk) read each shared
  // partition back to back: the second reader finds it in cache, and a prefix shared by many sequences
  // costs about one read from memory per step instead of one per sequence.
  std::vector<std::pair<int64_t, int64_t>> order(num_tasks);  // (locality key, task)
  for (int64_t i = 0; i < num_tasks; ++i) {
    const Task& t = tasks[i];
    order[i] = {(t.head * dims.num_blocks + tables[t.seq * table_width + t.first_block]), i};
  }
  std::sort(order.begin(), order.end());
  // Tasks go round-robin to threads, not in contiguous runs: a contiguous split can hand one thread all
  // the partitions of the longest sequence.
  at::parallel_for(0, workers, 1, [&](int64_t first_worker, int64_t last_worker) {
    std::vector<float> scores(group * kPartitionTokens);
    std::vector<float> q_scaled(group * d);
    for (int64_t worker = first_worker; worker < last_worker; ++worker)
      for (int64_t n = worker; n < num_tasks; n += workers) {
        const int64_t i = order[n].second;
        const Task& task = tasks[i];
        const T* qh = q + (task.seq * dims.heads + task.head * group) * d;
        const int64_t* table = tables + task.seq * table_width;
        Partial partial{maxes.data() + i * group, denoms.data() + i * group, accs.data() + i * group * d,
                        mass == nullptr ? nullptr : block_masses.data() + i * group * longest};
        attend(qh, table, task, scores.data(), q_scaled.data(), partial);
      }
  });
  // Merge each (sequence, kv head)'s partitions: rescale every partial to the overall max.
  at::parallel_for(0, batch, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> merged(d);
    for (int64_t b = begin; b < end; ++b)
      for (int64_t i = first_task[b]; i < first_task[b + 1]; ++i) {
        if (tasks[i].first_block != start_block[b]) continue;  // a head's first partition merges its run
        const int64_t h = tasks[i].head;
        int64_t last = i + 1;
        while (last < first_task[b + 1] && tasks[last].head == h) ++last;
        for (int64_t g = 0; g < group; ++g) {
          float m = -1e30f;
          for (int64_t p = i; p < last; ++p) m = std::max(m, maxes[p * group + g]);
          float denom = 0.f;
          std::fill(merged.begin(), merged.end(), 0.f);
          for (int64_t p = i; p < last; ++p) {
            const float w = expf(maxes[p * group + g] - m);
            denom += w * denoms[p * group + g];
            const float* a = accs.data() + (p * group + g) * d;
            for (int64_t x = 0; x < d; ++x) merged[x] += w * a[x];
          }
          const int64_t row = b * dims.heads + h * group + g;
          if (lse != nullptr) lse[row] = m + logf(denom);
          for (int64_t p = i; mass != nullptr && p < last; ++p) {  // the partials' block sums, normalized
            const float w = expf(maxes[p * group + g] - m) / denom;
            const float* sums = block_masses.data() + (p * group + g) * longest;
            float* row_mass = mass + b * mass_stride + tasks[p].first_block;
            for (int64_t j = 0; j < tasks[p].num_blocks; ++j) row_mass[j] += w * sums[j];
          }
          T* dst = out + row * d;
          const float inv = 1.f / denom;
          for (int64_t x = 0; x < d; ++x) dst[x] = static_cast<T>(merged[x] * inv);
        }
      }
  });
}

// A kernel's optional `window_starts` argument checked against its B rows: the rows' first keys as a dense int64
// tensor, or an undefined one when none was given (every row from key 0).
inline torch::Tensor window_start_rows(const std::optional<torch::Tensor>& window_starts, int64_t batch,
                                       const char* kernel) {
  if (!window_starts.has_value()) return {};
  auto starts = window_starts->contiguous();
  TORCH_CHECK(starts.scalar_type() == torch::kInt64 && starts.numel() == batch, kernel,
              ": window_starts must be [B] int64");
  return starts;
}

// A kernel's optional `mass` argument checked against its rows' block tables: (data, row stride), or (nullptr,
// 0) when none was given.
inline std::pair<float*, int64_t> mass_rows(const std::optional<torch::Tensor>& mass, int64_t batch,
                                            int64_t table_width) {
  if (!mass.has_value()) return {nullptr, 0};
  TORCH_CHECK(mass->scalar_type() == torch::kFloat32 && mass->dim() == 2 && mass->size(0) == batch &&
                  mass->size(1) >= table_width && mass->stride(1) == 1,
              "mass: float32 [B, >= block table width], its rows dense");
  return {mass->data_ptr<float>(), mass->stride(0)};
}

}  // namespace ridge_decode
