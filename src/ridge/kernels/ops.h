// The kernels' entry points, defined in the .cpp files beside this one: bound to Python in bindings.cpp,
// called from C++ by decode_stack.cpp.
#pragma once

#include <torch/extension.h>

#include <optional>
#include <tuple>

std::tuple<torch::Tensor, torch::Tensor> paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor block_tables, torch::Tensor context_lens, double scale,
                           std::optional<torch::Tensor> window_starts = std::nullopt,
                           std::optional<torch::Tensor> mass = std::nullopt);
std::tuple<torch::Tensor, torch::Tensor> quantized_paged_decode(
    torch::Tensor q, torch::Tensor k_codes, torch::Tensor v_codes, torch::Tensor k_scales, torch::Tensor v_scales,
    torch::Tensor block_tables, torch::Tensor context_lens, double scale, std::optional<torch::Tensor> window_starts,
    bool fp8, std::optional<torch::Tensor> mass = std::nullopt);
void quantized_cache_write_(torch::Tensor k_codes, torch::Tensor v_codes, torch::Tensor k_scales,
                            torch::Tensor v_scales, torch::Tensor k, torch::Tensor v, torch::Tensor slots,
                            std::optional<torch::Tensor> center, bool fp8);
torch::Tensor latent_decode(torch::Tensor q, torch::Tensor cache, torch::Tensor block_tables,
                            torch::Tensor context_lens, double scale, int64_t value_dim,
                            std::optional<torch::Tensor> window_starts = std::nullopt,
                            std::optional<torch::Tensor> mass = std::nullopt);
torch::Tensor head_matmul(torch::Tensor x, torch::Tensor weight, bool transposed);
torch::Tensor add_rms_norm_(torch::Tensor residual, torch::Tensor x, torch::Tensor weight, double eps);
torch::Tensor silu_mul(torch::Tensor gate_up);
torch::Tensor mamba2_decode_(torch::Tensor xbc, torch::Tensor dt, torch::Tensor conv_state, torch::Tensor ssm_state,
                             torch::Tensor slots, torch::Tensor conv_weight, c10::optional<torch::Tensor> conv_bias,
                             torch::Tensor dt_bias, torch::Tensor A_log, torch::Tensor D, int64_t groups,
                             double dt_min, double dt_max);
void rotary_(torch::Tensor x, torch::Tensor positions, torch::Tensor table, int64_t rotated_heads);
std::tuple<torch::Tensor, torch::Tensor> cache_gather(torch::Tensor k_cache, torch::Tensor v_cache,
                                                     torch::Tensor block_ids);
void merge_attention_(torch::Tensor out, torch::Tensor lse, torch::Tensor rows, torch::Tensor part,
                      torch::Tensor part_lse);
void cache_write_(torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor k, torch::Tensor v,
                  torch::Tensor slots);
torch::Tensor grouped_int8_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor scales,
                                  torch::Tensor minimums, int64_t group, torch::Tensor levels);
torch::Tensor int8_dot_linear(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, torch::Tensor minimums,
                              int64_t group, bool signed_codes);
bool int8_dot_available();
torch::Tensor dense_linear(torch::Tensor x, torch::Tensor weight, c10::optional<torch::Tensor> bias);
torch::Tensor int4pack_linear(torch::Tensor x, torch::Tensor packed, torch::Tensor scales_and_zeros, int64_t group,
                              int64_t block_width);
// A weight in vnni_linear.cpp's layout (linear/layouts.py's pack_vnni), with what its bytes do not say
struct VnniWeight {
  torch::Tensor packed;  // uint8 [N / 16, K / max(group, 32), record bytes]
  int64_t group;
  bool nibbles, signed_codes, minimums;  // 4-bit codes two a byte; int8 codes stored plus 128; minimums held
  double unit;  // what the stored float16 scales and minimums count in
  // 8-bit codes of at most 7 bits: 0 .. 127, or -64 .. 63 if signed (GGUF's 5- and 6-bit formats), which bf16
  // holds as 128 + code exactly, as 4-bit codes (bf16_dot_linear.cpp)
  bool seven_bit = false;
};
torch::Tensor vnni_linear(torch::Tensor x, const VnniWeight& weight);
bool vnni_available();
torch::Tensor bf16_dot_linear(torch::Tensor x, const VnniWeight& weight);
bool bf16_dot_available();
torch::Tensor vnni_tiled_linear(torch::Tensor x, const VnniWeight& weight);
// A pack_vnni weight dequantized into `packed`, a bf16 [N, K] weight in oneDNN's packed form (layout mkldnn), in place
void vnni_dequantize_onednn_(torch::Tensor packed, const VnniWeight& weight);
// The first nbytes bytes of a tensor of layout mkldnn, as a uint8 tensor that keeps it alive
torch::Tensor onednn_bytes(torch::Tensor packed, int64_t nbytes);
// Rows (output channels) of a pack_vnni weight of K columns, dequantized to float32 [T, K]
torch::Tensor vnni_rows(const VnniWeight& weight, torch::Tensor rows, int64_t k_dim);

// GGUF blocks (uint8 [n, block bytes]) of GGMLQuantizationType `kind` into out (float32, n * block values):
// code * scales[block, group] (+ minimums[block, group]), gguf's values to the bit (gguf_blocks.cpp)
void gguf_dequantize_(torch::Tensor out, torch::Tensor blocks, int64_t kind, torch::Tensor scales,
                      std::optional<torch::Tensor> minimums);
