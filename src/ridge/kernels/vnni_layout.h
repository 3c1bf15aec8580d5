// The sizes of vnni_linear.cpp's weight layout (linear/layouts.py's pack_vnni, described in vnni_linear.cpp), shared
// by the kernels that read it: vnni_linear.cpp (int8 activations) and bf16_dot_linear.cpp (exact, bf16).
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cstdint>

#include "vec.h"

#include "ops.h"

namespace ridge_vnni {

constexpr int64_t kBlock = 32;     // activation values per int8 scale; the fewest columns a record spans
constexpr int64_t kChannels = 16;  // output channels per layout block (a vector of 16 float sums)
constexpr int64_t kChunk = 64;     // bytes per chunk of codes
constexpr int64_t kNibbleColumns = 8;  // input columns per chunk of 4-bit codes (16 channels x 8 x 4 bits)
constexpr int64_t kByteColumns = 4;    // input columns per chunk of 8-bit codes (16 channels x 4 bytes)

struct Geometry {
  bool nibbles, minimums;
  int64_t k_dim, group;
  int64_t unit() const { return std::max(group, kBlock); }  // columns per record
  int64_t sub_block() const { return std::min(group, kBlock); }  // columns per scale step
  int64_t header_bytes() const {
    const int64_t values = kChannels * (unit() / group) * (minimums ? 2 : 1);
    return (values * 2 + kChunk - 1) / kChunk * kChunk;
  }
  int64_t record_bytes() const { return header_bytes() + unit() * kChannels / (nibbles ? 2 : 1); }
};

// The geometry of `weight` for inputs of k_dim columns, its tensor checked against it
inline Geometry geometry(const VnniWeight& weight, int64_t k_dim) {
  const int64_t group = weight.group;
  TORCH_CHECK(k_dim % kBlock == 0 && (group == 16 || group % kBlock == 0) && k_dim % group == 0,
              "K: a multiple of 32; group: 16, or a multiple of 32 dividing K");
  TORCH_CHECK(!(weight.nibbles && (group == 16 || weight.signed_codes)), "4-bit codes: unsigned, in groups of 32s");
  TORCH_CHECK(!(weight.nibbles && weight.seven_bit), "seven_bit: 8-bit codes of at most 7 bits, not 4-bit ones");
  const Geometry geo{weight.nibbles, weight.minimums, k_dim, group};
  const torch::Tensor& packed = weight.packed;
  TORCH_CHECK(packed.scalar_type() == torch::kByte && packed.is_contiguous() && packed.dim() == 3 &&
                  packed.size(1) == k_dim / geo.unit() && packed.size(2) == geo.record_bytes(),
              "packed: contiguous uint8 [N / 16, K / max(group, 32), record bytes] (linear/layouts.py's pack_vnni)");
  return geo;
}

// The bytes of the channel-block pair after the one at cb, into L2, while a thread works on this pair. A kernel's
// thread walks its pairs in order:
// - over several row tiles, a slice before each tile (before_tile): the first tile (or bf16_dot_linear.cpp's panel
//   fill) waited on memory with the arithmetic idle, and the later ones ran from cache with the memory idle
//   (Qwen2.5-0.5B at 32 rows, 2-core Zen 4: its int8 head 27.6-29.4 -> 24.6-25.2 ms, Q8_0 31.2-31.8 -> 27.8-28.5
//   ms, the layers 2-15% faster; docs/notes/bench-quantization.md);
// - in one row tile (decode's few rows), along the tile: each line it reads is prefetched `ahead()` bytes on, the
//   same line of the next pair. The tile reads its two blocks' records side by side, two streams a few kB long
//   each, and the hardware's prefetcher did not keep up with them: a scratch loop of plain loads over that pattern
//   read 10 GB/s on one core against 25 over one stream, 22 with these prefetches (into L2: a prefetch into L1 holds
//   one of the core's few L1 miss buffers until its line comes, and read 14). The layers of SmolLM2's int4
//   stack went from 4.0-4.7 to 3.1-3.2 ms a step (docs/notes/bench-quantization.md).
class NextPairPrefetch {
 public:
  NextPairPrefetch(const Geometry& geo, const uint8_t* weights, int64_t cb, int64_t channel_blocks, int64_t row_tiles) {
    const int64_t block_bytes = geo.record_bytes() * (geo.k_dim / geo.unit());
    const int64_t next_blocks = std::clamp<int64_t>(channel_blocks - cb - 2, 0, 2);
    next_ = weights + (cb + 2) * block_bytes;
    if (row_tiles > 1) {
      lines_ = next_blocks * block_bytes / kChunk;
      per_tile_ = (lines_ + row_tiles - 1) / row_tiles;
    } else if (next_blocks == 2) {  // (a lone last block: no pair after it to read ahead into)
      ahead_ = 2 * block_bytes;
    }
  }
  void before_tile() {
    for (const int64_t end = std::min(lines_, line_ + per_tile_); line_ < end; line_++)
      __builtin_prefetch(next_ + kChunk * line_, 0, 2);  // a read, into L2 (x86: prefetcht1)
  }
  // what a one-row-tile call adds to the address of each line it reads (0: nothing to prefetch)
  int64_t ahead() const { return ahead_; }

 private:
  const uint8_t* next_;
  int64_t lines_ = 0, per_tile_ = 0, line_ = 0, ahead_ = 0;
};

// The line `ahead` bytes past p into L2 (NextPairPrefetch::ahead), the lines of a record's header from its start
inline void prefetch_ahead(const uint8_t* p, int64_t ahead, int64_t bytes = kChunk) {
  if (ahead)
    for (int64_t at = 0; at < bytes; at += kChunk) __builtin_prefetch(p + ahead + at, 0, 2);
}

#if defined(__AVX512F__)
// 16 float16 values from p (a record's header), as floats
inline __m512 load_halves(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
#endif

#if defined(__AVX512BW__)
// A chunk's 64 bytes with channel 4 L + i's (bytes 16 L + 4 i + (0..3)) first two moved to bytes 16 L + 2 i + (0, 1)
// and its last two to 16 L + 8 + 2 i + (0, 1): unpacking the low and the high 8 bytes of each 128-bit lane then puts
// a channel's bytes into one 32-bit lane (bf16_dot_linear.cpp's lanes)
inline __m512i load_columns_apart(const uint8_t* chunk) {
  const __m512i columns_apart = _mm512_broadcast_i32x4(
      _mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15));
  return _mm512_shuffle_epi8(_mm512_loadu_si512(chunk), columns_apart);
}

// A 4-bit chunk's 128 codes as bf16 values 128 + code (bf16_dot_linear.cpp says why and how), in four vectors:
// 32-bit lane c of out[q] holds channel c's columns k0 + 2q and k0 + 2q + 1. An 8-bit chunk's 64 codes the same way,
// as nibbles: out[q] holds the low nibbles of columns k0 + 2q and k0 + 2q + 1 for q < 2, their high ones at q + 2
inline void unpack_bf16_pairs(const uint8_t* chunk, __m512i out[4]) {
  const __m512i low_nibbles = _mm512_set1_epi8(0x0F), magic = _mm512_set1_epi8(0x43);
  const __m512i bytes = load_columns_apart(chunk);
  const __m512i lo = _mm512_and_si512(bytes, low_nibbles);
  const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low_nibbles);
  out[0] = _mm512_unpacklo_epi8(lo, magic);
  out[1] = _mm512_unpackhi_epi8(lo, magic);
  out[2] = _mm512_unpacklo_epi8(hi, magic);
  out[3] = _mm512_unpackhi_epi8(hi, magic);
}

// An 8-bit chunk's 64 codes of at most 7 bits (stored bytes less `low`, 0 or 64, in 0 .. 127) as bf16 values
// 128 + byte - low, with the same shuffle: out[0] holds columns k0 and k0 + 1, out[1] k0 + 2 and k0 + 3
inline void unpack_bf16_seven_bit(const uint8_t* chunk, const __m512i& low, __m512i out[2]) {
  const __m512i magic = _mm512_set1_epi8(0x43);
  const __m512i bytes = _mm512_sub_epi8(load_columns_apart(chunk), low);
  out[0] = _mm512_unpacklo_epi8(bytes, magic);
  out[1] = _mm512_unpackhi_epi8(bytes, magic);
}
#endif

}  // namespace ridge_vnni
