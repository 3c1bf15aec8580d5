// The exact linear over 4- and 8-bit codes for bfloat16 activations, over vnni_linear.cpp's weight layout, on
// AVX512-BF16's vdpbf16ps (two bf16 products added into each of 16 float32 sums per instruction):
//   y[m, n] = sum_g scale[n, g] * (sum_{k in g} x[m, k] code[n, k]) + minimum[n, g] * xsum[m, g]
// x is multiplied as it is, unlike vnni_linear.cpp's int8 activations: the result is the dequantized layer's
// up to float32 rounding (the scales are the layout's float16 ones), except on a panel of grouped codes (below),
// where it is the layer dequantized to bf16, as a bf16 model's weights and the prompts' scratch hold it.
//
// Why it exists: at decode's few rows the exact kernels that widen each code to a float32 (torch's int4 one,
// quant_linear.cpp's grouped one) spend ~3 instructions per 16 weights (widen, convert, FMA) and ran the
// SmolLM2 stack's 4-bit layers at 12 GB/s, against the int8-activation kernel's 18 (2-core Zen 4, a third of the
// memory's rate and less): they are bound by instructions. Here a code becomes a bf16 by being the low byte of
// 0x43xx, whose value is 128 + code (bf16's 7 mantissa bits at exponent 7), so 64 code bytes turn into 64 bf16
// weights with 2 byte unpacks, and one vdpbf16ps multiplies 32 of them: ~12 instructions per 128 weights. The
// 128 taken once too many per code comes back through the group's sum of x: scale * (sum (128 + code) x - 128
// xsum) (exact products, float32 sums; the difference loses ~4 of float32's 24 bits, far inside bf16's 8).
//
// 8-bit codes do not fit 7 mantissa bits, but a byte u is two nibbles, u = 16 hi + lo: the same unpack gives both
// as 128 + nibble, lo multiplied by x and hi by 16 x (exact in bf16: a power of two), into the same sums, which
// then hold 2176 = 16 * 128 + 128 times x's sum too much (2304 for signed codes, stored plus 128; ~6 of float32's
// bits lost, still far inside bf16's). Twice the dot products per weight of 4-bit codes, at twice the bytes: the
// same arithmetic per byte streamed. Against the grouped kernel's float path (quant_linear.cpp), on the int8
// vocabulary projections streamed from memory (2-core Zen 4): 1.5x faster at 1 row on SmolLM2's, 1.9x on
// Qwen2.5-0.5B's (31-34 GB/s against 17-20), 1.3x at 4-8 rows, even at 16.
// With more rows, where the arithmetic binds, the doubled dot products cost: from kPanelMinRows rows a thread first
// converts its channel blocks' bytes to bf16 into a panel (PanelFill), once for all rows, and its tiles then take one
// dot product per weight, over all K in one run. Codes with one group a row stay exact codes there (the scale comes
// after); grouped ones are dequantized to bf16 (code * scale + minimum, rounded), so that the tiles do not scale and
// offset each group's sums, one multiply-add per sum and group: 6-12% of the dot products at 32-column groups, 12-25%
// at Q6_K's 16. Each pair of blocks' tiles fills the next pair's panel as they go, a chunk every few column pairs,
// where the converts and shuffles run beside the dot products rather than alone before them. On Qwen2.5-0.5B's shapes
// at 32 rows against oneDNN's packed bf16 weights (2-core Zen 4): int8 per channel 0.97-0.995x on 1152 x 896 and
// 9728 x 896, 1.07x on 896 x 4864; Q8_0-like 32-column groups 0.95-0.98x, 1.06-1.09x (the panel filled alone first,
// without the dequantization: 1.00-1.10x, in groups 1.09-1.21x; docs/notes/bench-quantization.md).
// GGUF's 5- and 6-bit codes (Q5_0 / Q5_1 / Q5_K, Q6_K) are held as bytes but span at most 128 values: less 64 if
// signed (stored plus 128), each is a 7-bit number, which the 0x43xx trick turns into one exact bf16 as it does a
// 4-bit code (kSevenBit): one dot product a weight, no panel below kSevenBitPanelMinRows rows. On Qwen2.5-0.5B's
// shapes against the nibbles / the first panel: Q5_0 4864 x 896 at 4 rows 0.22 against 0.28 ms; Q6_K 896 x 4864
// 0.18 against 0.26; even at 1 row. From 24 rows they too go onto the panel, Q6_K's 16-column groups most of all.
//
// Lanes: a chunk holds channel 4 L + i's codes at bytes 16 L + 4 i + (0..3) (vnni_linear.cpp's layout, 4-bit:
// columns k0..k0+3 in the low nibbles, k0+4..k0+7 in the high ones). One byte shuffle within each 128-bit lane
// moves channel 4 L + i's columns 0-1 to bytes 16 L + 2 i + (0, 1) and its columns 2-3 to 16 L + 8 + 2 i + (0, 1);
// then unpacking the low and the high 8 bytes of each lane puts channel c's columns (0, 1) and (2, 3) (low
// nibbles), (4, 5) and (6, 7) (high) into 32-bit lane c of four vectors, each multiplied by x's matching column
// pair, broadcast (8-bit codes: a chunk is columns k0..k0+3, the vectors their (0, 1) and (2, 3) low nibbles,
// then high ones, the high ones multiplied by 16 x). A lane is a channel: a group's sum is scaled and offset by
// one FMA each over 16 channels.
// (Reading the bytes unshuffled put two channels' halves in each vector and every channel in two lanes: two FMAs
// each per group on half-used lanes, and a pair sum at the end. The shuffle made SmolLM2's 30 layers' shapes
// 1.05-1.18x faster at 32-2048 rows, where the kernel is bound by arithmetic, and changed nothing at 1 row.)
#include <torch/extension.h>
#include <omp.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <vector>

#include "ops.h"
#include "vec.h"
#include "vnni_layout.h"

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define RIDGE_BF16_DOT 1
#endif

namespace {

using ridge_vnni::Geometry;
using ridge_vnni::kChannels;
using ridge_vnni::kByteColumns;
using ridge_vnni::kChunk;
using ridge_vnni::kNibbleColumns;

#if defined(RIDGE_BF16_DOT)

// Where a tile's bf16 weight pairs come from
enum class Source {
  kNibbles,      // 4-bit codes, each chunk unpacked as 128 + code
  kByteNibbles,  // 8-bit codes, each chunk unpacked as two nibbles (few rows)
  kSevenBit,     // 8-bit codes of at most 7 bits (VnniWeight::seven_bit), each chunk unpacked as 128 + code
};

// registers: (kSplit + 1) x rows x vectors sums, pairs x vectors codes, constants
constexpr int64_t kMaxRows = 4;
// 8-bit codes from this many rows go onto a panel. Nibbles / the first panel (filled alone) in ms (2-core Zen 4), int8
// heads 49152 x 576 and 151936 x 896, then layers in groups of 32 4864 x 896 and 1536 x 576: 4 rows 1.52 / 1.49,
// 6.4 / 9.2; 8 rows 2.36 / 2.21, 11.5 / 11.9, 0.34 / 0.28, 0.072 / 0.055; 16 rows 4.5 / 3.5, 21.3 / 16.5, 0.67 / 0.47,
// 0.14 / 0.09
constexpr int64_t kPanelMinRows = 8;
// 7-bit codes (kSevenBit) from this many rows: direct / panel on Qwen2.5-0.5B's Q5_0 and Q6_K-like shapes, 16 rows
// even, 24 rows 1.03-1.10x faster on the panel, 32 rows up to 1.2x (Q6_K)
constexpr int64_t kSevenBitPanelMinRows = 24;
// rows per panel tile (6 and 8 spilled or ran no faster, int8 heads at 32-512 rows, and with the fill in the loop)
constexpr int64_t kPanelRows = 4;

// x's column pairs for the panels' tiles, rows of a tile side by side: the pair k2 of row m0 + r of the tile at rows
// m0 .. m0 + kPanelRows - 1 at out[m0 * K / 2 + k2 * kPanelRows + r], so that a tile reads its rows from one pointer
// (with four row pointers beside the panels' and the fill's, gcc ran short of registers in the tile's loop and moved
// pointers through vector registers). Row tiles t_begin .. t_end, each a 4 x 16 transpose of pairs at a time; a last
// tile's missing rows repeat its last row, which the tile does not read
void pack_x_pairs(const c10::BFloat16* x, int64_t m_dim, int64_t k_dim, int64_t t_begin, int64_t t_end, int32_t* out) {
  static_assert(kPanelRows == 4, "a 4-row transpose");
  const int64_t pairs = k_dim / 2;  // in 16s: K is in 32s
  for (int64_t t = t_begin; t < t_end; t++) {
    const int32_t* row[4];
    for (int r = 0; r < 4; r++)
      row[r] = reinterpret_cast<const int32_t*>(x + std::min(t * 4 + r, m_dim - 1) * k_dim);
    int32_t* o = out + t * 4 * pairs;
    for (int64_t k2 = 0; k2 < pairs; k2 += 16) {
      __m512i v[4];
      for (int r = 0; r < 4; r++) v[r] = _mm512_loadu_si512(row[r] + k2);
      const __m512i lo01 = _mm512_unpacklo_epi32(v[0], v[1]), lo23 = _mm512_unpacklo_epi32(v[2], v[3]);
      const __m512i hi01 = _mm512_unpackhi_epi32(v[0], v[1]), hi23 = _mm512_unpackhi_epi32(v[2], v[3]);
      // c[j], 128-bit lane L: pair 4 L + j of rows 0-3
      const __m512i c[4] = {_mm512_unpacklo_epi64(lo01, lo23), _mm512_unpackhi_epi64(lo01, lo23),
                            _mm512_unpacklo_epi64(hi01, hi23), _mm512_unpackhi_epi64(hi01, hi23)};
      const __m512i c01_lo = _mm512_shuffle_i64x2(c[0], c[1], 0x44), c01_hi = _mm512_shuffle_i64x2(c[0], c[1], 0xEE);
      const __m512i c23_lo = _mm512_shuffle_i64x2(c[2], c[3], 0x44), c23_hi = _mm512_shuffle_i64x2(c[2], c[3], 0xEE);
      _mm512_storeu_si512(o + 4 * k2, _mm512_shuffle_i64x2(c01_lo, c23_lo, 0x88));       // pairs k2 .. k2 + 3
      _mm512_storeu_si512(o + 4 * k2 + 16, _mm512_shuffle_i64x2(c01_lo, c23_lo, 0xDD));  // k2 + 4 .. k2 + 7
      _mm512_storeu_si512(o + 4 * k2 + 32, _mm512_shuffle_i64x2(c01_hi, c23_hi, 0x88));
      _mm512_storeu_si512(o + 4 * k2 + 48, _mm512_shuffle_i64x2(c01_hi, c23_hi, 0xDD));
    }
  }
}

// What a panel (PanelFill) holds of a call's 8-bit codes
enum class PanelValues {
  kCodes,        // each stored byte as it is, exact (0 .. 255: 8 significant bits, as many as bf16 holds); the tile
                 // applies the scale, minimum and excess once at the end: weights with one group a row (per channel)
  kDequantized,  // code * scale + minimum rounded to bf16, the weight as a bf16 model (and the prompts' scratch) holds
                 // it: weights with groups along the row, whose per-group scaling the tile then does not repeat
};

// Fills a panel, chunk by chunk: channel blocks cb .. cb + vectors over all K columns as bf16 pairs, lane c of
// panel[v * K / 2 + k / 2] holding channel 16 (cb + v) + c's columns k and k + 1. A byte becomes a float by a
// convert, kDequantized then scales and offsets it, and cvtne2ps2bf16 rounds pairs of columns to bf16 (exactly for
// kCodes: 0 .. 255 has 8 significant bits, as many as bf16 holds). ~14 / ~18 instructions per chunk, once per call,
// where the nibble unpack is repeated for every 4 rows and doubles the dot products. (The high halves of the floats
// picked by vpermt2w, one instruction fewer for kCodes, ran 1.1-1.2x slower on Zen 4 than cvtne2ps2bf16 and vpermw)
template <PanelValues kPanelValues>
class PanelFill {
 public:
  static constexpr PanelValues kValues = kPanelValues;

  PanelFill(const Geometry& geo, const uint8_t* weights, int64_t cb, int64_t vectors, float excess, float unit,
            __m512i* panel)
      : rec_(weights + cb * (geo.k_dim / geo.unit()) * geo.record_bytes()),
        out_(panel),
        left_(vectors * geo.k_dim / kByteColumns),
        header_(geo.header_bytes()),
        record_(geo.record_bytes()),
        unit_chunks_(geo.unit() / kByteColumns),
        group_chunks_(geo.group / kByteColumns),
        minimums_at_(geo.minimums ? kChannels * 2 * (geo.unit() / geo.group) : -1),
        excess_(excess),
        unit_(unit) {}

  int64_t left() const { return left_; }

  // the next chunk (block by block, along K): its 64 codes into two pair vectors. The records of a thread's blocks lie
  // one after another, and so do the panel's pair vectors: both are walked by pointer
  __attribute__((always_inline)) inline void step() {
    // the state in locals, written back at the end: the panel's stores could otherwise alias the members, which the
    // compiler would then reload after each
    __m512i* out = out_;
    if (kValues == PanelValues::kDequantized && in_group_ == 0) {  // a group's first chunk: its values
      const uint8_t* values = rec_ + sub_ * kChannels * 2;
      const __m512 scale = _mm512_mul_ps(ridge_vnni::load_halves(values), _mm512_set1_ps(unit_));
      const __m512 minimum = minimums_at_ >= 0 ? _mm512_mul_ps(ridge_vnni::load_halves(values + minimums_at_),
                                                               _mm512_set1_ps(unit_))
                                               : _mm512_setzero_ps();
      scale_ = scale;
      offset_ = _mm512_fnmadd_ps(_mm512_set1_ps(excess_), scale, minimum);
    }
    const __m512 scale = scale_, offset = offset_;
    const __m512i bytes = _mm512_loadu_si512(rec_ + header_ + in_unit_ * kChunk);
    // cvtne2ps2bf16 puts column 2q's 16 lanes in words 0-15, 2q + 1's in 16-31: word 2 i of a pair vector takes i,
    // 2 i + 1 takes 16 + i
    const __m512i interleave = _mm512_set_epi32(0x1F000F, 0x1E000E, 0x1D000D, 0x1C000C, 0x1B000B, 0x1A000A, 0x190009,
                                                0x180008, 0x170007, 0x160006, 0x150005, 0x140004, 0x130003, 0x120002,
                                                0x110001, 0x100000);
    // byte j of a lane is column j; a pair of columns at a time, to take few registers from the tile this runs within
    for (int q = 0; q < 2; q++) {
      __m512 column[2];
      for (int h = 0; h < 2; h++) {
        column[h] = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(bytes, 8 * (2 * q + h)),
                                                        _mm512_set1_epi32(0xFF)));
        if constexpr (kValues == PanelValues::kDequantized) column[h] = _mm512_fmadd_ps(column[h], scale, offset);
      }
      const __m512bh rounded = _mm512_cvtne2ps_pbh(column[1], column[0]);
      _mm512_store_si512(out++, _mm512_permutexvar_epi16(interleave, reinterpret_cast<__m512i>(rounded)));
    }
    out_ = out;
    left_--;
    if (++in_group_ == group_chunks_) in_group_ = 0, sub_++;
    if (++in_unit_ == unit_chunks_) in_unit_ = 0, sub_ = 0, rec_ += record_;
  }

 private:
  const uint8_t* rec_;  // the record being read
  __m512i* out_;        // the next pair vector
  int64_t left_;        // chunks
  int64_t header_, record_, unit_chunks_, group_chunks_, minimums_at_;  // minimums_at_: -1 where none are held
  float excess_, unit_;
  int64_t in_unit_ = 0, in_group_ = 0, sub_ = 0;  // the record's chunk, the group's chunk, the group in the record
  __m512 scale_ = _mm512_setzero_ps(), offset_ = _mm512_setzero_ps();  // kDequantized: the current group's
};

// out[m0 .. m0 + kRows, channel blocks cb .. cb + kVectors) from a panel (PanelFill's for blocks cb ..): one pair of
// columns at a time over all K, one dot product a weight, then kCodes' scale, minimum and excess (one group a row)
template <class Fill, int kRows, int kVectors>
void panel_tile(const int32_t* x_pairs, const float* xsum, const Geometry& geo, float excess, int64_t m0, int64_t cb,
                const uint8_t* weights, const __m512i* panel, float unit, c10::BFloat16* out, int64_t n_dim,
                Fill* next, int64_t quota) {
  constexpr PanelValues kValues = Fill::kValues;
  // `quota` steps of the next pair's panel, one every `every` column pairs (a power of two), the rest after
  const int64_t k_dim = geo.k_dim;
  int64_t every = 1;
  while (quota > 0 && every * 2 * quota <= k_dim / 2) every *= 2;
  __m512 sums[kRows][kVectors];
  for (int r = 0; r < kRows; r++)
    for (int v = 0; v < kVectors; v++) sums[r][v] = _mm512_setzero_ps();
  for (int64_t k2 = 0; k2 < k_dim / 2; k2++) {
    __m512bh w[kVectors];
    for (int v = 0; v < kVectors; v++)
      w[v] = reinterpret_cast<__m512bh>(_mm512_load_si512(panel + v * (k_dim / 2) + k2));
    for (int r = 0; r < kRows; r++) {
      const __m512bh xq = reinterpret_cast<__m512bh>(_mm512_set1_epi32(x_pairs[k2 * kPanelRows + r]));
      for (int v = 0; v < kVectors; v++) sums[r][v] = _mm512_dpbf16_ps(sums[r][v], w[v], xq);
    }
    if (quota > 0 && (k2 & (every - 1)) == every - 1) next->step(), quota--;
  }
  for (; quota > 0; quota--) next->step();
  for (int v = 0; v < kVectors; v++) {
    __m512 scale = _mm512_set1_ps(1.f), offset = _mm512_setzero_ps();
    if constexpr (kValues == PanelValues::kCodes) {  // one record a block: its header holds the channels' values
      const uint8_t* rec = weights + (cb + v) * geo.record_bytes();
      scale = _mm512_mul_ps(ridge_vnni::load_halves(rec), _mm512_set1_ps(unit));
      const __m512 minimum = geo.minimums ? _mm512_mul_ps(ridge_vnni::load_halves(rec + kChannels * 2),
                                                          _mm512_set1_ps(unit))
                                          : _mm512_setzero_ps();
      offset = _mm512_fnmadd_ps(_mm512_set1_ps(excess), scale, minimum);
    }
    for (int r = 0; r < kRows; r++) {
      __m512 y = sums[r][v];
      if constexpr (kValues == PanelValues::kCodes)
        y = _mm512_fmadd_ps(offset, _mm512_set1_ps(xsum[m0 + r]), _mm512_mul_ps(y, scale));
      ridge_vec::store_bf16(out + (m0 + r) * n_dim + (cb + v) * kChannels, y);
    }
  }
}

// out[m0 .. m0 + kRows, channel blocks cb .. cb + kVectors) for one register tile, the arguments as Call holds them.
// kSplit: the chains of dot products per row and block (a dot product waits several cycles on the previous one into
// the same sums: with few rows, one chain each would wait on latency)
template <Source kSource, int kRows, int kVectors, int kSplit>
void tile(const c10::BFloat16* x, const c10::BFloat16* x16, const float* xsum, const Geometry& geo, float excess,
          int64_t m0, int64_t cb, const uint8_t* weights, uint8_t seven_bit_low, float unit, c10::BFloat16* out,
          int64_t n_dim, int64_t ahead) {
  constexpr bool kNibbles = kSource == Source::kNibbles;
  constexpr int64_t kColumns = kNibbles ? kNibbleColumns : kByteColumns;
  constexpr int kPairs = kSource == Source::kSevenBit ? 2 : 4;  // weight pair vectors per chunk
  const __m512i low = _mm512_set1_epi8(static_cast<char>(seven_bit_low));
  // a record per unit of max(group, 32) columns: one group, or two of Q6_K's 16-column ones (8-bit codes)
  const int64_t k_dim = geo.k_dim, group = geo.group, groups = k_dim / group, chunks = group / kColumns;
  // (4-bit codes: one group a record, known here, so that the loop over a record's groups compiles away)
  const int64_t units = k_dim / geo.unit(), unit_groups = kNibbles ? 1 : geo.unit() / group;
  const int64_t header = geo.header_bytes(), record = geo.record_bytes(), minimums_at = kChannels * 2 * unit_groups;
  const uint16_t* xr[kRows];
  const uint16_t* xr16[kRows];
  for (int r = 0; r < kRows; r++) {
    xr[r] = reinterpret_cast<const uint16_t*>(x) + (m0 + r) * k_dim;
    xr16[r] = kSource != Source::kByteNibbles ? nullptr : reinterpret_cast<const uint16_t*>(x16) + (m0 + r) * k_dim;
  }
  // the 2 bf16 activations vector q of a chunk at column k multiplies, broadcast to every 32-bit lane
  const auto pair = [&](int r, int64_t k, int q) {
    const uint16_t* at =
        kSource != Source::kByteNibbles ? xr[r] + k + 2 * q : (q < 2 ? xr[r] : xr16[r]) + k + 2 * (q % 2);
    int32_t word;
    std::memcpy(&word, at, sizeof(word));
    return reinterpret_cast<__m512bh>(_mm512_set1_epi32(word));
  };
  __m512 total[kRows][kVectors];
  for (int r = 0; r < kRows; r++)
    for (int v = 0; v < kVectors; v++) total[r][v] = _mm512_setzero_ps();
  for (int64_t u = 0; u < units; u++)
    for (int64_t sub = 0; sub < unit_groups; sub++) {
      const int64_t g = u * unit_groups + sub, s_at = sub * kChannels * 2;  // the group, its values in the header
      const uint8_t* rec[kVectors];
      for (int v = 0; v < kVectors; v++) {
        rec[v] = weights + ((cb + v) * units + u) * record;
        if (sub == 0) ridge_vnni::prefetch_ahead(rec[v], ahead, header);
      }
      __m512 part[kSplit][kRows][kVectors];
      for (int s = 0; s < kSplit; s++)
        for (int r = 0; r < kRows; r++)
          for (int v = 0; v < kVectors; v++) part[s][r][v] = _mm512_setzero_ps();
      for (int64_t c = 0; c < chunks; c++) {
        const int64_t k = g * group + c * kColumns;
        __m512bh w[kVectors][kPairs];  // every channel's columns 0-1, 2-3 (, 4-5, 6-7)
        for (int v = 0; v < kVectors; v++) {
          const uint8_t* chunk = rec[v] + header + (sub * chunks + c) * kChunk;
          _mm_prefetch(reinterpret_cast<const char*>(chunk + 8 * kChunk), _MM_HINT_T0);
          ridge_vnni::prefetch_ahead(chunk, ahead);
          if constexpr (kSource == Source::kSevenBit) {
            __m512i codes[2];
            ridge_vnni::unpack_bf16_seven_bit(chunk, low, codes);
            for (int q = 0; q < 2; q++) w[v][q] = reinterpret_cast<__m512bh>(codes[q]);
            continue;
          }
          __m512i codes[4];
          ridge_vnni::unpack_bf16_pairs(chunk, codes);
          for (int q = 0; q < 4; q++) w[v][q] = reinterpret_cast<__m512bh>(codes[q]);
        }
        for (int q = 0; q < kPairs; q++)
          for (int r = 0; r < kRows; r++) {
            const __m512bh xq = pair(r, k, q);
            for (int v = 0; v < kVectors; v++) {
              __m512& sums = part[q % kSplit][r][v];
              sums = _mm512_dpbf16_ps(sums, w[v][q], xq);
            }
          }
      }
      for (int v = 0; v < kVectors; v++) {
        const __m512 scale = ridge_vnni::load_halves(rec[v] + s_at);
        const __m512 minimum =
            geo.minimums ? ridge_vnni::load_halves(rec[v] + minimums_at + s_at) : _mm512_setzero_ps();
        const __m512 offset = _mm512_fnmadd_ps(_mm512_set1_ps(excess), scale, minimum);
        for (int r = 0; r < kRows; r++) {
          __m512 sums = part[0][r][v];
          for (int s = 1; s < kSplit; s++) sums = _mm512_add_ps(sums, part[s][r][v]);
          const __m512 xs = _mm512_set1_ps(xsum[(m0 + r) * groups + g]);
          total[r][v] = _mm512_fmadd_ps(offset, xs, _mm512_fmadd_ps(sums, scale, total[r][v]));
        }
      }
    }
  for (int r = 0; r < kRows; r++)
    for (int v = 0; v < kVectors; v++)
      ridge_vec::store_bf16(out + (m0 + r) * n_dim + (cb + v) * kChannels,
                            _mm512_mul_ps(total[r][v], _mm512_set1_ps(unit)));
}

// group_sums (vec.h) for bf16 values in groups of 16s, 16 at a time, not one float add after another (a decode
// batch's 32 rows of Qwen2.5-0.5B's 4864 columns are 155k values a call)
std::vector<float> bf16_group_sums(const c10::BFloat16* x, int64_t count, int64_t group) {
  std::vector<float> sums(count);
  for (int64_t i = 0; i < count; i++) {
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < group; j += 16) sum = _mm512_add_ps(sum, ridge_vec::load_bf16(x + i * group + j));
    sums[i] = _mm512_reduce_add_ps(sum);
  }
  return sums;
}


// What a call's tiles share
struct Call {
  const c10::BFloat16 *x, *x16;  // x16: x times 16, for 8-bit codes' high nibbles
  const float* xsum;             // [M, K / group]
  const int32_t* x_pairs;        // panels: x as pack_x_pairs lays it out
  Geometry geo;
  float excess;  // what the sums hold beyond sum x code, per unit of x's group sum
  const uint8_t* weights;
  uint8_t seven_bit_low;  // kSevenBit: what is taken from each stored byte to bring it into 0 .. 127
  float unit;
  c10::BFloat16* out;
  int64_t n_dim;
};

template <Source kSource, int kRows>
void tile_any(const Call& a, int64_t m0, int64_t cb, int64_t vectors, int64_t ahead) {
  constexpr int kSplit = kRows <= 2 ? 2 : 1;
  if (vectors == 2)
    tile<kSource, kRows, 2, kSplit>(a.x, a.x16, a.xsum, a.geo, a.excess, m0, cb, a.weights, a.seven_bit_low, a.unit,
                                    a.out, a.n_dim, ahead);
  else
    tile<kSource, kRows, 1, kSplit>(a.x, a.x16, a.xsum, a.geo, a.excess, m0, cb, a.weights, a.seven_bit_low, a.unit,
                                    a.out, a.n_dim, ahead);
}

template <Source kSource>
void tiles(const Call& a, int64_t m_dim, int64_t m0, int64_t cb, int64_t vectors, int64_t ahead) {
  switch (std::min(kMaxRows, m_dim - m0)) {
    case 1: tile_any<kSource, 1>(a, m0, cb, vectors, ahead); break;
    case 2: tile_any<kSource, 2>(a, m0, cb, vectors, ahead); break;
    case 3: tile_any<kSource, 3>(a, m0, cb, vectors, ahead); break;
    default: tile_any<kSource, 4>(a, m0, cb, vectors, ahead); break;
  }
}

template <class Fill, int kRows>
void panel_tile_any(const Call& a, int64_t m0, int64_t cb, int64_t vectors, const __m512i* panel, Fill* next,
                    int64_t quota) {
  const int32_t* x_pairs = a.x_pairs + m0 * (a.geo.k_dim / 2);
  if (vectors == 2)
    panel_tile<Fill, kRows, 2>(x_pairs, a.xsum, a.geo, a.excess, m0, cb, a.weights, panel, a.unit, a.out, a.n_dim, next,
                               quota);
  else
    panel_tile<Fill, kRows, 1>(x_pairs, a.xsum, a.geo, a.excess, m0, cb, a.weights, panel, a.unit, a.out, a.n_dim, next,
                               quota);
}

// A thread's channel-block pairs begin .. end on panels: each pair's tiles fill the next pair's panel as they go (a
// second panel), so that the fill's converts and shuffles run beside the dot products rather than alone before them
template <class Fill>
void panel_pairs(const Call& a, int64_t m_dim, int64_t begin, int64_t end, int64_t channel_blocks, float excess,
                 __m512i* panels) {
  const int64_t panel_vectors = a.geo.k_dim, row_tiles = (m_dim + kPanelRows - 1) / kPanelRows;
  // the panel of pair p (a thread's pairs alternate between its two), none past `end`
  const auto fill_for = [&](int64_t p) {
    const int64_t cb = 2 * p, vectors = p < end ? std::min<int64_t>(2, channel_blocks - cb) : 0;
    return Fill(a.geo, a.weights, cb, vectors, excess, a.unit, panels + (p - begin) % 2 * panel_vectors);
  };
  Fill first = fill_for(begin);
  while (first.left()) first.step();
  for (int64_t p = begin; p < end; p++) {
    const int64_t cb = 2 * p, vectors = std::min<int64_t>(2, channel_blocks - cb);
    const __m512i* panel = panels + (p - begin) % 2 * panel_vectors;
    Fill next = fill_for(p + 1);
    ridge_vnni::NextPairPrefetch next_pair(a.geo, a.weights, cb, channel_blocks, row_tiles);
    for (int64_t m0 = 0, tile = 0; m0 < m_dim; m0 += kPanelRows, tile++) {
      next_pair.before_tile();
      const int64_t quota = (next.left() + row_tiles - tile - 1) / (row_tiles - tile);
      switch (std::min(kPanelRows, m_dim - m0)) {
        case 1: panel_tile_any<Fill, 1>(a, m0, cb, vectors, panel, &next, quota); break;
        case 2: panel_tile_any<Fill, 2>(a, m0, cb, vectors, panel, &next, quota); break;
        case 3: panel_tile_any<Fill, 3>(a, m0, cb, vectors, panel, &next, quota); break;
        default: panel_tile_any<Fill, kPanelRows>(a, m0, cb, vectors, panel, &next, quota); break;
      }
    }
  }
}

#endif  // RIDGE_BF16_DOT

}  // namespace

bool bf16_dot_available() {
#if defined(RIDGE_BF16_DOT)
  return true;
#else
  return false;
#endif
}

torch::Tensor bf16_dot_linear(torch::Tensor x, const VnniWeight& weight) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16, "x: bfloat16 [M, K]");
  const int64_t m_dim = x.size(0), k_dim = x.size(1), group = weight.group;
  const Geometry geo = ridge_vnni::geometry(weight, k_dim);
  const int64_t n_dim = weight.packed.size(0) * kChannels;
#if defined(RIDGE_BF16_DOT)
  const torch::Tensor xc = x.contiguous();
  torch::Tensor out = torch::empty({m_dim, n_dim}, xc.options());
  const c10::BFloat16* xp = xc.data_ptr<c10::BFloat16>();
  // 8-bit codes from kPanelMinRows rows on a panel, 7-bit ones from kSevenBitPanelMinRows
  const bool on_panel = !weight.nibbles && m_dim >= (weight.seven_bit ? kSevenBitPanelMinRows : kPanelMinRows);
  const Source source = weight.nibbles     ? Source::kNibbles
                        : weight.seven_bit ? Source::kSevenBit
                                           : Source::kByteNibbles;
  const PanelValues values = group == k_dim ? PanelValues::kCodes : PanelValues::kDequantized;
  // x times 16 for 8-bit codes' high nibbles (exact: a power of two), in a plain buffer: a torch op per call cost
  // more than the multiplies on decode's few rows
  std::vector<c10::BFloat16> x16(!on_panel && source == Source::kByteNibbles ? m_dim * k_dim : 0);
  for (size_t i = 0; i < x16.size(); i++) x16[i] = static_cast<float>(xp[i]) * 16.f;
  // the excess's and minimums' term (none for a dequantized panel)
  const std::vector<float> xsum = on_panel && values == PanelValues::kDequantized
                                      ? std::vector<float>()
                                      : bf16_group_sums(xp, m_dim * (k_dim / group), group);
  const float signed_excess = weight.signed_codes ? 128.f : 0.f;
  const uint8_t seven_bit_low = weight.signed_codes ? 64 : 0;  // signed codes -64 .. 63 are stored as 64 .. 191
  const float excess = on_panel                         ? signed_excess
                       : source == Source::kNibbles     ? 128.f
                       : source == Source::kByteNibbles ? 2176.f + signed_excess
                                                        : 128.f - seven_bit_low + signed_excess;
  // (not a std::vector: pack_x_pairs writes every word)
  const int64_t x_pair_words = (m_dim + kPanelRows - 1) / kPanelRows * kPanelRows * (k_dim / 2);
  const std::unique_ptr<int32_t[]> x_pairs(on_panel ? new int32_t[x_pair_words] : nullptr);
  const Call call{xp, x16.empty() ? nullptr : x16.data(), xsum.data(), x_pairs.get(), geo, excess,
                  weight.packed.data_ptr<uint8_t>(), seven_bit_low, static_cast<float>(weight.unit),
                  out.data_ptr<c10::BFloat16>(), n_dim};
  // a thread takes two channel blocks and walks all the rows, as vnni_linear.cpp's linear()
  const int64_t channel_blocks = n_dim / kChannels, pairs = (channel_blocks + 1) / 2;
  if (on_panel) {
    // two panels of two blocks' K / 2 pair vectors for each thread, taken before the parallel region (one region,
    // one barrier at its end: a decode step makes ~120 of these calls). Not a std::vector: the fills write every
    // vector, zeroing them first would be a second pass
    const std::unique_ptr<__m512i[]> panels(new __m512i[2 * k_dim * omp_get_max_threads()]);
#pragma omp parallel
    {
      // a thread's pairs in one run, as schedule(static) would hand them out: each panel fills the next
      const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
      const int64_t row_tiles = (m_dim + kPanelRows - 1) / kPanelRows;
      pack_x_pairs(xp, m_dim, k_dim, row_tiles * t / threads, row_tiles * (t + 1) / threads, x_pairs.get());
#pragma omp barrier
      const int64_t begin = pairs * t / threads, end = pairs * (t + 1) / threads;
      __m512i* own = panels.get() + 2 * k_dim * t;
      if (values == PanelValues::kCodes)
        panel_pairs<PanelFill<PanelValues::kCodes>>(call, m_dim, begin, end, channel_blocks, signed_excess, own);
      else
        panel_pairs<PanelFill<PanelValues::kDequantized>>(call, m_dim, begin, end, channel_blocks, signed_excess, own);
    }
    return out;
  }
  const int64_t row_tiles = (m_dim + kMaxRows - 1) / kMaxRows;
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < pairs; p++) {
    const int64_t cb = 2 * p, vectors = std::min<int64_t>(2, channel_blocks - cb);
    ridge_vnni::NextPairPrefetch next_pair(geo, call.weights, cb, channel_blocks, row_tiles);
    const int64_t ahead = next_pair.ahead();
    for (int64_t m0 = 0; m0 < m_dim; m0 += kMaxRows) {
      next_pair.before_tile();
      if (source == Source::kNibbles)
        tiles<Source::kNibbles>(call, m_dim, m0, cb, vectors, ahead);
      else if (source == Source::kByteNibbles)
        tiles<Source::kByteNibbles>(call, m_dim, m0, cb, vectors, ahead);
      else
        tiles<Source::kSevenBit>(call, m_dim, m0, cb, vectors, ahead);
    }
  }
  return out;
#else
  TORCH_CHECK(false, "bf16_dot_linear: built without AVX512-BF16");
#endif
}
