// The exact linear over 4- and 8-bit codes for bfloat16 activations, over vnni_linear.cpp's weight layout, on
// AVX512-BF16's vdpbf16ps (two bf16 products added into each of 16 float32 sums per instruction):
//   y[m, n] = sum_g scale[n, g] * (sum_{k in g} x[m, k] code[n, k]) + minimum[n, g] * xsum[m, g]
// x is multiplied as it is, unlike vnni_linear.cpp's int8 activations: the result is the dequantized layer's
// up to float32 rounding (the scales are the layout's float16 ones).
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
// converts its channel blocks' bytes to exact bf16 values into a panel (fill_panel), once for all rows, and its tiles
// then take one dot product per weight. At 32 rows (a decode batch) the int8 heads of SmolLM2 and Qwen2.5-0.5B ran
// 1.5x faster than on the nibbles and than dequantized tiles on oneDNN (5.5 / 26.7 ms against 8.5 / 40.7 and 7.4 /
// 39.1), within 1.03-1.12x of oneDNN's packed bf16 weights (5.3 / 23.8).
// GGUF's 5- and 6-bit codes (Q5_0 / Q5_1 / Q5_K, Q6_K) are held as bytes but span at most 128 values: less 64 if
// signed (stored plus 128), each is a 7-bit number, which the 0x43xx trick turns into one exact bf16 as it does a
// 4-bit code (kSevenBit): one dot product a weight at every row count, no panel. On Qwen2.5-0.5B's shapes against
// the nibbles / panel: Q5_0 4864 x 896 at 4 rows 0.22 against 0.28 ms, at 32 rows 0.86 against 0.98; Q6_K
// 896 x 4864 0.18 against 0.26, 0.89 against 1.08; even at 1 row.
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
  kBytePanel,    // 8-bit codes, converted once per call into a panel of exact bf16 pairs (many rows; fill_panel)
};

// The stored bytes of channel blocks cb .. cb + vectors over all K columns as exact bf16 pairs (0 .. 255 has 8
// significant bits, as many as bf16 holds): lane c of panel[v * K / 2 + k / 2] holds channel 16 (cb + v) + c's
// columns k and k + 1. A byte becomes a float by a convert, whose high half is then its bf16: ~10 instructions per
// chunk, once per call, where the nibble unpack is repeated for every 4 rows and doubles the dot products
void fill_panel(const Geometry& geo, const uint8_t* weights, int64_t cb, int64_t vectors, __m512i* panel) {
  const int64_t units = geo.k_dim / geo.unit(), chunks = geo.unit() / kByteColumns;
  const int64_t header = geo.header_bytes(), record = geo.record_bytes();
  const __m512i low_byte = _mm512_set1_epi32(0xFF);
  // word 2 i: the high half of lane i of the first source (column k's float), word 2 i + 1: of the second's
  alignas(64) int32_t high_halves[16];
  for (int i = 0; i < 16; i++) high_halves[i] = (2 * i + 1) | (32 + 2 * i + 1) << 16;
  const __m512i pick = _mm512_load_si512(high_halves);
  for (int64_t v = 0; v < vectors; v++)
    for (int64_t u = 0; u < units; u++) {
      const uint8_t* rec = weights + ((cb + v) * units + u) * record;
      __m512i* out = panel + v * (geo.k_dim / 2) + u * geo.unit() / 2;
      for (int64_t c = 0; c < chunks; c++) {
        const __m512i bytes = _mm512_loadu_si512(rec + header + c * kChunk);
        __m512i column[kByteColumns];
        for (int j = 0; j < kByteColumns; j++)
          column[j] = _mm512_castps_si512(
              _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(bytes, 8 * j), low_byte)));
        for (int q = 0; q < 2; q++)
          _mm512_store_si512(out + 2 * c + q, _mm512_permutex2var_epi16(column[2 * q], pick, column[2 * q + 1]));
      }
    }
}

// out[m0 .. m0 + kRows, channel blocks cb .. cb + kVectors) for one register tile, the arguments as Call holds them;
// panel: fill_panel's for blocks cb .. cb + kVectors. kSplit: the chains of dot products per row and block (a dot
// product waits several cycles on the previous one into the same sums: with few rows, one chain each would wait on
// latency)
template <Source kSource, int kRows, int kVectors, int kSplit>
void tile(const c10::BFloat16* x, const c10::BFloat16* x16, const float* xsum, const Geometry& geo, float excess,
          int64_t m0, int64_t cb, const uint8_t* weights, uint8_t seven_bit_low, const __m512i* panel, float unit,
          c10::BFloat16* out, int64_t n_dim, int64_t ahead) {
  constexpr bool kNibbles = kSource == Source::kNibbles, kPanel = kSource == Source::kBytePanel;
  constexpr int64_t kColumns = kNibbles ? kNibbleColumns : kByteColumns;
  constexpr int kPairs = kPanel || kSource == Source::kSevenBit ? 2 : 4;  // weight pair vectors per chunk
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
          if constexpr (kPanel) {
            for (int q = 0; q < kPairs; q++)
              w[v][q] = reinterpret_cast<__m512bh>(_mm512_load_si512(panel + v * (k_dim / 2) + k / 2 + q));
            continue;
          }
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
        // pair by pair, each pair's weights used by every row before the next pair's (each sum takes its pairs in
        // the same order either way): the panel's tiles then hold 2 weight vectors live, not 4
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

// registers: (kSplit + 1) x rows x vectors sums, pairs x vectors codes, constants. (6 and 8 rows for the panel's
// tiles, measured at 32-512 rows on int8 heads: no faster, 8 spills)
constexpr int64_t kMaxRows = 4;
// 8-bit codes from this many rows go through fill_panel. Nibbles / panel in ms (2-core Zen 4), int8 heads 49152 x 576
// and 151936 x 896, then layers in groups of 32 4864 x 896 and 1536 x 576: 4 rows 1.52 / 1.49, 6.4 / 9.2; 8 rows
// 2.36 / 2.21, 11.5 / 11.9, 0.34 / 0.28, 0.072 / 0.055; 16 rows 4.5 / 3.5, 21.3 / 16.5, 0.67 / 0.47, 0.14 / 0.09
constexpr int64_t kPanelMinRows = 8;

// What a call's tiles share
struct Call {
  const c10::BFloat16 *x, *x16;  // x16: x times 16, for 8-bit codes' high nibbles
  const float* xsum;             // [M, K / group]
  Geometry geo;
  float excess;  // what the sums hold beyond sum x code, per unit of x's group sum
  const uint8_t* weights;
  uint8_t seven_bit_low;  // kSevenBit: what is taken from each stored byte to bring it into 0 .. 127
  float unit;
  c10::BFloat16* out;
  int64_t n_dim;
};

template <Source kSource, int kRows>
void tile_any(const Call& a, int64_t m0, int64_t cb, int64_t vectors, const __m512i* panel, int64_t ahead) {
  constexpr int kSplit = kRows <= 2 ? 2 : 1;
  if (vectors == 2)
    tile<kSource, kRows, 2, kSplit>(a.x, a.x16, a.xsum, a.geo, a.excess, m0, cb, a.weights, a.seven_bit_low, panel,
                                    a.unit, a.out, a.n_dim, ahead);
  else
    tile<kSource, kRows, 1, kSplit>(a.x, a.x16, a.xsum, a.geo, a.excess, m0, cb, a.weights, a.seven_bit_low, panel,
                                    a.unit, a.out, a.n_dim, ahead);
}

template <Source kSource>
void tiles(const Call& a, int64_t m_dim, int64_t m0, int64_t cb, int64_t vectors, const __m512i* panel,
           int64_t ahead) {
  switch (std::min(kMaxRows, m_dim - m0)) {
    case 1: tile_any<kSource, 1>(a, m0, cb, vectors, panel, ahead); break;
    case 2: tile_any<kSource, 2>(a, m0, cb, vectors, panel, ahead); break;
    case 3: tile_any<kSource, 3>(a, m0, cb, vectors, panel, ahead); break;
    default: tile_any<kSource, 4>(a, m0, cb, vectors, panel, ahead); break;
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
  const Source source = weight.nibbles           ? Source::kNibbles
                        : weight.seven_bit       ? Source::kSevenBit
                        : m_dim >= kPanelMinRows ? Source::kBytePanel
                                                 : Source::kByteNibbles;
  // x times 16 for 8-bit codes' high nibbles (exact: a power of two), in a plain buffer: a torch op per call cost
  // more than the multiplies on decode's few rows
  std::vector<c10::BFloat16> x16(source == Source::kByteNibbles ? m_dim * k_dim : 0);
  for (size_t i = 0; i < x16.size(); i++) x16[i] = static_cast<float>(xp[i]) * 16.f;
  const std::vector<float> xsum = group_sums(xp, m_dim * (k_dim / group), group);  // the excess's and minimums' term
  const float signed_excess = weight.signed_codes ? 128.f : 0.f;
  const uint8_t seven_bit_low = weight.signed_codes ? 64 : 0;  // signed codes -64 .. 63 are stored as 64 .. 191
  const float excess = source == Source::kNibbles       ? 128.f
                       : source == Source::kByteNibbles ? 2176.f + signed_excess
                       : source == Source::kSevenBit    ? 128.f - seven_bit_low + signed_excess
                                                        : signed_excess;
  const Call call{xp, x16.empty() ? nullptr : x16.data(), xsum.data(), geo, excess, weight.packed.data_ptr<uint8_t>(),
                  seven_bit_low, static_cast<float>(weight.unit), out.data_ptr<c10::BFloat16>(), n_dim};
  // a thread takes two channel blocks and walks all the rows, as vnni_linear.cpp's linear()
  const int64_t channel_blocks = n_dim / kChannels, pairs = (channel_blocks + 1) / 2;
  // a panel of two blocks' K / 2 pair vectors for each thread, taken before the parallel loop (one region, one barrier
  // at its end: a decode step makes ~120 of these calls)
  const int64_t panel_vectors = source == Source::kBytePanel ? k_dim : 0;
  const int64_t row_tiles = (m_dim + kMaxRows - 1) / kMaxRows;
  // (not a std::vector: fill_panel writes every vector, zeroing them first would be a second pass)
  const std::unique_ptr<__m512i[]> panels(panel_vectors ? new __m512i[panel_vectors * omp_get_max_threads()] : nullptr);
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < pairs; p++) {
    const int64_t cb = 2 * p, vectors = std::min<int64_t>(2, channel_blocks - cb);
    __m512i* panel = panels.get() + panel_vectors * omp_get_thread_num();
    if (source == Source::kBytePanel) fill_panel(geo, call.weights, cb, vectors, panel);
    ridge_vnni::NextPairPrefetch next_pair(geo, call.weights, cb, channel_blocks, row_tiles);
    const int64_t ahead = next_pair.ahead();
    for (int64_t m0 = 0; m0 < m_dim; m0 += kMaxRows) {
      next_pair.before_tile();
      switch (source) {
        case Source::kNibbles: tiles<Source::kNibbles>(call, m_dim, m0, cb, vectors, nullptr, ahead); break;
        case Source::kByteNibbles: tiles<Source::kByteNibbles>(call, m_dim, m0, cb, vectors, nullptr, ahead); break;
        case Source::kSevenBit: tiles<Source::kSevenBit>(call, m_dim, m0, cb, vectors, nullptr, ahead); break;
        case Source::kBytePanel: tiles<Source::kBytePanel>(call, m_dim, m0, cb, vectors, panel, ahead); break;
      }
    }
  }
  return out;
#else
  TORCH_CHECK(false, "bf16_dot_linear: built without AVX512-BF16");
#endif
}
