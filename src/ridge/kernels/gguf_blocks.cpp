// GGUF block formats dequantized to float32 in one pass over the blocks: each block's codes unpacked into a small
// array, then value = code * scale (+ minimum) written straight into the output (quant/gguf_blocks.py has the
// formats' table and computes the scales). Unpacked with torch ops, every step (nibbles, high bits, their sum, the
// float copy) writes a fresh tensor, and a fresh page's first touch costs more than the arithmetic: here the output
// is the only memory written (docs/notes/server-hardening.md).
//
// The values are gguf's to the bit: the product and the sum are two roundings, as in gguf's numpy (the sum is a
// second loop over the block so that the compiler cannot fuse it into the product: -ffast-math allows FMA).
#include <torch/extension.h>

#include <cstdint>
#include <cstring>

#include "ops.h"

namespace {

// GGMLQuantizationType's values
constexpr int64_t kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14;

struct Format {
  int64_t values, bytes, group;
};

Format format_of(int64_t kind) {
  switch (kind) {
    case kQ4_0: return {32, 18, 32};
    case kQ4_1: return {32, 20, 32};
    case kQ5_0: return {32, 22, 32};
    case kQ5_1: return {32, 24, 32};
    case kQ8_0: return {32, 34, 32};
    case kQ4_K: return {256, 144, 32};
    case kQ5_K: return {256, 176, 32};
    case kQ6_K: return {256, 210, 16};
    default: TORCH_CHECK(false, "gguf_dequantize_: GGUF type ", kind, " is not one ridge unpacks");
  }
}

// One block's codes in the table's convention (quant/gguf_blocks.py's _codes): value i of the block in code[i].
void unpack(int64_t kind, const uint8_t* b, int8_t* code) {
  switch (kind) {
    case kQ8_0:
      std::memcpy(code, b + 2, 32);
      return;
    case kQ4_0:
    case kQ4_1: {  // 16 bytes: value j the low nibble of byte j, value 16 + j its high nibble
      const uint8_t* qs = b + (kind == kQ4_0 ? 2 : 4);
      const int offset = kind == kQ4_0 ? 8 : 0;
      for (int j = 0; j < 16; ++j) {
        code[j] = static_cast<int8_t>((qs[j] & 0x0F) - offset);
        code[j + 16] = static_cast<int8_t>((qs[j] >> 4) - offset);
      }
      return;
    }
    case kQ5_0:
    case kQ5_1: {  // qh a little-endian uint32, bit i the fifth bit of value i; then the nibbles as Q4_0's
      const uint8_t* qh = b + (kind == kQ5_0 ? 2 : 4);
      const uint8_t* qs = qh + 4;
      uint32_t high;
      std::memcpy(&high, qh, 4);
      const int offset = kind == kQ5_0 ? 16 : 0;
      for (int j = 0; j < 16; ++j) {
        code[j] = static_cast<int8_t>(((qs[j] & 0x0F) | (((high >> j) & 1) << 4)) - offset);
        code[j + 16] = static_cast<int8_t>(((qs[j] >> 4) | (((high >> (j + 16)) & 1) << 4)) - offset);
      }
      return;
    }
    case kQ4_K:
    case kQ5_K: {  // qs: 4 runs of 32 bytes, each the low nibbles of 32 values then their high nibbles;
                   // Q5_K's qh[32]: bit s of byte j the fifth bit of value 32 s + j
      const uint8_t* qh = b + 16;
      const uint8_t* qs = b + (kind == kQ4_K ? 16 : 48);
      for (int run = 0; run < 4; ++run) {
        for (int j = 0; j < 32; ++j) {
          const uint8_t byte = qs[32 * run + j];
          int low = byte & 0x0F, high = byte >> 4;
          if (kind == kQ5_K) {
            low |= ((qh[j] >> (2 * run)) & 1) << 4;
            high |= ((qh[j] >> (2 * run + 1)) & 1) << 4;
          }
          code[64 * run + j] = static_cast<int8_t>(low);
          code[64 * run + 32 + j] = static_cast<int8_t>(high);
        }
      }
      return;
    }
    case kQ6_K: {  // two halves of 128 values: ql[64] (values u < 64 the low nibbles, the rest the high ones),
                   // qh[32] with four 2-bit fields a byte (field s of byte j: value 32 s + j); codes less 32
      for (int half = 0; half < 2; ++half) {
        const uint8_t* ql = b + 64 * half;
        const uint8_t* qh = b + 128 + 32 * half;
        int8_t* out = code + 128 * half;
        for (int s = 0; s < 4; ++s) {
          for (int j = 0; j < 32; ++j) {
            const int u = 32 * s + j;
            const int low = u < 64 ? (ql[u] & 0x0F) : (ql[u - 64] >> 4);
            out[u] = static_cast<int8_t>((low | (((qh[j] >> (2 * s)) & 3) << 4)) - 32);
          }
        }
      }
      return;
    }
  }
}

}  // namespace

void gguf_dequantize_(torch::Tensor out, torch::Tensor blocks, int64_t kind, torch::Tensor scales,
                      std::optional<torch::Tensor> minimums) {
  const Format f = format_of(kind);
  const int64_t n = blocks.size(0), groups = f.values / f.group;
  TORCH_CHECK(blocks.dtype() == torch::kUInt8 && blocks.is_contiguous() && blocks.dim() == 2 && blocks.size(1) == f.bytes,
              "gguf_dequantize_: blocks must be contiguous uint8 [n, ", f.bytes, "]");
  TORCH_CHECK(out.dtype() == torch::kFloat32 && out.is_contiguous() && out.numel() == n * f.values,
              "gguf_dequantize_: out must be contiguous float32 of ", n * f.values, " values");
  TORCH_CHECK(scales.dtype() == torch::kFloat32 && scales.is_contiguous() && scales.numel() == n * groups,
              "gguf_dequantize_: scales must be contiguous float32 [n, ", groups, "]");
  const float* minimum = nullptr;
  if (minimums.has_value()) {
    TORCH_CHECK(minimums->dtype() == torch::kFloat32 && minimums->is_contiguous() && minimums->numel() == n * groups,
                "gguf_dequantize_: minimums must be contiguous float32 [n, ", groups, "]");
    minimum = minimums->data_ptr<float>();
  }
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  const float* scale = scales.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, n, 256, [&](int64_t begin, int64_t end) {
    int8_t code[256];
    for (int64_t i = begin; i < end; ++i) {
      unpack(kind, src + i * f.bytes, code);
      float* row = dst + i * f.values;
      for (int64_t g = 0; g < groups; ++g) {
        const float s = scale[i * groups + g];
        for (int64_t v = g * f.group; v < (g + 1) * f.group; ++v) row[v] = static_cast<float>(code[v]) * s;
      }
      if (minimum != nullptr) {
        for (int64_t g = 0; g < groups; ++g) {
          const float m = minimum[i * groups + g];
          for (int64_t v = g * f.group; v < (g + 1) * f.group; ++v) row[v] += m;
        }
      }
    }
  });
}
