"""Where each tensor of a GGUF file or an HF checkpoint goes in ridge's DecoderModel: name tables per format and
model family, and the lookup. A name that maps to a fused parameter carries its slot (q=0, k=1, v=2; gate=0,
up=1); the loader concatenates the slots along the output dimension."""

from __future__ import annotations

import re

from ridge.config import ModelConfig
from ridge.multimodal.vision_config import VisionConfig

# (source-name pattern, ridge name template, slot in a fused parameter or None)
GGUF_NAMES = [
    (r"token_embd\.weight", "embed_tokens.weight", None),
    (r"output_norm\.weight", "norm.weight", None),
    (r"output\.weight", "lm_head.weight", None),
    (r"blk\.(\d+)\.attn_norm\.weight", "layers.{0}.input_norm.weight", None),
    (r"blk\.(\d+)\.ffn_norm\.weight", "layers.{0}.post_attn_norm.weight", None),
    (r"blk\.(\d+)\.post_attention_norm\.weight", "layers.{0}.attn_out_norm.weight", None),
    (r"blk\.(\d+)\.post_ffw_norm\.weight", "layers.{0}.mlp_out_norm.weight", None),
    (r"blk\.(\d+)\.attn_q\.(weight|bias)", "layers.{0}.attn.qkv.{1}", 0),
    (r"blk\.(\d+)\.attn_k\.(weight|bias)", "layers.{0}.attn.qkv.{1}", 1),
    (r"blk\.(\d+)\.attn_v\.(weight|bias)", "layers.{0}.attn.qkv.{1}", 2),
    (r"blk\.(\d+)\.attn_output\.(weight|bias)", "layers.{0}.attn.o_proj.{1}", None),
    (r"blk\.(\d+)\.attn_q_norm\.weight", "layers.{0}.attn.q_norm.weight", None),
    (r"blk\.(\d+)\.attn_k_norm\.weight", "layers.{0}.attn.k_norm.weight", None),
    (r"blk\.(\d+)\.ffn_gate\.weight", "layers.{0}.mlp.gate_up.weight", 0),
    (r"blk\.(\d+)\.ffn_up\.weight", "layers.{0}.mlp.gate_up.weight", 1),
    (r"blk\.(\d+)\.ffn_down\.weight", "layers.{0}.mlp.down.weight", None),
    # mixtures of experts: the router, each expert (a stacked tensor split by _gguf_tensors: `.{expert}` added to
    # its name), and Qwen2-MoE's shared expert with its gate
    (r"blk\.(\d+)\.ffn_gate_inp\.(weight|bias)", "layers.{0}.mlp.router.{1}", None),
    (r"blk\.(\d+)\.ffn_gate_exps\.(weight|bias)\.(\d+)", "layers.{0}.mlp.experts.{2}.gate_up.{1}", 0),
    (r"blk\.(\d+)\.ffn_up_exps\.(weight|bias)\.(\d+)", "layers.{0}.mlp.experts.{2}.gate_up.{1}", 1),
    (r"blk\.(\d+)\.ffn_down_exps\.(weight|bias)\.(\d+)", "layers.{0}.mlp.experts.{2}.down.{1}", None),
    (r"blk\.(\d+)\.ffn_gate_shexp\.weight", "layers.{0}.mlp.shared_expert.gate_up.weight", 0),
    (r"blk\.(\d+)\.ffn_up_shexp\.weight", "layers.{0}.mlp.shared_expert.gate_up.weight", 1),
    (r"blk\.(\d+)\.ffn_down_shexp\.weight", "layers.{0}.mlp.shared_expert.down.weight", None),
    (r"blk\.(\d+)\.ffn_gate_inp_shexp\.weight", "layers.{0}.mlp.shared_expert_gate.weight", None),
    (r"blk\.(\d+)\.exp_probs_b\.bias", "layers.{0}.mlp.router_bias", None),  # DeepSeek-V3's correction bias
]
# gpt-oss (llama.cpp's gpt-oss), GLM-4.5 (glm4moe) and Seed-OSS: their post_attention_norm is the MLP's input norm
# (Gemma's is a sandwich norm); and each of gpt-oss's attention layers has its sinks
GGUF_MLP_INPUT_NORM = [(r"blk\.(\d+)\.post_attention_norm\.weight", "layers.{0}.post_attn_norm.weight", None)]
GGUF_GPT_OSS_NAMES = [*GGUF_MLP_INPUT_NORM, (r"blk\.(\d+)\.attn_sinks\.weight", "layers.{0}.attn.sinks", None)]
# latent attention (deepseek2): its projections, attn_q among them (not a slot of a fused qkv); attn_kv_b is
# either in the file or joined from llama.cpp's attn_k_b / attn_v_b by _gguf_tensors
GGUF_MLA_NAMES = [(r"blk\.(\d+)\." + source, "layers.{0}.attn." + target, None) for source, target in [
    (r"attn_q\.weight", "q_proj.weight"), (r"attn_q_a\.weight", "q_a.weight"),
    (r"attn_q_a_norm\.weight", "q_a_norm.weight"), (r"attn_q_b\.weight", "q_b.weight"),
    (r"attn_kv_a_mqa\.weight", "kv_a.weight"), (r"attn_kv_a_norm\.weight", "kv_a_norm.weight"),
    (r"attn_kv_b\.weight", "kv_b"),
    # sparse attention's indexer (glm-dsa)
    (r"indexer\.attn_q_b\.weight", "indexer.wq_b.weight"), (r"indexer\.attn_k\.weight", "indexer.wk.weight"),
    (r"indexer\.k_norm\.(weight|bias)", "indexer.k_norm.{1}"),
    (r"indexer\.proj\.weight", "indexer.weights_proj.weight")]]
# tensors kept dense under gguf_native: a router's few weights decide which experts run (models/moe.py's Router),
# and latent attention's kv_b is multiplied per head by slices (models/mla.py), not as a layer
DENSE_UNDER_NATIVE = re.compile(r"blk\.\d+\.(ffn_gate_inp|attn_kv_b|attn_k_b|attn_v_b|exp_probs_b)\.")
# Gemma's sandwich norms: HF's post_attention_layernorm is the norm on attention's output there, not the MLP's
# input norm as in llama
HF_SANDWICH_NAMES = [
    (r"model\.layers\.(\d+)\.post_attention_layernorm\.weight", "layers.{0}.attn_out_norm.weight", None),
    (r"model\.layers\.(\d+)\.pre_feedforward_layernorm\.weight", "layers.{0}.post_attn_norm.weight", None),
    (r"model\.layers\.(\d+)\.post_feedforward_layernorm\.weight", "layers.{0}.mlp_out_norm.weight", None),
]
# Gemma 4's per-layer embeddings (the model's table and projection, each layer's gated branch) and layer scalars
HF_GEMMA4_NAMES = [
    (r"model\.embed_tokens_per_layer\.weight", "embed_per_layer.weight", None),
    (r"model\.per_layer_model_projection\.weight", "per_layer_model_projection.weight", None),
    (r"model\.per_layer_projection_norm\.weight", "per_layer_projection_norm.weight", None),
    *[(r"model\.layers\.(\d+)\." + source, "layers.{0}." + target, None) for source, target in [
        (r"per_layer_input_gate\.weight", "per_layer_gate.weight"),
        (r"per_layer_projection\.weight", "per_layer_projection.weight"),
        (r"post_per_layer_input_norm\.weight", "per_layer_norm.weight"), (r"layer_scalar", "layer_scalar")]],
]
# Gemma 4 26B-A4B's layers: the dense MLP beside the mixture (MLPBesideExperts), the router's projection and scales,
# each expert (the loader splits their stacked tensors), the norms around each
HF_GEMMA4_MOE_NAMES = [(r"model\.layers\.(\d+)\." + source, "layers.{0}.mlp." + target, slot)
                       for source, target, slot in [
                           (r"mlp\.gate_proj\.weight", "mlp.gate_up.weight", 0),
                           (r"mlp\.up_proj\.weight", "mlp.gate_up.weight", 1),
                           (r"mlp\.down_proj\.weight", "mlp.down.weight", None),
                           (r"router\.proj\.weight", "moe.router.weight", None),
                           (r"router\.scale", "moe.router_input_scale", None),
                           (r"router\.per_expert_scale", "moe.expert_scales", None),
                           (r"experts\.(\d+)\.(gate_up|down)\.weight", "moe.experts.{1}.{2}.weight", None),
                           (r"post_feedforward_layernorm_1\.weight", "mlp_out_norm.weight", None),
                           (r"pre_feedforward_layernorm_2\.weight", "experts_in_norm.weight", None),
                           (r"post_feedforward_layernorm_2\.weight", "experts_out_norm.weight", None)]]
# a multimodal checkpoint's language model (Gemma3ForConditionalGeneration): its prefixes, and what is skipped
LANGUAGE_MODEL_PREFIXES = [(r"model\.language_model\.", "model."), (r"language_model\.model\.", "model."),
                            (r"language_model\.lm_head\.", "lm_head.")]
# (Qwen3.5's: its vision tower `visual`, and `mtp`, its multi-token prediction layer, a drafter ridge does not run;
# Llama 4's vision tower: `vision_model`; Gemma 4's vision and audio towers and their embedders)
NOT_LANGUAGE_MODEL = re.compile(
    r"(model\.)?(vision_tower|vision_model|multi_modal_projector|visual|mtp|audio_tower|embed_vision|embed_audio)\.")
# a vision tower ridge runs (Qwen2-VL's: models/vision.py, whose modules carry HF's names; Qwen3-VL's MLPs and
# mergers, named anew, are renamed to them), held as the model's `visual` (Mistral 3's two modules under it)
VISION_TOWER = re.compile(r"(model\.)?(visual\.|(?=(vision_tower|multi_modal_projector)\.))")
# SigLIP's pooling head, which Gemma 3 does not read (it reads every patch's state)
UNREAD_VISION = re.compile(r"vision_tower\.(vision_model\.)?head\.")
_MERGERS = r"visual\.(merger|deepstack_merger_list\.\d+)\."
HF_VISION_NAMES = [(r"visual\.blocks\.(\d+)\.mlp\.linear_fc(1|2)\.(weight|bias)", "visual.blocks.{0}.mlp.fc{1}.{2}",
                    None),
                   (_MERGERS + r"norm\.(weight|bias)", "visual.{0}.ln_q.{1}", None),
                   (_MERGERS + r"linear_fc1\.(weight|bias)", "visual.{0}.mlp.0.{1}", None),
                   (_MERGERS + r"linear_fc2\.(weight|bias)", "visual.{0}.mlp.2.{1}", None),
                   # SigLIP's as Gemma 3's published checkpoints nest it (HF transformers 5 saves it unnested)
                   (r"visual\.vision_tower\.vision_model\.(.+)", "visual.vision_tower.{0}", None),
                   (r"visual\.(.+)", "visual.{0}", None)]
def _mmproj_blocks(layers: str, parts: list[tuple[str, str]]) -> list[tuple[str, str, int | None]]:
    """A projector file's block tensors (`v.blk.N.<part>.weight / .bias`) under a tower's `<layers>.N.<module>`."""
    return [(r"v\.blk\.(\d+)\." + part + r"\.(weight|bias)", layers + ".{0}." + module + ".{1}", None)
            for part, module in parts]


# llama.cpp's multimodal projector files (models/mmproj.py): Qwen2-VL's and Qwen2.5-VL's tower, whose q / k / v the
# converter splits (slots of qkv here) and whose two-frame patch kernel it writes as two (joined by the loader:
# `visual.patch_embed.proj.weight` arrives whole); the MLP's up / down are Qwen2-VL's fc1 / fc2, Qwen2.5-VL's gated
# MLP's up_proj / down_proj
def _mmproj_qwen_names(up: str, down: str) -> list[tuple[str, str, int | None]]:
    return [
        *[(r"v\.blk\.(\d+)\.attn_" + part + r"\.(weight|bias)", "visual.blocks.{0}.attn.qkv.{1}", slot)
          for slot, part in enumerate("qkv")],
        *_mmproj_blocks("visual.blocks", [("attn_out", "attn.proj"), ("ln1", "norm1"), ("ln2", "norm2"),
                                          ("ffn_gate", "mlp.gate_proj"), ("ffn_up", f"mlp.{up}"),
                                          ("ffn_down", f"mlp.{down}")]),
        (r"v\.post_ln\.(weight|bias)", "visual.merger.ln_q.{0}", None),
        (r"mm\.(0|2)\.(weight|bias)", "visual.merger.mlp.{0}.{1}", None),
        (r"visual\.patch_embed\.proj\.weight", "visual.patch_embed.proj.weight", None),
    ]


# Gemma 3's: SigLIP's layers and Gemma 3's projector (its norm's weight stored as 1 + w, read back by the loader)
MMPROJ_SIGLIP_NAMES = [
    (r"v\.patch_embd\.(weight|bias)", "visual.vision_tower.embeddings.patch_embedding.{0}", None),
    (r"v\.position_embd\.weight", "visual.vision_tower.embeddings.position_embedding.weight", None),
    *_mmproj_blocks("visual.vision_tower.encoder.layers", [
        ("attn_q", "self_attn.q_proj"), ("attn_k", "self_attn.k_proj"), ("attn_v", "self_attn.v_proj"),
        ("attn_out", "self_attn.out_proj"), ("ln1", "layer_norm1"), ("ln2", "layer_norm2"), ("ffn_up", "mlp.fc1"),
        ("ffn_down", "mlp.fc2")]),
    (r"v\.post_ln\.(weight|bias)", "visual.vision_tower.post_layernorm.{0}", None),
    (r"mm\.input_projection\.weight", "visual.multi_modal_projector.mm_input_projection_weight", None),
    (r"mm\.soft_emb_norm\.weight", "visual.multi_modal_projector.mm_soft_emb_norm.weight", None),
]

# Mistral 3's: Pixtral's layers (q / k rows as llama.cpp's converter permutes them, undone by the loader) and its
# projector
MMPROJ_PIXTRAL_NAMES = [
    (r"v\.patch_embd\.weight", "visual.vision_tower.patch_conv.weight", None),
    (r"v\.pre_ln\.weight", "visual.vision_tower.ln_pre.weight", None),
    *_mmproj_blocks("visual.vision_tower.transformer.layers", [
        ("attn_q", "attention.q_proj"), ("attn_k", "attention.k_proj"), ("attn_v", "attention.v_proj"),
        ("attn_out", "attention.o_proj"), ("ln1", "attention_norm"), ("ln2", "ffn_norm"),
        ("ffn_gate", "feed_forward.gate_proj"), ("ffn_up", "feed_forward.up_proj"),
        ("ffn_down", "feed_forward.down_proj")]),
    (r"mm\.input_norm\.weight", "visual.multi_modal_projector.norm.weight", None),
    (r"mm\.patch_merger\.weight", "visual.multi_modal_projector.patch_merger.merging_layer.weight", None),
    (r"mm\.(1|2)\.(weight|bias)", "visual.multi_modal_projector.linear_{0}.{1}", None),
]


def mmproj_names(tower: VisionConfig) -> list[tuple[str, str, int | None]]:
    """The name table of a projector file of `tower`'s family (Qwen2.5-VL's gated MLP under its own names)."""
    if tower.family == "siglip":
        return MMPROJ_SIGLIP_NAMES
    if tower.family == "pixtral":
        return MMPROJ_PIXTRAL_NAMES
    if tower.position_embeddings:  # Qwen3-VL's
        return _mmproj_qwen3_names(tower.deepstack_blocks)
    return _mmproj_qwen_names("up_proj", "down_proj") if tower.gated_mlp else _mmproj_qwen_names("fc1", "fc2")


def _mmproj_qwen3_names(deepstack_blocks: tuple[int, ...]) -> list[tuple[str, str, int | None]]:
    """Qwen3-VL's: its q / k / v kept fused (attn_qkv), the patch embedding's bias, the position table, and each
    DeepStack merger under the index of the block it follows (v.deepstack.{block}.*)."""
    return [
        (r"v\.blk\.(\d+)\.attn_qkv\.(weight|bias)", "visual.blocks.{0}.attn.qkv.{1}", None),
        *_mmproj_qwen_names("fc1", "fc2"),
        (r"v\.patch_embd\.bias", "visual.patch_embed.proj.bias", None),
        (r"v\.position_embd\.weight", "visual.pos_embed.weight", None),
        *[(rf"v\.deepstack\.{block}\.{source}\.(weight|bias)", f"visual.deepstack_merger_list.{k}.{target}.{{0}}",
           None) for k, block in enumerate(deepstack_blocks)
          for source, target in (("norm", "ln_q"), ("fc1", "mlp.0"), ("fc2", "mlp.2"))],
    ]


HF_NAMES = [
    (r"model\.embed_tokens\.weight", "embed_tokens.weight", None),
    (r"model\.norm\.weight", "norm.weight", None),
    (r"lm_head\.weight", "lm_head.weight", None),
    (r"model\.layers\.(\d+)\.input_layernorm\.weight", "layers.{0}.input_norm.weight", None),
    (r"model\.layers\.(\d+)\.post_attention_layernorm\.weight", "layers.{0}.post_attn_norm.weight", None),
    (r"model\.layers\.(\d+)\.self_attn\.q_proj\.(weight|bias)", "layers.{0}.attn.qkv.{1}", 0),
    (r"model\.layers\.(\d+)\.self_attn\.k_proj\.(weight|bias)", "layers.{0}.attn.qkv.{1}", 1),
    (r"model\.layers\.(\d+)\.self_attn\.v_proj\.(weight|bias)", "layers.{0}.attn.qkv.{1}", 2),
    (r"model\.layers\.(\d+)\.self_attn\.o_proj\.(weight|bias)", "layers.{0}.attn.o_proj.{1}", None),
    (r"model\.layers\.(\d+)\.self_attn\.sinks", "layers.{0}.attn.sinks", None),  # gpt-oss
    (r"model\.layers\.(\d+)\.self_attn\.q_norm\.weight", "layers.{0}.attn.q_norm.weight", None),
    (r"model\.layers\.(\d+)\.self_attn\.k_norm\.weight", "layers.{0}.attn.k_norm.weight", None),
    (r"model\.layers\.(\d+)\.mlp\.gate_proj\.weight", "layers.{0}.mlp.gate_up.weight", 0),
    (r"model\.layers\.(\d+)\.mlp\.up_proj\.weight", "layers.{0}.mlp.gate_up.weight", 1),
    (r"model\.layers\.(\d+)\.mlp\.down_proj\.weight", "layers.{0}.mlp.down.weight", None),
    # mixtures of experts: the router, each expert's FFN (Qwen's and OLMoE's names, Mixtral's w1 / w3 / w2), and
    # Qwen2-MoE's shared expert with its gate
    *[(r"model\.layers\.(\d+)\." + source, "layers.{0}.mlp." + target, slot) for source, target, slot in [
        (r"(?:mlp|block_sparse_moe)\.gate\.weight", "router.weight", None),
        (r"mlp\.router\.(weight|bias)", "router.{1}", None),  # gpt-oss's, and its experts (loader.py splits them)
        (r"mlp\.experts\.(\d+)\.gate_up\.(weight|bias)", "experts.{1}.gate_up.{2}", None),
        (r"mlp\.experts\.(\d+)\.down\.(weight|bias)", "experts.{1}.down.{2}", None),
        (r"mlp\.experts\.(\d+)\.gate_proj\.weight", "experts.{1}.gate_up.weight", 0),
        (r"mlp\.experts\.(\d+)\.up_proj\.weight", "experts.{1}.gate_up.weight", 1),
        (r"mlp\.experts\.(\d+)\.down_proj\.weight", "experts.{1}.down.weight", None),
        (r"block_sparse_moe\.experts\.(\d+)\.w1\.weight", "experts.{1}.gate_up.weight", 0),
        (r"block_sparse_moe\.experts\.(\d+)\.w3\.weight", "experts.{1}.gate_up.weight", 1),
        (r"block_sparse_moe\.experts\.(\d+)\.w2\.weight", "experts.{1}.down.weight", None),
        (r"mlp\.shared_expert\.gate_proj\.weight", "shared_expert.gate_up.weight", 0),
        (r"mlp\.shared_expert\.up_proj\.weight", "shared_expert.gate_up.weight", 1),
        (r"mlp\.shared_expert\.down_proj\.weight", "shared_expert.down.weight", None),
        (r"mlp\.shared_expert_gate\.weight", "shared_expert_gate.weight", None),
        (r"mlp\.shared_experts\.gate_proj\.weight", "shared_expert.gate_up.weight", 0),  # DeepSeek's name
        (r"mlp\.shared_experts\.up_proj\.weight", "shared_expert.gate_up.weight", 1),
        (r"mlp\.shared_experts\.down_proj\.weight", "shared_expert.down.weight", None),
        # MiniMax-M2's: the second; K-EXAONE's: the third
        (r"(?:mlp\.gate|block_sparse_moe|mlp)\.e_score_correction_bias", "router_bias", None),
        (r"mlp\.moe_statics\.e_score_correction_bias", "router_bias", None),  # Ernie 4.5's, [1, experts]
    ]],
]
# Phi-3 / Phi-4: q / k / v and gate / up stored fused, as ridge holds them
HF_PHI3_NAMES = [(r"model\.layers\.(\d+)\.self_attn\.qkv_proj\.weight", "layers.{0}.attn.qkv.weight", None),
                 (r"model\.layers\.(\d+)\.mlp\.gate_up_proj\.weight", "layers.{0}.mlp.gate_up.weight", None)]
# GLM-4's norms: post_attention_layernorm is the MLP's input norm (llama's), its sandwich norms named apart
HF_GLM4_NAMES = [(r"model\.layers\.(\d+)\.post_self_attn_layernorm\.weight", "layers.{0}.attn_out_norm.weight", None),
                 (r"model\.layers\.(\d+)\.post_mlp_layernorm\.weight", "layers.{0}.mlp_out_norm.weight", None)]
# and under llama.cpp's names: attn_qkv, and ffn_up holding gate and up (Phi-3's, GLM-4's)
GGUF_PHI3_NAMES = [(r"blk\.(\d+)\.attn_qkv\.(weight|bias)", "layers.{0}.attn.qkv.{1}", None),
                   (r"blk\.(\d+)\.ffn_up\.weight", "layers.{0}.mlp.gate_up.weight", None)]
# StarCoder2: LayerNorms with biases, and an ungated MLP whose up projection is c_fc (gate_up holds it alone)
HF_STARCODER2_NAMES = [(r"model\.norm\.bias", "norm.bias", None), *[
    (r"model\.layers\.(\d+)\." + source, "layers.{0}." + target, None) for source, target in [
        (r"input_layernorm\.bias", "input_norm.bias"), (r"post_attention_layernorm\.bias", "post_attn_norm.bias"),
        (r"mlp\.c_fc\.(weight|bias)", "mlp.gate_up.{1}"), (r"mlp\.c_proj\.(weight|bias)", "mlp.down.{1}")]]]
# BERT's encoders (BertModel, RobertaModel, XLMRobertaModel; a masked LM's under its `bert.` / `roberta.` prefix,
# which ENCODER_PREFIX strips, its head and the pooler left out: NOT_ENCODER)
HF_ENCODER_NAMES = [
    (r"embeddings\.word_embeddings\.weight", "embed_tokens.weight", None),
    (r"embeddings\.position_embeddings\.weight", "embed_positions.weight", None),
    (r"embeddings\.token_type_embeddings\.weight", "embed_token_types.weight", None),
    (r"embeddings\.LayerNorm\.(weight|bias)", "embed_norm.{0}", None),
    *[(r"encoder\.layer\.(\d+)\." + source, "layers.{0}." + target, slot) for source, target, slot in [
        (r"attention\.self\.query\.(weight|bias)", "attn.qkv.{1}", 0),
        (r"attention\.self\.key\.(weight|bias)", "attn.qkv.{1}", 1),
        (r"attention\.self\.value\.(weight|bias)", "attn.qkv.{1}", 2),
        (r"attention\.output\.dense\.(weight|bias)", "attn.o_proj.{1}", None),
        (r"attention\.output\.LayerNorm\.(weight|bias)", "attn_out_norm.{1}", None),
        (r"intermediate\.dense\.(weight|bias)", "mlp.gate_up.{1}", None),
        (r"output\.dense\.(weight|bias)", "mlp.down.{1}", None),
        (r"output\.LayerNorm\.(weight|bias)", "mlp_out_norm.{1}", None)]]]
# a sequence classifier's head: BERT's pooler and classifier, RoBERTa's classifier
HF_CLASSIFIER_NAMES = [
    (r"pooler\.dense\.(weight|bias)", "classifier.dense.{0}", None),
    (r"classifier\.dense\.(weight|bias)", "classifier.dense.{0}", None),
    (r"classifier\.out_proj\.(weight|bias)", "classifier.out.{0}", None),
    (r"classifier\.(weight|bias)", "classifier.out.{0}", None),
]
ENCODER_PREFIX = re.compile(r"^(bert|roberta)\.")
NOT_ENCODER = re.compile(r"(pooler|cls|lm_head)\.|embeddings\.position_ids$")  # but a classifier's pooler
# Llama 4: its FFN's own name (feed_forward), its router, shared expert and dense FFN there (the loader splits its
# stacked experts into these names)
HF_LLAMA4_NAMES = [(r"model\.layers\.(\d+)\.feed_forward\." + source, "layers.{0}.mlp." + target, slot)
                   for source, target, slot in [
                       (r"router\.weight", "router.weight", None),
                       (r"experts\.(\d+)\.(gate_up|down)\.weight", "experts.{1}.{2}.weight", None),
                       (r"shared_expert\.gate_proj\.weight", "shared_expert.gate_up.weight", 0),
                       (r"shared_expert\.up_proj\.weight", "shared_expert.gate_up.weight", 1),
                       (r"shared_expert\.down_proj\.weight", "shared_expert.down.weight", None),
                       (r"gate_proj\.weight", "gate_up.weight", 0), (r"up_proj\.weight", "gate_up.weight", 1),
                       (r"down_proj\.weight", "down.weight", None)]]
# Nemotron-H's ungated MLPs (the loader names its blocks as ridge's layers): up_proj alone is gate_up
HF_NEMOTRON_H_NAMES = [(r"model\.layers\.(\d+)\.mlp\." + source, "layers.{0}.mlp." + target, None)
                       for source, target in [(r"up_proj\.weight", "gate_up.weight"),
                                              (r"experts\.(\d+)\.up_proj\.weight", "experts.{1}.gate_up.weight"),
                                              (r"shared_experts\.up_proj\.weight", "shared_expert.gate_up.weight")]]
# latent attention (DeepSeek-V3): its projections, q_proj among them (not a slot of a fused qkv)
HF_MLA_NAMES = [(r"model\.layers\.(\d+)\.self_attn\." + source, "layers.{0}.attn." + target, None)
                 for source, target in [
                     (r"q_proj\.weight", "q_proj.weight"), (r"q_a_proj\.weight", "q_a.weight"),
                     (r"q_a_layernorm\.weight", "q_a_norm.weight"), (r"q_b_proj\.weight", "q_b.weight"),
                     (r"kv_a_proj_with_mqa\.weight", "kv_a.weight"), (r"kv_a_layernorm\.weight", "kv_a_norm.weight"),
                     (r"kv_b_proj\.weight", "kv_b"),
                     # sparse attention's indexer (DeepSeek-V3.2, GLM-5)
                     (r"indexer\.(wq_b|wk|weights_proj)\.weight", "indexer.{1}.weight"),
                     (r"indexer\.k_norm\.(weight|bias)", "indexer.k_norm.{1}")]]

# Granite's mixtures (loader.py splits their stacked experts, `.{expert}` added to the names): the router, the
# experts' fused gate / up and down, and the shared MLP, which is the whole FFN where a model has no experts
# (Granite 4.0-H's dense ones)
def _hf_granite_names(cfg: ModelConfig) -> list[tuple[str, str, int | None]]:
    shared = "mlp.shared_expert" if cfg.num_experts else "mlp"
    return [(r"model\.layers\.(\d+)\." + source, "layers.{0}." + target, None) for source, target in [
        (r"block_sparse_moe\.router\.layer\.weight", "mlp.router.weight"),
        (r"block_sparse_moe\.input_linear\.weight\.(\d+)", "mlp.experts.{1}.gate_up.weight"),
        (r"block_sparse_moe\.output_linear\.weight\.(\d+)", "mlp.experts.{1}.down.weight"),
        (r"shared_mlp\.input_linear\.weight", shared + ".gate_up.weight"),
        (r"shared_mlp\.output_linear\.weight", shared + ".down.weight")]]


# LFM2 (and LFM2-MoE): its short convolutions (models/short_conv.py), its norms' and attention's own names, its
# FFN's w1 / w3 / w2, and the final norm (embedding_norm, applied after the last layer)
HF_LFM2_NAMES = [(r"model\.layers\.(\d+)\." + source, "layers.{0}." + target, slot) for source, target, slot in [
    (r"conv\.in_proj\.(weight|bias)", "ssm.in_proj.{1}", None), (r"conv\.conv\.weight", "ssm.conv_weight", None),
    (r"conv\.conv\.bias", "ssm.conv_bias", None), (r"conv\.out_proj\.(weight|bias)", "ssm.out_proj.{1}", None),
    (r"operator_norm\.weight", "input_norm.weight", None), (r"ffn_norm\.weight", "post_attn_norm.weight", None),
    (r"self_attn\.out_proj\.weight", "attn.o_proj.weight", None),
    (r"self_attn\.q_layernorm\.weight", "attn.q_norm.weight", None),
    (r"self_attn\.k_layernorm\.weight", "attn.k_norm.weight", None),
    (r"feed_forward\.w1\.weight", "mlp.gate_up.weight", 0), (r"feed_forward\.w3\.weight", "mlp.gate_up.weight", 1),
    (r"feed_forward\.w2\.weight", "mlp.down.weight", None),
    # LFM2-MoE's mixtures: the router, its expert bias (which moves the choice only), each expert's w1 / w3 / w2
    (r"feed_forward\.gate\.weight", "mlp.router.weight", None), (r"feed_forward\.expert_bias", "mlp.router_bias", None),
    (r"feed_forward\.experts\.(\d+)\.w1\.weight", "mlp.experts.{1}.gate_up.weight", 0),
    (r"feed_forward\.experts\.(\d+)\.w3\.weight", "mlp.experts.{1}.gate_up.weight", 1),
    (r"feed_forward\.experts\.(\d+)\.w2\.weight", "mlp.experts.{1}.down.weight", None)]] + [
    (r"model\.embedding_norm\.weight", "norm.weight", None)]


# Mamba-2's mixer (in Mamba-2's own models, and the hybrids' Mamba layers), and the names around it in each
_SSM_MIXER_NAMES = [(source, target) for source, target in [
    (r"in_proj\.(weight|bias)", "in_proj.{1}"), (r"conv1d\.weight", "conv_weight"), (r"conv1d\.bias", "conv_bias"),
    (r"dt_bias", "dt_bias"), (r"A_log", "A_log"), (r"D", "D"), (r"norm\.weight", "norm_weight"),
    (r"out_proj\.(weight|bias)", "out_proj.{1}")]]
HF_SSM_NAMES = [
    *[(r"backbone\.layers\.(\d+)\.mixer\." + source, "layers.{0}.ssm." + target, None)
      for source, target in _SSM_MIXER_NAMES],
    *[(r"model\.layers\.(\d+)\.mamba\." + source, "layers.{0}.ssm." + target, None)
      for source, target in _SSM_MIXER_NAMES],
    (r"backbone\.embeddings?\.weight", "embed_tokens.weight", None),
    (r"backbone\.norm_f\.weight", "norm.weight", None),
    (r"backbone\.layers\.(\d+)\.norm\.weight", "layers.{0}.input_norm.weight", None),
    (r"model\.final_layernorm\.weight", "norm.weight", None),
    (r"model\.layers\.(\d+)\.pre_ff_layernorm\.weight", "layers.{0}.post_attn_norm.weight", None),
    (r"model\.layers\.(\d+)\.feed_forward\.gate_proj\.weight", "layers.{0}.mlp.gate_up.weight", 0),
    (r"model\.layers\.(\d+)\.feed_forward\.up_proj\.weight", "layers.{0}.mlp.gate_up.weight", 1),
    (r"model\.layers\.(\d+)\.feed_forward\.down_proj\.weight", "layers.{0}.mlp.down.weight", None),
]


# Qwen3.5's gated DeltaNet (models/gated_delta.py): its four input projections one in_proj (q, k, v, then z, b, a;
# Qwen3-Next's two grouped ones reordered to those by the loader), and an output gate as qkv's fourth slot (the
# loader splits it from q_proj's rows, where each head's query and gate sit side by side)
HF_GATED_DELTA_NAMES = [(r"model\.layers\.(\d+)\." + source, "layers.{0}." + target, slot) for source, target, slot in [
    (r"linear_attn\.in_proj_qkv\.weight", "ssm.in_proj.weight", 0),
    (r"linear_attn\.in_proj_z\.weight", "ssm.in_proj.weight", 1),
    (r"linear_attn\.in_proj_b\.weight", "ssm.in_proj.weight", 2),
    (r"linear_attn\.in_proj_a\.weight", "ssm.in_proj.weight", 3),
    (r"linear_attn\.conv1d\.weight", "ssm.conv_weight", None), (r"linear_attn\.dt_bias", "ssm.dt_bias", None),
    (r"linear_attn\.A_log", "ssm.A_log", None), (r"linear_attn\.norm\.weight", "ssm.norm_weight", None),
    (r"linear_attn\.out_proj\.weight", "ssm.out_proj.weight", None),
    (r"self_attn\.q_gate\.(weight|bias)", "attn.qkv.{1}", 3)]]


# a Mamba-2 mixer under llama.cpp's names (ssm_a holds A itself and is read as A_log by the loader, which also
# flattens ssm_a / ssm_d's [heads, 1] and ssm_norm's [groups, width a group])
GGUF_SSM_NAMES = [(r"blk\.(\d+)\." + source, "layers.{0}.ssm." + target, None) for source, target in [
    (r"ssm_in\.weight", "in_proj.weight"), (r"ssm_conv1d\.weight", "conv_weight"), (r"ssm_conv1d\.bias", "conv_bias"),
    (r"ssm_dt\.bias", "dt_bias"), (r"ssm_a", "A_log"), (r"ssm_d", "D"), (r"ssm_norm\.weight", "norm_weight"),
    (r"ssm_out\.weight", "out_proj.weight")]]


# Qwen3.5's under llama.cpp's names (qwen35, qwen35moe; qwen3next's, its fused ssm_ba / ssm_in split by the loader):
# the gated DeltaNet's four input projections (the rest under Mamba-2's names), the output gate split from attn_q by
# the loader, and post_attention_norm, the FFN's input norm
GGUF_QWEN3_5_NAMES = [(r"blk\.(\d+)\." + source, "layers.{0}." + target, slot) for source, target, slot in [
    (r"attn_qkv\.weight", "ssm.in_proj.weight", 0), (r"attn_gate\.weight", "ssm.in_proj.weight", 1),
    (r"ssm_beta\.weight", "ssm.in_proj.weight", 2), (r"ssm_alpha\.weight", "ssm.in_proj.weight", 3),
    (r"attn_q_gate\.(weight|bias)", "attn.qkv.{1}", 3),
    (r"post_attention_norm\.weight", "post_attn_norm.weight", None)]]


# LFM2's short convolutions under llama.cpp's names (the convolution's taps [hidden, taps]), and its final norm,
# which llama.cpp calls token_embd_norm after HF's embedding_norm
GGUF_LFM2_NAMES = [(r"blk\.(\d+)\.shortconv\." + source, "layers.{0}.ssm." + target, None) for source, target in [
    (r"conv\.weight", "conv_weight"), (r"conv\.bias", "conv_bias"), (r"in_proj\.(weight|bias)", "in_proj.{1}"),
    (r"out_proj\.(weight|bias)", "out_proj.{1}")]] + [(r"token_embd_norm\.weight", "norm.weight", None)]


def map_name(name: str, table: list[tuple[str, str, int | None]]) -> tuple[str, int | None]:
    for pattern, template, slot in table:
        match = re.fullmatch(pattern, name)
        if match:
            return template.format(*match.groups()), slot
    raise ValueError(f"tensor {name!r} has no place in the model (unsupported architecture variant?)")


def hf_names(cfg: ModelConfig) -> list[tuple[str, str, int | None]]:
    """The name table of an HF checkpoint of `cfg`'s family (the first pattern that matches a name wins)."""
    if cfg.architecture == "bert":
        return HF_ENCODER_NAMES + (HF_CLASSIFIER_NAMES if cfg.num_labels else [])
    family = (_hf_granite_names(cfg) if cfg.architecture in ("granitemoe", "granitemoehybrid")
              else HF_LFM2_NAMES if cfg.architecture in ("lfm2", "lfm2_moe")
              else HF_GATED_DELTA_NAMES if cfg.attention_output_gate or cfg.state_mixer == "gated_delta"
              else HF_PHI3_NAMES if cfg.architecture == "phi3"
              else HF_GLM4_NAMES + HF_PHI3_NAMES if cfg.architecture == "glm4"
              else HF_LLAMA4_NAMES if cfg.architecture == "llama4"
              else HF_NEMOTRON_H_NAMES if cfg.architecture == "nemotron_h"
              else HF_STARCODER2_NAMES if cfg.architecture == "starcoder2"
              else HF_GEMMA4_NAMES + (HF_GEMMA4_MOE_NAMES if cfg.moe_beside_mlp else []) if cfg.architecture == "gemma4"
              else [])
    gemma_norms = cfg.sandwich_norms and cfg.architecture != "glm4"
    return ((HF_VISION_NAMES if cfg.vision is not None else [])
            + (HF_SANDWICH_NAMES if gemma_norms else []) + (HF_MLA_NAMES if cfg.is_mla else [])
            + (HF_SSM_NAMES if cfg.ssm_layers else []) + family + HF_NAMES)


# Gemma 4 under llama.cpp's names: the per-layer embeddings, the layer scalar, and the 26B-A4B's mixture beside its
# dense MLP (the stacked experts split by the loader, `.{expert}` added); the dense MLP's own names are GGUF_NAMES'
# in a layer without experts
GGUF_GEMMA4_NAMES = [
    (r"per_layer_token_embd\.weight", "embed_per_layer.weight", None),
    (r"per_layer_model_proj\.weight", "per_layer_model_projection.weight", None),
    (r"per_layer_proj_norm\.weight", "per_layer_projection_norm.weight", None),
    *[(r"blk\.(\d+)\." + source, "layers.{0}." + target, None) for source, target in [
        (r"inp_gate\.weight", "per_layer_gate.weight"), (r"proj\.weight", "per_layer_projection.weight"),
        (r"post_norm\.weight", "per_layer_norm.weight"), (r"layer_output_scale\.weight", "layer_scalar")]]]
GGUF_GEMMA4_MOE_NAMES = [(r"blk\.(\d+)\." + source, "layers.{0}.mlp." + target, slot) for source, target, slot in [
    (r"ffn_gate\.weight", "mlp.gate_up.weight", 0), (r"ffn_up\.weight", "mlp.gate_up.weight", 1),
    (r"ffn_down\.weight", "mlp.down.weight", None), (r"ffn_gate_inp\.weight", "moe.router.weight", None),
    (r"ffn_gate_inp\.scale", "moe.router_input_scale", None), (r"ffn_down_exps\.scale", "moe.expert_scales", None),
    (r"ffn_gate_up_exps\.weight\.(\d+)", "moe.experts.{1}.gate_up.weight", None),
    (r"ffn_down_exps\.weight\.(\d+)", "moe.experts.{1}.down.weight", None),
    (r"post_ffw_norm_1\.weight", "mlp_out_norm.weight", None),
    (r"pre_ffw_norm_2\.weight", "experts_in_norm.weight", None),
    (r"post_ffw_norm_2\.weight", "experts_out_norm.weight", None)]]


# Nemotron-H's ungated MLP under llama.cpp's names (the loader names its blocks as ridge's layers): ffn_up alone
GGUF_NEMOTRON_H_NAMES = [(r"blk\.(\d+)\.ffn_up\.weight", "layers.{0}.mlp.gate_up.weight", None)]


# StarCoder2 under llama.cpp's names: LayerNorms with biases, the ungated MLP's ffn_up alone, biases on both
GGUF_STARCODER2_NAMES = [(r"output_norm\.bias", "norm.bias", None), *[
    (r"blk\.(\d+)\." + source, "layers.{0}." + target, None) for source, target in [
        (r"attn_norm\.bias", "input_norm.bias"), (r"ffn_norm\.bias", "post_attn_norm.bias"),
        (r"ffn_up\.(weight|bias)", "mlp.gate_up.{1}"), (r"ffn_down\.(weight|bias)", "mlp.down.{1}")]]]


# llama.cpp's encoders (its bert: BERT's tensors under gguf-py's names)
GGUF_ENCODER_NAMES = [
    (r"token_embd\.weight", "embed_tokens.weight", None),
    (r"token_types\.weight", "embed_token_types.weight", None),
    (r"position_embd\.weight", "embed_positions.weight", None),
    (r"token_embd_norm\.(weight|bias)", "embed_norm.{0}", None),
    *[(r"blk\.(\d+)\." + source, "layers.{0}." + target, slot) for source, target, slot in [
        (r"attn_q\.(weight|bias)", "attn.qkv.{1}", 0), (r"attn_k\.(weight|bias)", "attn.qkv.{1}", 1),
        (r"attn_v\.(weight|bias)", "attn.qkv.{1}", 2), (r"attn_output\.(weight|bias)", "attn.o_proj.{1}", None),
        (r"attn_output_norm\.(weight|bias)", "attn_out_norm.{1}", None),
        (r"ffn_up\.(weight|bias)", "mlp.gate_up.{1}", None), (r"ffn_down\.(weight|bias)", "mlp.down.{1}", None),
        (r"layer_output_norm\.(weight|bias)", "mlp_out_norm.{1}", None)]]]


def gguf_names(cfg: ModelConfig) -> list[tuple[str, str, int | None]]:
    """The name table of a GGUF file of `cfg`'s family."""
    if cfg.architecture == "bert":
        return GGUF_ENCODER_NAMES
    family = {"gpt_oss": GGUF_GPT_OSS_NAMES, "lfm2": GGUF_LFM2_NAMES, "lfm2_moe": GGUF_LFM2_NAMES,
              "qwen3_5": GGUF_QWEN3_5_NAMES, "qwen3_5_moe": GGUF_QWEN3_5_NAMES,
              "qwen3_next": GGUF_QWEN3_5_NAMES, "glm4_moe": GGUF_MLP_INPUT_NORM,
              "seed_oss": GGUF_MLP_INPUT_NORM, "phi3": GGUF_PHI3_NAMES,
              "glm4": GGUF_PHI3_NAMES, "nemotron_h": GGUF_NEMOTRON_H_NAMES, "starcoder2": GGUF_STARCODER2_NAMES,
              "gemma4": GGUF_GEMMA4_NAMES + (GGUF_GEMMA4_MOE_NAMES if cfg.moe_beside_mlp else [])
              }.get(cfg.architecture, [])
    return ((GGUF_MLA_NAMES if cfg.is_mla else []) + family + (GGUF_SSM_NAMES if cfg.ssm_layers else [])
            + GGUF_NAMES)
