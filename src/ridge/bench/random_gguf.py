"""A random-weight model written as a GGUF file, so that llama.cpp runs the shape ridge runs from `random:NAME`.

A shape with no small real checkpoint here (a mixture of experts of Qwen3-30B-A3B's layers, say) can still be
measured side by side: the weights ridge draws for `random:NAME` (models/random_weights.py, the same seed) are
written under llama.cpp's tensor names and header keys, in float16, with the vocabulary of a pulled GGUF of the
same size (llama.cpp will not load a model without one). ridge reads the file back to the same model. With
`block_type` (Q8_0, Q4_0, ...) the matrices are written in that GGUF block format, quantized by the gguf
package's own reference code, so that ridge (`--quantization gguf`) and llama.cpp run the same blocks.
"""

from __future__ import annotations

import functools
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import (
    GGML_QUANT_SIZES,
    ExpertGatingFuncType,
    GGMLQuantizationType,
    GGUFReader,
    GGUFValueType,
    GGUFWriter,
    LlamaFileType,
    RopeScalingType,
    quants,
)
from tqdm import tqdm

from ridge.config import ModelConfig
from ridge.models.loader import (
    PARTIAL_ROTARY_ROWS,
    ROTARY_PERMUTED,
    LoadedModel,
    indexer_rotary_orders,
    latent_rotary_order,
    random_model,
)
from ridge.models.registry import check_supported
from ridge.models.spec import (
    COHERE2_GLOBAL_EVERY,
    GEMMA3_GLOBAL_EVERY,
    LLAMA4_CHUNK,
    LLAMA4_TEMPERATURE,
    SMOLLM3_NOPE_EVERY,
    ModelSpec,
    nemotron_h_block_kinds,
)
from ridge.rope_scaling import RopeScaling

# the layout this module writes; bumped when it changes, so that a cached file of an older one is written again
WRITER_VERSION = 5

# ridge's architecture -> llama.cpp's (a Mixtral is llama with experts there, a Mistral without windows llama;
# DeepSeek-V2 and V3 are deepseek2, told apart by their gating function)
GGUF_ARCHITECTURES = {"llama": "llama", "mistral": "llama", "mixtral": "llama", "granite": "granite",
                      "qwen2": "qwen2", "qwen3": "qwen3",
                      "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "olmoe": "olmoe",
                      "deepseek_v2": "deepseek2", "deepseek_v3": "deepseek2", "gpt_oss": "gpt-oss",
                      "mamba2": "mamba2", "bamba": "granitehybrid", "granitemoe": "granitemoe",
                      "granitemoehybrid": "granitehybrid", "lfm2": "lfm2", "lfm2_moe": "lfm2moe",
                      "qwen3_5": "qwen35", "qwen3_5_moe": "qwen35moe", "qwen3_next": "qwen3next",
                      "glm4_moe": "glm4moe", "minimax_m2": "minimax-m2", "smollm3": "smollm3", "seed_oss": "seed_oss",
                      "phi3": "phi3", "olmo2": "olmo2", "olmo3": "olmo2", "exaone4": "exaone4",
                      "glm4": "glm4", "ernie4_5": "ernie4_5", "ernie4_5_moe": "ernie4_5-moe",
                      "cohere": "command-r", "cohere2": "cohere2", "gemma": "gemma", "gemma3": "gemma3",
                      "ministral3": "mistral3",
                      "mistral4": "mistral4", "llama4": "llama4", "dots1": "dots1", "exaone_moe": "exaone-moe",
                      "nemotron_h": "nemotron_h", "glm_moe_dsa": "glm-dsa", "gemma4": "gemma4",
                      "starcoder2": "starcoder2"}
# the indexer key widths llama.cpp's glm-dsa runs: multiples of this, its Hadamard rotation's (docs/notes/moe-mla.md)
GLM_DSA_INDEX_BLOCK = 64
# a Nemotron-H with a mixture is llama.cpp's nemotron_h_moe
_LAYER_NAMES = {"input_norm.weight": "attn_norm.weight", "post_attn_norm.weight": "ffn_norm.weight",
                "attn.o_proj.weight": "attn_output.weight", "attn.q_norm.weight": "attn_q_norm.weight",
                "attn.k_norm.weight": "attn_k_norm.weight", "mlp.down.weight": "ffn_down.weight",
                "mlp.router.weight": "ffn_gate_inp.weight", "mlp.shared_expert.down.weight": "ffn_down_shexp.weight",
                "mlp.router_bias": "exp_probs_b.bias", "attn.q_a.weight": "attn_q_a.weight",
                "attn.q_a_norm.weight": "attn_q_a_norm.weight", "attn.kv_a_norm.weight": "attn_kv_a_norm.weight",
                "attn.o_proj.bias": "attn_output.bias", "attn.sinks": "attn_sinks.weight",
                "mlp.router.bias": "ffn_gate_inp.bias", "attn_out_norm.weight": "post_attention_norm.weight",
                "mlp_out_norm.weight": "post_ffw_norm.weight",
                # StarCoder2's LayerNorm and MLP biases
                "input_norm.bias": "attn_norm.bias", "post_attn_norm.bias": "ffn_norm.bias",
                "mlp.down.bias": "ffn_down.bias"}
# gpt-oss's, Qwen3.5's, GLM-4.5's and Seed-OSS's MLP input norm is their post_attention_norm (Gemma's sandwich norm
# elsewhere)
_POST_ATTENTION_NORM_NAMES = {**_LAYER_NAMES, "post_attn_norm.weight": "post_attention_norm.weight"}
# a Mamba-2 mixer's (llama.cpp's ssm_a and ssm_d have no .weight suffix; ssm_dt is dt's bias alone)
_SSM_NAMES = {"ssm.in_proj.weight": "ssm_in.weight", "ssm.conv_weight": "ssm_conv1d.weight",
              "ssm.conv_bias": "ssm_conv1d.bias", "ssm.dt_bias": "ssm_dt.bias", "ssm.D": "ssm_d",
              "ssm.out_proj.weight": "ssm_out.weight"}
# LFM2's short convolution's
_SHORT_CONV_NAMES = {"ssm.in_proj.weight": "shortconv.in_proj.weight", "ssm.in_proj.bias": "shortconv.in_proj.bias",
                     "ssm.conv_weight": "shortconv.conv.weight", "ssm.conv_bias": "shortconv.conv.bias",
                     "ssm.out_proj.weight": "shortconv.out_proj.weight", "ssm.out_proj.bias": "shortconv.out_proj.bias"}
# matrices llama.cpp's state-space ops read in float32 only (its converter keeps them so)
_FLOAT32_ONLY = re.compile(r"blk\.\d+\.(ssm_conv1d\.weight|ssm_a|ssm_d|ssm_norm\.weight|shortconv\.conv\.weight)$")


def write_random_gguf(spec: ModelSpec, path: Path, vocabulary: Path, seed: int = 0, float16: bool = True,
                      block_type: str | None = None) -> Path:
    """`spec` with ridge's random weights of `seed` as a GGUF at `path` (float16, or float32: the weights of
    `random:NAME` in float32 exactly); the tokenizer copied from the GGUF `vocabulary`, whose token count must
    be the model's vocabulary size. block_type: a GGUF block format the gguf package quantizes to (BLOCK_TYPES)
    for every matrix but the routers (kept as llama.cpp's quantizer keeps them); MXFP4 for the experts only."""
    _check_writable(spec)
    return write_gguf(random_model(spec, torch.float16 if float16 else torch.float32, "cpu", seed), path, vocabulary,
                      float16, block_type)


def write_vocabulary(tokenizer_file: Path, path: Path, size: int, named: dict[int, str] | None = None) -> Path:
    """A GGUF holding only the byte-level BPE vocabulary of an HF tokenizer.json (llama.cpp's gpt2 model, no BOS
    added) and the chat template of the tokenizer_config.json beside it, for write_gguf to copy: its tokens by id (an
    added token a control token), then placeholders to `size` tokens; `named`: ids renamed (a random model's image
    tokens, which llama.cpp and ridge find by name)."""
    config = json.loads(tokenizer_file.read_text())
    vocab = {**config["model"]["vocab"], **{t["content"]: t["id"] for t in config.get("added_tokens", [])}}
    tokens = [f"<|placeholder_{i}|>" for i in range(size)]
    for token, i in vocab.items():
        if i < size:
            tokens[i] = token
    control = {t["id"] for t in config.get("added_tokens", [])} | set(named or {})
    for i, token in (named or {}).items():
        tokens[i] = token
    merges = [m if isinstance(m, str) else " ".join(m) for m in config["model"].get("merges") or []]
    if not merges:  # llama.cpp refuses a gpt2 vocabulary without merges: one that joins the bytes 0 and 1 (a token
        # no text here holds) into a slot that is neither a byte, a named token nor the end token
        slot = max(i for i in range(size - 1) if i not in control and len(tokens[i]) != 1)
        tokens[slot], merges = "Āā", ["Ā ā"]
    writer = GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    known = set(vocab.values())
    writer.add_token_types([3 if i in control else 1 if i in known else 5 for i in range(size)])
    writer.add_token_merges(merges)
    writer.add_add_bos_token(False)
    writer.add_eos_token_id(size - 1)
    settings = tokenizer_file.parent / "tokenizer_config.json"
    if settings.exists() and isinstance(template := json.loads(settings.read_text()).get("chat_template"), str):
        writer.add_chat_template(template)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_gguf(loaded: LoadedModel, path: Path, vocabulary: Path, float16: bool = True,
               block_type: str | None = None) -> Path:
    """A loaded model's dense weights as a GGUF at `path` (write_random_gguf's, for weights already held)."""
    blocks = _block_type(block_type)
    spec, cfg = loaded.spec, loaded.config
    arch = _check_writable(spec)
    if spec.mrope_section:  # Qwen2-VL's, Qwen2.5-VL's and Qwen3-VL's language models (their M-RoPE sections)
        arch = {"qwen2": "qwen2vl", "qwen3": "qwen3vl", "qwen3moe": "qwen3vlmoe"}[arch]
    writer = GGUFWriter(str(path), arch)
    _header(writer, arch, spec, cfg, float16, blocks)
    _copy_vocabulary(writer, vocabulary, spec.vocab_size)
    state = loaded.model.state_dict()
    # two passes over the tensors, each made as it is needed: what each holds (its shape, type and size), then
    # its data, written as it is made; a model as large as memory is never held twice (stacked experts, a
    # quantized copy), only one tensor's new form at a time
    for name, tensor in _file_tensors(cfg, state):
        form = _stored_form(name, tensor, blocks)
        writer.add_tensor_info(name, *form.shape_type_bytes(tensor), raw_dtype=form.raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    tensors = tqdm(_file_tensors(cfg, state), total=len(writer.tensors[0]), desc="write gguf", unit="tensor",
                   leave=False)
    for name, tensor in tensors:
        writer.write_tensor_data(_stored_form(name, tensor, blocks).data(tensor))
    writer.close()
    return path


@dataclass(frozen=True)
class _StoredForm:
    """How a tensor is stored: float32, in GGUF blocks (raw_dtype), or as it is (the model's float type)."""

    float32: bool = False
    raw_dtype: GGMLQuantizationType | None = None

    def shape_type_bytes(self, tensor: torch.Tensor) -> tuple[tuple[int, ...], np.dtype, int]:
        """What the file's tensor info says of it (for blocks: its bytes' shape, as GGUFWriter.add_tensor does)."""
        if self.raw_dtype is not None:
            block, type_size = GGML_QUANT_SIZES[self.raw_dtype]
            shape = (*tensor.shape[:-1], tensor.shape[-1] // block * type_size)
            return shape, np.dtype(np.uint8), math.prod(shape)
        dtype = np.dtype(np.float32) if self.float32 else np.dtype(str(tensor.dtype).removeprefix("torch."))
        return tuple(tensor.shape), dtype, tensor.numel() * dtype.itemsize

    def data(self, tensor: torch.Tensor) -> np.ndarray:
        if self.raw_dtype is not None:
            return quants.quantize(tensor.float().contiguous().numpy(), self.raw_dtype)
        return (tensor.float() if self.float32 else tensor).contiguous().numpy()


def _stored_form(name: str, tensor: torch.Tensor, blocks: GGMLQuantizationType | None) -> _StoredForm:
    # vectors (norms, biases) in float32, as llama.cpp's converter keeps them: its CPU ops add and multiply by them
    # in float32 only (the experts' biases are stacked, [experts, rows])
    if tensor.dim() == 1 or name.endswith(".bias") or _FLOAT32_ONLY.match(name):
        return _StoredForm(float32=True)
    if blocks is not None and not name.endswith("ffn_gate_inp.weight") and (
            blocks != GGMLQuantizationType.MXFP4 or "_exps." in name):
        return _StoredForm(raw_dtype=blocks)
    return _StoredForm()


def _check_writable(spec: ModelSpec) -> str:
    """llama.cpp's name for `spec`'s architecture, if a GGUF of it can hold the model (else ValueError)."""
    arch = GGUF_ARCHITECTURES.get(check_supported(spec.architecture))  # ridge's name for an HF class name too
    if arch is None:
        raise ValueError(f"model: writing a GGUF of architecture {spec.architecture!r} is not supported "
                         f"({', '.join(GGUF_ARCHITECTURES)})")
    if arch in ("mamba2", "granitehybrid", "nemotron_h"):
        _check_mamba2(spec, arch)
    if arch == "nemotron_h" and spec.is_moe:  # llama.cpp's nemotron_h_moe: every FFN block a mixture
        arch = "nemotron_h_moe"
    # deepseek2's (mistral4's), lfm2moe's, glm4moe's and ernie4_5-moe's header key; llama4's layer step
    leading = tuple(range(spec.first_dense_layers)) if arch in ("deepseek2", "mistral4", "lfm2moe", "glm4moe",
                                                                 "ernie4_5-moe", "dots1", "exaone-moe",
                                                                 "glm-dsa") else ()
    if arch == "llama4":
        leading = tuple(i for i in range(spec.num_layers) if (i + 1) % spec.moe_layer_step) if spec.is_moe else ()
        _check_llama4(spec)
    elif spec.chunked_window:
        raise ValueError(f"model: llama.cpp's {arch} has no chunked attention (llama4's alone)")
    if spec.dense_layer_indices != leading:
        raise ValueError(f"model: dense layers {list(spec.dense_layer_indices)} among the experts' have no GGUF "
                         f"header key in {arch}; llama.cpp would read experts there")
    if arch == "dots1" and (spec.num_kv_heads != spec.num_heads or spec.router_groups > 1):
        raise ValueError(f"model: llama.cpp's dots1 holds a key and value head per query head and routes without "
                         f"groups (dots.llm1's shape); this model has {spec.num_kv_heads} KV heads for "
                         f"{spec.num_heads} and {spec.router_groups} router groups")
    if arch == "glm-dsa" and spec.index_head_dim % GLM_DSA_INDEX_BLOCK:
        raise ValueError(f"model: llama.cpp's glm-dsa rotates the indexer's keys in blocks of {GLM_DSA_INDEX_BLOCK} "
                         f"dims (a Hadamard transform); index_head_dim {spec.index_head_dim} is not a multiple")
    first_shared = spec.num_layers - spec.kv_shared_layers
    if arch == "gemma4" and spec.kv_shared_layers and (
            not spec.is_local(first_shared - 2) or spec.is_local(first_shared - 1)):
        raise ValueError("model: llama.cpp's gemma4 gives its KV-shared layers the cache of the last layer before them "
                         "(global) and of the one before that (windowed); this model's last two layers that hold a "
                         f"cache are {'windowed' if spec.is_local(first_shared - 2) else 'global'} and "
                         f"{'windowed' if spec.is_local(first_shared - 1) else 'global'}")
    if arch == "starcoder2" and spec.sliding_window:
        raise ValueError(f"model: llama.cpp's starcoder2 attends without a window (a GGUF does not say one); this "
                         f"model's window is {spec.sliding_window} tokens (sliding_window=0 draws it without)")
    if arch == "command-r" and spec.qk_norm_params:
        raise ValueError("model: writing Command R+'s per-head q / k LayerNorms (use_qk_norm) to a GGUF is not "
                         "supported")
    if arch == "lfm2moe" and spec.routed_scaling_factor != 1.0:
        raise ValueError(f"model: routed_scaling_factor {spec.routed_scaling_factor} has no form in an lfm2moe GGUF "
                         "(llama.cpp's graph scales LFM2-MoE's expert weights by nothing)")
    if arch == "smollm3" and spec.nope_layers != tuple(
            i for i in range(spec.num_layers) if (i + 1) % SMOLLM3_NOPE_EVERY == 0):
        raise ValueError(f"model: NoPE layers {list(spec.nope_layers)} are not every {SMOLLM3_NOPE_EVERY}th, the one "
                         "pattern llama.cpp's smollm3 graph has (a GGUF does not say it)")
    if arch in _GATED_DELTA:
        _full_attention_interval(spec)
        if spec.ssm_state_size != spec.ssm_head_dim:
            raise ValueError(f"model: a {arch} GGUF holds gated DeltaNet heads whose keys are as wide as their values "
                             f"(llama.cpp's state is square); ssm_state_size {spec.ssm_state_size} != ssm_head_dim "
                             f"{spec.ssm_head_dim}")
    if arch == "olmo2" and (spec.tie_word_embeddings or spec.sliding_window and (
            not spec.global_every or spec.rope_scaling and spec.rope_local_theta is None)):
        raise ValueError("model: an olmo2 GGUF holds an output matrix of its own, and windows on all but every n-th "
                         "layer, their rotary unscaled (llama.cpp's olmo2 graph)")
    fixed = (COHERE2_GLOBAL_EVERY, tuple(i for i in range(spec.num_layers) if (i + 1) % COHERE2_GLOBAL_EVERY == 0))
    if arch == "cohere2" and spec.sliding_window and (spec.global_every, spec.nope_layers) != fixed:
        raise ValueError(f"model: llama.cpp's cohere2 windows all but every {COHERE2_GLOBAL_EVERY}th layer, which "
                         "turns no rotary (a GGUF does not say it)")
    if arch == "exaone4" and spec.sliding_window and (spec.num_layers, spec.sliding_window, spec.global_every) != (
            64, 4096, 4):
        raise ValueError("model: llama.cpp's exaone4 windows EXAONE-4.0-32B's shape only (64 layers, 4,096-token "
                         "windows on 3 of 4): another windowed shape would run unwindowed there")
    if arch == "gemma3":
        _check_gemma3(spec)
    if arch == "llama" and spec.sliding_window:  # (Mistral 7B's windows: llama.cpp's llama graph has none)
        raise ValueError(f"model: llama.cpp's llama attends without a window; this model's is {spec.sliding_window} "
                         "tokens")
    if (spec.rope_scaling or {}).get("llama_4_scaling_beta") and arch not in ("mistral3", "mistral4"):
        raise ValueError(f"model: llama.cpp's {arch} has no attention temperature (llama_4_scaling_beta)")
    if arch == "gpt-oss" and (spec.global_every != 2 or (spec.rope_scaling or {}).get("truncate", True)):
        raise ValueError("model: a gpt-oss GGUF holds windows on every other layer and YaRN without truncation "
                         "(what llama.cpp and models/spec.py assume for it)")
    return arch


_GATED_DELTA = ("qwen35", "qwen35moe", "qwen3next")  # llama.cpp's architectures of gated DeltaNet layers


def _check_gemma3(spec: ModelSpec) -> None:
    """What llama.cpp's gemma3 graph assumes and its header does not say: every 6th layer global, the windowed ones'
    rotary base 10,000, the attention scaled by the head's width (the 27B's by hidden / heads), no softcaps."""
    scale = spec.hidden_size / spec.num_heads if spec.num_layers == 62 else spec.head_dim
    windowed = [i for i in range(spec.num_layers) if spec.is_local(i)]
    if spec.sliding_window and windowed != [i for i in range(spec.num_layers) if (i + 1) % GEMMA3_GLOBAL_EVERY]:
        raise ValueError(f"model: llama.cpp's gemma3 windows all but every {GEMMA3_GLOBAL_EVERY}th layer (a GGUF does "
                         f"not say it); this model windows layers {windowed}")
    if (spec.rope_local_theta or 10000.0) != 10000.0 or (spec.query_pre_attn_scalar or scale) != scale:
        raise ValueError(f"model: llama.cpp's gemma3 turns its windowed layers at base 10000 and scales attention by "
                         f"1 / sqrt({scale:g}); this model's rope_local_base_freq is {spec.rope_local_theta} and "
                         f"query_pre_attn_scalar {spec.query_pre_attn_scalar}")
    if spec.attn_logit_softcap or spec.final_logit_softcap:
        raise ValueError("model: llama.cpp's gemma3 caps no logits (Gemma 2's softcaps)")


def _full_attention_interval(spec: ModelSpec) -> int:
    """A qwen35 file's one key for its layers: attention on every n-th (the last of each n), else ValueError."""
    interval = next((i + 1 for i in range(spec.num_layers) if i not in spec.ssm_layers), spec.num_layers + 1)
    if spec.ssm_layers != tuple(i for i in range(spec.num_layers) if (i + 1) % interval):
        raise ValueError(f"model: gated DeltaNet layers {list(spec.ssm_layers)} are not all but every n-th layer, "
                         "the one pattern a qwen35 GGUF holds (full_attention_interval)")
    return interval


def _check_llama4(spec: ModelSpec) -> None:
    """llama.cpp's llama4 graph fixes what Llama 4's config says apart (models/spec.py's _gguf_llama4_fields): the
    chunks, the NoPE layers and their temperature, or (a sliding_window key of 0) none of them; and q / k L2 norms
    unless the model has 128 experts."""
    chunked = (LLAMA4_CHUNK, True, 4, tuple(i for i in range(spec.num_layers) if (i + 1) % 4 == 0),
               LLAMA4_TEMPERATURE)
    have = (spec.sliding_window, spec.chunked_window, spec.global_every, spec.nope_layers, spec.nope_temperature)
    if have not in (chunked, (0, False, 0, (), None)):
        raise ValueError(f"model: llama.cpp's llama4 has {LLAMA4_CHUNK}-token chunks on 3 of 4 layers, the fourth "
                         f"without rotary and tempered {LLAMA4_TEMPERATURE}, or none of them (a GGUF does not say "
                         f"them); this model has chunks of {spec.sliding_window}, NoPE layers "
                         f"{list(spec.nope_layers)[:4]}, temperature {spec.nope_temperature}")
    if spec.qk_l2_norm != (spec.num_experts != 128):
        raise ValueError(f"model: llama.cpp's llama4 L2-norms q and k unless a model has 128 experts (Maverick); "
                         f"this one has {spec.num_experts} experts and use_qk_norm {spec.qk_l2_norm}")


def _check_mamba2(spec: ModelSpec, arch: str) -> None:
    """What llama.cpp's Mamba-2 layers compute: a convolution with its bias, no projection biases, dt unclamped."""
    unlike = [what for what, differs in (("ssm_conv_bias false", not spec.ssm_conv_bias),
                                         ("ssm_proj_bias true", spec.ssm_proj_bias),
                                         (f"ssm_dt_limit {spec.ssm_dt_limit}", spec.ssm_dt_limit != (0.0, math.inf)))
              if differs]
    if unlike:
        raise ValueError(f"model: a {arch} GGUF has no form for {', '.join(unlike)} (llama.cpp's Mamba-2 layers: a "
                         "convolution bias, no projection biases, dt not clamped)")


# the block formats the gguf package can quantize to (its reference code; the k-quants it only reads); MXFP4 for
# the experts only, the rest kept in floats, as llama.cpp's gpt-oss files have it
BLOCK_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "MXFP4")


def _block_type(name: str | None) -> GGMLQuantizationType | None:
    if name is None:
        return None
    if name not in BLOCK_TYPES:
        raise ValueError(f"block_type: {name!r} is not one of {', '.join(BLOCK_TYPES)}")
    return GGMLQuantizationType[name]


def _header(writer: GGUFWriter, arch: str, spec: ModelSpec, cfg: ModelConfig, float16: bool,
            blocks: GGMLQuantizationType | None) -> None:
    writer.add_context_length(spec.max_position_embeddings)
    writer.add_embedding_length(spec.hidden_size)
    # Nemotron-H's blocks hold one sublayer each: the header says each block's (its KV heads, its FFN width; 0: none)
    kinds = (nemotron_h_block_kinds(spec.num_layers, spec.ssm_layers, spec.mlp_free_layers, spec.dense_layer_indices
                                    if spec.is_moe else None) if arch in ("nemotron_h", "nemotron_h_moe") else None)
    widths = {"mlp": spec.intermediate_size, "moe": spec.moe_intermediate_size}
    writer.add_block_count(len(kinds) if kinds else spec.num_layers)
    if arch != "gemma4":  # its own: one per layer (_gemma4_header)
        writer.add_feed_forward_length([widths.get(kind, 0) for kind in kinds] if kinds else spec.intermediate_size)
    writer.add_head_count(spec.num_heads)
    writer.add_layer_norm_rms_eps(spec.rms_norm_eps)
    writer.add_file_type(_file_type(float16, blocks))
    if arch == "mamba2":
        _state_space_header(writer, spec)
        return
    if arch == "gemma4":
        _gemma4_header(writer, spec, cfg)
        return
    if arch in ("granitehybrid", "lfm2", "lfm2moe"):  # attention where the per-layer KV head count is not 0
        writer.add_head_count_kv([0 if i in spec.ssm_layers else spec.num_kv_heads for i in range(spec.num_layers)])
    if kinds:  # Nemotron-H's: Mamba-2 blocks, attention without rotary, MLPs; its norms' epsilon under this key
        writer.add_head_count_kv([spec.num_kv_heads if kind == "attention" else 0 for kind in kinds])
        _state_space_header(writer, spec)
        writer.add_layer_norm_eps(spec.rms_norm_eps)
    elif arch == "granitehybrid":  # Mamba-2 layers beside the attention
        _state_space_header(writer, spec)
        # llama.cpp's switch for rotary in this architecture: Bamba's half rotary on, Granite 4.0-H's none off
        writer.add_rope_scaling_finetuned(cfg.rotary_dim > 0)
        if cfg.rotary_dim:
            writer.add_rope_dimension_count(cfg.rotary_dim)
            if cfg.rotary_dim < spec.head_dim:  # _permute_rotary's form, not the converter's (models/loader.py)
                writer.add_bool(PARTIAL_ROTARY_ROWS, True)
    elif arch in _GATED_DELTA:  # gated DeltaNet layers beside the attention, every interval-th
        _state_space_header(writer, spec)
        writer.add_full_attention_interval(_full_attention_interval(spec))
        writer.add_head_count_kv(spec.num_kv_heads)
        writer.add_rope_dimension_count(cfg.rotary_dim)
        if arch != "qwen3next":
            # llama.cpp's multimodal rotary sections (time, height, width) of the rotary pairs, as Qwen3.5's 11, 11,
            # 10 of 32: a text token's three positions are equal, so any split turns what HF's text model turns
            pairs = cfg.rotary_dim // 2
            writer.add_rope_dimension_sections([(pairs + 2) // 3, (pairs + 1) // 3, pairs // 3, 0])
    elif arch in ("lfm2", "lfm2moe"):  # short convolutions beside the attention
        writer.add_shortconv_l_cache(spec.ssm_conv_kernel)
        writer.add_vocab_size(spec.vocab_size)
        if arch == "lfm2moe":
            writer.add_leading_dense_block_count(spec.first_dense_layers)
            writer.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)
    elif spec.is_mla:
        _latent_attention_header(writer, cfg)
    else:
        writer.add_head_count_kv(spec.num_kv_heads)
    if not spec.is_mla:
        writer.add_key_length(spec.head_dim)
        writer.add_value_length(spec.head_dim)
    writer.add_rope_freq_base(spec.rope_theta)
    if spec.mrope_section:
        writer.add_rope_dimension_sections([*spec.mrope_section, 0])
    if arch.startswith("qwen3vl"):  # the image tokens' DeepStack levels (llama.cpp widens their embeddings by them)
        writer.add_num_deepstack_layers(len(spec.vision.deepstack_blocks) if spec.vision else 0)
    if (scaling := cfg.rope_scaling) is not None and scaling.kind == "longrope":
        # as llama.cpp's converter writes Phi-3's: no scaling type, the factors as tensors (_gguf_tensors)
        writer.add_rope_scaling_orig_ctx_len(scaling.original_max_positions)
        writer.add_rope_scaling_attn_factors(scaling.rotation_magnitude())
    elif scaling is not None and scaling.kind != "llama3":  # llama3's: the rope_freqs tensor
        writer.add_rope_scaling_type(RopeScalingType(scaling.kind))
        writer.add_rope_scaling_factor(scaling.factor)
        writer.add_rope_scaling_orig_ctx_len(scaling.original_max_positions)
        if scaling.kind == "yarn":
            writer.add_rope_scaling_yarn_beta_fast(scaling.beta_fast)
            writer.add_rope_scaling_yarn_beta_slow(scaling.beta_slow)
        if scaling.mscale_all_dim:  # DeepSeek's: llama.cpp's graph takes mscale to equal mscale_all_dim
            if scaling.mscale != scaling.mscale_all_dim:
                raise ValueError(f"rope_scaling: mscale {scaling.mscale} != mscale_all_dim "
                                 f"{scaling.mscale_all_dim} has no GGUF form")
            # the converter writes mistral3's as it is, deepseek2's times 0.1
            writer.add_rope_scaling_yarn_log_mul(scaling.mscale_all_dim * (1.0 if arch == "mistral3" else 0.1))
    if (temperature := cfg.attention_temperature) is not None and arch != "llama4":  # mistral3's, mistral4's
        writer.add_attn_temperature_scale(temperature.scale)
        writer.add_attn_temperature_length(temperature.length)
    if spec.sliding_window and arch in ("gpt-oss", "olmo2", "exaone4", "cohere2", "exaone-moe", "gemma3"):
        writer.add_sliding_window(spec.sliding_window)
    if spec.sliding_window and arch == "exaone-moe":
        writer.add_sliding_window_pattern(spec.global_every)
    if spec.sliding_window and arch == "olmo2":  # OLMo-3's: every n-th layer global, the rest windowed
        writer.add_sliding_window_pattern(spec.global_every)
        if cfg.rope_local_theta is not None:
            writer.add_rope_freq_base_swa(cfg.rope_local_theta)
    if spec.is_moe:
        writer.add_expert_count(spec.num_experts)
        writer.add_expert_used_count(spec.experts_per_token)
        writer.add_expert_feed_forward_length(spec.moe_intermediate_size)
        if spec.shared_expert_intermediate_size:
            writer.add_expert_shared_feed_forward_length(spec.shared_expert_intermediate_size)
        if spec.norm_topk_prob is not None:
            writer.add_expert_weights_norm(bool(spec.norm_topk_prob))
    if arch.startswith("granite"):
        writer.add_embedding_scale(cfg.embedding_multiplier)
        writer.add_residual_scale(cfg.residual_multiplier)
        writer.add_logit_scale(cfg.logits_scaling)
        if cfg.attention_multiplier is not None:
            writer.add_attention_scale(cfg.attention_multiplier)
    if arch in ("glm4moe", "minimax-m2", "phi3", "glm4"):  # part of each head rotary (GLM's, MiniMax's, Phi-4-mini's)
        writer.add_rope_dimension_count(cfg.rotary_dim)
    if arch == "phi3":  # 0: none, as the converter writes Phi-4's
        writer.add_sliding_window(spec.sliding_window)
    if arch == "minimax-m2":
        writer.add_expert_gating_func(ExpertGatingFuncType.SIGMOID)
    if arch in ("command-r", "cohere2"):  # LayerNorm's epsilon; the logits' scale (Granite's divisor inverted)
        writer.add_layer_norm_eps(spec.rms_norm_eps)
        writer.add_logit_scale(1 / cfg.logits_scaling)
    if arch == "starcoder2":
        writer.add_layer_norm_eps(spec.rms_norm_eps)
    if arch == "llama4":  # its experts' layer step; a window of 0: no chunks, NoPE or temperature (_check_llama4)
        writer.add_interleave_moe_layer_step(spec.moe_layer_step)
        if not spec.sliding_window:
            writer.add_sliding_window(0)
    if arch == "ernie4_5-moe":  # its leading dense layers, experts on every layer after, shared experts as one FFN
        writer.add_leading_dense_block_count(spec.first_dense_layers)
        writer.add_interleave_moe_layer_step(1)
        writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if arch == "glm-dsa":  # its sparse attention's indexer, every layer's own (llama.cpp's indexer type 1)
        writer.add_indexer_head_count(spec.index_heads)
        writer.add_indexer_key_length(spec.index_head_dim)
        writer.add_indexer_top_k(spec.index_topk)
        writer.add_array(f"{arch}.attention.indexer.types", [1] * spec.num_layers)
    if arch in ("deepseek2", "mistral4", "glm4moe", "dots1", "exaone-moe", "nemotron_h_moe", "glm-dsa"):
        writer.add_vocab_size(spec.vocab_size)
        writer.add_leading_dense_block_count(spec.first_dense_layers)
        writer.add_expert_shared_count(spec.shared_experts)
        writer.add_expert_weights_scale(cfg.routed_scaling_factor)
        writer.add_expert_gating_func(ExpertGatingFuncType.SIGMOID if cfg.router_scoring == "sigmoid"
                                      else ExpertGatingFuncType.SOFTMAX)
        if cfg.router_groups > 1:
            writer.add_expert_group_count(cfg.router_groups)
            writer.add_expert_group_used_count(cfg.router_topk_groups)


def _gemma4_header(writer: GGUFWriter, spec: ModelSpec, cfg: ModelConfig) -> None:
    """llama.cpp's gemma4 keys: the global layers' heads under the plain keys and the windowed ones' under the _swa
    keys, KV heads and FFN widths per layer, each layer's kind as a flag (true: windowed), the KV-shared layers'
    count and the per-layer embeddings' width; the global rotary's still pairs are the rope_freqs tensor's."""
    layers = range(spec.num_layers)
    first_shared = spec.num_layers - spec.kv_shared_layers
    writer.add_feed_forward_length([spec.intermediate_size * (2 if spec.double_wide_shared_mlp and i >= first_shared
                                                              else 1) for i in layers])
    writer.add_head_count_kv([cfg.layer_kv_heads(i) for i in layers])
    writer.add_key_length(cfg.global_head_dim or spec.head_dim)
    writer.add_value_length(cfg.global_head_dim or spec.head_dim)
    writer.add_key_length_swa(spec.head_dim)
    writer.add_value_length_swa(spec.head_dim)
    writer.add_rope_dimension_count(cfg.global_head_dim or spec.head_dim)
    writer.add_rope_dimension_count_swa(cfg.rotary_dim)
    writer.add_rope_freq_base(spec.rope_theta)
    writer.add_rope_freq_base_swa(cfg.rope_local_theta or spec.rope_theta)
    writer.add_sliding_window(spec.sliding_window)
    writer.add_sliding_window_pattern([cfg.is_local(i) for i in layers])
    writer.add_shared_kv_layers(spec.kv_shared_layers)
    writer.add_embedding_length_per_layer_input(spec.per_layer_input_size)
    if spec.final_logit_softcap:
        writer.add_final_logit_softcapping(spec.final_logit_softcap)
    if spec.is_moe:
        writer.add_expert_count(spec.num_experts)
        writer.add_expert_used_count(spec.experts_per_token)
        writer.add_expert_feed_forward_length(spec.moe_intermediate_size)


def _gemma4_tensors(cfg: ModelConfig, state: dict[str, torch.Tensor]):
    """A Gemma 4 as llama.cpp's converter writes it: q / k / v apart (no k or v on a KV-shared layer, no v where the
    keys are the values), the layer scalar as a tensor, the global rotary's still pairs as divisors of 1e30, and the
    26B-A4B's experts stacked with gate and up fused."""
    yield "token_embd.weight", state["embed_tokens.weight"]
    turning = int(cfg.global_rotary_fraction * cfg.global_rotary_dim) // 2
    yield "rope_freqs.weight", torch.tensor([1.0] * turning + [1e30] * (cfg.global_rotary_dim // 2 - turning))
    yield "output_norm.weight", state["norm.weight"]
    if "lm_head.weight" in state:
        yield "output.weight", state["lm_head.weight"]
    for name, gguf_name in (("embed_per_layer.weight", "per_layer_token_embd.weight"),
                            ("per_layer_model_projection.weight", "per_layer_model_proj.weight"),
                            ("per_layer_projection_norm.weight", "per_layer_proj_norm.weight")):
        if name in state:
            yield gguf_name, state[name]
    names = {**_LAYER_NAMES, "per_layer_gate.weight": "inp_gate.weight", "per_layer_projection.weight": "proj.weight",
             "per_layer_norm.weight": "post_norm.weight", "layer_scalar": "layer_output_scale.weight",
             "mlp.mlp_out_norm.weight": "post_ffw_norm_1.weight", "mlp.experts_in_norm.weight": "pre_ffw_norm_2.weight",
             "mlp.experts_out_norm.weight": "post_ffw_norm_2.weight", "mlp.moe.router.weight": "ffn_gate_inp.weight",
             "mlp.moe.router_input_scale": "ffn_gate_inp.scale", "mlp.moe.expert_scales": "ffn_down_exps.scale",
             "mlp.mlp.down.weight": "ffn_down.weight"}
    for i in range(cfg.num_layers):
        layer = {name.removeprefix(f"layers.{i}."): t for name, t in state.items() if name.startswith(f"layers.{i}.")}
        for name, gguf_name in names.items():
            if name in layer:
                yield f"blk.{i}.{gguf_name}", layer[name]
        q, kv = cfg.num_heads * cfg.layer_head_dim(i), cfg.layer_kv_heads(i) * cfg.layer_head_dim(i)
        qkv = layer["attn.qkv.weight"]
        yield f"blk.{i}.attn_q.weight", qkv[:q]
        for part, rows in (("k", qkv[q:q + kv]), ("v", qkv[q + kv:])):
            if len(rows):  # none on a KV-shared layer; no v where the keys are the values
                yield f"blk.{i}.attn_{part}.weight", rows
        gate, up = layer.get("mlp.gate_up.weight", layer.get("mlp.mlp.gate_up.weight")).chunk(2)
        yield f"blk.{i}.ffn_gate.weight", gate
        yield f"blk.{i}.ffn_up.weight", up
        experts = sorted({int(name.split(".")[3]) for name in layer if name.startswith("mlp.moe.experts.")})
        if experts:
            yield f"blk.{i}.ffn_gate_up_exps.weight", torch.stack(
                [layer[f"mlp.moe.experts.{e}.gate_up.weight"] for e in experts])
            yield f"blk.{i}.ffn_down_exps.weight", torch.stack(
                [layer[f"mlp.moe.experts.{e}.down.weight"] for e in experts])


def _file_type(float16: bool, blocks: GGMLQuantizationType | None) -> LlamaFileType:
    """llama.cpp's LLAMA_FTYPE_*: MOSTLY_F16, ALL_F32, or the blocks' MOSTLY_Q8_0 and the like."""
    if blocks is None:
        return LlamaFileType.MOSTLY_F16 if float16 else LlamaFileType.ALL_F32
    # MXFP4: llama.cpp's type for experts alone in blocks
    return LlamaFileType.MOSTLY_MXFP4_MOE if blocks == GGMLQuantizationType.MXFP4 else \
        LlamaFileType[f"MOSTLY_{blocks.name}"]


def _state_space_header(writer: GGUFWriter, spec: ModelSpec) -> None:
    """llama.cpp's mamba2 keys: the heads are its time_step_rank (one dt per head), their widths the inner size."""
    writer.add_ssm_conv_kernel(spec.ssm_conv_kernel)
    writer.add_ssm_inner_size(spec.ssm_inner_size)
    writer.add_ssm_state_size(spec.ssm_state_size)
    writer.add_ssm_time_step_rank(spec.ssm_num_heads)
    writer.add_ssm_group_count(spec.ssm_groups)


def _latent_attention_header(writer: GGUFWriter, cfg: ModelConfig) -> None:
    """llama.cpp's current deepseek2 form: one KV head of the latent and the rotary key, the per-head widths in
    the _mla keys (models/spec.py reads this form and the older one)."""
    rank, rope = cfg.kv_lora_rank, cfg.qk_rope_head_dim
    writer.add_head_count_kv(1)
    writer.add_key_length(rank + rope)
    writer.add_value_length(rank)
    writer.add_key_length_mla(cfg.qk_nope_head_dim + rope)
    writer.add_value_length_mla(cfg.v_head_dim)
    writer.add_kv_lora_rank(rank)
    if cfg.q_lora_rank:
        writer.add_q_lora_rank(cfg.q_lora_rank)
    writer.add_rope_dimension_count(rope)


def _copy_vocabulary(writer: GGUFWriter, source: Path, vocab_size: int) -> None:
    entries = _vocabulary(str(source), source.stat().st_mtime_ns)
    tokens = next(value for key, value, _ in entries if key == "tokenizer.ggml.tokens")
    if len(tokens) != vocab_size:
        raise ValueError(f"vocabulary: {source.name} holds {len(tokens)} tokens, the model {vocab_size}")
    for key, value, kind in entries:
        if kind is None:  # an array: its items, decoded
            writer.add_array(key, value)
        else:
            writer.add_key_value(key, value, kind)


@functools.lru_cache(maxsize=4)
def _vocabulary(source: str, mtime_ns: int) -> tuple[tuple[str, Any, GGUFValueType | None], ...]:
    """A GGUF file's tokenizer.* key-values decoded (an array's kind None), once a process for a file as it is
    (mtime_ns): gguf's reader parses a vocabulary entry by entry, and a test session writes dozens of files with one
    donor's (docs/notes/test-suite.md)."""
    reader = GGUFReader(source)
    entries = []
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        if len(field.types) > 1:
            entries.append((key, [field.contents(i) for i in range(len(field.data))], None))
        else:
            entries.append((key, field.contents(), field.types[0]))
    return tuple(entries)


def _file_tensors(cfg: ModelConfig, state: dict[str, torch.Tensor]):
    """The file's tensors: _gguf_tensors', and a Nemotron-H's layers split into its blocks (models/spec.py's
    nemotron_h_block_kinds): a layer's mixer and input norm its mixer block's (attn_norm), its MLP and post-attention
    norm its MLP block's (attn_norm there too)."""
    tensors = _gemma4_tensors(cfg, state) if cfg.architecture == "gemma4" else _gguf_tensors(cfg, state)
    if cfg.architecture != "nemotron_h":  # (its mixture too)
        yield from tensors
        return
    kinds = nemotron_h_block_kinds(cfg.num_layers, cfg.ssm_layers, cfg.mlp_free_layers)
    mixers = [block for block, kind in enumerate(kinds) if kind != "mlp"]  # layer i's mixer block: mixers[i]
    mixer_block = dict(enumerate(mixers))
    mlp_block = {layer: block + 1 for layer, block in enumerate(mixers) if layer not in cfg.mlp_free_layers}
    for name, tensor in tensors:
        match = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
        if match is None:
            yield name, tensor
            continue
        layer, rest = int(match.group(1)), match.group(2)
        if rest.startswith(("ffn_", "exp_probs_b")):  # the FFN block's (a mixture's correction bias too)
            yield f"blk.{mlp_block[layer]}.{'attn_norm.weight' if rest == 'ffn_norm.weight' else rest}", tensor
        else:
            yield f"blk.{mixer_block[layer]}.{rest}", tensor


def _gguf_tensors(cfg: ModelConfig, state: dict[str, torch.Tensor]):
    """ridge's parameters -> llama.cpp's tensors: fused q/k/v and gate/up split, experts stacked."""
    yield "token_embd.weight", state["embed_tokens.weight"]
    if cfg.rope_scaling is not None and cfg.rope_scaling.kind == "llama3":
        # llama.cpp's converter writes Llama 3.1's scaling as each frequency's divisor
        plain = RopeScaling("linear", 1.0).inverse_frequencies(cfg.rotary_dim, cfg.rope_theta)
        yield "rope_freqs.weight", plain / cfg.rope_scaling.inverse_frequencies(cfg.rotary_dim, cfg.rope_theta)
    if cfg.rope_scaling is not None and cfg.rope_scaling.kind == "longrope":  # Phi-3's, as its converter writes them
        yield "rope_factors_long.weight", torch.tensor(cfg.rope_scaling.long_factor)
        yield "rope_factors_short.weight", torch.tensor(cfg.rope_scaling.short_factor)
    final_norm = "token_embd_norm" if cfg.architecture in ("lfm2", "lfm2_moe") else "output_norm"
    yield f"{final_norm}.weight", state["norm.weight"]
    if "norm.bias" in state:  # StarCoder2's LayerNorm
        yield f"{final_norm}.bias", state["norm.bias"]
    if "lm_head.weight" in state:
        yield "output.weight", state["lm_head.weight"]
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    for i in range(cfg.num_layers):
        layer = {name.removeprefix(f"layers.{i}."): t for name, t in state.items() if name.startswith(f"layers.{i}.")}
        post_attention = cfg.architecture in ("gpt_oss", "qwen3_5", "qwen3_5_moe", "qwen3_next", "glm4_moe", "seed_oss")
        names = _POST_ATTENTION_NORM_NAMES if post_attention else _LAYER_NAMES
        for name, gguf_name in names.items():
            if name in layer:
                yield f"blk.{i}.{gguf_name}", layer[name]
        if cfg.is_mla:
            yield from _latent_attention_tensors(cfg, i, layer)
        if "ssm.A_log" in layer and cfg.state_mixer == "gated_delta":
            yield from _gated_delta_tensors(cfg, i, layer)
        elif "ssm.A_log" in layer:
            yield from _state_space_tensors(cfg, i, layer)
        elif "ssm.conv_weight" in layer:
            yield from ((f"blk.{i}.{gguf_name}", layer[name]) for name, gguf_name in _SHORT_CONV_NAMES.items()
                        if name in layer)
        if cfg.architecture == "phi3":  # its q / k / v kept fused
            yield f"blk.{i}.attn_qkv.weight", layer.pop("attn.qkv.weight")
        ungated = not cfg.gated_mlp or cfg.hidden_act == "relu2"
        if (cfg.architecture in ("phi3", "glm4") or ungated) and "mlp.gate_up.weight" in layer:
            # gate / up kept fused: llama.cpp's ffn_up holds both (an ungated MLP's: up alone)
            yield f"blk.{i}.ffn_up.weight", layer.pop("mlp.gate_up.weight")
            if "mlp.gate_up.bias" in layer:  # StarCoder2's
                yield f"blk.{i}.ffn_up.bias", layer.pop("mlp.gate_up.bias")
        for kind in ("weight", "bias"):
            if (fused := layer.get(f"attn.qkv.{kind}")) is not None:
                queries = fused[:q]
                if cfg.attention_output_gate:  # each head's query rows then its gate's, as in the checkpoint
                    queries = torch.stack([queries.unflatten(0, (cfg.num_heads, -1)),
                                           fused[q + 2 * kv:].unflatten(0, (cfg.num_heads, -1))], 1).flatten(0, 2)
                for part, rows, heads in (("q", queries, cfg.num_heads), ("k", fused[q:q + kv], cfg.num_kv_heads),
                                          ("v", fused[q + kv:q + 2 * kv], None)):
                    if heads and (cfg.architecture in (*ROTARY_PERMUTED, "bamba", "mistral") or cfg.rope_interleave):
                        # llama's and Bamba's rows as llama.cpp's converter permutes them; GLM-4's, Ernie's and
                        # Cohere's as their checkpoints pair them (llama.cpp turns pairs there)
                        rows = _permute_rotary(rows, heads, cfg.rotary_dim)
                    yield f"blk.{i}.attn_{part}.{kind}", rows
        for prefix, suffix in (("mlp.", ""), ("mlp.shared_expert.", "_shexp")):
            if (gate_up := layer.get(f"{prefix}gate_up.weight")) is not None and cfg.hidden_act == "relu2":
                yield f"blk.{i}.ffn_up{suffix}.weight", gate_up  # ungated: up alone
            elif gate_up is not None:
                gate, up = gate_up.chunk(2)
                yield f"blk.{i}.ffn_gate{suffix}.weight", gate
                yield f"blk.{i}.ffn_up{suffix}.weight", up
        if "mlp.shared_expert_gate.weight" in layer:
            yield f"blk.{i}.ffn_gate_inp_shexp.weight", layer["mlp.shared_expert_gate.weight"].flatten()
        experts = sorted({int(name.split(".")[2]) for name in layer if name.startswith("mlp.experts.")})
        for kind in ("weight", "bias") if experts else ():
            if f"mlp.experts.0.down.{kind}" not in layer:
                continue
            gate_up = torch.stack([layer[f"mlp.experts.{e}.gate_up.{kind}"] for e in experts])
            if cfg.hidden_act == "relu2":  # ungated experts (Nemotron-H's): up alone
                yield f"blk.{i}.ffn_up_exps.{kind}", gate_up
            else:
                yield f"blk.{i}.ffn_gate_exps.{kind}", gate_up[:, :cfg.moe_intermediate_size]
                yield f"blk.{i}.ffn_up_exps.{kind}", gate_up[:, cfg.moe_intermediate_size:]
            yield f"blk.{i}.ffn_down_exps.{kind}", torch.stack([layer[f"mlp.experts.{e}.down.{kind}"] for e in experts])


def _state_space_tensors(cfg: ModelConfig, i: int, layer: dict[str, torch.Tensor]):
    """A Mamba-2 mixer as llama.cpp's converter writes it: A itself (-exp(A_log)), A and D as [heads, 1], the
    gated norm's weight as [groups, its width a group]."""
    for name, gguf_name in _SSM_NAMES.items():
        if name in layer:
            yield f"blk.{i}.{gguf_name}", layer[name].reshape(-1, 1) if name == "ssm.D" else layer[name]
    yield f"blk.{i}.ssm_a", -torch.exp(layer["ssm.A_log"].float()).reshape(-1, 1)
    yield f"blk.{i}.ssm_norm.weight", layer["ssm.norm_weight"].reshape(cfg.ssm_groups, -1)


def _gated_delta_tensors(cfg: ModelConfig, i: int, layer: dict[str, torch.Tensor]):
    """A gated DeltaNet as llama.cpp's converter writes it: in_proj's parts, A itself (-exp(A_log)), and for qwen35
    the value heads in llama.cpp's tiled order (value head j reading query / key head j % groups, where HF's
    grouped order has j // (heads / groups)): their rows of q k v and of the convolution, of z, b and a, their
    dt_bias and A, and their columns of out_proj. A qwen3next file keeps HF's grouped order, b and a fused as
    ssm_ba, key head by key head (HF's in_proj_ba)."""
    heads, width, inner = cfg.ssm_num_heads, cfg.ssm_head_dim, cfg.ssm_inner_size
    keys = cfg.ssm_conv_channels - inner  # q's and k's channels, before v's
    grouped = cfg.architecture == "qwen3_next"
    order = torch.arange(heads)  # the file's head j is the model's head order[j]
    if not grouped and not cfg.ssm_heads_tiled:  # tiled j holds grouped head (j % groups) * per_group + j // groups
        order = order.view(cfg.ssm_groups, -1).T.flatten()
    elif grouped and cfg.ssm_heads_tiled:  # grouped g * per_group + r holds tiled head r * groups + g
        order = order.view(-1, cfg.ssm_groups).T.flatten()

    def in_order(rows: torch.Tensor) -> torch.Tensor:  # rows of per-head blocks, the blocks in the file's order
        return rows.unflatten(0, (heads, -1))[order].flatten(0, 1)

    qkv, z, b, a = layer["ssm.in_proj.weight"].split([cfg.ssm_conv_channels, inner, heads, heads])
    conv = layer["ssm.conv_weight"]
    yield f"blk.{i}.attn_qkv.weight", torch.cat([qkv[:keys], in_order(qkv[keys:])])
    yield f"blk.{i}.attn_gate.weight", in_order(z)
    if grouped:
        yield f"blk.{i}.ssm_ba.weight", torch.cat([in_order(b).unflatten(0, (cfg.ssm_groups, -1)),
                                                   in_order(a).unflatten(0, (cfg.ssm_groups, -1))], 1).flatten(0, 1)
    else:
        yield f"blk.{i}.ssm_beta.weight", in_order(b)
        yield f"blk.{i}.ssm_alpha.weight", in_order(a)
    yield f"blk.{i}.ssm_conv1d.weight", torch.cat([conv[:keys], in_order(conv[keys:])])
    yield f"blk.{i}.ssm_dt.bias", layer["ssm.dt_bias"][order]
    yield f"blk.{i}.ssm_a", -torch.exp(layer["ssm.A_log"].float())[order]
    yield f"blk.{i}.ssm_norm.weight", layer["ssm.norm_weight"]
    out = layer["ssm.out_proj.weight"]
    yield f"blk.{i}.ssm_out.weight", out.unflatten(1, (heads, width))[:, order].flatten(1)


def _permute_rotary(rows: torch.Tensor, heads: int, rotary_dim: int) -> torch.Tensor:
    """llama.cpp's row order for llama q / k, whose rotary turns interleaved pairs: each head's first rotary_dim
    rows from halves to pairs (loader._unpermute_rotary's inverse), the rest as they are. (For Bamba's half rotary
    llama.cpp's converter permutes whole heads, which turns other pairs than HF's model does; the rotary rows alone
    give llama.cpp HF's model: docs/notes/ssm.md.)"""
    per_head = rows.reshape(heads, rows.shape[0] // heads, *rows.shape[1:])
    turned = per_head[:, :rotary_dim].reshape(heads, 2, rotary_dim // 2, *rows.shape[1:]).swapaxes(1, 2)
    return torch.cat([turned.reshape(heads, rotary_dim, *rows.shape[1:]), per_head[:, rotary_dim:]], 1).reshape(
        rows.shape)


def _latent_attention_tensors(cfg: ModelConfig, i: int, layer: dict[str, torch.Tensor]):
    """MLA's projections as llama.cpp's converter writes them: the query's and kv_a's rotary rows back in the
    checkpoint's interleaved pairs (loader._deinterleave_rotary's inverse), kv_b split per head into k_b
    [heads, rank, nope] (transposed) and v_b [heads, v_head_dim, rank]."""
    nope = cfg.qk_nope_head_dim
    for name, gguf_name in (("q_proj", "attn_q"), ("q_b", "attn_q_b"), ("kv_a", "attn_kv_a_mqa")):
        if (rows := layer.get(f"attn.{name}.weight")) is not None:
            yield f"blk.{i}.{gguf_name}.weight", rows[latent_rotary_order(cfg, name, rows.shape[0], to_halves=False)]
    kv_b = layer["attn.kv_b"].view(cfg.num_heads, nope + cfg.v_head_dim, cfg.kv_lora_rank)
    yield f"blk.{i}.attn_k_b.weight", kv_b[:, :nope].transpose(1, 2)
    yield f"blk.{i}.attn_v_b.weight", kv_b[:, nope:]
    if cfg.index_topk:  # the indexer's query and key rows (the key norm's dims with them) in interleaved pairs
        order = indexer_rotary_orders(cfg, to_halves=False)
        for name, gguf_name in (("wq_b.weight", "attn_q_b.weight"), ("wk.weight", "attn_k.weight"),
                                ("k_norm.weight", "k_norm.weight"), ("k_norm.bias", "k_norm.bias")):
            yield f"blk.{i}.indexer.{gguf_name}", layer[f"attn.indexer.{name}"][order[name]]
        yield f"blk.{i}.indexer.proj.weight", layer["attn.indexer.weights_proj.weight"]
