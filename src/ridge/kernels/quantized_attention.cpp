// Decode attention over a quantized paged KV cache: int8, fp8 (e4m3) and int4 codes of kv/formats.py, widened to
// float in registers as they are read (never to a dequantized copy: that copy is the traffic the format exists to
// save).
//
// Layout (attention/quantized_kv.py): K codes [kv_heads, N, d / 4, bs, 4] and V codes [kv_heads, N, bs / 4, d,
// 4], a byte a value; each 32-bit lane holds four dims of one token (K) or one dim of four tokens (V), the bf16
// kernel's layout (paged_attention.cpp) with four values a lane instead of two, so that every lane of a load is
// a different token (K) or dim (V) and no score needs a horizontal sum. Scales [kv_heads, N, bs] float16, one a
// row: a score is q . codes times the row's K scale; a row's value weight is its probability times its V scale.
//
// Keys scaled per channel of a block instead (key_channels: int8, kv/formats.py): scales [kv_heads, N, d], a byte
// each (2^(e/8 - 20), 0 for 0). A block's scores are then q times its channel scales, dotted with the codes: the
// query is scaled once a block, G x d products, against 16 x d for the block's scores.
//
// int4: keys in the same lanes with eight dims a lane (K [kv_heads, N, d / 8, bs, 4], nibble k of a lane dim
// 8i + k), scaled per channel of a block as int8's; values as rows (V [kv_heads, N, bs, d / 2], the torch path's),
// a float16 scale per 32 dims of a row (V scales [kv_heads, N, bs, d / 32]). A row's 64 dims are 8 lanes, so a
// load holds two tokens' and a lane's eight nibbles are eight dims 8i + k: eight accumulators per query head, one
// for each k, whose lanes are put back in dim order once a task.
//
// Each tensor's heads and blocks may sit at any strides (its first two dims), each head's block dense: a layer of
// Gemma 4 views its part of a slot's rows of bytes (attention/backend.py's carving of layers of different shapes).
//
// AVX512, block size 16, head_dim a multiple of 64; the backend takes its torch path elsewhere. The task split
// and the merge are decode_tasks.h's.
#include <torch/extension.h>

#include "decode_tasks.h"

#include <c10/util/Float8_e4m3fn.h>

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

using namespace ridge_decode;

// Where a cache tensor [kv_heads, N, ...] holds one head's block, in its elements.
struct BlockAt {
  int64_t head, block;
  explicit BlockAt(const torch::Tensor& t) : head(t.stride(0)), block(t.stride(1)) {}
  int64_t operator()(int64_t h, int64_t b) const { return h * head + b * block; }
};

// Whether t's dims after its heads and blocks are dense: each head's block in one run.
bool dense_blocks(const torch::Tensor& t) {
  int64_t expected = 1;
  for (int64_t i = t.dim() - 1; i >= 2; --i) {
    if (t.size(i) != 1 && t.stride(i) != expected) return false;
    expected *= t.size(i);
  }
  return true;
}

// A layer's four cache tensors' block positions.
struct CacheAt {
  BlockAt k_codes, v_codes, k_scales, v_scales;
};

#if defined(__AVX512F__)
enum class Codes { kInt8, kFp8, kInt4 };

// Bytes of one block of one KV head's codes, K or V.
template <Codes C>
inline int64_t block_bytes(const Dims& dims) {
  return C == Codes::kInt4 ? dims.block_elems() / 2 : dims.block_elems();
}

// Nibble k of every 32-bit lane of x as the int4 code it holds (stored plus 8), a float: a permute of the 16
// codes by the lane's low four bits (which is all the permute reads), no mask and no conversion.
template <int k>
inline __m512 nibble(__m512i x) {
  const __m512 codes = _mm512_setr_ps(-8.f, -7.f, -6.f, -5.f, -4.f, -3.f, -2.f, -1.f, 0.f, 1.f, 2.f, 3.f, 4.f, 5.f,
                                      6.f, 7.f);
  return _mm512_permutexvar_ps(k == 0 ? x : _mm512_srli_epi32(x, 4 * k), codes);
}

// Byte `c` of every 32-bit lane of x, as floats: an int8 code, or an fp8 e4m3 code's value. e4m3 (sign, 4
// exponent bits of bias 7, 3 mantissa bits) placed in a float16's fields is the value times 2^-8; float16 to
// float32 conversion keeps subnormals exact (DAZ does not apply to it), so fp8's subnormals survive too.
template <Codes C, int c>
inline __m512 widen(__m512i x) {
  if constexpr (C == Codes::kInt8) {
    return _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(x, 24 - 8 * c), 24));
  } else {
    const __m512i byte = _mm512_and_si512(_mm512_srli_epi32(x, 8 * c), _mm512_set1_epi32(0xFF));
    const __m512i half = _mm512_or_si512(_mm512_slli_epi32(_mm512_and_si512(byte, _mm512_set1_epi32(0x80)), 8),
                                         _mm512_slli_epi32(_mm512_and_si512(byte, _mm512_set1_epi32(0x7F)), 7));
    return _mm512_mul_ps(_mm512_cvtph_ps(_mm512_cvtepi32_epi16(half)), _mm512_set1_ps(256.f));
  }
}

inline __m512 scales16(const uint16_t* s) {  // 16 float16 scales
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s)));
}

// q [G, d] times a block's channel scales (d bytes, kv/formats.py: 2^(e/8 - 20), 0 for 0) into out [G, d], 16
// channels a vector: e's whole eighths go into a float's exponent, its remaining eighths come from a table.
inline void scale_query(const float* q, const uint8_t* scale_bytes, int64_t group, int64_t d, float* out) {
  const __m512 eighths = _mm512_setr_ps(1.f, 1.0905077f, 1.1892071f, 1.2968396f, 1.4142135f, 1.5422108f, 1.6817929f,
                                        1.8340081f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f);
  for (int64_t c = 0; c < d; c += 16) {
    const __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scale_bytes + c)));
    const __m512i power = _mm512_slli_epi32(_mm512_add_epi32(_mm512_srli_epi32(e, 3), _mm512_set1_epi32(127 - 20)), 23);
    const __m512 scale = _mm512_maskz_mul_ps(_mm512_test_epi32_mask(e, e), _mm512_castsi512_ps(power),
                                             _mm512_permutexvar_ps(_mm512_and_si512(e, _mm512_set1_epi32(7)), eighths));
    for (int64_t g = 0; g < group; ++g)
      _mm512_storeu_ps(out + g * d + c, _mm512_mul_ps(_mm512_loadu_ps(q + g * d + c), scale));
  }
}

// Scores of one K block (16 tokens) for G query heads (q already scaled, [G, d] floats) into
// scores[g * kPartitionTokens + t], times each token's K scale. `ahead` and `v_here`: the lines of the block
// after next's K and of this block's V to prefetch (blocks sit at random addresses, out of the hardware
// prefetcher's sight).
template <Codes C, int G>
inline void score_block(const float* q, const uint8_t* kb, const uint16_t* k_scale, int64_t d, const uint8_t* ahead,
                        const uint8_t* v_here, float* scores) {
  __m512 acc[G][4];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < 4; ++c) acc[g][c] = _mm512_setzero_ps();
  for (int64_t i = 0; i < d / 4; ++i) {  // i: four dims, one line of 16 tokens
    if (ahead != nullptr) {
      __builtin_prefetch(ahead + i * 64, 0, 2);
      __builtin_prefetch(v_here + i * 64, 0, 2);
    }
    const __m512i k = _mm512_loadu_si512(kb + i * 64);
    const __m512 k0 = widen<C, 0>(k), k1 = widen<C, 1>(k), k2 = widen<C, 2>(k), k3 = widen<C, 3>(k);
    for (int g = 0; g < G; ++g) {
      const float* qg = q + g * d + 4 * i;
      acc[g][0] = _mm512_fmadd_ps(_mm512_set1_ps(qg[0]), k0, acc[g][0]);
      acc[g][1] = _mm512_fmadd_ps(_mm512_set1_ps(qg[1]), k1, acc[g][1]);
      acc[g][2] = _mm512_fmadd_ps(_mm512_set1_ps(qg[2]), k2, acc[g][2]);
      acc[g][3] = _mm512_fmadd_ps(_mm512_set1_ps(qg[3]), k3, acc[g][3]);
    }
  }
  const __m512 s = k_scale != nullptr ? scales16(k_scale) : _mm512_set1_ps(1.f);  // none: q carries them
  for (int g = 0; g < G; ++g)
    _mm512_storeu_ps(scores + g * kPartitionTokens,
                     _mm512_mul_ps(_mm512_add_ps(_mm512_add_ps(acc[g][0], acc[g][1]),
                                                 _mm512_add_ps(acc[g][2], acc[g][3])), s));
}

// acc[g][c:c+64] = sum over the task's tokens of w[g][t] * codes[t][c:c+64], w the probability times the V
// scale. A load holds 16 dims of four tokens.
template <Codes C, int G>
inline void sum_values(const uint8_t* v_codes, const BlockAt& v_at, const int64_t* table, const Task& task,
                       const Dims& dims, const float* weights, int64_t c, float* acc_out) {
  const int64_t d = dims.head_dim, n = task.num_tokens;
  __m512 acc[G][4];
  for (int g = 0; g < G; ++g)
    for (int v = 0; v < 4; ++v) acc[g][v] = _mm512_setzero_ps();
  for (int64_t j = 0; j < task.num_blocks; ++j) {
    const uint8_t* vb = v_codes + v_at(task.head, table[task.first_block + j]);
    const int64_t quads = std::min<int64_t>(4, (n - j * 16 + 3) / 4);
    for (int64_t quad = 0; quad < quads; ++quad) {
      const uint8_t* row = vb + (quad * d + c) * 4;
      const float* w = weights + j * 16 + 4 * quad;
      for (int v = 0; v < 4; ++v) {
        const __m512i x = _mm512_loadu_si512(row + 64 * v);
        const __m512 t0 = widen<C, 0>(x), t1 = widen<C, 1>(x), t2 = widen<C, 2>(x), t3 = widen<C, 3>(x);
        for (int g = 0; g < G; ++g) {
          const float* wg = w + g * kPartitionTokens;
          __m512 a = _mm512_fmadd_ps(_mm512_set1_ps(wg[0]), t0, acc[g][v]);
          a = _mm512_fmadd_ps(_mm512_set1_ps(wg[1]), t1, a);
          a = _mm512_fmadd_ps(_mm512_set1_ps(wg[2]), t2, a);
          acc[g][v] = _mm512_fmadd_ps(_mm512_set1_ps(wg[3]), t3, a);
        }
      }
    }
  }
  for (int g = 0; g < G; ++g)
    for (int v = 0; v < 4; ++v) _mm512_storeu_ps(acc_out + g * d + c + 16 * v, acc[g][v]);
}

// int4's score_block: a line holds eight dims of 16 tokens (q scaled by the block's channel scales already).
template <int G>
inline void score_block_int4(const float* q, const uint8_t* kb, int64_t d, const uint8_t* ahead,
                             const uint8_t* v_here, float* scores) {
  __m512 acc[G][2];
  for (int g = 0; g < G; ++g) acc[g][0] = acc[g][1] = _mm512_setzero_ps();
  for (int64_t i = 0; i < d / 8; ++i) {
    if (ahead != nullptr) {
      __builtin_prefetch(ahead + i * 64, 0, 2);
      __builtin_prefetch(v_here + i * 64, 0, 2);
    }
    const __m512i k = _mm512_loadu_si512(kb + i * 64);
    const __m512 k0 = nibble<0>(k), k1 = nibble<1>(k), k2 = nibble<2>(k), k3 = nibble<3>(k);
    const __m512 k4 = nibble<4>(k), k5 = nibble<5>(k), k6 = nibble<6>(k), k7 = nibble<7>(k);
    for (int g = 0; g < G; ++g) {
      const float* qg = q + g * d + 8 * i;
      __m512 a = _mm512_fmadd_ps(_mm512_set1_ps(qg[0]), k0, acc[g][0]);
      __m512 b = _mm512_fmadd_ps(_mm512_set1_ps(qg[1]), k1, acc[g][1]);
      a = _mm512_fmadd_ps(_mm512_set1_ps(qg[2]), k2, a);
      b = _mm512_fmadd_ps(_mm512_set1_ps(qg[3]), k3, b);
      a = _mm512_fmadd_ps(_mm512_set1_ps(qg[4]), k4, a);
      b = _mm512_fmadd_ps(_mm512_set1_ps(qg[5]), k5, b);
      acc[g][0] = _mm512_fmadd_ps(_mm512_set1_ps(qg[6]), k6, a);
      acc[g][1] = _mm512_fmadd_ps(_mm512_set1_ps(qg[7]), k7, b);
    }
  }
  for (int g = 0; g < G; ++g)
    _mm512_storeu_ps(scores + g * kPartitionTokens, _mm512_add_ps(acc[g][0], acc[g][1]));
}

// int4's sum_values over dims [c, c + 64) for G <= 3 heads (eight accumulators each, 24 of the 32 registers):
// acc_out[g][c + 8i + k] = sum over the task's tokens of w * code, w the probability times the row's scale of the
// dim's 32. `weights`: w per head, token and 32 dims of the row ([g][t * groups + group], groups = d / 32).
template <int G>
inline void sum_values_int4(const uint8_t* v_codes, const BlockAt& v_at, const int64_t* table, const Task& task,
                            const Dims& dims, const float* weights, int64_t weights_stride, int64_t c,
                            float* acc_out) {
  const int64_t d = dims.head_dim, n = task.num_tokens, groups = d / 32, row = d / 2;
  // lanes 0-3 and 8-11 hold dims of the first 32, 4-7 and 12-15 of the second; 0-7 one token, 8-15 the next
  const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  __m512 acc[G][8];
  for (int g = 0; g < G; ++g)
    for (int k = 0; k < 8; ++k) acc[g][k] = _mm512_setzero_ps();
  for (int64_t j = 0; j < task.num_blocks; ++j) {
    const uint8_t* vb = v_codes + v_at(task.head, table[task.first_block + j]);
    const int64_t pairs = std::min<int64_t>(8, (n - j * 16 + 1) / 2);
    for (int64_t pair = 0; pair < pairs; ++pair) {
      const int64_t t = j * 16 + 2 * pair;
      const uint8_t* first = vb + 2 * pair * row + c / 2;
      const __m512i x = _mm512_inserti64x4(
          _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(first))),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(first + row)), 1);
      __m512 w[G];
      for (int g = 0; g < G; ++g) {
        const float* wt = weights + g * weights_stride + t * groups + c / 32;
        const __m128 four = _mm_setr_ps(wt[0], wt[1], wt[groups], wt[groups + 1]);
        w[g] = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(four));
      }
      const auto add = [&](auto k_constant) {
        constexpr int k = decltype(k_constant)::value;
        const __m512 codes = nibble<k>(x);
        for (int g = 0; g < G; ++g) acc[g][k] = _mm512_fmadd_ps(w[g], codes, acc[g][k]);
      };
      add(std::integral_constant<int, 0>{});
      add(std::integral_constant<int, 1>{});
      add(std::integral_constant<int, 2>{});
      add(std::integral_constant<int, 3>{});
      add(std::integral_constant<int, 4>{});
      add(std::integral_constant<int, 5>{});
      add(std::integral_constant<int, 6>{});
      add(std::integral_constant<int, 7>{});
    }
  }
  alignas(64) float lanes[16];
  for (int g = 0; g < G; ++g)
    for (int k = 0; k < 8; ++k) {
      _mm512_store_ps(lanes, acc[g][k]);
      for (int i = 0; i < 8; ++i) acc_out[g * d + c + 8 * i + k] = lanes[i] + lanes[i + 8];  // the two tokens' halves
    }
}

// The first `count` of a block's 16 rows. A final block's rows past the task's weigh nothing, whatever their V
// scales: masked, not multiplied by a zero probability, because those rows may hold bytes this layer never wrote (a
// block last held by a layer of another shape: attention/backend.py's slots), as floats an infinity or a NaN.
inline __mmask16 rows_below(int64_t count) {
  return count >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << std::max<int64_t>(count, 0)) - 1);
}

// k_scales: a float16 per row, or (k_channels) a byte per channel of each block.
template <Codes C>
void attend_partition(const float* q, const uint8_t* k_codes, const uint8_t* v_codes, const void* k_scales,
                      bool k_channels, const uint16_t* v_scales, const CacheAt& blocks, const int64_t* table,
                      const Task& task, const Dims& dims, float* scores, Partial out) {
  const int64_t d = dims.head_dim, group = dims.group, n = task.num_tokens, bytes = block_bytes<C>(dims);
  const auto block = [&](int64_t j) { return table[task.first_block + j]; };  // the task's j-th block's id
  const auto k_block = [&](int64_t j) { return k_codes + blocks.k_codes(task.head, block(j)); };
  const auto v_block_scales = [&](int64_t j) { return v_scales + blocks.v_scales(task.head, block(j)); };
  // a float16 a row, or a byte a channel
  const auto k_block_scales = [&](int64_t j) {
    const int64_t at_block = blocks.k_scales(task.head, block(j));
    return k_channels ? static_cast<const uint8_t*>(k_scales) + at_block
                      : reinterpret_cast<const uint8_t*>(static_cast<const uint16_t*>(k_scales) + at_block);
  };
  // keys per channel: each block's query is q times the block's channel scales, made just before the block is
  // scored, into a buffer of one block's query that each thread keeps, so that it stays in L1 (a whole task's
  // blocks' queries do not fit there: docs/notes/kv-compression.md)
  thread_local std::vector<float> q_block;
  if (k_channels && q_block.size() < static_cast<size_t>(group * d)) q_block.resize(group * d);
  // Blocks sit at random addresses, out of the hardware prefetcher's sight: the task's first two blocks of K
  // (score_block prefetches each later one two blocks ahead) and every block's scales, a line or two each, are
  // asked for at once here, so that their misses overlap instead of stalling one after another as they are read.
  for (int64_t j = 0; j < std::min<int64_t>(2, task.num_blocks); ++j)
    for (int64_t line = 0; line < bytes; line += 64) __builtin_prefetch(k_block(j) + line, 0, 2);
  for (int64_t j = 0; j < task.num_blocks; ++j) {
    __builtin_prefetch(k_block_scales(j), 0, 3);
    __builtin_prefetch(v_block_scales(j), 0, 3);
  }
  for (int64_t j = 0; j < task.num_blocks; ++j) {
    const uint8_t* kb = k_block(j);
    const uint8_t* ahead = j + 2 < task.num_blocks ? k_block(j + 2) : kb;
    const uint8_t* v_here = v_codes + blocks.v_codes(task.head, block(j));
    const uint16_t* ks = k_channels ? nullptr : reinterpret_cast<const uint16_t*>(k_block_scales(j));
    if (k_channels) scale_query(q, k_block_scales(j), group, d, q_block.data());
    const float* qj = k_channels ? q_block.data() : q;
    for (int64_t g0 = 0; g0 < group; g0 += 4)
      by_heads(group - g0, [&](auto heads) {
        float* into = scores + g0 * kPartitionTokens + j * 16;
        if constexpr (C == Codes::kInt4)
          score_block_int4<decltype(heads)::value>(qj + g0 * d, kb, d, g0 == 0 ? ahead : nullptr, v_here, into);
        else
          score_block<C, decltype(heads)::value>(qj + g0 * d, kb, ks, d, g0 == 0 ? ahead : nullptr, v_here, into);
      });
  }
  softmax_partial(scores, kPartitionTokens, n, task.skip, group, dims.block_size, out);
  if constexpr (C == Codes::kInt4) {
    // each token's probability times its row's scale of each 32 dims, [g][t * groups + group]
    const int64_t groups = d / 32, stride = kPartitionTokens * groups;
    thread_local std::vector<float> weights;
    if (weights.size() < static_cast<size_t>(group * stride)) weights.resize(group * stride);
    // a block's scales are 16 x groups float16s in a row: element e is token e / groups's
    thread_local std::vector<int32_t> token_of;
    token_of.resize(16 * groups);
    for (int64_t e = 0; e < 16 * groups; ++e) token_of[e] = static_cast<int32_t>(e / groups);
    for (int64_t g = 0; g < group; ++g) {
      const float* p = scores + g * kPartitionTokens;
      float* w = weights.data() + g * stride;
      for (int64_t j = 0; j < task.num_blocks; ++j) {
        const __m512 pj = _mm512_loadu_ps(p + j * 16);
        const uint16_t* s = v_block_scales(j);
        const __m512i live = _mm512_set1_epi32(static_cast<int32_t>(n - j * 16));
        for (int64_t e = 0; e < 16 * groups; e += 16) {
          const __m512i token = _mm512_loadu_si512(token_of.data() + e);
          _mm512_storeu_ps(w + j * 16 * groups + e,
                           _mm512_maskz_mul_ps(_mm512_cmplt_epi32_mask(token, live),
                                               _mm512_permutexvar_ps(token, pj), scales16(s + e)));
        }
      }
    }
    for (int64_t c = 0; c < d; c += 64)
      for (int64_t g0 = 0; g0 < group; g0 += 3) {
        const float* w = weights.data() + g0 * stride;
        float* into = out.acc + g0 * d;
        switch (std::min<int64_t>(3, group - g0)) {
          case 1: sum_values_int4<1>(v_codes, blocks.v_codes, table, task, dims, w, stride, c, into); break;
          case 2: sum_values_int4<2>(v_codes, blocks.v_codes, table, task, dims, w, stride, c, into); break;
          default: sum_values_int4<3>(v_codes, blocks.v_codes, table, task, dims, w, stride, c, into); break;
        }
      }
    return;
  }
  for (int64_t g = 0; g < group; ++g) {
    float* p = scores + g * kPartitionTokens;
    for (int64_t j = 0; j < task.num_blocks; ++j)  // probabilities (the softmax's, summed above) x V scales
      _mm512_storeu_ps(p + j * 16, _mm512_maskz_mul_ps(rows_below(n - j * 16), _mm512_loadu_ps(p + j * 16),
                                                       scales16(v_block_scales(j))));
  }
  for (int64_t c = 0; c < d; c += 64)
    for (int64_t g0 = 0; g0 < group; g0 += 4)
      by_heads(group - g0, [&](auto heads) {
        sum_values<C, decltype(heads)::value>(v_codes, blocks.v_codes, table, task, dims,
                                              scores + g0 * kPartitionTokens, c, out.acc + g0 * d);
      });
}
#endif

}  // namespace

// q: [B, heads, d] (float32, bfloat16 or float16); k_codes, v_codes: one layer's codes (uint8, layout above; every
// tensor's heads and blocks at any strides);
// k_scales: [kv_heads, N, bs] float16, or [kv_heads, N, d] uint8 (keys per channel); v_scales: [kv_heads, N,
// bs] float16 (int4: [kv_heads, N, bs, d / 32]); block_tables [B, width], context_lens [B], window_starts [B]
// (int64) as paged_decode's -> (out [B, heads, d] in q's dtype, lse [B, heads] float32). fp8: the codes are e4m3;
// else int4 where V codes are rows (4 dims), else int8. mass: as paged_decode's.
std::tuple<torch::Tensor, torch::Tensor> quantized_paged_decode(
    torch::Tensor q, torch::Tensor k_codes, torch::Tensor v_codes, torch::Tensor k_scales, torch::Tensor v_scales,
    torch::Tensor block_tables, torch::Tensor context_lens, double scale, std::optional<torch::Tensor> window_starts,
    bool fp8, std::optional<torch::Tensor> mass) {
#if !defined(__AVX512F__)
  TORCH_CHECK(false, "quantized_paged_decode: needs AVX512 (the backend's torch path runs elsewhere)");
#else
  TORCH_CHECK(q.device().is_cpu() && q.dim() == 3, "quantized_paged_decode: q [B, heads, d] on the CPU");
  const bool int4 = v_codes.dim() == 4 && !fp8;
  TORCH_CHECK(k_codes.dim() == 5 && (v_codes.dim() == 5 || int4) && k_codes.scalar_type() == torch::kUInt8 &&
                  v_codes.scalar_type() == torch::kUInt8 && dense_blocks(k_codes) && dense_blocks(v_codes),
              "quantized_paged_decode: codes uint8, K [kv_heads, N, d/4, bs, 4], V [kv_heads, N, bs/4, d, 4] (int4: "
              "K [kv_heads, N, d/8, bs, 4], V [kv_heads, N, bs, d/2])");
  const bool k_channels = k_scales.scalar_type() == torch::kUInt8;
  TORCH_CHECK((k_channels || k_scales.scalar_type() == torch::kHalf) && v_scales.scalar_type() == torch::kHalf &&
                  dense_blocks(k_scales) && dense_blocks(v_scales),
              "quantized_paged_decode: scales float16 [kv_heads, N, bs] (K: or uint8 [kv_heads, N, d]), each head's "
              "block dense");
  const int64_t batch = q.size(0), heads = q.size(1), d = q.size(2);
  const int64_t kv_heads = k_codes.size(0), num_blocks = k_codes.size(1), bs = k_codes.size(3);
  TORCH_CHECK(bs == 16 && d % 64 == 0 && k_codes.size(2) * (int4 ? 8 : 4) == d && heads % kv_heads == 0 &&
                  (!int4 || (k_channels && v_codes.size(3) * 2 == d)),
              "quantized_paged_decode: block size 16, head_dim a multiple of 64, heads a multiple of kv_heads "
              "(int4: keys per channel)");
  TORCH_CHECK(k_scales.numel() == kv_heads * num_blocks * (k_channels ? d : bs) &&
                  v_scales.numel() == kv_heads * num_blocks * bs * (int4 ? d / 32 : 1),
              "quantized_paged_decode: one scale per row (K: or per channel of a block; int4 V: per 32 of a row)");
  q = q.contiguous();
  block_tables = block_tables.contiguous();
  context_lens = context_lens.contiguous();
  const torch::Tensor starts = window_start_rows(window_starts, batch, "quantized_paged_decode");
  auto out = torch::empty_like(q);
  auto lse = torch::empty({batch, heads}, q.options().dtype(torch::kFloat32));
  const Dims dims{heads, kv_heads, heads / kv_heads, d, num_blocks, bs};
  const CacheAt blocks{BlockAt(k_codes), BlockAt(v_codes), BlockAt(k_scales), BlockAt(v_scales)};
  const auto* kc = k_codes.data_ptr<uint8_t>();
  const auto* vc = v_codes.data_ptr<uint8_t>();
  const void* ks = k_scales.data_ptr();
  const auto* vs = reinterpret_cast<const uint16_t*>(v_scales.data_ptr<at::Half>());
  const float softmax_scale = static_cast<float>(scale);
  const auto mass_out = mass_rows(mass, batch, block_tables.size(1));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::BFloat16, at::ScalarType::Half, q.scalar_type(),
                                  "quantized_paged_decode", [&] {
    run_decode_tasks(q.data_ptr<scalar_t>(), block_tables.data_ptr<int64_t>(), block_tables.size(1),
                     context_lens.data_ptr<int64_t>(), starts.defined() ? starts.data_ptr<int64_t>() : nullptr,
                     out.data_ptr<scalar_t>(), lse.data_ptr<float>(), batch, dims,
                     [&](const scalar_t* qh, const int64_t* table, const Task& task, float* scores, float* q_scaled,
                         Partial partial) {
      for (int64_t x = 0; x < dims.group * d; ++x) q_scaled[x] = static_cast<float>(qh[x]) * softmax_scale;
      if (fp8)
        attend_partition<Codes::kFp8>(q_scaled, kc, vc, ks, k_channels, vs, blocks, table, task, dims, scores,
                                      partial);
      else if (int4)
        attend_partition<Codes::kInt4>(q_scaled, kc, vc, ks, k_channels, vs, blocks, table, task, dims, scores,
                                      partial);
      else
        attend_partition<Codes::kInt8>(q_scaled, kc, vc, ks, k_channels, vs, blocks, table, task, dims, scores,
                                      partial);
    }, mass_out.first, mass_out.second);
  });
  return {out, lse};
#endif
}


namespace {

// kv/formats.py's CHANNEL_SCALE_TABLE: 2^(e/8 - 20) rounded once from double, so that both writes find the same
// scales bit for bit
struct ChannelScales {
  float value[256];
  ChannelScales() {
    value[0] = 0.f;
    for (int e = 1; e < 256; ++e) value[e] = static_cast<float>(std::exp2(e / 8.0 - 20.0));
  }
};
const ChannelScales kChannelScales;

// The byte of the smallest channel scale >= wanted (kv/formats.py's encode_channel_scales); 0 for 0. log2 finds it
// but for rounding; the table has the last word.
inline uint8_t encode_channel_scale(float wanted) {
  if (!(wanted > 0.f)) return 0;
  int e = static_cast<int>(std::min(255.f, std::max(1.f, std::ceil((std::log2(wanted) + 20.f) * 8.f))));
  while (e > 1 && kChannelScales.value[e - 1] >= wanted) --e;
  while (e < 255 && kChannelScales.value[e] < wanted) ++e;
  return static_cast<uint8_t>(e);
}

inline float decode_channel_scale(uint8_t e) { return kChannelScales.value[e]; }

// x / s as IEEE divides. The build's -ffast-math would multiply by a rounded reciprocal instead, and a value at a
// rounding tie would then round away from where torch's write rounds it (the embedded-rounding builtin is opaque to
// that rewrite).
inline float exact_div(float x, float s) {
#if defined(__AVX512F__)
  return _mm_cvtss_f32(_mm_div_round_ss(_mm_set_ss(x), _mm_set_ss(s), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#else
  return x / s;
#endif
}

// round half to even, as torch.round (an instruction, not a libm call, under -ffast-math)
inline uint8_t int8_code(float scaled) {
  return static_cast<uint8_t>(static_cast<int8_t>(std::nearbyint(std::min(127.f, std::max(-127.f, scaled)))));
}

// int4: the same, within +-7 (the code itself, -7..7; stored plus 8)
inline int int4_code(float scaled) { return static_cast<int>(std::nearbyint(std::min(7.f, std::max(-7.f, scaled)))); }

inline uint8_t fp8_code(float scaled) {
  return c10::Float8_e4m3fn(std::min(448.f, std::max(-448.f, scaled))).x;
}

}  // namespace

// k, v [T, kv_heads, d] (rows dense, any float dtype) into a quantized cache's layout (attention/quantized_kv.py)
// at `slots`, as that backend's torch write does: values (and fp8 keys) a float16 scale a row (int4: per 32 dims);
// int8 and int4 keys (k_scales uint8 [kv_heads, N, d]) less `center` (float32 [kv_heads, d]), per channel of
// their block, each block's scales grown to the step's keys (at least doubled when they grow) and its earlier keys
// requantized where they did. int4 where V codes are rows (4 dims). The tokens a step writes to one block are
// consecutive in `slots` (a sequence's), so a block's keys are handled together. Reads its inputs in place: a
// decode step's write is a few rows, and a torch conversion costs more than they do.
void quantized_cache_write_(torch::Tensor k_codes, torch::Tensor v_codes, torch::Tensor k_scales,
                            torch::Tensor v_scales, torch::Tensor k, torch::Tensor v, torch::Tensor slots,
                            std::optional<torch::Tensor> center, bool fp8) {
  TORCH_CHECK(dense_blocks(k_codes) && dense_blocks(v_codes) && dense_blocks(k_scales) && dense_blocks(v_scales) &&
                  v_scales.scalar_type() == torch::kHalf,
              "quantized_cache_write_: codes and scales with each head's block dense (values' scales float16)");
  const bool channels = k_scales.scalar_type() == torch::kUInt8;
  TORCH_CHECK(!(channels && fp8), "quantized_cache_write_: fp8 keys have a scale a row");
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k.stride(2) == 1 && v.stride(2) == 1 &&
                  k.scalar_type() == v.scalar_type(),
              "quantized_cache_write_: k, v [T, kv_heads, d] of one dtype, rows dense");
  TORCH_CHECK(slots.is_contiguous() && slots.scalar_type() == torch::kInt64, "quantized_cache_write_: slots int64");
  const int64_t tokens = k.size(0), heads = k.size(1), d = k.size(2);
  const int64_t bs = k_codes.size(3);
  const bool int4 = v_codes.dim() == 4 && !fp8;
  const CacheAt blocks{BlockAt(k_codes), BlockAt(v_codes), BlockAt(k_scales), BlockAt(v_scales)};
  TORCH_CHECK(k_codes.size(0) == heads && k_codes.size(2) * (int4 ? 8 : 4) == d && bs % 4 == 0 &&
                  slots.numel() == tokens && (!int4 || (channels && v_codes.size(3) * 2 == d && d % 32 == 0)),
              "quantized_cache_write_: codes K [kv_heads, N, d/4, bs, 4], V [kv_heads, N, bs/4, d, 4] (int4: K "
              "[kv_heads, N, d/8, bs, 4] scaled per channel, V [kv_heads, N, bs, d/2])");
  const float code_max = fp8 ? 448.f : int4 ? 7.f : 127.f;
  const int64_t value_group = int4 ? 32 : d;  // values per float16 scale of a row
  const float* cx = nullptr;
  if (center.has_value()) {
    TORCH_CHECK(center->scalar_type() == torch::kFloat && center->is_contiguous() && center->numel() == heads * d,
                "quantized_cache_write_: center float32 [kv_heads, d]");
    cx = center->data_ptr<float>();
  }
  const int64_t* slot = slots.data_ptr<int64_t>();
  uint8_t* kc = k_codes.data_ptr<uint8_t>();
  uint8_t* vc = v_codes.data_ptr<uint8_t>();
  at::Half* vs = v_scales.data_ptr<at::Half>();
  // key code c of row o of block b, head h: int8's byte, or int4's nibble (the code plus 8) of its lane's byte
  const auto key_byte = [&](int64_t h, int64_t b, int64_t o, int64_t c) -> uint8_t& {
    return int4 ? kc[blocks.k_codes(h, b) + (c / 8) * bs * 4 + o * 4 + c % 8 / 2]
                : kc[blocks.k_codes(h, b) + (c / 4) * bs * 4 + o * 4 + c % 4];
  };
  const auto key_code = [&](int64_t h, int64_t b, int64_t o, int64_t c) -> float {
    const uint8_t byte = key_byte(h, b, o, c);
    return int4 ? static_cast<float>((byte >> (4 * (c % 2)) & 15) - 8) : static_cast<float>(static_cast<int8_t>(byte));
  };
  const auto set_key_code = [&](int64_t h, int64_t b, int64_t o, int64_t c, float scaled) {
    uint8_t& byte = key_byte(h, b, o, c);
    if (!int4) {
      byte = int8_code(scaled);
      return;
    }
    const int shift = 4 * (c % 2);
    byte = static_cast<uint8_t>((byte & ~(15 << shift)) | (int4_code(scaled) + 8) << shift);
  };
  // a span of n values' float16 scale (its largest magnitude over the code's, kv/formats.py's quantize), and its
  // codes through `place(c, code)` (int4: the code plus 8)
  const auto span_codes = [&](const float* x, int64_t n, auto&& place) {
    float amax = 0.f;
    for (int64_t c = 0; c < n; ++c) amax = std::max(amax, std::fabs(x[c]));
    const at::Half stored = std::max(static_cast<float>(at::Half(exact_div(amax, code_max))), 6.103515625e-05f);
    const float scale = static_cast<float>(stored);
    for (int64_t c = 0; c < n; ++c) {
      const float scaled = exact_div(x[c], scale);
      place(c, fp8 ? fp8_code(scaled) : int4 ? static_cast<uint8_t>(int4_code(scaled) + 8) : int8_code(scaled));
    }
    return stored;
  };
  AT_DISPATCH_FLOATING_TYPES_AND2(at::ScalarType::BFloat16, at::ScalarType::Half, k.scalar_type(),
                                  "quantized_cache_write_", [&] {
    const scalar_t* kx = k.data_ptr<scalar_t>();
    const scalar_t* vx = v.data_ptr<scalar_t>();
    // row t of head h as floats, less the head's center (keys)
    const auto load = [&](const scalar_t* x, const torch::Tensor& of, int64_t t, int64_t h, const float* less,
                          float* out) {
      const scalar_t* src = x + t * of.stride(0) + h * of.stride(1);
      for (int64_t c = 0; c < d; ++c) out[c] = static_cast<float>(src[c]) - (less == nullptr ? 0.f : less[c]);
    };
    at::parallel_for(0, heads, 1, [&](int64_t h0, int64_t h1) {
      std::vector<float> row(d), rows, amax(d), scales(d);
      std::vector<uint8_t> held(d), grown(d);
      for (int64_t h = h0; h < h1; ++h) {
        const float* ch = cx == nullptr ? nullptr : cx + h * d;
        for (int64_t t = 0; t < tokens; ++t) {  // values, and fp8 keys: a row each
          const int64_t b = slot[t] / bs, o = slot[t] % bs;
          load(vx, v, t, h, nullptr, row.data());
          for (int64_t first = 0; first < d; first += value_group) {
            uint8_t* dst = int4 ? vc + blocks.v_codes(h, b) + o * (d / 2)
                                : vc + blocks.v_codes(h, b) + (o / 4) * d * 4 + o % 4;
            vs[blocks.v_scales(h, b) + o * (d / value_group) + first / value_group] =
                span_codes(row.data() + first, value_group, [&](int64_t c, uint8_t code) {
                  if (!int4) {
                    dst[(first + c) * 4] = code;
                    return;
                  }
                  const int64_t dim = first + c;  // the even dim in the low nibble
                  dst[dim / 2] = static_cast<uint8_t>(dim % 2 ? (dst[dim / 2] & 15) | code << 4
                                                              : (dst[dim / 2] & 0xF0) | code);
                });
          }
          if (channels) continue;
          load(kx, k, t, h, ch, row.data());
          k_scales.data_ptr<at::Half>()[blocks.k_scales(h, b) + o] =
              span_codes(row.data(), d, [&](int64_t c, uint8_t code) { key_byte(h, b, o, c) = code; });
        }
        if (!channels) continue;
        uint8_t* scale_bytes = k_scales.data_ptr<uint8_t>();
        for (int64_t first = 0, last; first < tokens; first = last) {  // a block's run of tokens [first, last)
          const int64_t b = slot[first] / bs, first_offset = slot[first] % bs;
          last = first + 1;
          while (last < tokens && slot[last] / bs == b) ++last;
          uint8_t* block_scales = scale_bytes + blocks.k_scales(h, b);
          // a block written from offset 0 starts afresh, whatever scales its last holder left
          for (int64_t c = 0; c < d; ++c) held[c] = first_offset > 0 ? block_scales[c] : 0;
          std::fill(amax.begin(), amax.end(), 0.f);
          if (rows.size() < static_cast<size_t>((last - first) * d)) rows.resize((last - first) * d);
          for (int64_t t = first; t < last; ++t) {  // the run's keys as floats, centered, read once
            float* r = rows.data() + (t - first) * d;
            load(kx, k, t, h, ch, r);
            for (int64_t c = 0; c < d; ++c) amax[c] = std::max(amax[c], std::fabs(r[c]));
          }
          for (int64_t c = 0; c < d; ++c) {
            // a key within the held scale leaves it (the common case of a decode step): no logarithm needed
            const float wanted_scale = exact_div(amax[c], code_max);
            const uint8_t wanted =
                wanted_scale <= decode_channel_scale(held[c]) ? 0 : encode_channel_scale(wanted_scale);
            // a scale that grows at least doubles (8 steps), so that the roundings a key takes as its block fills
            // add up to less than one step of the final scale
            const uint8_t doubled = held[c] > 0 ? static_cast<uint8_t>(std::min(255, held[c] + 8)) : 0;
            grown[c] = wanted > held[c] ? std::max(wanted, doubled) : held[c];
            if (grown[c] > held[c] && held[c] > 0) {  // the block's earlier keys, at the grown scale
              const float ratio = exact_div(decode_channel_scale(held[c]), decode_channel_scale(grown[c]));
              for (int64_t o = 0; o < first_offset; ++o) set_key_code(h, b, o, c, key_code(h, b, o, c) * ratio);
            }
            block_scales[c] = grown[c];
            scales[c] = std::max(decode_channel_scale(grown[c]), 1e-30f);
          }
          for (int64_t t = first; t < last; ++t) {
            const float* r = rows.data() + (t - first) * d;
            const int64_t o = slot[t] % bs;
            for (int64_t c = 0; c < d; ++c) set_key_code(h, b, o, c, exact_div(r[c], scales[c]));
          }
        }
      }
    });
  });
}

