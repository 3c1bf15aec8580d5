// Weight-only linear over integer codes with a scale (and optionally a minimum) per group of G input columns:
//   y[m, n] = sum_k x[m, k] * (code[n, k] * scale[n, k / G] + minimum[n, k / G])
// the layout that GGUF's block formats unpack to. torch has int8 kernels for one scale per output channel
// only, and int4 kernels for bf16; nothing for grouped int8 scales. Codes come a byte each (int8 [N, K]) or,
// 4-bit ones, two a byte (uint8 [N, K / 2], vec.h's nibble order): half the bytes to stream per step. 4-bit codes
// are either the integers 0..15 or indices into a table of 16 int8 levels (`levels`: MXFP4's numbers, which are
// not evenly spaced), where code[n, k] above reads levels[code[n, k]]. Scales are float32, or, with levels, powers of
// two held as their float32 exponent byte (MXFP4's e8m0 scales: a byte a group of 32 where a float takes four).
//
// Few rows (decode): every code is read once, widened to float in registers and multiplied into up to
// kRowBlock activation rows; each group's sums are scaled once (dot_rows); memory streams the codes and
// nothing else.
// Many rows (prefill, large batches): a tile of output channels (a few MB) is dequantized by all threads
// into a scratch in x's dtype and multiplied by torch's own matmul (oneDNN, AMX in bf16), so the
// dequantization is paid once per weight and step, not once per row, and the tile is read back from cache.
// The same tiling serves torch's int4 layout (int4pack_linear): torch's own int4 kernel dequantizes again
// for every 4 rows and misses AMX, which made quantized models 3x slower than bf16 at batch 32; and pack_vnni's
// layout for many rows (vnni_tiled_linear): bf16_dot_linear.cpp, exact, ran SmolLM2's 4-bit layers 1.18x slower than
// oneDNN's bf16 matmul at 2048 rows, where both are bound by arithmetic and its per-group scaling is the extra (8-bit
// codes, twice its dot products per weight, from 32 rows).
#include <torch/extension.h>
#include <omp.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include <torch/csrc/inductor/aoti_torch/c/shim.h>

#include "ops.h"
#include "vec.h"
#include "vnni_layout.h"

namespace {

constexpr int64_t kRowBlock = 4;
constexpr int64_t kChannelBlock = 4;  // output channels a thread takes at a time (decode path)
constexpr int64_t kFewRows = 8;  // up to this many rows, the register path (measured against tiles: 4-16 even)
// in float32 the tiles' matmul is MKL's sgemm, slow at few rows (kernels/dense_linear.cpp): up to this many,
// the register path (measured on the 2-core AVX2 box, 3072 x 576: 16 rows 2.5 -> 1.5 ms, 32 rows 4.0 -> 2.9 ms)
constexpr int64_t kFewRowsFloat = 32;
constexpr int64_t kTileBytes = 1 << 22;  // a tile's dequantized bytes: fits L2 + L3 share, amortizes a matmul call
constexpr int64_t kOnednnBlock = 64;  // output channels per block of oneDNN's packed bf16 layout (OnednnPairs)

// How a row's codes are held: a byte each; two a byte, as themselves; two a byte, as indices into the levels
enum class Codes { kBytes, kNibbles, kLevels };

// the levels, or nothing (an undefined or empty tensor)
bool has_levels(const torch::Tensor& levels) { return levels.defined() && levels.numel() > 0; }

// The groups' scales, from a float32 tensor or from exponent bytes e, each the float 2^(e - 127) (the bits e << 23:
// a normal float's exponent with no mantissa), indexed alike.
struct Scales {
  const float* floats = nullptr;
  const uint8_t* exponents = nullptr;

  static Scales of(const torch::Tensor& scales) {
    if (scales.scalar_type() == torch::kByte) return {nullptr, scales.data_ptr<uint8_t>()};
    return {scales.data_ptr<float>(), nullptr};
  }
  float operator[](int64_t i) const {
    if (exponents == nullptr) return floats[i];
    const uint32_t bits = static_cast<uint32_t>(exponents[i]) << 23;
    float value;
    std::memcpy(&value, &bits, sizeof(value));
    return value;
  }
  Scales operator+(int64_t n) const {
    return {floats != nullptr ? floats + n : nullptr, exponents != nullptr ? exponents + n : nullptr};
  }
};

Codes check(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scales,
            const torch::Tensor& minimums, int64_t group, const torch::Tensor& levels) {
  const bool packed = codes.scalar_type() == torch::kByte;
  TORCH_CHECK(!has_levels(levels) || (packed && levels.scalar_type() == torch::kInt8 && levels.numel() == 16 &&
                                      levels.is_contiguous()),
              "levels: empty, or contiguous int8 [16] for 4-bit codes two a byte");
  TORCH_CHECK(x.dim() == 2 && codes.dim() == 2 && x.size(1) == codes.size(1) * (packed ? 2 : 1),
              "x [M, K] and codes [N, K] (int8) or [N, K / 2] (uint8, 4-bit codes two a byte)");
  TORCH_CHECK((codes.scalar_type() == torch::kInt8 || packed) && codes.is_contiguous(),
              "codes: contiguous int8 or uint8");
  const int64_t k_dim = x.size(1);
  TORCH_CHECK(group % (packed ? 32 : 16) == 0 && k_dim % group == 0,
              "group: a multiple of 16 (of 32 for 4-bit codes two a byte) dividing K");
  TORCH_CHECK((scales.scalar_type() == torch::kFloat ||
               (scales.scalar_type() == torch::kByte && has_levels(levels) && minimums.numel() == 0)) &&
                  scales.is_contiguous() && scales.size(0) == codes.size(0) && scales.size(1) == k_dim / group,
              "scales: contiguous float32 [N, K / group], or with levels and no minimums uint8 exponent bytes");
  TORCH_CHECK(minimums.numel() == 0 || (minimums.sizes() == scales.sizes() && minimums.is_contiguous() &&
                                        minimums.scalar_type() == torch::kFloat),
              "minimums: empty, or float32 like scales");
  TORCH_CHECK(x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16, "x: float32 or bfloat16");
  return !packed ? Codes::kBytes : has_levels(levels) ? Codes::kLevels : Codes::kNibbles;
}

template <Codes kForm>
constexpr bool kTwoAByte = kForm != Codes::kBytes;

#if defined(RIDGE_FVEC)
using ridge_vec::fvec;
using ridge_vec::kLanes;

// Columns one step of a loop over codes covers: a 32-column block of 4-bit codes (both its halves come from the
// same 16 bytes), else one vector
template <Codes kForm>
constexpr int64_t kStep = kTwoAByte<kForm> ? 32 : kLanes;

// the levels in a register (a table for pshufb), or nothing
template <Codes kForm>
inline __m128i load_levels(const int8_t* levels) {
  if constexpr (kForm == Codes::kLevels) return _mm_loadu_si128(reinterpret_cast<const __m128i*>(levels));
  else return _mm_setzero_si128();
}

// kLanes codes of a row from column j + h, as floats (j: a multiple of kStep; h: of kLanes, below kStep)
template <Codes kForm>
inline fvec load_codes(const int8_t* row, int64_t j, int64_t h, __m128i levels) {
  const auto* bytes = reinterpret_cast<const uint8_t*>(row);
  if constexpr (kForm == Codes::kLevels) return ridge_vec::vload_nibble_levels(bytes, j, h, levels);
  else if constexpr (kForm == Codes::kNibbles) return ridge_vec::vload_nibbles(bytes, j, h);
  else return ridge_vec::vload_i8(row + j + h);
}

// out[m, n .. n + kChannels) for kRows rows of x (float32 [M, K]), in the factored form
//   sum_g scale[n, g] * (sum_{k in g} x[m, k] code[n, k]) + sum_g minimum[n, g] * xsum[m, g]
// (xsum[m, g]: the sum of x[m] over group g, the same for every channel): per 8 weights one conversion and
// one FMA per row, the scale applied once per group. Dequantizing every weight first cost a third more
// instructions, and this machine class (2 cores, AVX2) is bound by them, not by memory: 1.6x faster at
// batch 1 (3072 x 576, 287 -> 172 us). kChannels x kRows partial sums and as many totals stay in registers
// (16 on AVX2): kRows and kChannels are compile-time, so the compiler spills none.
template <Codes kForm, int64_t kChannels, int64_t kRows>
void dot_rows(const float* x, const float* xsum, int64_t k_dim, const int8_t* codes, Scales scales,
              const float* minimums, int64_t group, const int8_t* levels, float* out, int64_t out_stride) {
  const int64_t groups = k_dim / group, stride = code_row_bytes(kTwoAByte<kForm>, k_dim);
  const __m128i table = load_levels<kForm>(levels);
  fvec total[kChannels][kRows];
  for (int64_t c = 0; c < kChannels; c++)
    for (int64_t r = 0; r < kRows; r++) total[c][r] = ridge_vec::vset1(0.f);
  for (int64_t g = 0; g < groups; g++) {
    fvec part[kChannels][kRows];
    for (int64_t c = 0; c < kChannels; c++)
      for (int64_t r = 0; r < kRows; r++) part[c][r] = ridge_vec::vset1(0.f);
    for (int64_t j = g * group; j < (g + 1) * group; j += kStep<kForm>) {
      // the next channel block's codes, a block ahead: without it a weight larger than the caches (the
      // vocabulary projection) streamed at a third of the rate of one that stays in them
      if (j % 64 == 0)
        for (int64_t c = 0; c < kChannels; c++)
          _mm_prefetch(reinterpret_cast<const char*>(codes + (c + kChannels) * stride +
                                                     code_row_bytes(kTwoAByte<kForm>, j)),
                       _MM_HINT_T0);
      for (int64_t h = 0; h < kStep<kForm>; h += kLanes) {
        fvec w[kChannels];
        for (int64_t c = 0; c < kChannels; c++) w[c] = load_codes<kForm>(codes + c * stride, j, h, table);
        for (int64_t r = 0; r < kRows; r++) {
          const fvec xv = ridge_vec::vload(x + r * k_dim + j + h);
          for (int64_t c = 0; c < kChannels; c++) part[c][r] = ridge_vec::vfmadd(w[c], xv, part[c][r]);
        }
      }
    }
    for (int64_t c = 0; c < kChannels; c++) {
      const fvec scale = ridge_vec::vset1(scales[c * groups + g]);
      for (int64_t r = 0; r < kRows; r++) total[c][r] = ridge_vec::vfmadd(part[c][r], scale, total[c][r]);
    }
  }
  for (int64_t r = 0; r < kRows; r++)
    for (int64_t c = 0; c < kChannels; c++) {
      float offset = 0.f;  // the minimums' share
      if (minimums)
        for (int64_t g = 0; g < groups; g++) offset += minimums[c * groups + g] * xsum[r * groups + g];
      out[r * out_stride + c] = ridge_vec::vsum(total[c][r]) + offset;
    }
}

// Channels [n, n_end) for kRows rows: kChannels at a time (kChannels x kRows independent FMA chains; one
// channel alone is a chain of K / kLanes dependent FMAs, which bounds a decode step by latency), the rest one
// by one.
template <Codes kForm, int64_t kChannels, int64_t kRows>
void dot_channels(const float* x, const float* xsum, int64_t k_dim, int64_t n, int64_t n_end, const int8_t* codes,
                  Scales scales, const float* minimums, int64_t group, const int8_t* levels, float* out,
                  int64_t out_stride) {
  const int64_t groups = k_dim / group, stride = code_row_bytes(kTwoAByte<kForm>, k_dim);
  for (; n < n_end; n += kChannels) {
    const float* mn = minimums ? minimums + n * groups : nullptr;
    if (n + kChannels <= n_end) {
      dot_rows<kForm, kChannels, kRows>(x, xsum, k_dim, codes + n * stride, scales + n * groups, mn, group, levels,
                                        out + n, out_stride);
    } else {
      for (int64_t t = n; t < n_end; t++)
        dot_rows<kForm, 1, kRows>(x, xsum, k_dim, codes + t * stride, scales + t * groups,
                                  minimums ? minimums + t * groups : nullptr, group, levels, out + t, out_stride);
    }
  }
}

inline void store(float* out, fvec v) { ridge_vec::vstore(out, v); }
inline void store(c10::BFloat16* out, fvec v) { ridge_vec::vstore_bf16(out, v); }
#endif

// The scratch that many-row calls dequantize a tile into. Per calling thread: the engine calls from one
// thread, and a tile is dequantized and multiplied before the call returns, so nothing else can hold it.
void* scratch(size_t bytes) {
  thread_local std::vector<uint8_t> buffer;
  if (buffer.size() < bytes) buffer.resize(bytes);
  return buffer.data();
}

// rows x K grouped codes -> out [rows, K] in T, all threads
template <Codes kForm, typename T>
void dequantize_grouped(const int8_t* codes, Scales scales, const float* minimums, int64_t rows,
                        int64_t k_dim, int64_t group, const int8_t* levels, T* out) {
  const int64_t groups = rows * (k_dim / group);  // rows are contiguous: groups follow one another
#pragma omp parallel for schedule(static)
  for (int64_t g = 0; g < groups; g++) {
    const float scale = scales[g], minimum = minimums ? minimums[g] : 0.f;
#if defined(RIDGE_FVEC)
    const fvec s = ridge_vec::vset1(scale), mn = ridge_vec::vset1(minimum);
    const __m128i table = load_levels<kForm>(levels);
    for (int64_t j = g * group; j < (g + 1) * group; j += kStep<kForm>)
      for (int64_t h = 0; h < kStep<kForm>; h += kLanes)
        store(out + j + h, ridge_vec::vfmadd(load_codes<kForm>(codes, j, h, table), s, mn));
#else
    for (int64_t j = g * group; j < (g + 1) * group; j++) {
      // rows follow one another, and a 32-column block never straddles two: j indexes them all
      int code = codes[j];
      if constexpr (kForm != Codes::kBytes) code = nibble_at(reinterpret_cast<const uint8_t*>(codes), j);
      if constexpr (kForm == Codes::kLevels) code = levels[code];
      out[j] = static_cast<T>(code * scale + minimum);
    }
#endif
  }
}

// torch's CPU int4 layout (aten._convert_weight_to_int4pack_for_cpu), read back: channels in blocks of
// `width` (64 where torch's kernels run AVX512, 32 on AVX2: linear/layouts.py asks torch which), and the last
// N % width in one block; a block of B channels starting at channel n holds its K x (B / 2) bytes from byte
// n * K / 2 on, one row of bytes per input column k. In a full block byte j holds channel n + j (low nibble)
// and n + width / 2 + j (high); in the last block, channels n + 2j (low) and n + 2j + 1 (high).
// scales_and_zeros [K / group, N, 2] give w = (code - 8) * scale + zero. tests/test_quant.py checks this
// reading against torch's own kernel, so a change of layout in torch fails there, not silently.
void dequantize_int4pack(const uint8_t* packed, const c10::BFloat16* scales_and_zeros, int64_t n_dim,
                         int64_t k_dim, int64_t group, int64_t width, int64_t n0, int64_t rows,
                         c10::BFloat16* out) {
  const int64_t full = n_dim / width * width;  // the channels in full blocks
  const int64_t half = width / 2;
  // a thread takes whole blocks and walks down k: it reads the block's bytes in order (by k it would jump
  // K * half bytes from one block to the next)
#pragma omp parallel for schedule(static)
  for (int64_t n = n0; n < n0 + rows; n += width) {
    const uint8_t* block = packed + n * k_dim / 2;
#if defined(RIDGE_FVEC)
    if (n < full) {
      const int64_t vectors = width / kLanes;  // per row of the block (width: 32 or 64, checked by the caller)
      fvec scale[64 / kLanes], offset[64 / kLanes];
      for (int64_t k = 0; k < k_dim; k++) {
        if (k % group == 0) {
          const c10::BFloat16* sz = scales_and_zeros + ((k / group) * n_dim + n) * 2;
          for (int64_t q = 0; q < vectors; q++) {  // (scale, zero) pairs: the scale is the low half
            fvec zero;
            ridge_vec::vload_bf16_pairs(sz + 2 * kLanes * q, scale[q], zero);
            offset[q] = ridge_vec::vfmadd(ridge_vec::vset1(-8.f), scale[q], zero);
          }
        }
        const uint8_t* bytes = block + k * half;
        c10::BFloat16* row = out + k * rows + (n - n0);
        for (int64_t q = 0; q < vectors; q++) {  // channels n + kLanes q ..: low nibbles, then high
          const int64_t j = kLanes * q;
          store(row + j, ridge_vec::vfmadd(ridge_vec::vload_u4(bytes + j % half, j >= half), scale[q], offset[q]));
        }
      }
      continue;
    }
#endif
    const int64_t channels = n < full ? width : n_dim - full;  // in this block
    for (int64_t k = 0; k < k_dim; k++) {
      const c10::BFloat16* sz = scales_and_zeros + (k / group) * n_dim * 2;
      for (int64_t j = 0; j < channels; j++) {
        const bool high = n < full ? j >= half : j % 2 == 1;
        const uint8_t byte = block[k * (channels / 2) + (n < full ? j % half : j / 2)];
        const int code = high ? byte >> 4 : byte & 0x0F;
        const float scale = sz[(n + j) * 2], zero = sz[(n + j) * 2 + 1];
        out[k * rows + (n - n0) + j] = static_cast<c10::BFloat16>((code - 8) * scale + zero);
      }
    }
  }
}

// out = x @ W.T, W dequantized a tile of output channels at a time into the scratch by `dequantize(n0,
// rows, tile)`; the tile is W[n0:n0 + rows].T ([K, rows]) when k_major, else W[n0:n0 + rows] ([rows, K]).
template <typename T, typename Dequantize>
torch::Tensor tiled_linear(const torch::Tensor& x, int64_t n_dim, int64_t align, bool k_major, Dequantize dequantize) {
  const int64_t m_dim = x.size(0), k_dim = x.size(1);
  const torch::Tensor xc = x.contiguous();
  torch::Tensor out = torch::empty({m_dim, n_dim}, x.options());
  const int64_t tile = std::max<int64_t>(align, kTileBytes / (k_dim * int64_t(sizeof(T))) / align * align);
  T* buffer = static_cast<T*>(scratch(std::min(tile, n_dim) * k_dim * sizeof(T)));
  for (int64_t n0 = 0; n0 < n_dim; n0 += tile) {
    const int64_t rows = std::min(tile, n_dim - n0);
    dequantize(n0, rows, buffer);
    const torch::Tensor w = k_major ? torch::from_blob(buffer, {k_dim, rows}, x.options())
                                    : torch::from_blob(buffer, {rows, k_dim}, x.options()).t();
    if (rows == n_dim) return torch::mm(xc, w);
    torch::Tensor part = out.narrow(1, n0, rows);  // written in place (the matmul takes its row stride), not copied
    torch::mm_out(part, xc, w);
  }
  return out;
}

#if defined(__AVX512BW__)
// Where dequantize_vnni puts two input columns k, k + 1 (k even) of a block of 16 channels (b: the block's index from
// the first one dequantized), a lane a channel. Both layouts take a pair of columns at a time, as both kinds of
// chunk hold them: for 4-bit codes a vector of unpack_bf16_pairs holds 16 channels' values of one column in its even
// bf16 halves and of the next in its odd ones; an 8-bit chunk holds each channel's 4 columns in its lane's bytes.
//
// A k-major tile [K, rows] for torch's matmul.
struct KMajorTile {
  c10::BFloat16* tile;
  int64_t rows;
  void store_pair(int64_t b, int64_t k, __m512 first, __m512 second) const {
    c10::BFloat16* at = tile + k * rows + b * ridge_vnni::kChannels;
    ridge_vec::store_bf16(at, first);
    ridge_vec::store_bf16(at + rows, second);
  }
};

// oneDNN's bf16 weight layout for its AVX512 matmuls (what torch's mkldnn._reorder_linear_weight makes of an [N, K]
// weight; linear/dense.py's prompt_scratch checks it against that before using it): channels in blocks of 64 and, within a
// block, the columns in pairs, each pair as 64 channels x 2 values. A pair of columns of 16 channels is then 64
// contiguous bytes, a channel's two values side by side.
struct OnednnPairs {
  c10::BFloat16* weight;
  int64_t k_dim;
  void store_pair(int64_t b, int64_t k, __m512 first, __m512 second) const {
    constexpr int64_t kBlocksPer = kOnednnBlock / ridge_vnni::kChannels;
    const __m512i low = _mm512_cvtepu16_epi32(ridge_vec::to_bf16(first));
    const __m512i high = _mm512_slli_epi32(_mm512_cvtepu16_epi32(ridge_vec::to_bf16(second)), 16);
    c10::BFloat16* at = weight + ((b / kBlocksPer) * (k_dim / 2) + k / 2) * (2 * kOnednnBlock) +
                        (b % kBlocksPer) * (2 * ridge_vnni::kChannels);
    _mm512_storeu_si512(at, _mm512_or_si512(low, high));
  }
};

// pack_vnni's records of channels [n0, n0 + rows) (rows in 16s; groups of 16, or of 32s) -> `out`'s layout in bf16,
// w = code * scale + minimum rounded to bf16 (as a bf16 model's weights are), all threads.
template <typename Layout>
void dequantize_vnni(const VnniWeight& weight, const ridge_vnni::Geometry& geo, int64_t n0, int64_t rows,
                     const Layout& out) {
  using ridge_vnni::kChannels;
  const int64_t columns = geo.nibbles ? ridge_vnni::kNibbleColumns : ridge_vnni::kByteColumns;
  const int64_t groups = geo.k_dim / geo.group, chunks = geo.group / columns, blocks = rows / kChannels;
  const int64_t units = geo.k_dim / geo.unit(), unit_groups = geo.unit() / geo.group;
  const int64_t header = geo.header_bytes(), record = geo.record_bytes(), minimums_at = kChannels * 2 * unit_groups;
  const uint8_t* packed = weight.packed.data_ptr<uint8_t>() + n0 / kChannels * units * record;
  const __m512 unit = _mm512_set1_ps(static_cast<float>(weight.unit));
  const __m512i high_halves = _mm512_set1_epi32(static_cast<int32_t>(0xFFFF0000u)), low_byte = _mm512_set1_epi32(0xFF);
  // what a stored value holds beyond the code: 4-bit values are bf16 128 + code; signed 8-bit codes are stored plus 128
  const __m512 excess = _mm512_set1_ps(geo.nibbles ? 128.f : weight.signed_codes ? 128.f : 0.f);
#pragma omp parallel for collapse(2) schedule(static)
  for (int64_t b = 0; b < blocks; b++)
    for (int64_t g = 0; g < groups; g++) {
      // a record per unit of max(group, 32) columns: one group, or two 16-column ones (sub: which)
      const int64_t sub = g % unit_groups, s_at = sub * kChannels * 2;  // s_at: the group's values in the header
      const uint8_t* rec = packed + (b * units + g / unit_groups) * record;
      const __m512 scale = _mm512_mul_ps(ridge_vnni::load_halves(rec + s_at), unit);
      const __m512 minimum = geo.minimums ? _mm512_mul_ps(ridge_vnni::load_halves(rec + minimums_at + s_at), unit)
                                          : _mm512_setzero_ps();
      const __m512 offset = _mm512_fnmadd_ps(excess, scale, minimum);
      for (int64_t c = 0; c < chunks; c++) {
        const uint8_t* chunk = rec + header + (sub * chunks + c) * ridge_vnni::kChunk;
        const int64_t k = g * geo.group + c * columns;
        if (!geo.nibbles) {
          const __m512i bytes = _mm512_loadu_si512(chunk);
          __m512 values[4];
          for (int j = 0; j < 4; j++) {  // column j: byte j of every lane
            const __m512 stored = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(bytes, 8 * j), low_byte));
            values[j] = _mm512_fmadd_ps(stored, scale, offset);
          }
          out.store_pair(b, k, values[0], values[1]);
          out.store_pair(b, k + 2, values[2], values[3]);
          continue;
        }
        __m512i pairs[4];
        ridge_vnni::unpack_bf16_pairs(chunk, pairs);
        for (int q = 0; q < 4; q++) {
          const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(pairs[q], 16));
          const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(pairs[q], high_halves));
          out.store_pair(b, k + 2 * q, _mm512_fmadd_ps(even, scale, offset), _mm512_fmadd_ps(odd, scale, offset));
        }
      }
    }
}
#endif

template <Codes kForm>
torch::Tensor grouped_linear(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scales,
                             const torch::Tensor& minimums, int64_t group, const torch::Tensor& levels) {
  const int64_t m_dim = x.size(0), n_dim = codes.size(0), k_dim = x.size(1);
  const int8_t* c = static_cast<const int8_t*>(codes.data_ptr());
  const Scales s = Scales::of(scales);
  const float* mn = minimums.numel() ? minimums.data_ptr<float>() : nullptr;
  const int8_t* lv = kForm == Codes::kLevels ? levels.data_ptr<int8_t>() : nullptr;
  const int64_t groups = k_dim / group, stride = code_row_bytes(kTwoAByte<kForm>, k_dim);
#if defined(RIDGE_FVEC)
  if (m_dim <= (x.scalar_type() == torch::kFloat ? kFewRowsFloat : kFewRows)) {
    const torch::Tensor xf = x.to(torch::kFloat).contiguous();
    torch::Tensor out = torch::empty({m_dim, n_dim}, xf.options());
    const float* xp = xf.data_ptr<float>();
    // the sum of each row over each group: the minimums' term, shared by every channel
    const std::vector<float> xsum = group_sums(xp, mn ? m_dim * groups : 0, group);
    const float* xs = xsum.data();
    float* op = out.data_ptr<float>();
    for_channel_and_row_blocks(n_dim, m_dim, kChannelBlock, kRowBlock, [&](int64_t n, int64_t n_end, int64_t m0,
                                                                           int64_t rows) {
      const float* xm = xp + m0 * k_dim;
      const float* sm = xs + m0 * groups;
      float* om = op + m0 * n_dim;
      switch (rows) {  // registers: 2 x channels x rows + channels + 1 <= 16
        case 1: dot_channels<kForm, 4, 1>(xm, sm, k_dim, n, n_end, c, s, mn, group, lv, om, n_dim); break;
        case 2: dot_channels<kForm, 2, 2>(xm, sm, k_dim, n, n_end, c, s, mn, group, lv, om, n_dim); break;
        case 3: dot_channels<kForm, 2, 3>(xm, sm, k_dim, n, n_end, c, s, mn, group, lv, om, n_dim); break;
        default: dot_channels<kForm, 1, 4>(xm, sm, k_dim, n, n_end, c, s, mn, group, lv, om, n_dim); break;
      }
    });
    return out.to(x.scalar_type());
  }
#endif
  const auto tile = [&](int64_t n0, int64_t rows, auto* buffer) {
    dequantize_grouped<kForm>(c + n0 * stride, s + n0 * groups, mn ? mn + n0 * groups : nullptr, rows, k_dim,
                              group, lv, buffer);
  };
  if (x.scalar_type() == torch::kBFloat16) return tiled_linear<c10::BFloat16>(x, n_dim, 1, false, tile);
  return tiled_linear<float>(x, n_dim, 1, false, tile);
}

}  // namespace

torch::Tensor grouped_int8_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor scales,
                                  torch::Tensor minimums, int64_t group, torch::Tensor levels) {
  switch (check(x, codes, scales, minimums, group, levels)) {
    case Codes::kLevels: return grouped_linear<Codes::kLevels>(x, codes, scales, minimums, group, levels);
    case Codes::kNibbles: return grouped_linear<Codes::kNibbles>(x, codes, scales, minimums, group, levels);
    default: return grouped_linear<Codes::kBytes>(x, codes, scales, minimums, group, levels);
  }
}

torch::Tensor int4pack_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scales_and_zeros, int64_t group,
                              int64_t block_width) {
  const int64_t n_dim = scales_and_zeros.size(1), k_dim = x.size(1);
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16, "x: bfloat16 [M, K]");
  TORCH_CHECK(packed.scalar_type() == torch::kByte && packed.is_contiguous() && packed.numel() * 2 == n_dim * k_dim,
              "packed: torch's CPU int4 layout of an [N, K] weight");
  TORCH_CHECK(scales_and_zeros.scalar_type() == torch::kBFloat16 && scales_and_zeros.is_contiguous() &&
                  scales_and_zeros.dim() == 3 && scales_and_zeros.size(0) * group == k_dim,
              "scales_and_zeros: contiguous bfloat16 [K / group, N, 2]");
  TORCH_CHECK(n_dim % 16 == 0, "N: a multiple of 16 (torch's layout)");
  TORCH_CHECK(block_width == 32 || block_width == 64, "block_width: torch's 32 or 64");
  const uint8_t* p = packed.data_ptr<uint8_t>();
  const c10::BFloat16* sz = scales_and_zeros.data_ptr<c10::BFloat16>();
  // tiles start on a multiple of 64, so that a tile never splits a block
  return tiled_linear<c10::BFloat16>(x, n_dim, 64, true, [&](int64_t n0, int64_t rows, c10::BFloat16* tile) {
    dequantize_int4pack(p, sz, n_dim, k_dim, group, block_width, n0, rows, tile);
  });
}

torch::Tensor vnni_rows(const VnniWeight& weight, torch::Tensor rows, int64_t k_dim) {
  const ridge_vnni::Geometry geo = ridge_vnni::geometry(weight, k_dim);
  TORCH_CHECK(rows.scalar_type() == torch::kLong && rows.dim() == 1, "rows: int64 [T]");
  const torch::Tensor ids = rows.contiguous();
  const int64_t count = ids.size(0), unit = geo.unit(), units = k_dim / unit, group = geo.group;
  const int64_t header = geo.header_bytes(), record = geo.record_bytes(), per_unit = unit / group;
  const int64_t channels = weight.packed.size(0) * ridge_vnni::kChannels;
  const uint8_t* packed = weight.packed.data_ptr<uint8_t>();
  const int64_t* id = ids.data_ptr<int64_t>();
  const float offset = weight.signed_codes ? 128.f : 0.f, scale_unit = static_cast<float>(weight.unit);
  torch::Tensor out = torch::empty({count, k_dim}, torch::kFloat);
  float* o = out.data_ptr<float>();
  const auto half_at = [](const uint8_t* p) {
    c10::Half h;
    std::memcpy(&h, p, 2);
    return static_cast<float>(h);
  };
  for (int64_t t = 0; t < count; t++) {
    TORCH_CHECK(id[t] >= 0 && id[t] < channels, "vnni_rows: row ", id[t], " out of [0, ", channels, ")");
    const int64_t block = id[t] / ridge_vnni::kChannels, lane = id[t] % ridge_vnni::kChannels;
    for (int64_t u = 0; u < units; u++) {
      const uint8_t* rec = packed + (block * units + u) * record;
      for (int64_t i = 0; i < unit; i++) {  // the record's layout, as pack_vnni and vnni_linear.cpp state it
        const int64_t g = i / group;
        const float scale = half_at(rec + (g * ridge_vnni::kChannels + lane) * 2) * scale_unit;
        const float minimum =
            geo.minimums ? half_at(rec + ((per_unit + g) * ridge_vnni::kChannels + lane) * 2) * scale_unit : 0.f;
        int code;
        if (geo.nibbles) {
          const uint8_t byte = rec[header + (i / 8) * ridge_vnni::kChunk + lane * 4 + i % 4];
          code = i % 8 < 4 ? byte & 0x0F : byte >> 4;
        } else {
          code = rec[header + (i / 4) * ridge_vnni::kChunk + lane * 4 + i % 4];
        }
        o[t * k_dim + u * unit + i] = (static_cast<float>(code) - offset) * scale + minimum;
      }
    }
  }
  return out;
}

torch::Tensor vnni_tiled_linear(torch::Tensor x, const VnniWeight& weight) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16, "x: bfloat16 [M, K]");
  const ridge_vnni::Geometry geo = ridge_vnni::geometry(weight, x.size(1));
#if defined(__AVX512BW__)
  return tiled_linear<c10::BFloat16>(x, weight.packed.size(0) * ridge_vnni::kChannels, ridge_vnni::kChannels, true,
                                     [&](int64_t n0, int64_t rows, c10::BFloat16* tile) {
                                       dequantize_vnni(weight, geo, n0, rows, KMajorTile{tile, rows});
                                     });
#else
  TORCH_CHECK(false, "vnni_tiled_linear: built without AVX512BW");
#endif
}

// The bytes of a weight torch holds in oneDNN's packed form (a tensor of layout mkldnn, which has no data_ptr): torch's
// C shim for compiled models reads them out of it, a stable interface where the ATen function behind it is not.
static void* onednn_data(const torch::Tensor& packed) {
  TORCH_CHECK(packed.is_mkldnn(), "packed: a tensor of layout mkldnn (torch.ops.mkldnn._reorder_linear_weight)");
  void* data = nullptr;
  // AtenTensorHandle is the shim's name for at::Tensor*
  const auto handle = reinterpret_cast<AtenTensorHandle>(const_cast<torch::Tensor*>(&packed));
  TORCH_CHECK(aoti_torch_get_data_ptr(handle, &data) == AOTI_TORCH_SUCCESS && data, "packed: its bytes unreadable");
  return data;
}

torch::Tensor onednn_bytes(torch::Tensor packed, int64_t nbytes) {
  return torch::from_blob(onednn_data(packed), {nbytes}, [packed](void*) {}, torch::kByte);
}

void vnni_dequantize_onednn_(torch::Tensor packed, const VnniWeight& weight) {
  TORCH_CHECK(packed.scalar_type() == torch::kBFloat16 && packed.dim() == 2, "packed: bfloat16 [N, K]");
  const int64_t n_dim = packed.size(0), k_dim = packed.size(1);
  const ridge_vnni::Geometry geo = ridge_vnni::geometry(weight, k_dim);
  TORCH_CHECK(weight.packed.size(0) * ridge_vnni::kChannels == n_dim && n_dim % kOnednnBlock == 0,
              "packed: as many channels as the weight, a multiple of 64");
#if defined(__AVX512BW__)
  dequantize_vnni(weight, geo, 0, n_dim, OnednnPairs{static_cast<c10::BFloat16*>(onednn_data(packed)), k_dim});
#else
  TORCH_CHECK(false, "vnni_dequantize_onednn_: built without AVX512BW");
#endif
}
