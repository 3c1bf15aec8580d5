// The grouped weight-only linear with int8 activations (int8_dot_linear.cpp's arithmetic) as a matrix-matrix
// kernel for AVX512-VNNI: one vpdpbusd multiplies 64 code bytes by 64 activation bytes and adds them into 16
// int32 sums, twice the multiply-adds of a bf16 dot product (vdpbf16ps) per instruction and 4x those of a
// float FMA. At 32 rows a decode step is bound by arithmetic here, not by memory (bf16 matmul at 32 rows ran at
// ~330 GFLOP/s on a 2-core Zen 4), so a kernel that dequantizes to floats can at best tie with bf16; integer
// products are the only way for 4-bit weights to stay ahead once a batch fills the arithmetic units.
//
// Layout (linear/layouts.py's pack_vnni), llama.cpp's idea of a block that carries its own scales: output
// channels in blocks of 16, each a run of records, one per unit of max(group, 32) columns. A record is
//   a header: the unit's 16-channel scales as float16 (two groups' for 16-column groups), then as many
//     minimums where the weight has them, zero-padded to 64 bytes;
//   the unit's codes in chunks of 64 bytes: byte 4 n + j of a chunk is channel n's code at k0 + j, and for
//     4-bit codes its high nibble the code at k0 + 4 + j (a chunk then covers 8 columns, else 4).
// So a block's weights stream from one address upwards. Codes are unsigned bytes (vpdpbusd's unsigned
// operand); signed int8 codes are stored plus 128, and each sub-block's sum of the activations times 128
// starts its integer sum negative to take the offset back. The scales and minimums were multiplied by a
// power of two (`unit` is its inverse) that puts the largest at float16's top octave, so that none is
// subnormal; dx and the float sums carry `unit` back, at no cost in the loop. float16 keeps 11 bits of a
// scale: GGUF's Q4_0 / Q4_1 / Q8_0 / Q5_0 scales are float16 already; Q4_K's d * sc move by up to 2^-12 of
// themselves, well inside the int8 activations' own error.
//
//   x[m, 32 b .. 32 b + 32) ~ dx[m, b] * qx[m, ..],   qx in [-127, 127]   (as int8_dot_linear.cpp)
//   y[m, n] = sum_s scale[n, g(s)] * dx[m, b(s)] * (sum_{k in s} qx[m, k] code[n, k])
//             + sum_g minimum[n, g] * xsum[m, g]          (xsum: the float sum of x over group g)
// over sub-blocks s of min(group, 32) columns: a 32-value block, or half of one for 16-column groups (Q6_K).
//
// The register tile is kRows activation rows (4) x kVectors channel blocks (2): each code chunk is loaded and
// split into nibbles once for kRows rows, each row's activation quad broadcast once for the kVectors blocks.
#include <torch/extension.h>
#include <omp.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "ops.h"
#include "vec.h"
#include "vnni_layout.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define RIDGE_VNNI 1
#endif

namespace {

using ridge_vnni::Geometry;
using ridge_vnni::kBlock;
using ridge_vnni::kChannels;
using ridge_vnni::kChunk;
#if defined(RIDGE_VNNI)

using ridge_vnni::load_halves;

// x quantized per row and 32-value block, with what the sums need beside the codes
struct QuantizedRows {
  std::vector<int8_t> q;     // [M, K]
  std::vector<float> scale;  // dx [M, K / 32]
  std::vector<int32_t> sum;  // [M, K / 16]: sum of q over each half block (signed codes' offset)
  std::vector<float> group_sum;  // [M, K / group]: float sum of x over the group (minimums' term), or empty
};

template <typename T>
inline __m512 load16(const T* p) {
  if constexpr (std::is_same_v<T, float>) return _mm512_loadu_ps(p);
  else return ridge_vec::load_bf16(p);
}

// dx and the group sums in `unit`s of the stored scales and minimums
template <typename T>
QuantizedRows quantize_rows(const T* x, int64_t m_dim, int64_t k_dim, int64_t group, bool with_group_sums,
                            float unit) {
  const int64_t blocks = k_dim / kBlock;
  QuantizedRows rows{std::vector<int8_t>(m_dim * k_dim), std::vector<float>(m_dim * blocks),
                     std::vector<int32_t>(2 * m_dim * blocks), {}};
#pragma omp parallel for schedule(static) if (m_dim * blocks >= 1024)
  for (int64_t i = 0; i < m_dim * blocks; i++) {
    const __m512 lo = load16(x + i * kBlock), hi = load16(x + i * kBlock + kBlock / 2);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    rows.scale[i] = amax / 127.f * unit;
    const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, inv)), qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, inv));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(&rows.q[i * kBlock]), _mm512_cvtepi32_epi8(qlo));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(&rows.q[i * kBlock + kBlock / 2]), _mm512_cvtepi32_epi8(qhi));
    rows.sum[2 * i] = _mm512_reduce_add_epi32(qlo);
    rows.sum[2 * i + 1] = _mm512_reduce_add_epi32(qhi);
  }
  if (with_group_sums) {  // in order, as the exact kernel adds them
    rows.group_sum = group_sums(x, m_dim * (k_dim / group), group);
    for (float& sum : rows.group_sum) sum *= unit;
  }
  return rows;
}

// out[m0 .. m0 + kRows, 16 channel blocks cb .. cb + kVectors) for one register tile
template <bool kNibbles, bool kSigned, int kRows, int kVectors, typename T>
void tile(const QuantizedRows& x, const Geometry& geo, int64_t m0, int64_t cb, const uint8_t* weights, T* out,
          int64_t n_dim, int64_t ahead) {
  const int64_t k_dim = geo.k_dim, blocks = k_dim / kBlock, groups = k_dim / geo.group;
  const int64_t unit = geo.unit(), units = k_dim / unit, sub = geo.sub_block(), subs = unit / sub;
  const int64_t chunks = sub / (kNibbles ? 8 : 4);  // per sub-block
  const int64_t header = geo.header_bytes(), record = geo.record_bytes();
  const int64_t unit_groups = unit / geo.group, minimums_at = kChannels * 2 * unit_groups;
  const __m512i low_nibbles = _mm512_set1_epi8(0x0F);
  const int8_t* q[kRows];
  for (int r = 0; r < kRows; r++) q[r] = x.q.data() + (m0 + r) * k_dim;
  const auto quad = [&](int r, int64_t k) {  // 4 activation bytes broadcast to every lane
    int32_t word;
    std::memcpy(&word, q[r] + k, sizeof(word));
    return _mm512_set1_epi32(word);
  };
  __m512 total[kRows][kVectors];
  for (int r = 0; r < kRows; r++)
    for (int v = 0; v < kVectors; v++) total[r][v] = _mm512_setzero_ps();
  // with no division in the loop (a runtime idiv per sub-block cost a third of the products' time): for
  // 16-column groups a unit is one activation block of two groups, else one group of whole blocks
  const bool halves = sub < kBlock;
  for (int64_t u = 0; u < units; u++) {
    const uint8_t* rec[kVectors];
    for (int v = 0; v < kVectors; v++) {
      rec[v] = weights + ((cb + v) * units + u) * record;
      ridge_vnni::prefetch_ahead(rec[v], ahead, header);
    }
    for (int64_t j = 0; j < subs; j++) {
      const int64_t k0 = u * unit + j * sub, b = halves ? u : u * subs + j;  // b: the activations' block
      const int64_t local = halves ? j : 0, g = u * unit_groups + local;  // the group, in the unit and all
      __m512i part[kRows][kVectors];
      for (int r = 0; r < kRows; r++) {
        __m512i start = _mm512_setzero_si512();
        if constexpr (kSigned) {  // -128 x the sum of the sub-block's activations
          const int32_t* sums = &x.sum[2 * ((m0 + r) * blocks + b)];
          start = _mm512_set1_epi32(-128 * (halves ? sums[j] : sums[0] + sums[1]));
        }
        for (int v = 0; v < kVectors; v++) part[r][v] = start;
      }
      for (int64_t c = 0; c < chunks; c++) {
        const int64_t k = k0 + c * (kNibbles ? 8 : 4);
        // the chunk's codes for every vector first, then row by row one broadcast serves them all: the
        // broadcasts live one at a time, leaving the registers to the sums
        __m512i first[kVectors], second[kVectors];
        for (int v = 0; v < kVectors; v++) {
          const uint8_t* chunk = rec[v] + header + (j * chunks + c) * kChunk;
          _mm_prefetch(reinterpret_cast<const char*>(chunk + 8 * kChunk), _MM_HINT_T0);
          ridge_vnni::prefetch_ahead(chunk, ahead);
          const __m512i bytes = _mm512_loadu_si512(chunk);
          if constexpr (kNibbles) {
            first[v] = _mm512_and_si512(bytes, low_nibbles);
            second[v] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low_nibbles);
          } else {
            first[v] = bytes;
          }
        }
        for (int r = 0; r < kRows; r++) {
          const __m512i a = quad(r, k);
          for (int v = 0; v < kVectors; v++) part[r][v] = _mm512_dpbusd_epi32(part[r][v], first[v], a);
          if constexpr (kNibbles) {
            const __m512i a4 = quad(r, k + 4);
            for (int v = 0; v < kVectors; v++) part[r][v] = _mm512_dpbusd_epi32(part[r][v], second[v], a4);
          }
        }
      }
      for (int v = 0; v < kVectors; v++) {
        const __m512 s = load_halves(rec[v] + local * kChannels * 2);
        for (int r = 0; r < kRows; r++) {
          const __m512 ds = _mm512_mul_ps(s, _mm512_set1_ps(x.scale[(m0 + r) * blocks + b]));
          total[r][v] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(part[r][v]), ds, total[r][v]);
        }
        if (geo.minimums && (halves || j == subs - 1)) {  // the group's last sub-block
          const __m512 mn = load_halves(rec[v] + minimums_at + local * kChannels * 2);
          for (int r = 0; r < kRows; r++)
            total[r][v] = _mm512_fmadd_ps(mn, _mm512_set1_ps(x.group_sum[(m0 + r) * groups + g]), total[r][v]);
        }
      }
    }
  }
  for (int r = 0; r < kRows; r++)
    for (int v = 0; v < kVectors; v++) {
      T* o = out + (m0 + r) * n_dim + (cb + v) * kChannels;
      if constexpr (std::is_same_v<T, float>) _mm512_storeu_ps(o, total[r][v]);
      else ridge_vec::store_bf16(o, total[r][v]);
    }
}

// Rows m0 .. m0 + rows (up to kMaxRows) of channel blocks cb .. cb + vectors (up to 2)
template <bool kNibbles, bool kSigned, typename T>
void tile_any(const QuantizedRows& x, const Geometry& geo, int64_t m0, int64_t rows, int64_t cb, int64_t vectors,
              const uint8_t* weights, T* out, int64_t n_dim, int64_t ahead) {
#define RIDGE_TILE(R, V) tile<kNibbles, kSigned, R, V, T>(x, geo, m0, cb, weights, out, n_dim, ahead)
  // registers: 2 x rows x vectors sums, 2 x vectors codes, a broadcast and the mask; 4 rows measured 5-8%
  // faster than 6 (3072 x 576 and 576 x 1536, 32 and 512 rows), whose 24 sums left the compiler spilling
  if (vectors == 2) {
    switch (rows) {
      case 1: RIDGE_TILE(1, 2); break;
      case 2: RIDGE_TILE(2, 2); break;
      case 3: RIDGE_TILE(3, 2); break;
      default: RIDGE_TILE(4, 2); break;
    }
  } else {
    switch (rows) {
      case 1: RIDGE_TILE(1, 1); break;
      case 2: RIDGE_TILE(2, 1); break;
      case 3: RIDGE_TILE(3, 1); break;
      default: RIDGE_TILE(4, 1); break;
    }
  }
#undef RIDGE_TILE
}

constexpr int64_t kMaxRows = 4;

template <bool kNibbles, bool kSigned, typename T>
void linear(const QuantizedRows& x, const Geometry& geo, int64_t m_dim, int64_t n_dim, const uint8_t* weights,
            T* out) {
  // a thread takes two channel blocks (32 channels) and walks all the rows: their codes stay in L1 / L2 while
  // the rows go by, and the activations (M x K bytes) are shared by all from L2
  const int64_t channel_blocks = n_dim / kChannels, pairs = (channel_blocks + 1) / 2;
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < pairs; p++) {
    const int64_t cb = 2 * p, vectors = std::min<int64_t>(2, channel_blocks - cb);
    ridge_vnni::NextPairPrefetch next_pair(geo, weights, cb, channel_blocks, (m_dim + kMaxRows - 1) / kMaxRows);
    for (int64_t m0 = 0; m0 < m_dim; m0 += kMaxRows) {
      next_pair.before_tile();
      tile_any<kNibbles, kSigned, T>(x, geo, m0, std::min(kMaxRows, m_dim - m0), cb, vectors, weights, out,
                                     n_dim, next_pair.ahead());
    }
  }
}

#endif  // RIDGE_VNNI

}  // namespace

bool vnni_available() {
#if defined(RIDGE_VNNI)
  return true;
#else
  return false;
#endif
}

torch::Tensor vnni_linear(torch::Tensor x, const VnniWeight& weight) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16),
              "x: float32 or bfloat16 [M, K]");
  const int64_t m_dim = x.size(0), k_dim = x.size(1), group = weight.group;
  const Geometry geo = ridge_vnni::geometry(weight, k_dim);
  const torch::Tensor& packed = weight.packed;
  const int64_t n_dim = packed.size(0) * kChannels;
#if defined(RIDGE_VNNI)
  const torch::Tensor xc = x.contiguous();
  torch::Tensor out = torch::empty({m_dim, n_dim}, xc.options());
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const auto run = [&](auto* xp, auto* op) {
    const QuantizedRows rows = quantize_rows(xp, m_dim, k_dim, group, geo.minimums, static_cast<float>(weight.unit));
    using T = std::remove_pointer_t<decltype(op)>;
    if (geo.nibbles) linear<true, false, T>(rows, geo, m_dim, n_dim, w, op);
    else if (weight.signed_codes) linear<false, true, T>(rows, geo, m_dim, n_dim, w, op);
    else linear<false, false, T>(rows, geo, m_dim, n_dim, w, op);
  };
  if (xc.scalar_type() == torch::kFloat) run(xc.data_ptr<float>(), out.data_ptr<float>());
  else run(xc.data_ptr<c10::BFloat16>(), out.data_ptr<c10::BFloat16>());
  return out;
#else
  TORCH_CHECK(false, "vnni_linear: built without AVX512-VNNI");
#endif
}
