// The decoder stack's weights as decode_stack.cpp reads them; built once per engine from the model's
// modules (kernels/decode_stack.py), holding references to the same tensors, not copies.
#pragma once

#include <torch/extension.h>

#include <string>
#include <vector>

#include "ops.h"

namespace ridge_stack {

// One kernel call's weights, as the layer's Python module calls it (kernels/decode_stack.py):
//   grouped_int8 / int8_dot: codes, scales, minimums per group (exact, or with int8 activations); grouped_int8's
//   4-bit codes read through `levels` where given (MXFP4);
//   vnni: the same with int8 activations in vnni_linear.cpp's layout (`vnni`, the rest empty);
//   bf16_dot: 4- or 8-bit codes in that layout, exact, bf16 activations (bf16_dot_linear.cpp), or from
//   `tiled_min_rows` rows on the same weight dequantized to bf16 a tile at a time (quant_linear.cpp);
//   dense: a float32 weight on ridge's few-row kernel; linear: a plain weight on at::linear;
//   onednn: a bf16 weight packed by oneDNN (linear/dense.py), calls of fewer than `min_rows` rows padded;
//   int4pack: torch's CPU int4 layout, `scales` its scales_and_zeros, output channels padded to 16 (out_features
//   the real count).
struct LinearPart {
  enum class Kernel { kGrouped, kInt8Dot, kVnni, kBf16Dot, kDense, kLinear, kOneDnn, kInt4Pack };
  Kernel kernel;
  torch::Tensor weight, scales, minimums;  // what a kernel does not use is empty
  int64_t group;
  bool signed_codes;
  c10::optional<torch::Tensor> bias;
  int64_t out_features;
  torch::Tensor levels;  // grouped_int8's table of 4-bit code values (int8 [16]), or undefined

  c10::optional<VnniWeight> vnni;  // the vnni and bf16_dot kernels' weight
  int64_t tiled_min_rows = 0;      // bf16_dot's
  int64_t min_rows = 1;            // onednn's: fewer rows are padded up to this many (PackedLinear.min_rows)

  LinearPart(const std::string& kernel, torch::Tensor weight, torch::Tensor scales, torch::Tensor minimums,
             int64_t group, bool signed_codes, c10::optional<torch::Tensor> bias, int64_t out_features,
             c10::optional<torch::Tensor> levels = c10::nullopt);
  LinearPart(const std::string& kernel, VnniWeight vnni, c10::optional<torch::Tensor> bias, int64_t tiled_min_rows);
  torch::Tensor operator()(const torch::Tensor& x) const;
};

// A fused projection (q|k|v, gate|up): its parts' outputs side by side, then the projection's bias.
struct Linear {
  std::vector<LinearPart> parts;
  c10::optional<torch::Tensor> bias;

  torch::Tensor operator()(const torch::Tensor& x) const;
};

// A gated MLP's activation of its gate|up halves (models/layers.py's GatedMLP), op for op: SwiGLU (silu_mul), GeGLU
// (tanh-approximated gelu: Gemma), or gpt-oss's SwiGLU with the gate clamped above and up on both sides at `limit`,
// gate * sigmoid(alpha * gate) * (up + 1); or, ungated (gate_up holds up alone), Nemotron-H's squared ReLU or
// StarCoder2's tanh-approximated gelu of up.
struct Activation {
  enum class Kind { kSilu, kGeluTanh, kSwigluOai, kRelu2 };
  Kind kind = Kind::kSilu;
  double limit = 0.0, alpha = 1.0;  // swiglu_oai's
  bool gated = true;                // false for relu2 always, and for an ungated gelu_tanh

  Activation() = default;
  Activation(const std::string& name, double limit, double alpha, bool gated);
  torch::Tensor operator()(const torch::Tensor& gate_up) const;
};

// A mixture of experts (models/moe.py's MoEBlock): routed as its route() routes, op for op, and each expert
// any token chose run over its tokens with the same kernels. Where the step chose at least as many experts as
// there are threads, the experts run side by side, one a thread, each kernel on its caller's thread alone:
// an expert's matrices are a few MB, too small for a call over every thread to reach the memory's speed
// (docs/notes/moe-mla.md). A kernel's result does not depend on the threads it runs on, so neither does
// the layer's.
struct Experts {
  torch::Tensor router;                    // the router's weight [experts, hidden], on at::linear
  c10::optional<torch::Tensor> router_bias;  // a correction bias (sigmoid scoring's; Ernie's): moves the choice only
  int64_t top_k, groups, topk_groups;
  bool sigmoid, renormalize, group_top2;   // group_top2: a group rated by its two best scores, else its best
  double scaling;
  std::vector<Linear> gate_up, down;       // one per expert; an expert another rank holds has no parts
  c10::optional<Linear> shared_gate_up, shared_down;
  c10::optional<torch::Tensor> shared_gate;  // the shared expert's sigmoid gate's weight [1, hidden]
  c10::optional<torch::Tensor> router_logit_bias;  // a bias on the router's logits (gpt-oss)
  Activation activation;                   // the experts' and the shared expert's
  double norm_eps = 0.0;                   // added to the renormalised top k's sum (models/moe.py's norm_eps)
  bool scale_input = false;  // Llama 4's: an expert reads its tokens times their weights, its outputs join as they are
  // Gemma 4's router: it reads its input RMS-normed without a weight (router_input_eps), times this per-channel scale
  // and hidden ** -0.5; each chosen weight times its expert's own scale
  c10::optional<torch::Tensor> router_input_scale, expert_scales;
  double router_input_eps = 0.0;

  // router_input: what the router reads, where not the experts' input x (Gemma 4's: the stream)
  torch::Tensor operator()(const torch::Tensor& x, const c10::optional<torch::Tensor>& router_input) const;

 private:
  // each token's experts [T, k] and their weights [T, k] (float32), x the router's input
  std::pair<torch::Tensor, torch::Tensor> route(const torch::Tensor& x) const;
};

// Multi-head latent attention's projections (models/mla.py's LatentAttention), run as its forward() runs them:
// the query (through its low-rank bottleneck where q_a is given), the latent and rotary key, W_UK folded into the
// query and W_UV applied after, both on head_matmul (kernels/latent_attention.cpp).
// Sparse attention's indexer key (models/sparse_index.py): projected, LayerNormed, its first rope dims turned, and
// written to the indexer's cache [num_blocks, block_size, dim]. The stack serves only steps whose contexts are no
// longer than the indexer's top k (kernels/decode_stack.py), where attention reads every key: the key is all it
// must keep for later steps.
struct IndexerKey {
  Linear wk;
  torch::Tensor norm_weight, norm_bias, cache;
};

struct LatentProjections {
  c10::optional<Linear> q_a;               // with q_a_norm, the query's bottleneck before q (DeepSeek-V3)
  c10::optional<torch::Tensor> q_a_norm;
  Linear q, kv_a;                          // q: q_b, or q_proj where there is no bottleneck
  torch::Tensor kv_a_norm;
  torch::Tensor w_uk, w_uv;                // views of kv_b: [heads, nope, rank] and [heads, v_dim, rank]
  int64_t rope;                            // qk_rope_head_dim
  std::optional<IndexerKey> index_key;     // DeepSeek-V3.2's and GLM-5's, where the layer has an indexer
};

// A Mamba-2 mixer (models/mamba.py's Mamba2Mixer): its projections, the convolution's and the recurrence's
// parameters, and this layer's state tensors (kv/state_cache.py), which a step's rows index by their state slots.
struct StateMixer {
  Linear in_proj, out_proj;
  torch::Tensor conv_weight;
  c10::optional<torch::Tensor> conv_bias;
  torch::Tensor dt_bias, A_log, D, norm_weight;
  int64_t groups;  // of heads sharing B and C; the heads and their width are ssm_state's [slots, heads, head_dim, _]
  double dt_min, dt_max;
  torch::Tensor conv_state, ssm_state;
};

// LFM2's gated short convolution (models/short_conv.py's ShortConvMixer): its projections and taps, and this
// layer's convolution state (kv/state_cache.py's conv tensor: the last taps - 1 gated inputs of each slot).
struct ShortConv {
  Linear in_proj, out_proj;
  torch::Tensor conv_weight;  // [hidden, taps]
  c10::optional<torch::Tensor> conv_bias;
  torch::Tensor conv_state;
};

// Qwen3.5's gated DeltaNet (models/gated_delta.py's GatedDeltaMixer): its projections, taps and decay parameters,
// and this layer's state tensors (the convolution's last inputs, and each value head's [value_dim, key_dim] state).
struct GatedDelta {
  Linear in_proj, out_proj;
  torch::Tensor conv_weight;  // [channels, taps]
  c10::optional<torch::Tensor> conv_bias;
  torch::Tensor dt_bias, A_log, norm_weight;
  int64_t groups;  // of value heads sharing a query and key head
  bool tiled;      // value head j reads query / key head j % groups (a GGUF's order), else j / (heads / groups)
  torch::Tensor conv_state, ssm_state;
};

// models/layers.py's DecoderLayer.
struct Layer {
  // the mixer's and the MLP's input norms; absent where the layer norms its outputs only (OLMo-2: the sublayer reads
  // the residual stream itself), or has no MLP (Mamba-2's own layers)
  c10::optional<torch::Tensor> input_norm, post_attn_norm;
  c10::optional<torch::Tensor> q_norm, k_norm;  // qwen3's per-head norms
  Linear qkv, o_proj, gate_up, down;  // gate_up and down: a dense MLP's; empty where the layer has experts
  Activation activation;              // the dense MLP's
  // this layer's paged caches (attention/backend.py's layout); latent attention's rows in k_cache
  // (attention/latent.py's layout), v_cache unused
  torch::Tensor k_cache, v_cache;
  // a quantized cache's (attention/quantized_kv.py): k_cache, v_cache hold int8 or fp8 codes, these their scales,
  // and keys are stored less key_center; absent for a cache in the model's dtype
  c10::optional<torch::Tensor> k_scales, v_scales, key_center;
  bool fp8 = false;
  std::optional<Experts> experts;  // the layer's MLP, where it is a mixture of experts
  std::optional<LatentProjections> latent;  // the layer's attention, where it is latent (qkv empty then)
  std::optional<StateMixer> ssm;            // the layer's mixer, where it is a state-space one (no attention then)
  std::optional<ShortConv> short_conv;      // or LFM2's short convolution
  std::optional<GatedDelta> gated_delta;    // or Qwen3.5's gated DeltaNet
  bool output_gate = false;  // Qwen3.5's: qkv's rows end with a gate per query row, the output times its sigmoid
  int64_t group = 0;  // the layer's KV group (kv/layout.py): which of a step's GroupSteps it writes and reads
  c10::optional<torch::Tensor> rope_table;  // the layer's own rotary table (Gemma 3's local layers), else the stack's
  c10::optional<torch::Tensor> sinks;       // gpt-oss's attention sinks [heads]: one more logit in each softmax
  // sandwich norms (Gemma): the mixer's and the MLP's outputs normed before they join the residual stream
  c10::optional<torch::Tensor> attn_out_norm, mlp_out_norm;
  double residual_multiplier = 1.0;  // Granite: each branch's output scaled before it joins
  bool parallel = false;  // Cohere's: the MLP reads the mixer's normed input, the two outputs join as one branch
  bool tempered = false;  // its queries times the step's query_scales (a model's attention temperature), where given
  c10::optional<torch::Tensor> input_norm_bias, post_attn_norm_bias;  // LayerNorms' biases (StarCoder2's)
  // Gemma 4's attention (gemma4_attention): the layer's own KV heads and head width (0: the stack's), q, k and v each
  // RMS-normed over every head (v without a weight), a global layer's values its raw keys, and a KV-shared layer's
  // caches its source layer's, attended to without a write (its qkv holds q alone)
  int64_t kv_heads = 0, head_dim = 0;
  bool gemma4 = false, values_from_keys = false, kv_shared = false;
  // Gemma 4's end of a layer (layer_end): the whole stream plus a branch gated by the row's per-layer input, then
  // times the layer's scalar; the next layer starts from that stream as the first starts from the embeddings
  std::optional<Linear> per_layer_gate, per_layer_projection;
  c10::optional<torch::Tensor> per_layer_norm, layer_scalar;
  Activation per_layer_activation;
  // Gemma 4 26B-A4B's FFN (models/moe.py's MLPBesideExperts): the dense MLP (gate_up, down) on the normed input and
  // the experts on the stream normed by experts_in_norm (their router on the stream itself), each output normed
  c10::optional<torch::Tensor> beside_mlp_norm, experts_in_norm, experts_out_norm;

  // an MLP after the mixer: a dense one or a mixture (Mamba-2's own layers have none)
  bool has_mlp() const { return experts.has_value() || !down.parts.empty(); }
  bool ends_with_stream() const { return per_layer_gate.has_value() || layer_scalar.has_value(); }
};

// One KV group's part of a decode step (attention/backend.py's AttentionMetadata and KernelRows): each row's cache
// slot, block table and context length (the token included), the first key where the group has a window, and the
// attention mass per block to add to where it was asked for.
struct GroupStep {
  torch::Tensor slots, block_tables, context_lens;
  std::optional<torch::Tensor> window_starts, mass;
};

struct DecodeStack {
  std::vector<Layer> layers;
  torch::Tensor final_norm;
  c10::optional<torch::Tensor> final_norm_bias;
  torch::Tensor rope_table;  // float32 [max_positions, head_dim / 2, 2] = (cos, sin)
  int64_t heads, kv_heads, head_dim;
  double eps, scale;
  bool residual_in_fp32 = false;  // Mamba-2's: the residual stream adds in float32, each norm reads it rounded
  bool layer_norm = false;  // LayerNorms (mean-centred, in float32), with the biases given; else RMSNorms
  // under tensor parallelism: the group's in-place sum of a layer's partial attention and MLP outputs (a Python
  // callable, cluster/collectives.py's all_reduce_), called with the GIL taken back; None in one process
  py::object all_reduce;

  DecodeStack(std::vector<Layer> layers, torch::Tensor final_norm, torch::Tensor rope_table, int64_t heads,
              int64_t kv_heads, int64_t head_dim, double eps, double scale, py::object all_reduce,
              bool residual_in_fp32, bool layer_norm, c10::optional<torch::Tensor> final_norm_bias);
  // x: the embeddings [B, hidden] of B decode tokens, one per sequence -> the final norm's output [B, hidden];
  // each layer writes its k, v and attends as its KV group's step says (groups: one per group, the layout's order),
  // or advances its state in each row's state slot (state_slots [B], for a model with state-space layers);
  // query_scales [B] float32: each row's queries multiplied by it in the attention layers that are `tempered` (a
  // model's attention temperature, rope_scaling.py's AttentionTemperature), absent for none; per_layer_inputs
  // [B, layers, width]: each row's per-layer embeddings, for layers with a per_layer_gate (Gemma 4's).
  torch::Tensor forward(torch::Tensor x, torch::Tensor positions, std::vector<GroupStep> groups,
                        c10::optional<torch::Tensor> state_slots, c10::optional<torch::Tensor> query_scales,
                        c10::optional<torch::Tensor> per_layer_inputs) const;

 private:
  // a layer's attention from its normed input h to o_proj's input [B, heads * v_dim]
  torch::Tensor attention(const Layer& layer, const torch::Tensor& h, const torch::Tensor& positions,
                          const GroupStep& step, const c10::optional<torch::Tensor>& query_scales) const;
  torch::Tensor latent_attention(const Layer& layer, const torch::Tensor& h, const torch::Tensor& positions,
                                 const GroupStep& step, const c10::optional<torch::Tensor>& query_scales) const;
  torch::Tensor gemma4_attention(const Layer& layer, const torch::Tensor& h, const torch::Tensor& positions,
                                 const GroupStep& step) const;
  // a layer's end where it ends_with_stream(): the whole stream [B, hidden] -> the stream the next layer starts from
  torch::Tensor layer_end(const Layer& layer, torch::Tensor stream, const c10::optional<torch::Tensor>& per_layer_inputs,
                          int64_t index) const;
  // a state-space layer's mixer from its normed input h to its output [B, hidden]
  torch::Tensor state_mixer(const StateMixer& mixer, const torch::Tensor& h, const torch::Tensor& slots) const;
  torch::Tensor short_conv(const ShortConv& mixer, const torch::Tensor& h, const torch::Tensor& slots) const;
  torch::Tensor gated_delta(const GatedDelta& mixer, const torch::Tensor& h, const torch::Tensor& slots) const;
  torch::Tensor branch_output(const Layer& layer, torch::Tensor x, const c10::optional<torch::Tensor>& norm) const;
  // the stack's norm of x (RMSNorm, or LayerNorm under layer_norm, with its bias where it has one)
  torch::Tensor norm_(const torch::Tensor& x, const torch::Tensor& weight,
                      const c10::optional<torch::Tensor>& bias = c10::nullopt) const;
  // residual += x, then the norm of the sum (without a norm: a copy of the sum)
  torch::Tensor add_norm_(torch::Tensor& residual, const torch::Tensor& x, const c10::optional<torch::Tensor>& weight,
                          const c10::optional<torch::Tensor>& bias = c10::nullopt) const;
  void reduce_(const torch::Tensor& x) const;
};

}  // namespace ridge_stack
