// A decode step's decoder layers in one call from Python.
//
// At batch 1 a small model's layer is ~10 kernel calls of a few microseconds each, and the Python around
// them (module calls, argument unpacking, views) cost as much again: on SmolLM2-135M, 5.5 of an 18 ms step.
// This runs the same kernels, in the same order, from C++: the outputs are bit-identical to the Python
// path's (models/layers.py), which stays the reference and serves everything this does not (prefill,
// speculative verification, shared prefixes, formats without a kernel here).
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <limits>
#include <vector>

#include "decode_stack.h"
#include "ops.h"

namespace ridge_stack {

LinearPart::LinearPart(const std::string& kernel, torch::Tensor weight, torch::Tensor scales,
                       torch::Tensor minimums, int64_t group, bool signed_codes,
                       c10::optional<torch::Tensor> bias, int64_t out_features,
                       c10::optional<torch::Tensor> levels)
    : weight(std::move(weight)), scales(std::move(scales)), minimums(std::move(minimums)), group(group),
      signed_codes(signed_codes), bias(std::move(bias)), out_features(out_features),
      levels(levels.has_value() ? *levels : torch::Tensor()) {
  TORCH_CHECK(!this->levels.defined() || kernel == "grouped_int8", "LinearPart: levels are grouped_int8's");
  if (kernel == "grouped_int8") {
    this->kernel = Kernel::kGrouped;
  } else if (kernel == "int8_dot") {
    this->kernel = Kernel::kInt8Dot;
  } else if (kernel == "dense") {
    this->kernel = Kernel::kDense;
  } else if (kernel == "linear") {
    this->kernel = Kernel::kLinear;
  } else if (kernel == "onednn") {
    this->kernel = Kernel::kOneDnn;
  } else if (kernel == "int4pack") {
    this->kernel = Kernel::kInt4Pack;
  } else {
    TORCH_CHECK(false, "LinearPart: kernel must be grouped_int8, int8_dot, dense, linear, onednn or int4pack, not ",
                kernel);
  }
}

LinearPart::LinearPart(const std::string& kernel, VnniWeight vnni, c10::optional<torch::Tensor> bias,
                       int64_t tiled_min_rows)
    : group(vnni.group), signed_codes(vnni.signed_codes), bias(std::move(bias)), out_features(0),
      vnni(std::move(vnni)), tiled_min_rows(tiled_min_rows) {
  TORCH_CHECK(kernel == "vnni" || kernel == "bf16_dot",
              "LinearPart: a pack_vnni weight's kernel is vnni or bf16_dot, not ", kernel);
  this->kernel = kernel == "vnni" ? Kernel::kVnni : Kernel::kBf16Dot;
}

namespace {

// torch's oneDNN linear over a packed weight (PackedLinear.forward's call), through the dispatcher: the op
// is registered by torch's mkldnn library, not declared in ATen's headers
torch::Tensor onednn_linear(const torch::Tensor& x, const torch::Tensor& packed, const c10::optional<torch::Tensor>& bias) {
  static const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  torch::jit::Stack stack{x, packed, bias.has_value() ? c10::IValue(*bias) : c10::IValue(), std::string("none"),
                          c10::List<c10::optional<at::Scalar>>(), std::string("")};
  op.callBoxed(&stack);
  return stack[0].toTensor();
}

}  // namespace

torch::Tensor LinearPart::operator()(const torch::Tensor& x) const {
  torch::Tensor out;
  switch (kernel) {
    case Kernel::kDense:  // these take the bias themselves, as their modules have them do
      return dense_linear(x, weight, bias);
    case Kernel::kLinear:
      return at::linear(x, weight, bias);
    case Kernel::kOneDnn:
      if (x.size(0) < min_rows) {  // as PackedLinear pads (linear/dense.py)
        const auto padded = torch::cat({x, x.new_zeros({min_rows - x.size(0), x.size(1)})});
        return onednn_linear(padded, weight, bias).narrow(0, 0, x.size(0));
      }
      return onednn_linear(x, weight, bias);
    case Kernel::kInt8Dot:
      out = int8_dot_linear(x, weight, scales, minimums, group, signed_codes);
      break;
    case Kernel::kVnni:
      out = vnni_linear(x, *vnni);
      break;
    case Kernel::kBf16Dot:
      out = x.size(0) < tiled_min_rows ? bf16_dot_linear(x, *vnni) : vnni_tiled_linear(x, *vnni);
      break;
    case Kernel::kGrouped:
      out = grouped_int8_linear(x, weight, scales, minimums, group, levels);
      break;
    case Kernel::kInt4Pack:
      out = at::_weight_int4pack_mm_for_cpu(x, weight, group, scales);
      if (out.size(1) != out_features) out = out.narrow(1, 0, out_features).contiguous();
      break;
  }
  return bias.has_value() ? out.add_(*bias) : out;
}

torch::Tensor Linear::operator()(const torch::Tensor& x) const {
  torch::Tensor out;
  if (parts.size() == 1) {
    out = parts[0](x);
  } else {
    std::vector<torch::Tensor> outs;
    outs.reserve(parts.size());
    for (const auto& part : parts) outs.push_back(part(x));
    out = torch::cat(outs, -1);
  }
  return bias.has_value() ? out.add_(*bias) : out;
}

std::pair<torch::Tensor, torch::Tensor> Experts::route(const torch::Tensor& x) const {
  auto input = x;
  if (router_input_scale.has_value()) {
    const auto normed = at::rms_norm(x.to(torch::kFloat), {x.size(1)}, c10::nullopt, router_input_eps);
    input = normed.to(x.scalar_type()) * *router_input_scale * std::pow(static_cast<double>(x.size(1)), -0.5);
  }
  const auto logits = at::linear(input, router, router_logit_bias).to(torch::kFloat);
  const auto scores = sigmoid ? logits.sigmoid() : logits.softmax(-1);
  auto choice = router_bias.has_value() ? scores + router_bias->to(torch::kFloat) : scores;
  if (groups > 1) {
    const auto grouped = choice.view({x.size(0), groups, -1});
    const auto rating = group_top2 ? std::get<0>(grouped.topk(2, -1)).sum(-1) : grouped.amax(-1);
    const auto best = std::get<1>(rating.topk(topk_groups, -1));
    const auto keep = torch::zeros_like(grouped.select(-1, 0), torch::kBool).scatter_(1, best, true);
    choice = grouped.masked_fill(keep.logical_not().unsqueeze(-1), -std::numeric_limits<double>::infinity())
                 .view_as(choice);
  }
  const auto experts = std::get<1>(choice.topk(top_k, -1));
  auto weights = scores.gather(1, experts);
  if (renormalize) weights = weights / (weights.sum(-1, true) + norm_eps);
  if (expert_scales.has_value()) {
    weights = weights * expert_scales->to(torch::kFloat).index_select(0, experts.flatten()).view_as(experts);
  }
  return {experts, scaling != 1.0 ? weights * scaling : weights};
}

Activation::Activation(const std::string& name, double limit, double alpha, bool gated)
    : limit(limit), alpha(alpha), gated(gated) {
  if (name == "silu") {
    kind = Kind::kSilu;
  } else if (name == "gelu_tanh") {
    kind = Kind::kGeluTanh;
  } else if (name == "swiglu_oai") {
    kind = Kind::kSwigluOai;
  } else if (name == "relu2") {
    kind = Kind::kRelu2;
    this->gated = false;
  } else {
    TORCH_CHECK(false, "Activation: silu, gelu_tanh, swiglu_oai or relu2, not ", name);
  }
  TORCH_CHECK(this->gated || kind == Kind::kRelu2 || kind == Kind::kGeluTanh,
              "Activation: an ungated MLP takes relu2 or gelu_tanh, not ", name);
}

torch::Tensor Activation::operator()(const torch::Tensor& gate_up) const {
  if (kind == Kind::kSilu) return gated ? silu_mul(gate_up) : at::silu(gate_up);
  if (kind == Kind::kRelu2) return at::relu(gate_up).square();  // up alone: no gate
  if (!gated) return at::gelu(gate_up, "tanh");
  const auto halves = gate_up.chunk(2, -1);
  if (kind == Kind::kGeluTanh) return at::gelu(halves[0], "tanh") * halves[1];
  const auto gate = halves[0].clamp_max(limit), up = halves[1].clamp(-limit, limit);
  return gate * torch::sigmoid(gate * alpha) * (up + 1);
}

torch::Tensor Experts::operator()(const torch::Tensor& x, const c10::optional<torch::Tensor>& router_input) const {
  const auto [chosen, weights] = route(router_input.has_value() ? *router_input : x);
  // each expert's tokens and weights in the order of a stable sort of the flattened choices (the Python path's)
  const int64_t num_experts = static_cast<int64_t>(gate_up.size());
  std::vector<std::vector<int64_t>> tokens(num_experts);
  std::vector<std::vector<float>> token_weights(num_experts);
  const auto chosen_a = chosen.accessor<int64_t, 2>();
  const auto weights_a = weights.accessor<float, 2>();
  for (int64_t t = 0; t < chosen.size(0); ++t) {
    for (int64_t slot = 0; slot < top_k; ++slot) {
      tokens[chosen_a[t][slot]].push_back(t);
      token_weights[chosen_a[t][slot]].push_back(weights_a[t][slot]);
    }
  }
  std::vector<int64_t> active;  // the experts this process runs that some token chose
  for (int64_t e = 0; e < num_experts; ++e) {
    if (!tokens[e].empty() && !gate_up[e].parts.empty()) active.push_back(e);
  }
  const auto long_options = torch::TensorOptions().dtype(torch::kLong);
  std::vector<torch::Tensor> rows(active.size()), outs(active.size());
  for (size_t i = 0; i < active.size(); ++i) {
    rows[i] = torch::tensor(tokens[active[i]], long_options);
  }
  // the i-th active expert's tokens' weights [n, 1] float32
  const auto weights_of = [&](size_t i) {
    return torch::tensor(token_weights[active[i]], torch::TensorOptions().dtype(torch::kFloat)).unsqueeze(1);
  };
  const auto run = [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t e = active[i];
      auto input = x.index_select(0, rows[i]);
      if (scale_input) input = input * weights_of(i).to(x.scalar_type());
      outs[i] = down[e](activation(gate_up[e](input)));
    }
  };
  const int64_t count = static_cast<int64_t>(active.size());
  if (count >= at::get_num_threads()) {
    at::parallel_for(0, count, 1, run);  // the kernels inside run on their caller's thread
  } else {
    run(0, count);
  }
  auto out = torch::zeros_like(x);
  for (size_t i = 0; i < active.size(); ++i) {
    out.index_add_(0, rows[i], scale_input ? outs[i].to(out.scalar_type())
                                           : (outs[i] * weights_of(i)).to(out.scalar_type()));
  }
  if (shared_gate_up.has_value()) {
    auto shared = (*shared_down)(activation((*shared_gate_up)(x)));
    if (shared_gate.has_value()) shared = at::linear(x, *shared_gate).sigmoid() * shared;
    out += shared;
  }
  return out;
}

DecodeStack::DecodeStack(std::vector<Layer> layers, torch::Tensor final_norm, torch::Tensor rope_table,
                         int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, double scale,
                         py::object all_reduce, bool residual_in_fp32, bool layer_norm,
                         c10::optional<torch::Tensor> final_norm_bias)
    : layers(std::move(layers)), final_norm(std::move(final_norm)), final_norm_bias(std::move(final_norm_bias)),
      rope_table(std::move(rope_table)),
      heads(heads), kv_heads(kv_heads), head_dim(head_dim), eps(eps), scale(scale),
      residual_in_fp32(residual_in_fp32), layer_norm(layer_norm), all_reduce(std::move(all_reduce)) {
  TORCH_CHECK(this->rope_table.is_contiguous() && this->rope_table.scalar_type() == torch::kFloat,
              "DecodeStack: rope_table float32 [max_positions, head_dim / 2, 2]");
  TORCH_CHECK(layer_norm || !this->final_norm_bias.has_value(), "DecodeStack: only LayerNorms have a bias");
}

// The order of models/layers.py's DecoderLayer.forward, op for op; residual: the stream before x is added.
torch::Tensor DecodeStack::forward(torch::Tensor x, torch::Tensor positions, std::vector<GroupStep> groups,
                                   c10::optional<torch::Tensor> state_slots,
                                   c10::optional<torch::Tensor> query_scales,
                                   c10::optional<torch::Tensor> per_layer_inputs) const {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "DecodeStack: x [B, hidden] contiguous");
  const int64_t rows = x.size(0);
  TORCH_CHECK(positions.numel() == rows, "DecodeStack: one position per row");
  TORCH_CHECK(!state_slots.has_value() || state_slots->numel() == rows, "DecodeStack: one state slot per row");
  if (query_scales.has_value()) {  // as the rows' queries' dtype, shaped to multiply [B, heads, dim]
    TORCH_CHECK(query_scales->numel() == rows, "DecodeStack: one query scale per row");
    query_scales = query_scales->to(x.scalar_type()).view({rows, 1, 1});
  }
  for (const GroupStep& step : groups) {
    TORCH_CHECK(step.slots.numel() == rows && step.block_tables.size(0) == rows && step.context_lens.numel() == rows &&
                    (!step.window_starts.has_value() || step.window_starts->numel() == rows),
                "DecodeStack: each group's step has one slot, block table, context length (and window start) per row");
  }
  TORCH_CHECK(!per_layer_inputs.has_value() ||
                  (per_layer_inputs->size(0) == rows && per_layer_inputs->size(1) == static_cast<int64_t>(layers.size())),
              "DecodeStack: per_layer_inputs [B, layers, width]");
  torch::Tensor residual;
  for (size_t index = 0; index < layers.size(); ++index) {
    const Layer& layer = layers[index];
    torch::Tensor h;
    if (!residual.defined()) {  // the first layer (the embeddings), or one after a layer that ends with the stream
      residual = residual_in_fp32 ? x.to(torch::kFloat) : x;
      h = layer.input_norm.has_value() ? norm_(x, *layer.input_norm, layer.input_norm_bias) : x;
    } else {
      h = add_norm_(residual, x, layer.input_norm, layer.input_norm_bias);
    }
    if (layer.ssm.has_value() || layer.short_conv.has_value() || layer.gated_delta.has_value()) {
      TORCH_CHECK(state_slots.has_value(), "DecodeStack: a state-space layer needs the rows' state slots");
      x = layer.ssm.has_value()          ? state_mixer(*layer.ssm, h, *state_slots)
          : layer.short_conv.has_value() ? short_conv(*layer.short_conv, h, *state_slots)
                                         : gated_delta(*layer.gated_delta, h, *state_slots);
    } else {
      TORCH_CHECK(layer.group < static_cast<int64_t>(groups.size()), "DecodeStack: no step for KV group ", layer.group);
      const GroupStep& step = groups[layer.group];
      x = layer.o_proj(layer.latent.has_value() ? latent_attention(layer, h, positions, step, query_scales)
                       : layer.gemma4             ? gemma4_attention(layer, h, positions, step)
                                                  : attention(layer, h, positions, step, query_scales));
    }
    if (layer.parallel) x = x + layer.down(layer.activation(layer.gate_up(h)));  // the MLP on the mixer's input
    reduce_(x);
    x = branch_output(layer, x, layer.attn_out_norm);
    if (layer.parallel || !layer.has_mlp()) continue;
    h = add_norm_(residual, x, layer.post_attn_norm, layer.post_attn_norm_bias);
    if (layer.experts_in_norm.has_value()) {  // MLPBesideExperts.forward: each branch whole before its norm
      const auto stream = residual.to(h.scalar_type());
      auto dense = layer.down(layer.activation(layer.gate_up(h)));
      auto routed = (*layer.experts)(at::rms_norm(stream, {stream.size(1)}, *layer.experts_in_norm, eps), stream);
      reduce_(dense);
      reduce_(routed);
      x = at::rms_norm(dense, {h.size(1)}, *layer.beside_mlp_norm, eps) +
          at::rms_norm(routed, {h.size(1)}, *layer.experts_out_norm, eps);
    } else {
      x = layer.experts.has_value() ? (*layer.experts)(h, c10::nullopt)
                                    : layer.down(layer.activation(layer.gate_up(h)));
      reduce_(x);
    }
    x = branch_output(layer, x, layer.mlp_out_norm);
    if (layer.ends_with_stream()) {
      x = layer_end(layer, residual + x, per_layer_inputs, static_cast<int64_t>(index));
      residual = torch::Tensor();
    }
  }
  return residual.defined() ? add_norm_(residual, x, final_norm, final_norm_bias) : norm_(x, final_norm, final_norm_bias);
}

// models/layers.py's DecoderLayer._gemma4_end
torch::Tensor DecodeStack::layer_end(const Layer& layer, torch::Tensor stream,
                                     const c10::optional<torch::Tensor>& per_layer_inputs, int64_t index) const {
  if (layer.per_layer_gate.has_value()) {
    TORCH_CHECK(per_layer_inputs.has_value(), "DecodeStack: a per-layer gate needs the rows' per_layer_inputs");
    const auto gate = layer.per_layer_activation((*layer.per_layer_gate)(stream));
    const auto branch = (*layer.per_layer_projection)(gate * per_layer_inputs->select(1, index));
    stream = stream + at::rms_norm(branch, {branch.size(1)}, *layer.per_layer_norm, eps);
  }
  return layer.layer_scalar.has_value() ? stream * *layer.layer_scalar : stream;
}

// models/layers.py's RMSNorm.forward with a residual: a float32 stream is added to and read back rounded; without a
// norm, ResidualAdd.forward's: the stream itself, a copy in x's dtype
torch::Tensor DecodeStack::add_norm_(torch::Tensor& residual, const torch::Tensor& x,
                                     const c10::optional<torch::Tensor>& weight,
                                     const c10::optional<torch::Tensor>& bias) const {
  if (!weight.has_value()) {
    residual.add_(x);
    return residual.to(x.scalar_type(), /*non_blocking=*/false, /*copy=*/true);
  }
  if (layer_norm || residual.scalar_type() != x.scalar_type()) {
    residual.add_(x);
    return norm_(residual.to(x.scalar_type()), *weight, bias);
  }
  return add_rms_norm_(residual, x, *weight, eps);
}

// models/layers.py's RMSNorm, or its LayerNorm (computed in float32; Cohere's without a bias, StarCoder2's with)
torch::Tensor DecodeStack::norm_(const torch::Tensor& x, const torch::Tensor& weight,
                                 const c10::optional<torch::Tensor>& bias) const {
  if (!layer_norm) return at::rms_norm(x, {x.size(1)}, weight, eps);
  const auto float_bias = bias.has_value() ? c10::optional<torch::Tensor>(bias->to(torch::kFloat)) : c10::nullopt;
  return at::layer_norm(x.to(torch::kFloat), {x.size(1)}, weight.to(torch::kFloat), float_bias, eps)
      .to(x.scalar_type());
}

// models/mamba.py's Mamba2Mixer.forward for decode rows, op for op, its recurrence on kernels/state_space.cpp's
torch::Tensor DecodeStack::state_mixer(const StateMixer& m, const torch::Tensor& h, const torch::Tensor& slots) const {
  const int64_t rows = h.size(0), heads = m.ssm_state.size(1), inner = heads * m.ssm_state.size(2);
  const auto parts = m.in_proj(h).split_with_sizes({inner, m.conv_weight.size(0), heads}, -1);
  auto y = mamba2_decode_(parts[1], parts[2], m.conv_state, m.ssm_state, slots, m.conv_weight, m.conv_bias, m.dt_bias,
                          m.A_log, m.D, m.groups, m.dt_min, m.dt_max);
  y = y * at::silu(parts[0].to(torch::kFloat));
  y = at::rms_norm(y.view({rows, m.groups, inner / m.groups}), {inner / m.groups}, c10::nullopt, eps)
          .view({rows, inner});
  return m.out_proj((y * m.norm_weight).to(h.scalar_type()));  // y float32: the product widens the weight
}

// models/short_conv.py's ShortConvMixer.forward for decode rows, op for op
torch::Tensor DecodeStack::short_conv(const ShortConv& m, const torch::Tensor& h, const torch::Tensor& slots) const {
  const auto parts = m.in_proj(h).chunk(3, -1);  // B, C, x
  const auto gated = (parts[0] * parts[2]).to(torch::kFloat);
  const auto window = at::cat({m.conv_state.index_select(0, slots), gated.unsqueeze(-1)}, -1);  // [B, hidden, taps]
  m.conv_state.index_copy_(0, slots, window.narrow(2, 1, window.size(2) - 1));
  auto out = (window * m.conv_weight.to(torch::kFloat)).sum(-1);
  if (m.conv_bias.has_value()) out.add_(m.conv_bias->to(torch::kFloat));
  return m.out_proj((parts[1].to(torch::kFloat) * out).to(h.scalar_type()));
}

// models/gated_delta.py's GatedDeltaMixer.forward for decode rows (its _activate and _step), op for op
torch::Tensor DecodeStack::gated_delta(const GatedDelta& m, const torch::Tensor& h, const torch::Tensor& slots) const {
  const int64_t heads = m.ssm_state.size(1), value_dim = m.ssm_state.size(2), key_dim = m.ssm_state.size(3);
  const int64_t inner = heads * value_dim, channels = m.conv_weight.size(0), width = m.groups * key_dim;
  const auto parts = m.in_proj(h).split_with_sizes({channels, inner, heads, heads}, -1);  // q k v, z, b, alpha
  const auto beta = at::sigmoid(parts[2].to(torch::kFloat));
  const auto decay = -at::exp(m.A_log.to(torch::kFloat)) *
                     at::softplus(parts[3].to(torch::kFloat) + m.dt_bias.to(torch::kFloat));
  const auto window = at::cat({m.conv_state.index_select(0, slots), parts[0].to(torch::kFloat).unsqueeze(-1)}, -1);
  m.conv_state.index_copy_(0, slots, window.narrow(2, 1, window.size(2) - 1));
  auto conv_out = (window * m.conv_weight.to(torch::kFloat)).sum(-1);
  if (m.conv_bias.has_value()) conv_out = conv_out + m.conv_bias->to(torch::kFloat);
  const auto qkv = at::silu(conv_out).split_with_sizes({width, width, inner}, -1);
  const auto heads_of = [&](const torch::Tensor& t) {  // each value head its group's key-wide vector, L2-normed
    const auto grouped = t.unflatten(-1, {m.groups, key_dim});
    const auto normed = grouped * at::rsqrt(grouped.square().sum(-1, true) + 1e-6);
    return m.tiled ? normed.repeat({1, heads / m.groups, 1}) : normed.repeat_interleave(heads / m.groups, 1);
  };
  const auto q = heads_of(qkv[0]) * std::pow(static_cast<double>(key_dim), -0.5), k = heads_of(qkv[1]);
  const auto v = qkv[2].unflatten(-1, {heads, value_dim});
  auto state = m.ssm_state.index_select(0, slots) * at::exp(decay).unsqueeze(-1).unsqueeze(-1);
  const auto correction = beta.unsqueeze(-1) * (v - at::matmul(state, k.unsqueeze(-1)).squeeze(-1));
  state += correction.unsqueeze(-1) * k.unsqueeze(2);
  m.ssm_state.index_copy_(0, slots, state);
  const auto y = at::matmul(state, q.unsqueeze(-1)).squeeze(-1);
  const auto normed = at::rms_norm(y, {value_dim}, c10::nullopt, eps).to(h.scalar_type()) * m.norm_weight;
  const auto gated = normed * at::silu(parts[1].to(torch::kFloat)).view({-1, heads, value_dim});
  return m.out_proj(gated.flatten(1).to(h.scalar_type()));
}

// a mixer's or an MLP's output as it joins the residual stream: its sandwich norm, then the residual multiplier
torch::Tensor DecodeStack::branch_output(const Layer& layer, torch::Tensor x,
                                         const c10::optional<torch::Tensor>& norm) const {
  if (norm.has_value()) x = at::rms_norm(x, {x.size(1)}, *norm, eps);
  return layer.residual_multiplier != 1.0 ? x * layer.residual_multiplier : x;
}

torch::Tensor DecodeStack::attention(const Layer& layer, const torch::Tensor& h, const torch::Tensor& positions,
                                     const GroupStep& step, const c10::optional<torch::Tensor>& query_scales) const {
  const int64_t rows = h.size(0);
  const torch::Tensor& table = layer.rope_table.has_value() ? *layer.rope_table : rope_table;
  auto qkv = layer.qkv(h).view({rows, -1, head_dim});
  auto split = layer.output_gate ? qkv.split_with_sizes({heads, kv_heads, kv_heads, heads}, 1)
                                 : qkv.split_with_sizes({heads, kv_heads, kv_heads}, 1);
  torch::Tensor q = split[0], k = split[1], v = split[2];
  // a partial rotary (a table narrower than the head) turns each head's first dims, the rest pass through
  const int64_t rotary_dim = table.size(1) * 2;
  const auto rotated = [&](const torch::Tensor& x) { return rotary_dim < head_dim ? x.narrow(2, 0, rotary_dim) : x; };
  if (layer.q_norm.has_value() && layer_norm) {  // Command R+'s: a LayerNorm over each head, each its own weight
    q = (at::layer_norm(q.to(torch::kFloat), {head_dim}, c10::nullopt, c10::nullopt, eps) *
         layer.q_norm->to(torch::kFloat))
            .to(h.scalar_type());
    k = (at::layer_norm(k.to(torch::kFloat), {head_dim}, c10::nullopt, c10::nullopt, eps) *
         layer.k_norm->to(torch::kFloat))
            .to(h.scalar_type());
    rotary_(rotated(q), positions, table, heads);
    rotary_(rotated(k), positions, table, kv_heads);
  } else if (layer.q_norm.has_value()) {
    if (layer.q_norm->numel() != head_dim) {  // OLMoE's: over all of q's heads at once, and all of k's
      q = at::rms_norm(q.reshape({rows, -1}), {q.size(1) * head_dim}, *layer.q_norm, eps).view({rows, heads, head_dim});
      k = at::rms_norm(k.reshape({rows, -1}), {k.size(1) * head_dim}, *layer.k_norm, eps)
              .view({rows, kv_heads, head_dim});
    } else {
      q = at::rms_norm(q, {head_dim}, *layer.q_norm, eps);
      k = at::rms_norm(k, {head_dim}, *layer.k_norm, eps);
    }
    rotary_(rotated(q), positions, table, heads);
    rotary_(rotated(k), positions, table, kv_heads);
  } else {  // q and k side by side in qkv: rotated in one go
    rotary_(rotated(qkv), positions, table, heads + kv_heads);
  }
  if (layer.tempered && query_scales.has_value()) q.mul_(*query_scales);
  std::tuple<torch::Tensor, torch::Tensor> attended;  // and each row and head's log-sum-exp
  if (layer.k_scales.has_value()) {
    quantized_cache_write_(layer.k_cache, layer.v_cache, *layer.k_scales, *layer.v_scales, k, v, step.slots,
                           layer.key_center, layer.fp8);
    attended = quantized_paged_decode(q, layer.k_cache, layer.v_cache, *layer.k_scales, *layer.v_scales,
                                      step.block_tables, step.context_lens, scale, step.window_starts, layer.fp8,
                                      step.mass);
  } else {
    cache_write_(layer.k_cache, layer.v_cache, k, v, step.slots);
    attended = paged_decode(q, layer.k_cache, layer.v_cache, step.block_tables, step.context_lens, scale,
                            step.window_starts, step.mass);
  }
  auto& [out, lse] = attended;
  if (layer.sinks.has_value()) {  // attention/backend.py's sink_correction_: out * Z / (Z + e^sink)
    out.mul_(torch::sigmoid(lse - layer.sinks->to(torch::kFloat)).to(out.scalar_type()).unsqueeze(-1));
  }
  if (layer.output_gate) return out.reshape({rows, heads * head_dim}) * torch::sigmoid(split[3].reshape({rows, -1}));
  return out.reshape({rows, heads * head_dim});
}

// models/layers.py's Attention._forward_gemma4, op for op
torch::Tensor DecodeStack::gemma4_attention(const Layer& layer, const torch::Tensor& h, const torch::Tensor& positions,
                                            const GroupStep& step) const {
  const int64_t rows = h.size(0), dim = layer.head_dim > 0 ? layer.head_dim : head_dim;
  const int64_t kv = layer.kv_heads > 0 ? layer.kv_heads : kv_heads;
  const torch::Tensor& table = layer.rope_table.has_value() ? *layer.rope_table : rope_table;
  const int64_t rotary_dim = table.size(1) * 2;
  const auto rotated = [&](const torch::Tensor& x) { return rotary_dim < dim ? x.narrow(2, 0, rotary_dim) : x; };
  const auto qkv = layer.qkv(h).view({rows, -1, dim});
  const auto q = at::rms_norm(qkv.narrow(1, 0, heads), {dim}, *layer.q_norm, eps);
  if (!layer.kv_shared) {
    const auto raw_k = qkv.narrow(1, heads, kv);
    const auto v = at::rms_norm(layer.values_from_keys ? raw_k : qkv.narrow(1, heads + kv, kv), {dim}, c10::nullopt, eps);
    const auto k = at::rms_norm(raw_k, {dim}, *layer.k_norm, eps);
    rotary_(rotated(k), positions, table, kv);
    if (layer.k_scales.has_value())
      quantized_cache_write_(layer.k_cache, layer.v_cache, *layer.k_scales, *layer.v_scales, k, v, step.slots,
                             layer.key_center, layer.fp8);
    else
      cache_write_(layer.k_cache, layer.v_cache, k, v, step.slots);
  }
  rotary_(rotated(q), positions, table, heads);
  const auto attended =
      layer.k_scales.has_value()
          ? quantized_paged_decode(q, layer.k_cache, layer.v_cache, *layer.k_scales, *layer.v_scales,
                                   step.block_tables, step.context_lens, scale, step.window_starts, layer.fp8, step.mass)
          : paged_decode(q, layer.k_cache, layer.v_cache, step.block_tables, step.context_lens, scale,
                         step.window_starts, step.mass);
  return std::get<0>(attended).reshape({rows, heads * dim});
}

// models/mla.py's LatentAttention.forward and attention/latent.py's decode, op for op
torch::Tensor DecodeStack::latent_attention(const Layer& layer, const torch::Tensor& h,
                                            const torch::Tensor& positions, const GroupStep& step,
                                            const c10::optional<torch::Tensor>& query_scales) const {
  const LatentProjections& p = *layer.latent;
  const int64_t rows = h.size(0), local_heads = p.w_uk.size(0), nope = p.w_uk.size(1), rank = p.w_uk.size(2);
  auto q = p.q_a.has_value() ? p.q(at::rms_norm((*p.q_a)(h), {p.q_a_norm->size(0)}, *p.q_a_norm, eps)) : p.q(h);
  q = q.view({rows, local_heads, nope + p.rope});
  // before the rotary, as models/mla.py: the two commute
  if (layer.tempered && query_scales.has_value()) q = q * *query_scales;
  const auto q_nope = q.narrow(2, 0, nope);
  const auto q_pe = q.narrow(2, nope, p.rope).contiguous();
  const auto kv = p.kv_a(h);
  const auto latent = kv.narrow(1, 0, rank);
  const auto k_pe = kv.narrow(1, rank, p.rope).contiguous().view({rows, 1, p.rope});
  rotary_(q_pe, positions, rope_table, local_heads);
  rotary_(k_pe, positions, rope_table, 1);
  const auto query = torch::cat({head_matmul(q_nope, p.w_uk, false), q_pe}, -1);
  const auto row = torch::cat({at::rms_norm(latent, {rank}, p.kv_a_norm, eps), k_pe.view({rows, p.rope})}, -1);
  layer.k_cache.view({-1, rank + p.rope}).index_copy_(0, step.slots, row);
  if (p.index_key.has_value()) {  // models/sparse_index.py's Indexer.forward, its key's part
    const IndexerKey& index = *p.index_key;
    const int64_t dim = index.norm_weight.size(0);
    const auto key = at::layer_norm(index.wk(h), {dim}, index.norm_weight, index.norm_bias, 1e-6).view({rows, 1, dim});
    rotary_(key.narrow(2, 0, p.rope), positions, rope_table, 1);
    index.cache.view({-1, dim}).index_copy_(0, step.slots, key.view({rows, dim}));
  }
  const auto mixed = latent_decode(query, layer.k_cache, step.block_tables, step.context_lens, scale, rank,
                                   step.window_starts, step.mass)
                         .narrow(2, 0, rank);
  return head_matmul(mixed, p.w_uv, true).reshape({rows, local_heads * p.w_uv.size(1)});
}

void DecodeStack::reduce_(const torch::Tensor& x) const {
  if (all_reduce.is_none()) return;
  py::gil_scoped_acquire gil;  // forward runs without it
  all_reduce(x);
}

}  // namespace ridge_stack
