// The exact 4-bit linear for bfloat16 activations, over vnni_linear.cpp's weight layout, on AVX512-BF16's
// vdpbf16ps (two bf16 products added into each of 16 float32 sums per instruction):
//   y[m, n] = sum_g scale[n, g] * (sum_{k in g} x[m, k] code[n, k]) + minimum[n, g] * xsum[m, g]
// x is multiplied as it is, unlike vnni_linear.cpp's int8 activations: the result is the dequantized layer's
// up to float32 rounding (the scales are the layout's float16 ones).
//
// Why it exists: at decode's few rows the exact kernels that widen each code to a float32 (torch's int4 one,
// quant_linear.cpp's grouped one) spend ~3 instructions per 16 weights (widen, convert, FMA) and ran the
// SmolLM2 stack's 4-bit layers at 12 GB/s, against the int8-activation kernel's 18 (2-core Zen 4, a third of the
// memory's rate and less): they are bound by instructions. Here a code becomes a bf16 by being the low byte of
// 0x43xx, whose value is 128 + code (bf16's 7 mantissa bits at exponent 7), so 64 code bytes turn into 64 bf16
// weights with 2 byte unpacks, and one vdpbf16ps multiplies 32 of them: ~11 instructions per 128 weights. The
// 128 taken once too many per code comes back through the group's sum of x: scale * (sum (128 + code) x - 128
// xsum) (exact products, float32 sums; the difference loses ~4 of float32's 24 bits, far inside bf16's 8).
//
// Lanes: a chunk holds channel 4 L + i's codes at bytes 16 L + 4 i + (0..3) (vnni_linear.cpp's layout, 4-bit:
// columns k0..k0+3 in the low nibbles, k0+4..k0+7 in the high ones). Unpacking the low half of each 128-bit lane
// puts channels 4 L and 4 L + 1 into 32-bit lanes 4 L .. 4 L + 3, two columns a lane (A below); the high half,
// channels 4 L + 2 and 4 L + 3 (B). With x's 4 columns broadcast as 64 bits, every lane multiplies its own two
// columns. Each channel's sum thus lies in two lanes, added at the end; scales are spread to the lanes by a
// permute per group, and the offset (minimum - 128 scale) * xsum goes into the first lane of each pair.
#include <torch/extension.h>
#include <omp.h>

#include <algorithm>
#include <cstring>
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
using ridge_vnni::kChunk;

#if defined(RIDGE_BF16_DOT)

constexpr int64_t kColumns = 8;  // per 4-bit chunk

// out[m0 .. m0 + kRows, channel blocks cb .. cb + kVectors) for one register tile; xsum [M, K / group]
template <int kRows, int kVectors>
void tile(const c10::BFloat16* x, const float* xsum, const Geometry& geo, int64_t m0, int64_t cb,
          const uint8_t* weights, float unit, c10::BFloat16* out, int64_t n_dim) {
  const int64_t k_dim = geo.k_dim, group = geo.group, groups = k_dim / group, chunks = group / kColumns;
  const int64_t header = geo.header_bytes(), record = geo.record_bytes(), minimums_at = kChannels * 2;
  const __m512i low_nibbles = _mm512_set1_epi8(0x0F), magic = _mm512_set1_epi8(0x43);
  // lane -> channel of A and B; the pairs' first and second lanes, A's then B's (permutex2var: 16 + i is B's i)
  const __m512i lanes_a = _mm512_setr_epi32(0, 0, 1, 1, 4, 4, 5, 5, 8, 8, 9, 9, 12, 12, 13, 13);
  const __m512i lanes_b = _mm512_add_epi32(lanes_a, _mm512_set1_epi32(2));
  const __m512i firsts = _mm512_setr_epi32(0, 2, 16, 18, 4, 6, 20, 22, 8, 10, 24, 26, 12, 14, 28, 30);
  const __m512i seconds = _mm512_add_epi32(firsts, _mm512_set1_epi32(1));
  const uint16_t* xr[kRows];
  for (int r = 0; r < kRows; r++) xr[r] = reinterpret_cast<const uint16_t*>(x) + (m0 + r) * k_dim;
  const auto quad = [&](int r, int64_t k) {  // 4 bf16 activations broadcast to every 64-bit lane
    int64_t word;
    std::memcpy(&word, xr[r] + k, sizeof(word));
    return reinterpret_cast<__m512bh>(_mm512_set1_epi64(word));
  };
  __m512 total_a[kRows][kVectors], total_b[kRows][kVectors];
  for (int r = 0; r < kRows; r++)
    for (int v = 0; v < kVectors; v++) total_a[r][v] = total_b[r][v] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; g++) {  // a record per group: 4-bit groups are 32s
    const uint8_t* rec[kVectors];
    for (int v = 0; v < kVectors; v++) rec[v] = weights + ((cb + v) * groups + g) * record;
    __m512 part_a[kRows][kVectors], part_b[kRows][kVectors];
    for (int r = 0; r < kRows; r++)
      for (int v = 0; v < kVectors; v++) part_a[r][v] = part_b[r][v] = _mm512_setzero_ps();
    for (int64_t c = 0; c < chunks; c++) {
      const int64_t k = g * group + c * kColumns;
      __m512bh w[kVectors][4];  // A's columns 0-3, B's 0-3, A's 4-7, B's 4-7
      for (int v = 0; v < kVectors; v++) {
        const uint8_t* chunk = rec[v] + header + c * kChunk;
        _mm_prefetch(reinterpret_cast<const char*>(chunk + 8 * kChunk), _MM_HINT_T0);
        const __m512i bytes = _mm512_loadu_si512(chunk);
        const __m512i lo = _mm512_and_si512(bytes, low_nibbles);
        const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low_nibbles);
        w[v][0] = reinterpret_cast<__m512bh>(_mm512_unpacklo_epi8(lo, magic));
        w[v][1] = reinterpret_cast<__m512bh>(_mm512_unpackhi_epi8(lo, magic));
        w[v][2] = reinterpret_cast<__m512bh>(_mm512_unpacklo_epi8(hi, magic));
        w[v][3] = reinterpret_cast<__m512bh>(_mm512_unpackhi_epi8(hi, magic));
      }
      for (int r = 0; r < kRows; r++) {
        const __m512bh first = quad(r, k), second = quad(r, k + 4);
        for (int v = 0; v < kVectors; v++) {
          part_a[r][v] = _mm512_dpbf16_ps(part_a[r][v], w[v][0], first);
          part_b[r][v] = _mm512_dpbf16_ps(part_b[r][v], w[v][1], first);
          part_a[r][v] = _mm512_dpbf16_ps(part_a[r][v], w[v][2], second);
          part_b[r][v] = _mm512_dpbf16_ps(part_b[r][v], w[v][3], second);
        }
      }
    }
    for (int v = 0; v < kVectors; v++) {
      const __m512 scale = ridge_vnni::load_halves(rec[v]);
      const __m512 minimum = geo.minimums ? ridge_vnni::load_halves(rec[v] + minimums_at) : _mm512_setzero_ps();
      const __m512 offset = _mm512_fnmadd_ps(_mm512_set1_ps(128.f), scale, minimum);
      const __m512 scale_a = _mm512_permutexvar_ps(lanes_a, scale), scale_b = _mm512_permutexvar_ps(lanes_b, scale);
      const __m512 offset_a = _mm512_maskz_permutexvar_ps(0x5555, lanes_a, offset);
      const __m512 offset_b = _mm512_maskz_permutexvar_ps(0x5555, lanes_b, offset);
      for (int r = 0; r < kRows; r++) {
        const __m512 sum = _mm512_set1_ps(xsum[(m0 + r) * groups + g]);
        total_a[r][v] = _mm512_fmadd_ps(offset_a, sum, _mm512_fmadd_ps(part_a[r][v], scale_a, total_a[r][v]));
        total_b[r][v] = _mm512_fmadd_ps(offset_b, sum, _mm512_fmadd_ps(part_b[r][v], scale_b, total_b[r][v]));
      }
    }
  }
  for (int r = 0; r < kRows; r++)
    for (int v = 0; v < kVectors; v++) {
      const __m512 pairs = _mm512_add_ps(_mm512_permutex2var_ps(total_a[r][v], firsts, total_b[r][v]),
                                         _mm512_permutex2var_ps(total_a[r][v], seconds, total_b[r][v]));
      ridge_vec::store_bf16(out + (m0 + r) * n_dim + (cb + v) * kChannels, _mm512_mul_ps(pairs, _mm512_set1_ps(unit)));
    }
}

constexpr int64_t kMaxRows = 4;  // registers: 4 x rows x vectors sums, 4 x vectors codes, 2 broadcasts, constants

template <int kRows>
void tile_any(const c10::BFloat16* x, const float* xsum, const Geometry& geo, int64_t m0, int64_t cb,
              int64_t vectors, const uint8_t* weights, float unit, c10::BFloat16* out, int64_t n_dim) {
  if (vectors == 2) tile<kRows, 2>(x, xsum, geo, m0, cb, weights, unit, out, n_dim);
  else tile<kRows, 1>(x, xsum, geo, m0, cb, weights, unit, out, n_dim);
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
  TORCH_CHECK(weight.nibbles, "bf16_dot_linear: 4-bit codes (8-bit ones are not exact in bf16 as 128 + code)");
  const int64_t m_dim = x.size(0), k_dim = x.size(1), group = weight.group;
  const Geometry geo = ridge_vnni::geometry(weight, k_dim);
  const int64_t n_dim = weight.packed.size(0) * kChannels;
#if defined(RIDGE_BF16_DOT)
  const torch::Tensor xc = x.contiguous();
  torch::Tensor out = torch::empty({m_dim, n_dim}, xc.options());
  const c10::BFloat16* xp = xc.data_ptr<c10::BFloat16>();
  const std::vector<float> xsum = group_sums(xp, m_dim * (k_dim / group), group);  // the 128s' and minimums' term
  const uint8_t* w = weight.packed.data_ptr<uint8_t>();
  c10::BFloat16* op = out.data_ptr<c10::BFloat16>();
  const float unit = static_cast<float>(weight.unit);
  // a thread takes two channel blocks and walks all the rows, as vnni_linear.cpp's linear()
  const int64_t channel_blocks = n_dim / kChannels, pairs = (channel_blocks + 1) / 2;
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < pairs; p++) {
    const int64_t cb = 2 * p, vectors = std::min<int64_t>(2, channel_blocks - cb);
    for (int64_t m0 = 0; m0 < m_dim; m0 += kMaxRows) {
      switch (std::min(kMaxRows, m_dim - m0)) {
        case 1: tile_any<1>(xp, xsum.data(), geo, m0, cb, vectors, w, unit, op, n_dim); break;
        case 2: tile_any<2>(xp, xsum.data(), geo, m0, cb, vectors, w, unit, op, n_dim); break;
        case 3: tile_any<3>(xp, xsum.data(), geo, m0, cb, vectors, w, unit, op, n_dim); break;
        default: tile_any<4>(xp, xsum.data(), geo, m0, cb, vectors, w, unit, op, n_dim); break;
      }
    }
  }
  return out;
#else
  TORCH_CHECK(false, "bf16_dot_linear: built without AVX512-BF16");
#endif
}
