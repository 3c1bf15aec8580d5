// One extension module for ridge's hand-written CPU kernels (see cpu_ops.py for why each exists).
#include <torch/extension.h>

#include "decode_stack.h"
#include "ops.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "decode attention over the paged KV cache -> (out, logsumexp)",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("context_lens"),
        py::arg("scale"), py::arg("window_starts") = py::none(), py::arg("mass") = py::none());
  m.def("quantized_paged_decode", &quantized_paged_decode,
        "paged_decode over int8 / fp8 / int4 codes and their scales -> (out, logsumexp)", py::arg("q"),
        py::arg("k_codes"), py::arg("v_codes"), py::arg("k_scales"), py::arg("v_scales"), py::arg("block_tables"),
        py::arg("context_lens"), py::arg("scale"), py::arg("window_starts") = py::none(), py::arg("fp8") = false,
        py::arg("mass") = py::none());
  m.def("quantized_cache_write_", &quantized_cache_write_,
        "k, v [T, kv_heads, d] quantized into an int8 / fp8 cache's codes and scales at slots (keys less center)",
        py::arg("k_codes"), py::arg("v_codes"), py::arg("k_scales"), py::arg("v_scales"), py::arg("k"), py::arg("v"),
        py::arg("slots"), py::arg("center") = py::none(), py::arg("fp8") = false);
  m.def("latent_decode", &latent_decode,
        "latent attention's decode over its paged rows -> [B, heads, dim], each head's weighted sum of latents",
        py::arg("q"), py::arg("cache"), py::arg("block_tables"), py::arg("context_lens"), py::arg("scale"),
        py::arg("value_dim"), py::arg("window_starts") = py::none(), py::arg("mass") = py::none());
  m.def("head_matmul", &head_matmul, "x[:, h] @ weight[h] (transposed: weight[h].T) for every head h",
        py::arg("x"), py::arg("weight"), py::arg("transposed"));
  m.def("add_rms_norm_", &add_rms_norm_, "residual += x in place; return RMSNorm(residual)");
  m.def("silu_mul", &silu_mul, "silu(gate) * up of a [.., 2F] gate|up tensor");
  m.def("mamba2_decode_", &mamba2_decode_,
        "a Mamba-2 mixer's decode token: the convolution step and the recurrence, in place on each row's slot of the "
        "states -> y [rows, heads * head_dim] float32 (D's skip added)",
        py::arg("xbc"), py::arg("dt"), py::arg("conv_state"), py::arg("ssm_state"), py::arg("slots"),
        py::arg("conv_weight"), py::arg("conv_bias"), py::arg("dt_bias"), py::arg("A_log"), py::arg("D"),
        py::arg("groups"), py::arg("dt_min"), py::arg("dt_max"));
  m.def("rotary_", &rotary_, "rotate the first heads of x [T, heads, d] in place by their positions");
  m.def("grouped_int8_linear", &grouped_int8_linear,
        "x @ (codes * scales + minimums).T with one scale (and minimum) per group of input columns; 4-bit codes "
        "read as levels[code] where levels (int8 [16]; else an empty tensor) are given");
  m.def("int8_dot_linear", &int8_dot_linear,
        "grouped_int8_linear with x quantized to int8 per 32 values: integer dot products, not exact");
  m.def("int8_dot_available", &int8_dot_available, "whether int8_dot_linear was built (AVX2)");
  m.def("gguf_dequantize_", &gguf_dequantize_, "GGUF blocks into float32 values, gguf's to the bit",
        py::arg("out"), py::arg("blocks"), py::arg("kind"), py::arg("scales"), py::arg("minimums") = py::none());
  py::class_<VnniWeight>(m, "VnniWeight", "a weight in vnni_linear's layout (linear/layouts.py's pack_vnni)")
      .def(py::init([](torch::Tensor packed, int64_t group, bool nibbles, bool signed_codes, bool minimums,
                       double unit, bool seven_bit) {
             return VnniWeight{packed, group, nibbles, signed_codes, minimums, unit, seven_bit};
           }),
           py::arg("packed"), py::arg("group"), py::arg("nibbles"), py::arg("signed_codes"), py::arg("minimums"),
           py::arg("unit"), py::arg("seven_bit") = false)
      .def_readonly("packed", &VnniWeight::packed)
      .def_readonly("seven_bit", &VnniWeight::seven_bit);
  m.def("vnni_linear", &vnni_linear,
        "int8_dot_linear's arithmetic as a matrix kernel for AVX512-VNNI, over pack_vnni's layout",
        py::arg("x"), py::arg("weight"));
  m.def("vnni_available", &vnni_available, "whether vnni_linear was built (AVX512-VNNI)");
  m.def("bf16_dot_linear", &bf16_dot_linear,
        "x @ W.T for bfloat16 x, W 4- or 8-bit codes in pack_vnni's layout: exact, on AVX512-BF16 dot products",
        py::arg("x"), py::arg("weight"));
  m.def("bf16_dot_available", &bf16_dot_available, "whether bf16_dot_linear was built (AVX512-BF16)");
  m.def("vnni_tiled_linear", &vnni_tiled_linear,
        "x @ W.T for many bfloat16 rows, W (pack_vnni's layout) dequantized to bf16 a tile at a time for "
        "oneDNN's matmul", py::arg("x"), py::arg("weight"));
  m.def("vnni_dequantize_onednn_", &vnni_dequantize_onednn_,
        "W (pack_vnni's layout) dequantized to bf16 into a weight in oneDNN's packed form, in place: a prompt's "
        "matmul on it reads what oneDNN's fastest bf16 kernels read", py::arg("packed"), py::arg("weight"));
  m.def("onednn_bytes", &onednn_bytes, "the first nbytes bytes of a tensor of layout mkldnn, as uint8",
        py::arg("packed"), py::arg("nbytes"));
  m.def("vnni_rows", &vnni_rows,
        "rows (output channels) of a pack_vnni weight dequantized to float32 [T, K]: a tied table's lookup",
        py::arg("weight"), py::arg("rows"), py::arg("k_dim"));
  m.def("dense_linear", &dense_linear, "x @ weight.T (+ bias) for a few float32 or bf16 rows, on every thread",
        py::arg("x"), py::arg("weight"), py::arg("bias") = py::none());
  m.def("int4pack_linear", &int4pack_linear,
        "x @ W.T for many rows of x, W in torch's CPU int4 layout, dequantized a tile at a time");
  m.def("cache_gather", &cache_gather, "K, V of the given blocks as dense rows [kv_heads, n * bs, d]");
  m.def("merge_attention_", &merge_attention_,
        "merge another attention part (folded [kv_heads, R * group, d] + lse) into rows of out, in place");
  m.def("cache_write_", &cache_write_, "copy k, v [T, kv_heads, d] into the paged caches at slots");

  using namespace ridge_stack;
  py::class_<LinearPart>(m, "LinearPart", "one kernel call's weights (decode_stack.h)")
      .def(py::init<const std::string&, torch::Tensor, torch::Tensor, torch::Tensor, int64_t, bool,
                    c10::optional<torch::Tensor>, int64_t, c10::optional<torch::Tensor>>(),
           py::arg("kernel"), py::arg("weight"), py::arg("scales"), py::arg("minimums"), py::arg("group"),
           py::arg("signed_codes"), py::arg("bias"), py::arg("out_features"), py::arg("levels") = py::none())
      .def(py::init([](const std::string& kernel, const VnniWeight& weight, c10::optional<torch::Tensor> bias,
                       int64_t tiled_min_rows) { return LinearPart(kernel, weight, std::move(bias), tiled_min_rows); }),
           py::arg("kernel"), py::arg("vnni"), py::arg("bias"), py::arg("tiled_min_rows"))
      .def_readwrite("min_rows", &LinearPart::min_rows);
  py::class_<Linear>(m, "Linear", "a projection: its parts' outputs side by side, plus a bias")
      .def(py::init([](std::vector<LinearPart> parts, c10::optional<torch::Tensor> bias) {
             return Linear{std::move(parts), std::move(bias)};
           }),
           py::arg("parts"), py::arg("bias"))
      .def("__call__", &Linear::operator(), py::arg("x"));
  py::class_<Activation>(m, "Activation", "an MLP's activation, gated or not (models/layers.py's GatedMLP)")
      .def(py::init<const std::string&, double, double, bool>(), py::arg("name"), py::arg("limit") = 0.0,
           py::arg("alpha") = 1.0, py::arg("gated") = true);
  py::class_<Experts>(m, "Experts", "a mixture-of-experts MLP: its router and experts (models/moe.py)")
      .def(py::init([](torch::Tensor router, c10::optional<torch::Tensor> router_bias, int64_t top_k, int64_t groups,
                       int64_t topk_groups, bool sigmoid, bool renormalize, bool group_top2, double scaling,
                       std::vector<Linear> gate_up, std::vector<Linear> down, c10::optional<Linear> shared_gate_up,
                       c10::optional<Linear> shared_down, c10::optional<torch::Tensor> shared_gate,
                       c10::optional<torch::Tensor> router_logit_bias, Activation activation, double norm_eps,
                       bool scale_input, c10::optional<torch::Tensor> router_input_scale,
                       c10::optional<torch::Tensor> expert_scales, double router_input_eps) {
             TORCH_CHECK(gate_up.size() == down.size(), "Experts: a gate_up and a down per expert");
             Experts experts{router,  router_bias,    top_k,       groups,        topk_groups,       sigmoid,
                             renormalize, group_top2, scaling, gate_up,    down,          shared_gate_up,
                             shared_down, shared_gate, router_logit_bias, activation, norm_eps, scale_input};
             experts.router_input_scale = router_input_scale;
             experts.expert_scales = expert_scales;
             experts.router_input_eps = router_input_eps;
             return experts;
           }),
           py::arg("router"), py::arg("router_bias"), py::arg("top_k"), py::arg("groups"), py::arg("topk_groups"),
           py::arg("sigmoid"), py::arg("renormalize"), py::arg("group_top2"), py::arg("scaling"),
           py::arg("gate_up"), py::arg("down"), py::arg("shared_gate_up"), py::arg("shared_down"),
           py::arg("shared_gate"), py::arg("router_logit_bias") = py::none(),
           py::arg("activation") = Activation(), py::arg("norm_eps") = 0.0, py::arg("scale_input") = false,
           py::arg("router_input_scale") = py::none(), py::arg("expert_scales") = py::none(),
           py::arg("router_input_eps") = 0.0)
      .def("__call__", &Experts::operator(), py::arg("x"), py::arg("router_input") = py::none());
  py::class_<IndexerKey>(m, "IndexerKey", "sparse attention's indexer key and its cache (models/sparse_index.py)")
      .def(py::init([](Linear wk, torch::Tensor norm_weight, torch::Tensor norm_bias, torch::Tensor cache) {
             TORCH_CHECK(cache.dim() == 3 && cache.size(2) == norm_weight.size(0) && cache.is_contiguous(),
                         "IndexerKey: cache [num_blocks, block_size, dim], contiguous");
             return IndexerKey{wk, norm_weight, norm_bias, cache};
           }),
           py::arg("wk"), py::arg("norm_weight"), py::arg("norm_bias"), py::arg("cache"));
  py::class_<LatentProjections>(m, "LatentProjections", "latent attention's projections (models/mla.py)")
      .def(py::init([](c10::optional<Linear> q_a, c10::optional<torch::Tensor> q_a_norm, Linear q, Linear kv_a,
                       torch::Tensor kv_a_norm, torch::Tensor w_uk, torch::Tensor w_uv, int64_t rope,
                       std::optional<IndexerKey> index_key) {
             TORCH_CHECK(q_a.has_value() == q_a_norm.has_value(), "LatentProjections: q_a comes with q_a_norm");
             TORCH_CHECK(w_uk.dim() == 3 && w_uv.dim() == 3 && w_uk.size(0) == w_uv.size(0) &&
                             w_uk.size(2) == w_uv.size(2),
                         "LatentProjections: w_uk [heads, nope, rank], w_uv [heads, v_dim, rank]");
             return LatentProjections{q_a, q_a_norm, q, kv_a, kv_a_norm, w_uk, w_uv, rope, index_key};
           }),
           py::arg("q_a"), py::arg("q_a_norm"), py::arg("q"), py::arg("kv_a"), py::arg("kv_a_norm"), py::arg("w_uk"),
           py::arg("w_uv"), py::arg("rope"), py::arg("index_key") = py::none());
  py::class_<Layer>(m, "Layer", "one decoder layer's weights and paged caches")
      .def(py::init([](c10::optional<torch::Tensor> input_norm, c10::optional<torch::Tensor> post_attn_norm,
                       c10::optional<torch::Tensor> q_norm,
                       c10::optional<torch::Tensor> k_norm, Linear qkv, Linear o_proj, Linear gate_up, Linear down,
                       torch::Tensor k_cache, torch::Tensor v_cache, c10::optional<torch::Tensor> k_scales,
                       c10::optional<torch::Tensor> v_scales, c10::optional<torch::Tensor> key_center, bool fp8,
                       std::optional<Experts> experts, std::optional<LatentProjections> latent, Activation activation,
                       int64_t group, c10::optional<torch::Tensor> rope_table, c10::optional<torch::Tensor> sinks,
                       c10::optional<torch::Tensor> attn_out_norm, c10::optional<torch::Tensor> mlp_out_norm,
                       double residual_multiplier, std::optional<StateMixer> ssm,
                       std::optional<ShortConv> short_conv, std::optional<GatedDelta> gated_delta, bool output_gate,
                       bool parallel, bool tempered, c10::optional<torch::Tensor> input_norm_bias,
                       c10::optional<torch::Tensor> post_attn_norm_bias, int64_t kv_heads, int64_t head_dim,
                       bool gemma4, bool values_from_keys, bool kv_shared, std::optional<Linear> per_layer_gate,
                       std::optional<Linear> per_layer_projection, c10::optional<torch::Tensor> per_layer_norm,
                       c10::optional<torch::Tensor> layer_scalar, Activation per_layer_activation,
                       c10::optional<torch::Tensor> beside_mlp_norm, c10::optional<torch::Tensor> experts_in_norm,
                       c10::optional<torch::Tensor> experts_out_norm) {
             TORCH_CHECK(beside_mlp_norm.has_value() == experts_in_norm.has_value() &&
                             experts_in_norm.has_value() == experts_out_norm.has_value() &&
                             (!experts_in_norm.has_value() || (experts.has_value() && !down.parts.empty())),
                         "Layer: experts beside a dense MLP come with both and three norms");
             TORCH_CHECK(per_layer_gate.has_value() == per_layer_projection.has_value() &&
                             per_layer_gate.has_value() == per_layer_norm.has_value(),
                         "Layer: a per-layer branch has a gate, a projection and a norm");
             TORCH_CHECK(!gemma4 || (q_norm.has_value() && (kv_shared || k_norm.has_value())),
                         "Layer: Gemma 4's attention norms q (and k, where it projects one)");
             TORCH_CHECK(attn_out_norm.has_value() == mlp_out_norm.has_value(),
                         "Layer: sandwich norms come in pairs (attn_out_norm, mlp_out_norm)");
             Layer layer{input_norm, post_attn_norm, q_norm,     k_norm, qkv,    o_proj, gate_up, down,
                         activation, k_cache,        v_cache,    k_scales, v_scales, key_center, fp8, experts, latent};
             layer.group = group;
             layer.rope_table = rope_table;
             layer.sinks = sinks;
             layer.attn_out_norm = attn_out_norm;
             layer.mlp_out_norm = mlp_out_norm;
             layer.residual_multiplier = residual_multiplier;
             layer.ssm = ssm;
             layer.short_conv = short_conv;
             layer.gated_delta = gated_delta;
             layer.output_gate = output_gate;
             layer.parallel = parallel;
             layer.tempered = tempered;
             layer.input_norm_bias = input_norm_bias;
             layer.post_attn_norm_bias = post_attn_norm_bias;
             layer.kv_heads = kv_heads;
             layer.head_dim = head_dim;
             layer.gemma4 = gemma4;
             layer.values_from_keys = values_from_keys;
             layer.kv_shared = kv_shared;
             layer.per_layer_gate = per_layer_gate;
             layer.per_layer_projection = per_layer_projection;
             layer.per_layer_norm = per_layer_norm;
             layer.layer_scalar = layer_scalar;
             layer.per_layer_activation = per_layer_activation;
             layer.beside_mlp_norm = beside_mlp_norm;
             layer.experts_in_norm = experts_in_norm;
             layer.experts_out_norm = experts_out_norm;
             return layer;
           }),
           py::arg("input_norm"), py::arg("post_attn_norm"), py::arg("q_norm"), py::arg("k_norm"), py::arg("qkv"),
           py::arg("o_proj"), py::arg("gate_up"), py::arg("down"), py::arg("k_cache"), py::arg("v_cache"),
           py::arg("k_scales") = py::none(), py::arg("v_scales") = py::none(), py::arg("key_center") = py::none(),
           py::arg("fp8") = false, py::arg("experts") = py::none(), py::arg("latent") = py::none(),
           py::arg("activation") = Activation(), py::arg("group") = 0, py::arg("rope_table") = py::none(),
           py::arg("sinks") = py::none(), py::arg("attn_out_norm") = py::none(), py::arg("mlp_out_norm") = py::none(),
           py::arg("residual_multiplier") = 1.0, py::arg("ssm") = py::none(), py::arg("short_conv") = py::none(),
           py::arg("gated_delta") = py::none(), py::arg("output_gate") = false, py::arg("parallel") = false,
           py::arg("tempered") = false, py::arg("input_norm_bias") = py::none(),
           py::arg("post_attn_norm_bias") = py::none(), py::arg("kv_heads") = 0, py::arg("head_dim") = 0,
           py::arg("gemma4") = false, py::arg("values_from_keys") = false, py::arg("kv_shared") = false,
           py::arg("per_layer_gate") = py::none(), py::arg("per_layer_projection") = py::none(),
           py::arg("per_layer_norm") = py::none(), py::arg("layer_scalar") = py::none(),
           py::arg("per_layer_activation") = Activation(), py::arg("beside_mlp_norm") = py::none(),
           py::arg("experts_in_norm") = py::none(), py::arg("experts_out_norm") = py::none());
  py::class_<StateMixer>(m, "StateMixer", "a Mamba-2 mixer's weights and its layer's state tensors")
      .def(py::init([](Linear in_proj, Linear out_proj, torch::Tensor conv_weight,
                       c10::optional<torch::Tensor> conv_bias, torch::Tensor dt_bias, torch::Tensor A_log,
                       torch::Tensor D, torch::Tensor norm_weight, int64_t groups, double dt_min, double dt_max,
                       torch::Tensor conv_state, torch::Tensor ssm_state) {
             TORCH_CHECK(ssm_state.dim() == 4, "StateMixer: ssm_state [slots, heads, head_dim, state_size]");
             return StateMixer{in_proj, out_proj, conv_weight, conv_bias, dt_bias, A_log, D, norm_weight, groups,
                               dt_min, dt_max, conv_state, ssm_state};
           }),
           py::arg("in_proj"), py::arg("out_proj"), py::arg("conv_weight"), py::arg("conv_bias"), py::arg("dt_bias"),
           py::arg("A_log"), py::arg("D"), py::arg("norm_weight"), py::arg("groups"), py::arg("dt_min"),
           py::arg("dt_max"), py::arg("conv_state"), py::arg("ssm_state"));
  py::class_<ShortConv>(m, "ShortConv", "LFM2's short convolution's weights and its layer's convolution state")
      .def(py::init([](Linear in_proj, Linear out_proj, torch::Tensor conv_weight,
                       c10::optional<torch::Tensor> conv_bias, torch::Tensor conv_state) {
             TORCH_CHECK(conv_state.dim() == 3 && conv_state.scalar_type() == torch::kFloat,
                         "ShortConv: conv_state float32 [slots, hidden, taps - 1]");
             return ShortConv{in_proj, out_proj, conv_weight, conv_bias, conv_state};
           }),
           py::arg("in_proj"), py::arg("out_proj"), py::arg("conv_weight"), py::arg("conv_bias"),
           py::arg("conv_state"));
  py::class_<GatedDelta>(m, "GatedDelta", "a gated DeltaNet's weights and its layer's state tensors")
      .def(py::init([](Linear in_proj, Linear out_proj, torch::Tensor conv_weight,
                       c10::optional<torch::Tensor> conv_bias, torch::Tensor dt_bias, torch::Tensor A_log,
                       torch::Tensor norm_weight, int64_t groups, bool tiled, torch::Tensor conv_state,
                       torch::Tensor ssm_state) {
             TORCH_CHECK(ssm_state.dim() == 4 && ssm_state.scalar_type() == torch::kFloat,
                         "GatedDelta: ssm_state float32 [slots, heads, value_dim, key_dim]");
             TORCH_CHECK(groups > 0 && ssm_state.size(1) % groups == 0, "GatedDelta: groups must divide the heads");
             return GatedDelta{in_proj, out_proj, conv_weight, conv_bias, dt_bias, A_log, norm_weight, groups, tiled,
                               conv_state, ssm_state};
           }),
           py::arg("in_proj"), py::arg("out_proj"), py::arg("conv_weight"), py::arg("conv_bias"), py::arg("dt_bias"),
           py::arg("A_log"), py::arg("norm_weight"), py::arg("groups"), py::arg("tiled"), py::arg("conv_state"),
           py::arg("ssm_state"));
  py::class_<GroupStep>(m, "GroupStep", "one KV group's part of a decode step")
      .def(py::init([](torch::Tensor slots, torch::Tensor block_tables, torch::Tensor context_lens,
                       std::optional<torch::Tensor> window_starts, std::optional<torch::Tensor> mass) {
             return GroupStep{slots, block_tables, context_lens, window_starts, mass};
           }),
           py::arg("slots"), py::arg("block_tables"), py::arg("context_lens"), py::arg("window_starts") = py::none(),
           py::arg("mass") = py::none());
  py::class_<DecodeStack>(m, "DecodeStack", "a decode step's decoder layers and final norm in one call")
      .def(py::init<std::vector<Layer>, torch::Tensor, torch::Tensor, int64_t, int64_t, int64_t, double, double,
                    py::object, bool, bool, c10::optional<torch::Tensor>>(),
           py::arg("layers"), py::arg("final_norm"), py::arg("rope_table"), py::arg("heads"), py::arg("kv_heads"),
           py::arg("head_dim"), py::arg("eps"), py::arg("scale"), py::arg("all_reduce") = py::none(),
           py::arg("residual_in_fp32") = false, py::arg("layer_norm") = false,
           py::arg("final_norm_bias") = py::none())
      // the GIL released: a server's event loop keeps answering while a step runs
      .def("forward", &DecodeStack::forward, py::call_guard<py::gil_scoped_release>(), py::arg("x"),
           py::arg("positions"), py::arg("groups"), py::arg("state_slots") = py::none(),
           py::arg("query_scales") = py::none(), py::arg("per_layer_inputs") = py::none());
}
