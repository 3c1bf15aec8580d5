"""An HF vision-language checkpoint's vision tower written as llama.cpp's multimodal projector file (mmproj GGUF).

What llama.cpp's converter (convert_hf_to_gguf.py --mmproj) writes for Qwen2-VL, Qwen2.5-VL, Gemma 3 and Mistral 3,
so that a tower with no published GGUF here (a random one of a test, a benchmark's shape) runs from the files a
llama.cpp user has: the header keys under `clip.vision.*`, the processor's mean and deviation, and the tensors under
the names of the gguf package's own table (TensorNameMap of MODEL_ARCH.MMPROJ), with the converter's changes: Qwen's
fused q / k / v cut in three and its two-frame patch kernel in two, Gemma 3's projector norm stored as the 1 + w it
multiplies by, Pixtral's q / k rows permuted as llama's and its [IMG_BREAK] embedding copied in.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from gguf import MODEL_ARCH, GGUFType, GGUFWriter, VisionProjectorType, get_tensor_name_map
from safetensors import safe_open

from ridge.models.mmproj import QWEN2_5_VL_WINDOW
from ridge.models.spec import spec_from_hf_config
from ridge.multimodal.images import ImageProcessing

# an HF model_type -> its projector type
PROJECTOR_TYPES = {"qwen2_vl": VisionProjectorType.QWEN2VL, "qwen2_5_vl": VisionProjectorType.QWEN25VL,
                   "qwen3_vl": VisionProjectorType.QWEN3VL, "qwen3_vl_moe": VisionProjectorType.QWEN3VL,
                   "gemma3": VisionProjectorType.GEMMA3, "mistral3": VisionProjectorType.PIXTRAL}
_TOWER_PREFIXES = ("visual.", "vision_tower.", "multi_modal_projector.")


def write_mmproj(folder: Path, path: Path, float16: bool = False) -> Path:
    """The tower of the HF folder `folder` (config.json, safetensors, preprocessor_config.json) as a projector file
    at `path`, in float32 (or float16: the converter's default for matrices)."""
    config = json.loads((folder / "config.json").read_text())
    kind = config.get("model_type")
    if kind not in PROJECTOR_TYPES:
        raise ValueError(f"model: writing an mmproj of {kind!r} is not supported ({', '.join(PROJECTOR_TYPES)})")
    vision, text = config["vision_config"], config.get("text_config") or config
    # the processor as ridge reads the folder (its preprocessor_config.json, or the family's HF defaults where it has
    # none): what the converter copies from a checkpoint's preprocessor_config.json, which the published ones all have
    processing = ImageProcessing.of_model(folder, spec_from_hf_config(config, folder.name).vision)
    depth = vision.get("depth", vision.get("num_hidden_layers"))
    writer = GGUFWriter(str(path), "clip")
    writer.add_type(GGUFType.MMPROJ)
    writer.add_clip_has_vision_encoder(True)
    writer.add_clip_projector_type(PROJECTOR_TYPES[kind])
    writer.add_vision_projection_dim(text["hidden_size"])
    writer.add_vision_block_count(depth)
    writer.add_vision_head_count(vision.get("num_heads", vision.get("num_attention_heads")))
    writer.add_vision_patch_size(vision.get("patch_size", 14))
    writer.add_vision_image_mean(list(processing.mean))
    writer.add_vision_image_std(list(processing.std))
    if kind.startswith("qwen3_vl"):
        writer.add_vision_embedding_length(vision["hidden_size"])
        writer.add_vision_feed_forward_length(vision["intermediate_size"])
        side = int(vision.get("num_position_embeddings", 2304) ** 0.5)  # the converter's image size: the table's
        writer.add_vision_image_size(side * vision.get("patch_size", 16))
        writer.add_vision_attention_layernorm_eps(text.get("rms_norm_eps", 1e-6))
        writer.add_vision_use_gelu(True)
        writer.add_vision_spatial_merge_size(vision.get("spatial_merge_size", 2))
        deep = vision.get("deepstack_visual_indexes") or []
        writer.add_vision_is_deepstack_layers([i in deep for i in range(depth)])
    elif kind == "mistral3":
        writer.add_vision_embedding_length(vision["hidden_size"])
        writer.add_vision_feed_forward_length(vision["intermediate_size"])
        writer.add_vision_image_size(vision["image_size"])
        writer.add_vision_attention_layernorm_eps(vision.get("layer_norm_eps", 1e-5))
        act = vision.get("hidden_act", "silu")
        if act not in ("silu", "gelu"):  # the two the converter writes (and llama.cpp runs)
            raise ValueError(f"vision_config.hidden_act: {act!r} has no form in a pixtral mmproj (silu, gelu)")
        writer.add_vision_use_silu(True) if act == "silu" else writer.add_vision_use_gelu(True)
        writer.add_vision_spatial_merge_size(config.get("spatial_merge_size", 2))
    elif kind == "gemma3":
        writer.add_vision_embedding_length(vision["hidden_size"])
        writer.add_vision_feed_forward_length(vision["intermediate_size"])
        writer.add_vision_image_size(vision["image_size"])
        writer.add_vision_attention_layernorm_eps(vision.get("layer_norm_eps", 1e-6))
        writer.add_vision_use_gelu(True)
        pooling = (vision["image_size"] // vision["patch_size"]) // int(config.get("mm_tokens_per_image", 256) ** 0.5)
        if pooling != 4:  # the converter writes it only where it is not llama.cpp's default
            writer.add_vision_projector_scale_factor(pooling)
    else:
        # the converter's renames: Qwen2-VL's embed_dim is the tower's width, and its hidden_size (the merger's
        # output) lands in feed_forward_length
        writer.add_vision_embedding_length(vision.get("embed_dim", vision.get("hidden_size")))
        writer.add_vision_feed_forward_length(vision["hidden_size"] if "embed_dim" in vision
                                              else vision["intermediate_size"])
        writer.add_vision_image_size(vision.get("image_size", 560))
        writer.add_vision_attention_layernorm_eps(text.get("rms_norm_eps", 1e-6))
    if kind.startswith("qwen"):  # the processor's pixel budget, under the gguf package's keys
        writer.add_vision_min_pixels(processing.min_pixels)
        writer.add_vision_max_pixels(processing.max_pixels)
    if kind == "qwen2_5_vl":
        writer.add_vision_use_silu(True)
        full = vision["fullatt_block_indexes"]
        pattern = full[0] + 1
        if any(b - a != pattern for a, b in zip(full, full[1:], strict=False)):
            raise ValueError(f"vision_config.fullatt_block_indexes {full}: not every n-th block (llama.cpp's "
                             "n_wa_pattern)")
        writer.add_vision_n_wa_pattern(pattern)
        if vision.get("window_size", QWEN2_5_VL_WINDOW) != QWEN2_5_VL_WINDOW:
            # the converter writes none: llama.cpp assumes every published checkpoint's; a test's smaller tower
            # says its own under the gguf package's key for it
            writer.add_vision_window_size(vision["window_size"])
    # (the table's numbered names run to its block count: the merger's mm.2 needs three, whatever the depth)
    names = get_tensor_name_map(MODEL_ARCH.MMPROJ, max(depth, 3))
    for name, tensor in _tower_tensors(folder, config):
        name = name if name.startswith("v.") else names.get_name(name, try_suffixes=(".weight", ".bias")) or _unmapped(
            name)
        data = tensor.float()
        if float16 and data.ndim >= 2 and not name.startswith("v.position_embd"):  # (llama.cpp adds it in float32)
            data = data.half()
        writer.add_tensor(name, data.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _tower_tensors(folder: Path, config: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tower tensors under the converter's HF names (HF transformers 5's `model.` prefix dropped),
    changed as the converter changes them (Pixtral's q / k rows permuted as llama's, its [IMG_BREAK] embedding
    copied from the language model's)."""
    kind, heads = config["model_type"], config["vision_config"].get("num_attention_heads")
    deepstack = config["vision_config"].get("deepstack_visual_indexes") or []
    img_break = _token_id(folder, "[IMG_BREAK]") if kind == "mistral3" else None
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), "pt") as handle:
            for stored in handle.keys():  # noqa: SIM118 - safe_open is not a dict
                name = stored.removeprefix("model.")
                if img_break is not None and name.endswith("embed_tokens.weight"):
                    yield "v.token_embd.img_break", handle.get_tensor(stored)[img_break]  # (llama.cpp: no suffix)
                if not name.startswith(_TOWER_PREFIXES):
                    continue
                if kind == "gemma3" and name.startswith("vision_tower.") and ".vision_model." not in name:
                    name = name.replace("vision_tower.", "vision_tower.vision_model.", 1)  # as published
                if name.startswith("vision_tower.vision_model.head."):  # SigLIP's pooling head, which Gemma 3 skips
                    continue
                tensor = handle.get_tensor(stored)
                if kind.startswith("qwen3_vl") and (renamed := _qwen3_name(name, deepstack)):
                    yield renamed, tensor  # its mergers and patch bias, named by the converter itself
                    continue
                if kind == "mistral3" and name.endswith(("attention.q_proj.weight", "attention.k_proj.weight")):
                    # each head's rotary halves interleaved, as llama.cpp's converter permutes llama's
                    tensor = tensor.reshape(heads, 2, -1, tensor.shape[-1]).transpose(1, 2).reshape(tensor.shape)
                if ".qkv." in name and not kind.startswith("qwen3_vl"):  # q, k, v as three (Qwen3-VL's fused)
                    for part, rows in zip("qkv", tensor.chunk(3), strict=True):
                        yield name.replace(".qkv.", f".{part}."), rows
                elif name.endswith("patch_embed.proj.weight"):  # a 2-frame Conv3d as two Conv2d kernels
                    yield "v.patch_embd.weight", tensor[:, :, 0]
                    yield "v.patch_embd.weight.1", tensor[:, :, 1]
                elif name.endswith("mm_soft_emb_norm.weight"):  # Gemma's norm multiplies by 1 + w
                    yield name, tensor.float() + 1
                else:
                    yield name.replace("_weight", ".weight"), tensor


def _qwen3_name(name: str, deepstack: list[int]) -> str | None:
    """Qwen3-VL's tensors the converter names itself: the merger (norm -> v.post_ln, linear_fc1 / 2 -> mm.0 / 2), each
    DeepStack merger under the index of the block it follows, the patch embedding's bias; None for the others."""
    parts = {"norm": "norm", "linear_fc1": "fc1", "linear_fc2": "fc2"}
    if match := re.fullmatch(r"visual\.merger\.(norm|linear_fc1|linear_fc2)\.(weight|bias)", name):
        part, kind = match.groups()
        return f"v.post_ln.{kind}" if part == "norm" else f"mm.{0 if part == 'linear_fc1' else 2}.{kind}"
    deep = r"visual\.deepstack_merger_list\.(\d+)\.(norm|linear_fc1|linear_fc2)\.(weight|bias)"
    if match := re.fullmatch(deep, name):
        k, part, kind = match.groups()
        return f"v.deepstack.{deepstack[int(k)]}.{parts[part]}.{kind}"
    return "v.patch_embd.bias" if name == "visual.patch_embed.proj.bias" else None


def _token_id(folder: Path, token: str) -> int:
    """A special token's id in the folder's tokenizer.json."""
    added = json.loads((folder / "tokenizer.json").read_text()).get("added_tokens", [])
    found = next((t["id"] for t in added if t["content"] == token), None)
    if found is None:
        raise ValueError(f"{folder}: tokenizer.json has no {token} token")
    return int(found)


def _unmapped(name: str) -> str:
    raise ValueError(f"{name}: no name for it in the gguf package's projector table")
